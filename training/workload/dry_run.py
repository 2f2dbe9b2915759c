"""``hetero validate``'s check of a user workload: what every host will check at start, run here first on a
few local samples, so that a workload that cannot run is refused before anything is billed.

From the spec and its code folder (packed and unpacked exactly as the hosts receive it):

1. the requirements resolve (``pip install --dry-run``, from the shipped wheels when there are any);
2. the module imports without the platform at module scope, defines the contract's hooks with their
   signatures, each importable by name;
3. the job's hyperparameters split into the platform's, the loop's and the module's (typos named);
4. with local folders for the channels (``--channel train=DIR``): the channel lists, the first samples
   preprocess into the same keys, dtypes and shapes; the model builds; one training step on a batch of
   them returns a scalar loss that requires grad and is finite; the evaluation step, when there is a
   validation channel, returns per-sample values or scalars.

The step runs on this machine's CPU in fp32: it checks the contract, not the speed or the precision.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from training.data_service.dataset import ChannelError
from training.hyperparameters import to_hyperparameter_string
from training.variants import VARIANTS
from training.workload.code import CodeError, install_requirements, pack_code, unpack_code
from training.workload.contexts import ChannelContext, TrainContext
from training.workload.contract import WorkloadError, batch_keys_hint, load_workload, user_frame
from training.workload.host import split_settings
from training.workload.samples import BatchRecipe, check_evaluation_classes, classes_of, list_channel, make_batch, probe_features
from training.workload.tf_contract import load_keras_workload

DRY_RUN_SAMPLES = 4


def dry_run(spec: Any, code_dir: Path, channels: Mapping[str, Path], *, samples: int = DRY_RUN_SAMPLES,
            install: bool = True) -> dict[str, Any]:
    """Check a user workload spec's code against the contract (see the module docstring); a report of what
    was checked, or a WorkloadError / CodeError / HyperparameterError naming what is wrong."""
    code = spec.code
    if spec.is_script:
        return dry_run_script(spec, code_dir, install=install)
    packed = pack_code(code_dir)
    report: dict[str, Any] = {"module": code.module, "sha256": packed.sha256, "files": len(packed.files)}
    _check_channel_names(spec, channels)
    with tempfile.TemporaryDirectory(prefix="workload-dry-run-") as scratch:
        archive = Path(scratch) / "sourcedir.tar.gz"
        archive.write_bytes(packed.archive)
        unpacked = unpack_code(archive, Path(scratch) / "code", packed.sha256)
        try:
            packages = None
            if install and code.requirements:
                # Installed (into an environment of the dry run's own, seeing this one's packages), so that
                # the module imports with them, as on a host.
                packages = install_requirements(unpacked, code.requirements, Path(scratch) / "environment")
                report["requirements"] = "installed"
            if VARIANTS[spec.variant].contract == "tensorflow":
                report |= _check_keras(load_keras_workload(unpacked, code.module, packages), spec, packed.sha256, channels, samples)
            else:
                workload = load_workload(unpacked, code.module, packages)
                report |= _check_loaded(workload, spec, packed.sha256, channels, samples)
        except (WorkloadError, CodeError) as error:
            # Name the user's own files, not the dry run's copy of them.
            raise type(error)(str(error).replace(str(unpacked.resolve()), str(code_dir)).replace(str(unpacked), str(code_dir))) from None
        finally:
            _forget(unpacked)
    return report


def dry_run_script(spec: Any, code_dir: Path, *, install: bool = True) -> dict[str, Any]:
    """A script's check before anything is billed: its folder packs as the hosts receive it, its entry point
    is in it and compiles, and its requirements install. The script itself does not run here: what it does
    is its own (try it on the emulated cluster: ``hetero local``)."""
    code = spec.code
    packed = pack_code(code_dir)
    program = code.entry_point or code.command
    report: dict[str, Any] = {"script": program, "sha256": packed.sha256, "files": len(packed.files), "hooks": []}
    with tempfile.TemporaryDirectory(prefix="script-dry-run-") as scratch:
        archive = Path(scratch) / "sourcedir.tar.gz"
        archive.write_bytes(packed.archive)
        unpacked = unpack_code(archive, Path(scratch) / "code", packed.sha256)
        if code.entry_point:
            entry = unpacked / code.entry_point
            if not entry.is_file():
                shipped = sorted(str(path) for path in packed.files if str(path).endswith((".py", ".sh")))[:10]
                raise CodeError(f"the entry point {code.entry_point!r} is not in {code_dir} as it is packed (it holds {shipped}; "
                                ".git, virtual environments and caches are left out)")
            if entry.suffix == ".py":
                try:
                    compile(entry.read_bytes(), str(code_dir / code.entry_point), "exec")
                except SyntaxError as error:
                    raise CodeError(f"{code.entry_point} does not compile: {error.msg} at line {error.lineno}") from None
                report["compiles"] = True
        if install and code.requirements:
            install_requirements(unpacked, code.requirements, Path(scratch) / "environment")
            report["requirements"] = "installed"
    report["not_checked"] = ["the script itself (run it on the emulated cluster: hetero local SPEC --channel NAME=DIR)"]
    return report


def dry_run_builtin(spec: Any, channels: Mapping[str, Path], *, samples: int = DRY_RUN_SAMPLES) -> dict[str, Any]:
    """The same check of a PyTorch variant's built-in workload (training/workloads/) on local channels:
    its hyperparameters as the hosts split them, its listing, preprocessing and a training step."""
    from training.variants import VARIANTS
    from training.workload.host import builtin_workload

    code_dir, module = builtin_workload(VARIANTS[spec.variant])
    report: dict[str, Any] = {"module": module, "builtin": True, "not_checked": []}
    _check_channel_names(spec, channels)
    return report | _check_loaded(load_workload(code_dir, module, None), spec, "", channels, samples)


def _check_channel_names(spec: Any, channels: Mapping[str, Path]) -> None:
    unknown = sorted(set(channels) - {channel.name for channel in spec.inputs})
    if unknown:
        raise ChannelError(f"--channel {unknown[0]}: the spec has no such input (it has {sorted(channel.name for channel in spec.inputs)})")


def _check_loaded(workload: Any, spec: Any, sha256: str, channels: Mapping[str, Path], samples: int) -> dict[str, Any]:
    """Steps 3 and 4 of the module docstring for a loaded workload."""
    report: dict[str, Any] = {"hooks": sorted(workload.hooks), "not_checked": []}
    raw = {name: to_hyperparameter_string(value) for name, value in spec.hyperparameters.items()}
    raw |= {"role_map": '{"dry-run": "dnn"}', "workload_module": workload.name, "workload_sha256": sha256 or "0" * 64}
    _, config, hyperparameters = split_settings(raw, workload, "dry-run-token-of-sixteen")
    report["hyperparameters"] = dict(hyperparameters)
    if "train" in channels:
        report |= _dry_run_data(workload, config, hyperparameters, channels, samples)
        if config.eval_channel and config.eval_channel not in channels:
            report["not_checked"].append(f"eval_step on {config.eval_channel!r} (no --channel {config.eval_channel}=DIR)")
    else:
        report["not_checked"].append("the hooks on samples (no --channel train=DIR)")
    return report


def _check_keras(workload: Any, spec: Any, sha256: str, channels: Mapping[str, Path], samples: int) -> dict[str, Any]:
    """A TensorFlow workload: its hyperparameters split as the hosts split them, then (with a train
    channel) two steps of the platform's own Keras loop on this machine's CPU, over the local files, with
    the validation channel when given: the dataset's graph, the model, the steps and eval_step, exactly as
    a host runs them (training/trainers/keras_runtime.py's keras_trial)."""
    from training.trainers.config import KerasWorkloadConfig

    report: dict[str, Any] = {"hooks": sorted(workload.hooks), "not_checked": []}
    raw = {name: to_hyperparameter_string(value) for name, value in spec.hyperparameters.items()}
    raw |= {"role_map": '{"dry-run": "dnn"}', "workload_module": workload.name, "workload_sha256": sha256 or "0" * 64}
    _, config, hyperparameters = split_settings(raw, workload, "dry-run-token-of-sixteen", KerasWorkloadConfig)
    report["hyperparameters"] = dict(hyperparameters)
    if config.eval_channel and not workload.has("eval_step"):
        raise WorkloadError(f"the job validates on {config.eval_channel!r} (eval_channel), but {workload.file} defines no eval_step()")
    if "train" not in channels:
        report["not_checked"].append("the hooks on samples (no --channel train=DIR)")
        return report
    if config.eval_channel and config.eval_channel not in channels:
        report["not_checked"].append(f"eval_step on {config.eval_channel!r} (no --channel {config.eval_channel}=DIR)")
    from training.trainers.keras_runtime import keras_trial

    return report | keras_trial(workload, config, hyperparameters, channels, batch_size=samples)


def _dry_run_data(workload: Any, config: Any, hyperparameters: Mapping[str, Any], channels: Mapping[str, Path], samples: int) -> dict[str, Any]:
    import torch

    from training.trainers.pytorch_runtime import check_finite, step_output

    listed = list_channel(workload, ChannelContext("train", channels["train"], True, hyperparameters, channels))
    features = probe_features(workload, listed, seed=config.seed, hyperparameters=hyperparameters)
    count = min(samples, len(listed))
    recipe = BatchRecipe(workload.code_dir, workload.name, None, listed, hyperparameters, config.seed, features)
    batch, skipped = make_batch(workload, recipe, list(range(count)), list(range(len(listed))), [0] * count)
    report: dict[str, Any] = {"samples": len(listed), "classes": list(classes_of(listed)), "skipped": skipped,
                              "features": {spec.name: str(spec) for spec in features}}
    ctx = TrainContext(hyperparameters=hyperparameters, device=torch.device("cpu"), steps=config.steps, classes=classes_of(listed),
                       num_samples=len(listed), step=1, channels=dict(channels))
    torch.manual_seed(config.seed)
    model = _call("build_model", workload.build_model, ctx)
    if not isinstance(model, torch.nn.Module):
        raise WorkloadError(f"build_model returned a {type(model).__name__}: return a torch.nn.Module")
    optimizer, scheduler = _dry_run_optimizer(workload, model, ctx, hyperparameters)
    tensors = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in batch.items()}
    if workload.has("device_transform"):
        tensors = _call("device_transform", workload.device_transform, tensors, ctx)
    loss, metrics = step_output(_call("train_step", workload.train_step, model, dict(tensors), ctx), 1)
    report["trial_loss"] = check_finite(loss.item(), 1)
    report["trial_metrics"] = sorted(metrics)
    loss.backward()
    optimizer.step()
    if scheduler is not None:
        _call("the scheduler's step()", scheduler.step)
    if config.eval_channel:
        if not workload.has("eval_step"):
            raise WorkloadError(f"the job validates on {config.eval_channel!r} (eval_channel), but {workload.file} defines no eval_step()")
        if config.eval_channel in channels:
            evaluation = list_channel(workload, ChannelContext(config.eval_channel, channels[config.eval_channel], False, hyperparameters, channels,
                                                                  classes=classes_of(listed)))
            check_evaluation_classes(config.eval_channel, evaluation, classes_of(listed))
            eval_features = probe_features(workload, evaluation, seed=config.seed, hyperparameters=hyperparameters, training=False)
            eval_recipe = BatchRecipe(workload.code_dir, workload.name, None, evaluation, hyperparameters, config.seed, eval_features, training=False)
            eval_count = min(samples, len(evaluation))
            eval_batch, _ = make_batch(workload, eval_recipe, list(range(eval_count)), list(range(len(evaluation))), [0] * eval_count)
            tensors = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in eval_batch.items()}
            if workload.has("device_transform"):
                tensors = _call("device_transform", workload.device_transform, tensors, ctx)
            ctx.training = False
            with torch.no_grad():
                output = _call("eval_step", workload.eval_step, model.eval(), tensors, ctx)
            if not isinstance(output, Mapping) or not output:
                raise WorkloadError(f"eval_step returned a {type(output).__name__}: return {{name: per-sample values [B] or a scalar}}")
            values = {}
            for name, value in output.items():
                value = torch.as_tensor(value).float()
                if value.numel() != 1 and tuple(value.shape) != (eval_count,):
                    raise WorkloadError(f"eval_step's {name!r} has shape {list(value.shape)}: per-sample values [{eval_count}] or a scalar")
                values[str(name)] = round(float(value.mean()), 6)
            report["trial_eval"] = values
    if not all(math.isfinite(value) for value in report.get("trial_eval", {}).values()):
        raise WorkloadError(f"eval_step gave non-finite values on the first samples: {report['trial_eval']}")
    return report


def _dry_run_optimizer(workload: Any, model: Any, ctx: Any, hyperparameters: Mapping[str, Any]) -> tuple[Any, Any]:
    """The optimizer and scheduler as the runtime builds and checks them (a bare module, no device)."""
    from training.trainers.pytorch_runtime import checked_optimizer, default_optimizer

    if not workload.has("build_optimizer"):
        return default_optimizer(model, hyperparameters), None
    return checked_optimizer(_call("build_optimizer", workload.build_optimizer, model, ctx))


def _call(hook: str, function: Any, *args: Any) -> Any:
    try:
        return function(*args)
    except WorkloadError:
        raise
    except Exception as error:  # noqa: BLE001 — the user's hook, by name, with where in the user's code
        raise WorkloadError(f"{hook} raised {type(error).__name__} on the first samples{user_frame(error)}: {error}"
                            + batch_keys_hint(error, args)) from error


def _forget(folder: Path) -> None:
    """Drop every module the dry run imported from its copy of the code (siblings too) and the folder from
    the path, so that a second check (another spec) imports its own code."""
    import sys

    root = str(folder.resolve())
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", "") or "").startswith(root):
            del sys.modules[name]
    for entry in [entry for entry in sys.path if entry.startswith(root) or entry.startswith(str(folder.parent.resolve()))]:
        sys.path.remove(entry)
