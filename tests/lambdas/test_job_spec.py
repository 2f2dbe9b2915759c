"""Job spec validation: a corpus of invalid specs, each refused with the field named, plus fuzzing."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lambdas.core.catalog import CATALOG
from lambdas.core.job_spec import (
    ARCHIVE_NAME,
    JobSpec,
    JobSpecError,
    SpecPolicy,
    WorkloadCode,
    code_key,
    role_map,
    trainer_config,
    validate_job_spec,
    worst_case_cost_usd,
)
from lambdas.core.service_limits import java_length, java_pattern, limit, training_instance_types

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def hetero() -> dict[str, Any]:
    return json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())


def homogeneous() -> dict[str, Any]:
    return json.loads((EXAMPLES / "pytorch-homogeneous.json").read_text())


def neuron() -> dict[str, Any]:
    return json.loads((EXAMPLES / "neuron-trn1-2xlarge.json").read_text())


def tensorflow() -> dict[str, Any]:
    return json.loads((EXAMPLES / "tensorflow-heterogeneous.json").read_text())


def changed(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of base with the value at a dotted path (list indexes as numbers) set, or removed for
    REMOVE."""
    spec = copy.deepcopy(base)
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]
    target = spec
    for part in parents:
        target = target[part]
    if value is REMOVE:
        del target[last]
    else:
        target[last] = value
    return spec


REMOVE = object()
GROUP = {"name": "data_group", "role": "data", "instance_type": "ml.c5.9xlarge", "count": 1}
SHA = "ab" * 32
UPLOADED = {"code": f"s3://results-bucket/code/{SHA}/sourcedir.tar.gz", "sha256": SHA, "module": "workload"}


def user(base: dict[str, Any], workload: dict[str, Any] | None = None, hyperparameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """The base spec training a user workload (by default its uploaded archive), with the loop's settings
    and the module's own hyperparameters (``hidden``)."""
    spec = copy.deepcopy(base)
    spec["workload"] = UPLOADED if workload is None else workload
    spec["hyperparameters"] = {"batch_size": 32, "steps": 100, "hidden": 64} if hyperparameters is None else hyperparameters
    return spec


def script(workload: dict[str, Any] | None = None, hyperparameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """The script-mode example with its code uploaded and ``workload``'s fields changed (REMOVE drops one)."""
    spec = json.loads((EXAMPLES / "pytorch-script.json").read_text())
    fields = {"code": UPLOADED["code"], "sha256": SHA, "entry_point": "train.py"} | (workload or {})
    spec["workload"] = {key: value for key, value in fields.items() if value is not REMOVE}
    if hyperparameters is not None:
        spec["hyperparameters"] = hyperparameters
    return spec


def with_eval(base: dict[str, Any], groups: list[str]) -> dict[str, Any]:
    """A heterogeneous user workload validating on a "val" channel routed to ``groups``."""
    spec = user(base, hyperparameters={"eval_channel": "val", "eval_every": 50, "steps": 100})
    spec["inputs"]["val"] = {"s3_uri": "s3://datasets-bucket/val/", "groups": groups}
    return spec

# (id, spec, field named in the error)
INVALID: list[tuple[str, Any, str]] = [
    ("not an object", [], "$"),
    ("unknown top-level field", changed(hetero(), "priority", "high"), "priority"),
    ("future spec version", changed(hetero(), "spec_version", 2), "spec_version"),
    ("no run name", changed(hetero(), "run_name", REMOVE), "run_name"),
    ("run name with spaces", changed(hetero(), "run_name", "my run"), "run_name"),
    ("run name too long", changed(hetero(), "run_name", "a" * 41), "run_name"),
    ("run name starting with a hyphen", changed(hetero(), "run_name", "-run"), "run_name"),
    ("run name not a string", changed(hetero(), "run_name", 42), "run_name"),
    ("no variant", changed(hetero(), "variant", REMOVE), "variant"),
    ("unknown variant", changed(hetero(), "variant", "jax"), "variant"),
    ("unknown workload", changed(hetero(), "workload", "speech"), "workload"),
    ("unknown distribution", changed(hetero(), "distribution", "horovod"), "distribution"),
    ("no distribution across several dnn hosts", changed(changed(homogeneous(), "distribution", "none"), "instance_groups.0.count", 2), "distribution"),
    ("no instance groups", changed(hetero(), "instance_groups", []), "instance_groups"),
    ("instance groups not a list", changed(hetero(), "instance_groups", {"a": 1}), "instance_groups"),
    ("six groups", changed(hetero(), "instance_groups", [dict(GROUP, name=f"g{i}") for i in range(5)] + [hetero()["instance_groups"][1]]), "instance_groups"),
    ("group not an object", changed(hetero(), "instance_groups.0", "data"), "instance_groups[0]"),
    ("group with an unknown field", changed(hetero(), "instance_groups.0.spot", True), "instance_groups[0].spot"),
    ("group name with a space", changed(hetero(), "instance_groups.0.name", "data group"), "instance_groups[0].name"),
    ("group named like SageMaker's own", changed(hetero(), "instance_groups.0.name", "homogeneousCluster"), "instance_groups[0].name"),
    ("duplicate group names", changed(hetero(), "instance_groups.1.name", "data_group"), "instance_groups"),
    ("unknown role", changed(hetero(), "instance_groups.0.role", "cpu"), "instance_groups[0].role"),
    ("no dnn group", changed(hetero(), "instance_groups.1.role", "data"), "instance_groups"),
    ("two dnn groups", changed(hetero(), "instance_groups.0.role", "dnn"), "instance_groups"),
    ("instance type without ml. prefix", changed(hetero(), "instance_groups.0.instance_type", "c5.9xlarge"), "instance_groups[0].instance_type"),
    ("instance type not in the catalog", changed(hetero(), "instance_groups.0.instance_type", "ml.c5.metal"), "instance_groups[0].instance_type"),
    ("zero instances", changed(hetero(), "instance_groups.0.count", 0), "instance_groups[0].count"),
    ("too many instances", changed(hetero(), "instance_groups.0.count", 21), "instance_groups[0].count"),
    ("count as a string", changed(hetero(), "instance_groups.0.count", "2"), "instance_groups[0].count"),
    ("count as a boolean", changed(hetero(), "instance_groups.0.count", True), "instance_groups[0].count"),
    ("data group on a GPU instance", changed(hetero(), "instance_groups.0.instance_type", "ml.p3.2xlarge"), "instance_groups[0].instance_type"),
    ("Trainium with the pytorch variant", changed(hetero(), "instance_groups.1.instance_type", "ml.trn1.2xlarge"), "instance_groups[1].instance_type"),
    ("neuron variant on a GPU instance", changed(neuron(), "instance_groups.0.instance_type", "ml.p3.2xlarge"), "instance_groups[0].instance_type"),
    ("neuron variant with a data group", changed(neuron(), "instance_groups", [GROUP, neuron()["instance_groups"][0]]), "instance_groups"),
    ("neuron variant on the vision workload", changed(neuron(), "workload", "vision"), "workload"),
    ("vision hyperparameter for the text trainer", changed(neuron(), "hyperparameters.augment", "heavy"), "hyperparameters"),
    ("hyperparameters not an object", changed(hetero(), "hyperparameters", [1]), "hyperparameters"),
    ("hyperparameter value a list", changed(hetero(), "hyperparameters.steps", [1, 2]), "hyperparameters.steps"),
    ("hyperparameter value null", changed(hetero(), "hyperparameters.steps", None), "hyperparameters.steps"),
    ("hyperparameter name with a dash", changed(hetero(), "hyperparameters.learning-rate", 0.1), "hyperparameters.learning-rate"),
    ("unknown hyperparameter", changed(hetero(), "hyperparameters.lerning_rate", 0.1), "hyperparameters"),
    ("hyperparameter of the wrong type", changed(hetero(), "hyperparameters.batch_size", "large"), "hyperparameters"),
    ("hyperparameter out of range", changed(hetero(), "hyperparameters.steps", 0), "hyperparameters"),
    ("warm-up longer than training", changed(hetero(), "hyperparameters.warmup_steps", 500), "hyperparameters"),
    ("unknown model", changed(hetero(), "hyperparameters.model", "vgg16"), "hyperparameters"),
    ("platform key set by hand", changed(hetero(), "hyperparameters.shutdown_token", "x" * 20), "hyperparameters.shutdown_token"),
    ("role map set by hand", changed(hetero(), "hyperparameters.role_map", "{}"), "hyperparameters.role_map"),
    ("toolkit key set by hand", changed(hetero(), "hyperparameters.sagemaker_program", "x.py"), "hyperparameters.sagemaker_program"),
    ("no inputs", changed(hetero(), "inputs", {}), "inputs"),
    ("inputs not an object", changed(hetero(), "inputs", ["s3://datasets-bucket/"]), "inputs"),
    ("channel name with a slash", changed(hetero(), "inputs", {"tr/ain": {"s3_uri": "s3://datasets-bucket/x/", "groups": ["data_group"]}}), "inputs.tr/ain"),
    ("channel without an S3 URI", changed(hetero(), "inputs.train.s3_uri", "/local/path"), "inputs.train.s3_uri"),
    ("channel assigned to an unknown group", changed(hetero(), "inputs.train.groups", ["gpu_group"]), "inputs.train.groups"),
    ("channel groups not a list", changed(hetero(), "inputs.train.groups", "data_group"), "inputs.train.groups"),
    ("channel assigned only to the dnn group", changed(hetero(), "inputs.train.groups", ["dnn_group"]), "inputs.train.groups"),
    ("channel in pipe mode", changed(hetero(), "inputs.train.input_mode", "pipe"), "inputs.train.input_mode"),
    ("channel in an unknown mode", changed(hetero(), "inputs.train.input_mode", "File"), "inputs.train.input_mode"),
    ("channel with an unknown distribution", changed(hetero(), "inputs.train.distribution", "ShardedByS3Key"), "inputs.train.distribution"),
    ("sharded channel read by the dnn group too", changed(changed(hetero(), "inputs.train.distribution", "sharded"), "inputs.train.groups",
                                                          ["data_group", "dnn_group"]), "inputs.train.distribution"),
    ("sharded channel of a homogeneous job", changed(homogeneous(), "inputs.train.distribution", "sharded"), "inputs.train.distribution"),
    ("sharded channel of a text job", changed(neuron(), "inputs.train.distribution", "sharded"), "inputs.train.distribution"),
    ("channel mode not a string", changed(hetero(), "inputs.train.input_mode", ["file"]), "inputs.train.input_mode"),
    ("channel distribution not a string", changed(hetero(), "inputs.train.distribution", {"sharded": True}), "inputs.train.distribution"),
    ("fastfile prefix that is a partial folder name", changed(changed(hetero(), "inputs.train.input_mode", "fastfile"), "inputs.train.s3_uri",
                                                             "s3://datasets-bucket/demo-images"), "inputs.train.s3_uri"),
    ("sharded across data hosts of different speeds", changed(changed(changed(hetero(), "inputs.train.distribution", "sharded"),
                                                                      "instance_groups", [GROUP, dict(GROUP, name="small", instance_type="ml.c5.xlarge"),
                                                                                          hetero()["instance_groups"][1]]),
                                                              "inputs.train.groups", ["data_group", "small"]), "inputs.train.distribution"),
    ("sharded channel for tf.data.service", changed(tensorflow(), "inputs.train.distribution", "sharded"), "inputs.train.distribution"),
    (
        "one channel assigned, one not",
        changed(hetero(), "inputs.validation", {"s3_uri": "s3://datasets-bucket/validation/"}),
        "inputs.validation.groups",
    ),
    ("runtime too short", changed(hetero(), "max_runtime_s", 10), "max_runtime_s"),
    ("runtime beyond SageMaker's limit", changed(hetero(), "max_runtime_s", 6 * 24 * 3600), "max_runtime_s"),
    ("runtime as a float", changed(hetero(), "max_runtime_s", 3600.5), "max_runtime_s"),
    ("tensorflow with a PyTorch distribution", changed(tensorflow(), "distribution", "torchrun"), "distribution"),
    ("tensorflow mirrored across two DNN hosts", changed(changed(tensorflow(), "distribution", "mirrored"), "instance_groups.1.count", 2), "distribution"),
    ("pytorch with horovod", changed(hetero(), "distribution", "horovod"), "distribution"),
    ("a ResNet18 asked of the Keras trainer", changed(tensorflow(), "hyperparameters.model", "resnet18"), "hyperparameters"),
    ("tensorflow data group without the channel", changed(tensorflow(), "inputs.train.groups", ["dnn_group"]), "inputs.train.groups"),
    # SageMaker's own limits (botocore's service model), whole values only, and numbers in range.
    ("run name with a trailing newline", changed(hetero(), "run_name", "vision-hetero\n"), "run_name"),
    ("group name with a trailing newline", changed(hetero(), "instance_groups.0.name", "data_group\n"), "instance_groups[0].name"),
    ("instance type with a trailing newline", changed(hetero(), "instance_groups.0.instance_type", "ml.c5.9xlarge\n"), "instance_groups[0].instance_type"),
    ("resume_from with a trailing newline", changed(hetero(), "resume_from", "run-1\n"), "resume_from"),
    ("a channel named like the platform's own", changed(hetero(), "inputs.platform", {"s3_uri": "s3://datasets-bucket/x/", "groups": ["data_group"]}), "inputs.platform"),
    ("20 channels: SageMaker's 20 less the platform's", changed(hetero(), "inputs", {f"c{i}": {"s3_uri": "s3://datasets-bucket/x/", "groups": ["data_group"]} for i in range(20)}), "inputs"),
    ("21 channels", changed(hetero(), "inputs", {f"c{i}": {"s3_uri": "s3://datasets-bucket/x/", "groups": ["data_group"]} for i in range(21)}), "inputs"),
    ("S3 URI longer than SageMaker takes", changed(hetero(), "inputs.train.s3_uri", "s3://datasets-bucket/" + "x" * 1010), "inputs.train.s3_uri"),
    ("S3 URI without a bucket", changed(hetero(), "inputs.train.s3_uri", "s3://"), "inputs.train.s3_uri"),
    ("S3 URI with an uppercase bucket", changed(hetero(), "inputs.train.s3_uri", "s3://Datasets/x/"), "inputs.train.s3_uri"),
    ("S3 URI with a newline", changed(hetero(), "inputs.train.s3_uri", "s3://datasets-bucket/x/\n"), "inputs.train.s3_uri"),
    ("S3 URI with a line separator Java's '.' refuses", changed(hetero(), "inputs.train.s3_uri", "s3://datasets-bucket/a\u2028b/"), "inputs.train.s3_uri"),
    ("S3 URI over 1,024 UTF-16 units in fewer characters", changed(hetero(), "inputs.train.s3_uri", "s3://datasets-bucket/" + "\U0001F600" * 600), "inputs.train.s3_uri"),
    ("hyperparameter value with a carriage return", changed(neuron(), "hyperparameters.model", "bert\rbase"), "hyperparameters.model"),
    ("S3 URI over HTTPS", changed(hetero(), "inputs.train.s3_uri", "https://datasets-bucket.s3.amazonaws.com/x/"), "inputs.train.s3_uri"),
    ("channel with an unknown field", changed(hetero(), "inputs.train.mode", "pipe"), "inputs.train.mode"),
    ("channel naming a group twice", changed(hetero(), "inputs.train.groups", ["data_group", "data_group"]), "inputs.train.groups"),
    ("no train channel", changed(hetero(), "inputs", {"images": {"s3_uri": "s3://datasets-bucket/x/", "groups": ["data_group"]}}), "inputs"),
    ("10**30 steps", changed(hetero(), "hyperparameters.steps", 10**30), "hyperparameters"),
    ("a batch of 10**9", changed(hetero(), "hyperparameters.batch_size", 10**9), "hyperparameters"),
    ("negative momentum", changed(hetero(), "hyperparameters.momentum", -0.5), "hyperparameters"),
    ("NaN learning rate", changed(hetero(), "hyperparameters.learning_rate", float("nan")), "hyperparameters.learning_rate"),
    ("infinite learning rate", changed(hetero(), "hyperparameters.learning_rate", float("inf")), "hyperparameters.learning_rate"),
    ("huge learning rate", changed(hetero(), "hyperparameters.learning_rate", 1e6), "hyperparameters"),
    ("image size of 10**6", changed(hetero(), "hyperparameters.image_size", 10**6), "hyperparameters"),
    ("hyperparameter value over 2,500 characters", changed(neuron(), "hyperparameters.model", "m" * 2501), "hyperparameters.model"),
    ("more hyperparameters than SageMaker takes", changed(hetero(), "hyperparameters", {f"h{i}": 1 for i in range(90)}), "hyperparameters"),
    ("model channel not among the inputs", changed(neuron(), "hyperparameters.model_channel", "weights"), "hyperparameters.model_channel"),
    ("eval channel not among the inputs", changed(neuron(), "inputs.test", REMOVE), "hyperparameters.eval_channel"),
    ("negative cost ceiling", changed(hetero(), "max_cost_usd", -1), "max_cost_usd"),
    ("cost ceiling as a boolean", changed(hetero(), "max_cost_usd", True), "max_cost_usd"),
    ("NaN cost ceiling", changed(hetero(), "max_cost_usd", float("nan")), "max_cost_usd"),
    ("run costlier than its own ceiling", changed(hetero(), "max_cost_usd", 1), "max_runtime_s"),
    # A user workload
    ("a workload field of none", user(hetero(), UPLOADED | {"entry": "main"}), "workload.entry"),
    ("workload 'user' as a name", changed(hetero(), "workload", "user"), "workload"),
    ("no code", user(hetero(), {"module": "workload"}), "workload.code"),
    ("empty code", user(hetero(), {"code": ""}), "workload.code"),
    ("code from https", user(hetero(), {"code": "https://example.com/x.tar.gz"}), "workload.code"),
    ("code with a newline", user(hetero(), {"code": "my_workload\n"}), "workload.code"),
    ("s3 code that is no archive", user(hetero(), UPLOADED | {"code": f"s3://results-bucket/code/{SHA}/"}), "workload.code"),
    ("s3 code in a bad bucket", user(hetero(), UPLOADED | {"code": f"s3://Bad_Bucket/code/{SHA}/sourcedir.tar.gz"}), "workload.code"),
    ("s3 code without its sha256", user(hetero(), {"code": UPLOADED["code"]}), "workload.sha256"),
    ("short sha256", user(hetero(), UPLOADED | {"sha256": "ab" * 31}), "workload.sha256"),
    ("uppercase sha256", user(hetero(), UPLOADED | {"sha256": "AB" * 32}), "workload.sha256"),
    ("sha256 of a local folder", user(hetero(), {"code": "my_workload", "sha256": SHA}), "workload.sha256"),
    ("module with a hyphen", user(hetero(), UPLOADED | {"module": "my-workload"}), "workload.module"),
    ("module as a path", user(hetero(), UPLOADED | {"module": "pkg/train.py"}), "workload.module"),
    ("module not a string", user(hetero(), UPLOADED | {"module": 3}), "workload.module"),
    ("requirements outside the folder", user(hetero(), UPLOADED | {"requirements": "../requirements.txt"}), "workload.requirements"),
    ("absolute requirements", user(hetero(), UPLOADED | {"requirements": "/etc/requirements.txt"}), "workload.requirements"),
    ("requirements not a string", user(hetero(), UPLOADED | {"requirements": ["torch"]}), "workload.requirements"),
    ("tensorflow user workload validating on nothing", user(tensorflow(), hyperparameters={"eval_every": 10}), "hyperparameters"),
    ("input named code", changed(hetero(), "inputs.code", {"s3_uri": "s3://datasets-bucket/x/", "groups": ["data_group"]}), "inputs.code"),
    ("the code channel counted in the limit", user(changed(homogeneous(), "inputs", {f"c{i}": {"s3_uri": "s3://datasets-bucket/x/"}
                                                                                      for i in range(18)} | {"train": {"s3_uri": "s3://datasets-bucket/t/"}})), "inputs"),
    ("user workload: zero steps", user(hetero(), hyperparameters={"steps": 0}), "hyperparameters"),
    ("user workload: unknown precision", user(hetero(), hyperparameters={"precision": "fp8"}), "hyperparameters"),
    ("user workload: negative clip norm", user(hetero(), hyperparameters={"grad_clip_norm": -1.0}), "hyperparameters"),
    ("user workload: eval_every without a channel", user(hetero(), hyperparameters={"eval_every": 10}), "hyperparameters"),
    ("user workload: eval channel not an input", user(hetero(), hyperparameters={"eval_channel": "val"}), "hyperparameters.eval_channel"),
    ("user workload: eval channel on the data group only", with_eval(hetero(), ["data_group"]), "inputs.val.groups"),
    ("user workload: a platform setting", user(hetero(), hyperparameters={"workload_module": "other"}), "hyperparameters.workload_module"),
    ("user workload: a sagemaker_ name", user(hetero(), hyperparameters={"sagemaker_program": "x.py"}), "hyperparameters.sagemaker_program"),
    ("user workload: a channel the data group lacks", changed(with_eval(hetero(), ["dnn_group"]), "inputs.extra",
                                                              {"s3_uri": "s3://datasets-bucket/e/", "groups": ["dnn_group"]}), "inputs.extra.groups"),
    ("user workload: a misspelt eval channel with data groups", with_eval(hetero(), ["dnn_group"]) | {"hyperparameters": {"eval_channel": "vall"}},
     "hyperparameters.eval_channel"),
    ("eval channel is the training channel", changed(hetero(), "hyperparameters.eval_channel", "train"), "hyperparameters.eval_channel"),
    ("user workload: eval channel is the training channel", user(hetero(), hyperparameters={"eval_channel": "train"}), "hyperparameters.eval_channel"),
    ("precompile_steps on a GPU", changed(hetero(), "hyperparameters.precompile_steps", 2), "hyperparameters.precompile_steps"),
    ("user workload: precompile_steps on a GPU", user(hetero(), hyperparameters={"precompile_steps": 2}), "hyperparameters.precompile_steps"),
    ("fp16 on Trainium", changed(neuron(), "hyperparameters.precision", "fp16"), "hyperparameters.precision"),
    ("built-in text workload with a data group", changed(neuron(), "instance_groups", [GROUP, *neuron()["instance_groups"]]), "instance_groups"),
    ("script: entry point and command", script(workload={"command": "python train.py"}), "workload.command"),
    ("script: entry point outside the folder", script(workload={"entry_point": "../train.py"}), "workload.entry_point"),
    ("script: entry point not a .py or .sh file", script(workload={"entry_point": "train"}), "workload.entry_point"),
    ("script: an empty command", script(workload={"entry_point": REMOVE, "command": " "}), "workload.command"),
    ("script: a command of two lines", script(workload={"entry_point": REMOVE, "command": "cd x\npython t.py"}), "workload.command"),
    ("script: a module field", script(workload={"module": "workload"}), "workload.module"),
    ("script: an image outside ECR", script(workload={"image": "docker.io/me/train:1"}), "workload.image"),
    ("script: an image without a tag or digest", script(workload={"image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/t"}), "workload.image"),
    ("script: a regex without a group", script(workload={"step_time_regex": "step_time=[0-9.]+"}), "workload.step_time_regex"),
    ("script: a regex with two groups", script(workload={"step_time_regex": "(a)=([0-9.]+)"}), "workload.step_time_regex"),
    ("script: a regex that does not compile", script(workload={"step_time_regex": "([0-9.]+"}), "workload.step_time_regex"),
    ("script: a regex past SageMaker's 500 characters", script(workload={"step_time_regex": "(x)" + "y" * 500}), "workload.step_time_regex"),
    ("script: a unit of minutes", script(workload={"step_time_unit": "min"}), "workload.step_time_unit"),
    ("script: negative warm-up", script(workload={"warmup_steps": -1}), "workload.warmup_steps"),
    ("script: a distribution", changed(script(), "distribution", "torchrun"), "distribution"),
    ("script: a platform setting as a hyperparameter", script(hyperparameters={"role_map": "x"}), "hyperparameters.role_map"),
    ("script: a toolkit hyperparameter", script(hyperparameters={"sagemaker_program": "x.py"}), "hyperparameters.sagemaker_program"),
    ("script: a GPU data group", changed(script(), "instance_groups.0.instance_type", "ml.p3.2xlarge"), "instance_groups[0].instance_type"),
    ("script field without an entry point", user(hetero(), UPLOADED | {"image": "x"}), "workload.image"),
]


def test_a_spec_without_a_distribution_gets_its_variants_default() -> None:
    assert validate_job_spec(changed(tensorflow(), "distribution", REMOVE)).distribution == "horovod"
    assert validate_job_spec(changed(hetero(), "distribution", REMOVE)).distribution == "torchrun"


def test_mirrored_names_horovod_as_the_multi_host_choice() -> None:
    with pytest.raises(JobSpecError, match="use 'horovod'"):
        validate_job_spec(changed(changed(tensorflow(), "distribution", "mirrored"), "instance_groups.1.count", 2))


def test_the_corpus_is_large() -> None:
    assert len(INVALID) >= 120


@pytest.mark.parametrize(("spec", "field"), [(spec, field) for _, spec, field in INVALID], ids=[name for name, _, _ in INVALID])
def test_invalid_specs_are_refused_naming_the_field(spec: Any, field: str) -> None:
    with pytest.raises(JobSpecError) as refused:
        validate_job_spec(spec)
    assert refused.value.field == field
    assert len(refused.value.problem) > 10  # says what is wrong and what to do


# The example sweeps (a "sweep_name") beside the example specs.
SWEEPS = sorted(path.name for path in EXAMPLES.glob("*.json") if "sweep_name" in json.loads(path.read_text()))


@pytest.mark.parametrize("name", sorted(path.name for path in EXAMPLES.glob("*.json") if path.name not in SWEEPS))
def test_the_examples_are_valid(name: str) -> None:
    spec = validate_job_spec(json.loads((EXAMPLES / name).read_text()))
    assert isinstance(spec, JobSpec) and spec.variant == name.split("-")[0]


@pytest.mark.parametrize("name", SWEEPS)
def test_the_example_sweeps_plan_valid_configurations(name: str) -> None:
    from lambdas.core.sweep import plan_sweep

    plan = plan_sweep(json.loads((EXAMPLES / name).read_text()))
    assert len(plan.configurations) >= 2 and all(validate_job_spec(spec) for spec in plan.configurations)


def test_a_user_workload_carries_its_code_and_its_own_hyperparameters() -> None:
    spec = validate_job_spec(user(hetero(), UPLOADED | {"requirements": "requirements.txt"}, {"steps": 100, "hidden": 64, "my_lr": 0.1}))
    assert spec.workload == "user" and spec.code == WorkloadCode(UPLOADED["code"], "workload", "requirements.txt", SHA)
    assert not spec.code.is_local and spec.hyperparameters["hidden"] == 64  # the module's own: passed on, checked where it is
    config = trainer_config(spec)  # the loop's settings alone
    assert type(config).__name__ == "WorkloadConfig" and config.steps == 100 and not hasattr(config, "hidden")
    local = validate_job_spec(user(homogeneous(), {"code": "examples/workloads/tiny"}))
    assert local.code == WorkloadCode("examples/workloads/tiny") and local.code.is_local and local.code.module == "workload"
    assert validate_job_spec(hetero()).code is None  # a built-in


def test_a_script_keeps_its_own_hyperparameters_and_channel_routing() -> None:
    """A script routes its channels and reads its hyperparameters itself: no "train" channel, no loop settings."""
    raw = script(workload={"step_time_regex": r"took ([0-9.]+) s", "step_time_unit": "s", "warmup_steps": 0},
                 hyperparameters={"epochs": 3, "lr": 0.1, "steps": "many"})
    raw["inputs"] = {"images": {"s3_uri": "s3://datasets-bucket/i/", "groups": ["data_group"]},
                     "labels": {"s3_uri": "s3://datasets-bucket/l/", "groups": ["dnn_group"]}}
    spec = validate_job_spec(raw)
    assert spec.is_script and not spec.is_user_workload and spec.distribution == "none"
    assert (spec.code.entry_point, spec.code.step_time_unit, spec.code.warmup_steps, spec.code.module) == ("train.py", "s", 0, "")
    assert spec.hyperparameters["steps"] == "many"  # the script's own: not the platform loop's integer
    assert validate_job_spec(script(hyperparameters={"batch-size": 8})).hyperparameters["batch-size"] == 8  # argparse's --batch-size
    with pytest.raises(JobSpecError, match="without spaces"):
        validate_job_spec(script(hyperparameters={"batch size": 8}))
    with pytest.raises(JobSpecError, match="did you mean 'entry_point'"):
        validate_job_spec(script(workload={"entry_point": REMOVE, "entrypoint": "train.py"}))
    command = validate_job_spec(script(workload={"entry_point": REMOVE, "command": "torchrun --nproc_per_node 8 train.py"}))
    assert command.code.command.startswith("torchrun") and command.code.entry_point == ""
    assert validate_job_spec(changed(script(), "variant", "neuron") | {"instance_groups": [
        {"name": "trainium", "role": "dnn", "instance_type": "ml.trn1.2xlarge", "count": 1}], "inputs": {}}).is_script


def test_a_scripts_own_image_must_come_from_a_repository_the_deployment_allows() -> None:
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/teams/train:v3"
    allowed = SpecPolicy.from_environment({"RESULTS_BUCKET": "results-bucket",
                                           "SCRIPT_IMAGE_REPOSITORIES": '["123456789012.dkr.ecr.us-east-1.amazonaws.com/teams/train"]'})
    assert validate_job_spec(script(workload={"image": image}), allowed).code.image == image
    by_digest = image.removesuffix(":v3") + "@sha256:" + "0" * 64
    assert validate_job_spec(script(workload={"image": by_digest}), allowed).code.image == by_digest
    for policy in (SpecPolicy.from_environment({"RESULTS_BUCKET": "results-bucket"}),  # a deployment that names none allows none
                   SpecPolicy.from_environment({"RESULTS_BUCKET": "results-bucket", "SCRIPT_IMAGE_REPOSITORIES": '["1.dkr/other"]'})):
        with pytest.raises(JobSpecError, match="not a repository the platform's jobs may pull from") as refused:
            validate_job_spec(script(workload={"image": image}), policy)
        assert refused.value.field == "workload.image"


def test_eighteen_channels_leave_room_for_the_code_channel_only_without_a_nineteenth() -> None:
    inputs = {f"c{i}": {"s3_uri": "s3://datasets-bucket/x/"} for i in range(17)} | {"train": {"s3_uri": "s3://datasets-bucket/t/"}}
    assert len(validate_job_spec(user(changed(homogeneous(), "inputs", inputs))).inputs) == 18  # + platform + code = 20
    nineteen = inputs | {"c17": {"s3_uri": "s3://datasets-bucket/x/"}}
    assert len(validate_job_spec(changed(homogeneous(), "inputs", nineteen)).inputs) == 19  # a built-in: no code channel


def test_a_user_workloads_eval_channel_goes_to_the_dnn_group_and_the_data_group_need_not_read_it() -> None:
    spec = validate_job_spec(with_eval(hetero(), ["dnn_group"]))
    assert {channel.name: channel.groups for channel in spec.inputs} == {"train": ("data_group",), "val": ("dnn_group",)}
    assert validate_job_spec(with_eval(hetero(), ["data_group", "dnn_group"])).inputs[1].groups == ("data_group", "dnn_group")
    # A built-in's channels still reach every data group.
    builtin = changed(hetero(), "inputs.val", {"s3_uri": "s3://datasets-bucket/val/", "groups": ["dnn_group"]})
    with pytest.raises(JobSpecError, match="preprocess this channel") as refused:
        validate_job_spec(builtin)
    assert refused.value.field == "inputs.val.groups"


def test_a_neuron_user_workload_may_have_cpu_data_groups() -> None:
    """Heterogeneous Trainium: CPU data hosts preprocess for trn1 hosts (the built-in text trainer cannot)."""
    raw = user(changed(neuron(), "instance_groups", [GROUP, *neuron()["instance_groups"]]))
    raw["inputs"] = {"train": {"s3_uri": "s3://datasets-bucket/text/", "groups": ["data_group"]}}
    spec = validate_job_spec(raw)
    assert spec.is_heterogeneous and spec.data_groups[0].instance_type == "ml.c5.9xlarge" and spec.variant == "neuron"
    with pytest.raises(JobSpecError, match="CPU type"):
        validate_job_spec(changed(raw, "instance_groups.0.instance_type", "ml.p3.2xlarge"))


def test_role_map_of_a_single_group_is_the_homogeneous_cluster() -> None:
    assert role_map(validate_job_spec(homogeneous())) == {"homogeneousCluster": "dnn"}
    assert role_map(validate_job_spec(hetero())) == {"data_group": "data", "dnn_group": "dnn"}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.integers() | st.floats() | st.text(max_size=12)
    | st.sampled_from(["s3://datasets-bucket/x/\n", "vision\n", "s3://" + "a" * 1100, "ml.c5.9xlarge\n", "train"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
PATHS = st.sampled_from(
    ["run_name", "variant", "workload", "distribution", "instance_groups", "instance_groups.0", "instance_groups.0.count",
     "instance_groups.1.instance_type", "instance_groups.0.role", "hyperparameters", "hyperparameters.steps",
     "hyperparameters.batch_size", "hyperparameters.learning_rate", "hyperparameters.momentum", "hyperparameters.image_size",
     "inputs", "inputs.train", "inputs.train.groups", "inputs.train.s3_uri", "inputs.train.input_mode", "inputs.train.distribution",
     "max_runtime_s", "spec_version", "max_cost_usd",
     "resume_from"]
)


@settings(max_examples=300, deadline=None)
@given(mutations=st.lists(st.tuples(PATHS, JSON), min_size=1, max_size=3))
def test_fuzzed_specs_are_valid_or_refused_by_name(mutations: list[tuple[str, Any]]) -> None:
    spec = hetero()
    for path, value in mutations:
        try:
            spec = changed(spec, path, value)
        except (KeyError, IndexError, TypeError):
            continue  # the path no longer exists after an earlier mutation
    try:
        validated = validate_job_spec(spec)
    except JobSpecError as error:
        assert error.field and error.problem
        return
    assert isinstance(validated, JobSpec)


# The deployment's policy ---------------------------------------------------------------------------------

POLICY = SpecPolicy(input_buckets=frozenset({"datasets-bucket"}), run_cost_ceiling_usd=1000.0, sweep_cost_ceiling_usd=5000.0,
                    prices_usd_per_hour={"ml.trn1.2xlarge": 1.5, "ml.trn1.32xlarge": 25.0})


def test_a_channel_outside_the_allowed_buckets_is_refused_by_name() -> None:
    spec = changed(hetero(), "inputs.train.s3_uri", "s3://someone-elses-bucket/images/")
    validate_job_spec(spec)  # no deployment: any bucket
    with pytest.raises(JobSpecError, match="'someone-elses-bucket' is not one the platform's jobs may read") as refused:
        validate_job_spec(spec, POLICY)
    assert refused.value.field == "inputs.train.s3_uri"
    # Which buckets are allowed, and where a deployment sets them.
    assert "allows ['datasets-bucket']" in refused.value.problem and "DatasetsBucket output" in refused.value.problem
    assert "cdk.json" in refused.value.problem and "input_buckets" in refused.value.problem
    assert "placeholder" not in refused.value.problem


def test_the_examples_placeholder_bucket_is_refused_as_a_placeholder() -> None:
    """The example specs name s3://datasets-bucket/: a deployment whose buckets are others says that it is
    the examples' placeholder, and which buckets to use instead."""
    example = json.loads((Path(__file__).resolve().parents[2] / "examples" / "pytorch-heterogeneous.json").read_text())
    ours = SpecPolicy(input_buckets=frozenset({"hetero-datasets-123", "team-images"}))
    with pytest.raises(JobSpecError) as refused:
        validate_job_spec(example, ours)
    assert refused.value.field == "inputs.train.s3_uri"
    assert "s3://datasets-bucket/ is the example specs' placeholder" in refused.value.problem
    assert "allows ['hetero-datasets-123', 'team-images']" in refused.value.problem


def test_twenty_p4d_for_five_days_is_refused_with_its_cost() -> None:
    spec = changed(changed(homogeneous(), "instance_groups.0.instance_type", "ml.p4d.24xlarge"), "instance_groups.0.count", 20)
    spec["max_runtime_s"] = 5 * 24 * 3600
    with pytest.raises(JobSpecError) as refused:
        validate_job_spec(spec, POLICY)
    # 20 × $37.688/h × 120 h, from the fallback table
    assert refused.value.field == "max_runtime_s"
    assert "$90,451.20" in refused.value.problem and "ceiling of $1,000.00" in refused.value.problem


def test_the_cost_is_every_instance_for_the_whole_runtime() -> None:
    spec = validate_job_spec(hetero(), POLICY)  # 1× c5.9xlarge + 1× p3.2xlarge for 1 h
    assert worst_case_cost_usd(spec, POLICY) == pytest.approx(1.836 + 3.825)


def test_a_spec_may_lower_the_ceiling_but_not_raise_it() -> None:
    with pytest.raises(JobSpecError, match="above the ceiling of \\$5.00"):
        validate_job_spec(changed(hetero(), "max_cost_usd", 5), POLICY)
    assert validate_job_spec(changed(hetero(), "max_cost_usd", 6), POLICY).max_cost_usd == 6.0
    with pytest.raises(JobSpecError, match="a spec can only lower it") as refused:
        validate_job_spec(changed(hetero(), "max_cost_usd", 2000), POLICY)
    assert refused.value.field == "max_cost_usd"


def test_an_unpriced_type_under_a_ceiling_is_refused_not_waved_through() -> None:
    spec = changed(neuron(), "instance_groups.0.instance_type", "ml.trn2.48xlarge")
    with pytest.raises(JobSpecError, match="no price known for ml.trn2.48xlarge") as refused:
        validate_job_spec(spec, POLICY)
    assert refused.value.field == "instance_groups[0].instance_type"
    validate_job_spec(neuron(), POLICY)  # trn1: priced by the deployment's table


DEPLOYED = SpecPolicy(input_buckets=frozenset({"datasets-bucket"}), code_bucket="results-bucket")


def test_a_deployment_refuses_a_local_code_folder_naming_hetero_run() -> None:
    """The state machine cannot read the user's disk: only the client packs and uploads a folder."""
    raw = user(hetero(), {"code": "my_workload"})
    assert validate_job_spec(raw).code.is_local  # offline, the emulated cluster: a folder is fine
    with pytest.raises(JobSpecError) as refused:
        validate_job_spec(raw, DEPLOYED)
    assert refused.value.field == "workload.code"
    assert refused.value.problem == "a local folder: start the run with `hetero run`, which uploads it"


@pytest.mark.parametrize("elsewhere", [
    f"s3://datasets-bucket/code/{SHA}/sourcedir.tar.gz",  # an allowed input bucket is still not where code lives
    f"s3://results-bucket/code/{'cd' * 32}/sourcedir.tar.gz",  # another archive's place
    f"s3://results-bucket/artifacts/{SHA}/sourcedir.tar.gz",  # another prefix of the results bucket
    f"s3://results-bucket/code/{SHA}/x/sourcedir.tar.gz",
])
def test_a_deployment_takes_code_only_from_code_sha256_of_its_results_bucket(elsewhere: str) -> None:
    validate_job_spec(user(hetero(), UPLOADED | {"code": elsewhere}))  # no deployment: any s3:// archive
    with pytest.raises(JobSpecError, match="only from its platform's results bucket") as refused:
        validate_job_spec(user(hetero(), UPLOADED | {"code": elsewhere}), DEPLOYED)
    assert refused.value.field == "workload.code"
    # The results bucket is on no input allow-list, yet its code/<sha256>/ is where the code must be.
    assert validate_job_spec(user(hetero()), DEPLOYED).code.source == f"s3://results-bucket/{code_key(SHA)}"


def test_the_code_location_is_the_packers(tmp_path: Path) -> None:
    """The Lambdas' asset does not ship training/workload/code.py: the names it uses are held equal here."""
    from training.workload import code

    (tmp_path / "workload.py").write_text("def build_model(ctx):\n    return None\n")
    packed = code.pack_code(tmp_path)
    assert ARCHIVE_NAME == code.ARCHIVE_NAME and code_key(packed.sha256) == packed.key


def test_the_policy_reads_the_results_bucket_from_the_lambda_environment_or_the_launch_settings() -> None:
    assert SpecPolicy.from_environment({"RESULTS_BUCKET": "results-bucket"}).code_bucket == "results-bucket"
    assert SpecPolicy.from_environment({"OUTPUT_S3_URI": "s3://results-bucket/artifacts/"}).code_bucket == "results-bucket"


def test_the_policy_reads_the_lambda_environment() -> None:
    policy = SpecPolicy.from_environment({"INPUT_BUCKETS": '["a-bucket"]', "RUN_COST_CEILING_USD": "250", "SWEEP_COST_CEILING_USD": "900",
                                          "CEILING_PRICES": '{"ml.trn1.2xlarge": 1.5}'})
    assert policy == SpecPolicy(frozenset({"a-bucket"}), 250.0, 900.0, {"ml.trn1.2xlarge": 1.5})
    assert SpecPolicy.from_environment({}) == SpecPolicy()


# SageMaker's limits, from botocore's model ---------------------------------------------------------------


def test_the_limits_are_the_service_models() -> None:
    assert limit("InputDataConfig").max == 20
    assert limit("S3Uri").max == 1024
    assert limit("ChannelName").problem("train") is None
    assert limit("ChannelName").problem("train\n") is not None  # whole value: no "$" loophole
    assert limit("HyperParameters").max == 100


def test_the_catalog_is_within_sagemakers_training_instance_types() -> None:
    assert set(CATALOG) <= training_instance_types()


def test_java_semantics_carry_over() -> None:
    assert java_length("\U0001F600") == 2 and java_length("abc") == 3
    assert java_pattern(".*").fullmatch("a\tb") and not java_pattern(".*").fullmatch("a\u2028b")
    assert java_pattern("[.]x").fullmatch(".x") and not java_pattern("[.]x").fullmatch("ax")  # a class's "." is literal
    assert java_pattern("a\\.b").fullmatch("a.b") and not java_pattern("a\\.b").fullmatch("axb")


def test_the_models_patterns_we_use_mean_the_same_in_python() -> None:
    """Java's \\p{...} classes are not Python's: none of the patterns used may have them."""
    for shape in ("TrainingJobName", "ChannelName", "S3Uri", "HyperParameterKey", "HyperParameterValue"):
        pattern = limit(shape).pattern
        assert pattern is None or "\\p{" not in pattern.pattern, shape


def test_a_channel_says_how_it_reaches_its_hosts() -> None:
    default = validate_job_spec(hetero()).inputs[0]
    assert (default.input_mode, default.distribution) == ("file", "replicated")
    streamed = validate_job_spec(changed(changed(hetero(), "inputs.train.input_mode", "fastfile"), "inputs.train.distribution", "sharded"))
    assert (streamed.inputs[0].input_mode, streamed.inputs[0].distribution) == ("fastfile", "sharded")
    # fastfile suits every reader, the DNN group's ranks included.
    assert validate_job_spec(changed(homogeneous(), "inputs.train.input_mode", "fastfile")).inputs[0].input_mode == "fastfile"


def test_a_tensorflow_user_workload_is_validated_against_the_keras_loops_settings() -> None:
    spec = validate_job_spec(user(tensorflow(), hyperparameters={"batch_size": 16, "steps": 60, "eval_channel": "validation",
                                                                 "learning_rate": 0.003, "width": 16})
                             | {"inputs": tensorflow()["inputs"] | {"validation": {"s3_uri": "s3://my-datasets/v/", "groups": ["dnn_group"]}}})
    assert spec.is_user_workload and spec.variant == "tensorflow"
    assert trainer_config(spec).__class__.__name__ == "KerasWorkloadConfig" and trainer_config(spec).eval_channel == "validation"


def test_a_g5_dnn_group_with_c6i_data_hosts_is_accepted_and_priced_by_the_ceiling() -> None:
    spec = changed(changed(hetero(), "instance_groups.0.instance_type", "ml.c6i.8xlarge"), "instance_groups.1.instance_type", "ml.g5.2xlarge")
    validated = validate_job_spec(spec)
    assert [group.instance_type for group in validated.instance_groups] == ["ml.c6i.8xlarge", "ml.g5.2xlarge"]
    priced = SpecPolicy(run_cost_ceiling_usd=1000, prices_usd_per_hour={"ml.c6i.8xlarge": 2.0, "ml.g5.2xlarge": 1.5})
    hours = validated.max_runtime_s / 3600
    assert worst_case_cost_usd(validate_job_spec(spec, priced), priced) == pytest.approx((validated.instance_groups[0].count * 2.0 + 1.5) * hours)
    # Under a ceiling, a type priced nowhere is refused by name, pointing at where its price goes.
    with pytest.raises(JobSpecError, match="no price known for ml.c6i.8xlarge.*ceiling_prices_usd_per_hour"):
        validate_job_spec(spec, SpecPolicy(run_cost_ceiling_usd=1000))


def test_a_data_group_on_a_new_gpu_type_is_refused_naming_cpu_families() -> None:
    with pytest.raises(JobSpecError, match=r"idle accelerators: use a CPU type \(ml\.c5\.\*, ml\.c6i\.\*") as error:
        validate_job_spec(changed(hetero(), "instance_groups.0.instance_type", "ml.g6.xlarge"))
    assert error.value.field == "instance_groups[0].instance_type"


def test_a_burstable_data_group_and_an_arm_host_are_refused_before_launch() -> None:
    """A t3's CPU credits run out under a data host's steady load; a Grace (Arm) host cannot start the
    platform's x86_64 images: both named, before anything is billed."""
    with pytest.raises(JobSpecError, match="burstable: its CPU credits run out") as error:
        validate_job_spec(changed(hetero(), "instance_groups.0.instance_type", "ml.t3.2xlarge"))
    assert error.value.field == "instance_groups[0].instance_type"
    with pytest.raises(JobSpecError, match=r"Arm \(Grace\) host CPUs.*x86_64") as error:
        validate_job_spec(changed(hetero(), "instance_groups.1.instance_type", "ml.p6e-gb200.36xlarge"))
    assert error.value.field == "instance_groups[1].instance_type"
    assert validate_job_spec(changed(hetero(), "instance_groups.1.instance_type", "ml.p6-b200.48xlarge"))  # x86_64 Blackwell: fine


@pytest.mark.parametrize("instance_type", ["ml.trn1n.32xlarge", "ml.trn2.48xlarge"])
def test_every_trainium_type_takes_the_neuron_variant_and_only_it(instance_type: str) -> None:
    assert validate_job_spec(changed(neuron(), "instance_groups.0.instance_type", instance_type)).dnn_group.instance_type == instance_type
    with pytest.raises(JobSpecError, match="needs variant 'neuron'"):
        validate_job_spec(changed(homogeneous(), "instance_groups.0.instance_type", instance_type))
    with pytest.raises(JobSpecError, match=r"ml\.trn1\.\*, ml\.trn1n\.\*, ml\.trn2\.\*"):
        validate_job_spec(changed(neuron(), "instance_groups.0.instance_type", "ml.p5.48xlarge"))
