"""training/hyperparameters.py: the container contract, typed and strict."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest

from tests.conftest import TOKEN, hetero_resource_config, platform_hyperparameters
from training.cluster import BASE_DIR_ENV, parse_resource_config
from training.hyperparameters import HyperparameterError, PlatformSettings, RoleMapError, build, parse_settings
from training.trainers.config import VisionConfig


def test_settings_and_trainer_config_are_split_and_typed() -> None:
    raw = platform_hyperparameters(data_service_port=7000) | {"batch_size": "64", "learning_rate": "0.1", "cached_input_batches": "4"}
    settings, config = parse_settings(raw | {"sagemaker_program": "launcher.py"}, VisionConfig, TOKEN)
    assert settings.data_service_port == 7000
    assert dict(settings.role_map) == {"data_group": "data", "dnn_group": "dnn"}
    assert (config.batch_size, config.learning_rate, config.cached_input_batches) == (64, 0.1, 4)


def test_unknown_hyperparameter_is_refused_with_the_nearest_name() -> None:
    with pytest.raises(HyperparameterError, match=r"unknown hyperparameter 'lerning_rate' \(did you mean 'learning_rate'\?\)"):
        parse_settings(platform_hyperparameters() | {"lerning_rate": "0.1"}, VisionConfig, TOKEN)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("batch_size", "sixty", "not a valid int"),
        ("batch_size", "2.5", "not a valid int"),
        ("cached_input_batches", "-1", "cached_input_batches must be in 0..100000"),
        ("steps", "0", "steps must be in 1..10000000"),
        ("steps", str(10**30), "steps must be in 1..10000000"),
        ("batch_size", str(10**9), "batch_size must be in 1..65536"),
        ("momentum", "-0.5", "momentum must be in 0..0.999"),
        ("learning_rate", "nan", "not a valid float"),
        ("learning_rate", "inf", "not a valid float"),
        ("seed", str(2**32), "seed must be in"),
        ("warmup_steps", "100", "warmup_steps must be in"),
        ("model", "vgg", "model must be one of"),
        ("augment", "extreme", "augment must be one of"),
        ("image_size", "4", "image_size must be in"),
        ("role_map", "[1]", "not a valid JSON object"),
        ("distribution", "mpi", "distribution 'mpi' is not one of"),
        ("shutdown_token", TOKEN, "must not be a hyperparameter"),
        ("data_service_port", "80", "port in 1024..65535"),
    ],
)
def test_bad_values_name_the_hyperparameter(key: str, value: str, message: str) -> None:
    with pytest.raises(HyperparameterError, match=message):
        parse_settings(platform_hyperparameters() | {key: value}, VisionConfig, TOKEN)


def test_role_map_and_token_are_required() -> None:
    with pytest.raises(HyperparameterError, match="'role_map' is required"):
        parse_settings({}, VisionConfig, TOKEN)
    with pytest.raises(HyperparameterError, match="at least 16 characters"):
        parse_settings(platform_hyperparameters(), VisionConfig, "short")


def test_the_token_comes_from_the_platform_channel_and_never_leaves_as_a_hyperparameter(tmp_path) -> None:
    from tests.conftest import write_host_tree
    from training.hyperparameters import load_settings

    write_host_tree(tmp_path, hetero_resource_config(), platform_hyperparameters())
    settings, _ = load_settings(VisionConfig, {BASE_DIR_ENV: str(tmp_path)})
    assert settings.shutdown_token == TOKEN
    assert "shutdown_token" not in settings.to_hyperparameters()
    (tmp_path / "input" / "data" / "platform" / "shutdown_token").unlink()
    with pytest.raises(HyperparameterError, match="no 'platform' channel with its shutdown token"):
        load_settings(VisionConfig, {BASE_DIR_ENV: str(tmp_path)})


@pytest.mark.parametrize(
    ("roles", "message"),
    [({"a": "data"}, "exactly one 'dnn'"), ({"a": "dnn", "b": "dnn"}, "exactly one 'dnn'"), ({"a": "dnn", "b": "cpu"}, "unknown roles")],
)
def test_role_map_needs_one_dnn_group_and_known_roles(roles: dict, message: str) -> None:
    with pytest.raises(RoleMapError, match=message):
        PlatformSettings(role_map=roles, shutdown_token=TOKEN)


def test_every_group_of_the_job_needs_a_role() -> None:
    cluster = parse_resource_config(hetero_resource_config())
    settings = PlatformSettings(role_map={"dnn_group": "dnn"}, shutdown_token=TOKEN)
    with pytest.raises(RoleMapError, match="'data_group' is not in the role map"):
        settings.check_cluster(cluster)
    extra = PlatformSettings(role_map={"dnn_group": "dnn", "data_group": "data", "gpu2": "data"}, shutdown_token=TOKEN)
    with pytest.raises(RoleMapError, match=r"\['gpu2'\] that this job does not have"):
        extra.check_cluster(cluster)


def test_platform_settings_round_trip_through_sagemaker_strings() -> None:
    settings = PlatformSettings(role_map={"d": "data", "g": "dnn"}, shutdown_token=TOKEN, data_idle_timeout_s=7.5, processes_per_host=2)
    strings = settings.to_hyperparameters()
    assert all(isinstance(value, str) for value in strings.values())
    assert json.loads(strings["role_map"]) == {"d": "data", "g": "dnn"}
    assert "shutdown_token" not in strings  # never a hyperparameter: it arrives as a file
    assert build(PlatformSettings, strings) == dataclasses.replace(settings, shutdown_token="")


def test_data_service_targets_follow_the_role_map_and_address_map() -> None:
    cluster = parse_resource_config(hetero_resource_config())
    settings = PlatformSettings(role_map={"data_group": "data", "dnn_group": "dnn"}, shutdown_token=TOKEN, data_service_port=7001)
    assert settings.data_service_targets(cluster, {"algo-1": "127.0.9.2"}) == ["127.0.9.2:7001", "algo-2:7001"]


@dataclass(frozen=True)
class Flags:
    enabled: bool = False


@pytest.mark.parametrize(("text", "value"), [("true", True), ("False", False), ("1", True), ("no", False), (True, True)])
def test_booleans_accept_the_usual_spellings(text: object, value: bool) -> None:
    assert build(Flags, {"enabled": text}).enabled is value


def test_a_boolean_that_is_neither_is_refused() -> None:
    with pytest.raises(HyperparameterError, match="'enabled'='maybe' is not a valid bool"):
        build(Flags, {"enabled": "maybe"})
