"""What SageMaker's training toolkit gives an entry point, computed by us: the ``SM_*`` environment and the
command-line arguments a script written for SageMaker reads, so that it runs under our launcher as it
is (script mode: the issue "Your existing heterogeneous script").

The toolkit (the ``sagemaker-training`` package, which SageMaker's framework images run as their entry
point) reads ``/opt/ml/input/config/{resourceconfig,inputdataconfig,hyperparameters}.json`` and the
machine, and exports ``SM_HOSTS``, ``SM_CURRENT_HOST``, ``SM_CURRENT_INSTANCE_GROUP`` and its hosts,
``SM_INSTANCE_GROUPS``, ``SM_CHANNEL_<NAME>``, ``SM_HP_<NAME>``, ``SM_MODEL_DIR``, ``SM_TRAINING_ENV``
(all of it as JSON) and the rest, then runs the entry point with the hyperparameters as
``--name value`` arguments. ``training_env`` and ``toolkit_environment`` compute the same from the same files, without the
toolkit (our images need not carry it, nor its gevent and scipy): a pure function of the files' contents,
the machine's counts (``MachineFacts``) and the base folder. tests/sdk/test_script_environment.py holds it
to the toolkit itself, variable for variable, for heterogeneous and homogeneous jobs.

Two differences, on purpose: the platform's own channels (the shutdown token's, our packed code, a resumed
run's checkpoints) and hyperparameters are not the script's, so the launcher passes only the user's
(``user_inputs``); and the CPU count is the host's own (its CPU affinity: the emulated cluster shares a
machine's cores between its hosts), where the toolkit counts the machine's.

``script_environment`` reads this host's files and gives the script its whole environment and arguments
(training/script_mode.py starts it with them).

    env = toolkit_environment(training_env(resource_config, inputs, hyperparameters, base_dir=Path("/opt/ml"),
                                           facts=MachineFacts(num_cpus=8, num_gpus=1, num_neurons=0)))
    subprocess.Popen([sys.executable, "train.py", *json.loads(env["SM_USER_ARGS"])], env=os.environ | env)
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.cluster import base_dir as base_dir_of
from training.cluster import config_dir
from training.hyperparameters import CODE_CHANNEL, PLATFORM_CHANNEL, RESUME_CHANNEL, platform_keys

# The hyperparameters the toolkit reads for itself (sagemaker_training.params.SAGEMAKER_HYPERPARAMETERS):
# never the script's, nor among the framework parameters.
TOOLKIT_HYPERPARAMETERS = frozenset({
    "sagemaker_program", "sagemaker_submit_directory", "sagemaker_enable_cloudwatch_metrics", "sagemaker_region",
    "sagemaker_container_log_level", "sagemaker_job_name", "sagemaker_default_module_name", "sagemaker_tuning_objective_metric",
    "sagemaker_s3_output",
})
TOOLKIT_PREFIX = "sagemaker_"
# A framework parameter that puts the current group among those that distribute (the toolkit's list).
DISTRIBUTION_FLAGS = (
    "sagemaker_mpi_enabled", "sagemaker_parameter_server_enabled", "sagemaker_distributed_dataparallel_enabled",
    "sagemaker_pytorch_ddp_enabled", "sagemaker_pytorch_xla_multi_worker_enabled",
    "sagemaker_multi_worker_mirrored_strategy_enabled", "sagemaker_torch_distributed_enabled",
)
HOMOGENEOUS_GROUP = "homogeneousCluster"  # the toolkit's name for the group of a job without instance groups
INFO = 20  # logging.INFO: the toolkit's default log level
# The platform's channels are not the script's.
PLATFORM_CHANNELS = frozenset({PLATFORM_CHANNEL, CODE_CHANNEL, RESUME_CHANNEL})


@dataclass(frozen=True)
class MachineFacts:
    """What the toolkit reads from the machine rather than the files."""

    num_cpus: int
    num_gpus: int = 0
    num_neurons: int = 0


def decoded_hyperparameters(raw: Mapping[str, str]) -> dict[str, Any]:
    """hyperparameters.json's values as the toolkit reads them: each JSON-decoded where it parses
    (``"3"`` → 3, ``'"train.py"'`` → "train.py"), else the string itself. Pure."""
    decoded: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            decoded[key] = json.loads(value)
        except (ValueError, TypeError):
            decoded[key] = value
    return decoded


def command_arguments(hyperparameters: Mapping[str, Any]) -> list[str]:
    """The hyperparameters as the toolkit passes them to the entry point: ``--name value`` in name order
    (``-n`` for a one-letter name), a dict as ``k=v,k=v``, None as "". Pure."""

    def name(key: str) -> str:
        return f"--{key}" if len(key) > 1 else f"-{key}"

    def value(item: Any) -> str:
        if isinstance(item, Mapping):
            return ",".join(f"{k}={v}" for k, v in sorted(item.items()))
        return "" if item is None else str(item)

    return list(itertools.chain.from_iterable((name(key), value(hyperparameters[key])) for key in sorted(hyperparameters)))


def _env_value(value: Any) -> str:
    """A value as the toolkit exports it (sagemaker_training.mapping.to_env_vars). Pure."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _module_name(program: Any) -> Any:
    return program[:-3] if isinstance(program, str) and program.endswith(".py") else program


def training_env(
    resource_config: Mapping[str, Any],
    input_data_config: Mapping[str, Any],
    hyperparameters: Mapping[str, str],
    *,
    base_dir: Path,
    facts: MachineFacts,
    framework_module: str | None = None,
    job_name: str | None = None,
) -> dict[str, Any]:
    """The toolkit's training environment (``dict(sagemaker_training.environment.Environment())``, which
    it exports as SM_TRAINING_ENV) for these files' contents: ``hyperparameters`` as hyperparameters.json
    holds them (strings). Pure."""
    every = decoded_hyperparameters(hyperparameters)
    toolkit = {key: value for key, value in every.items() if key.startswith(TOOLKIT_PREFIX)}
    user = {key: value for key, value in every.items() if not key.startswith(TOOLKIT_PREFIX)}
    framework = {key: value for key, value in toolkit.items() if key not in TOOLKIT_HYPERPARAMETERS}
    current_group = resource_config.get("current_group_name", HOMOGENEOUS_GROUP)
    groups = list(resource_config.get("instance_groups", []))
    groups_by_name = {group["instance_group_name"]: group for group in groups}
    distributing = framework.get("sagemaker_distribution_instance_groups",
                                 [current_group] if any(framework.get(flag, False) for flag in DISTRIBUTION_FLAGS) else [])
    hosts = list(resource_config["hosts"])
    distribution_hosts = ([host for group in groups if group["instance_group_name"] in distributing for host in group["hosts"]]
                          if groups else list(hosts))
    master = distribution_hosts[0] if distribution_hosts else hosts[0]
    input_dir, output_dir = base_dir / "input", base_dir / "output"
    program = toolkit.get("sagemaker_program")
    return {
        "additional_framework_parameters": framework,
        "channel_input_dirs": {channel: str(input_dir / "data" / channel) for channel in input_data_config},
        "current_host": resource_config["current_host"],
        "current_instance_group": current_group,
        "current_instance_group_hosts": list(groups_by_name.get(current_group, {}).get("hosts", [])),
        "current_instance_type": resource_config.get("current_instance_type", "local"),
        "distribution_hosts": distribution_hosts,
        "distribution_instance_groups": distributing,
        "framework_module": framework_module,
        "hosts": hosts,
        "hyperparameters": user,
        "input_config_dir": str(input_dir / "config"),
        "input_data_config": dict(input_data_config),
        "input_dir": str(input_dir),
        "instance_groups": [group["instance_group_name"] for group in groups],
        "instance_groups_dict": groups_by_name,
        "is_hetero": len(groups) > 1,
        "is_master": resource_config["current_host"] == master,
        "is_modelparallel_enabled": None,
        "is_smddpmprun_installed": False,
        "is_smddprun_installed": False,
        "job_name": job_name,
        "log_level": toolkit.get("sagemaker_container_log_level", INFO),
        "master_hostname": master,
        "model_dir": str(base_dir / "model"),
        "module_dir": str(toolkit.get("sagemaker_submit_directory", str(base_dir / "code"))),
        "module_name": _module_name(str(program)),
        "network_interface_name": resource_config.get("network_interface_name", "eth0"),
        "num_cpus": facts.num_cpus,
        "num_gpus": facts.num_gpus,
        "num_neurons": facts.num_neurons,
        "output_data_dir": str(output_dir / "data"),
        "output_dir": str(output_dir),
        "output_intermediate_dir": str(output_dir / "intermediate"),
        "resource_config": dict(resource_config),
        "topology": list(resource_config.get("topology", [])),
        "user_entry_point": program,
    }


# What the toolkit exports under the training environment's own names (Environment.to_env_vars), and
# what it exports under names of its own.
EXPORTED = ("hosts", "network_interface_name", "user_entry_point", "resource_config", "input_data_config", "output_data_dir",
            "current_host", "current_instance_type", "current_instance_group", "current_instance_group_hosts", "instance_groups",
            "instance_groups_dict", "distribution_instance_groups", "is_hetero", "module_name", "log_level", "framework_module",
            "input_dir", "input_config_dir", "output_dir", "num_cpus", "num_gpus", "num_neurons", "model_dir", "module_dir",
            "output_intermediate_dir")
RENAMED = {"hps": "hyperparameters", "framework_params": "additional_framework_parameters"}


def toolkit_environment(env: Mapping[str, Any]) -> dict[str, str]:
    """The SM_* variables the toolkit exports for a training environment (``training_env``'s), as its
    ``Environment().to_env_vars()`` does. Pure."""
    exported: dict[str, Any] = {name: env[name] for name in EXPORTED} | {name: env[key] for name, key in RENAMED.items()}
    exported |= {"channels": sorted(env["channel_input_dirs"]), "training_env": dict(env),
                 "user_args": command_arguments(env["hyperparameters"])}
    if env["topology"]:
        exported["topology"] = env["topology"]
    exported |= {f"channel_{name}": path for name, path in env["channel_input_dirs"].items()}
    exported |= {f"hp_{name}": value for name, value in env["hyperparameters"].items()}
    return {f"SM_{key.upper()}": _env_value(value) for key, value in exported.items()}


def script_hyperparameters(raw: Mapping[str, Any]) -> dict[str, str]:
    """hyperparameters.json without the platform's own settings: the script's, and the toolkit's sagemaker_
    keys (the request's sagemaker_program). Pure."""
    return {key: str(value) for key, value in raw.items() if key not in platform_keys() | {"variant"}}


def script_inputs(input_data_config: Mapping[str, Any]) -> dict[str, Any]:
    """inputdataconfig.json without the platform's channels. Pure."""
    return {name: value for name, value in input_data_config.items() if name not in PLATFORM_CHANNELS}


def script_environment(hyperparameters: Mapping[str, Any], code_dir: Path, packages: Path | None, facts: MachineFacts,
                       environ: Mapping[str, str] = os.environ) -> tuple[dict[str, str], list[str]]:
    """(the script's whole environment, its arguments): this process's environment with the toolkit's
    SM_* variables for this host's resourceconfig.json and inputdataconfig.json, and the code folder (and
    its installed requirements) on PYTHONPATH."""
    config = config_dir(environ)
    resource = json.loads((config / "resourceconfig.json").read_text())
    inputs_file = config / "inputdataconfig.json"
    inputs = json.loads(inputs_file.read_text()) if inputs_file.is_file() else {}
    own = script_hyperparameters(hyperparameters) | {"sagemaker_submit_directory": str(code_dir)}
    env = training_env(resource, script_inputs(inputs), own, base_dir=base_dir_of(environ), facts=facts,
                       job_name=environ.get("TRAINING_JOB_NAME"), framework_module=environ.get("SAGEMAKER_TRAINING_MODULE"))
    path = [str(code_dir), *([str(packages)] if packages else []), *filter(None, [environ.get("PYTHONPATH", "")])]
    variables = dict(environ) | toolkit_environment(env) | {"PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}
    # The image's interpreter first (a command's `python`, `torchrun`), then the requirements' console
    # scripts (accelerate, deepspeed: <environment>/bin), then the rest.
    interpreter = str(Path(sys.executable).parent)
    scripts = [str(packages.parents[2] / "bin")] if packages else []
    variables["PATH"] = os.pathsep.join([interpreter, *scripts, *filter(None, [environ.get("PATH", "")])])
    return variables, command_arguments(env["hyperparameters"])
