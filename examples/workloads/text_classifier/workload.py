"""A text classifier that tokenises in preprocessing (on the data hosts of a heterogeneous job), with fixed
shapes for XLA: an example workload, written only against the platform's workload contract.

    python examples/workloads/text_classifier/make_data.py build/reviews       # train/ and validation/ JSONL
    hetero local examples/workloads/text_classifier/heterogeneous.json --channel train=build/reviews/train ...
"""

import zlib

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

HYPERPARAMETERS = {"max_tokens": 32, "vocabulary": 4096, "width": 64, "learning_rate": 0.01, "token_dropout": 0.1}


def list_samples(ctx):
    rows = ctx.readers.jsonl(ctx.path)  # {"text": ..., "label": 0 or 1} per line
    rows.classes = ("negative", "positive")
    return rows


def tokenize(text, vocabulary):  # a hashing tokenizer: no vocabulary file to ship (0 is padding)
    return [1 + zlib.crc32(word.encode()) % (vocabulary - 1) for word in text.lower().split()]


def preprocess(row, ctx):
    size = ctx.hyperparameters["max_tokens"]
    tokens = tokenize(row["text"], ctx.hyperparameters["vocabulary"])
    if ctx.training:  # drop a few words at random: augmentation that needs the seeded generator
        tokens = [token for token in tokens if ctx.rng.random() >= ctx.hyperparameters["token_dropout"]] or tokens
    if not tokens:
        raise ctx.Skip("an empty text")
    ids = np.zeros(size, dtype=np.int32)
    ids[: min(size, len(tokens))] = tokens[:size]
    return {"input_ids": ids, "label": np.int64(row["label"])}


class BagOfWords(nn.Module):
    def __init__(self, vocabulary, width, classes):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width, padding_idx=0)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, input_ids):
        mask = (input_ids > 0).unsqueeze(-1).float()  # a mean over the real tokens: no data-dependent shape
        pooled = (self.embedding(input_ids.long()) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(pooled)


def build_model(ctx):
    return BagOfWords(ctx.hyperparameters["vocabulary"], ctx.hyperparameters["width"], len(ctx.classes))


def build_optimizer(model, ctx):
    return torch.optim.Adam(model.parameters(), lr=ctx.hyperparameters["learning_rate"])


def train_step(model, batch, ctx):
    return F.cross_entropy(model(batch["input_ids"]), batch["label"])


def eval_step(model, batch, ctx):
    logits = model(batch["input_ids"])
    return {"loss": F.cross_entropy(logits, batch["label"], reduction="none"), "accuracy": (logits.argmax(1) == batch["label"]).float()}
