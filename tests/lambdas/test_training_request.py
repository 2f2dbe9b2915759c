"""The CreateTrainingJob request: its content, and botocore's validation of it (moto answers)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from lambdas.core.job_spec import validate_job_spec
from lambdas.core.training_request import LaunchSettings, RequestError, checkpoint_uri, create_training_job_request, job_name
from training.hyperparameters import CODE_CHANNEL, PlatformSettings, build
from training.metrics import metric_line, parse_metric_line
from training.trainers.config import VisionConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SETTINGS = LaunchSettings(
    image_uris={"pytorch": "123456789012.dkr.ecr.us-east-1.amazonaws.com/training-pytorch:abc"},
    role_arn="arn:aws:iam::123456789012:role/training-sagemaker",
    output_s3_uri="s3://results-bucket/artifacts/",
    checkpoint_s3_uri="s3://results-bucket/checkpoints/",
    control_s3_uri="s3://results-bucket/control/",
    tags={"platform": "heterogeneous-training"},
)


def request_for(example: str) -> dict:
    spec = validate_job_spec(json.loads((EXAMPLES / example).read_text()))
    return create_training_job_request(spec, SETTINGS, name=job_name("hetero", spec.run_name, "ab12cd34ef"), run_id="run-0001")


def test_heterogeneous_spec_uses_instance_groups_and_routes_the_channel() -> None:
    request = request_for("pytorch-heterogeneous.json")
    resources = request["ResourceConfig"]
    assert "InstanceType" not in resources and "InstanceCount" not in resources
    assert [g["InstanceGroupName"] for g in resources["InstanceGroups"]] == ["data_group", "dnn_group"]
    source = request["InputDataConfig"][0]["DataSource"]["S3DataSource"]
    assert source["InstanceGroupNames"] == ["data_group"]


def test_the_token_travels_in_the_platform_channel_to_every_host_and_nowhere_else() -> None:
    """DescribeTrainingJob shows hyperparameters to anyone who may describe the job, and every poll's
    history event holds its answer: the token is in no field of the request, only behind the channel's
    S3 prefix, which reaches every group."""
    for example, groups in (("pytorch-heterogeneous.json", ["data_group", "dnn_group"]), ("pytorch-homogeneous.json", None)):
        request = request_for(example)
        assert "token" not in json.dumps(request["HyperParameters"]).lower()
        (platform,) = [c for c in request["InputDataConfig"] if c["ChannelName"] == "platform"]
        source = platform["DataSource"]["S3DataSource"]
        assert source["S3Uri"] == "s3://results-bucket/control/hetero-" + json.loads((EXAMPLES / example).read_text())["run_name"] + "-ab12cd34ef/"
        assert source.get("InstanceGroupNames") == groups


def test_single_group_spec_is_a_classic_homogeneous_job() -> None:
    request = request_for("pytorch-homogeneous.json")
    assert request["ResourceConfig"]["InstanceType"] == "ml.p3.2xlarge" and "InstanceGroups" not in request["ResourceConfig"]
    assert "InstanceGroupNames" not in request["InputDataConfig"][0]["DataSource"]["S3DataSource"]
    assert json.loads(request["HyperParameters"]["role_map"]) == {"homogeneousCluster": "dnn"}


def test_the_container_reads_back_exactly_what_the_request_carries() -> None:
    request = request_for("pytorch-heterogeneous.json")
    hyperparameters = request["HyperParameters"]
    assert all(isinstance(value, str) for value in hyperparameters.values())
    platform = build(PlatformSettings, {k: v for k, v in hyperparameters.items() if k in PlatformSettings.__dataclass_fields__})
    assert dict(platform.role_map) == {"data_group": "data", "dnn_group": "dnn"}
    config = build(VisionConfig, {k: v for k, v in hyperparameters.items() if k in VisionConfig.__dataclass_fields__})
    assert config.augment == "heavy"


def test_metric_definitions_capture_the_trainers_lines() -> None:
    definitions = {d["Name"]: d["Regex"] for d in request_for("pytorch-heterogeneous.json")["AlgorithmSpecification"]["MetricDefinitions"]}
    assert parse_metric_line("step=9/40 loss=0.5 step_time_ms=86.1 data_wait_ms=1.0 samples_per_s=371.7")["step_time_ms"] == 86.1
    assert set(definitions) == {"step_time_ms", "data_wait_ms", "samples_per_s", "loss", "warmup_ms", "eval_accuracy"}
    # A diverging run's lines are its evidence: non-finite values are captured, not dropped (the job's own
    # regexes, as SageMaker applies them to each log line).
    line = metric_line(7, 20, {"loss": float("nan"), "eval_accuracy": float("inf"), "step_time_ms": 86.1, "data_wait_ms": 1.5e-3})
    captured = {name: re.search(regex, line).group(1) for name, regex in definitions.items() if re.search(regex, line)}
    assert captured == {"loss": "nan", "eval_accuracy": "inf", "step_time_ms": "86.1", "data_wait_ms": "0.0"}
    assert math.isnan(parse_metric_line("step=7/20 loss=nan")["loss"]) and parse_metric_line("loss=-inf warmup_ms=2e+03") == {
        "loss": -math.inf, "warmup_ms": 2000.0}


def test_checkpoints_are_per_run_name_and_the_job_name_per_execution() -> None:
    request = request_for("pytorch-heterogeneous.json")
    # The run's own checkpoints (two runs of one spec share none); resuming names the earlier run.
    assert request["CheckpointConfig"] == {"S3Uri": "s3://results-bucket/checkpoints/run-0001/", "LocalPath": "/opt/ml/checkpoints"}
    resumed = validate_job_spec(json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text()) | {"resume_from": "run-0000"})
    carried_on = create_training_job_request(resumed, SETTINGS, name="hetero-vision-hetero-ab12cd34ef", run_id="run-0001")
    assert carried_on["CheckpointConfig"]["S3Uri"] == checkpoint_uri(SETTINGS, "run-0001")  # writes only its own
    (resume,) = [c for c in carried_on["InputDataConfig"] if c["ChannelName"] == "resume"]
    assert resume["DataSource"]["S3DataSource"]["S3Uri"] == "s3://results-bucket/checkpoints/run-0000/"
    # Only the DNN group downloads the checkpoints, even when the spec routes no channel: then every
    # channel is routed (SageMaker takes all or none), the unrouted ones to every group.
    unrouted = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    unrouted["inputs"] = {"train": {"s3_uri": "s3://datasets-bucket/images/"}}
    unrouted["instance_groups"][0]["role"], unrouted["instance_groups"][1]["role"] = "data", "dnn"
    routed = create_training_job_request(validate_job_spec(unrouted | {"resume_from": "run-0000"}), SETTINGS, name="hetero-x-ab12cd34ef",
                                         run_id="run-0001")
    routes = {c["ChannelName"]: c["DataSource"]["S3DataSource"].get("InstanceGroupNames") for c in routed["InputDataConfig"]}
    assert routes == {"train": ["data_group", "dnn_group"], "platform": ["data_group", "dnn_group"], "resume": ["dnn_group"]}
    assert request["TrainingJobName"] == "hetero-vision-hetero-ab12cd34ef"
    assert len(job_name("platform10", "a" * 40, "x" * 10)) == 62
    # Never cut: cut, the suffix (the execution's hash) would go, and two executions share one job.
    with pytest.raises(RequestError, match="not a valid training job name"):
        job_name("platform10", "a" * 42, "x" * 10)
    with pytest.raises(RequestError):
        job_name("hetero", "run", "bad_suffix")


def test_a_variant_without_an_image_is_refused() -> None:
    spec = validate_job_spec(json.loads((EXAMPLES / "pytorch-homogeneous.json").read_text()))
    settings = LaunchSettings(image_uris={}, role_arn=SETTINGS.role_arn, output_s3_uri="s3://datasets-bucket/", checkpoint_s3_uri="s3://datasets-bucket/c/")
    with pytest.raises(RequestError, match="no training image is deployed for variant 'pytorch'"):
        create_training_job_request(spec, settings, name="x", run_id="run-0001")


@pytest.mark.parametrize("example", ["pytorch-heterogeneous.json", "pytorch-homogeneous.json"])
def test_requests_pass_botocore_validation(example: str) -> None:
    request = request_for(example)
    with mock_aws():
        client = boto3.client("sagemaker", region_name="us-east-1")
        client.create_training_job(**request)  # botocore validates every parameter against the API model
        described = client.describe_training_job(TrainingJobName=request["TrainingJobName"])
    assert described["TrainingJobName"] == request["TrainingJobName"]
    assert described["HyperParameters"] == request["HyperParameters"]


def test_botocore_validation_is_really_applied() -> None:
    from botocore.exceptions import ParamValidationError

    request = request_for("pytorch-heterogeneous.json")
    request["ResourceConfig"]["InstanceGroups"][0]["InstanceCount"] = "1"
    with mock_aws(), pytest.raises(ParamValidationError, match="InstanceCount"):
        boto3.client("sagemaker", region_name="us-east-1").create_training_job(**request)


@pytest.mark.parametrize(("example", "cores"), [("neuron-trn1-2xlarge.json", "2"), ("neuron-trn1-32xlarge.json", "32")])
def test_trainium_requests_run_one_process_per_neuroncore_with_a_shared_compile_cache(example: str, cores: str) -> None:
    settings = LaunchSettings(
        image_uris={"neuron": "123456789012.dkr.ecr.us-east-1.amazonaws.com/training-neuron:abc"}, role_arn=SETTINGS.role_arn,
        output_s3_uri="s3://results-bucket/artifacts/", checkpoint_s3_uri="s3://results-bucket/checkpoints/",
        neuron_cache_s3_uri="s3://results-bucket/neuron-cache/", control_s3_uri="s3://results-bucket/control/",
    )
    spec = validate_job_spec(json.loads((EXAMPLES / example).read_text()))
    request = create_training_job_request(spec, settings, name=job_name("hetero", spec.run_name, "ab12cd34ef"), run_id="run-0001")
    hyperparameters = request["HyperParameters"]
    assert hyperparameters["processes_per_host"] == cores and hyperparameters["variant"] == "neuron"
    assert hyperparameters["neuron_compile_cache_uri"] == "s3://results-bucket/neuron-cache/"
    assert request["ResourceConfig"]["InstanceType"].startswith("ml.trn1.")
    with mock_aws():
        boto3.client("sagemaker", region_name="us-east-1").create_training_job(**request)


def test_gpu_requests_leave_the_process_count_to_the_host() -> None:
    hyperparameters = request_for("pytorch-heterogeneous.json")["HyperParameters"]
    assert hyperparameters["processes_per_host"] == "0" and hyperparameters["neuron_compile_cache_uri"] == ""


@pytest.mark.parametrize(("input_mode", "distribution", "mode", "s3_distribution"), [
    ("file", "replicated", "File", "FullyReplicated"),
    ("fastfile", "replicated", "FastFile", "FullyReplicated"),
    ("file", "sharded", "File", "ShardedByS3Key"),
    ("fastfile", "sharded", "FastFile", "ShardedByS3Key"),
])
def test_each_input_mode_and_distribution_reaches_the_request_and_passes_botocore(
    input_mode: str, distribution: str, mode: str, s3_distribution: str
) -> None:
    raw = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    raw["inputs"]["train"] |= {"input_mode": input_mode, "distribution": distribution}
    spec = validate_job_spec(raw)
    request = create_training_job_request(spec, SETTINGS, name=job_name("hetero", spec.run_name, "ab12cd34ef"), run_id="run-0001")
    train = next(channel for channel in request["InputDataConfig"] if channel["ChannelName"] == "train")
    assert train["InputMode"] == mode and train["DataSource"]["S3DataSource"]["S3DataDistributionType"] == s3_distribution
    platform = next(channel for channel in request["InputDataConfig"] if channel["ChannelName"] == "platform")
    assert platform["InputMode"] == "File" and platform["DataSource"]["S3DataSource"]["S3DataDistributionType"] == "FullyReplicated"
    with mock_aws():
        boto3.client("sagemaker", region_name="us-east-1").create_training_job(**request)  # botocore validates it


SHA = "ab" * 32
CODE = f"s3://results-bucket/code/{SHA}/sourcedir.tar.gz"


def user_request(example: str, workload: dict | None = None, **changes: object) -> dict:
    raw = json.loads((EXAMPLES / example).read_text()) | {"hyperparameters": {"steps": 100, "hidden": 64}} | changes
    raw["workload"] = workload or {"code": CODE, "sha256": SHA, "module": "my_pkg.train", "requirements": "requirements.txt"}
    spec = validate_job_spec(raw)
    return create_training_job_request(spec, SETTINGS, name=job_name("hetero", spec.run_name, "ab12cd34ef"), run_id="run-0001")


def channels(request: dict) -> dict[str, dict]:
    return {channel["ChannelName"]: channel for channel in request["InputDataConfig"]}


def test_a_user_workloads_code_channel_reaches_every_group_of_a_heterogeneous_job() -> None:
    """SageMaker routes channels all or none: the code, like the token, goes to every group (data hosts
    import the module too), as the one archive object, copied before the launcher starts."""
    request = user_request("pytorch-heterogeneous.json")
    code = channels(request)[CODE_CHANNEL]
    assert code == {"ChannelName": "code", "InputMode": "File", "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": CODE, "S3DataDistributionType": "FullyReplicated", "InstanceGroupNames": ["data_group", "dnn_group"]}}}
    assert channels(request)["train"]["DataSource"]["S3DataSource"]["InstanceGroupNames"] == ["data_group"]
    # A resuming run routes every channel (its checkpoints go to the DNN group alone): the code still to all.
    resumed = channels(user_request("pytorch-heterogeneous.json", resume_from="run-0000"))
    assert resumed[CODE_CHANNEL]["DataSource"]["S3DataSource"]["InstanceGroupNames"] == ["data_group", "dnn_group"]
    assert resumed["resume"]["DataSource"]["S3DataSource"]["InstanceGroupNames"] == ["dnn_group"]


def test_a_homogeneous_user_workload_gets_its_code_channel_unrouted() -> None:
    request = user_request("pytorch-homogeneous.json")
    source = channels(request)[CODE_CHANNEL]["DataSource"]["S3DataSource"]
    assert source["S3Uri"] == CODE and "InstanceGroupNames" not in source
    assert CODE_CHANNEL not in channels(request_for("pytorch-homogeneous.json"))  # a built-in has none


def test_a_user_workloads_module_hash_and_requirements_travel_as_platform_settings() -> None:
    hyperparameters = user_request("pytorch-heterogeneous.json")["HyperParameters"]
    platform = build(PlatformSettings, {k: v for k, v in hyperparameters.items() if k in PlatformSettings.__dataclass_fields__})
    assert (platform.workload_module, platform.workload_sha256, platform.workload_requirements) == ("my_pkg.train", SHA, "requirements.txt")
    assert hyperparameters["hidden"] == "64" and hyperparameters["steps"] == "100"  # the module's own beside the loop's
    builtin = request_for("pytorch-heterogeneous.json")["HyperParameters"]
    assert builtin.get("workload_module", "") == "" and builtin.get("workload_sha256", "") == ""


def test_a_user_workloads_request_passes_botocore_validation() -> None:
    for example in ("pytorch-heterogeneous.json", "pytorch-homogeneous.json"):
        request = user_request(example)
        with mock_aws():
            client = boto3.client("sagemaker", region_name="us-east-1")
            client.create_training_job(**request)
            described = client.describe_training_job(TrainingJobName=request["TrainingJobName"])
        assert any(channel["ChannelName"] == "code" for channel in described["InputDataConfig"])


def test_a_request_for_code_still_in_a_local_folder_is_refused() -> None:
    """Only the uploaded archive can reach a job (the launch Lambda's policy refuses a folder before this)."""
    raw = json.loads((EXAMPLES / "pytorch-homogeneous.json").read_text()) | {"workload": {"code": "my_workload"}, "hyperparameters": {}}
    with pytest.raises(RequestError, match="is a local folder"):
        create_training_job_request(validate_job_spec(raw), SETTINGS, name="hetero-x-ab12cd34ef", run_id="run-0001")


# Script mode ----------------------------------------------------------------------------------------

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/teams/vision-train:v3"


def script_request(workload: dict | None = None, example: str = "pytorch-script.json", **changes: object) -> dict:
    raw = json.loads((EXAMPLES / example).read_text()) | changes
    raw["workload"] = {key: value for key, value in ({"code": CODE, "sha256": SHA, "entry_point": "train.py"} | (workload or {})).items() if value}
    raw.pop("distribution", None)
    spec = validate_job_spec(raw)
    return create_training_job_request(spec, SETTINGS, name=job_name("hetero", spec.run_name, "ab12cd34ef"), run_id="run-0001")


def test_a_script_request_carries_the_entry_point_the_code_and_the_scripts_own_hyperparameters() -> None:
    request = script_request({"requirements": "requirements.txt"})
    hyperparameters = request["HyperParameters"]
    platform = build(PlatformSettings, {k: v for k, v in hyperparameters.items() if k in PlatformSettings.__dataclass_fields__})
    assert (platform.script_entry_point, platform.workload_sha256, platform.workload_requirements) == ("train.py", SHA, "requirements.txt")
    assert platform.workload_module == "" and platform.distribution == "none"
    assert hyperparameters["sagemaker_program"] == '"train.py"'  # JSON, as the SDK writes it and the toolkit reads it
    assert json.loads(hyperparameters["sagemaker_distribution_instance_groups"]) == ["dnn_group"]  # the toolkit's master: a trainer
    assert hyperparameters["data_group"] == '"data_group"' and hyperparameters["batch_size"] == "16"  # the script's own, JSON as the SDK writes them
    # The launcher's control ports stay away from those scripts use (the public TF sample's dispatcher is on 6000).
    assert (platform.data_service_port, platform.job_control_port) == (29600, 29601)
    assert channels(request)[CODE_CHANNEL]["DataSource"]["S3DataSource"]["InstanceGroupNames"] == ["data_group", "dnn_group"]
    assert request["AlgorithmSpecification"]["TrainingImage"] == SETTINGS.image_uris["pytorch"]


def test_a_scripts_own_image_and_step_time_regex_reach_the_request_and_pass_botocore() -> None:
    request = script_request({"image": IMAGE, "step_time_regex": r"iter time: ([0-9.]+)s", "step_time_unit": "s"})
    specification = request["AlgorithmSpecification"]
    assert specification["TrainingImage"] == IMAGE
    assert specification["ContainerEntrypoint"] == ["python", "-m", "training.launcher"]  # the launcher, whatever the image's own
    assert "ContainerEntrypoint" not in script_request()["AlgorithmSpecification"]  # the platform's image: its own entrypoint is it
    definitions = {item["Name"]: item["Regex"] for item in specification["MetricDefinitions"]}
    assert definitions["step_time_s"] == r"iter time: ([0-9.]+)s" and "step_time_ms" not in definitions
    assert script_request({"command": "torchrun --nproc_per_node 8 train.py", "entry_point": ""})["HyperParameters"].get("sagemaker_program") is None
    for example in ("pytorch-script.json", "pytorch-homogeneous.json"):
        request = script_request({"image": IMAGE}, example=example)
        with mock_aws():
            client = boto3.client("sagemaker", region_name="us-east-1")
            client.create_training_job(**request)  # botocore validates every parameter against the API model
            described = client.describe_training_job(TrainingJobName=request["TrainingJobName"])
        assert described["AlgorithmSpecification"]["TrainingImage"] == IMAGE
        assert described["HyperParameters"]["script_entry_point"] == "train.py"
