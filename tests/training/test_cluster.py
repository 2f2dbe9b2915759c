"""training/cluster.py: resourceconfig.json in both SageMaker forms, refusals, and agreement with the
sagemaker-training toolkit on the same files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import hetero_resource_config, write_host_tree
from training.cluster import (
    HOMOGENEOUS_GROUP,
    ClusterConfigError,
    address_of,
    host_addresses,
    load_cluster,
    parse_resource_config,
)

HOMOGENEOUS_NEW = {
    "current_host": "algo-2",
    "current_instance_type": "ml.p3.2xlarge",
    "current_group_name": "homogeneousCluster",
    "hosts": ["algo-1", "algo-2"],
    "instance_groups": [{"instance_group_name": "homogeneousCluster", "instance_type": "ml.p3.2xlarge", "hosts": ["algo-1", "algo-2"]}],
    "network_interface_name": "eth0",
}
HOMOGENEOUS_OLD = {"current_host": "algo-1", "hosts": ["algo-1", "algo-2"], "network_interface_name": "ethwe"}


def test_heterogeneous_config_names_the_current_group_and_every_group() -> None:
    cluster = parse_resource_config(hetero_resource_config("algo-3"))
    assert cluster.current_group == "dnn_group"
    assert cluster.current_instance_type == "ml.p3.2xlarge"
    assert cluster.is_heterogeneous
    assert cluster.group("data_group").hosts == ("algo-1", "algo-2")
    assert cluster.group_names == ("data_group", "dnn_group")


@pytest.mark.parametrize("raw", [HOMOGENEOUS_NEW, HOMOGENEOUS_OLD], ids=["with-groups", "without-groups"])
def test_homogeneous_config_is_one_group_of_every_host(raw: dict) -> None:
    cluster = parse_resource_config(raw)
    assert cluster.current_group == HOMOGENEOUS_GROUP
    assert not cluster.is_heterogeneous
    assert cluster.group(HOMOGENEOUS_GROUP).hosts == ("algo-1", "algo-2")


def test_unknown_group_lookup_lists_the_groups() -> None:
    with pytest.raises(KeyError, match="data_group"):
        parse_resource_config(hetero_resource_config()).group("nope")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"current_host": "algo-9"}, "not among hosts"),
        ({"current_host": ""}, "current_host must be"),
        ({"hosts": []}, "hosts must be a non-empty list"),
        ({"hosts": ["algo-1", "algo-1", "algo-2", "algo-3"]}, "names a host twice"),
        ({"current_group_name": "dnn_group"}, "disagrees with instance_groups"),
        ({"instance_groups": []}, "non-empty list"),
        ({"instance_groups": ["x"]}, r"instance_groups\[0\] must be an object"),
        (
            {"instance_groups": [{"instance_group_name": "a", "instance_type": "ml.c5.xlarge", "hosts": ["algo-1", "algo-2", "algo-3"]},
                                 {"instance_group_name": "a", "instance_type": "ml.c5.xlarge", "hosts": ["algo-4"]}]},
            "repeat",
        ),
        (
            {"instance_groups": [{"instance_group_name": "a", "instance_type": "ml.c5.xlarge", "hosts": ["algo-1", "algo-2"]}]},
            "are not the job's hosts",
        ),
        (
            {"instance_groups": [{"instance_group_name": "a", "hosts": ["algo-1", "algo-2", "algo-3"]}]},
            r"instance_groups\[0\]\.instance_type",
        ),
    ],
)
def test_inconsistent_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ClusterConfigError, match=message):
        parse_resource_config(hetero_resource_config() | change)


def test_missing_file_says_how_to_run_elsewhere(tmp_path: Path) -> None:
    with pytest.raises(ClusterConfigError, match="SAGEMAKER_BASE_DIR"):
        load_cluster({"SAGEMAKER_BASE_DIR": str(tmp_path)})


@pytest.mark.parametrize(("text", "message"), [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object")])
def test_malformed_file_is_refused(tmp_path: Path, text: str, message: str) -> None:
    write_host_tree(tmp_path, text)
    with pytest.raises(ClusterConfigError, match=message):
        load_cluster({"SAGEMAKER_BASE_DIR": str(tmp_path)})


def test_base_dir_moves_with_the_environment(tmp_path: Path) -> None:
    write_host_tree(tmp_path, hetero_resource_config("algo-2"))
    assert load_cluster({"SAGEMAKER_BASE_DIR": str(tmp_path)}).current_host == "algo-2"


def test_host_addresses_map_overrides_names_only_where_given() -> None:
    addresses = host_addresses({"TRAINING_HOST_ADDRESSES": json.dumps({"algo-1": "127.0.5.2"})})
    assert address_of("algo-1", addresses) == "127.0.5.2"
    assert address_of("algo-2", addresses) == "algo-2"
    assert host_addresses({}) == {}
    with pytest.raises(ClusterConfigError, match="JSON object"):
        host_addresses({"TRAINING_HOST_ADDRESSES": "[1]"})


TOOLKIT_VIEW = """
import json
from sagemaker_training import environment
env = environment.Environment()
print(json.dumps({
    "current_host": env.current_host,
    "current_group": env.current_instance_group,
    "current_instance_type": env.current_instance_type,
    "hosts": env.hosts,
    "groups": {name: group["hosts"] for name, group in env.instance_groups_dict.items()},
    "current_group_hosts": env.current_instance_group_hosts,
    "is_hetero": env.is_hetero,
}))
"""


def toolkit_view(base: Path) -> dict:
    # The toolkit reads SAGEMAKER_BASE_DIR at import, so each tree needs a fresh interpreter.
    result = subprocess.run(
        [sys.executable, "-c", TOOLKIT_VIEW], env={"SAGEMAKER_BASE_DIR": str(base), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "raw",
    [hetero_resource_config("algo-1"), hetero_resource_config("algo-3"), HOMOGENEOUS_NEW, HOMOGENEOUS_OLD],
    ids=["hetero-data-host", "hetero-dnn-host", "homogeneous", "homogeneous-old"],
)
def test_parser_agrees_with_the_sagemaker_training_toolkit(tmp_path: Path, raw: dict) -> None:
    write_host_tree(tmp_path, raw)
    ours = load_cluster({"SAGEMAKER_BASE_DIR": str(tmp_path)})
    theirs = toolkit_view(tmp_path)
    assert ours.current_host == theirs["current_host"]
    assert ours.current_group == theirs["current_group"]
    assert list(ours.hosts) == theirs["hosts"]
    assert ours.is_heterogeneous == theirs["is_hetero"]
    if "instance_groups" in raw:
        assert {group.name: list(group.hosts) for group in ours.groups} == theirs["groups"]
        assert list(ours.group(ours.current_group).hosts) == theirs["current_group_hosts"]
        assert ours.current_instance_type == theirs["current_instance_type"]
    else:
        # Without instance_groups the toolkit reports no groups at all; we make the one implied group.
        assert theirs["groups"] == {} and ours.group(HOMOGENEOUS_GROUP).hosts == ("algo-1", "algo-2")
