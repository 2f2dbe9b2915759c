"""PyTorch/XLA sequence classification (BERT-style, via transformers): the Trainium trainer.

One process per NeuronCore, started by torchrun; each one trains on the XLA device, with:

* world size and ordinals from ``torch_xla.runtime`` (not the deprecated xrt calls);
* the training CSV (AmazonPolarity layout: label, title, content) tokenised once per node, by local rank 0,
  into a cache named after its inputs, while the other ranks wait at a rendezvous;
* a DistributedSampler shard per rank, fed through MpDeviceLoader, and ``xm.optimizer_step`` (which
  all-reduces gradients across ranks); the loss is read every step, so every step is one executed graph;
* the shared loop (training/trainers/loop.py): warm-up steps, where XLA compiles, are left out of step time
  and reported as ``warmup_s``; ``max_train_steps`` is ``steps``, honoured exactly;
* evaluation over the whole eval channel (its own sampler and loader, never a training batch), every
  ``eval_every`` steps and at the end, reduced across ranks;
* checkpoints and the model saved from the device to the CPU by the chief only.

Locally, torch-xla runs on its CPU device (``PJRT_DEVICE=CPU``) in a single process; XLA's collectives do
not work there, so the multi-process parts (sharding, once-per-node tokenisation) are tested with gloo.

    python -m training.trainers.xla_text      (started by the launcher, like every trainer)
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from training.cluster import ClusterConfigError, base_dir, load_cluster
from training.data_service.dataset import ChannelError, EmptyChannelError, channel_dir, scan_csv_channel
from training.failure import write_failure
from training.hyperparameters import HyperparameterError, load_hyperparameters, parse_settings
from training.metrics import metric_line
from training.trainers.config import TextConfig
from training.trainers.loop import DataExhaustedError, OutputPaths, TrainingLoop, TrainingStopped, leave_stopped

log = logging.getLogger("training.xla_text")

Batch = dict[str, torch.Tensor]


class TextDataError(ChannelError):
    """A CSV channel that cannot be read as (label, title, content) rows."""


def read_polarity_csv(folder: Path, channel: str) -> tuple[list[str], list[int]]:
    """Texts ("title. content") and labels from every .csv file of a channel, in file-name order. A
    header row is recognised by a non-numeric label and skipped."""
    files = scan_csv_channel(folder, channel, "this host's group")
    texts: list[str] = []
    labels: list[int] = []
    for path in files:
        with path.open(newline="", encoding="utf-8") as handle:
            for line, row in enumerate(csv.reader(handle), start=1):
                if line == 1 and row and not row[0].strip().lstrip("-").isdigit():
                    continue
                if len(row) < 3:
                    raise TextDataError(f"{path.name} line {line}: expected label,title,content, got {len(row)} fields")
                labels.append(int(row[0]))
                texts.append(f"{row[1].strip()}. {row[2].strip()}")
    if not texts:
        raise EmptyChannelError(f"channel {channel!r} at {folder} holds no CSV rows")
    return texts, labels


def label_ids(labels: list[int]) -> tuple[list[int], list[int]]:
    """AmazonPolarity writes classes as 1/2, the Hugging Face copy as 0/1: map whatever is there to
    0..n-1, in sorted order. Returns (ids, the original label of each id)."""
    classes = sorted(set(labels))
    index = {label: position for position, label in enumerate(classes)}
    return [index[label] for label in labels], classes


def cache_key(folder: Path, tokenizer_name: str, max_seq_len: int) -> str:
    """Names the tokenised cache after what it was made from, so a changed input never reuses it."""
    digest = hashlib.sha256(f"{tokenizer_name}|{max_seq_len}".encode())
    for path in sorted(folder.glob("*.csv")):
        stat = path.stat()
        digest.update(f"{path.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def tokenize_channel(folder: Path, channel: str, tokenizer: Any, max_seq_len: int, cache_dir: Path) -> Path:
    """Tokenise a CSV channel into ``cache_dir`` (once: an existing cache is kept); returns the file."""
    path = cache_dir / f"{channel}-{cache_key(folder, getattr(tokenizer, 'name_or_path', ''), max_seq_len)}.pt"
    if path.exists():
        return path
    texts, labels = read_polarity_csv(folder, channel)
    ids, classes = label_ids(labels)
    encoded = tokenizer(texts, truncation=True, padding="max_length", max_length=max_seq_len, return_tensors="pt")
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
         "labels": torch.tensor(ids, dtype=torch.long), "classes": classes},
        partial,
    )
    os.replace(partial, path)
    return path


def once_per_node(local_rank: int, make: Callable[[], Path], barrier: Callable[[], None]) -> Path:
    """Local rank 0 makes the file while the node's other ranks wait; then every rank has it. ``make``
    must be deterministic (the other ranks call it too, after the barrier, to learn the path: it finds
    the cache and returns at once)."""
    if local_rank == 0:
        path = make()
        barrier()
        return path
    barrier()
    return make()


def load_tokenized(path: Path) -> tuple[TensorDataset, list[int]]:
    data = torch.load(path, weights_only=True)
    return TensorDataset(data["input_ids"], data["attention_mask"], data["labels"]), list(data["classes"])


def shard_loader(dataset: TensorDataset, *, batch_size: int, world_size: int, rank: int, seed: int, train: bool) -> DataLoader:
    """This rank's share: shuffled, equal and full batches for training; in order and whole for eval."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=train, seed=seed, drop_last=train)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=train)


class TextTrainer(TrainingLoop[Batch]):
    checkpoint_name = "checkpoint.pt"

    def __init__(
        self,
        config: TextConfig,
        paths: OutputPaths,
        *,
        model: torch.nn.Module,
        tokenizer: Any,
        train: TensorDataset,
        evaluation: TensorDataset | None,
        classes: list[int],
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        import torch_xla

        super().__init__(config, paths, rank=rank, world_size=world_size)
        self.text = config
        self.device = torch_xla.device()
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.train_data, self.eval_data, self.classes = train, evaluation, classes
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
        self.eval_accuracy: float | None = None

    def _device_loader(self, loader: DataLoader) -> Iterator[Any]:
        import torch_xla.distributed.parallel_loader as pl

        return iter(pl.MpDeviceLoader(loader, self.device))

    def batches(self) -> Iterator[Batch]:
        loader = shard_loader(self.train_data, batch_size=self.text.batch_size, world_size=self.world_size, rank=self.rank,
                              seed=self.text.seed, train=True)
        if len(loader) == 0:
            raise DataExhaustedError(f"{len(self.train_data)} examples make no full batch of {self.text.batch_size} per rank")
        epoch = 0
        while True:
            loader.sampler.set_epoch(epoch)
            for input_ids, attention_mask, labels in self._device_loader(loader):
                yield {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
            epoch += 1

    def train_step(self, batch: Batch) -> float:
        import torch_xla.core.xla_model as xm

        loss = self.model(**batch).loss
        loss.backward()
        xm.optimizer_step(self.optimizer)  # all-reduces gradients across ranks, then steps
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()  # executes this step's graph

    def after_step(self, step: int) -> None:
        if self.text.eval_every and step % self.text.eval_every == 0 and step < self.text.steps:
            accuracy = self.evaluate()
            if self.is_chief:
                print(metric_line(step, self.text.steps, {"eval_accuracy": accuracy}), flush=True)

    def evaluate(self) -> float:
        """Accuracy over the whole eval channel, every rank scoring its shard."""
        assert self.eval_data is not None
        loader = shard_loader(self.eval_data, batch_size=self.text.batch_size, world_size=self.world_size, rank=self.rank,
                              seed=self.text.seed, train=False)
        correct = torch.zeros((), device=self.device)
        total = torch.zeros((), device=self.device)
        self.model.eval()
        with torch.no_grad():
            for input_ids, attention_mask, labels in self._device_loader(loader):
                logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
                correct += (logits.argmax(-1) == labels).sum()
                total += labels.numel()
        self.model.train()
        counts = torch.stack([correct, total])
        if self.world_size > 1:
            import torch_xla.core.xla_model as xm

            counts = xm.all_reduce(xm.REDUCE_SUM, counts)
        correct_count, total_count = counts.cpu().tolist()
        self.eval_accuracy = correct_count / total_count if total_count else None
        return self.eval_accuracy

    def save_checkpoint(self, path: Path, step: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.save({"step": step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, str(path), master_only=False)

    def load_checkpoint(self, path: Path) -> int:
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        return int(state["step"])

    def save_model(self, model_dir: Path) -> None:
        cpu_state = {name: tensor.cpu() for name, tensor in self.model.state_dict().items()}
        self.model.save_pretrained(model_dir, state_dict=cpu_state)
        self.tokenizer.save_pretrained(model_dir)

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("training-loop")

    def reduce_max(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        import torch_xla.core.xla_model as xm

        # Host values: reduced between the processes' hosts, without a device graph.
        return xm.mesh_reduce("step-metrics", values, lambda per_rank: [max(column) for column in zip(*per_rank, strict=True)])

    def gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        import torch_xla.core.xla_model as xm

        return xm.mesh_reduce("gather", value, list)

    def summary_extra(self) -> dict[str, Any]:
        if self.eval_data is not None:
            self.evaluate()
        return {
            "variant": "neuron",
            "model": self.text.model_channel or self.text.model,
            "device": str(self.device),
            "classes": self.classes,
            "eval_accuracy": self.eval_accuracy,
        }


def build_trainer(environ: dict[str, str]) -> TextTrainer:
    import torch_xla.runtime as xr

    cluster = load_cluster(environ)
    settings, config = parse_settings(load_hyperparameters(environ), TextConfig)
    world_size = int(environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        import torch.distributed as dist

        dist.init_process_group("xla", init_method="xla://")
    rank, local_rank = (xr.global_ordinal(), xr.local_ordinal()) if world_size > 1 else (0, 0)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # The model and tokenizer come from a channel (offline, versioned with the data) or a named model.
    source = str(channel_dir(config.model_channel, environ)) if config.model_channel else config.model
    tokenizer = AutoTokenizer.from_pretrained(source)
    cache = base_dir(environ) / "tokenized"  # node-local: every host tokenises its own copy

    def barrier() -> None:
        if world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("tokenized")

    def tokenized(channel: str) -> Path:
        folder = channel_dir(channel, environ)
        return once_per_node(local_rank, lambda: tokenize_channel(folder, channel, tokenizer, config.max_seq_len, cache), barrier)

    train, classes = load_tokenized(tokenized(settings.data_channel))
    evaluation = load_tokenized(tokenized(config.eval_channel))[0] if config.eval_channel else None
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=len(classes))
    log.info("host %s rank %d/%d: %d training examples, classes %s", cluster.current_host, rank, world_size, len(train), classes)
    return TextTrainer(config, OutputPaths.from_environment(environ), model=model, tokenizer=tokenizer, train=train,
                       evaluation=evaluation, classes=classes, rank=rank, world_size=world_size)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        build_trainer(dict(os.environ)).run()
    except (ClusterConfigError, HyperparameterError, ChannelError, DataExhaustedError, OSError) as error:
        log.error("training failed: %s: %s", type(error).__name__, error)
        write_failure(f"{type(error).__name__}: {error}")
        return 1
    except TrainingStopped as stopped:
        return leave_stopped(stopped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
