"""One host's environment, read once at a process's door and passed down as one frozen value.

What a process on a SageMaker training host learns from outside comes from a few files under the base
directory (``/opt/ml``, moved by ``SAGEMAKER_BASE_DIR`` as the sagemaker-training toolkit moves it) and a few
variables: resourceconfig.json (the cluster and this host's group), hyperparameters.json, inputdataconfig.json
(how each channel was distributed), the job's shutdown token in the platform channel, and the emulated
cluster's host addresses. The entry point of each process (the launcher; issue 45 moves the trainers and the
tf.data.service child here too) reads them here, once: a file that is wrong is refused there with its named
error, before any role starts, and no module below reads ``os.environ`` or ``/opt/ml`` for them again.

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


__all__ = ["ClusterConfigError", "HostEnvironment", "HyperparameterError", "read_input_data_config"]
