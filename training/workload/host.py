"""What every host of a user-workload job does with the workload before it serves or trains.

The launcher (``unpack_on_host``), before the role split, on every host: check the code channel's archive
against the SHA-256 the run was started with, unpack it into a fresh folder of its own, install its
requirements into that folder, import the module and check it against the contract, and split the job's
hyperparameters into the platform's, the loop's and the workload's (a key none of them knows is refused,
with the nearest name). A workload that cannot run fails every host here, with the reason, before any
data host serves or any trainer starts. The trainer processes it then starts find the folder in the
environment (``prepared_workload``) and load the same module the same way.

    WORKLOAD_DIR_ENV  the unpacked code folder      WORKLOAD_PACKAGES_ENV  its installed requirements
    WORKLOAD_MODULE_ENV  the module, for a built-in (training/workloads/, in the image: nothing unpacked)
"""

from __future__ import annotations

import logging
import os
import shutil
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from training.cluster import base_dir
from training.hyperparameters import (
    CODE_CHANNEL,
    PLATFORM_CHANNEL,
    RESUME_CHANNEL,
    HyperparameterError,
    PlatformSettings,
    load_hyperparameters,
    load_shutdown_token,
    parse_settings,
)
from training.trainers.config import WorkloadConfig
from training.workload.code import PACKAGES_DIR, find_archive, install_requirements, unpack_code
from training.workload.contexts import ChannelContext, routed_channel
from training.workload.contract import Workload, WorkloadError, load_workload, resolve_hyperparameters
from training.workload.samples import FeatureSpec, list_channel, probe_features

log = logging.getLogger(__name__)

WORKLOAD_DIR_ENV = "TRAINING_WORKLOAD_DIR"
WORKLOAD_PACKAGES_ENV = "TRAINING_WORKLOAD_PACKAGES"
# A node-local folder on the job's volume for a workload's caches (set by the launcher for every process
# of the host; the text built-in keeps its tokenised channels there).
CACHE_DIR_ENV = "TRAINING_CACHE_DIR"
WORKLOAD_MODULE_ENV = "TRAINING_WORKLOAD_MODULE"  # the module to import (a built-in's; a user's is the job's workload_module)


def builtin_workload(variant: Any) -> tuple[Path, str]:
    """(code folder, module) of a PyTorch variant's built-in workload (training/workloads/)."""
    from training.variants import BUILTIN_WORKLOADS_DIR

    return BUILTIN_WORKLOADS_DIR, variant.workloads[0]


def workload_keys(workload: Workload) -> frozenset[str]:
    return frozenset(workload.hyperparameters)


def split_settings(raw: Mapping[str, Any], workload: Workload, token: str,
                   loop_config: type = WorkloadConfig) -> tuple[PlatformSettings, Any, types.MappingProxyType]:
    """The platform's settings, the loop's (``loop_config``: WorkloadConfig for PyTorch, KerasWorkloadConfig
    for TensorFlow) and the workload's own hyperparameters from the job's. A key that the workload declares
    and the loop also has is refused: it would mean two things."""
    platform_keys_ = {item.name for item in fields(loop_config)} | {item.name for item in fields(PlatformSettings)} | {"variant"}
    clashes = sorted(workload_keys(workload) & platform_keys_)
    if clashes:
        raise HyperparameterError(f"the workload declares {clashes} in HYPERPARAMETERS ({workload.file}), which the platform's loop "
                                  "or launcher sets: rename them (they would mean two things), or read the loop's from ctx")
    # The module's LOOP_DEFAULTS under the job's own values (SageMaker passes strings; so do these).
    loop = {key: str(value) for key, value in workload.loop_defaults.items()} | dict(raw)
    platform, config = parse_settings({key: value for key, value in loop.items() if key not in workload_keys(workload)}, loop_config,
                                      token, also_known=workload_keys(workload))
    return platform, config, resolve_hyperparameters(workload, raw)


def channel_folders(environ: Mapping[str, str] = os.environ) -> dict[str, Path]:
    """The channels this host received (the platform's own are not the workload's)."""
    root = base_dir(environ) / "input" / "data"
    skip = {PLATFORM_CHANNEL, RESUME_CHANNEL, CODE_CHANNEL}
    return {path.name: path for path in sorted(root.iterdir()) if path.is_dir() and path.name not in skip} if root.is_dir() else {}


@dataclass(frozen=True)
class PreparedWorkload:
    """A workload loaded on a host, with the job's settings split for it."""

    workload: Workload
    settings: PlatformSettings
    config: WorkloadConfig
    hyperparameters: Mapping[str, Any]
    sha256: str
    channels: Mapping[str, Path]

    def list(self, channel: str, *, training: bool, classes: Sequence[str] = ()) -> Sequence[Any]:
        """The channel as the workload lists it; ``classes``: the training channel's, for another channel."""
        ctx = ChannelContext(channel=channel, path=self.channel(channel), training=training, hyperparameters=self.hyperparameters,
                             channels=self.channels, training_channel=self.settings.data_channel, classes=tuple(classes))
        return list_channel(self.workload, ctx)

    def channel(self, name: str) -> Path:
        return routed_channel(self.channels, name)

    def features(self, samples: Sequence[Any], *, training: bool) -> tuple[FeatureSpec, ...]:
        return probe_features(self.workload, samples, seed=self.config.seed, hyperparameters=self.hyperparameters, training=training)


def prepare(code_dir: Path, packages_dir: Path | None, environ: Mapping[str, str] = os.environ,
            raw: Mapping[str, Any] | None = None, module: str = "") -> PreparedWorkload:
    """Load and check the workload in ``code_dir`` against this host's job: ``module``, or the job's
    workload_module (a user's)."""
    raw = load_hyperparameters(environ) if raw is None else raw
    module = module or str(raw.get("workload_module", ""))
    workload = load_workload(code_dir, module, packages_dir)
    settings, config, hyperparameters = split_settings(raw, workload, load_shutdown_token(environ))
    if config.eval_channel and not workload.has("eval_step"):
        raise WorkloadError(f"the job validates on {config.eval_channel!r} (eval_channel), but {workload.file} defines no eval_step()")
    return PreparedWorkload(workload, settings, config, hyperparameters, settings.workload_sha256, channel_folders(environ))


def prepared_workload(environ: Mapping[str, str] = os.environ) -> PreparedWorkload:
    """In a trainer process: the workload its launcher unpacked and checked."""
    try:
        code_dir = Path(environ[WORKLOAD_DIR_ENV])
    except KeyError:
        raise HyperparameterError(f"{WORKLOAD_DIR_ENV} is not set: the launcher starts this trainer with the unpacked workload") from None
    packages = environ.get(WORKLOAD_PACKAGES_ENV) or None
    return prepare(code_dir, Path(packages) if packages else None, environ, module=environ.get(WORKLOAD_MODULE_ENV, ""))


def unpack_on_host(settings: PlatformSettings, environ: Mapping[str, str] = os.environ) -> tuple[Path, Path | None]:
    """The code channel's archive, checked and unpacked into a fresh folder, its requirements installed:
    (the code folder, the installed packages or None)."""
    channel = base_dir(environ) / "input" / "data" / CODE_CHANNEL
    archive = find_archive(channel)
    # Fresh for every start of the host: a restarted container never runs a half-unpacked or stale folder.
    destination = base_dir(environ) / "workload" / settings.workload_sha256[:16]
    shutil.rmtree(destination, ignore_errors=True)
    unpack_code(archive, destination, settings.workload_sha256)
    packages = install_requirements(destination, settings.workload_requirements)
    log.info("%s unpacked into %s%s", settings.workload_module or settings.script_entry_point or "the script's code", destination,
             f", requirements installed into {PACKAGES_DIR}" if packages else "")
    return destination, packages
