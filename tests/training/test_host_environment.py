"""The host's environment read once at the door (training/host_environment.py): what it holds, what it
refuses by name, and that it cannot be changed once read; and a trainer process's, over its host's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.conftest import TOKEN, hetero_resource_config, platform_hyperparameters, write_host_tree
from training.cluster import BASE_DIR_ENV, HOST_ADDRESSES_ENV, ClusterConfigError
from training.host_environment import (
    CONTAINER_STARTED_ENV,
    GRAPH_EXTRACTION_ENV,
    PROGRESS_DIR_ENV,
    WORKLOAD_DIR_ENV,
    WORKLOAD_MODULE_ENV,
    WORKLOAD_PACKAGES_ENV,
    HostEnvironment,
    OutputPaths,
    TrainerEnvironment,
)
from training.hyperparameters import PLATFORM_CHANNEL, TOKEN_FILE, HyperparameterError


def host_tree(tmp_path: Path, images: Path | None = None) -> Path:
    return write_host_tree(tmp_path, hetero_resource_config("algo-1"), platform_hyperparameters(batch_size=8),
                           {"train": images} if images else None)


def test_a_host_tree_reads_as_one_frozen_value(tmp_path: Path, images: Path) -> None:
    base = host_tree(tmp_path, images)
    (base / "input" / "config" / "inputdataconfig.json").write_text(json.dumps({"train": {"S3DistributionType": "ShardedByS3Key"}}))
    host = HostEnvironment.read({BASE_DIR_ENV: str(base), HOST_ADDRESSES_ENV: json.dumps({"algo-1": "127.0.9.1"})})
    assert (host.cluster.current_host, host.cluster.current_group) == ("algo-1", "data_group")
    assert host.hyperparameters["batch_size"] == "8" and host.shutdown_token == TOKEN
    assert host.channel("train") == base / "input" / "data" / "train" and host.channel_is_sharded("train")
    assert not host.channel_is_sharded("validation")
    assert (host.bind_address(), host.address("algo-1"), host.address("algo-3")) == ("127.0.9.1", "127.0.9.1", "algo-3")
    assert (host.checkpoints_dir, host.output_data_dir, host.cache_dir) == (base / "checkpoints", base / "output" / "data", base / "cache")
    with pytest.raises(dataclasses.FrozenInstanceError):
        host.shutdown_token = "another"  # type: ignore[misc]
    with pytest.raises(TypeError):
        host.hyperparameters["batch_size"] = "9"  # type: ignore[index]


def test_on_sagemaker_a_host_listens_on_every_interface(tmp_path: Path) -> None:
    host = HostEnvironment.read({BASE_DIR_ENV: str(host_tree(tmp_path))})
    assert host.addresses == {} and host.bind_address() == "0.0.0.0"


@pytest.mark.parametrize(("damage", "error", "words"), [
    (lambda base: (base / "input" / "config" / "resourceconfig.json").unlink(), ClusterConfigError, "this is not a SageMaker host"),
    (lambda base: (base / "input" / "config" / "hyperparameters.json").write_text("[1]"), HyperparameterError, "must hold a JSON object"),
    (lambda base: (base / "input" / "data" / PLATFORM_CHANNEL / TOKEN_FILE).unlink(), HyperparameterError, "shutdown token"),
    (lambda base: (base / "input" / "config" / "inputdataconfig.json").write_text("{"), ClusterConfigError, "inputdataconfig.json is not valid JSON"),
    (lambda base: (base / "input" / "config" / "inputdataconfig.json").write_text('{"train": 3}'), ClusterConfigError,
     "channel name → its configuration"),
], ids=["no resourceconfig", "hyperparameters not an object", "no token", "inputdataconfig not JSON", "inputdataconfig not channels"])
def test_a_host_file_that_is_missing_or_wrong_is_refused_by_name_at_the_door(tmp_path: Path, damage, error: type[Exception],
                                                                              words: str) -> None:
    base = host_tree(tmp_path)
    damage(base)
    with pytest.raises(error, match=words):
        HostEnvironment.read({BASE_DIR_ENV: str(base)})


def test_a_trainer_process_reads_its_place_its_workload_and_its_launchers_folders_at_its_door(tmp_path: Path) -> None:
    base = host_tree(tmp_path)
    process = TrainerEnvironment.read({
        BASE_DIR_ENV: str(base), "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "PJRT_DEVICE": "CPU",
        WORKLOAD_DIR_ENV: str(tmp_path / "code"), WORKLOAD_PACKAGES_ENV: "", WORKLOAD_MODULE_ENV: "vision",
        PROGRESS_DIR_ENV: str(tmp_path / "progress"), CONTAINER_STARTED_ENV: "1700000000.5", GRAPH_EXTRACTION_ENV: "1",
    })
    assert (process.rank, process.world_size, process.local_rank, process.local_world_size) == (3, 4, 1, 2)
    assert process.host.cluster.current_host == "algo-1" and process.host.shutdown_token == TOKEN
    assert process.code() == (tmp_path / "code", None) and process.workload_module == "vision"
    assert process.outputs == OutputPaths(base / "model", base / "output" / "data", base / "checkpoints", tmp_path / "progress")
    assert (process.container_started_at, process.graph_extraction, process.pjrt_device) == (1700000000.5, True, "CPU")
    # A process started alone (a test, `hetero validate`'s trial): rank 0 of 1, no launcher's folders.
    horovods = TrainerEnvironment.read({BASE_DIR_ENV: str(base), "HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0",
                                        "HOROVOD_LOCAL_SIZE": "2"})
    assert (horovods.rank, horovods.world_size, horovods.local_rank, horovods.local_world_size) == (2, 4, 0, 2)
    torchruns = TrainerEnvironment.read({BASE_DIR_ENV: str(base), "RANK": "1", "WORLD_SIZE": "2", "HOROVOD_SIZE": "garbage"})
    assert (torchruns.rank, torchruns.world_size) == (1, 2)  # horovodrun's are not read where torchrun's are
    alone = TrainerEnvironment.read({BASE_DIR_ENV: str(base)})
    assert (alone.rank, alone.world_size, alone.local_world_size, alone.progress_dir, alone.container_started_at) == (0, 1, 1, None, None)
    assert not alone.graph_extraction and alone.outputs.progress_dir is None
    with pytest.raises(HyperparameterError, match=f"{WORKLOAD_DIR_ENV} is not set"):
        alone.code()
    with pytest.raises(dataclasses.FrozenInstanceError):
        alone.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize(("variables", "words"), [
    ({"RANK": "two"}, "RANK='two' is not a whole number"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a whole number of at least 1"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 of WORLD_SIZE=4"),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 of 2"),
    ({"HOROVOD_RANK": "x"}, "HOROVOD_RANK='x'"),
], ids=["not a number", "no process", "negative", "rank past its count", "local rank past its count", "horovod's not a number"])
def test_a_rank_its_launcher_could_not_have_written_is_refused_by_name(tmp_path: Path, variables: dict[str, str], words: str) -> None:
    with pytest.raises(HyperparameterError, match=words):
        TrainerEnvironment.read({BASE_DIR_ENV: str(host_tree(tmp_path))} | variables)
