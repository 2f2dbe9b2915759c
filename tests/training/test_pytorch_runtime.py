"""The one PyTorch runtime of user workloads (training/trainers/pytorch_runtime.py), in this process: a step
is one executed graph on XLA, a diverged loss fails naming its step and saves nothing, a step that returns
the wrong thing is refused by name, a batch whose shapes change is refused on XLA, the homogeneous loader
draws exactly what a data host's worker draws, and the saved model loads without the platform."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import write_host_tree
from training.cluster import BASE_DIR_ENV
from training.host_environment import WORKLOAD_DIR_ENV, TrainerEnvironment
from training.trainers.pytorch_runtime import (
    LocalSamples,
    NonFiniteLossError,
    ShapeChangedError,
    StepOutputError,
    WorkloadTrainer,
    build_trainer,
    step_output,
)
from training.workload.contract import WorkloadError
from training.workload.host import prepared_workload
from training.workload.samples import BatchRecipe, make_batch

REPO = Path(__file__).resolve().parents[2]
TEXT_EXAMPLE = REPO / "examples" / "workloads" / "text_classifier"

LINEAR = '''
import numpy as np
import torch

HYPERPARAMETERS = {"explode_at": 0, "crop_at": 0}

def list_samples(ctx):
    return list(range(32))

def preprocess(sample, ctx):
    return {"x": np.full(4, sample / 32, dtype=np.float32) + ctx.rng.normal(size=4).astype(np.float32), "y": np.float32(sample % 2)}

def build_model(ctx):
    return torch.nn.Linear(4, 1)

def device_transform(batch, ctx):
    if ctx.hyperparameters["crop_at"] and ctx.step >= ctx.hyperparameters["crop_at"]:
        batch["x"] = batch["x"][:, :3]
        batch["x"] = torch.nn.functional.pad(batch["x"], (0, 1))[: batch["x"].shape[0] - 1]
        batch["y"] = batch["y"][:-1]
    return batch

def train_step(model, batch, ctx):
    loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])
    if ctx.hyperparameters["explode_at"] and ctx.step >= ctx.hyperparameters["explode_at"]:
        loss = loss * float("nan")
    return loss
'''


def host(tmp_path: Path, code: Path, *, xla: bool = False, channels: dict[str, Path] | None = None, **hyperparameters) -> dict[str, str]:
    """A homogeneous host tree for a user workload; the environment its trainer process would have."""
    resource = {"current_host": "algo-1", "current_instance_type": "ml.trn1.2xlarge" if xla else "ml.p3.2xlarge",
                "current_group_name": "homogeneousCluster", "hosts": ["algo-1"],
                "instance_groups": [{"instance_group_name": "homogeneousCluster", "instance_type": "ml.p3.2xlarge", "hosts": ["algo-1"]}]}
    settings = {"role_map": json.dumps({"homogeneousCluster": "dnn"}), "variant": "neuron" if xla else "pytorch",
                "workload_module": "workload", "workload_sha256": "0" * 64, "dataloader_workers": "0", "warmup_steps": "1"}
    empty = tmp_path / "channel"
    empty.mkdir(exist_ok=True)
    base = write_host_tree(tmp_path / "opt-ml", resource, settings | {key: str(value) for key, value in hyperparameters.items()},
                           channels or {"train": empty})
    return {BASE_DIR_ENV: str(base), WORKLOAD_DIR_ENV: str(code)}


def linear_code(tmp_path: Path) -> Path:
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "workload.py").write_text(textwrap.dedent(LINEAR))
    sys.modules.pop("workload", None)
    return folder


@pytest.fixture(autouse=True)
def forget_workload_module():
    yield
    sys.modules.pop("workload", None)


def test_a_diverged_loss_fails_naming_its_step_and_saves_neither_checkpoint_nor_model(tmp_path):
    environ = host(tmp_path, linear_code(tmp_path), steps=20, explode_at=7, checkpoint_every=5, batch_size=4)
    trainer = build_trainer(TrainerEnvironment.read(environ))
    with pytest.raises(NonFiniteLossError, match=r"the loss is nan at step 7"):
        trainer.run()
    checkpoint = torch.load(Path(environ[BASE_DIR_ENV]) / "checkpoints" / "checkpoint.pt", weights_only=True)
    assert checkpoint["loop"]["step"] == 5  # the last healthy one; none of the diverged state
    assert not (Path(environ[BASE_DIR_ENV]) / "model" / "model.pt").exists()


@pytest.mark.parametrize(("output", "words"), [
    (torch.ones(3, requires_grad=True), r"a loss of shape \[3\] at step 4"),
    (torch.ones((), requires_grad=False), r"does not require grad at step 4"),
    (2.5, r"returned a float at step 4"),
    ((torch.ones((), requires_grad=True), {"acc": torch.ones(2)}), r"metric 'acc' has shape \[2\]"),
])
def test_a_step_that_returns_the_wrong_thing_is_refused_by_name(output, words):
    with pytest.raises(StepOutputError, match=words):
        step_output(output, 4)


def test_on_xla_a_step_is_one_executed_graph_and_compiles_nothing_after_warm_up(tmp_path, tmp_path_factory):
    import importlib.util

    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    make = importlib.util.spec_from_file_location("make_reviews", TEXT_EXAMPLE / "make_data.py")
    module = importlib.util.module_from_spec(make)
    make.loader.exec_module(module)
    reviews = module.write(tmp_path_factory.mktemp("reviews"), train=128, validation=32)
    environ = host(tmp_path, TEXT_EXAMPLE, xla=True, channels={"train": reviews / "train"}, steps=20, batch_size=8)
    trainer = build_trainer(TrainerEnvironment.read(environ))
    assert trainer.xla and str(trainer.device).startswith("xla")
    batches = trainer.batches()

    def count(metric: str) -> int:
        # torch-xla records an execution's metric on its own thread, possibly after the loss reached the
        # host: wait for the device to be idle so a step's execution is counted in its own window.
        xm.wait_device_ops()
        data = met.metric_data(metric)
        return data[0] if data else 0

    for _ in range(3):
        trainer.loss_value(trainer.train_step(next(batches)))
    executed, compiled = [], []
    for _ in range(4):
        before = count("ExecuteTime"), count("CompileTime")
        trainer.loss_value(trainer.train_step(next(batches)))
        executed.append(count("ExecuteTime") - before[0])
        compiled.append(count("CompileTime") - before[1])
    assert executed == [1, 1, 1, 1] and compiled == [0, 0, 0, 0]


def test_on_xla_validating_mid_run_compiles_no_training_graph_again(tmp_path, tmp_path_factory):
    """eval_every switches the model to eval and back on the device: the training step after it must find
    its graph in the cache (a recompile costs minutes on Trainium), at every validation."""
    import importlib.util

    import torch_xla.debug.metrics as met

    make = importlib.util.spec_from_file_location("make_reviews", TEXT_EXAMPLE / "make_data.py")
    module = importlib.util.module_from_spec(make)
    make.loader.exec_module(module)
    reviews = module.write(tmp_path_factory.mktemp("reviews"), train=128, validation=32)
    environ = host(tmp_path, TEXT_EXAMPLE, xla=True, channels={"train": reviews / "train", "validation": reviews / "validation"},
                   steps=16, batch_size=8, eval_channel="validation", eval_every=5, checkpoint_every=0)
    trainer = build_trainer(TrainerEnvironment.read(environ))
    step, compiles = trainer.train_step, []

    def compiles_of_each_step(batch):  # the real step, with the compilations it caused counted
        before = (met.metric_data("CompileTime") or (0,))[0]
        output = step(batch)
        compiles.append((met.metric_data("CompileTime") or (0,))[0] - before)
        return output

    trainer.train_step = compiles_of_each_step
    summary = trainer.run()
    assert summary["validation"]["step"] == 16 and len(compiles) == 16
    assert sum(compiles[2:]) == 0, compiles  # the first two steps compile (fresh, then with optimizer state); none after


def test_on_xla_a_batch_whose_shapes_change_is_refused_naming_the_feature(tmp_path):
    environ = host(tmp_path, linear_code(tmp_path), xla=True, steps=10, crop_at=0, batch_size=4)
    trainer = build_trainer(TrainerEnvironment.read(environ))
    batches = trainer.batches()
    trainer.train_step(next(batches))
    shorter = {name: tensor[:-1] for name, tensor in next(batches).items()}
    with pytest.raises(ShapeChangedError, match=r"batch 'x' \[3, 4\] at step 2, 'x' \[4, 4\] before"):
        trainer.train_step(shorter)


def test_the_homogeneous_loader_draws_what_a_data_hosts_worker_draws(tmp_path):
    environ = host(tmp_path, linear_code(tmp_path), steps=10)
    prepared = prepared_workload(TrainerEnvironment.read(environ))
    samples = prepared.list("train", training=True)
    features = prepared.features(samples, training=True)
    local = LocalSamples(prepared, samples, features, seed=prepared.config.seed)
    recipe = BatchRecipe(prepared.workload.code_dir, "workload", None, samples, dict(prepared.hyperparameters), prepared.config.seed, features)
    served, _ = make_batch(prepared.workload, recipe, [5, 9], [], [3, 3])  # samples 5 and 9 of epoch 3, on a data host
    for slot, index in enumerate((5, 9)):
        mine, skipped = local[(3, index)]
        assert skipped == 0 and np.array_equal(mine["x"], served["x"][slot])
    assert not np.array_equal(local[(4, 5)][0]["x"], served["x"][0])  # another epoch, another draw


def test_the_saved_model_loads_without_the_platform(tmp_path):
    environ = host(tmp_path, linear_code(tmp_path), steps=6, batch_size=4)
    trainer: WorkloadTrainer = build_trainer(TrainerEnvironment.read(environ))
    trainer.run()
    model = Path(environ[BASE_DIR_ENV]) / "model"
    # A fresh interpreter that cannot import the platform (nor this repository: its editable install's finder is dropped).
    script = f"import sys, importlib.util; sys.path = [p for p in sys.path if p not in ({str(REPO)!r}, '')]; sys.path.insert(0, {str(model)!r})\n" \
             "sys.meta_path = [finder for finder in sys.meta_path if 'editable' not in getattr(finder, '__module__', repr(finder))]\n" \
             "assert importlib.util.find_spec('training') is None, 'the platform is importable'\n" \
             f"from load_model import load\nmodel, card = load({str(model)!r})\nimport torch\n" \
             "print(card['module'], type(model).__name__, float(model(torch.zeros(1, 4)).detach().reshape(())) == float(model.bias))\n" \
             "ctx = card['ctx']  # the module's own preprocess and device_transform, as validation ran them\n" \
             "sample = card['workload'].preprocess(5, ctx)\n" \
             "batch = card['workload'].device_transform({'x': torch.from_numpy(sample['x'])[None]}, ctx)\n" \
             "print(ctx.training, tuple(batch['x'].shape))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["workload", "Linear", "True", "False", "(1,", "4)"]
    card = json.loads((model / "workload.json").read_text())
    assert card["features"] == [{"name": "x", "dtype": "float32", "shape": [4]}, {"name": "y", "dtype": "float32", "shape": []}]


def test_workload_state_a_resume_could_not_load_is_refused_at_the_first_checkpoint(tmp_path):
    code = linear_code(tmp_path)
    source = (code / "workload.py").read_text().replace("    loss = torch.nn.functional.mse_loss(",
                                                          "    ctx.state['best'] = np.float64(1.5)\n    loss = torch.nn.functional.mse_loss(")
    (code / "workload.py").write_text(source)
    environ = host(tmp_path, code, steps=10, checkpoint_every=3, batch_size=4)
    with pytest.raises(StepOutputError, match=r"ctx.state\['best'\] is a float64, which a resumed run could not load"):
        build_trainer(TrainerEnvironment.read(environ)).run()
    assert not (Path(environ[BASE_DIR_ENV]) / "checkpoints" / "checkpoint.pt").exists()


NUMPY_SCHEDULE = '''
def build_optimizer(model, ctx):  # the augmented_cnn example's shape: a LambdaLR whose factor is a NumPy scalar
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 0.5 * (1 + np.cos(np.pi * min(1.0, done / ctx.steps))))
'''


def test_a_schedule_computed_with_numpy_checkpoints_plain_and_resumes_at_its_rate(tmp_path):
    """Before: the scheduler's _last_lr and the optimizer's lr were np.float64, and the resume's weights_only
    load raised UnpicklingError. Now they are saved as Python floats and the resumed run continues the schedule."""
    import shutil

    code = linear_code(tmp_path)
    (code / "workload.py").write_text((code / "workload.py").read_text() + NUMPY_SCHEDULE)
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
    first = host(tmp_path / "first", code, steps=4, batch_size=4, checkpoint_every=2)
    build_trainer(TrainerEnvironment.read(first)).run()
    written = torch.load(Path(first[BASE_DIR_ENV]) / "checkpoints" / "checkpoint.pt", weights_only=True)
    assert all(type(rate) is float for rate in written["scheduler"]["_last_lr"] + [group["lr"] for group in written["optimizer"]["param_groups"]])
    second = host(tmp_path / "second", code, steps=4, batch_size=4)
    (Path(second[BASE_DIR_ENV]) / "checkpoints").mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(first[BASE_DIR_ENV]) / "checkpoints" / "checkpoint.pt", Path(second[BASE_DIR_ENV]) / "checkpoints")
    resumed = build_trainer(TrainerEnvironment.read(second))
    assert resumed.load_checkpoint(resumed.checkpoint_path)["step"] == 4
    assert resumed.scheduler.last_epoch == 4 and resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 * (1 + np.cos(np.pi)))


def test_state_a_resume_could_not_load_fails_the_run_at_its_first_checkpoint_naming_the_part(tmp_path):
    """A scheduler whose state holds an object weights_only refuses (a Decimal here): the first checkpoint is
    loaded back as it is written, and the run stops there, naming the scheduler, with no checkpoint left."""
    from training.trainers.checkpoint_state import UnrestorableCheckpointError

    code = linear_code(tmp_path)
    (code / "workload.py").write_text((code / "workload.py").read_text() + textwrap.dedent('''
        import decimal

        class DecimalStep(torch.optim.lr_scheduler.LambdaLR):
            def state_dict(self):
                return super().state_dict() | {"precision": decimal.Decimal("0.5")}

        def build_optimizer(model, ctx):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            return optimizer, DecimalStep(optimizer, lambda done: 1.0)
    '''))
    environ = host(tmp_path, code, steps=6, batch_size=4, checkpoint_every=2)
    with pytest.raises(UnrestorableCheckpointError, match=r"the checkpoint of step 2 could not be resumed: the scheduler's state_dict holds "
                                                          r"an object .*decimal\.Decimal"):
        build_trainer(TrainerEnvironment.read(environ)).run()
    assert not list((Path(environ[BASE_DIR_ENV]) / "checkpoints").glob("checkpoint.pt*"))


def test_a_scheduler_that_steps_on_a_metric_is_refused_by_name(tmp_path):
    code = linear_code(tmp_path)
    (code / "workload.py").write_text((code / "workload.py").read_text() + textwrap.dedent('''
        def build_optimizer(model, ctx):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            return optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    '''))
    with pytest.raises(StepOutputError, match="ReduceLROnPlateau, which steps on a metric"):
        build_trainer(TrainerEnvironment.read(host(tmp_path, code, steps=4)))


PROBE = '''
import os

import numpy as np
import torch

def list_samples(ctx):
    return list(range(8))

def preprocess(sample, ctx):
    return {"index": np.int64(sample), "pid": np.int64(os.getpid()), "draw": np.float64(ctx.rng.random())}

def build_model(ctx):
    return torch.nn.Linear(1, 1)

def train_step(model, batch, ctx):
    return model(batch["draw"].float().unsqueeze(1)).mean()
'''


def test_each_rank_draws_its_own_augmentations_and_workers_never_restart(tmp_path):
    """A homogeneous job's DataLoader workers persist across epochs (the sampler never ends, so they
    never drain at an epoch's end); each rank reads its own half of an epoch, and a sample's draws are
    (seed, epoch, sample)'s: another epoch draws anew, a resumed run draws what the uninterrupted one would."""
    from training.trainers.pytorch_runtime import tagged_order

    code = tmp_path / "code"
    code.mkdir()
    (code / "workload.py").write_text(PROBE)
    trainer = build_trainer(TrainerEnvironment.read(host(tmp_path, code, batch_size=2, dataloader_workers=2, steps=100)))
    batches = [next(batches) for batches in [trainer.batches()] for _ in range(12)]  # three epochs of 8 samples
    assert len({int(pid) for batch in batches for pid in batch["pid"]}) == 2  # the same two worker processes all along
    epochs = [sorted(int(i) for batch in batches[at:at + 4] for i in batch["index"]) for at in (0, 4, 8)]
    assert epochs == [list(range(8))] * 3  # each epoch reads every sample once
    draws = [{int(i): float(d) for batch in batches[at:at + 4] for i, d in zip(batch["index"], batch["draw"], strict=True)} for at in (0, 4)]
    assert all(draws[0][index] != draws[1][index] for index in range(8))  # a new epoch, new augmentations
    halves = [list(itertools.islice(tagged_order(8, rank=rank, world_size=2, seed=0, start=0), 4)) for rank in (0, 1)]
    assert sorted(index for half in halves for _, index in half) == list(range(8))  # the two ranks' halves: the epoch, once
    uninterrupted = list(itertools.islice(tagged_order(8, rank=0, world_size=2, seed=0, start=0), 12))
    assert list(itertools.islice(tagged_order(8, rank=0, world_size=2, seed=0, start=5), 7)) == uninterrupted[5:]


def test_an_evaluation_listing_with_classes_of_its_own_is_refused_by_name(tmp_path):
    """Labels index the classes: a user's eval listing that names other classes than the training
    channel's would score against the wrong outputs, so the trainer refuses it before step 1."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "workload.py").write_text(textwrap.dedent('''
        import numpy as np
        import torch

        class Listing(list):
            classes = ()

        def listing(items, classes):
            samples = Listing(items)
            samples.classes = tuple(classes)
            return samples

        def list_samples(ctx):
            if ctx.training:
                return listing([(0, 0), (1, 1), (2, 2)] * 4, ["ant", "bee", "cat"])
            assert ctx.classes == ("ant", "bee", "cat")  # the training channel's, while listing another
            return listing([(1, 0), (2, 1)], ["bee", "cat"])  # its own: a subset, relabelled

        def preprocess(sample, ctx):
            return {"x": np.full(2, sample[0], dtype=np.float32), "y": np.int64(sample[1])}

        def build_model(ctx):
            return torch.nn.Linear(2, len(ctx.classes))

        def train_step(model, batch, ctx):
            return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])

        def eval_step(model, batch, ctx):
            return {"accuracy": (model(batch["x"]).argmax(1) == batch["y"]).float().mean()}
    '''))
    environ = host(tmp_path, code, channels={"train": tmp_path / "channel", "validation": tmp_path / "channel"},
                   steps=2, batch_size=2, eval_channel="validation")
    with pytest.raises(WorkloadError, match=r"channel 'validation' lists classes \['bee', 'cat'\], but the training channel's are \['ant', 'bee', 'cat'\]"):
        build_trainer(TrainerEnvironment.read(environ))


def test_a_resumed_run_trains_at_its_own_rate_with_the_first_runs_moments(tmp_path):
    """Without a scheduler, the rate is the resumed job's learning_rate (a retry with a lower rate must get
    it), while AdamW's moments and step counts continue from the checkpoint."""
    import shutil

    code = linear_code(tmp_path)
    source = (code / "workload.py").read_text()
    (code / "workload.py").write_text(source.replace('HYPERPARAMETERS = {"explode_at": 0, "crop_at": 0}',
                                                     'HYPERPARAMETERS = {"explode_at": 0, "crop_at": 0, "learning_rate": 0.001}'))
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
    first = host(tmp_path / "first", code, steps=4, batch_size=4, checkpoint_every=2, learning_rate=0.1)
    build_trainer(TrainerEnvironment.read(first)).run()
    second = host(tmp_path / "second", code, steps=8, batch_size=4, learning_rate=0.5)
    (Path(second[BASE_DIR_ENV]) / "checkpoints").mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(first[BASE_DIR_ENV]) / "checkpoints" / "checkpoint.pt", Path(second[BASE_DIR_ENV]) / "checkpoints")
    resumed = build_trainer(TrainerEnvironment.read(second))
    assert resumed.load_checkpoint(resumed.checkpoint_path)["step"] == 4
    assert [group["lr"] for group in resumed.optimizer.param_groups] == [0.5]
    assert all(int(state["step"]) == 4 for state in resumed.optimizer.state_dict()["state"].values())
