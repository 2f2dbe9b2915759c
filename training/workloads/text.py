"""The built-in text classifier: a Hugging Face sequence-classification model (BERT by default) fine-tuned
on AmazonPolarity-style text, written only against the workload contract (training/workload/contract.py)
and trained by the one PyTorch runtime (training/trainers/pytorch_runtime.py), on Trainium as on a GPU.

A spec names it with ``"workload": "text"`` and no code of its own: the launcher puts this folder on the
path and imports the module as ``text``, exactly as it imports a user's ``workload``. What it does:

* ``list_samples``: the channel's CSV (label, title, content) and JSONL ({"label", "title", "content"} or
  {"label", "text"}) shards, anywhere under it, read in path order, tokenised once per node in chunks of
  ``tokenize_chunk`` texts straight into memory-mapped int32 arrays (a 3.6M-row channel in one tokenizer
  call would need ~90 GiB), into a node-local cache named after its inputs (``TRAINING_CACHE_DIR``, else
  the temporary folder). The first process of the node to get there makes it, under a file lock; the
  node's other ranks wait on the file system (not in a device collective, which the Neuron runtime would
  time out after 30 s) and reuse it. The listing is ``TokenizedRows``: a Sequence over the memmaps that
  pickles as its folder's path, so worker processes get millions of rows in microseconds;
* the classes are the training channel's sorted distinct labels (AmazonPolarity writes 1/2, the Hugging
  Face copy 0/1), as strings; an evaluation channel's labels are mapped through the training channel's
  (``ctx.training_channel``), so that an id means what it meant in training, and a label training never
  saw is refused by name;
* ``build_model``: the pretrained model with a fresh classification head, in fp32 whatever the checkpoint
  holds (the runtime seeds torch first and broadcasts rank 0's parameters on XLA: one head on every rank);
* AdamW, weight decay on weights only (not on LayerNorm weights and biases), with a linear warm-up over
  ``lr_warmup_fraction`` of the steps then a linear decay to zero (the Neuron BERT recipe's schedule);
  gradients clipped to a norm of 1.0 by default (``LOOP_DEFAULTS``, BERT's and Hugging Face's default);
* each step passes a prepared 4-D additive attention mask (see ``additive_mask``): one graph per step.

The model and tokenizer come from the ``model_channel`` channel (offline, versioned with the data) or the
``model`` name (a Hugging Face name in the image's cache, or a folder). A heterogeneous job routes the
model channel to the data group too (it tokenises there) and the training channel to the DNN group when
it validates there (the evaluation labels are mapped through its classes).

The saved model is the runtime's: ``model.pt`` (the state_dict), ``workload.json``, this code and
``load_model.py``. ``from load_model import load; model, card = load("MODEL_DIR")`` rebuilds the model with
``build_model`` from the ``model`` hyperparameter in workload.json (a Hugging Face name or a folder with the
pretrained model's config) and loads the trained weights over it; a model trained from a ``model_channel``
loads after setting, in workload.json, ``model_channel`` to "" and ``model`` to that pretrained folder
(its tokenizer is the one to tokenise inputs with: the same ``max_seq_len``, padding to it).

    {"variant": "neuron", "workload": "text", "hyperparameters": {"model_channel": "model", "eval_channel": "test"}, ...}
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch.nn import functional as F

HYPERPARAMETERS = {"model": "bert-base-uncased", "model_channel": "", "max_seq_len": 128, "learning_rate": 5e-5, "weight_decay": 0.01,
                   "lr_warmup_fraction": 0.1, "tokenize_chunk": 4096}
LOOP_DEFAULTS = {"grad_clip_norm": 1.0}  # BERT's pre-training and Hugging Face's Trainer clip at 1.0

CACHE_DIR_ENV = "TRAINING_CACHE_DIR"
TEXT_SUFFIXES = (".csv", ".jsonl")

log = logging.getLogger("text")


class TextDataError(ValueError):
    """A text channel that cannot be read as labelled rows: the message names the file and the line."""


# Reading the rows --------------------------------------------------------------------------------------


def text_files(folder: Path) -> list[Path]:
    """The channel's non-empty .csv/.jsonl shards, anywhere under it, in path order (hidden folders and
    files, such as .ipynb_checkpoints, left out)."""
    folder = Path(folder)
    return sorted(path for path in folder.rglob("*") if path.suffix.lower() in TEXT_SUFFIXES and path.is_file()
                  and not any(part.startswith(".") for part in path.relative_to(folder).parts) and path.stat().st_size > 0)


def polarity_rows(folder: Path, channel: str) -> Iterator[tuple[int, str]]:
    """(label, "title. content") of every row of every shard of a channel, in path order, read as a stream
    (a channel may not fit in memory). A CSV header row is recognised by a non-numeric label."""
    files = text_files(folder)
    if not files:
        raise TextDataError(f"channel {channel!r} at {folder} holds no non-empty {' or '.join(TEXT_SUFFIXES)} files")
    for path in files:
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
    """(rows, the sorted distinct labels) of a channel: the training channel's, in sorted order, become
    ids 0..n-1."""
    rows, labels = 0, set()
    for label, _ in polarity_rows(folder, channel):
        rows += 1
        labels.add(label)
    if not rows:
        raise TextDataError(f"channel {channel!r} at {folder} holds no rows")
    return rows, sorted(labels)


# The node-local cache ----------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Node-local: every host tokenises its own copy (SageMaker gives each container its own /tmp)."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path(tempfile.gettempdir()) / "hetero-tokenized")


def files_key(folder: Path) -> str:
    """A digest of the channel's shards: their relative paths, sizes and modification times."""
    listing = "".join(f"{path.relative_to(folder)}|{path.stat().st_size}|{path.stat().st_mtime_ns}\n" for path in text_files(folder))
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def cache_key(folder: Path, tokenizer_name: str, max_seq_len: int, classes: Sequence[int] | None = None) -> str:
    """Names a channel's tokenised cache after what it was made from (its files, the tokenizer, the
    length, the classes its labels map through), so a changed input never reuses it. Pure but for
    reading the files' sizes and times."""
    made_from = f"{files_key(folder)}|{tokenizer_name}|{max_seq_len}|{list(classes) if classes is not None else ''}"
    return hashlib.sha256(made_from.encode()).hexdigest()[:16]


def tokenizer_identity(tokenizer: Any) -> str:
    """The tokenizer's name, and for a fast tokenizer a digest of its whole definition (vocabulary,
    normaliser, special tokens): a model folder replaced at the same path is another tokenizer."""
    name = str(getattr(tokenizer, "name_or_path", ""))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return f"{name}#{hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]}" if backend is not None else name


def made_once(path: Path, make: Callable[[Path], None], *, poll_s: float = 0.2) -> Path:
    """``path``, made by ``make(partial)`` and renamed into place by the first process of the node to get
    here; the others wait on a file lock (released by the kernel if its holder dies) and find it made.
    A crash leaves at most a ``.partial`` that the next maker clears: ``path`` is whole or absent."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        waited, told = 0.0, 0.0
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(poll_s)
                waited += poll_s
                if waited - told >= 60:
                    told = waited
                    log.info("still waiting for another process of this node to make %s (%.0f s)", path.name, waited)
        try:
            if not path.exists():  # else the holder we waited for made it
                partial = path.with_name(path.name + ".partial")
                if partial.is_dir():
                    shutil.rmtree(partial)
                partial.unlink(missing_ok=True)
                make(partial)
                os.replace(partial, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def scanned_classes(folder: Path, channel: str, cache: Path) -> tuple[int, list[int]]:
    """channel_classes, once per node and input: an evaluation channel's listing reads the training
    channel's labels, and the training channel's listing then reuses them (one pass less over it)."""
    path = cache / f"{channel}-{files_key(folder)}.labels.json"

    def make(partial: Path) -> None:
        rows, labels = channel_classes(folder, channel)
        partial.write_text(json.dumps({"rows": rows, "labels": labels}))

    scan = json.loads(made_once(path, make).read_text())
    return int(scan["rows"]), [int(label) for label in scan["labels"]]


def tokenize_channel(folder: Path, channel: str, tokenizer: Any, max_seq_len: int, cache: Path, *,
                     classes: Sequence[int] | None = None, chunk: int = 4096) -> Path:
    """A channel tokenised into ``cache`` once (an existing cache is kept); returns its folder.

    ``classes``: the training channel's labels, for an evaluation channel (its ids must mean what they
    meant in training; a label training never saw is refused); None for the training channel itself.
    The rows are tokenised ``chunk`` at a time into preallocated memory-mapped int32 arrays, so memory
    stays bounded whatever the channel's size."""
    path = cache / f"{channel}-{cache_key(folder, tokenizer_identity(tokenizer), max_seq_len, classes)}"

    def make(partial: Path) -> None:
        rows, seen = scanned_classes(folder, channel, cache)
        mapped = list(seen if classes is None else classes)
        unknown = sorted(set(seen) - set(mapped))
        if unknown:
            raise TextDataError(f"channel {channel!r} has labels {unknown} that the training channel's classes {mapped} do not have")
        index = {label: position for position, label in enumerate(mapped)}
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
        (partial / "classes.json").write_text(json.dumps([str(label) for label in mapped]))
        log.info("tokenised %d rows of channel %r into %s", rows, channel, path)

    return made_once(path, make)


class TokenizedRows(Sequence):
    """A tokenised channel, memory-mapped: row i is {"input_ids": int32 [L], "attention_mask": int32 [L],
    "label": class id}. Pickles as its folder (the arrays are reopened where it is unpickled)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.input_ids, self.attention_mask, self.labels = (np.load(self.folder / f"{name}.npy", mmap_mode="r")
                                                            for name in ("input_ids", "attention_mask", "labels"))
        self.classes: tuple[str, ...] = tuple(json.loads((self.folder / "classes.json").read_text()))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[position] for position in range(*index.indices(len(self)))]
        return {"input_ids": np.array(self.input_ids[index]), "attention_mask": np.array(self.attention_mask[index]),
                "label": int(self.labels[index])}

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenizedRows, (str(self.folder),))


# The hooks ---------------------------------------------------------------------------------------------


def model_source(ctx: Any) -> str:
    """The model channel's folder when ``model_channel`` is set, else the ``model`` name or folder."""
    channel = ctx.hyperparameters["model_channel"]
    if not channel:
        return str(ctx.hyperparameters["model"])
    if not hasattr(ctx, "channel_path"):  # load_model.py's context: the job's channels are not here
        raise ValueError(f"this model was built from the job's {channel!r} channel: set model_channel to \"\" and model to that "
                         "pretrained model's folder (or Hugging Face name) in workload.json's hyperparameters to load it")
    return str(ctx.channel_path(channel))


def list_samples(ctx: Any) -> TokenizedRows:
    from transformers import AutoTokenizer

    hyperparameters = ctx.hyperparameters
    cache = cache_dir()
    classes = None
    if not ctx.training:  # labels mean what they meant in training: mapped through its classes
        _, classes = scanned_classes(ctx.channel_path(ctx.training_channel), ctx.training_channel, cache)
    tokenizer = AutoTokenizer.from_pretrained(model_source(ctx))
    return TokenizedRows(tokenize_channel(Path(ctx.path), ctx.channel, tokenizer, hyperparameters["max_seq_len"], cache, classes=classes,
                                          chunk=hyperparameters["tokenize_chunk"]))


def preprocess(sample: dict[str, Any], ctx: Any) -> dict[str, np.ndarray]:
    return {"input_ids": sample["input_ids"], "attention_mask": sample["attention_mask"], "label": np.int64(sample["label"])}


def build_model(ctx: Any) -> torch.nn.Module:
    """The pretrained model with a fresh classification head (drawn after the runtime's seed)."""
    from transformers import AutoModelForSequenceClassification

    # fp32 weights whatever the checkpoint was saved in: transformers' default (dtype "auto") would load a
    # bf16 checkpoint as bf16, and AdamW would then update half-precision weights with no fp32 copy.
    return AutoModelForSequenceClassification.from_pretrained(model_source(ctx), num_labels=len(ctx.classes), dtype=torch.float32)


def rate_factor(step: int, total_steps: int, warmup_fraction: float) -> float:
    """The rate of optimizer step ``step`` (1-based) relative to the peak: linear from zero over the
    warm-up, then linear down; step warmup + 1 runs at the peak and the last at peak / (decay steps),
    never at zero. Pure (Hugging Face's get_linear_schedule_with_warmup, counted from step 1)."""
    warmup = int(warmup_fraction * total_steps)
    if warmup and step <= warmup:
        return step / warmup
    return max(0.0, (total_steps - step + 1) / max(1, total_steps - warmup))


def build_optimizer(model: torch.nn.Module, ctx: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    hyperparameters = ctx.hyperparameters
    # Weight decay on matrices only: not on LayerNorm weights and biases (BERT's and Hugging Face's rule).
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    groups = [{"params": [p for p in parameters if p.dim() >= 2], "weight_decay": hyperparameters["weight_decay"]},
              {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=hyperparameters["learning_rate"])
    steps, warmup = ctx.steps, hyperparameters["lr_warmup_fraction"]

    def factor(done: int) -> float:  # LambdaLR counts the steps done from 0, the loop's steps from 1
        return rate_factor(done + 1, steps, warmup)

    # A plain function, so a checkpoint keeps none of it: a resumed run's schedule is its own. On XLA the
    # rate travels as device data: a new rate each step compiles no new graph.
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# What a masked token's attention score gets: BERT's own value. Finite in bf16 as well (fp32's minimum
# rounds to -inf in bf16, and 0 × -inf, for every token attended to, is NaN under XLA_USE_BF16).
MASKED_SCORE = -10_000.0


def additive_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The [batch, 1, 1, tokens] additive mask the attention layers add (0 to attend, MASKED_SCORE to
    ignore). Given a 2-D mask, transformers first asks ``mask.all()`` to skip masking: a value read
    from the device in the middle of the step, which on XLA executes a graph of its own every step and
    makes two step graphs (batches with and without padding). A prepared 4-D mask is used as it is."""
    return (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * MASKED_SCORE


def train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], ctx: Any) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=additive_mask(batch["attention_mask"]), labels=batch["label"]).loss


def eval_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], ctx: Any) -> dict[str, torch.Tensor]:
    logits = model(input_ids=batch["input_ids"], attention_mask=additive_mask(batch["attention_mask"])).logits
    return {"accuracy": (logits.argmax(-1) == batch["label"]).float(), "loss": F.cross_entropy(logits, batch["label"], reduction="none")}
