"""The workload contract's TensorFlow side, version 1: a user's tf.data pipeline and Keras model on the platform.

    HYPERPARAMETERS = {"image_size": 64}         # optional: the module's own, with their defaults
    LOOP_DEFAULTS = {"learning_rate": 0.05}      # optional: its defaults for the loop's settings (KerasWorkloadConfig)
    FILE_PATTERN = "*.jpg"                       # optional: which files of a channel are samples (default: all)
    def build_dataset(files, ctx): ...           # files: tf.data of {"path", "label"} → a tf.data.Dataset of elements
    def build_model(ctx): ...                    # a built keras.Model (with an Input, or model.build(shape))
    def build_optimizer(model, ctx): ...         # optional: a keras optimizer (default SGD with momentum)
    def train_step(model, batch, ctx): ...       # the loss (a scalar tensor), or (loss, {name: scalar})
    def eval_step(model, batch, ctx): ...        # optional: {name: per-sample values [B] or a scalar}

Why this shape. tf.data.service runs a dataset's *graph* on the data hosts: the dataset is serialised by
the dispatcher and rebuilt by every worker, so no Python of the user's runs there, and the unit that
dynamic sharding hands out must be the platform's file list. So the platform owns the source (the
channel's files, listed, grouped, shuffled, repeated, sharded; each file once per epoch across the data
hosts) and the batching (full batches of ``batch_size``, a failed sample left out), and the user writes
the element-wise part between them, in TensorFlow ops: read, decode, augment. The same function builds a
homogeneous job's input on the trainer. The loop is the platform's, as for PyTorch: the GradientTape, the
distribution (Horovod or MirroredStrategy), mixed precision and loss scaling, XLA, the per-step stop vote,
checkpoints, validation, metrics and the summary. ``train_step`` is traced once (tf.function): what it
reads of ``ctx`` is read when it is traced.

What is refused, by name, in ``hetero validate`` and on the host that builds it before anything is
served or trained: Python inside the dataset's graph (``py_function``, ``numpy_function``,
``from_generator``: tf.data.service's workers cannot run it), an element with a dimension left unknown (it
could not be batched), a model that cannot be built or has no weights, and a first step that does not
fit the elements (the error with the elements' structure). A non-finite loss fails the run
(loop.NonFiniteLossError).

    python -m training.workload.tf_contract CODE_DIR MODULE CHANNEL_DIR   # the checks, on local files
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.data_service.dataset import ChannelError, EmptyChannelError, ImageDataset
from training.workload.contract import (
    TENSORFLOW,
    Workload,
    WorkloadError,
    batch_keys_hint,
    load_workload,
    module_source,
    user_frame,
)

# tf.data ops that run Python, and what the user wrote to get them.
PYTHON_OPS = {"EagerPyFunc": "tf.py_function", "PyFunc": "tf.numpy_function", "PyFuncStateless": "tf.numpy_function",
              "GeneratorDataset": "tf.data.Dataset.from_generator"}


class PythonInGraphError(WorkloadError):
    """The dataset runs Python: tf.data.service's workers run only the serialised graph."""


class ElementShapeError(WorkloadError):
    """An element with a dimension the graph leaves unknown: it could not be batched."""


class ModelBuildError(WorkloadError):
    """build_model (or build_optimizer) raised, or returned what the loop cannot train."""


class ElementStructureError(WorkloadError):
    """The first training step does not fit the dataset's elements."""


class StepOutputError(WorkloadError):
    """train_step or eval_step returned something other than what the contract asks for."""


@dataclass
class KerasContext:
    """What the TensorFlow hooks receive as ``ctx``."""

    hyperparameters: Mapping[str, Any]
    classes: tuple[str, ...] = ()
    num_samples: int = 0  # the training channel's files
    training: bool = True  # False while building the validation dataset and in eval_step
    rank: int = 0
    world_size: int = 1
    steps: int = 0
    batch_size: int = 0
    seed: int = 0
    learning_rate: float = 0.0  # the loop's learning_rate setting (what a build_optimizer may start from)
    precision: str = "fp32"
    channels: Mapping[str, Path] = field(default_factory=dict)

    def channel_path(self, name: str) -> Path:
        if name not in self.channels:
            raise WorkloadError(f"channel {name!r} is not routed to this host (it has {sorted(self.channels)})")
        return self.channels[name]


def load_keras_workload(code_dir: Path, module: str, packages_dir: Path | None = None) -> Workload:
    return load_workload(code_dir, module, packages_dir, contract=TENSORFLOW)


def file_pattern(code_dir: Path, module: str) -> str:
    """The module's FILE_PATTERN, read from its source (a string literal: the launcher lists the channel
    without importing TensorFlow), "*" when it sets none."""
    value = module_constant(code_dir, module, "FILE_PATTERN")
    if value is None:
        return "*"
    if not isinstance(value, str) or not value:
        raise WorkloadError(f"FILE_PATTERN in {module_source(code_dir, module)} must be a string literal, a glob of file names like '*.jpg'")
    return value


def module_constant(code_dir: Path, module: str, name: str) -> Any:
    """A module-level constant (``NAME = <literal>``, annotated or not) read from the module's source without
    importing it: the launcher lists channels and settles the loop's settings without TensorFlow. None
    when the module does not set it; WorkloadError when it is not a literal or the source does not parse."""
    import ast

    source = module_source(code_dir, module)
    if source is None:
        return None
    try:
        tree = ast.parse(source.read_text(errors="replace"), filename=str(source))
    except SyntaxError as error:
        raise WorkloadError(f"{source} line {error.lineno}: {error.msg}") from None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) and node.value else []
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                raise WorkloadError(f"{name} in {source} line {node.lineno} must be a literal (the launcher reads it without importing "
                                    "the module)") from None
    return None


def list_channel_files(root: Path, channel: str, pattern: str = "*", classes: Sequence[str] | None = None) -> ImageDataset:
    """A channel's sample files (names matching ``pattern``, hidden ones left out), sorted, relative to
    ``root``; a file's label is its top-level folder's index among the folders (``classes``: the training
    channel's, for another channel), or -1 for a file at the top. What build_dataset's files hold
    (absolute here; tf_pipeline.relative_samples makes them relative for a data host)."""
    if not root.is_dir():
        raise ChannelError(f"channel {channel!r} has no folder at {root}")
    files = sorted(path for path in root.rglob("*") if path.is_file() and fnmatch.fnmatch(path.name, pattern)
                   and not any(part.startswith(".") for part in path.relative_to(root).parts))
    if not files:
        raise EmptyChannelError(f"channel {channel!r} ({root}) holds no files matching {pattern!r}")
    relative = [path.relative_to(root) for path in files]
    own = tuple(sorted({path.parts[0] for path in relative if len(path.parts) > 1}))
    names = tuple(classes) if classes is not None else own
    unknown = sorted(set(own) - set(names))
    if unknown:
        raise ChannelError(f"channel {channel!r} has class folders {unknown[:5]} that the training channel has not ({list(names)[:10]})")
    index = {name: i for i, name in enumerate(names)}
    samples = [(root / path, index[path.parts[0]] if len(path.parts) > 1 else -1) for path in relative]
    return ImageDataset(root=root, classes=names, samples=samples)


def python_ops(dataset: Any) -> list[str]:
    """What in the dataset's graph runs Python (PYTHON_OPS' user-facing names), in the order first met."""
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())  # noqa: SLF001 — tf.data.service serialises the same graph
    ops = [node.op for node in graph.node] + [node.op for function in graph.library.function for node in function.node_def]
    found = list(dict.fromkeys(PYTHON_OPS[op] for op in ops if op in PYTHON_OPS))
    if "tf.data.Dataset.from_generator" in found:  # it calls the generator through numpy_function ops of its own
        found = [name for name in found if name != "tf.numpy_function"]
    return found


def element_problem(spec: Any) -> str | None:
    """What in an element's structure cannot be batched (a dimension left unknown), or None. Pure."""
    import tensorflow as tf

    for path, component in flatten_structure(spec):
        if not isinstance(component, tf.TensorSpec):
            return f"element {path} is a {type(component).__name__}: build_dataset's elements are tensors (a dict or tuple of them)"
        if component.shape.rank is None or None in component.shape.as_list():
            return (f"element {path} has shape {component.shape}: every dimension must be known to batch it "
                    "(resize or pad it to a fixed shape, and tf.ensure_shape it)")
    return None


def flatten_structure(spec: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(spec, Mapping):
        return [item for key in spec for item in flatten_structure(spec[key], f"{path}[{key!r}]")]
    if isinstance(spec, tuple | list):
        return [item for i, value in enumerate(spec) for item in flatten_structure(value, f"{path}[{i}]")]
    return [(path or "(the element)", spec)]


def build_elements(workload: Workload, files: Any, ctx: KerasContext) -> Any:
    """The user's build_dataset over ``files`` (tf_pipeline.file_source), checked: a tf.data.Dataset whose
    graph runs no Python and whose elements have fixed shapes."""
    import tensorflow as tf

    try:
        elements = workload.build_dataset(files, ctx)
    except WorkloadError:
        raise
    except Exception as error:  # noqa: BLE001 — the user's code: named, with their line
        raise WorkloadError(f"build_dataset raised {type(error).__name__}{user_frame(error)}: {error}") from error
    if not isinstance(elements, tf.data.Dataset):
        raise WorkloadError(f"build_dataset in {workload.file} returned a {type(elements).__name__}: return the tf.data.Dataset "
                            "of preprocessed elements (files.map(...))")
    found = python_ops(elements)
    if found:
        raise PythonInGraphError(f"build_dataset in {workload.file} uses {', '.join(found)}: tf.data.service's workers run the "
                                 "dataset's graph without Python, so write the preprocessing in TensorFlow ops (tf.image, "
                                 "tf.io, tf.strings)")
    problem = element_problem(elements.element_spec)
    if problem:
        raise ElementShapeError(f"build_dataset in {workload.file}: {problem}")
    return elements


def build_model(workload: Workload, ctx: KerasContext) -> Any:
    """The user's model, checked: a keras.Model with its weights (the loop builds the optimizer on them)."""
    import keras

    try:
        model = workload.build_model(ctx)
    except Exception as error:  # noqa: BLE001
        raise ModelBuildError(f"build_model raised {type(error).__name__}{user_frame(error)}: {error}") from error
    if not isinstance(model, keras.Model):
        raise ModelBuildError(f"build_model in {workload.file} returned a {type(model).__name__}, not a keras.Model")
    if not model.trainable_variables:
        raise ModelBuildError(f"build_model in {workload.file} returned a model with no weights yet: start it with keras.Input(shape) "
                              "or call model.build(input_shape) before returning it")
    return model


def structure_error(error: Exception, element_spec: Any, model: Any, batch: Any) -> ElementStructureError:
    """The first step's failure, with the elements' structure and what the model takes."""
    inputs = getattr(model, "inputs", None)
    takes = f"; the model takes {[tuple(tensor.shape) for tensor in inputs]}" if inputs else ""
    return ElementStructureError(f"train_step raised {type(error).__name__}{user_frame(error)} on the first batch: "
                                 f"{reason_of(error)}{batch_keys_hint(error, (batch,))} (the elements are {element_spec}{takes})")


def reason_of(error: BaseException) -> str:
    """The error's own words, without what TensorFlow wraps them in: an op error's first line (its node
    follows); for an error raised while tracing ("in user code:", the frames), the exception's line and
    Keras's explanation after it, up to its list of arguments. Pure."""
    import re

    text = getattr(error, "message", None) or str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    own = [i for i, line in enumerate(lines) if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", line) and i > 0]
    if lines[0].startswith("in user code") and own:
        tail = lines[own[-1]:]
        ends = [i for i, line in enumerate(tail) if line.startswith("Arguments received")]
        return " ".join(tail[:ends[0]] if ends else tail)[:600]
    return lines[0][:600]


def probe_elements(workload: Workload, paths: Sequence[str], labels: Sequence[int], ctx: KerasContext, count: int = 8) -> None:
    """The dataset's elements made from the first files once, without the batching's ignore_errors: a
    dataset whose every element fails (a wrong decode op, a bad path) would otherwise be retried over an
    endless source and never yield a batch. Refused when all of the first ``count`` fail, with the first reason."""
    import tensorflow as tf

    from training.data_service.tf_pipeline import file_source

    count = min(count, len(paths))
    files = file_source(list(paths[:count]), list(labels[:count]), seed=0, repeat=False)
    iterator = iter(build_elements(workload, files, ctx))
    reasons = []
    for _ in range(count):
        try:
            next(iterator)
            return
        except StopIteration:
            break
        except tf.errors.OpError as error:
            reasons.append(reason_of(error))
    if reasons:
        raise WorkloadError(f"build_dataset's elements fail on each of the first {len(reasons)} files: {reasons[0]}")



def split_loss(output: Any) -> tuple[Any, dict[str, Any]]:
    """(loss, metrics) of what train_step returned: a scalar loss, or (loss, {name: scalar})."""
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], Mapping):
        return output[0], dict(output[1])
    return output, {}


def main(argv: Sequence[str] | None = None) -> int:
    """Build the dataset over a local channel, print its element spec and one batch's shapes."""
    from training.data_service.tf_pipeline import batched, file_source

    code_dir, module, channel = (argv or sys.argv[1:])[:3]
    workload = load_keras_workload(Path(code_dir), module)
    listing = list_channel_files(Path(channel).resolve(), "train", file_pattern(Path(code_dir), module))
    ctx = KerasContext(dict(workload.hyperparameters), classes=listing.classes, num_samples=len(listing), batch_size=4)
    files = file_source([str(path) for path, _ in listing.samples], [label for _, label in listing.samples], seed=0)
    elements = build_elements(workload, files, ctx)
    batch = next(iter(batched(elements, 4)))
    print(elements.element_spec)
    print({path: tuple(value.shape) for path, value in flatten_structure(batch)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
