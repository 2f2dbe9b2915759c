"""One homogeneous SageMaker host in a folder, and a PyTorch trainer built in this process from it, the way
a job's trainer process builds one: for the benchmarks (bench/gpu.py, bench/offload.py) and the tests,
which then time and check the very code a job runs (the launcher, the workload's checks and the runtime),
configured as the job configures it.

    trainer = single_host_trainer(Path("/tmp/run"), {"model": "cnn", "steps": 20}, {"train": images})
    trainer.run()
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.cluster import BASE_DIR_ENV
from training.host_environment import WORKLOAD_DIR_ENV, WORKLOAD_MODULE_ENV, WORKLOAD_PACKAGES_ENV, TrainerEnvironment
from training.hyperparameters import PLATFORM_CHANNEL, TOKEN_FILE
from training.variants import VARIANTS
from training.workload.host import builtin_workload

GROUP = "homogeneousCluster"


def write_single_host(base: Path, hyperparameters: Mapping[str, Any], channels: Mapping[str, Path], *, variant: str = "pytorch",
                      instance_type: str = "ml.p3.2xlarge") -> Path:
    """/opt/ml of the one host of a homogeneous job under ``base`` (its channels linked, not copied)."""
    config = base / "input" / "config"
    config.mkdir(parents=True, exist_ok=True)
    group = {"instance_group_name": GROUP, "instance_type": instance_type, "hosts": ["algo-1"]}
    (config / "resourceconfig.json").write_text(json.dumps({"current_host": "algo-1", "current_instance_type": instance_type,
                                                            "current_group_name": GROUP, "hosts": ["algo-1"], "instance_groups": [group]}))
    settings = {"role_map": json.dumps({GROUP: "dnn"}), "variant": variant} | {key: _text(value) for key, value in hyperparameters.items()}
    (config / "hyperparameters.json").write_text(json.dumps(settings))
    (config / "inputdataconfig.json").write_text(json.dumps({name: {"TrainingInputMode": "File"} for name in channels}))
    token = base / "input" / "data" / PLATFORM_CHANNEL / TOKEN_FILE
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text(secrets.token_hex(16))
    for name, folder in channels.items():
        link = base / "input" / "data" / name
        link.unlink(missing_ok=True)
        link.symlink_to(Path(folder).resolve(), target_is_directory=True)
    return base


def trainer_environment(base: Path, *, variant: str = "pytorch", code_dir: Path | None = None, module: str = "") -> dict[str, str]:
    """What the launcher gives the trainer process: the host's folder and the workload to load (the
    variant's built-in unless ``code_dir``/``module`` name a user's)."""
    if code_dir is None:
        code_dir, module = builtin_workload(VARIANTS[variant])
    return {BASE_DIR_ENV: str(base), WORKLOAD_DIR_ENV: str(code_dir), WORKLOAD_MODULE_ENV: module, WORKLOAD_PACKAGES_ENV: ""}


def single_host_trainer(base: Path, hyperparameters: Mapping[str, Any], channels: Mapping[str, Path], *, variant: str = "pytorch",
                        code_dir: Path | None = None, module: str = "", extra_environment: Mapping[str, str] | None = None) -> Any:
    """The runtime's trainer for a one-host job in ``base`` (training/trainers/pytorch_runtime.py)."""
    from training.trainers.pytorch_runtime import build_trainer

    write_single_host(base, hyperparameters, channels, variant=variant,
                      instance_type="ml.trn1.2xlarge" if VARIANTS[variant].accelerator == "trainium" else "ml.p3.2xlarge")
    environment = trainer_environment(base, variant=variant, code_dir=code_dir, module=module) | dict(extra_environment or {})
    return build_trainer(TrainerEnvironment.read(environment))


def _text(value: Any) -> str:
    """A hyperparameter as SageMaker passes it: a string (JSON's true/false for booleans)."""
    return json.dumps(value) if isinstance(value, bool) else str(value)
