"""The PyTorch/XLA text trainer on torch-xla's CPU device (single process), and its multi-process logic
(once-per-node tokenisation, sharding) with two real processes on gloo."""

from __future__ import annotations

import csv
import itertools
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("PJRT_DEVICE", "CPU")

from training.metrics import parse_metric_line  # noqa: E402
from training.trainers import host_collectives  # noqa: E402
from training.trainers.config import TextConfig  # noqa: E402
from training.trainers.loop import OutputPaths  # noqa: E402
from training.trainers.sampling import EndlessSampler  # noqa: E402
from training.trainers.xla_text import (  # noqa: E402
    EvalShard,
    TextDataError,
    TextTrainer,
    build_model,
    cache_key,
    channel_classes,
    load_tokenized,
    once_per_node,
    polarity_rows,
    tokenize_channel,
    tokenized_path,
    train_loader,
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
    from transformers import AutoTokenizer

    config = TextConfig(**({"model": str(tiny_model), "max_seq_len": 16, "batch_size": 16, "learning_rate": 3e-3,
                            "warmup_steps": 3, "steps": 60} | overrides))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    train = load_tokenized(tokenize_channel(data / "train", "train", tokenizer, config.max_seq_len, base / "cache"))
    evaluation = load_tokenized(tokenize_channel(data / "test", "test", tokenizer, config.max_seq_len, base / "cache",
                                                 classes=train.classes))
    model = build_model(str(tiny_model), len(train.classes), config.seed)
    return TextTrainer(config, OutputPaths.under(base), model=model, tokenizer=tokenizer, train=train, evaluation=evaluation)


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


def test_xla_training_resumes_where_its_checkpoint_left_off(tiny_model, polarity, tmp_path) -> None:
    at_checkpoint: list[torch.Tensor] = []

    class Recording(TextTrainer):
        def save_checkpoint(self, path: Path, state: dict) -> None:
            at_checkpoint.append(torch.get_rng_state())
            super().save_checkpoint(path, state)

    first = trainer(tiny_model, polarity, tmp_path, steps=6, warmup_steps=1, checkpoint_every=3)
    first.__class__ = Recording
    first.run()
    resumed = trainer(tiny_model, polarity, tmp_path, steps=10, warmup_steps=1)
    torch.manual_seed(1234)  # anything: the checkpoint's state must win
    loaded = resumed.load_checkpoint(resumed.checkpoint_path)
    assert loaded["step"] == 6 and loaded["samples_per_rank"] == 6 * 16
    resumed.set_rng_state(loaded["rng"][0])
    assert torch.equal(torch.get_rng_state(), at_checkpoint[-1])
    assert resumed.lr_scheduler.last_epoch == 6  # the schedule goes on from step 7, not from its warm-up
    # ... at this run's rate for step 7 (10 steps now: the first run's schedule ended at step 6, rate 0 next)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(resumed.schedule.at(7)) and resumed.schedule.at(7) > 0

    summary = resumed.run()
    assert summary["start_step"] == 6 and summary["timed_steps"] == 3
    # The data position: the resumed run read on from sample 96 of the shard, not from its start again.
    assert resumed.resume_samples == 96
    sampler = train_loader(resumed.train_data, batch_size=16, world_size=1, rank=0, seed=0, start=96).sampler
    straight = EndlessSampler(len(resumed.train_data), rank=0, world_size=1, seed=0)
    assert list(itertools.islice(iter(sampler), 16)) == list(itertools.islice(iter(straight), 96, 112))
    assert list(itertools.islice(iter(sampler), 16)) != list(itertools.islice(iter(straight), 16))


def test_a_steady_state_step_is_one_executed_graph(tiny_model, polarity, tmp_path) -> None:
    """torch-xla's own metrics: after the warm-up compiles, each step executes one graph and compiles none
    (reading the loss inside the step executed a second, loss-only graph; the rate schedule must not
    compile a graph per rate)."""
    import torch_xla.debug.metrics as met

    run = trainer(tiny_model, polarity, tmp_path, steps=12, warmup_steps=1, log_every=1)
    batches = run.batches()

    def count(metric: str) -> int:
        data = met.metric_data(metric)
        return data[0] if data else 0

    for _ in range(3):  # warm-up: the step's graph and the loader's are compiled here
        run.loss_value(run.train_step(next(batches)))
    executed, compiled = [], []
    for _ in range(4):
        before = count("ExecuteTime"), count("CompileTime")
        run.loss_value(run.train_step(next(batches)))  # as the loop does on a step it logs, the batch's fetch included
        executed.append(count("ExecuteTime") - before[0])
        compiled.append(count("CompileTime") - before[1])
    assert executed == [1, 1, 1, 1] and compiled == [0, 0, 0, 0]


def _pending(tensors: list[torch.Tensor]) -> bool:
    """Whether any of these XLA tensors still has computation to run (its IR is more than device data)."""
    import torch_xla

    text = torch_xla._XLAC._get_xla_tensors_text(tensors)
    return any("=" in line and "xla::device_data()" not in line for line in text.splitlines())


def test_every_rank_has_settled_its_step_when_the_chief_saves(tiny_model, polarity, tmp_path) -> None:
    seen: list[bool] = []

    class Recording(TextTrainer):
        def save_checkpoint(self, path: Path, state: dict) -> None:
            seen.append(_pending(list(self.model.parameters()) + [t for s in self.optimizer.state.values() for t in s.values()
                                                                  if isinstance(t, torch.Tensor) and t.device.type == "xla"]))
            super().save_checkpoint(path, state)

    run = trainer(tiny_model, polarity, tmp_path, steps=4, warmup_steps=1, checkpoint_every=2)
    run.__class__ = Recording
    run.run()
    assert seen == [False, False]


def test_the_rate_warms_up_then_decays_linearly(tiny_model, polarity, tmp_path) -> None:
    run = trainer(tiny_model, polarity, tmp_path, steps=10, warmup_steps=1, lr_warmup_fraction=0.2, learning_rate=1e-3)
    rates = []
    batches = run.batches()
    for _ in range(10):
        rates.append(run.optimizer.param_groups[0]["lr"])
        run.train_step(next(batches))
    assert rates == pytest.approx([5e-4, 1e-3, 1e-3, 0.875e-3, 0.75e-3, 0.625e-3, 0.5e-3, 0.375e-3, 0.25e-3, 0.125e-3])


def test_polarity_csv_reading(tmp_path: Path) -> None:
    folder = write_csv(tmp_path / "a" / "x.csv", 4, seed=0, header=True)
    rows = list(polarity_rows(folder, "train"))
    assert [label for label, _ in rows] == [2, 1, 2, 1] and ". " in rows[0][1]
    assert channel_classes(folder, "train") == (4, [1, 2])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bad.csv").write_text("1,only a title\n")
    with pytest.raises(TextDataError, match="bad.csv line 1: expected label,title,content"):
        list(polarity_rows(tmp_path / "b", "train"))


def test_a_channel_of_csv_and_json_lines_shards_in_subfolders_reads_every_row_in_path_order(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    write_csv(root / "part-a" / "00.csv", 3, seed=0, header=True)
    (root / "part-b").mkdir()
    (root / "part-b" / "01.jsonl").write_text(
        '{"label": 2, "title": "Great", "content": "works well"}\n\n{"label": "1", "text": "broke in a day"}\n'
    )
    rows = list(polarity_rows(root, "train"))
    assert len(rows) == 5 and rows[3:] == [(2, "Great. works well"), (1, "broke in a day")]
    before = cache_key(root, "tok", 16)
    (root / "part-b" / "02.jsonl").write_text('{"label": 1, "text": "meh"}\n')
    assert cache_key(root, "tok", 16) != before  # a new shard, a new cache
    for bad, message in (('{"label": 1}', "expected"), ("not json", "not JSON"), ('{"label": true, "text": "x"}', "not an integer"),
                         ('["label", 1]', "expected")):
        (root / "part-b" / "02.jsonl").write_text(bad + "\n")
        with pytest.raises(TextDataError, match=f"02.jsonl line 1: .*{message}"):
            list(polarity_rows(root, "train"))


def test_the_cache_is_named_after_its_inputs(tmp_path: Path) -> None:
    folder = write_csv(tmp_path / "c" / "x.csv", 4, seed=0)
    before = cache_key(folder, "tok", 16)
    assert cache_key(folder, "tok", 32) != before
    assert cache_key(folder, "tok", 16, classes=[1, 2]) != before  # an eval channel's, mapped by training's classes
    write_csv(folder / "x.csv", 6, seed=0)
    assert cache_key(folder, "tok", 16) != before


class CountingTokenizer:
    """The real tokenizer, recording how many texts each call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, []
        self.name_or_path = tokenizer.name_or_path

    def __call__(self, texts, **options):
        self.calls.append(len(texts))
        return self.tokenizer(texts, **options)


def test_tokenisation_goes_in_chunks_into_memory_mapped_int32(tiny_model, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = write_csv(tmp_path / "data" / "part.csv", 45, seed=4)
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(tiny_model))
    tokenized = load_tokenized(tokenize_channel(folder, "train", tokenizer, 16, tmp_path / "cache", chunk=10))
    assert tokenizer.calls == [10, 10, 10, 10, 5]  # never the whole channel in one call
    assert tokenized.input_ids.dtype == np.int32 and isinstance(tokenized.input_ids, np.memmap)
    whole = tokenizer.tokenizer([text for _, text in polarity_rows(folder, "train")], truncation=True, padding="max_length",
                                max_length=16, return_tensors="np")
    assert np.array_equal(tokenized.input_ids, whole["input_ids"]) and np.array_equal(tokenized.attention_mask, whole["attention_mask"])
    assert tokenized.labels.tolist() == [1, 0] * 22 + [1] and tokenized.classes == (1, 2)
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_evaluation_labels_mean_what_they_meant_in_training(tiny_model, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    only_positive = tmp_path / "eval"
    only_positive.mkdir()
    (only_positive / "e.csv").write_text("2,good,great\n2,fine,superb\n")
    # Mapped on its own, the one class would become id 0 (negative in training); mapped through training's, 1.
    evaluation = load_tokenized(tokenize_channel(only_positive, "test", tokenizer, 16, tmp_path / "cache", classes=(1, 2)))
    assert evaluation.labels.tolist() == [1, 1]
    (only_positive / "e.csv").write_text("3,odd,item\n")
    with pytest.raises(TextDataError, match=r"labels \[3\] that the training channel's classes \[1, 2\] do not have"):
        tokenize_channel(only_positive, "test", tokenizer, 16, tmp_path / "cache", classes=(1, 2))


def test_an_evaluation_writes_a_progress_mark_per_batch(tiny_model, polarity, tmp_path, monkeypatch) -> None:
    """The launcher's stall rule sees no step during an evaluation: each of its batches is a mark."""
    from training.trainers.loop import PROGRESS_DIR_ENV

    (tmp_path / "progress").mkdir()
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path / "progress"))
    run = trainer(tiny_model, polarity, tmp_path, eval_channel="test")
    written: list[str] = []
    write = run._write_mark
    monkeypatch.setattr(run, "_write_mark", lambda text: (written.append(text), write(text)))
    assert run.evaluate() is not None
    batches = len(EvalShard(run.eval_data, rank=0, world_size=1, batch_size=16))
    assert batches == 6 and written == [f"evaluate {count} 0" for count in range(1, batches + 1)]
    assert (tmp_path / "progress" / "rank-0").read_text() == "evaluate 6 0"


def test_evaluation_counts_every_example_once_across_ranks(tiny_model, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = write_csv(tmp_path / "data" / "part.csv", 10, seed=5)
    dataset = load_tokenized(tokenize_channel(folder, "test", AutoTokenizer.from_pretrained(tiny_model), 16, tmp_path / "cache"))
    counted: list[int] = []
    for rank in range(3):
        shard = EvalShard(dataset, rank=rank, world_size=3, batch_size=3)
        for index in range(len(shard)):
            ids, _, _, weights = shard[index]
            assert ids.shape == (3, 16)  # fixed shape: one compiled evaluation graph
            counted += shard.batches[index].indices[: int(weights.sum())]
    assert sorted(counted) == list(range(10))  # a DistributedSampler would have padded 10 to 12


def _node(rank: int, world: int, port: int, root: str, tiny_model: str, results: dict) -> None:
    from transformers import AutoTokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    calls = Path(root) / "tokenized-by"
    folder, cache = Path(root) / "data", Path(root) / "cache"

    def make() -> Path:
        with calls.open("a") as handle:
            handle.write(f"{rank}\n")
        return tokenize_channel(folder, "train", tokenizer, 16, cache)

    path = once_per_node(rank, make, tokenized_path(folder, "train", tokenizer, 16, cache), poll_s=0.05)
    dataset = load_tokenized(path)
    loader = train_loader(dataset, batch_size=4, world_size=world, rank=rank, seed=0)
    indices = list(itertools.islice(iter(loader.sampler), 40))  # two epochs of this rank's shard
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
    for epoch in (slice(0, 20), slice(20, 40)):  # every epoch: disjoint halves that cover the channel
        assert sorted(shard_0[epoch] + shard_1[epoch]) == list(range(40))
    assert shard_0[:20] != shard_0[20:]  # and reshuffled between epochs


def _one_model(rank: int, world: int, port: int, tiny_model: str, data: str, root: str, results: dict) -> None:
    """Two real TextTrainers (each on its own torch-xla CPU device) whose host group is gloo."""
    from transformers import AutoTokenizer

    os.environ["PJRT_DEVICE"] = "CPU"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = host_collectives.host_group()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = Path(root) / f"rank-{rank}"
    train = load_tokenized(tokenize_channel(Path(data) / "train", "train", tokenizer, 16, base / "cache"))
    model = build_model(tiny_model, 2, seed=100 + rank)  # different heads: only the broadcast can make them one
    config = TextConfig(model=tiny_model, max_seq_len=16, batch_size=4, steps=4, warmup_steps=1)
    trainer = TextTrainer(config, OutputPaths.under(base), model=model, tokenizer=tokenizer, train=train, evaluation=None,
                          rank=rank, world_size=world, host_group=group)
    state = {name: value.cpu() for name, value in trainer.model.state_dict().items()}
    results[rank] = (state, trainer.reduce_max([float(rank), -float(rank)]), trainer.gather(f"rank {rank}"))
    trainer.barrier()
    dist.destroy_process_group()


def headless(tiny_model: Path, folder: Path) -> Path:
    """The tiny model as a pretrained encoder without a classification head (as bert-base-uncased is):
    ``from_pretrained(num_labels=…)`` draws the head afresh in every process."""
    from transformers import AutoTokenizer, BertModel

    BertModel.from_pretrained(tiny_model).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    return folder


def test_trainium_ranks_start_from_one_model_and_agree_on_the_host(tiny_model, polarity, tmp_path) -> None:
    from training.local.cluster import free_port

    encoder = headless(tiny_model, tmp_path / "encoder")
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_one_model, args=(2, free_port(), str(encoder), str(polarity), str(tmp_path), results), nprocs=2, join=True)
    (state_0, max_0, gathered_0), (state_1, max_1, gathered_1) = results[0], results[1]
    assert state_0.keys() == state_1.keys()
    assert all(torch.equal(state_0[name], state_1[name]) for name in state_0)  # the master's weights on both
    assert max_0 == max_1 == [1.0, 0.0]  # the loop's step vote and data wait, reduced on the host
    assert gathered_0 == gathered_1 == ["rank 0", "rank 1"]


def test_the_model_is_built_the_same_whatever_the_random_stream_did_before(tiny_model, tmp_path) -> None:
    encoder = str(headless(tiny_model, tmp_path / "encoder"))
    torch.rand(3)
    first = build_model(encoder, 2, seed=0).classifier.weight.detach().clone()
    torch.rand(11)
    second = build_model(encoder, 2, seed=0)
    assert not torch.equal(first, build_model(encoder, 2, seed=1).classifier.weight)  # the head is drawn here
    assert torch.equal(first, second.classifier.weight)  # seeded before the fresh head is drawn
    assert second.classifier.weight.dtype == torch.float32


STAND_IN_PARALLEL_COMPILE = """#!/bin/sh
# Stands in for the Neuron SDK's neuron_parallel_compile (not installable here): it runs the trainer's
# command with graph extraction on, as the real tool does before it compiles what it collected.
echo "$@" > "$(dirname "$0")/ran"
NEURON_EXTRACT_GRAPHS_ONLY=1 "$@"
"""


@pytest.mark.cluster
def test_a_trainium_spec_runs_on_the_emulated_cluster(tiny_model, polarity, tmp_path, monkeypatch) -> None:
    """The neuron example spec, shrunk, through the real entrypoint: launcher → (graph pre-compilation →)
    torchrun → XLA trainer."""
    import json

    from lambdas.core.job_spec import validate_job_spec
    from training.local.cluster import EmulatedCluster, EmulationOptions

    raw = json.loads((Path(__file__).resolve().parents[2] / "examples" / "neuron-trn1-2xlarge.json").read_text())
    raw["hyperparameters"] |= {"steps": 20, "warmup_steps": 3, "batch_size": 16, "max_seq_len": 16, "eval_every": 10,
                               "checkpoint_every": 0, "learning_rate": 0.003, "precompile_steps": 3}
    tools = tmp_path / "neuron-sdk"
    tools.mkdir()
    (tools / "neuron_parallel_compile").write_text(STAND_IN_PARALLEL_COMPILE)
    (tools / "neuron_parallel_compile").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    lines: list[str] = []
    channels = {"train": polarity / "train", "test": polarity / "test", "model": tiny_model}
    cluster = EmulatedCluster(validate_job_spec(raw), EmulationOptions(workdir=tmp_path, channels=channels),
                              on_line=lambda host, line: lines.append(line))
    result = cluster.run()
    assert result.ok, result.report() + "\n".join(lines[-40:])
    summary = cluster.summary()
    assert summary["variant"] == "neuron" and summary["steps"] == 20 and summary["eval_accuracy"] is not None
    assert sum("step_time_ms=" in line for line in lines) == 17 and any("eval_accuracy=" in line for line in lines)
    # The pre-compilation ran the trainer first, 3 steps into a scratch folder: no metric line of its own
    # (17 above are the real run's), no checkpoint or model where the job's own would be resumed from.
    assert "training.torchrun" in (tools / "ran").read_text()
    host = next(path for path in tmp_path.glob("algo-*/opt/ml") if (path / "precompile").exists())
    assert json.loads((host / "precompile" / "output" / "data" / "summary.json").read_text())["steps"] == 3
    assert json.loads((host / "output" / "data" / "summary.json").read_text())["start_step"] == 0
