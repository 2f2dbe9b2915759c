"""PyTorch image classification on the DNN group: one process per device, DDP across them.

Where its batches come from depends on the job:

* with a data group, every process streams preprocessed uint8 batches from all data hosts over gRPC
  (training/data_service/client.py) and its CPUs only train;
* without one (the homogeneous baseline), DataLoader workers on this host's own CPUs decode and augment
  with exactly the same code the data hosts run;
* with ``cached_input_batches=N``, the first N real batches are kept in memory and cycled: the model's
  step time on real content with no input cost, the train-only figure the offload benchmark compares
  against. (Random tensors are not a faithful stand-in: on the CPU, a step on noise measured 5–10%
  slower than on real images.)

Normalisation to float runs on the device in every case. On a GPU the defaults are what the device is
fast at (measured on one H200, ResNet50 at 224², train-only: fp32 60 ms/step, bf16 + channels_last 29 ms):
mixed precision (``precision``: bf16 autocast on Ampere and later, fp16 with a gradient scaler on older
GPUs), channels_last, cuDNN's autotuner, batches in page-locked memory copied without blocking, and
``torch.compile`` on request. Each process binds its GPU before NCCL starts.

The learning rate is per worker and scaled by the number of workers after a linear warm-up
(training/trainers/schedule.py). The homogeneous input is an endless per-rank shard
(training/trainers/sampling.py): workers never drain at an epoch boundary, a resumed job reads on from
its checkpoint's data position, and each rank's DataLoader workers draw their own augmentations.

The launcher starts this module through torchrun (or directly); it reads the job from the SageMaker files
like any other process on the host:

    python -m training.trainers.pytorch_vision
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from training.cluster import ClusterConfigError, host_addresses, load_cluster
from training.data_service.client import DataServiceDataset
from training.data_service.control import DataServiceError, describe, describe_every
from training.data_service.dataset import ChannelError, CorruptDatasetError, ImageDataset, channel_dir, scan_images
from training.data_service.preprocess import DECODE_ERRORS, load_and_augment
from training.failure import write_failure
from training.hyperparameters import HyperparameterError, load_settings
from training.trainers import host_collectives
from training.trainers.config import AugmentConfig, VisionConfig
from training.trainers.host_collectives import end_process
from training.trainers.loop import (
    CheckpointWriteError,
    DataExhaustedError,
    OutputPaths,
    TrainingStopped,
    leave_stopped,
)
from training.trainers.precision import resolve_precision
from training.trainers.sampling import EndlessSampler, ShardTooSmallError
from training.trainers.schedule import Schedule
from training.trainers.service_summary import (  # noqa: F401 — tests import it here
    rank_service_stats,
    service_summary,
    shard_classes,
)
from training.trainers.torch_loop import TorchTrainingLoop, host_cpus

log = logging.getLogger("training.pytorch_vision")

# ImageNet statistics, applied on the device to the uint8 batches.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class VisionBatch(NamedTuple):
    images: torch.Tensor  # uint8 [B, 3, S, S]
    labels: torch.Tensor  # int64 [B]
    skipped: int  # undecodable files replaced or dropped while making this batch


class SmallCNN(nn.Module):
    """Three conv stages (width, 2×, 4× channels) with batch norm, global pooling and a linear head."""

    def __init__(self, num_classes: int, width: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for stage in range(3):
            out = width * 2**stage
            layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            layers += [nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            layers.append(nn.MaxPool2d(2))
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(config: VisionConfig, num_classes: int) -> nn.Module:
    if config.model == "cnn":
        return SmallCNN(num_classes, config.cnn_width)
    return getattr(torchvision.models, config.model)(weights=None, num_classes=num_classes)


class LocalImages(Dataset):
    """Map-style dataset over an image channel (files or tar shard members); an undecodable sample yields
    None and is counted."""

    def __init__(self, folder: ImageDataset, augment: AugmentConfig, seed: int = 0) -> None:
        self.folder = folder
        self.augment = augment
        self.seed = seed  # for reading in the trainer's own process (no workers)
        self._rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> tuple[np.ndarray | None, int]:
        if self._rng is None:
            # The DataLoader seeds each worker (worker_seed + its index); numpy's stream derives from it.
            worker = torch.utils.data.get_worker_info()
            self._rng = np.random.default_rng((worker.seed if worker is not None else self.seed) % 2**32)
        path, label = self.folder.samples[index]
        try:
            return load_and_augment(path, self._rng, self.augment), label
        except DECODE_ERRORS:
            log.warning("skipping undecodable file %s", path)
            return None, label


def ignore_stop_signal(_worker_id: int) -> None:
    """DataLoader workers leave SIGTERM to their trainer. torchrun stops a rank by signalling its whole
    process group: a worker killed by it would crash the trainer (PyTorch turns a worker's death into an
    error in the main process) before it reaches the step boundary where it saves. The workers still
    end with their trainer, which shuts them down, or, if it dies, by noticing that it is gone."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def worker_seed(seed: int, rank: int, start: int) -> int:
    """The seed of a rank's DataLoader workers (torch gives worker k this plus k): apart for every rank, so
    that worker k of each rank does not draw the same crops, and for every resumed run. Pure."""
    return (seed * 1_000_003 + rank) * 1_000_003 + start


def local_loader(
    dataset: Dataset, *, batch_size: int, rank: int, world_size: int, seed: int, start: int, workers: int, pin_memory: bool,
    collate_fn: Any = None, shard_ends: Sequence[int] = (),
) -> DataLoader:
    """This rank's endless shard of ``dataset`` from ``start`` samples in, decoded by ``workers`` processes
    that persist (the sampler never ends, so they never drain) and draw augmentations of their own.
    ``shard_ends``: the dataset is tar shards, read in their streaming order (EndlessSampler)."""
    try:
        sampler = EndlessSampler(len(dataset), rank=rank, world_size=world_size, seed=seed, start=start, shard_ends=shard_ends)
    except ShardTooSmallError as error:
        raise DataExhaustedError(str(error)) from None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_fn,
        worker_init_fn=ignore_stop_signal,
        generator=torch.Generator().manual_seed(worker_seed(seed, rank, start)),
        pin_memory=pin_memory,
        prefetch_factor=2 if workers > 0 else None,
        drop_last=True,
    )


def collate_skipping(items: list[tuple[np.ndarray | None, int]]) -> VisionBatch:
    good = [(image, label) for image, label in items if image is not None]
    if not good:
        raise CorruptDatasetError(f"none of the {len(items)} files of a batch could be decoded; check the channel")
    return VisionBatch(
        torch.from_numpy(np.stack([image for image, _ in good])),
        torch.tensor([label for _, label in good], dtype=torch.int64),
        len(items) - len(good),
    )


class VisionTrainer(TorchTrainingLoop[VisionBatch]):
    checkpoint_name = "checkpoint.pt"

    def __init__(
        self,
        config: VisionConfig,
        paths: OutputPaths,
        *,
        classes: list[str],
        source: str,
        local_folder: ImageDataset | None = None,
        service: DataServiceDataset | None = None,
        epoch_samples: Mapping[str, int] | None = None,
        sharded: bool = False,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        cpus: int = 1,
    ) -> None:
        super().__init__(config, paths, rank=rank, world_size=world_size)
        self.vision = config
        self.classes = classes
        self.source = source
        self.local_folder = local_folder
        self.service = service
        # The samples one epoch holds: per data host (by address) for a sharded channel, else the
        # channel's ({"channel": n}): what the summary's epoch accounting checks receipts against.
        self.epoch_samples = dict(epoch_samples or {})
        self.sharded = sharded  # each data host serves its own shard: its epochs are checked on their own
        self.cpus = cpus
        self.device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        self.precision = resolve_precision(config.precision, gpu=self.device.type == "cuda", capability=capability)
        self.memory_format = torch.channels_last if config.channels_last and self.device.type == "cuda" else torch.contiguous_format
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: pick each convolution's fastest kernel once
        torch.manual_seed(config.seed)
        self.module = build_model(config, len(classes)).to(self.device, memory_format=self.memory_format)
        self.model: nn.Module = self.module
        # The loop's own collectives (data wait, stop votes, summary counts) are host values: on a gloo
        # group of their own (training/trainers/host_collectives.py), so they never wait on the device.
        self.host_group = None
        if world_size > 1:
            self.model = DistributedDataParallel(self.module, device_ids=[local_rank] if self.device.type == "cuda" else None)
            self.host_group = host_collectives.host_group()
        if config.compile:
            self.model = torch.compile(self.model)
        self.optimizer = torch.optim.SGD(
            self.module.parameters(), lr=config.learning_rate, momentum=config.momentum, weight_decay=config.weight_decay
        )
        self.schedule = Schedule(config.learning_rate, config.steps, config.lr_warmup_fraction, workers=world_size,
                                 scale_with_workers=config.scale_lr)
        # LambdaLR counts the steps taken (from 0); the schedule, the step about to be taken (from 1).
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda done: self.schedule.factor(done + 1))
        # fp16 needs its loss scaled (its range is too narrow for small gradients); bf16 and fp32 do not.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.criterion = nn.CrossEntropyLoss()
        self.mean = torch.tensor(MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=self.device).view(1, 3, 1, 1)
        self.skipped_samples = 0
        self._in_flight: torch.Tensor | None = None  # the previous step's loss, while its kernels run

    def batches(self) -> Iterator[VisionBatch]:
        source = self._service_batches() if self.source == "data_service" else self._local_batches()
        if not self.vision.cached_input_batches:
            yield from source
            return
        # All of them made before the first step ends, so the cost lands in a warm-up step.
        cache = [next(source) for _ in range(self.vision.cached_input_batches)]
        while True:
            yield from cache

    def _service_batches(self) -> Iterator[VisionBatch]:
        assert self.service is not None
        for images, labels in self.service:
            yield VisionBatch(images, labels, 0)

    def _local_batches(self) -> Iterator[VisionBatch]:
        assert self.local_folder is not None
        seed = worker_seed(self.vision.seed, self.rank, self.resume_samples)
        dataset = LocalImages(self.local_folder, self.vision.augment_config, seed=seed)
        workers = self.cpus if self.vision.dataloader_workers < 0 else self.vision.dataloader_workers
        loader = local_loader(dataset, batch_size=self.vision.batch_size, rank=self.rank, world_size=self.world_size,
                              seed=self.vision.seed, start=self.resume_samples, workers=workers,
                              pin_memory=self.device.type == "cuda", collate_fn=collate_skipping,
                              shard_ends=self.local_folder.shard_ends)
        for batch in loader:
            self.skipped_samples += batch.skipped
            yield batch

    def train_step(self, batch: VisionBatch) -> torch.Tensor:
        images = batch.images.to(self.device, non_blocking=True).float().div_(255).sub_(self.mean).div_(self.std)
        images = images.contiguous(memory_format=self.memory_format)
        labels = batch.labels.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        dtype = AUTOCAST_DTYPES.get(self.precision)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            loss = self.criterion(self.model(images), labels)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.lr_scheduler.step()
        # One step in flight: wait for the previous step while this one runs on the GPU, so the next
        # batch's copy and kernel launches overlap it, and the host never runs further ahead (the step
        # time is then the GPU's). Reading a loss (on a step that logs) waits for its step.
        previous, self._in_flight = self._in_flight, loss.detach()
        if previous is not None:
            previous.item()
        return self._in_flight

    def loss_value(self, loss: Any) -> float:
        return loss.item() if isinstance(loss, torch.Tensor) else float(loss)

    def settle(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._in_flight = None

    def save_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        # Into a file of ours: a failed write then raises OSError with its errno (ENOSPC), which torch's own
        # writer, given a path, reports as a bare RuntimeError.
        with open(path, "wb") as handle:
            torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "lr_scheduler": self.lr_scheduler.state_dict(), "scaler": self.scaler.state_dict(), "loop": state}, handle)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        saved = torch.load(path, map_location=self.device, weights_only=True)
        self.module.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        # The next step's rate from this run's schedule (``steps`` or the workers may have changed).
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.at(int(saved["loop"]["step"]) + 1)
        return saved["loop"]

    def save_model(self, model_dir: Path) -> None:
        torch.save(self.module.state_dict(), model_dir / "model.pt")
        (model_dir / "classes.txt").write_text("\n".join(self.classes) + "\n")

    def summary_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "variant": "pytorch",
            "model": self.vision.model,
            "device": self.device.type,
            "data_source": self.source,
            "precision": self.precision,
            "channels_last": self.memory_format == torch.channels_last,
            "compiled": self.vision.compile,
            "cached_input_batches": self.vision.cached_input_batches,
            "classes": len(self.classes),
        }
        return extra | self.input_summary(self.service, self.skipped_samples, self.epoch_samples, sharded=self.sharded,
                                          epochs=not self.vision.cached_input_batches)


def build_trainer(environ: dict[str, str]) -> VisionTrainer:
    cluster = load_cluster(environ)
    settings, config = load_settings(VisionConfig, environ)
    rank, world_size = int(environ.get("RANK", 0)), int(environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(environ.get("LOCAL_RANK", 0)), int(environ.get("LOCAL_WORLD_SIZE", 1))
    cpus = max(1, host_cpus() // local_world)
    torch.set_num_threads(cpus)
    if torch.cuda.is_available():
        # Before NCCL and before any pinned memory: otherwise every rank makes a context on GPU 0.
        torch.cuda.set_device(local_rank)
    if world_size > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    paths = OutputPaths.from_environment(environ)
    addresses = settings.data_service_targets(cluster, host_addresses(environ))
    common: dict[str, Any] = dict(rank=rank, world_size=world_size, local_rank=local_rank, cpus=cpus)
    if addresses:
        info = describe(addresses, settings.shutdown_token, settings.data_connect_timeout_s)
        if info.batch_size != config.batch_size or tuple(info.sample_shape) != config.augment_config.sample_shape:
            raise HyperparameterError(
                f"data host {info.host} makes batches of {info.batch_size} × {tuple(info.sample_shape)}, "
                f"this trainer expects {config.batch_size} × {config.augment_config.sample_shape}"
            )
        # The samples an epoch holds: each host's own shard (every host must answer: their classes must
        # agree too), or the whole channel, whose epochs the hosts split (one answer suffices, and a data
        # host that never comes up leaves training to the others).
        if info.sharded:
            infos = describe_every(addresses, settings.shutdown_token, settings.data_connect_timeout_s)
            classes = shard_classes(infos)
            epoch_samples = {address: int(host.num_samples) for address, host in zip(addresses, infos, strict=True)}
        else:
            classes, epoch_samples = list(info.classes), {"channel": int(info.num_samples)}
        service = DataServiceDataset(
            addresses,
            config.batch_size,
            token=settings.shutdown_token,
            client_id=f"{cluster.current_host}/rank{rank}",
            connect_timeout_s=settings.data_connect_timeout_s,
            batch_timeout_s=settings.data_batch_timeout_s,
            pin_memory=torch.cuda.is_available(),
        )
        return VisionTrainer(config, paths, classes=classes, source="data_service", service=service,
                             epoch_samples=epoch_samples, sharded=info.sharded, **common)
    folder = scan_images(channel_dir(settings.data_channel, environ), settings.data_channel, cluster.current_group)
    return VisionTrainer(config, paths, classes=list(folder.classes), source="local", local_folder=folder, **common)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        trainer = build_trainer(dict(os.environ))
        summary = trainer.run()
    except (ClusterConfigError, HyperparameterError, ChannelError, CorruptDatasetError, DataServiceError, DataExhaustedError, CheckpointWriteError) as error:
        log.error("training failed: %s: %s", type(error).__name__, error)
        write_failure(f"{type(error).__name__}: {error}")
        return 1
    except TrainingStopped as stopped:
        return leave_stopped(stopped)
    if trainer.is_chief:
        log.info("training finished: %d steps, step time p50 %s ms", summary["steps"], (summary["step_time_ms"] or {}).get("p50"))
    return 0


if __name__ == "__main__":
    try:
        exit_code = main()
    except Exception:  # an error none of main's handlers names (a broken collective): its traceback, then out
        traceback.print_exc()
        exit_code = 1
    end_process(exit_code)
