"""`hetero run --direct` through the real SageMaker Python SDK (ModelTrainer), against moto: the request the
SDK sends is the platform builder's, field by field, for the example specs; where the SDK would send
another (a SageMaker SDK config of the user's adding a field), the builder's request is sent instead and
the job says why; bad input is refused before anything is written or created."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import boto3
import pytest
from moto.core.exceptions import JsonRESTError
from moto.sagemaker.models import SageMakerModelBackend

from hetero import sdk
from hetero.api import ClientFacingError, InputRefused, Platform, SpecRefused
from hetero.direct import RUN_TAG, job_result, launch_direct, prepare, stop_job
from lambdas.core.job_spec import validate_job_spec
from lambdas.core.price_performance import FALLBACK_PRICES
from lambdas.core.training_request import create_training_job_request, settings_from_environment
from tests.sdk.conftest import LAUNCH_SETTINGS, REGION, RESULTS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Heterogeneous PyTorch (a data group serving a DNN group), TensorFlow (tf.data.service), Trainium (three
# channels, NeuronCore processes and the compile cache) and a single-group job (InstanceType, no groups).
SPECS = ["pytorch-heterogeneous.json", "tensorflow-heterogeneous.json", "neuron-trn1-32xlarge.json", "pytorch-homogeneous.json"]


def builders_request(raw: dict, job_name: str, run_id: str) -> dict:
    """What lambdas/core/training_request.py makes for this job, computed here on its own."""
    settings = settings_from_environment(LAUNCH_SETTINGS)
    # A direct run's checkpoints, token and artifacts: apart from every state-machine run's (an untagged job
    # session reaches only direct.runs/, infra/constructs/execution_role.py).
    settings = replace(settings, tags=dict(settings.tags) | {RUN_TAG: run_id}, output_s3_uri=f"{settings.output_s3_uri}direct.runs/")
    key = f"direct.runs/{run_id}"
    return create_training_job_request(validate_job_spec(raw), settings, name=job_name, run_id=key, control_key=key)


def platform() -> Platform:
    return Platform(region=REGION)


@pytest.mark.parametrize("example", SPECS)
def test_modeltrainer_sends_the_builders_request_field_by_field(aws, example: str) -> None:
    raw = json.loads((EXAMPLES / example).read_text())
    through_sdk = launch_direct(EXAMPLES / example, platform(), name="through-sdk")
    assert through_sdk.sent_by == sdk.sdk_version() and through_sdk.fallback is None
    (sent,) = aws.created
    assert sent["TrainingJobName"] == through_sdk.job_name and through_sdk.job_name.startswith(f"hetero-{raw['run_name']}-")
    assert sdk.differences(builders_request(raw, through_sdk.job_name, "through-sdk"), sent) == []
    # The same spec sent by boto3 (no SDK): the one request, but for its job's name and run id.
    by_boto3 = launch_direct(EXAMPLES / example, platform(), name="by-boto3", use_sdk=False)
    assert by_boto3.sent_by == "boto3"
    second = aws.created[1]
    assert sdk.differences(builders_request(raw, by_boto3.job_name, "by-boto3"), second) == []
    as_one = json.dumps(second, sort_keys=True).replace(by_boto3.job_name, "<job>").replace("by-boto3", "<run>")
    assert as_one == json.dumps(sent, sort_keys=True).replace(through_sdk.job_name, "<job>").replace("through-sdk", "<run>")
    # What makes the job the platform's reached SageMaker: groups and routing, the container contract.
    job = aws.sagemaker.describe_training_job(TrainingJobName=through_sdk.job_name)
    assert job["HyperParameters"]["role_map"] == sent["HyperParameters"]["role_map"]
    if len(raw["instance_groups"]) > 1:
        assert [group["InstanceGroupName"] for group in sent["ResourceConfig"]["InstanceGroups"]] == [g["name"] for g in raw["instance_groups"]]
        assert all("InstanceGroupNames" in channel["DataSource"]["S3DataSource"] for channel in sent["InputDataConfig"])
    else:
        assert sent["ResourceConfig"]["InstanceType"] == raw["instance_groups"][0]["instance_type"]
    # Each job's shutdown token, under its run, where its platform channel reads it.
    assert aws.keys("control/") == ["control/direct.runs/by-boto3/shutdown_token", "control/direct.runs/through-sdk/shutdown_token"]
    assert sent["CheckpointConfig"]["S3Uri"] == f"s3://{RESULTS}/checkpoints/direct.runs/through-sdk/"


def test_the_checks_leave_nothing_behind_on_the_sdks_client(aws) -> None:
    """sagemaker-core keeps one client per session for the process: a capture, then launches, then a
    capture again on one session each meet only their own handlers."""
    raw = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    request = builders_request(raw, "hetero-vision-hetero-20261201000000", "a-run")
    session = boto3.Session(region_name=REGION)
    captured = sdk.captured_request(request, session, "hetero-vision-hetero")
    assert sdk.differences(request, captured) == ["TrainingJobName: sent " + repr(captured["TrainingJobName"]) + ", the builder's is 'hetero-vision-hetero-20261201000000'"]
    assert aws.created == [] and aws.jobs() == []
    shared = platform()
    shared.session = session  # the launches below send through the SDK's client of this very session
    first, second = launch_direct(raw, shared, name="one"), launch_direct(raw, shared, name="two")
    assert first.fallback is None and second.fallback is None and len(aws.jobs()) == 2
    assert sdk.captured_request(request, session, "hetero-vision-hetero")["TrainingJobName"].startswith("hetero-vision-hetero-")
    assert len(aws.jobs()) == 2  # (a stale check of a launch would have refused this capture's request)


def test_a_request_the_sdk_would_change_is_sent_as_the_builders(aws, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An administrator's SageMaker SDK config (network isolation for every training job) makes
    ModelTrainer add a field: its call is stopped before it leaves, and boto3 sends the builder's request."""
    config = tmp_path / "sagemaker-config.yaml"
    config.write_text("SchemaVersion: '1.0'\nSageMaker:\n  TrainingJob:\n    EnableNetworkIsolation: true\n")
    monkeypatch.setenv("SAGEMAKER_ADMIN_CONFIG_OVERRIDE", str(config))
    raw = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    job = launch_direct(raw, platform(), name="isolated")
    assert job.sent_by == "boto3" and job.fallback == "the SDK's request differs in EnableNetworkIsolation: sent by boto3"
    (sent,) = aws.created  # the SDK's request never left
    assert "EnableNetworkIsolation" not in sent
    assert sdk.differences(builders_request(raw, job.job_name, "isolated"), sent) == []
    assert aws.jobs() == [job.job_name]


def test_a_mismatch_names_fields_without_their_values() -> None:
    """It is raised inside ModelTrainer.train, whose telemetry sends the failure's text to the SDK's endpoint."""
    found = sdk.differences({"Environment": {}, "RoleArn": "arn:aws:iam::1:role/r"}, {"Environment": {"TOKEN": "s3cr3t"}, "RoleArn": "arn:aws:iam::1:role/x"})
    error = sdk.RequestMismatch(found)
    assert str(error) == "the SDK's request differs in Environment.TOKEN, RoleArn" and "s3cr3t" not in str(error)
    assert any("s3cr3t" in line for line in error.differences)


def test_an_sdk_that_refuses_its_config_falls_back_before_anything_is_sent(aws, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "sagemaker-config.yaml"
    config.write_text("SchemaVersion: '1.0'\nSageMaker:\n  TrainingJob:\n    EnableNetworkIsolation: 'maybe'\n")
    monkeypatch.setenv("SAGEMAKER_ADMIN_CONFIG_OVERRIDE", str(config))
    raw = json.loads((EXAMPLES / "tensorflow-heterogeneous.json").read_text())
    job = launch_direct(raw, platform(), name="bad-config")
    assert job.sent_by == "boto3" and job.fallback.startswith("ModelTrainer refused the request (ValidationError")
    (sent,) = aws.created
    assert sdk.differences(builders_request(raw, job.job_name, "bad-config"), sent) == []


def test_a_forty_character_run_name_fits_a_job_name_either_way(aws) -> None:
    raw = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text()) | {"run_name": "r" * 40}
    through_sdk = launch_direct(raw, platform(), name="long-sdk")
    by_boto3 = launch_direct(raw, platform(), name="long-boto3", use_sdk=False)
    assert through_sdk.fallback is None and through_sdk.sent_by != "boto3"
    assert len(through_sdk.job_name) == len(by_boto3.job_name) == 63 and through_sdk.job_name[-8:].isdigit()
    assert [sent["TrainingJobName"] for sent in aws.created] == [through_sdk.job_name, by_boto3.job_name]


def test_bad_input_is_refused_before_anything_is_written_or_created(aws) -> None:
    raw = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    elsewhere = raw | {"inputs": {"train": {"s3_uri": "s3://someone-elses-bucket/images/", "groups": ["data_group"]}}}
    with pytest.raises(SpecRefused, match=r"inputs\.train"):
        launch_direct(elsewhere, platform())  # the deployment's bucket allow-list
    too_dear = raw | {"instance_groups": [raw["instance_groups"][0], raw["instance_groups"][1] | {"count": 20}], "max_runtime_s": 86400}
    with pytest.raises(SpecRefused, match="ceiling"):
        launch_direct(too_dear, platform())  # the deployment's cost ceiling
    with pytest.raises(InputRefused, match="--name"):
        launch_direct(raw, platform(), name="no spaces please")
    aws.s3.put_object(Bucket=RESULTS, Key="checkpoints/direct.runs/trained-before/step-100.pt", Body=b"x")
    with pytest.raises(InputRefused, match="checkpoints already"):
        launch_direct(raw, platform(), name="trained-before")  # it would resume step 100 and train nothing new
    # Its job's session reaches only direct.runs/: another run's checkpoints would be refused after billing.
    with pytest.raises(SpecRefused, match="resume_from.*cannot resume another run's checkpoints"):
        launch_direct(raw | {"resume_from": "some-run"}, platform(), name="resuming")
    assert aws.created == [] and aws.keys("control/") == []
    launch_direct(raw, platform(), name="once")
    with pytest.raises(InputRefused, match="launched before"):
        launch_direct(raw, platform(), name="once")
    assert len(aws.created) == 1 and aws.keys("control/") == ["control/direct.runs/once/shutdown_token"]
    # Default ids: a notebook's loop launches several in one second.
    assert len({launch_direct(raw, platform()).run_id for _ in range(3)}) == 3


def user_workload_spec(tmp_path: Path, example: str) -> Path:
    """The example as a user workload whose code is a folder beside the spec's file."""
    (tmp_path / "my_workload").mkdir()
    (tmp_path / "my_workload" / "workload.py").write_text("def list_samples(ctx):\n    return []\n\ndef preprocess(sample, ctx):\n    return {}\n\n"
                                                          "def build_model(ctx):\n    return None\n\ndef train_step(model, batch, ctx):\n    return 0\n")
    raw = json.loads((EXAMPLES / example).read_text()) | {"workload": {"code": "my_workload"}, "hyperparameters": {"steps": 10, "hidden": 8}}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("example", ["pytorch-heterogeneous.json", "pytorch-homogeneous.json"])
def test_modeltrainer_sends_a_user_workloads_code_channel_as_the_builder_does(aws, tmp_path: Path, example: str) -> None:
    """The code channel (every group) is in what the SDK sends, field by field the builder's, and in what
    boto3 sends; the folder is uploaded once for both."""
    from training.workload.code import pack_code

    path = user_workload_spec(tmp_path, example)
    packed = pack_code(tmp_path / "my_workload")
    through_sdk = launch_direct(path, platform(), name="user-sdk")
    assert through_sdk.sent_by == sdk.sdk_version() and through_sdk.fallback is None
    by_boto3 = launch_direct(path, platform(), name="user-boto3", use_sdk=False)
    uri = f"s3://{RESULTS}/code/{packed.sha256}/sourcedir.tar.gz"
    assert through_sdk.raw_spec["workload"] == {"code": uri, "sha256": packed.sha256, "module": "workload"}
    for job, sent in zip((through_sdk, by_boto3), aws.created, strict=True):
        assert sdk.differences(builders_request(dict(job.raw_spec), job.job_name, job.run_id), sent) == []
        (code,) = [channel for channel in sent["InputDataConfig"] if channel["ChannelName"] == "code"]
        assert code["DataSource"]["S3DataSource"]["S3Uri"] == uri and code["InputMode"] == "File"
        groups = code["DataSource"]["S3DataSource"].get("InstanceGroupNames")
        assert groups == (["data_group", "dnn_group"] if "heterogeneous" in example else None)
        assert sent["HyperParameters"]["workload_sha256"] == packed.sha256
    assert aws.keys("code/") == [packed.key]
    assert aws.s3.get_object(Bucket=RESULTS, Key=packed.key)["Body"].read() == packed.archive


def test_a_bad_code_folder_is_refused_before_anything_is_written(aws, tmp_path: Path) -> None:
    path = user_workload_spec(tmp_path, "pytorch-heterogeneous.json")
    (tmp_path / "my_workload" / "workload.py").unlink()
    (tmp_path / "my_workload" / "other.py").write_text("")
    with pytest.raises(SpecRefused, match=r"workload\.module: 'workload' is not in"):
        launch_direct(path, platform(), name="no-module")
    with pytest.raises(SpecRefused, match=r"workload\.code: .* does not exist"):
        launch_direct(json.loads(path.read_text()) | {"workload": {"code": str(tmp_path / "absent")}}, platform())
    assert aws.created == [] and aws.keys("code/") == [] and aws.keys("control/") == []


def take_names(aws, raw: dict, run_id: str, tagged_as: str) -> None:
    """Create jobs of every name the SDK may pick for ``run_id`` in the next minute, tagged as run ``tagged_as``."""
    launch = prepare(raw, platform(), run_id)
    request = launch.request(f"{launch.base_job_name}-00000000000000")
    request["Tags"] = [tag if tag["Key"] != RUN_TAG else {"Key": RUN_TAG, "Value": tagged_as} for tag in request["Tags"]]
    now = datetime.now()
    for seconds in range(60):
        aws.sagemaker.create_training_job(**(request | {"TrainingJobName": f"{launch.base_job_name}-{now + timedelta(seconds=seconds):%Y%m%d%H%M%S}"}))
    aws.created.clear()


def test_a_job_sagemaker_refuses_takes_its_token_back(aws) -> None:
    """Another run's jobs hold the names the SDK may pick: SageMaker refuses the job (ResourceInUse), the
    error is one line, the token goes, and the run id may be launched again."""
    raw = json.loads((EXAMPLES / "pytorch-homogeneous.json").read_text())
    take_names(aws, raw, "refused", tagged_as="someone-else")
    with pytest.raises(ClientFacingError, match="ResourceInUse"):
        launch_direct(raw, platform(), name="refused")
    assert len(aws.created) == 1 and aws.keys("control/direct.runs/refused/") == []


def test_a_create_that_meets_its_own_job_is_the_launch(aws) -> None:
    """A create retried after a lost answer meets the job its first attempt made (ResourceInUse): that job,
    tagged with this run, is the launch; its token stays, for its hosts to read."""
    raw = json.loads((EXAMPLES / "pytorch-homogeneous.json").read_text())
    take_names(aws, raw, "retried", tagged_as="retried")
    job = launch_direct(raw, platform(), name="retried")
    assert job.sent_by == sdk.sdk_version() and job.job_name in aws.jobs()
    assert aws.keys("control/direct.runs/retried/") == ["control/direct.runs/retried/shutdown_token"]


def test_a_describe_refused_after_the_create_keeps_the_job_and_its_token(aws, monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelTrainer describes the job it created; that call refused (a caller without DescribeTrainingJob)
    leaves the job launched: it is returned, and its token stays for its hosts."""
    refused = []

    def refuse_once(self, *args, **kwargs):
        if not refused:
            refused.append(True)
            raise JsonRESTError("AccessDeniedException", "not authorized to perform: sagemaker:DescribeTrainingJob")
        return describe(self, *args, **kwargs)

    describe = SageMakerModelBackend.describe_training_job
    monkeypatch.setattr(SageMakerModelBackend, "describe_training_job", refuse_once)
    job = launch_direct(EXAMPLES / "pytorch-heterogeneous.json", platform(), name="undescribed")
    assert refused and job.sent_by == sdk.sdk_version() and aws.jobs() == [job.job_name]
    assert aws.keys("control/direct.runs/undescribed/") == ["control/direct.runs/undescribed/shutdown_token"]


def test_a_direct_jobs_result_and_stop(aws) -> None:
    raw = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    running = launch_direct(raw, platform(), name="to-stop")
    assert stop_job(running.job_name, platform()) == "InProgress"
    assert aws.sagemaker.describe_training_job(TrainingJobName=running.job_name)["TrainingJobStatus"] == "Stopping"
    assert stop_job(running.job_name, platform()) == "Stopping" and aws.stops == [running.job_name]  # not stopped twice
    request = dict(aws.created[0]) | {"TrainingJobName": "someone-elses-job", "Tags": []}
    aws.sagemaker.create_training_job(**request)
    with pytest.raises(InputRefused, match="not a direct job of this platform"):
        stop_job("someone-elses-job", platform())
    assert aws.stops == [running.job_name]
    job = launch_direct(raw, platform(), name="to-finish")
    aws.finish(job.job_name, {"step_time_ms": {"p50": 184.0, "p90": 190.0, "mean": 185.0}, "wall_ms_per_step": 196.0, "samples_per_s": 348.0,
                              "steps": 500, "timed_steps": 480})
    result = job_result(job.job_name, platform(), raw)
    assert (result["run_id"], result["status"], result["spec"]) == ("to-finish", "Completed", raw)
    # ml.c5.9xlarge + ml.p3.2xlarge by the fallback table, at 196 ms a step over the timed steps (184 ms the median).
    prices = FALLBACK_PRICES.usd_per_hour
    assert result["usd_per_hour"] == pytest.approx(prices["ml.c5.9xlarge"] + prices["ml.p3.2xlarge"])
    assert result["cost_per_1k_steps_usd"] == pytest.approx(result["usd_per_hour"] * 196.0 / 3600, rel=1e-3)
    # A job that completed without its hosts' summary is no success.
    assert job_result(running.job_name, platform())["status"] == "Stopping"
    empty = launch_direct(raw, platform(), name="no-summary")
    aws.finish(empty.job_name, None)
    assert job_result(empty.job_name, platform())["failure_reason"].startswith("NoSummary")
    with pytest.raises(ClientFacingError, match="no training job"):
        job_result("hetero-nothing-20260101000000", platform())


def test_modeltrainer_sends_a_scripts_request_as_the_builder_does(aws, tmp_path: Path) -> None:
    """Script mode through the SDK: the script's folder uploaded and routed to every group, its entry point,
    its own image and its step-time MetricDefinition in what ModelTrainer sends, field by field the
    builder's; boto3 sends the same."""
    import shutil

    from training.workload.code import pack_code

    shutil.copytree(EXAMPLES / "scripts" / "grpc_feed", tmp_path / "feed")
    raw = json.loads((EXAMPLES / "pytorch-script.json").read_text())
    raw["workload"] = {"code": "feed", "entry_point": "train.py", "step_time_regex": r"took ([0-9.]+) ms"}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw))
    packed = pack_code(tmp_path / "feed")
    through_sdk = launch_direct(path, platform(), name="script-sdk")
    assert through_sdk.sent_by == sdk.sdk_version() and through_sdk.fallback is None
    by_boto3 = launch_direct(path, platform(), name="script-boto3", use_sdk=False)
    assert through_sdk.raw_spec["workload"] | {"code": "", "sha256": ""} == raw["workload"] | {"code": "", "sha256": ""}
    for job, sent in zip((through_sdk, by_boto3), aws.created, strict=True):
        assert sdk.differences(builders_request(dict(job.raw_spec), job.job_name, job.run_id), sent) == []
        assert sent["HyperParameters"]["script_entry_point"] == "train.py" and sent["HyperParameters"]["sagemaker_program"] == '"train.py"'
        assert {"Name": "step_time_ms", "Regex": r"took ([0-9.]+) ms"} in sent["AlgorithmSpecification"]["MetricDefinitions"]
        (code,) = [channel for channel in sent["InputDataConfig"] if channel["ChannelName"] == "code"]
        assert code["DataSource"]["S3DataSource"]["InstanceGroupNames"] == ["data_group", "dnn_group"]
    assert aws.keys("code/") == [packed.key]
