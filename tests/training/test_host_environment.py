"""The host's environment read once at the door (training/host_environment.py): what it holds, what it
refuses by name, and that it cannot be changed once read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.conftest import TOKEN, hetero_resource_config, platform_hyperparameters, write_host_tree
from training.cluster import BASE_DIR_ENV, HOST_ADDRESSES_ENV, ClusterConfigError
from training.host_environment import HostEnvironment
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
