"""The built-in text workload (training/workloads/text.py) through the one PyTorch runtime, as a Trainium job
runs it: on torch-xla's CPU device in this process (single process: XLA's collectives do not work there),
its readers, its once-per-node tokenised cache and its listing, two ranks on gloo for the one model they
start from, and the example Trainium spec on the emulated cluster."""

from __future__ import annotations

import csv
import json
import os
import pickle
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("PJRT_DEVICE", "CPU")

from tests.conftest import write_host_tree  # noqa: E402
from training.cluster import BASE_DIR_ENV  # noqa: E402
from training.host_environment import (  # noqa: E402
    PROGRESS_DIR_ENV,
    WORKLOAD_DIR_ENV,
    WORKLOAD_MODULE_ENV,
    OutputPaths,
    TrainerEnvironment,
)
from training.metrics import parse_metric_line  # noqa: E402
from training.trainers import host_collectives  # noqa: E402
from training.trainers.loop import TrainingStopped  # noqa: E402
from training.trainers.pytorch_runtime import EvalSamples, WorkloadTrainer, build_trainer  # noqa: E402
from training.variants import BUILTIN_WORKLOADS_DIR  # noqa: E402
from training.workload.contexts import ChannelContext  # noqa: E402
from training.workload.contract import load_workload  # noqa: E402
from training.workload.host import prepared_workload  # noqa: E402
from training.workload.samples import MAX_SAMPLE_ITEM_BYTES, list_channel  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
text = load_workload(BUILTIN_WORKLOADS_DIR, "text").module  # through the contract's checks, as every host loads it

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


@pytest.fixture(scope="module")
def polarity(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("polarity")
    write_csv(root / "train" / "part-0.csv", 256, seed=1)
    write_csv(root / "test" / "test.csv", 96, seed=2, header=True)
    return root


@pytest.fixture(autouse=True)
def node_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own node-local cache (the module's default is the machine's temporary folder)."""
    monkeypatch.setenv(text.CACHE_DIR_ENV, str(tmp_path / "node-cache"))
    return tmp_path / "node-cache"


def text_host(tmp_path: Path, channels: dict[str, Path], **hyperparameters) -> dict[str, str]:
    """A one-host Trainium job of the built-in text workload, as its launcher leaves it for the trainer:
    the host tree, the built-ins' folder and the module's name (no code of the user's)."""
    resource = {"current_host": "algo-1", "current_instance_type": "ml.trn1.2xlarge", "current_group_name": "homogeneousCluster",
                "hosts": ["algo-1"],
                "instance_groups": [{"instance_group_name": "homogeneousCluster", "instance_type": "ml.trn1.2xlarge", "hosts": ["algo-1"]}]}
    settings = {"role_map": json.dumps({"homogeneousCluster": "dnn"}), "variant": "neuron", "dataloader_workers": 0,
                "model_channel": "model", "max_seq_len": 16, "batch_size": 16, "learning_rate": 3e-3, "warmup_steps": 3, "steps": 60}
    base = write_host_tree(tmp_path / "opt-ml", resource, {key: str(value) for key, value in (settings | hyperparameters).items()},
                           channels)
    return {BASE_DIR_ENV: str(base), WORKLOAD_DIR_ENV: str(BUILTIN_WORKLOADS_DIR), WORKLOAD_MODULE_ENV: "text"}


def polarity_host(tmp_path: Path, tiny_model: Path, polarity: Path, **hyperparameters) -> dict[str, str]:
    return text_host(tmp_path, {"train": polarity / "train", "test": polarity / "test", "model": tiny_model}, **hyperparameters)


def metric_lines(output: str) -> list[dict]:
    return [parse_metric_line(line) for line in output.splitlines() if line.startswith("step=")]


# Training through the runtime ------------------------------------------------------------------------------


def test_the_builtin_learns_the_polarity_task_on_xla_and_its_model_loads(tiny_model, polarity, tmp_path, capsys) -> None:
    environ = polarity_host(tmp_path, tiny_model, polarity, eval_channel="test", eval_every=30)
    trainer = build_trainer(TrainerEnvironment.read(environ))
    assert trainer.xla and trainer.runtime.grad_clip_norm == 1.0  # the module's LOOP_DEFAULTS
    assert trainer.classes == ("1", "2") and trainer.features[0].name == "input_ids" and str(trainer.features[0]) == "int32 [16]"
    summary = trainer.run()
    lines = metric_lines(capsys.readouterr().out)
    losses = [line["loss"] for line in lines if "loss" in line]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert [line["eval_accuracy"] for line in lines if "eval_accuracy" in line][0] > 0.5  # the periodic validation ran
    assert summary["validation"]["samples"] == 96 and summary["validation"]["metrics"]["accuracy"] >= 0.9, summary["validation"]
    assert summary["variant"] == "neuron" and summary["workload"] == "text" and summary["device"].startswith("xla")
    assert summary["timed_steps"] == 57 and summary["warmup_s"] > 0 and summary["step_time_ms"]["p50"] > 0

    # The model folder loads as its docstring says: the pretrained folder named instead of the job's channel.
    model_dir = Path(environ[BASE_DIR_ENV]) / "model"
    card = json.loads((model_dir / "workload.json").read_text())
    assert card["module"] == "text" and card["classes"] == ["1", "2"] and (model_dir / "code" / "text.py").exists()
    card["hyperparameters"] |= {"model_channel": "", "model": str(tiny_model)}
    (model_dir / "workload.json").write_text(json.dumps(card))
    saved_path, saved_module = list(sys.path), sys.modules.get("text")
    try:
        sys.path.insert(0, str(model_dir))
        from load_model import load

        model, _ = load(model_dir)
    finally:
        sys.path[:] = saved_path
        sys.modules.pop("load_model", None)
        sys.modules["text"] = saved_module
    assert model.config.num_labels == 2
    assert torch.equal(model.classifier.weight, torch.load(model_dir / "model.pt", weights_only=True)["classifier.weight"])


def test_training_resumes_where_its_checkpoint_left_off(tiny_model, polarity, tmp_path) -> None:
    """A SIGTERM after step 6 of 10: the checkpoint's step, data position, random state and schedule."""
    environ = polarity_host(tmp_path, tiny_model, polarity, steps=10, warmup_steps=1, checkpoint_every=3)
    first = build_trainer(TrainerEnvironment.read(environ))
    at_checkpoint: list[torch.Tensor] = []
    step, save = first.train_step, first.save_checkpoint

    def stopped_at_6(batch):
        if first.ctx.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # the stop vote after the next step
        return step(batch)

    first.train_step = stopped_at_6
    first.save_checkpoint = lambda path, state: (at_checkpoint.append(torch.get_rng_state()), save(path, state))
    with pytest.raises(TrainingStopped, match="after step 6 of 10"):
        first.run()

    resumed = build_trainer(TrainerEnvironment.read(environ))
    torch.manual_seed(1234)  # anything: the checkpoint's state must win
    loaded = resumed.load_checkpoint(resumed.checkpoint_path)
    assert loaded["step"] == 6 and loaded["samples_per_rank"] == 6 * 16
    resumed.set_rng_state(loaded["rng"][0])
    assert torch.equal(torch.get_rng_state(), at_checkpoint[-1])
    assert resumed.scheduler.last_epoch == 6  # the schedule goes on from step 7, not from its warm-up
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * text.rate_factor(7, 10, 0.1)) and text.rate_factor(7, 10, 0.1) > 0
    summary = resumed.run()
    assert summary["start_step"] == 6 and summary["timed_steps"] == 3 and resumed.resume_samples == 96  # read on from sample 96


def test_a_steady_state_step_is_one_executed_graph(tiny_model, polarity, tmp_path) -> None:
    """torch-xla's own metrics: after the warm-up compiles, each step (clipping and the changing rate
    included) executes one graph and compiles none; transformers' 2-D mask check would read the device
    mid-step."""
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    trainer = build_trainer(TrainerEnvironment.read(polarity_host(tmp_path, tiny_model, polarity, steps=12, warmup_steps=1)))
    batches = trainer.batches()

    def count(metric: str) -> int:
        # torch-xla records an execution's metric on its own thread, possibly after the loss reached the
        # host: wait for the device to be idle so a step's execution is counted in its own window.
        xm.wait_device_ops()
        data = met.metric_data(metric)
        return data[0] if data else 0

    for _ in range(3):  # warm-up: the step's graph and the loader's are compiled here
        trainer.loss_value(trainer.train_step(next(batches)))
    executed, compiled = [], []
    for _ in range(4):
        before = count("ExecuteTime"), count("CompileTime")
        trainer.loss_value(trainer.train_step(next(batches)))  # as the loop does on a step it logs, the batch's fetch included
        executed.append(count("ExecuteTime") - before[0])
        compiled.append(count("CompileTime") - before[1])
    assert executed == [1, 1, 1, 1] and compiled == [0, 0, 0, 0]


def _pending(tensors: list[torch.Tensor]) -> bool:
    """Whether any of these XLA tensors still has computation to run (its IR is more than device data)."""
    import torch_xla

    dump = torch_xla._XLAC._get_xla_tensors_text(tensors)
    return any("=" in line and "xla::device_data()" not in line for line in dump.splitlines())


def test_every_step_has_settled_when_the_chief_saves(tiny_model, polarity, tmp_path) -> None:
    trainer = build_trainer(TrainerEnvironment.read(polarity_host(tmp_path, tiny_model, polarity, steps=4, warmup_steps=1, checkpoint_every=2)))
    seen: list[bool] = []
    save = trainer.save_checkpoint

    def checked(path, state):
        optimizer_state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.device.type == "xla"]
        seen.append(_pending(list(trainer.module.parameters()) + optimizer_state))
        save(path, state)

    trainer.save_checkpoint = checked
    trainer.run()
    assert seen == [False, False]


def test_the_rate_warms_up_then_decays_linearly_and_decay_spares_norms_and_biases(tiny_model, polarity, tmp_path) -> None:
    trainer = build_trainer(TrainerEnvironment.read(polarity_host(tmp_path, tiny_model, polarity, steps=10, warmup_steps=1, lr_warmup_fraction=0.2,
                                          learning_rate=1e-3)))
    decayed, spared = trainer.optimizer.param_groups
    names = {id(parameter): name for name, parameter in trainer.module.named_parameters()}
    assert decayed["weight_decay"] == 0.01 and spared["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("weight") and "LayerNorm" not in names[id(p)] for p in decayed["params"])
    assert {names[id(p)] for p in spared["params"]} >= {"bert.embeddings.LayerNorm.weight", "classifier.bias"}
    rates = []
    batches = trainer.batches()
    for _ in range(10):
        rates.append([group["lr"] for group in trainer.optimizer.param_groups])
        trainer.train_step(next(batches))
    assert [first for first, _ in rates] == pytest.approx([5e-4, 1e-3, 1e-3, 0.875e-3, 0.75e-3, 0.625e-3, 0.5e-3, 0.375e-3, 0.25e-3, 0.125e-3])
    assert all(first == second for first, second in rates)


def test_a_validation_writes_a_progress_mark_per_batch_and_counts_every_example_once(tiny_model, polarity, tmp_path, monkeypatch) -> None:
    """The launcher's stall rule sees no step during a validation: each of its batches is a mark. Its
    batches have one shape (one compiled graph) and hold every example once across the ranks."""
    (tmp_path / "progress").mkdir()
    environ = polarity_host(tmp_path, tiny_model, polarity, eval_channel="test") | {PROGRESS_DIR_ENV: str(tmp_path / "progress")}
    trainer = build_trainer(TrainerEnvironment.read(environ))
    written: list[str] = []
    write = trainer._write_mark
    monkeypatch.setattr(trainer, "_write_mark", lambda mark: (written.append(mark), write(mark)))
    assert trainer.validate()["samples"] == 96
    assert written == [f"evaluate {count} 0" for count in range(1, 7)]  # 96 examples, batches of 16
    assert (tmp_path / "progress" / "rank-0").read_text() == "evaluate 6 0"

    prepared = prepared_workload(TrainerEnvironment.read(environ))
    counted: list[int] = []
    for rank in range(5):
        shard = EvalSamples(prepared, trainer.eval_samples, trainer.eval_features, seed=0, rank=rank, world_size=5, batch_size=7)
        for index in range(len(shard)):
            batch, weights = shard[index]
            assert batch["input_ids"].shape == (7, 16) and batch["input_ids"].dtype == torch.int32
            counted += shard.batches[index].indices[: int(weights.sum())]
    assert sorted(counted) == list(range(96))  # a DistributedSampler would have padded 96 to 105


# Reading the channel ---------------------------------------------------------------------------------------


def test_polarity_csv_reading(tmp_path: Path) -> None:
    folder = write_csv(tmp_path / "a" / "x.csv", 4, seed=0, header=True)
    rows = list(text.polarity_rows(folder, "train"))
    assert [label for label, _ in rows] == [2, 1, 2, 1] and ". " in rows[0][1]
    assert text.channel_classes(folder, "train") == (4, [1, 2])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bad.csv").write_text("1,only a title\n")
    with pytest.raises(text.TextDataError, match="bad.csv line 1: expected label,title,content"):
        list(text.polarity_rows(tmp_path / "b", "train"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "empty.csv").write_text("")
    with pytest.raises(text.TextDataError, match=r"channel 'train' at .* holds no non-empty .csv or .jsonl files"):
        list(text.polarity_rows(tmp_path / "c", "train"))


def test_a_channel_of_csv_and_json_lines_shards_in_subfolders_reads_every_row_in_path_order(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    write_csv(root / "part-a" / "00.csv", 3, seed=0, header=True)
    (root / "part-b").mkdir()
    (root / "part-b" / "01.jsonl").write_text(
        '{"label": 2, "title": "Great", "content": "works well"}\n\n{"label": "1", "text": "broke in a day"}\n'
    )
    (root / ".ipynb_checkpoints").mkdir()
    (root / ".ipynb_checkpoints" / "00-checkpoint.csv").write_text("1,not,read\n")
    rows = list(text.polarity_rows(root, "train"))
    assert len(rows) == 5 and rows[3:] == [(2, "Great. works well"), (1, "broke in a day")]
    before = text.cache_key(root, "tok", 16)
    (root / "part-b" / "02.jsonl").write_text('{"label": 1, "text": "meh"}\n')
    assert text.cache_key(root, "tok", 16) != before  # a new shard, a new cache
    for bad, message in (('{"label": 1}', "expected"), ("not json", "not JSON"), ('{"label": true, "text": "x"}', "not an integer"),
                         ('["label", 1]', "expected")):
        (root / "part-b" / "02.jsonl").write_text(bad + "\n")
        with pytest.raises(text.TextDataError, match=f"02.jsonl line 1: .*{message}"):
            list(text.polarity_rows(root, "train"))


def test_the_cache_is_named_after_its_inputs(tiny_model, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = write_csv(tmp_path / "c" / "x.csv", 4, seed=0)
    before = text.cache_key(folder, "tok", 16)
    assert text.cache_key(folder, "tok", 32) != before
    assert text.cache_key(folder, "other", 16) != before
    assert text.cache_key(folder, "tok", 16, classes=[1, 2]) != before  # an eval channel's, mapped by training's classes
    write_csv(folder / "x.csv", 6, seed=0)
    assert text.cache_key(folder, "tok", 16) != before
    # A tokenizer is its definition, not only its path: another vocabulary saved at the same path is another cache.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    grown = AutoTokenizer.from_pretrained(tiny_model)
    grown.add_tokens(["splendid"])
    assert text.tokenizer_identity(tokenizer) == text.tokenizer_identity(AutoTokenizer.from_pretrained(tiny_model))
    assert text.tokenizer_identity(grown) != text.tokenizer_identity(tokenizer) and grown.name_or_path == tokenizer.name_or_path


class CountingTokenizer:
    """The real tokenizer, recording how many texts each call was given."""

    def __init__(self, tokenizer, delay_s: float = 0.0) -> None:
        self.tokenizer, self.calls, self.delay_s = tokenizer, [], delay_s
        self.name_or_path = tokenizer.name_or_path

    def __call__(self, texts, **options):
        self.calls.append(len(texts))
        time.sleep(self.delay_s)
        return self.tokenizer(texts, **options)


def test_tokenisation_goes_in_chunks_into_memory_mapped_int32(tiny_model, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = write_csv(tmp_path / "data" / "part.csv", 45, seed=4)
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(tiny_model))
    rows = text.TokenizedRows(text.tokenize_channel(folder, "train", tokenizer, 16, tmp_path / "cache", chunk=10))
    assert tokenizer.calls == [10, 10, 10, 10, 5]  # never the whole channel in one call
    assert rows.input_ids.dtype == np.int32 and isinstance(rows.input_ids, np.memmap) and isinstance(rows.attention_mask, np.memmap)
    whole = tokenizer.tokenizer([body for _, body in text.polarity_rows(folder, "train")], truncation=True, padding="max_length",
                                max_length=16, return_tensors="np")
    assert np.array_equal(rows.input_ids, whole["input_ids"]) and np.array_equal(rows.attention_mask, whole["attention_mask"])
    assert rows.labels.tolist() == [1, 0] * 22 + [1] and rows.classes == ("1", "2") and len(rows) == 45
    assert rows[3]["label"] == 0 and rows[3]["input_ids"].dtype == np.int32 and not isinstance(rows[3]["input_ids"], np.memmap)
    features = text.preprocess(rows[3], None)
    assert features["label"].dtype == np.int64 and np.array_equal(features["input_ids"], whole["input_ids"][3])
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_the_node_tokenises_once_and_a_crashed_attempt_leaves_nothing_half_made(tiny_model, tmp_path: Path) -> None:
    """Ranks of a node list at once: one tokenises, the others wait on its lock and reuse the cache."""
    from transformers import AutoTokenizer

    folder = write_csv(tmp_path / "data" / "part.csv", 40, seed=3)
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(tiny_model), delay_s=0.05)
    paths: list[Path] = []
    ranks = [threading.Thread(target=lambda: paths.append(text.tokenize_channel(folder, "train", tokenizer, 16, tmp_path / "cache",
                                                                                    chunk=10)))
             for _ in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert tokenizer.calls == [10, 10, 10, 10] and len(set(paths)) == 1 and len(paths) == 3

    class Failing(CountingTokenizer):
        def __call__(self, texts, **options):
            raise RuntimeError("killed mid-way")

    write_csv(folder / "part.csv", 41, seed=3)  # another input, another cache
    with pytest.raises(RuntimeError, match="killed mid-way"):
        text.tokenize_channel(folder, "train", Failing(tokenizer.tokenizer), 16, tmp_path / "cache")
    assert len([path for path in (tmp_path / "cache").iterdir() if path.is_dir() and not path.name.endswith(".partial")]) == 1
    again = text.tokenize_channel(folder, "train", tokenizer, 16, tmp_path / "cache")  # clears the partial and makes it whole
    assert len(text.TokenizedRows(again)) == 41 and not list((tmp_path / "cache").glob("*.partial"))


def test_evaluation_labels_mean_what_they_meant_in_training(tiny_model, polarity, tmp_path: Path) -> None:
    only_positive = tmp_path / "eval"
    only_positive.mkdir()
    (only_positive / "e.csv").write_text("2,good,great\n2,fine,superb\n")
    channels = {"train": polarity / "train", "test": only_positive, "model": tiny_model}
    hyperparameters = dict(text.HYPERPARAMETERS) | {"model_channel": "model", "max_seq_len": 16}

    def listing(channel: str, training: bool):
        return text.list_samples(ChannelContext(channel=channel, path=channels[channel], training=training, hyperparameters=hyperparameters,
                                                channels=channels, training_channel="train"))

    # Mapped on its own, the one class would become id 0 (negative in training); through training's, 1.
    evaluation = listing("test", training=False)
    assert [row["label"] for row in evaluation] == [1, 1] and evaluation.classes == ("1", "2")
    assert listing("train", training=True).classes == ("1", "2")
    (only_positive / "e.csv").write_text("3,odd,item\n")
    with pytest.raises(text.TextDataError, match=r"channel 'test' has labels \[3\] that the training channel's classes \[1, 2\] do not have"):
        listing("test", training=False)


def test_the_listing_pickles_small_and_fast_whatever_its_rows(tmp_path: Path) -> None:
    folder = tmp_path / "tokenized"
    folder.mkdir()
    rows_count, length = 200_000, 128
    for name in ("input_ids", "attention_mask"):
        np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=np.int32, shape=(rows_count, length))[-1] = 7
    np.lib.format.open_memmap(folder / "labels.npy", mode="w+", dtype=np.int64, shape=(rows_count,))[-1] = 1
    (folder / "classes.json").write_text('["1", "2"]')
    rows = text.TokenizedRows(folder)
    sent = pickle.dumps(rows)
    assert len(sent) < 512  # its folder, not 200k rows of 1 KiB: a worker process gets it at once
    started = time.perf_counter()
    for _ in range(100):
        copy = pickle.loads(pickle.dumps(rows))
    assert time.perf_counter() - started < 1.0
    assert len(copy) == rows_count and copy.classes == ("1", "2") and copy[-1]["label"] == 1 and int(copy[-1]["input_ids"][0]) == 7
    assert len(pickle.dumps(rows[-1])) < MAX_SAMPLE_ITEM_BYTES
    ctx = ChannelContext(channel="train", path=folder, training=True, hyperparameters={})
    assert list_channel(SimpleNamespace(list_samples=lambda _: rows), ctx) is rows  # the contract's checks take it as it is


# One model across ranks ------------------------------------------------------------------------------------


def headless(tiny_model: Path, folder: Path) -> Path:
    """The tiny model as a pretrained encoder without a classification head (as bert-base-uncased is),
    saved in bf16: ``from_pretrained(num_labels=…)`` draws the head afresh in every process."""
    from transformers import AutoTokenizer, BertModel

    BertModel.from_pretrained(tiny_model).to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    return folder


def test_the_model_is_built_the_same_whatever_the_random_stream_did_before_and_in_fp32(tiny_model, polarity, tmp_path) -> None:
    encoder = headless(tiny_model, tmp_path / "encoder")
    channels = {"train": polarity / "train", "model": encoder}

    def head(seed: int, run: str) -> torch.Tensor:
        return build_trainer(TrainerEnvironment.read(text_host(tmp_path / run, channels, seed=seed))).module.classifier.weight.detach().cpu()

    torch.rand(3)
    first = head(0, "a")
    torch.rand(11)
    assert torch.equal(first, head(0, "b"))  # seeded before the fresh head is drawn
    assert not torch.equal(first, head(1, "c"))  # the head is drawn there
    assert first.dtype == torch.float32  # from a bf16 checkpoint


def _one_model(rank: int, world: int, port: int, roots: list[str], results: dict) -> None:
    """Two runtime trainers on XLA (each on its own torch-xla CPU device) whose host group is gloo, each
    drawing a different head: only the broadcast of rank 0's parameters can make them one model."""
    from dataclasses import replace

    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ[text.CACHE_DIR_ENV] = str(Path(roots[rank]) / "node-cache")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = host_collectives.host_group()
    environ = json.loads((Path(roots[rank]) / "environ.json").read_text())
    prepared = prepared_workload(TrainerEnvironment.read(environ))
    samples = prepared.list("train", training=True)
    config = replace(prepared.config, seed=100 + rank)
    trainer = WorkloadTrainer(config, OutputPaths.under(Path(roots[rank])), prepared=prepared, classes=samples.classes,
                              features=prepared.features(samples, training=True), num_samples=len(samples), source="local",
                              samples=samples, rank=rank, world_size=world, xla=True, host_group=group)
    state = {name: value.cpu() for name, value in trainer.module.state_dict().items()}
    results[rank] = (state, trainer.reduce_max([float(rank), -float(rank)]), trainer.gather(f"rank {rank}"))
    trainer.barrier()
    dist.destroy_process_group()


def test_trainium_ranks_start_from_one_model_and_agree_on_the_host(tiny_model, polarity, tmp_path) -> None:
    from training.local.cluster import free_port

    encoder = headless(tiny_model, tmp_path / "encoder")
    roots = []
    for rank in range(2):
        environ = text_host(tmp_path / f"rank-{rank}", {"train": polarity / "train", "model": encoder}, steps=4, warmup_steps=1)
        (tmp_path / f"rank-{rank}" / "environ.json").write_text(json.dumps(environ))
        roots.append(str(tmp_path / f"rank-{rank}"))
    results = mp.Manager().dict()
    mp.spawn(_one_model, args=(2, free_port(), roots, results), nprocs=2, join=True)
    (state_0, max_0, gathered_0), (state_1, max_1, gathered_1) = results[0], results[1]
    assert state_0.keys() == state_1.keys()
    assert all(torch.equal(state_0[name], state_1[name]) for name in state_0)  # rank 0's weights on both
    assert max_0 == max_1 == [1.0, 0.0]  # the loop's step vote and data wait, reduced on the host
    assert gathered_0 == gathered_1 == ["rank 0", "rank 1"]


# The example Trainium spec -----------------------------------------------------------------------------------

STAND_IN_PARALLEL_COMPILE = """#!/bin/sh
# Stands in for the Neuron SDK's neuron_parallel_compile (not installable here): it runs the trainer's
# command with graph extraction on, as the real tool does before it compiles what it collected.
echo "$@" > "$(dirname "$0")/ran"
NEURON_EXTRACT_GRAPHS_ONLY=1 "$@"
"""


@pytest.mark.cluster
def test_a_trainium_spec_runs_the_builtin_on_the_emulated_cluster(tiny_model, polarity, tmp_path, monkeypatch) -> None:
    """The neuron example spec, shrunk, through the real entrypoint: launcher → (graph pre-compilation →)
    torchrun → the runtime on the built-in text module."""
    from lambdas.core.job_spec import validate_job_spec
    from training.local.cluster import EmulatedCluster, EmulationOptions

    raw = json.loads((REPO / "examples" / "neuron-trn1-2xlarge.json").read_text())
    raw["hyperparameters"] |= {"steps": 20, "warmup_steps": 3, "batch_size": 16, "max_seq_len": 16, "eval_every": 10,
                               "checkpoint_every": 0, "learning_rate": 0.003, "precompile_steps": 3}
    tools = tmp_path / "neuron-sdk"
    tools.mkdir()
    (tools / "neuron_parallel_compile").write_text(STAND_IN_PARALLEL_COMPILE)
    (tools / "neuron_parallel_compile").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    lines: list[str] = []
    channels = {"train": polarity / "train", "test": polarity / "test", "model": tiny_model}
    cluster = EmulatedCluster(validate_job_spec(raw), EmulationOptions(workdir=tmp_path, channels=channels, processes_per_host=1),
                              on_line=lambda host, line: lines.append(line))
    result = cluster.run()
    assert result.ok, result.report() + "\n".join(lines[-40:])
    summary = cluster.summary()
    assert summary["variant"] == "neuron" and summary["workload"] == "text" and summary["steps"] == 20
    assert summary["validation"]["samples"] == 96 and summary["validation"]["metrics"]["accuracy"] > 0.5
    # 17 timed steps and two validations, all the real run's: the pre-compilation ran the trainer first, 3
    # steps into a scratch folder, with no metric line of its own and no checkpoint or model where the
    # job's own would be resumed from.
    assert sum("step_time_ms=" in line for line in lines) == 17
    assert [re.search(r"step=(\d+)/", line).group(1) for line in lines if "eval_accuracy=" in line] == ["10", "20"]
    assert "training.torchrun" in (tools / "ran").read_text()
    host = next(path for path in tmp_path.glob("algo-*/opt/ml") if (path / "precompile").exists())
    assert json.loads((host / "precompile" / "output" / "data" / "summary.json").read_text())["steps"] == 3
    assert json.loads((host / "output" / "data" / "summary.json").read_text())["start_step"] == 0
