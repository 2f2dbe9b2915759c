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
    LOOP_DEFAULTS = {"grad_clip_norm": 1.0}            # optional: its defaults for the platform loop's settings
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
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Contract:
    """One framework's hooks, and the loop settings (a dataclass of training/trainers/config.py, by name)
    that a module's LOOP_DEFAULTS may set."""

    framework: str
    required: Mapping[str, tuple[str, ...]]
    optional: Mapping[str, tuple[str, ...]]
    loop_config: str

    @property
    def hooks(self) -> dict[str, tuple[str, ...]]:
        return {**self.required, **self.optional}


PYTORCH = Contract("pytorch", REQUIRED_HOOKS, OPTIONAL_HOOKS, "WorkloadConfig")
# The TensorFlow side (training/workload/tf_contract.py says what each hook does): the dataset is a tf.data
# graph that tf.data.service's workers run, so preprocessing is one hook over the platform's file dataset.
TENSORFLOW = Contract(
    "tensorflow",
    {"build_dataset": ("files", "ctx"), "build_model": ("ctx",), "train_step": ("model", "batch", "ctx")},
    {"build_optimizer": ("model", "ctx"), "eval_step": ("model", "batch", "ctx")},
    "KerasWorkloadConfig",
)
CONTRACTS = {contract.framework: contract for contract in (PYTORCH, TENSORFLOW)}
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
    # The module's defaults for the platform loop's settings (WorkloadConfig's fields), under the job's.
    loop_defaults: Mapping[str, bool | int | float | str] = field(default_factory=lambda: types.MappingProxyType({}))

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


def add_to_path(code_dir: Path, packages_dir: Path | None = None) -> None:
    """The code folder first on the import path; its installed requirements last, after the image's own
    packages (which they never shadow: a requirement that pulled in another torch must not replace the
    image's CUDA or Neuron build)."""
    if str(code_dir) not in sys.path:
        sys.path.insert(0, str(code_dir))
    if packages_dir is not None and str(packages_dir) not in sys.path:
        import site

        site.addsitedir(str(packages_dir))  # appended, with its .pth files read (namespace packages, editable installs)


def load_workload(code_dir: Path, module: str, packages_dir: Path | None = None, contract: Contract = PYTORCH) -> Workload:
    """Import ``module`` from ``code_dir`` and check it against the contract (check_module)."""
    code_dir = Path(code_dir).resolve()
    if module.endswith(".py") or "/" in module:
        raise WorkloadImportError(f"workload module {module!r} is a file name: name the module ({module.removesuffix('.py').replace('/', '.')})")
    add_to_path(code_dir, packages_dir)
    _refuse_platform_imports(code_dir, module)
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name and module.startswith(error.name):
            present = sorted(path.stem for path in code_dir.glob("*.py")) + sorted(path.parent.name for path in code_dir.glob("*/__init__.py"))
            close = difflib.get_close_matches(module, present, n=1)
            raise WorkloadImportError(f"no module {module!r} in the code folder {code_dir} (looked for {module.replace('.', '/')}.py "
                                      f"or its package{f'; did you mean {close[0]!r}?' if close else ''})") from None
        raise WorkloadImportError(f"importing workload module {module!r} ({code_dir}) failed: it imports {error.name!r}, which is "
                                  "not installed: add it to the workload's requirements file") from None
    except Exception as error:  # noqa: BLE001 — whatever the user's module raises is theirs to fix, by name
        raise WorkloadImportError(f"importing workload module {module!r} ({code_dir}) raised {type(error).__name__}: {error}") from None
    return check_module(loaded, module, code_dir, contract)


def check_module(loaded: types.ModuleType, name: str, code_dir: Path, contract: Contract = PYTORCH) -> Workload:
    """The hooks of an imported module, each checked: present, a function of this module taking the
    contract's arguments; and its HYPERPARAMETERS, if any, a dict of scalars."""
    where = getattr(loaded, "__file__", name)
    hooks: dict[str, Callable[..., Any]] = {}
    for hook, parameters in contract.hooks.items():
        function = getattr(loaded, hook, None)
        if function is None:
            if hook in contract.required:
                raise MissingHookError(_missing(hook, loaded, where, contract))
            continue
        hooks[hook] = _checked_hook(hook, function, parameters, name, where)
    _misspelt_optional(loaded, where, contract)
    declared = getattr(loaded, "HYPERPARAMETERS", {})
    if not isinstance(declared, Mapping) or not all(isinstance(key, str) and key.isidentifier() for key in declared):
        raise WorkloadError(f"HYPERPARAMETERS in {where} must be a dict of name → default value")
    bad = {key: value for key, value in declared.items() if not isinstance(value, HYPERPARAMETER_TYPES)}
    if bad:
        raise WorkloadError(f"HYPERPARAMETERS in {where}: {bad} are not bool, int, float or str (SageMaker passes hyperparameters as strings)")
    return Workload(loaded, name, code_dir, types.MappingProxyType(hooks), types.MappingProxyType(dict(declared)),
                    types.MappingProxyType(_loop_defaults(loaded, where, contract)))


def _loop_defaults(loaded: types.ModuleType, where: str, contract: Contract) -> dict[str, Any]:
    """The module's LOOP_DEFAULTS, checked: names of the loop's settings (the contract's loop config), each
    of the setting's type (a misspelt one would silently be ignored)."""
    from dataclasses import MISSING, fields

    from training.trainers import config

    declared = getattr(loaded, "LOOP_DEFAULTS", {})
    if not isinstance(declared, Mapping):
        raise WorkloadError(f"LOOP_DEFAULTS in {where} must be a dict of loop setting → default value")
    settings = {item.name: item.default for item in fields(getattr(config, contract.loop_config)) if item.default is not MISSING}
    for key, value in declared.items():
        if key not in settings:
            close = difflib.get_close_matches(str(key), list(settings), n=1)
            raise WorkloadError(f"LOOP_DEFAULTS in {where} names {key!r}, which is not a setting of the platform's loop"
                                + (f" (did you mean {close[0]!r}?)" if close else f"; they are {sorted(settings)}"))
        expected = type(settings[key])
        kinds = (int, float) if expected is float else (expected,)  # an int is a fine float
        if not isinstance(value, kinds) or (isinstance(value, bool) and expected is not bool):
            kind = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}[expected]
            raise WorkloadError(f"LOOP_DEFAULTS in {where}: {key}={value!r} is not {kind}, as the setting is (default {settings[key]!r})")
    return dict(declared)


def _defined(loaded: types.ModuleType, contract: Contract) -> list[str]:
    return [name for name, value in vars(loaded).items() if callable(value) and not name.startswith("_") and name not in contract.hooks]


def _missing(hook: str, loaded: types.ModuleType, where: str, contract: Contract) -> str:
    close = difflib.get_close_matches(hook, _defined(loaded, contract), n=1)
    hint = f" (it defines {close[0]}(): rename it {hook})" if close else ""
    return (f"the workload module {where} defines no {hook}(){hint}; a {contract.framework} workload defines "
            f"{', '.join(contract.required)} (and optionally {', '.join(contract.optional)})")


def _misspelt_optional(loaded: types.ModuleType, where: str, contract: Contract) -> None:
    """An optional hook misspelt would be silently unused (build_optimiser: the default optimizer, no
    scheduler): a function named within a letter or two of one that is not defined is refused."""
    for hook in contract.optional:
        if hasattr(loaded, hook):
            continue
        close = difflib.get_close_matches(hook, _defined(loaded, contract), n=1, cutoff=0.85)
        if close:
            raise MissingHookError(f"{where} defines {close[0]}(), not {hook}(): the platform calls {hook} by that name; rename it "
                                   "(or give a helper a name further from it)")


def _checked_hook(hook: str, function: Any, parameters: tuple[str, ...], module: str, where: str) -> Callable[..., Any]:
    if not callable(function):
        raise MissingHookError(f"{hook} in {where} is a {type(function).__name__}, not a function")
    qualname = getattr(function, "__qualname__", "")
    owner = getattr(function, "__module__", None)
    # Data hosts import the module and take the hook by its name: one defined in another module of the code
    # and imported here does too; one of __main__ (a notebook, a script) is nowhere to import from.
    if "<lambda>" in qualname or "<locals>" in qualname or owner in (None, "__main__"):
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


def module_source(code_dir: Path, module: str) -> Path | None:
    """The file a dotted module is imported from inside the code folder (a module, or a package's
    __init__.py); None when there is neither (import_module then says what is missing)."""
    base = Path(code_dir).joinpath(*module.split("."))
    source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    return source if source.is_file() else None


def _refuse_platform_imports(code_dir: Path, module: str) -> None:
    """A workload imports nothing of the platform at module scope: the saved model then loads without the
    platform, and a data host's workers import it with nothing else set up. Read from its source."""
    source = module_source(code_dir, module)
    if source is None:
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


def user_frame(error: BaseException) -> str:
    """" at <file>:<line>" of the innermost frame of the traceback that is not the platform's or a library's
    (the user's own line), or "" when there is none."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    platform_root = str(Path(__file__).resolve().parents[1])
    own = [frame for frame in frames if not frame.filename.startswith(platform_root) and "site-packages" not in frame.filename
           and not frame.filename.startswith("<")]
    return f" at {Path(own[-1].filename).name}:{own[-1].lineno}" if own else ""


def batch_keys_hint(error: BaseException, args: tuple[Any, ...]) -> str:
    """For a KeyError inside a step: the keys the batch (a dict among ``args``) has. Pure."""
    if not isinstance(error, KeyError):
        return ""
    batches = [arg for arg in args if isinstance(arg, Mapping) and not isinstance(arg, types.MappingProxyType)]
    return f" (the batch has {sorted(batches[0])})" if batches else ""


def source_problem(source: str, filename: str, contract: Contract = PYTORCH) -> str | None:
    """What the contract refuses that reading the module's source alone shows (no import: the client
    that launches need not have the workload's packages): a syntax error, a required hook that is no
    top-level function, a hook that takes another number of arguments. None when the source passes;
    hooks assigned otherwise than by def (an import, an alias) are left to the hosts' full check."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as error:
        return f"{filename} line {error.lineno}: {error.msg}"
    defined = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    bound = {target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets if isinstance(target, ast.Name)}
    imported = {(alias.asname or alias.name).split(".")[0] for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in node.names}
    for hook in contract.required:
        if hook not in defined and hook not in bound and hook not in imported and "*" not in imported:
            close = difflib.get_close_matches(hook, [name for name in defined if name not in contract.hooks], n=1)
            return f"{filename} defines no {hook}()" + (f" (it defines {close[0]}(): rename it {hook})" if close else "")
    for hook, parameters in contract.hooks.items():
        node = defined.get(hook)
        if node is None or node.args.vararg is not None:
            continue
        positional = [*node.args.posonlyargs, *node.args.args]
        required = len(positional) - len(node.args.defaults)
        if not required <= len(parameters) <= len(positional):
            return f"{hook} in {filename} takes {len(positional)} arguments, but the platform calls {hook}({', '.join(parameters)})"
    return None
