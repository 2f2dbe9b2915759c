"""PyTorch/XLA sequence classification (BERT-style, via transformers): the Trainium trainer.

One process per NeuronCore, started by torchrun; each one trains on the XLA device, as the Neuron guide
and pytorch/xla's own multi-process examples do:

* world size and ordinals from ``torch_xla.runtime`` (not the deprecated xrt calls);
* one model: the seed is set before the model is built (in fp32, whatever the checkpoint holds), and the
  master's parameters are broadcast to every rank on the host, before any device work (``from_pretrained(num_labels=…)`` draws a fresh classifier head, and ``xm.optimizer_step``
  only averages gradients: ranks that start apart stay apart);
* the training CSV (AmazonPolarity layout: label, title, content) tokenised once per node, by local rank 0,
  in chunks of ``tokenize_chunk`` texts straight into memory-mapped int32 arrays (a 3.6M-row channel in
  one tokenizer call would need ~90 GiB), into a cache named after its inputs; the node's other ranks wait
  for the finished cache on the file system, not in a device collective (the Neuron runtime times those
  out after 30 s by default);
* an endless, resumable shard per rank (training/trainers/sampling.py) fed through MpDeviceLoader, and
  ``xm.optimizer_step`` (which all-reduces gradients across ranks); each step ends with ``torch_xla.sync()``,
  so a step is one executed graph, and one step is kept in flight (the previous one is waited for while
  this one runs: tracing overlaps execution, and the step time is the device's); the loss is read only on
  the steps that print it (use ``log_every`` > 1 on Trainium: a read waits for its step);
* the loop's own collectives (stop votes, data wait, barriers) on a gloo group, on the host
  (training/trainers/host_collectives.py): no device graph, and no device timeout while ranks wait;
* AdamW with linear warm-up and linear decay (the Neuron BERT recipe's schedule);
* the shared loop (training/trainers/loop.py): warm-up steps, where XLA compiles, are left out of step time
  and reported as ``warmup_s``; ``max_train_steps`` is ``steps``, honoured exactly;
* evaluation over the whole eval channel, every example counted once (fixed-size batches, the padding of
  the last one not counted), its labels mapped through the training classes, every ``eval_every`` steps
  and at the end, reduced across ranks;
* checkpoints and the model saved from the device to the CPU by the chief, after every rank has settled.

Locally, torch-xla runs on its CPU device (``PJRT_DEVICE=CPU``) in a single process; XLA's collectives do
not work there, so the multi-process parts (one model, sharding, once-per-node tokenisation) are tested
with gloo.

    python -m training.trainers.xla_text      (started by the launcher, like every trainer)
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from training.cluster import ClusterConfigError, base_dir, load_cluster
from training.data_service.dataset import ChannelError, EmptyChannelError, channel_dir, scan_text_channel, text_files
from training.failure import write_failure
from training.hyperparameters import HyperparameterError, load_settings
from training.metrics import metric_line
from training.trainers import host_collectives
from training.trainers.config import TextConfig
from training.trainers.loop import (
    CheckpointWriteError,
    DataExhaustedError,
    OutputPaths,
    TrainingStopped,
    leave_stopped,
)
from training.trainers.sampling import EndlessSampler, ShardTooSmallError, eval_batches
from training.trainers.schedule import Schedule
from training.trainers.torch_loop import TorchTrainingLoop

log = logging.getLogger("training.xla_text")

Batch = dict[str, torch.Tensor]


class TextDataError(ChannelError):
    """A CSV channel that cannot be read as (label, title, content) rows."""


def polarity_rows(folder: Path, channel: str) -> Iterator[tuple[int, str]]:
    """(label, "title. content") of every row of every text shard of a channel (scan_text_channel), in
    path order, read as a stream (a channel may not fit in memory). A CSV header row is recognised by a
    non-numeric label."""
    for path in scan_text_channel(folder, channel, "this host's group"):
        with path.open(newline="", encoding="utf-8") as handle:
            yield from (jsonl_rows if path.suffix.lower() == ".jsonl" else csv_rows)(handle, str(path.relative_to(folder)))


def csv_rows(handle: TextIO, name: str) -> Iterator[tuple[int, str]]:
    for line, row in enumerate(csv.reader(handle), start=1):
        if line == 1 and row and not row[0].strip().lstrip("-").isdigit():
            continue
        if len(row) < 3:
            raise TextDataError(f"{name} line {line}: expected label,title,content, got {len(row)} fields")
        yield text_label(row[0], name, line), f"{row[1].strip()}. {row[2].strip()}"


def jsonl_rows(handle: TextIO, name: str) -> Iterator[tuple[int, str]]:
    """JSON lines with a label and either title and content (AmazonPolarity's fields) or one text."""
    for line, text in enumerate(handle, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise TextDataError(f"{name} line {line}: not JSON ({error.msg})") from None
        if not isinstance(record, dict) or "label" not in record or not ({"title", "content"} <= record.keys() or "text" in record):
            raise TextDataError(f'{name} line {line}: expected {{"label", "title", "content"}} or {{"label", "text"}}')
        body = str(record["text"]) if "text" in record else f"{str(record['title']).strip()}. {str(record['content']).strip()}"
        yield text_label(record["label"], name, line), body


def text_label(value: object, name: str, line: int) -> int:
    if isinstance(value, bool):
        raise TextDataError(f"{name} line {line}: label {value!r} is not an integer")
    try:
        return int(value) if isinstance(value, int) else int(str(value).strip())
    except ValueError:
        raise TextDataError(f"{name} line {line}: label {value!r} is not an integer") from None


def channel_classes(folder: Path, channel: str) -> tuple[int, list[int]]:
    """(rows, the sorted distinct labels) of a channel: AmazonPolarity writes classes as 1/2, the Hugging
    Face copy as 0/1; the training channel's classes, in sorted order, become ids 0..n-1."""
    rows, labels = 0, set()
    for label, _ in polarity_rows(folder, channel):
        rows += 1
        labels.add(label)
    if not rows:
        raise EmptyChannelError(f"channel {channel!r} at {folder} holds no CSV rows")
    return rows, sorted(labels)


def cache_key(folder: Path, tokenizer_name: str, max_seq_len: int, classes: Sequence[int] | None = None) -> str:
    """Names the tokenised cache after what it was made from, so a changed input never reuses it."""
    digest = hashlib.sha256(f"{tokenizer_name}|{max_seq_len}|{list(classes) if classes is not None else ''}".encode())
    for path in sorted(text_files(folder)):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class TokenizedText(Dataset):
    """A tokenised channel, memory-mapped: int32 token ids and masks [rows, max_seq_len], int64 labels."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray
    classes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.from_numpy(np.array(self.input_ids[index])), torch.from_numpy(np.array(self.attention_mask[index])),
                torch.tensor(self.labels[index]))


def tokenized_path(folder: Path, channel: str, tokenizer: Any, max_seq_len: int, cache_dir: Path, classes: Sequence[int] | None = None) -> Path:
    """Where ``tokenize_channel`` leaves a channel's cache (a folder); the same on every rank. Pure but
    for reading the files' sizes and times."""
    key = cache_key(folder, getattr(tokenizer, "name_or_path", ""), max_seq_len, classes)
    return cache_dir / f"{channel}-{key}"


def tokenize_channel(
    folder: Path,
    channel: str,
    tokenizer: Any,
    max_seq_len: int,
    cache_dir: Path,
    *,
    classes: Sequence[int] | None = None,
    chunk: int = 4096,
) -> Path:
    """Tokenise a CSV channel into ``cache_dir`` (once: an existing cache is kept); returns its folder.

    ``classes``: the training channel's classes, for an evaluation channel (its ids must mean what they
    meant in training; a label training never saw is refused); None for the training channel itself.
    The rows are tokenised ``chunk`` at a time into preallocated memory-mapped int32 arrays, so memory
    stays bounded whatever the channel's size."""
    path = tokenized_path(folder, channel, tokenizer, max_seq_len, cache_dir, classes)
    if path.exists():
        return path
    rows, seen = channel_classes(folder, channel)
    if classes is None:
        classes = seen
    unknown = sorted(set(seen) - set(classes))
    if unknown:
        raise TextDataError(f"channel {channel!r} has labels {unknown} that the training channel's classes {list(classes)} do not have")
    index = {label: position for position, label in enumerate(classes)}
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    arrays = {name: np.lib.format.open_memmap(partial / f"{name}.npy", mode="w+", dtype=np.int32, shape=(rows, max_seq_len))
              for name in ("input_ids", "attention_mask")}
    labels = np.lib.format.open_memmap(partial / "labels.npy", mode="w+", dtype=np.int64, shape=(rows,))
    texts: list[str] = []
    done = 0

    def flush() -> None:
        nonlocal done
        encoded = tokenizer(texts, truncation=True, padding="max_length", max_length=max_seq_len, return_tensors="np")
        for name, array in arrays.items():
            array[done : done + len(texts)] = encoded[name]
        done += len(texts)
        texts.clear()

    for row, (label, text) in enumerate(polarity_rows(folder, channel)):
        labels[row] = index[label]
        texts.append(text)
        if len(texts) == chunk:
            flush()
    if texts:
        flush()
    for array in (*arrays.values(), labels):
        array.flush()
    (partial / "classes.json").write_text(json.dumps(list(classes)))
    os.replace(partial, path)
    return path


def once_per_node(local_rank: int, make: Callable[[], Path], expected: Path, *, poll_s: float = 0.5) -> Path:
    """Local rank 0 makes the file (``make`` returns ``expected``) while the node's other ranks wait for it
    to appear: on the file system, not in a collective, because making it can take minutes and the Neuron
    runtime times device collectives out after 30 s. ``make`` must leave ``expected`` atomically (it
    renames a finished folder into place). If rank 0 fails, torchrun ends the waiting ranks."""
    if local_rank == 0:
        return make()
    waited = 0.0
    while not expected.exists():
        time.sleep(poll_s)
        waited += poll_s
        if waited % 60 < poll_s:
            log.info("local rank %d still waiting for local rank 0 to tokenise %s (%.0f s)", local_rank, expected.name, waited)
    return expected


def load_tokenized(path: Path) -> TokenizedText:
    arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r") for name in ("input_ids", "attention_mask", "labels")}
    return TokenizedText(**arrays, classes=tuple(json.loads((path / "classes.json").read_text())))


def train_loader(dataset: TokenizedText, *, batch_size: int, world_size: int, rank: int, seed: int, start: int = 0) -> DataLoader:
    """This rank's endless shard, from ``start`` samples in; every batch full (one graph shape)."""
    try:
        sampler = EndlessSampler(len(dataset), rank=rank, world_size=world_size, seed=seed, start=start)
    except ShardTooSmallError as error:
        raise DataExhaustedError(str(error)) from None
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


class EvalShard(Dataset):
    """This rank's evaluation batches (training/trainers/sampling.eval_batches): fixed-size, each with a
    0/1 weight per example so that the padding of the last batch is not counted."""

    def __init__(self, dataset: TokenizedText, *, rank: int, world_size: int, batch_size: int) -> None:
        self.dataset = dataset
        self.batches = eval_batches(len(dataset), rank=rank, world_size=world_size, batch_size=batch_size)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        batch = self.batches[index]
        ids, mask, labels = (torch.stack(column) for column in zip(*(self.dataset[i] for i in batch.indices), strict=True))
        weights = torch.zeros(len(batch.indices), dtype=torch.int32)
        weights[: batch.valid] = 1
        return ids, mask, labels, weights


# What a masked token's attention score gets: BERT's own value. Finite in bf16 as well (fp32's minimum
# rounds to -inf in bf16, and 0 × -inf, for every token attended to, is NaN under XLA_USE_BF16).
MASKED_SCORE = -10_000.0


def additive_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The [batch, 1, 1, tokens] additive mask the attention layers add (0 to attend, MASKED_SCORE to
    ignore). Given a 2-D mask, transformers first asks ``mask.all()`` to skip masking: a value read
    from the device in the middle of the step, which on XLA executes a graph of its own every step and
    makes two step graphs (batches with and without padding). A prepared 4-D mask is used as it is."""
    return (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * MASKED_SCORE


class TextTrainer(TorchTrainingLoop[Batch]):
    checkpoint_name = "checkpoint.pt"

    def __init__(
        self,
        config: TextConfig,
        paths: OutputPaths,
        *,
        model: torch.nn.Module,
        tokenizer: Any,
        train: TokenizedText,
        evaluation: TokenizedText | None,
        rank: int = 0,
        world_size: int = 1,
        host_group: Any = None,
    ) -> None:
        import torch_xla

        super().__init__(config, paths, rank=rank, world_size=world_size)
        self.text = config
        self.host_group = host_group  # the loop's own collectives, on the host (training/trainers/host_collectives.py)
        if world_size > 1:
            # One model: every rank takes the master's weights, on the CPU, before any device work.
            host_collectives.broadcast_parameters(model, host_group)
        self.device = torch_xla.device()
        self.model = model.to(self.device)
        self._in_flight: torch.Tensor | None = None  # the previous step's loss, while its graph runs
        self.tokenizer = tokenizer
        self.train_data, self.eval_data, self.classes = train, evaluation, list(train.classes)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
        self.schedule = Schedule(config.learning_rate, config.steps, config.lr_warmup_fraction, decay=True)
        # The rate for step s is factor(s); LambdaLR counts from 0, the loop's steps from 1. On XLA the rate
        # travels as device data, so a new rate each step compiles no new graph.
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda done: self.schedule.factor(done + 1))
        self.eval_accuracy: float | None = None

    def _device_loader(self, loader: DataLoader) -> Iterator[Any]:
        import torch_xla.distributed.parallel_loader as pl

        return iter(pl.MpDeviceLoader(loader, self.device))

    def batches(self) -> Iterator[Batch]:
        loader = train_loader(self.train_data, batch_size=self.text.batch_size, world_size=self.world_size, rank=self.rank,
                              seed=self.text.seed, start=self.resume_samples)
        for input_ids, attention_mask, labels in self._device_loader(loader):
            yield {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def train_step(self, batch: Batch) -> torch.Tensor:
        import torch_xla
        import torch_xla.core.xla_model as xm

        loss = self.model(input_ids=batch["input_ids"], attention_mask=additive_mask(batch["attention_mask"]), labels=batch["labels"]).loss
        loss.backward()
        xm.optimizer_step(self.optimizer)  # all-reduces gradients across ranks, then steps
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        torch_xla.sync()  # the step's one graph: forward, backward, all-reduce, update, sent to run
        # One step in flight: wait for the previous step's graph while this one runs, so that tracing the
        # next step overlaps this one's execution, and the host never runs further ahead than that (the
        # step time is then the device's, not the tracing's).
        previous, self._in_flight = self._in_flight, loss
        if previous is not None:
            previous.item()  # a transfer once that graph has run; executes nothing
        return loss  # reading it (on a step that logs) waits for this step's graph

    def loss_value(self, loss: Any) -> float:
        return loss.item() if isinstance(loss, torch.Tensor) else float(loss)

    def settle(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()
        self._in_flight = None

    def after_step(self, step: int) -> None:
        if self.text.eval_every and step % self.text.eval_every == 0 and step < self.text.steps:
            accuracy = self.evaluate()
            if self.is_chief:
                print(metric_line(step, self.text.steps, {"eval_accuracy": accuracy}), flush=True)

    def evaluate(self) -> float | None:
        """Accuracy over the whole eval channel, every example counted once, every rank scoring its shard."""
        assert self.eval_data is not None
        shard = EvalShard(self.eval_data, rank=self.rank, world_size=self.world_size, batch_size=self.text.batch_size)
        loader = DataLoader(shard, batch_size=None)
        correct = torch.zeros((), device=self.device)
        total = torch.zeros((), device=self.device)
        self.model.eval()
        with torch.no_grad():
            for input_ids, attention_mask, labels, weights in self._device_loader(loader):
                logits = self.model(input_ids=input_ids, attention_mask=additive_mask(attention_mask)).logits
                correct += ((logits.argmax(-1) == labels) * weights).sum()
                total += weights.sum()
                self.mark_progress("evaluate")  # no step runs meanwhile: the launcher's stall rule counts these
        self.model.train()
        counts = torch.stack([correct, total])
        if self.world_size > 1:
            import torch_xla.core.xla_model as xm

            counts = xm.all_reduce(xm.REDUCE_SUM, counts)
        correct_count, total_count = counts.cpu().tolist()
        self.eval_accuracy = correct_count / total_count if total_count else None
        return self.eval_accuracy

    def save_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        import torch_xla.core.xla_model as xm

        xm.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "lr_scheduler": self.lr_scheduler.state_dict(), "loop": state}, str(path), master_only=False)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        # The next step's rate from this run's schedule (``steps`` may have changed since the checkpoint).
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.at(int(saved["loop"]["step"]) + 1)
        return saved["loop"]

    def save_model(self, model_dir: Path) -> None:
        cpu_state = {name: tensor.cpu() for name, tensor in self.model.state_dict().items()}
        self.model.save_pretrained(model_dir, state_dict=cpu_state)
        self.tokenizer.save_pretrained(model_dir)

    def summary_extra(self) -> dict[str, Any]:
        if self.eval_data is not None:
            self.evaluate()
        return {
            "variant": "neuron",
            "model": self.text.model_channel or self.text.model,
            "device": str(self.device),
            "classes": self.classes,
            "eval_accuracy": self.eval_accuracy,
            "eval_examples": len(self.eval_data) if self.eval_data is not None else 0,
        }


def build_model(source: str, num_labels: int, seed: int) -> torch.nn.Module:
    """The pretrained model with a fresh classification head, the same head on every rank: the seed is
    set before the head is drawn (the master's parameters are broadcast as well, in TextTrainer)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    # fp32 weights whatever the checkpoint was saved in: transformers' default (dtype "auto") would load a
    # bf16 checkpoint as bf16, and AdamW would then update half-precision weights with no fp32 copy.
    return AutoModelForSequenceClassification.from_pretrained(source, num_labels=num_labels, dtype=torch.float32)


# Set by neuron_parallel_compile while it runs the trainer to collect its graphs (tensors hold no values).
GRAPH_EXTRACTION_ENV = "NEURON_EXTRACT_GRAPHS_ONLY"


def graph_extraction_run(config: TextConfig, scratch: Path) -> tuple[TextConfig, OutputPaths]:
    """Under neuron_parallel_compile: ``precompile_steps`` steps (every graph of a step is seen after a
    few), a checkpoint and an evaluation (their graphs too), into a scratch folder, never the job's own
    outputs (its tensors are zeros: a checkpoint of them would be resumed from). Pure."""
    steps = max(2, config.precompile_steps)
    extraction = replace(config, steps=steps, warmup_steps=min(config.warmup_steps, steps - 1), checkpoint_every=0, eval_every=0)
    return extraction, OutputPaths.under(scratch)


def build_trainer(environ: dict[str, str]) -> TextTrainer:
    import torch_xla.runtime as xr

    cluster = load_cluster(environ)
    settings, config = load_settings(TextConfig, environ)
    paths = OutputPaths.from_environment(environ)
    extracting = bool(environ.get(GRAPH_EXTRACTION_ENV))
    if extracting:
        config, paths = graph_extraction_run(config, base_dir(environ) / "precompile")
    world_size = int(environ.get("WORLD_SIZE", 1))
    group = None
    if world_size > 1:
        import torch.distributed as dist

        dist.init_process_group("xla", init_method="xla://")
        group = host_collectives.host_group()
    rank, local_rank = (xr.global_ordinal(), xr.local_ordinal()) if world_size > 1 else (0, 0)
    from transformers import AutoTokenizer

    # The model and tokenizer come from a channel (offline, versioned with the data) or a named model.
    source = str(channel_dir(config.model_channel, environ)) if config.model_channel else config.model
    tokenizer = AutoTokenizer.from_pretrained(source)
    cache = base_dir(environ) / "tokenized"  # node-local: every host tokenises its own copy

    def tokenized(channel: str, classes: Sequence[int] | None) -> TokenizedText:
        folder = channel_dir(channel, environ)
        path = tokenized_path(folder, channel, tokenizer, config.max_seq_len, cache, classes)
        make = lambda: tokenize_channel(folder, channel, tokenizer, config.max_seq_len, cache, classes=classes,  # noqa: E731
                                        chunk=config.tokenize_chunk)
        return load_tokenized(once_per_node(local_rank, make, path))

    train = tokenized(settings.data_channel, None)
    evaluation = tokenized(config.eval_channel, train.classes) if config.eval_channel else None
    if world_size > 1:
        # Every node tokenises its own copy, some slower than others: wait on the host for all of them
        # before the first device collective, which the Neuron runtime would time out.
        host_collectives.barrier(group)
    model = build_model(source, len(train.classes), config.seed)
    log.info("host %s rank %d/%d: %d training examples, classes %s", cluster.current_host, rank, world_size, len(train), list(train.classes))
    trainer = TextTrainer(config, paths, model=model, tokenizer=tokenizer, train=train, evaluation=evaluation, rank=rank,
                          world_size=world_size, host_group=group)
    trainer.report_metrics = not extracting  # its step times are not the job's
    return trainer


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        build_trainer(dict(os.environ)).run()
    except (ClusterConfigError, HyperparameterError, ChannelError, DataExhaustedError, CheckpointWriteError, OSError) as error:
        log.error("training failed: %s: %s", type(error).__name__, error)
        write_failure(f"{type(error).__name__}: {error}")
        return 1
    except TrainingStopped as stopped:
        return leave_stopped(stopped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
