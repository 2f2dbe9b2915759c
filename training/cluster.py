"""The cluster as one host sees it: SageMaker's resourceconfig.json turned into a small typed value.

SageMaker writes ``/opt/ml/input/config/resourceconfig.json`` on every instance of a training job. In a
heterogeneous job it names the current host, its instance group and every group with its hosts; in a
homogeneous job older platforms write only ``current_host`` and ``hosts`` and newer ones report a single
group called ``homogeneousCluster``. Host names (``algo-1``...) say nothing about groups, so this file is
the only place a host learns its group.

The base directory moves the way the sagemaker-training toolkit moves it (``SAGEMAKER_BASE_DIR``), which is
how the emulated cluster (``training/local``) gives each host its own tree.

    python -m training.cluster            # print the current host's view as JSON
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

# The toolkit's own name for the variable and its default (sagemaker_training/environment.py).
BASE_DIR_ENV = "SAGEMAKER_BASE_DIR"
DEFAULT_BASE_DIR = "/opt/ml"
# What SageMaker calls the single group of a homogeneous job.
HOMOGENEOUS_GROUP = "homogeneousCluster"
# Maps host names to addresses where DNS cannot (the emulated cluster's loopback addresses). JSON object.
HOST_ADDRESSES_ENV = "TRAINING_HOST_ADDRESSES"


class ClusterConfigError(ValueError):
    """resourceconfig.json is missing, unreadable or inconsistent."""


@dataclass(frozen=True)
class InstanceGroup:
    name: str
    instance_type: str
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Cluster:
    current_host: str
    current_group: str
    current_instance_type: str
    hosts: tuple[str, ...]
    groups: tuple[InstanceGroup, ...]
    network_interface: str = "eth0"

    @property
    def is_heterogeneous(self) -> bool:
        # As the toolkit decides it: more than one instance group.
        return len(self.groups) > 1

    def group(self, name: str) -> InstanceGroup:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(f"instance group {name!r} is not in this job; groups: {self.group_names}")

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(group.name for group in self.groups)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def base_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get(BASE_DIR_ENV, DEFAULT_BASE_DIR))


def config_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return base_dir(environ) / "input" / "config"


def parse_resource_config(raw: Mapping[str, object]) -> Cluster:
    """Build a Cluster from the parsed JSON of resourceconfig.json; raise ClusterConfigError on anything
    a SageMaker host could not have been given."""
    current_host = _require_str(raw, "current_host")
    hosts = _require_str_list(raw, "hosts")
    if current_host not in hosts:
        raise ClusterConfigError(f"current_host {current_host!r} is not among hosts {hosts}")
    raw_groups = raw.get("instance_groups")
    if raw_groups is None:
        # Older homogeneous jobs: no groups at all; every host is in the one group.
        instance_type = str(raw.get("current_instance_type", "unknown"))
        groups = (InstanceGroup(HOMOGENEOUS_GROUP, instance_type, tuple(hosts)),)
    else:
        groups = _parse_groups(raw_groups, hosts)
    current = [group for group in groups if current_host in group.hosts]
    if len(current) != 1:
        raise ClusterConfigError(f"host {current_host!r} belongs to {len(current)} instance groups, not 1")
    declared_group = raw.get("current_group_name", current[0].name)
    if declared_group != current[0].name:
        raise ClusterConfigError(
            f"current_group_name {declared_group!r} disagrees with instance_groups, which put "
            f"{current_host!r} in {current[0].name!r}"
        )
    return Cluster(
        current_host=current_host,
        current_group=current[0].name,
        current_instance_type=str(raw.get("current_instance_type", current[0].instance_type)),
        hosts=tuple(hosts),
        groups=groups,
        network_interface=str(raw.get("network_interface_name", "eth0")),
    )


def load_cluster(environ: Mapping[str, str] = os.environ) -> Cluster:
    path = config_dir(environ) / "resourceconfig.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ClusterConfigError(
            f"{path} does not exist: this is not a SageMaker host (set {BASE_DIR_ENV} to run elsewhere)"
        ) from None
    except json.JSONDecodeError as error:
        raise ClusterConfigError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ClusterConfigError(f"{path} holds a {type(raw).__name__}, not a JSON object")
    return parse_resource_config(raw)


def host_addresses(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Host name → address overrides; empty on SageMaker, where host names resolve through DNS."""
    raw = environ.get(HOST_ADDRESSES_ENV)
    if not raw:
        return {}
    try:
        addresses = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ClusterConfigError(f"{HOST_ADDRESSES_ENV} is not valid JSON: {error}") from None
    if not isinstance(addresses, dict):
        raise ClusterConfigError(f"{HOST_ADDRESSES_ENV} must be a JSON object of host → address")
    return {str(host): str(address) for host, address in addresses.items()}


def address_of(host: str, addresses: Mapping[str, str]) -> str:
    return addresses.get(host, host)


def _parse_groups(raw_groups: object, hosts: list[str]) -> tuple[InstanceGroup, ...]:
    if not isinstance(raw_groups, list) or not raw_groups:
        raise ClusterConfigError("instance_groups must be a non-empty list")
    groups = []
    for index, raw_group in enumerate(raw_groups):
        if not isinstance(raw_group, dict):
            raise ClusterConfigError(f"instance_groups[{index}] must be an object")
        groups.append(
            InstanceGroup(
                name=_require_str(raw_group, "instance_group_name", f"instance_groups[{index}]."),
                instance_type=_require_str(raw_group, "instance_type", f"instance_groups[{index}]."),
                hosts=tuple(_require_str_list(raw_group, "hosts", f"instance_groups[{index}].")),
            )
        )
    names = [group.name for group in groups]
    if len(set(names)) != len(names):
        raise ClusterConfigError(f"instance group names repeat: {names}")
    grouped = [host for group in groups for host in group.hosts]
    if sorted(grouped) != sorted(hosts):
        raise ClusterConfigError(f"the groups' hosts {sorted(grouped)} are not the job's hosts {sorted(hosts)}")
    return tuple(groups)


def _require_str(raw: Mapping[str, object], key: str, where: str = "") -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise ClusterConfigError(f"{where}{key} must be a non-empty string, got {value!r}")
    return value


def _require_str_list(raw: Mapping[str, object], key: str, where: str = "") -> list[str]:
    value = raw.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ClusterConfigError(f"{where}{key} must be a non-empty list of host names, got {value!r}")
    if len(set(value)) != len(value):
        raise ClusterConfigError(f"{where}{key} names a host twice: {value}")
    return value


if __name__ == "__main__":
    print(load_cluster().to_json())
