"""A data host serving a workload (a user's, or a built-in's: training/workloads/): the data service's
server, stream, epochs and lifecycle (training/data_service/server.py), with the workload's preprocess
making the batches.

Its worker processes (spawned: the gRPC process runs threads) import the workload's module by name from
the unpacked code folder, once each, and make whole batches there: the user's function, the stacking
and the wire bytes all stay off the gRPC process's CPU. Before the host serves, it lists the channel
with the module's ``list_samples`` and preprocesses a first sample: what every batch will hold
(its features, announced by Describe) is known before any trainer connects, and a hook that cannot
run fails the host, by name, before anything waits on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.data_service import codec
from training.data_service.dataset import ImageDataset
from training.data_service.server import BatchProducer, WorkerSetup, slot_tags
from training.workload.contexts import ChannelContext
from training.workload.contract import Workload, load_workload
from training.workload.samples import BatchRecipe, BatchTrace, FeatureSpec, classes_of, list_channel, make_batch, probe_features


def host_listing(workload: Workload, channel: str, path: Path, hyperparameters: Mapping[str, Any],
                 channels: Mapping[str, Path]) -> ImageDataset:
    """The channel as the workload lists it, in the form the server describes and serves."""
    ctx = ChannelContext(channel=channel, path=path, training=True, hyperparameters=hyperparameters, channels=channels,
                         training_channel=channel)
    samples = list_channel(workload, ctx)
    # Tar shards' members (Samples.shard_ends) are served shard by shard, as the homogeneous loader reads them.
    return ImageDataset(root=path, classes=classes_of(samples), samples=samples, shard_ends=tuple(getattr(samples, "shard_ends", ())),
                        lister=f"{workload.name}.list_samples")


def recipe_for(workload: Workload, listing: ImageDataset, *, packages_dir: Path | None, hyperparameters: Mapping[str, Any],
               seed: int) -> BatchRecipe:
    """What the workers need, with the features of the first sample that preprocesses."""
    features = probe_features(workload, listing.samples, seed=seed, hyperparameters=hyperparameters)
    return BatchRecipe(workload.code_dir, workload.name, packages_dir, listing.samples, dict(hyperparameters), seed, features)  # sent to spawned workers: a plain dict


def wire_features(features: tuple[FeatureSpec, ...]) -> tuple[codec.FeatureSpec, ...]:
    return tuple(codec.FeatureSpec(spec.name, spec.dtype, spec.shape) for spec in features)


class WorkloadBatchProducer(BatchProducer):
    """BatchProducer whose workers run the workload's preprocess; ``options`` are BatchProducer's."""

    def __init__(self, listing: ImageDataset, recipe: BatchRecipe, **options: Any) -> None:
        self.recipe = recipe
        super().__init__(listing, WorkerSetup(_init_workload_worker, (recipe,), _make_workload_batch), **options)


_recipe: BatchRecipe | None = None
_workload: Workload | None = None


def _init_workload_worker(recipe: BatchRecipe) -> None:
    global _recipe, _workload
    _recipe = recipe
    _workload = load_workload(recipe.code_dir, recipe.module, recipe.packages_dir)


def _make_workload_batch(indices: list[int], spares: list[int], seed: list[int], epochs: list[int], positions: list[int]) -> tuple[bytes, int]:
    """One batch by the workload's preprocess, serialised with its slot tags. ``seed`` (the batch's own
    stream for the image pipeline) is not used: each sample draws from sample_rng(job seed, epoch, index)."""
    assert _recipe is not None and _workload is not None, "worker not initialised"
    trace = BatchTrace()
    features, skipped = make_batch(_workload, _recipe, indices, spares, epochs, trace)
    sample_ids, sample_epochs = slot_tags(indices, spares, epochs, trace.slots, trace.failed)
    return codec.encode_features(features, skipped, sample_ids=sample_ids, epochs=sample_epochs, positions=positions), skipped
