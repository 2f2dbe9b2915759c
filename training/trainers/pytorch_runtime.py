"""The one PyTorch runtime of user workloads: the platform's loop around a workload's hooks, on a GPU, a CPU
or an XLA device (Trainium's NeuronCores; torch-xla's CPU device locally).

The workload (training/workload/contract.py) brings its samples, its preprocess, its model and one
training step; this module owns everything else, the same way for every workload:

* where batches come from: streamed from the data hosts (each batch a dict of the workload's named
  arrays, training/data_service/client.py), or, without a data group, made by DataLoader workers on this
  host's CPUs with the very same preprocess and the same draws (training/workload/samples.py): an
  endless, resumable shard per rank (training/trainers/sampling.py), a skipped sample replaced by a spare;
* the device: batches moved without blocking (pinned memory on a GPU) or through MpDeviceLoader on XLA,
  the optional ``device_transform`` there, the model built under the job's seed (the same weights on
  every rank), DDP across ranks on GPUs and CPUs, ``xm.optimizer_step`` (which all-reduces the
  gradients) on XLA;
* the step: ``zero_grad``, the user's ``train_step`` under autocast (``precision``: bf16, fp16 with a
  gradient scaler, or fp32), ``backward``, optional clipping of the gradients' norm, the optimizer and
  scheduler steps; one step in flight (the previous step's loss is read while this one runs, so that the
  step time is the device's), checked finite on every step (``NonFiniteLossError`` names the step: a
  diverged run fails instead of saving a model of NaNs), and on XLA each step is one graph and a batch
  whose shapes change fails (``ShapeChangedError``: each new shape compiles anew);
* validation every ``eval_every`` steps and at the end over the ``eval_channel`` (read on the DNN
  hosts, ``training=False``), every sample counted once across ranks, the workload's per-sample values
  averaged, in the metric lines (``eval_<name>``), the summary and result.json;
* the loop's shared duties (training/trainers/loop.py): the stop vote, checkpoints with the workload's
  ``ctx.state``, resume, metric lines, the summary;
* a saved model that loads without the platform: ``model.pt`` (the state_dict), ``workload.json`` (the
  module, its hyperparameters, the classes, the features), the workload's code, and ``load_model.py``.

The launcher starts it through torchrun (or directly), with the unpacked code folder in the environment:

    TRAINING_WORKLOAD_DIR=/opt/ml/workload/code python -m training.trainers.pytorch_runtime
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from training.cluster import ClusterConfigError
from training.data_service import codec
from training.data_service.client import DataServiceDataset
from training.data_service.control import DataServiceError, describe, describe_every
from training.data_service.dataset import ChannelError
from training.data_service.epochs import last_epochs, merge
from training.data_service.positions import Layout, Position, ResumePlan, advance, resume_plan
from training.data_service.server import epoch_share
from training.failure import write_failure, write_first_failure
from training.host_environment import OutputPaths, TrainerEnvironment
from training.hyperparameters import HyperparameterError
from training.trainers import host_collectives
from training.trainers.checkpoint_state import UnrestorableCheckpointError, check_loads_back, plain
from training.trainers.config import WorkloadConfig
from training.trainers.loop import (
    CheckpointWriteError,
    DataExhaustedError,
    NonFiniteLossError,
    TrainingStopped,
    check_finite,
    leave_stopped,
)
from training.trainers.precision import resolve_precision
from training.trainers.sampling import ShardTooSmallError, epoch_order, eval_batches, rank_share
from training.trainers.service_summary import shard_classes
from training.trainers.torch_loop import TorchTrainingLoop, host_cpus
from training.workload.contexts import TrainContext
from training.workload.contract import CONTRACT_VERSION, Workload, WorkloadError, batch_keys_hint, user_frame
from training.workload.host import PreparedWorkload, prepared_workload
from training.workload.samples import (
    SPARE_EPOCH,
    AllSkippedError,
    FeatureSpec,
    check_evaluation_classes,
    check_features,
    classes_of,
    preprocess_one,
    sample_rng,
)

log = logging.getLogger("training.pytorch_runtime")

Batch = dict[str, torch.Tensor]
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Tries to fill the slot of a skipped sample in a homogeneous job (a data host uses its batch's spares).
SPARE_TRIES = 64


class StepOutputError(WorkloadError):
    """train_step or eval_step returned something other than what the contract asks for."""


class ShapeChangedError(WorkloadError):
    """On XLA, a batch whose shapes differ from the first one's: each new shape compiles the step again."""


def step_output(output: Any, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) from what train_step returned: a scalar loss tensor that requires grad, or
    (loss, {name: scalar}). Pure."""
    loss, metrics = (output if isinstance(output, tuple) and len(output) == 2 else (output, {}))
    if not isinstance(loss, torch.Tensor):
        raise StepOutputError(f"train_step returned a {type(loss).__name__} at step {step}: return the loss tensor, or (loss, {{name: value}})")
    if loss.numel() != 1:
        raise StepOutputError(f"train_step returned a loss of shape {list(loss.shape)} at step {step}: return one number (the batch's mean)")
    if not loss.requires_grad:
        raise StepOutputError(f"train_step returned a loss that does not require grad at step {step} (computed under no_grad, or detached)")
    if not isinstance(metrics, Mapping):
        raise StepOutputError(f"train_step's metrics at step {step} are a {type(metrics).__name__}: return (loss, {{name: scalar}})")
    checked = {}
    for name, value in metrics.items():
        value = torch.as_tensor(value)
        if value.numel() != 1:
            raise StepOutputError(f"train_step's metric {name!r} has shape {list(value.shape)} at step {step}: metrics are scalars")
        checked[str(name)] = value.detach()
    return loss.reshape(()), checked


def default_optimizer(module: nn.Module, hyperparameters: Mapping[str, Any]) -> torch.optim.Optimizer:
    """A workload's optimizer when it builds none: AdamW at its learning_rate hyperparameter, else 1e-3."""
    return torch.optim.AdamW(module.parameters(), lr=float(hyperparameters.get("learning_rate", 1e-3)))


def checked_optimizer(built: Any) -> tuple[torch.optim.Optimizer, Any]:
    """(optimizer, scheduler or None) from what build_optimizer returned, or StepOutputError: an optimizer,
    or (optimizer, scheduler) whose scheduler steps once per step with no argument (not ReduceLROnPlateau)."""
    optimizer, scheduler = built if isinstance(built, tuple) and len(built) == 2 else (built, None)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise StepOutputError(f"build_optimizer returned a {type(optimizer).__name__}: return a torch.optim optimizer, or (optimizer, scheduler)")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise StepOutputError(f"build_optimizer's scheduler is a {type(scheduler).__name__} with no step()")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise StepOutputError("build_optimizer returned ReduceLROnPlateau, which steps on a metric: the platform steps the "
                              "scheduler once per training step, with no argument; use a step-based one (LambdaLR, CosineAnnealingLR)")
    return optimizer, scheduler


def batch_shapes(batch: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in batch.items()}


def tagged_order(size: int, *, rank: int, world_size: int, seed: int, start: int, shard_ends: Sequence[int] = (),
                 legacy: bool = False) -> Iterator[tuple[int, int]]:
    """(epoch, index) for this rank, endlessly, from ``start`` samples in: EndlessSampler's order with the
    epoch beside each index (preprocess draws from (seed, epoch, index)); tar shards (``shard_ends``)
    in their streaming order; ``legacy``: a run resumed from an earlier release's checkpoint keeps its order."""
    per_epoch = size // world_size
    if per_epoch == 0:
        raise ShardTooSmallError(f"{size} samples cannot give each of {world_size} trainer processes one")
    epoch, offset = divmod(start, per_epoch)
    while True:
        for index in rank_share(epoch_order(size, seed, epoch, shard_ends=shard_ends, legacy=legacy), rank, world_size)[offset:]:
            yield epoch, index
        epoch, offset = epoch + 1, 0


class TaggedSampler(torch.utils.data.Sampler):
    def __init__(self, size: int, *, rank: int, world_size: int, seed: int, start: int, shard_ends: Sequence[int] = (),
                 legacy: bool = False) -> None:
        next(tagged_order(size, rank=rank, world_size=world_size, seed=seed, start=start, shard_ends=shard_ends))  # refuses too few samples now
        self.size, self.rank, self.world_size, self.seed, self.start = size, rank, world_size, seed, start
        self.shard_ends, self.legacy = tuple(shard_ends), legacy

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return tagged_order(self.size, rank=self.rank, world_size=self.world_size, seed=self.seed, start=self.start,
                            shard_ends=self.shard_ends, legacy=self.legacy)


class LocalSamples(Dataset):
    """A homogeneous job's training samples: ``dataset[(epoch, index)]`` preprocessed by the workload, a
    skipped one replaced by a spare drawn from its own stream. Returns (features, skipped)."""

    def __init__(self, prepared: PreparedWorkload, samples: Sequence[Any], features: Sequence[FeatureSpec], seed: int) -> None:
        self.prepared, self.samples, self.features, self.seed = prepared, samples, tuple(features), seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]) -> tuple[dict[str, np.ndarray], int]:
        epoch, index = key
        spares = sample_rng(self.seed, SPARE_EPOCH, index).integers(0, len(self.samples), size=SPARE_TRIES)
        for skipped, (candidate, candidate_epoch) in enumerate([(index, epoch), *((int(spare), SPARE_EPOCH) for spare in spares)]):
            features = preprocess_one(self.prepared.workload, self.samples, candidate, seed=self.seed, epoch=candidate_epoch,
                                      training=True, hyperparameters=self.prepared.hyperparameters)
            if features is not None:
                check_features(features, self.features, sample=self.samples[candidate], index=candidate)
                return features, skipped
        raise AllSkippedError(f"preprocess skipped sample {index} and {SPARE_TRIES} spares: the channel holds too few usable samples")


def collate_features(items: list[tuple[dict[str, np.ndarray], int]]) -> tuple[Batch, int]:
    names = list(items[0][0])
    return {name: torch.from_numpy(np.stack([features[name] for features, _ in items])) for name in names}, sum(skipped for _, skipped in items)


class EvalSamples(Dataset):
    """This rank's validation batches: fixed size, a 0/1 weight per slot (padding and skipped samples 0)."""

    def __init__(self, prepared: PreparedWorkload, samples: Sequence[Any], features: Sequence[FeatureSpec], *, seed: int, rank: int,
                 world_size: int, batch_size: int) -> None:
        self.prepared, self.samples, self.features, self.seed = prepared, samples, tuple(features), seed
        self.batches = eval_batches(len(samples), rank=rank, world_size=world_size, batch_size=batch_size)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, position: int) -> tuple[Batch, torch.Tensor]:
        batch = self.batches[position]
        rows, weights = [], torch.zeros(len(batch.indices), dtype=torch.float32)
        for slot, index in enumerate(batch.indices):
            features = preprocess_one(self.prepared.workload, self.samples, index, seed=self.seed, epoch=0, training=False,
                                      hyperparameters=self.prepared.hyperparameters)
            if features is not None:
                check_features(features, self.features, sample=self.samples[index], index=index)
                weights[slot] = 1.0 if slot < batch.valid else 0.0
            rows.append(features)
        filler = next((row for row in rows if row is not None), None)
        if filler is None:
            filler = {spec.name: np.zeros(spec.shape, dtype=spec.dtype) for spec in self.features}
        rows = [row if row is not None else filler for row in rows]
        return {name: torch.from_numpy(np.stack([row[name] for row in rows])) for name in filler}, weights


class WorkloadTrainer(TorchTrainingLoop[Batch]):
    checkpoint_name = "checkpoint.pt"

    def __init__(
        self,
        config: WorkloadConfig,
        paths: OutputPaths,
        *,
        prepared: PreparedWorkload,
        classes: Sequence[str],
        features: Sequence[FeatureSpec],
        num_samples: int,
        source: str,
        samples: Sequence[Any] | None = None,
        service: DataServiceDataset | None = None,
        epoch_samples: Mapping[str, int] | None = None,
        sharded: bool = False,
        data_layout: Layout | None = None,
        data_shares: Mapping[str, int] | None = None,
        eval_samples: Sequence[Any] | None = None,
        eval_features: Sequence[FeatureSpec] = (),
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        cpus: int = 1,
        xla: bool = False,
        host_group: Any = None,
    ) -> None:
        super().__init__(config, paths, rank=rank, world_size=world_size)
        self.runtime = config
        self.prepared = prepared
        self.workload: Workload = prepared.workload
        self.classes, self.features, self.source = tuple(classes), tuple(features), source
        self.samples, self.service = samples, service
        self.epoch_samples, self.sharded = dict(epoch_samples or {}), sharded
        # Where the data hosts' streams stand (training/data_service/positions.py): their layout and
        # epoch sizes; the chief's positions of what every rank trained; a resumed run's plan, and the
        # first jobs' epoch ledger, which this job's adds to.
        self.data_layout, self.data_shares = data_layout, dict(data_shares or {})
        self._tracks_positions = service is not None and data_layout is not None and not config.cached_input_batches
        self.data_positions: dict[str, Position] = {}
        self.resume_plan: ResumePlan | None = None
        self.earlier_ledger: dict[str, Any] | None = None
        self.carried_input: Any = None  # a checkpoint's record, kept as it was by a job that does not track positions
        self.eval_samples, self.eval_features = eval_samples, tuple(eval_features)
        self.cpus, self.xla, self.host_group = cpus, xla, host_group
        if xla:
            import torch_xla

            self.device = torch_xla.device()
        else:
            self.device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        gpu = self.device.type == "cuda"
        capability = torch.cuda.get_device_capability(self.device) if gpu else None
        self.precision = "fp32" if xla and config.precision == "auto" else resolve_precision(config.precision, gpu=gpu, capability=capability)
        if xla and self.precision == "fp16":
            raise HyperparameterError("precision fp16 needs a loss scaler, which XLA devices do not use: use bf16 or fp32")
        if gpu:
            torch.backends.cudnn.benchmark = True
        self.ctx = TrainContext(hyperparameters=prepared.hyperparameters, device=self.device, rank=rank, world_size=world_size,
                                local_rank=local_rank, steps=config.steps, classes=self.classes, num_samples=num_samples,
                                precision=self.precision, is_xla=xla, channels=prepared.channels)
        torch.manual_seed(config.seed)  # the same initial weights on every rank
        self.module = self._build_model()
        if xla and world_size > 1:
            host_collectives.broadcast_parameters(self.module, host_group)  # one model, before any device work
        self.module.to(self.device)
        self.model: nn.Module = self.module
        if world_size > 1 and not xla:
            self.model = DistributedDataParallel(self.module, device_ids=[local_rank] if gpu else None)
        if config.compile and not xla:  # XLA compiles every step's graph anyway
            self.model = torch.compile(self.model)
        self.optimizer, self.scheduler = self._build_optimizer()
        self._checkpoint_loads_back = False  # until the first checkpoint was loaded back (save_checkpoint)
        self.scaler = torch.amp.GradScaler(self.device.type if not xla else "cpu", enabled=self.precision == "fp16")
        self.skipped_samples = 0
        self._in_flight: tuple[torch.Tensor, dict[str, torch.Tensor], int] | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self.validation: dict[str, Any] | None = None

    # Building ---------------------------------------------------------------------------------------

    def _build_model(self) -> nn.Module:
        try:
            model = self.workload.build_model(self.ctx)
        except Exception as error:  # noqa: BLE001 — the user's hook, by name
            raise WorkloadError(f"build_model raised {type(error).__name__}: {error}") from error
        if not isinstance(model, nn.Module):
            raise StepOutputError(f"build_model returned a {type(model).__name__}: return a torch.nn.Module")
        return model

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        if not self.workload.has("build_optimizer"):
            return default_optimizer(self.module, self.prepared.hyperparameters), None
        try:
            built = self.workload.build_optimizer(self.module, self.ctx)
        except Exception as error:  # noqa: BLE001
            raise WorkloadError(f"build_optimizer raised {type(error).__name__}: {error}") from error
        return checked_optimizer(built)

    # Input ------------------------------------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        source = self._service_batches() if self.source == "data_service" else self._local_batches()
        if self.runtime.cached_input_batches:
            source = _cycled([next(source) for _ in range(self.runtime.cached_input_batches)])  # made before the first step ends
        if self.xla:
            import torch_xla.distributed.parallel_loader as pl

            source = iter(pl.MpDeviceLoader(_Reiterable(source), self.device))
        yield from source

    def _service_batches(self) -> Iterator[Batch]:
        assert self.service is not None
        yield from self.service

    def _local_batches(self) -> Iterator[Batch]:
        assert self.samples is not None
        dataset = LocalSamples(self.prepared, self.samples, self.features, self.runtime.seed)
        workers = self.cpus if self.runtime.dataloader_workers < 0 else self.runtime.dataloader_workers
        try:
            sampler = TaggedSampler(len(self.samples), rank=self.rank, world_size=self.world_size, seed=self.runtime.seed,
                                    start=self.resume_samples, shard_ends=getattr(self.samples, "shard_ends", ()), legacy=self.legacy_order)
        except ShardTooSmallError as error:
            raise DataExhaustedError(str(error)) from None
        loader = DataLoader(dataset, batch_size=self.runtime.batch_size, sampler=sampler, num_workers=workers,
                            collate_fn=collate_features, worker_init_fn=_ignore_stop_signal, drop_last=True,
                            pin_memory=self.device.type == "cuda", prefetch_factor=2 if workers > 0 else None,
                            persistent_workers=False)
        for batch, skipped in loader:
            self.skipped_samples += skipped
            yield batch

    # The step ---------------------------------------------------------------------------------------

    def _on_device(self, batch: Batch) -> Batch:
        if not self.xla:
            batch = {name: tensor.to(self.device, non_blocking=True) for name, tensor in batch.items()}
        if self.workload.has("device_transform"):
            try:
                batch = self.workload.device_transform(batch, self.ctx)
            except Exception as error:  # noqa: BLE001
                raise WorkloadError(f"device_transform raised {type(error).__name__} at step {self.ctx.step}: {error}") from error
            if not isinstance(batch, Mapping):
                raise StepOutputError(f"device_transform returned a {type(batch).__name__}: return the batch (a dict of tensors)")
        return dict(batch)

    def _autocast(self) -> Any:
        dtype = AUTOCAST_DTYPES.get(self.precision)
        device_type = "xla" if self.xla else self.device.type
        return torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)

    def train_step(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        if self._tracks_positions:
            self.service.mark_trained()  # the oldest batch the stream yielded: a device loader keeps order
        self.ctx.step += 1
        step = self.ctx.step
        if self.xla:
            shapes = batch_shapes(batch)
            if self._shapes is None:
                self._shapes = shapes
            elif shapes != self._shapes:
                changed = next(name for name in shapes if shapes[name] != self._shapes.get(name))
                raise ShapeChangedError(f"batch {name_shape(changed, shapes)} at step {step}, {name_shape(changed, self._shapes)} before: "
                                        "on XLA each new shape compiles the step again; make preprocess return one shape (pad to a fixed length)")
        batch = self._on_device(batch)
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            try:
                output = self.workload.train_step(self.model, batch, self.ctx)
            except Exception as error:  # noqa: BLE001 — the user's step: named, with the step
                raise WorkloadError(f"train_step raised {type(error).__name__}{user_frame(error)} at step {step}: {error}"
                                    + batch_keys_hint(error, (batch,))) from error
        loss, metrics = step_output(output, step)
        self.scaler.scale(loss).backward()
        if self.xla:
            import torch_xla
            import torch_xla.core.xla_model as xm

            if self.runtime.grad_clip_norm > 0:
                # Clipped by the norm of the averaged gradients, as DDP's are: reduce, clip, step
                # (xm.optimizer_step is reduce_gradients then step).
                xm.reduce_gradients(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.runtime.grad_clip_norm)
                self.optimizer.step()
            else:
                xm.optimizer_step(self.optimizer)  # all-reduces the gradients across ranks, then steps
            if self.scheduler is not None:
                self.scheduler.step()
            torch_xla.sync()  # the step's one graph, sent to run
        else:
            if self.runtime.grad_clip_norm > 0:  # DDP's gradients are averaged by now: the global norm
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.runtime.grad_clip_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scheduler is not None:
                self.scheduler.step()
        # One step in flight: the previous step's loss is read (and checked) while this one runs.
        previous, self._in_flight = self._in_flight, (loss.detach(), metrics, step)
        if previous is not None:
            check_finite(previous[0].item(), previous[2])
        return self._in_flight

    def loss_value(self, loss: Any) -> float:
        if isinstance(loss, tuple):
            return check_finite(loss[0].item(), loss[2])
        return float(loss)

    def logged_metrics(self, loss: Any) -> dict[str, float]:
        return {name: value.item() for name, value in loss[1].items()} if isinstance(loss, tuple) else {}

    def settle(self) -> None:
        if self.xla:
            import torch_xla
            import torch_xla.core.xla_model as xm

            torch_xla.sync()
            xm.wait_device_ops()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._in_flight is not None:  # no checkpoint (nor model) of a diverged step
            check_finite(self._in_flight[0].item(), self._in_flight[2])
        self._in_flight = None

    # Validation -------------------------------------------------------------------------------------

    def after_step(self, step: int) -> None:
        if self.runtime.eval_every and step % self.runtime.eval_every == 0 and step < self.runtime.steps:
            self.validate()

    def validate(self) -> dict[str, Any]:
        """The workload's eval_step over the whole validation channel, every sample counted once across the
        ranks; each metric is the mean of its per-sample values (a scalar counts for the batch's samples)."""
        assert self.eval_samples is not None
        dataset = EvalSamples(self.prepared, self.eval_samples, self.eval_features, seed=self.runtime.seed, rank=self.rank,
                              world_size=self.world_size, batch_size=self.runtime.eval_batch_size or self.runtime.batch_size)
        workers = min(self.cpus, 4) if self.runtime.dataloader_workers < 0 else self.runtime.dataloader_workers
        loader: Any = DataLoader(dataset, batch_size=None, num_workers=workers, worker_init_fn=_ignore_stop_signal)
        if self.xla:
            import torch_xla.distributed.parallel_loader as pl

            loader = pl.MpDeviceLoader(loader, self.device)
        sums: dict[str, torch.Tensor] = {}
        count = torch.zeros((), device=self.device)
        # The unwrapped module: DDP's forward broadcasts buffers (BatchNorm's) after a training step, a
        # collective that a rank with no validation batch (fewer samples than ranks) would never join.
        model = self.module
        model.eval()
        self.ctx.training = False
        with torch.no_grad():
            for batch, weights in loader:
                weights = weights.to(self.device)
                batch = self._on_device(batch)
                with self._autocast():
                    try:
                        output = self.workload.eval_step(model, batch, self.ctx)
                    except Exception as error:  # noqa: BLE001
                        raise WorkloadError(f"eval_step raised {type(error).__name__}{user_frame(error)} after step {self.ctx.step}: "
                                            f"{error}" + batch_keys_hint(error, (batch,))) from error
                if not isinstance(output, Mapping) or not output:
                    raise StepOutputError(f"eval_step returned a {type(output).__name__}: return {{name: per-sample values [B] or a scalar}}")
                for name, value in output.items():
                    value = torch.as_tensor(value, device=self.device).float()
                    if value.numel() == 1:
                        total = value.reshape(()) * weights.sum()
                    elif tuple(value.shape) == tuple(weights.shape):
                        total = (value * weights).sum()
                    else:
                        raise StepOutputError(f"eval_step's {name!r} has shape {list(value.shape)}: per-sample values [{len(weights)}] or a scalar")
                    sums[str(name)] = sums.get(str(name), torch.zeros((), device=self.device)) + total
                count = count + weights.sum()
                self.mark_progress("evaluate")
        model.train()
        self.ctx.training = True
        local = {name: float(value.cpu()) for name, value in sums.items()} | {"__count": float(count.cpu())}
        ranks = self.gather(local)
        samples = sum(rank["__count"] for rank in ranks)
        metrics = {name: sum(rank.get(name, 0.0) for rank in ranks) / samples for name in local if name != "__count"} if samples else {}
        self.validation = {"step": self.ctx.step, "samples": int(samples), "metrics": {name: round(value, 6) for name, value in metrics.items()}}
        if self.is_chief and self.report_metrics:  # not a graph extraction's (its tensors hold no values)
            from training.metrics import metric_line

            print(metric_line(self.ctx.step, self.runtime.steps, {f"eval_{name}": value for name, value in metrics.items()}), flush=True)
        return self.validation

    # Collectives, state, outputs --------------------------------------------------------------------

    def save_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        check_restorable(self.ctx.state)
        # The optimizer's and scheduler's state as the user's code computed it (a schedule returning np.cos
        # leaves NumPy scalars in both): made plain, so that a resume's weights_only load takes it.
        saved = {"model": _to_cpu(self.module.state_dict()), "optimizer": plain(_to_cpu(self.optimizer.state_dict())),
                 "scheduler": plain(self.scheduler.state_dict()) if self.scheduler is not None else None,
                 "scaler": self.scaler.state_dict(), "workload_state": _to_cpu(self.ctx.state), "loop": state}
        with open(path, "wb") as handle:
            torch.save(saved, handle)
        if not self._checkpoint_loads_back:  # the first one: loaded back now, as a resume would, not found unloadable then
            check_loads_back(path, saved, int(state["step"]))
            self._checkpoint_loads_back = True

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        check_checkpoint_format(saved, path)
        changed = ("resume it with the code that wrote it, or train afresh with another checkpoint_s3_uri")
        try:
            self.module.load_state_dict(saved["model"])
        except RuntimeError as error:  # torch: missing, unexpected or differently shaped weights
            raise CheckpointFormatError(f"checkpoint {path} does not fit this run's model: {str(error).splitlines()[0]} …; {changed}") from None
        # The optimizer's state (moments, step counts) continues; its settings are this run's: a resumed
        # job with another learning_rate, weight decay or world size (the rate scales with the workers)
        # trains with what it was given, not with what the first job was. Written into the saved groups
        # before loading, so that torch places the state as this run's flags (capturable, fused) say.
        optimizer_state = with_this_runs_settings(saved["optimizer"], self.optimizer, keep_saved_lr=not isinstance(
            self.scheduler, torch.optim.lr_scheduler.LambdaLR) and self.scheduler is not None)
        try:
            self.optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError) as error:  # torch: another number or size of parameter groups
            raise CheckpointFormatError(f"checkpoint {path} does not fit this run's optimizer ({error}): the model or the "
                                        f"optimizer's parameter groups changed since it was written; {changed}") from None
        if self.scheduler is not None and saved.get("scheduler") is not None:
            base_lrs = list(getattr(self.scheduler, "base_lrs", []))
            self.scheduler.load_state_dict(saved["scheduler"])
            if base_lrs:
                self.scheduler.base_lrs = base_lrs  # this run's peak rates, not the first job's
            resumed_rate(self.scheduler)
        self.scaler.load_state_dict(saved["scaler"])
        self.ctx.state.clear()
        self.ctx.state.update(saved.get("workload_state") or {})
        self.ctx.step = int(saved["loop"]["step"])
        return saved["loop"]

    def save_model(self, model_dir: Path) -> None:
        torch.save(_to_cpu(self.module.state_dict()), model_dir / "model.pt")
        (model_dir / "workload.json").write_text(json.dumps(self.model_card(), indent=2, sort_keys=True) + "\n")
        code = model_dir / "code"
        shutil.rmtree(code, ignore_errors=True)
        shutil.copytree(self.workload.code_dir, code, ignore=shutil.ignore_patterns(".packages", "__pycache__", "wheels"))
        shutil.copyfile(Path(__file__).with_name("load_model.py"), model_dir / "load_model.py")

    def model_card(self) -> dict[str, Any]:
        """What loading the model needs beside its weights (load_model.py reads it)."""
        return {
            "contract_version": CONTRACT_VERSION,
            "module": self.workload.name,
            "code": "code",
            "weights": "model.pt",
            "hyperparameters": dict(self.prepared.hyperparameters),
            "classes": list(self.classes),
            "num_samples": self.ctx.num_samples,
            "features": [{"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)} for spec in self.features],
            "sha256": self.prepared.sha256,
            "validation": self.validation,
        }

    def summary_extra(self) -> dict[str, Any]:
        # Not on a stop: SageMaker's SIGKILL comes 120 s after its SIGTERM, and the model and summary come first.
        if self.eval_samples is not None and not self.stopping:
            self.validate()
        extra: dict[str, Any] = {
            "variant": "neuron" if self.xla else "pytorch",
            "workload": self.workload.name,
            "workload_sha256": self.prepared.sha256,
            "device": str(self.device) if self.xla else self.device.type,
            "data_source": self.source,
            "precision": self.precision,
            "classes": len(self.classes),
            "features": {spec.name: str(spec) for spec in self.features},
            "validation": self.validation,
            "cached_input_batches": self.runtime.cached_input_batches,
        }
        if self.resume_plan is not None:
            extra["data_position"] = self.resume_plan.summary()
        return extra | self.input_summary(self.service, self.skipped_samples, self.epoch_samples, sharded=self.sharded,
                                          epochs=not self.runtime.cached_input_batches, earlier=self.earlier_ledger)

    # Data-host positions ----------------------------------------------------------------------------

    def input_state(self) -> Any:
        if not self._tracks_positions:
            return None
        assert self.service is not None
        return {"trained": self.service.drain_trained(), "ledger": self.service.stats.ledger.as_dict()}

    def checkpoint_input(self, ranks: list[Any]) -> Any:
        if not self._tracks_positions:
            return self.carried_input  # what an earlier job recorded, for a later one that tracks again
        assert self.data_layout is not None
        trained: dict[str, list[np.ndarray]] = {}
        for rank in ranks:
            for host, ranges in rank["trained"].items():
                trained.setdefault(host, []).append(ranges)
        for host, ranges in trained.items():
            self.data_positions[host] = advance(self.data_positions.get(host, Position()), ranges)
        return {"layout": self.data_layout.as_json(),
                "positions": {host: position.as_json() for host, position in sorted(self.data_positions.items())},
                "ledger": merge([self.earlier_ledger or {}, *(rank["ledger"] for rank in ranks)])}

    def restore_input(self, saved: Any) -> None:
        if not self._tracks_positions:
            self.carried_input = saved
            return
        assert self.service is not None and self.data_layout is not None
        if saved is None:
            plan = ResumePlan(why="the checkpoint holds no data-host positions (a job without data hosts, one that cycled cached "
                                  "batches, or an earlier release wrote it): the data hosts start their order afresh, and what was trained "
                                  "of its last epoch is trained again")
        else:
            plan = resume_plan(saved, self.data_layout, last_epochs(saved.get("ledger") or {}))
            self.earlier_ledger = saved.get("ledger")
        self.data_positions = dict(plan.positions) if plan.exact else {
            host: Position(next=plan.start_epoch * share) for host, share in self.data_shares.items()}
        self.resume_plan = self.service.resume = plan
        log.info("data hosts resume %s", plan.summary())


class CheckpointFormatError(RuntimeError):
    """A checkpoint this runtime cannot resume: another release's layout, or another optimizer's."""


CHECKPOINT_KEYS = frozenset({"model", "optimizer", "scheduler", "scaler", "workload_state", "loop"})


def check_checkpoint_format(saved: Any, path: Path) -> None:
    """Refuse (CheckpointFormatError) a checkpoint not written by this runtime (save_checkpoint): an
    earlier release's trainers kept the schedule under ``lr_scheduler`` and one parameter group, which
    would resume with the schedule restarted or fail deep inside torch. Pure."""
    keys = set(saved) if isinstance(saved, Mapping) else set()
    if keys != CHECKPOINT_KEYS:
        found = ", ".join(sorted(map(str, keys))) or "none"
        raise CheckpointFormatError(f"checkpoint {path} was not written by this release's PyTorch runtime (its keys: {found}; "
                                    f"expected {', '.join(sorted(CHECKPOINT_KEYS))}): it cannot be resumed; train afresh "
                                    "with another checkpoint_s3_uri, or resume it with the release that wrote it")


def with_this_runs_settings(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, *, keep_saved_lr: bool) -> dict[str, Any]:
    """A saved optimizer state whose parameter groups carry this run's settings (everything but the
    parameter ids; the rate too unless ``keep_saved_lr``: a scheduler other than LambdaLR continues from
    the saved rate) and the saved moments. Groups that do not pair up are left for torch to refuse. Pure."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return dict(saved) if isinstance(saved, Mapping) else saved
    merged = []
    for kept, mine in zip(groups, optimizer.param_groups, strict=True):
        settings = {key: value for key, value in mine.items() if key != "params" and not (keep_saved_lr and key == "lr")}
        merged.append({**kept, **settings})
    return {**saved, "param_groups": merged}


def resumed_rate(scheduler: Any) -> None:
    """The next step's rate from this run's schedule: the optimizer's saved rate is the earlier run's,
    whose ``steps`` (or workers) may differ. For LambdaLR, whose rate is a function of the step; another
    scheduler's (a chained formula) continues from the saved rate."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        for group, base, rate in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
            group["lr"] = base * rate(scheduler.last_epoch)


def check_restorable(state: Mapping[str, Any]) -> None:
    """Refuse (StepOutputError, naming the key) workload state a resume could not load: checkpoints load
    with weights_only (no arbitrary objects are unpickled), which takes tensors, numbers, strings, and
    lists and dicts of them, not NumPy values."""
    import io

    for key, value in state.items():
        buffer = io.BytesIO()
        torch.save(_to_cpu(value), buffer)
        buffer.seek(0)
        try:
            torch.load(buffer, weights_only=True)
        except Exception as error:  # noqa: BLE001 — whatever weights_only refuses, named
            raise StepOutputError(f"ctx.state[{key!r}] is a {type(value).__name__}, which a resumed run could not load (checkpoints load "
                                  f"with weights_only): keep tensors, Python numbers, strings, and lists or dicts of them ({error})") from None


def worker_error_text(error: BaseException) -> str:
    """An error's message without the wrapper torch puts around one re-raised from a DataLoader worker
    ("Caught HookError in DataLoader worker process 0. Original Traceback ..."): its last line's message."""
    text = str(error)
    if "Original Traceback" not in text:
        return text
    last = [line for line in text.splitlines() if line.strip()][-1]
    prefix = f"{type(error).__module__}.{type(error).__name__}: "
    return last[len(prefix):] if last.startswith(prefix) else last


def name_shape(name: str, shapes: Mapping[str, tuple[int, ...]]) -> str:
    return f"{name!r} {list(shapes[name])}" if name in shapes else f"{name!r} (absent)"


def _cycled(batches: list[Batch]) -> Iterator[Batch]:
    while True:
        yield from batches


class _Reiterable:
    """An iterator that MpDeviceLoader may iterate once (it asks for iter(); a generator is its own)."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator

    def __iter__(self) -> Iterator[Any]:
        return self.iterator


def _ignore_stop_signal(_worker_id: int) -> None:
    """DataLoader workers leave SIGTERM to their trainer: torchrun stops a rank by signalling its whole
    process group, and a worker killed by it would crash the trainer (PyTorch turns a worker's death into
    an error) before the step boundary where it saves. They die with it (PR_SET_PDEATHSIG): a trainer
    that fails leaves at once, and no worker of it runs on."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


PR_SET_PDEATHSIG = 1


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value




def graph_extraction_run(config: WorkloadConfig, scratch: Path) -> tuple[WorkloadConfig, OutputPaths]:
    """Under neuron_parallel_compile (``precompile_steps``): that many steps (every graph of a step is seen
    after a few), a checkpoint and a validation (their graphs too), into a scratch folder, never the job's
    own outputs (its tensors are zeros: a checkpoint of them would be resumed from). Pure."""
    steps = max(2, config.precompile_steps)
    extraction = replace(config, steps=steps, warmup_steps=min(config.warmup_steps, steps - 1), checkpoint_every=0, eval_every=0,
                         precompile_steps=0)
    return extraction, OutputPaths.under(scratch)


def build_trainer(process: TrainerEnvironment) -> WorkloadTrainer:
    """This process's trainer, from what its door read (``TrainerEnvironment.read``): the workload its
    launcher unpacked, its rank, and the data hosts to read from when the job has them."""
    host = process.host
    cluster = host.cluster
    prepared = prepared_workload(process)
    settings, config = prepared.settings, prepared.config
    xla = settings.variant == "neuron"
    rank, world_size, local_rank = process.rank, process.world_size, process.local_rank
    cpus = max(1, host_cpus() // process.local_world_size)
    torch.set_num_threads(cpus)
    if torch.cuda.is_available() and not xla:
        torch.cuda.set_device(local_rank)  # before NCCL and any pinned memory
    if xla and world_size > 1 and process.pjrt_device == "CPU":
        raise HyperparameterError(f"torch-xla's CPU device runs one trainer process per host ({world_size} were started): on the "
                                  "emulated cluster pass --processes-per-host 1")
    host_group = None
    if world_size > 1:
        if xla:
            import torch_xla.distributed.xla_backend  # noqa: F401 — registers the "xla" backend

            dist.init_process_group("xla", init_method="xla://")
        else:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        host_group = host_collectives.host_group()
    paths = process.outputs
    extracting = xla and process.graph_extraction
    if extracting:
        config, paths = graph_extraction_run(config, host.base_dir / "precompile")
    common: dict[str, Any] = dict(prepared=prepared, rank=rank, world_size=world_size, local_rank=local_rank, cpus=cpus, xla=xla,
                                  host_group=host_group)
    addresses = settings.data_service_targets(cluster, host.addresses)
    if addresses:
        info = describe(addresses, settings.shutdown_token, settings.data_connect_timeout_s)
        if not info.features:
            raise DataServiceError(f"data host {info.host} describes no workload features (a tf.data.service host's): its job runs another variant")
        features = tuple(FeatureSpec(spec.name, spec.dtype, tuple(spec.shape)) for spec in info.features)
        try:
            wire = [codec.FeatureSpec(spec.name, spec.dtype, spec.shape) for spec in features]
        except codec.TensorFormatError as error:
            raise DataServiceError(f"data host {info.host} describes features no batch can carry: {error}") from None
        classes: Sequence[str] = tuple(info.classes)
        data_hosts = settings.data_hosts(cluster)  # in the addresses' order
        if info.sharded:
            # Each host lists its own share: their class names must agree, or a label would mean different
            # classes from different hosts.
            infos = describe_every(addresses, settings.shutdown_token, settings.data_connect_timeout_s)
            classes = shard_classes(infos)
            host_samples = [int(host.num_samples) for host in infos]
            epoch_samples = dict(zip(data_hosts, host_samples, strict=True))  # the ledger's scopes: host names
        else:
            host_samples = [int(info.num_samples)] * len(data_hosts)  # every host lists the whole channel
            epoch_samples = {"channel": int(info.num_samples)}
        listings = [host.listing_digest for host in infos] if info.sharded else [info.listing_digest] * len(data_hosts)
        layout = Layout(tuple(data_hosts), info.sharded, config.seed, tuple(host_samples), tuple(listings))
        shares = {host: epoch_share(samples, index, len(data_hosts), info.sharded) for index, (host, samples) in enumerate(zip(data_hosts, host_samples, strict=True))}
        service = DataServiceDataset(addresses, config.batch_size, token=settings.shutdown_token, client_id=f"{cluster.current_host}/rank{rank}",
                                     connect_timeout_s=settings.data_connect_timeout_s, batch_timeout_s=settings.data_batch_timeout_s,
                                     pin_memory=torch.cuda.is_available() and not xla,
                                     # Every host must serve these (the first host's word): another is refused by name.
                                     features=wire,
                                     # A graph extraction's few steps: they do not fix where the hosts' streams start.
                                     max_batches=config.steps if extracting else 0)
        common |= evaluation(prepared, config, classes)
        trainer = WorkloadTrainer(config, paths, classes=classes, features=features, num_samples=int(info.num_samples),
                                  source="data_service", service=service, epoch_samples=epoch_samples, sharded=info.sharded,
                                  data_layout=None if extracting else layout, data_shares=shares, **common)
    else:
        samples = prepared.list(settings.data_channel, training=True)
        features = prepared.features(samples, training=True)
        common |= evaluation(prepared, config, classes_of(samples))
        trainer = WorkloadTrainer(config, paths, classes=classes_of(samples), features=features, num_samples=len(samples), source="local",
                                  samples=samples, **common)
    trainer.report_metrics = not extracting  # a graph extraction's step times are not the job's
    trainer.container_started_at = process.container_started_at
    return trainer


def evaluation(prepared: PreparedWorkload, config: WorkloadConfig, classes: Sequence[str]) -> dict[str, Any]:
    """The evaluation channel's samples and features (none without an eval_channel), listed with the
    training channel's ``classes``. A listing whose classes are not those (an ImageFolder of a subset of
    the classes, labelled by its own sorted folders) is refused: its labels would name other classes than
    the model's outputs, and its accuracy would be wrong without a word."""
    if not config.eval_channel:
        return dict(eval_samples=None, eval_features=())
    samples = prepared.list(config.eval_channel, training=False, classes=classes)
    check_evaluation_classes(config.eval_channel, samples, classes)
    return dict(eval_samples=samples, eval_features=prepared.features(samples, training=False))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        trainer = build_trainer(TrainerEnvironment.read())
        summary = trainer.run()
    except (ClusterConfigError, HyperparameterError, ChannelError, WorkloadError, DataServiceError, DataExhaustedError,
            CheckpointWriteError, CheckpointFormatError, UnrestorableCheckpointError, NonFiniteLossError) as error:
        reason = f"{type(error).__name__}: {worker_error_text(error)}"
        log.error("training failed: %s", reason)
        write_failure(reason)
        return 1
    except TrainingStopped as stopped:
        return leave_stopped(stopped)
    if trainer.is_chief:
        log.info("training finished: %d steps, step time p50 %s ms", summary["steps"], (summary["step_time_ms"] or {}).get("p50"))
    return 0


if __name__ == "__main__":
    try:
        exit_code = main()
    except Exception as error:  # none of main's handlers names it (a broken collective, CUDA out of memory): its reason
        traceback.print_exc()
        write_first_failure(f"{type(error).__name__}: {error}")
        exit_code = 1
    # The trainer leaves at once, its outputs written (past the final barrier) or its reason: tearing down
    # DataLoader workers waited here, after a failed batch and after every homogeneous XLA run (up to the
    # launcher's exit timeout, billed), and a gloo group's teardown can deadlock (end_process).
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
    os._exit(exit_code)
