"""What every host of a user-workload job does with the workload before it serves or trains.

The launcher (``unpack_on_host``), before the role split, on every host: check the code channel's archive
against the SHA-256 the run was started with, unpack it into a fresh folder of its own, install its
requirements into that folder, import the module and check it against the contract, and split the job's
hyperparameters into the platform's, the loop's and the workload's (a key none of them knows is refused,
with the nearest name). A workload that cannot run fails every host here, with the reason, before any
data host serves or any trainer starts. The trainer processes it then starts find the folder in their
TrainerEnvironment (``prepared_workload``; training/host_environment.py names the variables the launcher
sets for them) and load the same module the same way. Everything here takes the host's environment as
read at its process's door: nothing reads os.environ or /opt/ml itself.
"""

from __future__ import annotations

import logging
import shutil
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from training.host_environment import HostEnvironment, TrainerEnvironment
from training.hyperparameters import (
    CODE_CHANNEL,
    PLATFORM_CHANNEL,
    RESUME_CHANNEL,
    HyperparameterError,
    PlatformSettings,
    parse_settings,
)
from training.trainers.config import WorkloadConfig
from training.workload.code import PACKAGES_DIR, find_archive, install_requirements, unpack_code
from training.workload.contexts import ChannelContext, routed_channel
from training.workload.contract import Workload, WorkloadError, load_workload, resolve_hyperparameters
from training.workload.samples import FeatureSpec, list_channel, probe_features

log = logging.getLogger(__name__)

# A node-local folder on the job's volume for a workload's caches (set by the launcher for every process
# of the host; the text built-in keeps its tokenised channels there).
CACHE_DIR_ENV = "TRAINING_CACHE_DIR"


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


def channel_folders(host: HostEnvironment) -> dict[str, Path]:
    """The channels this host received (the platform's own are not the workload's)."""
    root = host.base_dir / "input" / "data"
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


def prepare(code_dir: Path, packages_dir: Path | None, host: HostEnvironment,
            raw: Mapping[str, Any] | None = None, module: str = "") -> PreparedWorkload:
    """Load and check the workload in ``code_dir`` against this host's job (``raw``: its hyperparameters,
    the host's by default): ``module``, or the job's workload_module (a user's)."""
    raw = host.hyperparameters if raw is None else raw
    module = module or str(raw.get("workload_module", ""))
    workload = load_workload(code_dir, module, packages_dir)
    settings, config, hyperparameters = split_settings(raw, workload, host.shutdown_token)
    if config.eval_channel and not workload.has("eval_step"):
        raise WorkloadError(f"the job validates on {config.eval_channel!r} (eval_channel), but {workload.file} defines no eval_step()")
    return PreparedWorkload(workload, settings, config, hyperparameters, settings.workload_sha256, channel_folders(host))


def prepared_workload(process: TrainerEnvironment) -> PreparedWorkload:
    """In a trainer process: the workload its launcher unpacked and checked."""
    code_dir, packages = process.code()
    return prepare(code_dir, packages, process.host, module=process.workload_module)


def unpack_on_host(settings: PlatformSettings, host: HostEnvironment) -> tuple[Path, Path | None]:
    """The code channel's archive, checked and unpacked into a fresh folder, its requirements installed:
    (the code folder, the installed packages or None)."""
    archive = find_archive(host.channel(CODE_CHANNEL))
    # Fresh for every start of the host: a restarted container never runs a half-unpacked or stale folder.
    destination = host.base_dir / "workload" / settings.workload_sha256[:16]
    shutil.rmtree(destination, ignore_errors=True)
    unpack_code(archive, destination, settings.workload_sha256)
    packages = install_requirements(destination, settings.workload_requirements)
    log.info("%s unpacked into %s%s", settings.workload_module or settings.script_entry_point or "the script's code", destination,
             f", requirements installed into {PACKAGES_DIR}" if packages else "")
    return destination, packages
