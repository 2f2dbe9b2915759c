"""A workload's samples: listing a channel, preprocessing one sample, checking what came out, making batches.

One code path for every place a sample is preprocessed (a data host's worker process, a homogeneous
job's DataLoader worker, ``hetero validate``'s dry run), so that the same sample of the same epoch
gives the same arrays everywhere:

* ``sample_rng(seed, epoch, index)``: the generator ``preprocess`` draws from, a pure function of the
  job's seed, the epoch whose turn it is and the sample's index in the listing (a spare that fills the
  slot of a skipped sample draws from its own stream);
* ``check_features``: the output is a dict of named NumPy arrays of a dtype the data service carries,
  and every sample has the same keys, dtypes and shapes as the first one (``FeatureMismatchError``
  names the key, what was expected and what came): batches stack, and an XLA step keeps one shape;
* a hook that raises fails at once, naming the hook, the sample and the exception (``HookError``);
  ``ctx.Skip`` (SkipSample) leaves the sample out, counted, and the next candidate takes its slot.

Standard library and NumPy only (data hosts never import the trainer's framework for this).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from training.workload.contexts import ChannelContext, SampleContext, SkipSample
from training.workload.contract import Workload, WorkloadError, user_frame

# What the data service carries (training/data_service/codec.py ALLOWED_DTYPES).
FEATURE_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
FEATURE_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
# A listing's items are small records (paths, keys, labels), sent to every worker process: not the data.
MAX_SAMPLE_ITEM_BYTES = 64 << 10
# The epoch of a spare (a sample drawn to fill a skipped one's slot): outside every real epoch.
SPARE_EPOCH = 2**32 - 1


class HookError(WorkloadError):
    """A workload hook raised: the hook, the sample (or step) and the exception."""


class PreprocessOutputError(WorkloadError):
    """``preprocess`` returned something that is not a dict of arrays the platform can batch and send."""


class FeatureMismatchError(PreprocessOutputError):
    """A sample's arrays differ in keys, dtype or shape from the first sample's."""


class SamplesError(WorkloadError):
    """``list_samples`` returned no samples, or items that are not small picklable records."""


class AllSkippedError(WorkloadError):
    """Every candidate for a batch slot was skipped: the channel holds too few usable samples."""


@dataclass(frozen=True)
class FeatureSpec:
    """One named array of a preprocessed sample: its dtype and its shape (one sample's)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator ``preprocess`` gets for sample ``index`` in ``epoch``. Pure."""
    return np.random.default_rng([seed, epoch, index])


def describe_sample(sample: Any, limit: int = 160) -> str:
    text = repr(sample)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def list_channel(workload: Workload, ctx: ChannelContext) -> Sequence[Any]:
    """The channel's samples by the workload's list_samples, checked: a non-empty sequence of small,
    picklable items."""
    try:
        samples = workload.list_samples(ctx)
    except Exception as error:  # noqa: BLE001 — the user's hook: named, with its exception
        raise HookError(f"list_samples raised {type(error).__name__} on channel {ctx.channel!r} ({ctx.path}): {error}") from error
    if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence):
        raise SamplesError(f"list_samples returned a {type(samples).__name__} for channel {ctx.channel!r}: return a list of samples")
    if not samples:
        raise SamplesError(f"list_samples found no samples in channel {ctx.channel!r} ({ctx.path})")
    for position in sorted({0, len(samples) // 2, len(samples) - 1}):
        try:
            size = len(pickle.dumps(samples[position]))
        except Exception as error:  # noqa: BLE001 — an unpicklable item (an open file, a lambda)
            raise SamplesError(f"sample {position} of channel {ctx.channel!r} ({describe_sample(samples[position])}) cannot be sent to "
                               f"worker processes: {type(error).__name__}: {error}; list small records (paths, keys, labels)") from None
        if size > MAX_SAMPLE_ITEM_BYTES:
            raise SamplesError(f"sample {position} of channel {ctx.channel!r} pickles to {size} bytes: list_samples lists records "
                               f"(paths, keys, labels) of at most {MAX_SAMPLE_ITEM_BYTES >> 10} KiB; read the data in preprocess")
    return samples


def classes_of(samples: Sequence[Any]) -> tuple[str, ...]:
    return tuple(getattr(samples, "classes", ()) or ())


def check_evaluation_classes(channel: str, samples: Sequence[Any], classes: Sequence[str]) -> None:
    """Refuse (WorkloadError) an evaluation listing whose classes are not the training channel's (an
    ImageFolder of some of the classes, labelled by its own sorted folders): its labels would name other
    classes than the model's outputs, and its accuracy would be wrong without a word. Pure."""
    listed = classes_of(samples)
    if listed and classes and tuple(listed) != tuple(classes):
        raise WorkloadError(
            f"channel {channel!r} lists classes {list(listed)[:8]}, but the training channel's are {list(classes)[:8]}: "
            "its labels must index the training channel's classes (ctx.classes while listing it; "
            "ctx.readers.image_folder maps an ImageFolder's by name)"
        )


def as_features(output: Any, *, sample: Any, index: int) -> dict[str, np.ndarray]:
    """``preprocess``'s output as named arrays (NumPy scalars and Python numbers become 0-d arrays), or
    PreprocessOutputError naming what is wrong. Pure."""
    where = f"preprocess of sample {index} ({describe_sample(sample)})"
    if not isinstance(output, Mapping) or not output:
        raise PreprocessOutputError(f"{where} returned a {type(output).__name__}: return a dict of NumPy arrays, e.g. "
                                    "{'image': uint8 array, 'label': int}")
    features: dict[str, np.ndarray] = {}
    for name, value in output.items():
        if not isinstance(name, str) or not FEATURE_NAME.fullmatch(name):
            raise PreprocessOutputError(f"{where}: key {name!r} is not 1–64 letters, digits or _")
        if isinstance(value, float) and not isinstance(value, np.generic):
            value = np.asarray(value, dtype=np.float32)  # a Python float: float32, what a model takes (not float64)
        elif isinstance(value, (bool, int, np.generic)):
            value = np.asarray(value)
        if not isinstance(value, np.ndarray):
            raise PreprocessOutputError(f"{where}: {name!r} is a {type(value).__module__}.{type(value).__name__}, not a NumPy array "
                                        "(preprocessing runs on CPUs, in processes without the trainer's framework: return arrays)")
        if value.dtype.name not in FEATURE_DTYPES:
            raise PreprocessOutputError(f"{where}: {name!r} has dtype {value.dtype.name}, which cannot be batched and sent; use one of "
                                        f"{', '.join(FEATURE_DTYPES)}")
        if 0 in value.shape:
            raise PreprocessOutputError(f"{where}: {name!r} has shape {list(value.shape)}, with no elements: every feature holds at least "
                                        "one value (pad an empty one to a fixed size, with a mask)")
        features[name] = value
    return features


def spec_of(features: Mapping[str, np.ndarray]) -> tuple[FeatureSpec, ...]:
    return tuple(FeatureSpec(name, array.dtype.name, tuple(array.shape)) for name, array in features.items())


def check_features(features: Mapping[str, np.ndarray], expected: Sequence[FeatureSpec], *, sample: Any, index: int) -> None:
    """Refuse a sample whose arrays differ from ``expected`` (the first sample's), naming the key. Pure."""
    where = f"preprocess of sample {index} ({describe_sample(sample)})"
    names = [spec.name for spec in expected]
    if set(features) != set(names):  # the order may differ: batches are built by name
        missing, extra = sorted(set(names) - set(features)), sorted(set(features) - set(names))
        raise FeatureMismatchError(f"{where} returned keys {list(features)}, expected {names} (the first sample's)"
                                   + (f"; missing {missing}" if missing else "") + (f"; extra {extra}" if extra else ""))
    for spec in expected:
        array = features[spec.name]
        if array.dtype.name != spec.dtype or tuple(array.shape) != spec.shape:
            raise FeatureMismatchError(f"{where}: {spec.name!r} is {array.dtype.name} {list(array.shape)}, expected {spec} (the first "
                                       "sample's): every sample must give the same dtypes and shapes (pad or crop to one size)")


def preprocess_one(workload: Workload, samples: Sequence[Any], index: int, *, seed: int, epoch: int, training: bool,
                   hyperparameters: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """Sample ``index`` of ``samples`` preprocessed; None when the hook skipped it (ctx.Skip)."""
    sample = samples[index]
    ctx = SampleContext(rng=sample_rng(seed, epoch, index), training=training, hyperparameters=hyperparameters, epoch=epoch, index=index)
    try:
        output = workload.preprocess(sample, ctx)
    except SkipSample:
        return None
    except Exception as error:  # noqa: BLE001 — the user's hook fails the job at once, by name
        raise HookError(f"preprocess raised {type(error).__name__}{user_frame(error)} on sample {index} ({describe_sample(sample)}): "
                        f"{error}") from error
    return as_features(output, sample=sample, index=index)


@dataclass
class BatchTrace:
    """Where make_batch's candidates went, by position in indices + spares (epoch accounting)."""

    slots: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # skipped


@dataclass(frozen=True)
class BatchRecipe:
    """What a worker process needs to preprocess batches of a workload (sent once, at its start)."""

    code_dir: Path
    module: str
    packages_dir: Path | None
    samples: Sequence[Any]
    hyperparameters: Mapping[str, Any]
    seed: int
    features: tuple[FeatureSpec, ...]
    training: bool = True


def make_batch(workload: Workload, recipe: BatchRecipe, indices: Sequence[int], spares: Sequence[int], epochs: Sequence[int],
               trace: BatchTrace | None = None) -> tuple[dict[str, np.ndarray], int]:
    """A full batch of ``len(indices)`` samples, each checked against the recipe's features; a skipped
    sample is counted and the slot takes the next candidate (the indices first, then the spares).
    Returns (stacked features, skipped count)."""
    batch = {spec.name: np.empty((len(indices), *spec.shape), dtype=spec.dtype) for spec in recipe.features}
    candidates = enumerate([*zip(indices, epochs, strict=True), *((spare, SPARE_EPOCH) for spare in spares)])
    skipped = 0
    for slot in range(len(indices)):
        for position, (index, epoch) in candidates:
            features = preprocess_one(workload, recipe.samples, index, seed=recipe.seed, epoch=epoch, training=recipe.training,
                                      hyperparameters=recipe.hyperparameters)
            if features is None:
                skipped += 1
                if trace is not None:
                    trace.failed.append(position)
                continue
            check_features(features, recipe.features, sample=recipe.samples[index], index=index)
            for name, array in features.items():
                batch[name][slot] = array
            if trace is not None:
                trace.slots.append(position)
            break
        else:
            raise AllSkippedError(f"preprocess skipped {skipped} of the {len(indices) + len(spares)} samples a data host had for one "
                                  f"batch of {len(indices)} (its own and as many spares): too many samples are skipped; check the channel")
    return batch, skipped


def probe_features(workload: Workload, samples: Sequence[Any], *, seed: int, hyperparameters: Mapping[str, Any], training: bool = True,
                   tries: int = 64) -> tuple[FeatureSpec, ...]:
    """The features every sample must have: the first sample that preprocesses (skipped ones passed over)."""
    for index in range(min(tries, len(samples))):
        features = preprocess_one(workload, samples, index, seed=seed, epoch=0, training=training, hyperparameters=hyperparameters)
        if features is not None:
            return spec_of(features)
    raise AllSkippedError(f"preprocess skipped the first {min(tries, len(samples))} samples: the channel holds no usable sample")
