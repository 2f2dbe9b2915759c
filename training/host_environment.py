"""One host's environment, read once at a process's door and passed down as one frozen value.

What a process on a SageMaker training host learns from outside comes from a few files under the base
directory (``/opt/ml``, moved by ``SAGEMAKER_BASE_DIR`` as the sagemaker-training toolkit moves it) and a few
variables: resourceconfig.json (the cluster and this host's group), hyperparameters.json, inputdataconfig.json
(how each channel was distributed), the job's shutdown token in the platform channel, and the emulated
cluster's host addresses. The entry point of each process reads them here, once: the launcher a
HostEnvironment, each trainer process a TrainerEnvironment (the host's, plus what its launcher and torchrun or
horovodrun set for it: its rank, the unpacked workload, the progress folder). A file or a variable that is
wrong is refused there with its named error, before any role starts, and no module below reads
``os.environ`` or ``/opt/ml`` for them again (tests/test_host_environment_door.py keeps it so; issue 45
moves the tf.data.service child here too).

The layout below the base directory, as SageMaker defines it:

    input/config/{resourceconfig,hyperparameters,inputdataconfig}.json
    input/data/<channel>/             each channel's files (the platform channel holds the token)
    checkpoints/                      synced to the job's CheckpointConfig S3 prefix
    model/                            uploaded as model.tar.gz when the job completes
    output/failure, output/data/      the FailureReason; files uploaded as output.tar.gz
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from training.cluster import Cluster, ClusterConfigError, base_dir, host_addresses, load_cluster
from training.hyperparameters import HyperparameterError, load_hyperparameters, load_shutdown_token

# What the launcher sets for the trainer processes it starts (training/dnn_host.py writes them, the trainers'
# door reads them). The workload: the unpacked code folder, its installed requirements, and the module to
# import (a built-in's; a user's is the job's workload_module).
WORKLOAD_DIR_ENV = "TRAINING_WORKLOAD_DIR"
WORKLOAD_PACKAGES_ENV = "TRAINING_WORKLOAD_PACKAGES"
WORKLOAD_MODULE_ENV = "TRAINING_WORKLOAD_MODULE"
# A folder every trainer process writes its step into after each step (the launcher reads it).
PROGRESS_DIR_ENV = "TRAINING_PROGRESS_DIR"
# The container's start (the launcher's first moment), wall-clock seconds: time to first batch counts from it.
CONTAINER_STARTED_ENV = "TRAINING_CONTAINER_STARTED_AT"
# Set by neuron_parallel_compile while it runs the trainer to collect its graphs (tensors hold no values).
GRAPH_EXTRACTION_ENV = "NEURON_EXTRACT_GRAPHS_ONLY"


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class HostEnvironment:
    """This host as SageMaker (or the emulated cluster) set it up. Build it with :meth:`read`."""

    base_dir: Path
    cluster: Cluster
    # hyperparameters.json as SageMaker writes it: names to strings (a local test may give other JSON values).
    hyperparameters: Mapping[str, Any]
    shutdown_token: str
    # Host name to address where DNS cannot resolve it (the emulated cluster's loopback addresses); empty on SageMaker.
    addresses: Mapping[str, str]
    # inputdataconfig.json: each channel's S3DistributionType and content settings, as SageMaker describes them.
    input_data_config: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> HostEnvironment:
        """This host's files and variables, checked; ClusterConfigError or HyperparameterError names what
        is missing or wrong."""
        root = base_dir(environ)
        return cls(
            base_dir=root,
            cluster=load_cluster(environ),
            hyperparameters=_frozen(load_hyperparameters(environ)),
            shutdown_token=load_shutdown_token(environ),
            addresses=_frozen(host_addresses(environ)),
            input_data_config=_frozen(read_input_data_config(root / "input" / "config" / "inputdataconfig.json")),
        )

    def channel(self, name: str) -> Path:
        """Where SageMaker puts a channel's files on this host (the folder may not exist: not routed here)."""
        return self.base_dir / "input" / "data" / name

    def channel_is_sharded(self, name: str) -> bool:
        """Whether this host got a ShardedByS3Key share of the channel rather than every object of it."""
        return self.input_data_config.get(name, {}).get("S3DistributionType") == "ShardedByS3Key"

    def address(self, host: str) -> str:
        """The address to reach a host at: its override here, else its name (DNS)."""
        return self.addresses.get(host, host)

    def bind_address(self) -> str:
        """Where this host's servers listen: every interface on SageMaker, its own address when emulated."""
        return self.addresses.get(self.cluster.current_host, "0.0.0.0")

    @property
    def checkpoints_dir(self) -> Path:
        return self.base_dir / "checkpoints"

    @property
    def output_data_dir(self) -> Path:
        return self.base_dir / "output" / "data"

    @property
    def cache_dir(self) -> Path:
        """Node-local caches on the job's volume (not the container's own disk)."""
        return self.base_dir / "cache"


@dataclass(frozen=True)
class OutputPaths:
    """Where a trainer writes: SageMaker's model, output data and checkpoint folders, and the launcher's
    progress folder (None: no launcher reads its progress, as in a test or ``hetero validate``)."""

    model_dir: Path
    output_data_dir: Path
    checkpoint_dir: Path
    progress_dir: Path | None = None

    @classmethod
    def under(cls, root: Path, progress_dir: Path | None = None) -> OutputPaths:
        """SageMaker's layout below a base directory (/opt/ml on a real host)."""
        return cls(root / "model", root / "output" / "data", root / "checkpoints", progress_dir)


def _count(environ: Mapping[str, str], name: str, default: int, *, least: int) -> int:
    """A count torchrun, horovodrun or the launcher set; HyperparameterError naming it when it is not one."""
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise HyperparameterError(f"{name}={text!r} is not a whole number of at least {least}: this trainer's launcher sets it")
    return value


def _optional_path(environ: Mapping[str, str], name: str) -> Path | None:
    text = environ.get(name)
    return Path(text) if text else None


@dataclass(frozen=True)
class TrainerEnvironment:
    """One trainer process: its host's environment, its place among the job's processes, and what its
    launcher prepared for it. Build it with :meth:`read`."""

    host: HostEnvironment
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    workload_dir: Path | None = None
    workload_packages: Path | None = None
    workload_module: str = ""
    progress_dir: Path | None = None
    container_started_at: float | None = None
    graph_extraction: bool = False
    pjrt_device: str = ""  # torch-xla's device kind (CPU on the emulated cluster)

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> TrainerEnvironment:
        """This process's host and place, checked: a rank or count that is not one is refused by name.
        RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun sets them (horovodrun's HOROVOD_*
        ones where torchrun's are absent); a process started alone is rank 0 of 1."""
        started = environ.get(CONTAINER_STARTED_ENV)
        try:
            started_at = float(started) if started else None
        except ValueError:
            started_at = None  # a clock reading, only for time to first batch: a bad one means "not known"
        def place(name: str, horovods: str, default: int, least: int) -> int:
            # torchrun's variable, else horovodrun's (read only when torchrun's is absent: a stray one
            # the image inherited must not refuse a torchrun rank), else a process started alone.
            return _count(environ, name if environ.get(name) else horovods, default, least=least)

        world_size = place("WORLD_SIZE", "HOROVOD_SIZE", 1, 1)
        local_world = place("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", 1, 1)
        rank = place("RANK", "HOROVOD_RANK", 0, 0)
        local_rank = place("LOCAL_RANK", "HOROVOD_LOCAL_RANK", 0, 0)
        if rank >= world_size or local_rank >= local_world:
            raise HyperparameterError(f"RANK={rank} of WORLD_SIZE={world_size}, LOCAL_RANK={local_rank} of {local_world}: "
                                      "a rank must be below its count")
        return cls(
            host=HostEnvironment.read(environ),
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world,
            workload_dir=_optional_path(environ, WORKLOAD_DIR_ENV),
            workload_packages=_optional_path(environ, WORKLOAD_PACKAGES_ENV),
            workload_module=environ.get(WORKLOAD_MODULE_ENV, ""),
            progress_dir=_optional_path(environ, PROGRESS_DIR_ENV),
            container_started_at=started_at,
            graph_extraction=bool(environ.get(GRAPH_EXTRACTION_ENV)),
            pjrt_device=environ.get("PJRT_DEVICE", ""),
        )

    @property
    def outputs(self) -> OutputPaths:
        return OutputPaths.under(self.host.base_dir, self.progress_dir)

    def code(self) -> tuple[Path, Path | None]:
        """(the unpacked workload's folder, its installed requirements or None), as the launcher set them."""
        if self.workload_dir is None:
            raise HyperparameterError(f"{WORKLOAD_DIR_ENV} is not set: the launcher starts this trainer with the unpacked workload")
        return self.workload_dir, self.workload_packages


def read_input_data_config(path: Path) -> dict[str, Any]:
    """inputdataconfig.json, or nothing where a host has none (SageMaker writes it on every host; a job with
    no channel has an empty one)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as error:
        raise ClusterConfigError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict) or not all(isinstance(value, dict) for value in raw.values()):
        raise ClusterConfigError(f"{path} must hold a JSON object of channel name → its configuration")
    return raw


__all__ = [
    "CONTAINER_STARTED_ENV",
    "GRAPH_EXTRACTION_ENV",
    "PROGRESS_DIR_ENV",
    "WORKLOAD_DIR_ENV",
    "WORKLOAD_MODULE_ENV",
    "WORKLOAD_PACKAGES_ENV",
    "ClusterConfigError",
    "HostEnvironment",
    "HyperparameterError",
    "OutputPaths",
    "TrainerEnvironment",
    "read_input_data_config",
]
