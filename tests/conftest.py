"""Shared fixtures: fake SageMaker host trees and small JPEG datasets."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

# Whatever the run puts in a temp folder (a cdk.out of ~70 MB for every synthesis, which the CDK never
# removes; the emulated hosts' files) goes in a folder of the run's own, inherited by every process it
# starts (the CDK's Node kernel, the hosts), and removed when the run ends.
RUN_TMP = tempfile.mkdtemp(prefix="hetero-tests-")
os.environ["TMPDIR"] = RUN_TMP
tempfile.tempdir = None  # read TMPDIR again
atexit.register(shutil.rmtree, RUN_TMP, ignore_errors=True)

# torch-xla's device must exist before torch's autograd engine first runs in this process, or a later
# XLA backward pass trips an engine assertion (the trainers themselves run in processes of their own).
os.environ.setdefault("PJRT_DEVICE", "CPU")
import torch_xla  # noqa: E402

torch_xla.device()

# Shard indexes the tests list are cached in a folder of the test run's own, not the machine's temp folder
# (inherited by the emulated hosts).
os.environ.setdefault("SHARD_INDEX_CACHE_DIR", tempfile.mkdtemp(prefix="shard-index-"))

from training.hyperparameters import PLATFORM_CHANNEL, TOKEN_FILE  # noqa: E402
from training.stop_signals import restore_stop_signals  # noqa: E402

# Every process a test starts, with SIGINT and SIGTERM at their defaults: the suite runs the same in the
# foreground, in the background and under CI (which starts it with SIGINT ignored, as a background job of a
# non-interactive shell is). The inherited ignore itself is tested where it matters, on purpose:
# tests/training/test_stop_signals.py and test_local_command.py's Ctrl-C.
restore_stop_signals()
from training.local.images import generated_samples, write_dataset, write_shards  # noqa: E402

TOKEN = "test-shutdown-token-0123456789"


def hetero_resource_config(current: str = "algo-1") -> dict[str, Any]:
    return {
        "current_host": current,
        "current_instance_type": "ml.c5.9xlarge" if current in ("algo-1", "algo-2") else "ml.p3.2xlarge",
        "current_group_name": "data_group" if current in ("algo-1", "algo-2") else "dnn_group",
        "hosts": ["algo-1", "algo-2", "algo-3"],
        "instance_groups": [
            {"instance_group_name": "data_group", "instance_type": "ml.c5.9xlarge", "hosts": ["algo-1", "algo-2"]},
            {"instance_group_name": "dnn_group", "instance_type": "ml.p3.2xlarge", "hosts": ["algo-3"]},
        ],
        "network_interface_name": "eth0",
    }


def platform_hyperparameters(**overrides: Any) -> dict[str, str]:
    values = {"role_map": json.dumps({"data_group": "data", "dnn_group": "dnn"})}
    return values | {key: str(value) for key, value in overrides.items()}


def write_host_tree(
    base: Path,
    resource_config: dict[str, Any] | str | None,
    hyperparameters: dict[str, str] | None = None,
    channels: dict[str, Path] | None = None,
) -> Path:
    """A fake /opt/ml under ``base``; a str resource_config is written verbatim (for malformed files)."""
    config = base / "input" / "config"
    config.mkdir(parents=True, exist_ok=True)
    if resource_config is not None:
        text = resource_config if isinstance(resource_config, str) else json.dumps(resource_config)
        (config / "resourceconfig.json").write_text(text)
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters or {}))
    (config / "inputdataconfig.json").write_text(json.dumps({name: {"TrainingInputMode": "File"} for name in channels or {}}))
    token = base / "input" / "data" / PLATFORM_CHANNEL / TOKEN_FILE  # the job's token, as its platform channel delivers it
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text(TOKEN)
    for name, folder in (channels or {}).items():
        link = base / "input" / "data" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(folder, target_is_directory=True)
    return base


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 classes × 24 real JPEG files of 96 px."""
    return write_dataset(tmp_path_factory.mktemp("images"), classes=4, per_class=24, size=96)


@pytest.fixture(scope="session")
def image_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same 96 JPEG files as ``images``, byte for byte, as 6 tar shards of 16 (WebDataset layout)."""
    root = tmp_path_factory.mktemp("image-shards")
    write_shards(root, generated_samples(classes=4, per_class=24, size=96, seed=0), per_shard=16)
    return root
