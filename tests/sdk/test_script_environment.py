"""training/script_env.py against SageMaker's training toolkit itself (the ``sagemaker-training`` package,
installed in .venv-sdk): for the same resourceconfig.json, inputdataconfig.json and hyperparameters.json,
every SM_* variable the toolkit exports, and the arguments it gives the entry point, are ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.script_env import MachineFacts, command_arguments, decoded_hyperparameters, toolkit_environment, training_env

GROUPS = [
    {"instance_group_name": "data_group", "instance_type": "ml.c5.9xlarge", "hosts": ["algo-1", "algo-2"]},
    {"instance_group_name": "dnn_group", "instance_type": "ml.p3.2xlarge", "hosts": ["algo-3"]},
]
INPUTS = {
    "train": {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated", "RecordWrapperType": "None"},
    "validation": {"TrainingInputMode": "File", "S3DistributionType": "ShardedByS3Key", "RecordWrapperType": "None",
                   "ContentType": "application/x-image"},
}
# As SageMaker writes them: every value a string, the SDK's own JSON-encoded.
HYPERPARAMETERS = {
    "epochs": "3", "lr": "0.1", "b": "true", "optimizer": "adamw", "layers": "[1, 2]", "schedule": '{"warmup": 2, "kind": "cos"}',
    "sagemaker_program": '"train.py"', "sagemaker_submit_directory": '"/opt/ml/code"', "sagemaker_container_log_level": "20",
    "sagemaker_region": '"us-east-1"', "sagemaker_pytorch_ddp_enabled": "true",
    "sagemaker_distribution_instance_groups": '["dnn_group"]',
}

CASES = {
    "heterogeneous, a data host": (
        {"current_host": "algo-2", "current_instance_type": "ml.c5.9xlarge", "current_group_name": "data_group",
         "hosts": ["algo-1", "algo-2", "algo-3"], "instance_groups": GROUPS, "network_interface_name": "eth0"}, HYPERPARAMETERS),
    "heterogeneous, the trainer": (
        {"current_host": "algo-3", "current_instance_type": "ml.p3.2xlarge", "current_group_name": "dnn_group",
         "hosts": ["algo-1", "algo-2", "algo-3"], "instance_groups": GROUPS, "network_interface_name": "eth0"}, HYPERPARAMETERS),
    "heterogeneous, no distribution": (
        {"current_host": "algo-1", "current_instance_type": "ml.c5.9xlarge", "current_group_name": "data_group",
         "hosts": ["algo-1", "algo-2", "algo-3"], "instance_groups": GROUPS, "network_interface_name": "eth0"},
        {"epochs": "1", "sagemaker_program": '"serve.py"'}),
    "homogeneous, two hosts": (
        {"current_host": "algo-1", "current_instance_type": "ml.g5.xlarge", "current_group_name": "homogeneousCluster",
         "hosts": ["algo-1", "algo-2"], "instance_groups": [{"instance_group_name": "homogeneousCluster",
                                                            "instance_type": "ml.g5.xlarge", "hosts": ["algo-1", "algo-2"]}],
         "network_interface_name": "eth0"}, {"x": "5", "sagemaker_program": '"train.py"', "sagemaker_mpi_enabled": "true"}),
    "an older resourceconfig (no groups)": (
        {"current_host": "algo-1", "hosts": ["algo-1"]}, {"epochs": "2"}),
}


def write_tree(base: Path, resource_config: dict, hyperparameters: dict) -> None:
    config = base / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(json.dumps(resource_config))
    (config / "inputdataconfig.json").write_text(json.dumps(INPUTS))
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters))


@pytest.mark.parametrize("case", list(CASES))
def test_the_environment_is_the_toolkits_for_the_same_files(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resource_config, hyperparameters = CASES[case]
    write_tree(tmp_path, resource_config, hyperparameters)
    # The toolkit reads its files under SAGEMAKER_BASE_DIR, fixed when its modules load.
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("SAGEMAKER_PROGRAM", "SAGEMAKER_SUBMIT_DIRECTORY", "SAGEMAKER_TRAINING_MODULE", "TRAINING_JOB_NAME", "SM_HP_MP_PARAMETERS"):
        monkeypatch.delenv(name, raising=False)
    import importlib

    import sagemaker_training.environment as toolkit

    toolkit = importlib.reload(toolkit)
    theirs = toolkit.Environment()
    facts = MachineFacts(num_cpus=theirs.num_cpus, num_gpus=theirs.num_gpus, num_neurons=theirs.num_neurons)  # the machine's
    ours = toolkit_environment(training_env(resource_config, INPUTS, hyperparameters, base_dir=tmp_path, facts=facts))
    expected = theirs.to_env_vars()
    assert sorted(ours) == sorted(expected)
    assert {key: value for key, value in ours.items() if value != expected[key]} == {}
    assert json.loads(ours["SM_USER_ARGS"]) == theirs.to_cmd_args()


def test_hyperparameters_become_the_scripts_arguments_as_the_toolkit_gives_them() -> None:
    decoded = decoded_hyperparameters({"epochs": "3", "name": "resnet", "s": '{"b": 2, "a": 1}', "n": "null", "q": '"quoted"'})
    assert decoded == {"epochs": 3, "name": "resnet", "s": {"b": 2, "a": 1}, "n": None, "q": "quoted"}
    assert command_arguments(decoded) == ["--epochs", "3", "-n", "", "--name", "resnet", "-q", "quoted", "-s", "a=1,b=2"]
