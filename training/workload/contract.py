"""The workload contract, version 1: the named functions a user's module defines, found and checked by name.

A workload is plain Python (a module, or a package's module) that imports nothing of the platform at
module scope: the platform imports it on every host, looks its functions up by name, and passes them
context objects (training/workload/contexts.py). The shape follows the split the field settled on: the
user writes what is theirs (reading a dataset, preprocessing a sample, a model, one step: Ray Data's
``map_batches`` function and Ray Train's loop body, Lightning's ``training_step``, a SageMaker script's
model code), the platform owns the loop around it (where batches come from, devices, DDP or XLA,
precision, backward and the optimizer step, the stop vote, checkpoints, validation, metrics, the
summary), so that the same file trains homogeneous, heterogeneous and on Trainium.

    HYPERPARAMETERS = {"learning_rate": 0.01}          # optional: the module's own, with their defaults
    def list_samples(ctx): ...                         # a channel's samples: small picklable items
    def preprocess(sample, ctx): ...                   # CPU, ctx.rng seeded by the platform → dict of arrays
    def build_model(ctx): ...                          # a torch.nn.Module
    def build_optimizer(model, ctx): ...               # optional: an optimizer, or (optimizer, scheduler)
    def train_step(model, batch, ctx): ...             # the loss (a scalar tensor), or (loss, {name: scalar})
    def eval_step(model, batch, ctx): ...              # optional: {name: per-sample values [B] or a scalar}
    def device_transform(batch, ctx): ...              # optional: on the device, before each step

Data hosts import the module by name in their worker processes (nothing is pickled but the samples), so
each hook must be a plain module-level function of the module (no lambda, closure or ``__main__``
function). Every check here names the hook and the file searched.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTRACT_VERSION = 1
# Hook name → its parameters (the platform passes them positionally, in this order).
REQUIRED_HOOKS: Mapping[str, tuple[str, ...]] = {
    "list_samples": ("ctx",),
    "preprocess": ("sample", "ctx"),
    "build_model": ("ctx",),
    "train_step": ("model", "batch", "ctx"),
}
OPTIONAL_HOOKS: Mapping[str, tuple[str, ...]] = {
    "build_optimizer": ("model", "ctx"),
    "eval_step": ("model", "batch", "ctx"),
    "device_transform": ("batch", "ctx"),
}
HOOKS = {**REQUIRED_HOOKS, **OPTIONAL_HOOKS}
# The platform's top-level packages: a workload imports none of them at module scope (inside a function,
# for a reader, it may).
PLATFORM_PACKAGES = frozenset({"training", "lambdas", "infra", "hetero"})
HYPERPARAMETER_TYPES = (bool, int, float, str)


class WorkloadError(ValueError):
    """A workload module that the platform cannot run; the message names the hook and the file."""


class WorkloadImportError(WorkloadError):
    """The module cannot be found or raised while it was imported."""


class MissingHookError(WorkloadError):
    """A required function is not defined (or a name is not a function)."""


class HookSignatureError(WorkloadError):
    """A hook does not take the arguments the platform passes."""


class NotImportableByNameError(WorkloadError):
    """A hook that a data host's worker could not import by its name (a lambda, a closure, __main__)."""


class PlatformImportError(WorkloadError):
    """The module imports the platform at module scope."""


@dataclass(frozen=True)
class Workload:
    """A user's module, loaded and checked: its hooks by name, and its declared hyperparameters."""

    module: types.ModuleType
    name: str  # the dotted module name it was imported by
    code_dir: Path
    hooks: Mapping[str, Callable[..., Any]]
    hyperparameters: Mapping[str, bool | int | float | str]  # declared defaults

    @property
    def file(self) -> str:
        return str(getattr(self.module, "__file__", self.name))

    def has(self, hook: str) -> bool:
        return hook in self.hooks

    def __getattr__(self, hook: str) -> Callable[..., Any]:
        try:
            return self.__dict__["hooks"][hook]
        except KeyError:
            raise AttributeError(hook) from None


def add_to_path(*folders: Path | None) -> None:
    """Put the code folder (and its installed requirements) first on the import path, once each."""
    for folder in reversed([folder for folder in folders if folder is not None]):
        text = str(folder)
        if text not in sys.path:
            sys.path.insert(0, text)


def load_workload(code_dir: Path, module: str, packages_dir: Path | None = None) -> Workload:
    """Import ``module`` from ``code_dir`` and check it against the contract (check_module)."""
    code_dir = Path(code_dir).resolve()
    add_to_path(code_dir, packages_dir)
    _refuse_platform_imports(code_dir, module)
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name and module.startswith(error.name):
            raise WorkloadImportError(f"no module {module!r} in the code folder {code_dir} (looked for {module.replace('.', '/')}.py "
                                      f"or its package)") from None
        raise WorkloadImportError(f"importing workload module {module!r} ({code_dir}) failed: it imports {error.name!r}, which is "
                                  "not installed: add it to the workload's requirements file") from None
    except Exception as error:  # noqa: BLE001 — whatever the user's module raises is theirs to fix, by name
        raise WorkloadImportError(f"importing workload module {module!r} ({code_dir}) raised {type(error).__name__}: {error}") from None
    return check_module(loaded, module, code_dir)


def check_module(loaded: types.ModuleType, name: str, code_dir: Path) -> Workload:
    """The hooks of an imported module, each checked: present, a function of this module taking the
    contract's arguments; and its HYPERPARAMETERS, if any, a dict of scalars."""
    where = getattr(loaded, "__file__", name)
    hooks: dict[str, Callable[..., Any]] = {}
    for hook, parameters in HOOKS.items():
        function = getattr(loaded, hook, None)
        if function is None:
            if hook in REQUIRED_HOOKS:
                raise MissingHookError(_missing(hook, loaded, where))
            continue
        hooks[hook] = _checked_hook(hook, function, parameters, name, where)
    declared = getattr(loaded, "HYPERPARAMETERS", {})
    if not isinstance(declared, Mapping) or not all(isinstance(key, str) and key.isidentifier() for key in declared):
        raise WorkloadError(f"HYPERPARAMETERS in {where} must be a dict of name → default value")
    bad = {key: value for key, value in declared.items() if not isinstance(value, HYPERPARAMETER_TYPES)}
    if bad:
        raise WorkloadError(f"HYPERPARAMETERS in {where}: {bad} are not bool, int, float or str (SageMaker passes hyperparameters as strings)")
    return Workload(loaded, name, code_dir, types.MappingProxyType(hooks), types.MappingProxyType(dict(declared)))


def _missing(hook: str, loaded: types.ModuleType, where: str) -> str:
    defined = [name for name, value in vars(loaded).items() if callable(value) and not name.startswith("_")]
    close = difflib.get_close_matches(hook, defined, n=1)
    hint = f" (did you mean to name {close[0]!r} {hook!r}?)" if close else ""
    return (f"the workload module {where} defines no {hook}(){hint}; a workload defines "
            f"{', '.join(REQUIRED_HOOKS)} (and optionally {', '.join(OPTIONAL_HOOKS)})")


def _checked_hook(hook: str, function: Any, parameters: tuple[str, ...], module: str, where: str) -> Callable[..., Any]:
    if not callable(function):
        raise MissingHookError(f"{hook} in {where} is a {type(function).__name__}, not a function")
    qualname = getattr(function, "__qualname__", "")
    owner = getattr(function, "__module__", None)
    if "<lambda>" in qualname or "<locals>" in qualname or owner in (None, "__main__") or owner != module:
        defined = f"defined in {owner!r} as {qualname!r}" if owner else "with no module of its own"
        raise NotImportableByNameError(
            f"{hook} in {where} is {defined}: data hosts import hooks by name ({module}.{hook}) in their worker processes, "
            f"so define it with def at the top level of {module}")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return function
    try:
        signature.bind(*parameters)
    except TypeError:
        expected = f"{hook}({', '.join(parameters)})"
        raise HookSignatureError(f"{hook} in {where} takes {signature}, but the platform calls {expected}") from None
    return function


def _refuse_platform_imports(code_dir: Path, module: str) -> None:
    """A workload imports nothing of the platform at module scope: the saved model then loads without the
    platform, and a data host's workers import it with nothing else set up. Read from its source."""
    base = code_dir.joinpath(*module.split("."))
    source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    if not source.is_file():
        return  # import_module says what is missing
    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except SyntaxError as error:
        raise WorkloadImportError(f"{source} line {error.lineno}: {error.msg}") from None
    for node in tree.body:
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        for name in names:
            if name.split(".")[0] in PLATFORM_PACKAGES and not (code_dir / name.split(".")[0]).exists():
                raise PlatformImportError(f"{source} line {node.lineno} imports {name} at module scope: a workload imports nothing "
                                          "of the platform there (the context objects bring what it needs: ctx.readers, ctx.Skip)")


def resolve_hyperparameters(workload: Workload, raw: Mapping[str, Any]) -> types.MappingProxyType:
    """The module's hyperparameters: its defaults, with the job's values (strings, as SageMaker passes
    them) converted to each default's type. Keys it does not declare are not taken here."""
    from training.hyperparameters import HyperparameterError, _convert

    values = dict(workload.hyperparameters)
    for name, default in workload.hyperparameters.items():
        if name in raw:
            try:
                values[name] = _convert(name, raw[name], type(default))
            except HyperparameterError as error:
                raise HyperparameterError(f"{error} (the workload declares {name}={default!r} in {workload.file})") from None
    return types.MappingProxyType(values)
