"""Job spec validation: a corpus of invalid specs, each refused with the field named, plus fuzzing."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lambdas.core.job_spec import JobSpec, JobSpecError, role_map, validate_job_spec

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
    ("inputs not an object", changed(hetero(), "inputs", ["s3://b/"]), "inputs"),
    ("channel name with a slash", changed(hetero(), "inputs", {"tr/ain": {"s3_uri": "s3://b/x/", "groups": ["data_group"]}}), "inputs.tr/ain"),
    ("channel without an S3 URI", changed(hetero(), "inputs.train.s3_uri", "/local/path"), "inputs.train.s3_uri"),
    ("channel assigned to an unknown group", changed(hetero(), "inputs.train.groups", ["gpu_group"]), "inputs.train.groups"),
    ("channel groups not a list", changed(hetero(), "inputs.train.groups", "data_group"), "inputs.train.groups"),
    ("channel assigned only to the dnn group", changed(hetero(), "inputs.train.groups", ["dnn_group"]), "inputs.train.groups"),
    (
        "one channel assigned, one not",
        changed(hetero(), "inputs.validation", {"s3_uri": "s3://b/validation/"}),
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
]


def test_a_spec_without_a_distribution_gets_its_variants_default() -> None:
    assert validate_job_spec(changed(tensorflow(), "distribution", REMOVE)).distribution == "horovod"
    assert validate_job_spec(changed(hetero(), "distribution", REMOVE)).distribution == "torchrun"


def test_mirrored_names_horovod_as_the_multi_host_choice() -> None:
    with pytest.raises(JobSpecError, match="use 'horovod'"):
        validate_job_spec(changed(changed(tensorflow(), "distribution", "mirrored"), "instance_groups.1.count", 2))


def test_the_corpus_is_large() -> None:
    assert len(INVALID) >= 40


@pytest.mark.parametrize(("spec", "field"), [(spec, field) for _, spec, field in INVALID], ids=[name for name, _, _ in INVALID])
def test_invalid_specs_are_refused_naming_the_field(spec: Any, field: str) -> None:
    with pytest.raises(JobSpecError) as refused:
        validate_job_spec(spec)
    assert refused.value.field == field
    assert len(refused.value.problem) > 10  # says what is wrong and what to do


@pytest.mark.parametrize("name", sorted(path.name for path in EXAMPLES.glob("*.json")))
def test_the_examples_are_valid(name: str) -> None:
    spec = validate_job_spec(json.loads((EXAMPLES / name).read_text()))
    assert isinstance(spec, JobSpec) and spec.variant == name.split("-")[0]


def test_role_map_of_a_single_group_is_the_homogeneous_cluster() -> None:
    assert role_map(validate_job_spec(homogeneous())) == {"homogeneousCluster": "dnn"}
    assert role_map(validate_job_spec(hetero())) == {"data_group": "data", "dnn_group": "dnn"}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
PATHS = st.sampled_from(
    ["run_name", "variant", "workload", "distribution", "instance_groups", "instance_groups.0", "instance_groups.0.count",
     "instance_groups.1.instance_type", "instance_groups.0.role", "hyperparameters", "hyperparameters.steps",
     "hyperparameters.batch_size", "inputs", "inputs.train", "inputs.train.groups", "max_runtime_s", "spec_version"]
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
