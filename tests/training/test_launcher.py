"""training/launcher.py: the command it builds, exit codes, and every bad input refused before anything
starts (each case runs the real entrypoint in a fresh process against a fake /opt/ml)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import hetero_resource_config, platform_hyperparameters, write_host_tree
from training.hyperparameters import HyperparameterError
from training.launcher import CONFIG_ERROR_EXIT, exit_status, trainer_command

REPO = Path(__file__).resolve().parents[2]


def test_torchrun_spans_the_dnn_group() -> None:
    command = trainer_command(
        "training.trainers.pytorch_vision", distribution="torchrun", nnodes=2, processes_per_host=4, node_rank=1,
        master_address="10.0.0.7", master_port=29500, python="python",
    )
    assert command == [
        "python", "-m", "training.torchrun", "--nnodes=2", "--nproc-per-node=4", "--node-rank=1",
        "--master-addr=10.0.0.7", "--master-port=29500", "-m", "training.trainers.pytorch_vision",
    ]


def test_no_distribution_runs_one_plain_process_and_refuses_more() -> None:
    kwargs = dict(distribution="none", node_rank=0, master_address="a", master_port=29500, python="python")
    assert trainer_command("m", nnodes=1, processes_per_host=1, **kwargs) == ["python", "-m", "m"]
    with pytest.raises(HyperparameterError, match="use torchrun \\(PyTorch\\) or horovod \\(TensorFlow\\)"):
        trainer_command("m", nnodes=1, processes_per_host=2, **kwargs)


def test_horovod_and_mirrored_start_the_module_itself_and_mirrored_stays_on_one_host() -> None:
    kwargs = dict(node_rank=0, master_address="a", master_port=29500, python="python")
    assert trainer_command("m", distribution="horovod", nnodes=2, processes_per_host=8, **kwargs) == ["python", "-m", "m"]
    assert trainer_command("m", distribution="mirrored", nnodes=1, processes_per_host=8, **kwargs) == ["python", "-m", "m"]
    with pytest.raises(HyperparameterError, match="'mirrored' runs on one host .* use distribution 'horovod'"):
        trainer_command("m", distribution="mirrored", nnodes=2, processes_per_host=1, **kwargs)


@pytest.mark.parametrize(("returncode", "status"), [(0, 0), (1, 1), (-9, 137), (-15, 143)])
def test_a_killed_trainer_is_a_failure(returncode: int, status: int) -> None:
    assert exit_status(returncode) == status


def run_launcher(base: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"SAGEMAKER_BASE_DIR": str(base), "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "training.launcher"], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30, "a refused job must end fast"
    return result


def empty_channel(tmp_path: Path) -> Path:
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    return tmp_path / "empty"


CASES = {
    "missing resourceconfig": (lambda tmp, images: (None, platform_hyperparameters(), {}), "resourceconfig.json does not exist"),
    "malformed resourceconfig": (lambda tmp, images: ("{oops", platform_hyperparameters(), {}), "is not valid JSON"),
    "group missing from the role map": (
        lambda tmp, images: (hetero_resource_config("algo-1"), platform_hyperparameters(role_map=json.dumps({"dnn_group": "dnn"})), {}),
        "RoleMapError: instance group 'data_group' is not in the role map",
    ),
    "unknown hyperparameter": (
        lambda tmp, images: (hetero_resource_config("algo-1"), platform_hyperparameters() | {"lerning_rate": "0.1"}, {}),
        "unknown hyperparameter 'lerning_rate' (did you mean 'learning_rate'?)",
    ),
    "unknown variant": (
        lambda tmp, images: (hetero_resource_config("algo-1"), platform_hyperparameters(variant="jax"), {}),
        "variant 'jax' has no trainer",
    ),
    "data host without its channel": (
        lambda tmp, images: (hetero_resource_config("algo-1"), platform_hyperparameters(data_connect_timeout_s=1), {}),
        "MissingChannelError: channel 'train' is not on this host",
    ),
    "data host with an empty channel": (
        lambda tmp, images: (hetero_resource_config("algo-2"), platform_hyperparameters(data_connect_timeout_s=1), {"train": empty_channel(tmp)}),
        "EmptyChannelError",
    ),
    "homogeneous host without its channel": (
        lambda tmp, images: (
            {"current_host": "algo-1", "hosts": ["algo-1"]},
            platform_hyperparameters(role_map=json.dumps({"homogeneousCluster": "dnn"})),
            {},
        ),
        "assign it to instance group 'homogeneousCluster'",
    ),
    "one process asked, several hosts": (
        lambda tmp, images: (
            {"current_host": "algo-1", "hosts": ["algo-1", "algo-2"]},
            platform_hyperparameters(role_map=json.dumps({"homogeneousCluster": "dnn"}), distribution="none"),
            {"train": images},
        ),
        "use torchrun (PyTorch) or horovod (TensorFlow)",
    ),
    "tensorflow with a PyTorch distribution": (
        lambda tmp, images: (hetero_resource_config("algo-3"), platform_hyperparameters(variant="tensorflow", distribution="torchrun"), {}),
        "variant 'tensorflow' runs with distribution ['horovod', 'mirrored', 'none'], not 'torchrun'",
    ),
    "tensorflow data host without its channel": (
        lambda tmp, images: (
            hetero_resource_config("algo-2"), platform_hyperparameters(variant="tensorflow", distribution="horovod", data_connect_timeout_s=1), {}
        ),
        "MissingChannelError: channel 'train' is not on this host",
    ),
    "a ResNet18 asked of the Keras trainer": (
        lambda tmp, images: (hetero_resource_config("algo-3"), platform_hyperparameters(variant="tensorflow", distribution="horovod", model="resnet18"), {}),
        "model must be one of ('cnn', 'resnet50'), got 'resnet18'",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_ends_the_host_with_one_clear_line(tmp_path: Path, images: Path, case: str) -> None:
    make, message = CASES[case]
    resource_config, hyperparameters, channels = make(tmp_path, images)
    base = write_host_tree(tmp_path / "opt" / "ml", resource_config, hyperparameters, channels)
    result = run_launcher(base)
    assert result.returncode == CONFIG_ERROR_EXIT, result.stdout + result.stderr
    assert message in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert not (base / "output" / "data" / "summary.json").exists()
    assert message in (base / "output" / "failure").read_text()  # becomes the job's FailureReason


def run_dnn_host_without_its_data_hosts(tmp_path: Path, subnet: int, hyperparameters: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path, float]:
    """The DNN host's launcher of a heterogeneous job whose data hosts never come up; returns the
    result, the host's /opt/ml and how long it took."""
    addresses = {name: f"127.0.{subnet}.{index + 2}" for index, name in enumerate(("algo-1", "algo-2", "algo-3"))}
    base = write_host_tree(tmp_path / "opt" / "ml", hetero_resource_config("algo-3"), hyperparameters)
    env = os.environ | {"SAGEMAKER_BASE_DIR": str(base), "PYTHONPATH": str(REPO), "TRAINING_HOST_ADDRESSES": json.dumps(addresses)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "training.launcher"], env=env, capture_output=True, text=True, timeout=120)
    return result, base, time.monotonic() - started


def test_a_dnn_host_whose_data_hosts_never_come_fails_within_the_bound(tmp_path: Path) -> None:
    hyperparameters = platform_hyperparameters(data_connect_timeout_s=3, master_port=29731, data_service_port=29732) | {
        "model": "cnn", "cnn_width": "8", "image_size": "32", "batch_size": "8", "steps": "5", "warmup_steps": "1",
    }
    result, base, elapsed = run_dnn_host_without_its_data_hosts(tmp_path, 79, hyperparameters)
    assert result.returncode == 1, result.stdout[-2000:]
    assert elapsed < 60
    failure = (base / "output" / "failure").read_text()
    assert failure.startswith("DataServiceUnavailableError: no data host answered within 3 s")
