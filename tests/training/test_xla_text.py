"""The PyTorch/XLA text trainer on torch-xla's CPU device (single process), and its multi-process logic
(once-per-node tokenisation, sharding) with two real processes on gloo."""

from __future__ import annotations

import csv
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("PJRT_DEVICE", "CPU")

from training.metrics import parse_metric_line  # noqa: E402
from training.trainers.config import TextConfig  # noqa: E402
from training.trainers.loop import OutputPaths  # noqa: E402
from training.trainers.xla_text import (  # noqa: E402
    TextDataError,
    TextTrainer,
    cache_key,
    label_ids,
    load_tokenized,
    once_per_node,
    read_polarity_csv,
    shard_loader,
    tokenize_channel,
)

POSITIVE = ["great", "wonderful", "excellent", "loved", "perfect", "amazing", "superb", "delightful"]
NEGATIVE = ["awful", "terrible", "broken", "hated", "poor", "useless", "boring", "disappointing"]
FILLER = ["the", "a", "this", "product", "book", "was", "and", "it", "really", "item", "quite", "very"]


def review(rng: random.Random, positive: bool) -> tuple[str, str, str]:
    words = POSITIVE if positive else NEGATIVE
    body = rng.sample(FILLER, 5) + rng.sample(words, 2)
    rng.shuffle(body)
    return ("2" if positive else "1", f"{rng.choice(FILLER)} {rng.choice(words)}", " ".join(body))


def write_csv(path: Path, rows: int, seed: int, header: bool = False) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        if header:
            writer.writerow(["label", "title", "content"])
        for index in range(rows):
            writer.writerow(review(rng, positive=index % 2 == 0))
    return path.parent


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer BERT and a word-level tokenizer, built here (no hub download), saved as a model channel."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([" ".join(POSITIVE + NEGATIVE + FILLER + ["."])],
                                  trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=fast.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def trainer(tiny_model: Path, data: Path, base: Path, **overrides) -> TextTrainer:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    config = TextConfig(**({"model": str(tiny_model), "max_seq_len": 16, "batch_size": 16, "learning_rate": 3e-3,
                            "warmup_steps": 3, "steps": 60} | overrides))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    train, classes = load_tokenized(tokenize_channel(data / "train", "train", tokenizer, config.max_seq_len, base / "cache"))
    evaluation, _ = load_tokenized(tokenize_channel(data / "test", "test", tokenizer, config.max_seq_len, base / "cache"))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=len(classes))
    return TextTrainer(config, OutputPaths.under(base), model=model, tokenizer=tokenizer, train=train, evaluation=evaluation,
                       classes=classes)


@pytest.fixture(scope="module")
def polarity(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("polarity")
    write_csv(root / "train" / "part-0.csv", 256, seed=1)
    write_csv(root / "test" / "test.csv", 96, seed=2, header=True)
    return root


def test_xla_training_learns_the_polarity_task(tiny_model, polarity, tmp_path, capsys) -> None:
    run = trainer(tiny_model, polarity, tmp_path, eval_every=30, eval_channel="test")
    summary = run.run()
    lines = [parse_metric_line(line) for line in capsys.readouterr().out.splitlines() if line.startswith("step=")]
    losses = [line["loss"] for line in lines if "loss" in line]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert [line["eval_accuracy"] for line in lines if "eval_accuracy" in line]  # the periodic evaluation ran
    assert summary["eval_accuracy"] >= 0.9, summary
    assert summary["device"].startswith("xla") and summary["timed_steps"] == 57
    assert summary["warmup_s"] > 0 and summary["step_time_ms"]["p50"] > 0
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "model").config.num_labels == 2


def test_xla_training_resumes_from_its_checkpoint(tiny_model, polarity, tmp_path) -> None:
    trainer(tiny_model, polarity, tmp_path, steps=6, warmup_steps=1, checkpoint_every=3).run()
    resumed = trainer(tiny_model, polarity, tmp_path, steps=10, warmup_steps=1)
    summary = resumed.run()
    assert summary["start_step"] == 6 and summary["timed_steps"] == 3


def test_polarity_csv_reading(tmp_path: Path) -> None:
    folder = write_csv(tmp_path / "a" / "x.csv", 4, seed=0, header=True)
    texts, labels = read_polarity_csv(folder, "train")
    assert len(texts) == 4 and labels == [2, 1, 2, 1] and ". " in texts[0]
    assert label_ids([2, 1, 2]) == ([1, 0, 1], [1, 2])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bad.csv").write_text("1,only a title\n")
    with pytest.raises(TextDataError, match="bad.csv line 1: expected label,title,content"):
        read_polarity_csv(tmp_path / "b", "train")


def test_the_cache_is_named_after_its_inputs(tmp_path: Path) -> None:
    folder = write_csv(tmp_path / "c" / "x.csv", 4, seed=0)
    before = cache_key(folder, "tok", 16)
    assert cache_key(folder, "tok", 32) != before
    write_csv(folder / "x.csv", 6, seed=0)
    assert cache_key(folder, "tok", 16) != before


def _node(rank: int, world: int, port: int, root: str, tiny_model: str, results: dict) -> None:
    from transformers import AutoTokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    calls = Path(root) / "tokenized-by"

    def make() -> Path:
        existing = sorted((Path(root) / "cache").glob("train-*.pt"))
        if not existing:
            with calls.open("a") as handle:
                handle.write(f"{rank}\n")
        return tokenize_channel(Path(root) / "data", "train", tokenizer, 16, Path(root) / "cache")

    path = once_per_node(local_rank=rank, make=make, barrier=dist.barrier)
    dataset, _ = load_tokenized(path)
    loader = shard_loader(dataset, batch_size=4, world_size=world, rank=rank, seed=0, train=True)
    indices = list(iter(loader.sampler))
    results[rank] = (str(path), indices)
    dist.destroy_process_group()


def test_tokenisation_happens_once_per_node_and_ranks_get_disjoint_shards(tiny_model, tmp_path) -> None:
    from training.local.cluster import free_port

    write_csv(tmp_path / "data" / "part.csv", 40, seed=3)
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_node, args=(2, free_port(), str(tmp_path), str(tiny_model), results), nprocs=2, join=True)
    assert (tmp_path / "tokenized-by").read_text().split() == ["0"]  # local rank 0 made it, rank 1 waited
    (path_0, shard_0), (path_1, shard_1) = results[0], results[1]
    assert path_0 == path_1
    assert not set(shard_0) & set(shard_1) and len(shard_0) == len(shard_1) == 20


@pytest.mark.cluster
def test_a_trainium_spec_runs_on_the_emulated_cluster(tiny_model, polarity, tmp_path) -> None:
    """The neuron example spec, shrunk, through the real entrypoint: launcher → torchrun → XLA trainer."""
    import json

    from lambdas.core.job_spec import validate_job_spec
    from training.local.cluster import EmulatedCluster, EmulationOptions

    raw = json.loads((Path(__file__).resolve().parents[2] / "examples" / "neuron-trn1-2xlarge.json").read_text())
    raw["hyperparameters"] |= {"steps": 20, "warmup_steps": 3, "batch_size": 16, "max_seq_len": 16, "eval_every": 10,
                               "checkpoint_every": 0, "learning_rate": 0.003}
    lines: list[str] = []
    channels = {"train": polarity / "train", "test": polarity / "test", "model": tiny_model}
    cluster = EmulatedCluster(validate_job_spec(raw), EmulationOptions(workdir=tmp_path, channels=channels),
                              on_line=lambda host, line: lines.append(line))
    result = cluster.run()
    assert result.ok, result.report() + "\n".join(lines[-40:])
    summary = cluster.summary()
    assert summary["variant"] == "neuron" and summary["steps"] == 20 and summary["eval_accuracy"] is not None
    assert sum("step_time_ms=" in line for line in lines) == 17 and any("eval_accuracy=" in line for line in lines)
