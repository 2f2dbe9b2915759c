"""The built-in image classifier (training/workloads/vision.py) on the one PyTorch runtime, in this process on
the CPU, built from a one-host SageMaker tree as a job's trainer process builds it: learning with
validation, metric lines, outputs, resume, the rate's warm-up and decay, weight decay off norms and
biases, precision, undecodable files, cached input, tar shards' streaming order, and the Lambda-side
view of its settings held equal to the module's."""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
from dataclasses import MISSING, fields, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from training.local.single_host import single_host_trainer
from training.metrics import METRIC_DEFINITIONS, metric_line, parse_metric_line
from training.trainers.config import TextConfig, VisionConfig, WorkloadConfig
from training.trainers.loop import CheckpointWriteError, summarize
from training.trainers.precision import resolve_precision
from training.variants import BUILTIN_WORKLOADS_DIR, VARIANTS

SMALL = dict(model="cnn", cnn_width=8, image_size=32, batch_size=16, learning_rate=0.05, dataloader_workers=1)


def trainer(images: Path, base: Path, channels: dict[str, Path] | None = None, **overrides):
    return single_host_trainer(base, SMALL | overrides, channels or {"train": images})


def vision_module():
    spec = importlib.util.spec_from_file_location("builtin_vision_for_tests", BUILTIN_WORKLOADS_DIR / "vision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metric_lines(text: str) -> list[dict[str, float]]:
    return [parse_metric_line(line) for line in text.splitlines() if line.startswith("step=")]


def held_out(images: Path, folder: Path, classes: list[str]) -> Path:
    for name in classes:
        shutil.copytree(images / name, folder / name)
    return folder


def test_training_learns_validates_and_logs_one_metric_line_per_step(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # The held-out folder has 3 of the 4 classes: its labels must still name the training channel's
    # classes (by its own sorted folders, class_01 would be label 0 and the accuracy near nothing).
    validation = held_out(images, tmp_path / "validation", ["class_01", "class_02", "class_03"])
    summary = trainer(images, tmp_path, {"train": images, "validation": validation}, steps=40, warmup_steps=3, eval_channel="validation",
                      eval_every=20).run()
    out = capsys.readouterr().out
    lines = [line for line in metric_lines(out) if "loss" in line]
    assert len(lines) == 40
    assert [("warmup_ms" in line, "step_time_ms" in line) for line in lines[:3]] == [(True, False)] * 3
    assert all("step_time_ms" in line and "data_wait_ms" in line and "warmup_ms" not in line for line in lines[3:])
    losses = [line["loss"] for line in lines]
    assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8, losses
    assert summary["timed_steps"] == 37 and summary["warmup_steps"] == 3
    assert summary["data_source"] == "local" and summary["skipped_samples"] == 0 and summary["workload"] == "vision"
    # Validated at step 20 and at the end, over every one of the 72 images (centre crops), well above chance (0.25).
    evaluations = [line for line in metric_lines(out) if "eval_accuracy" in line]
    assert len(evaluations) == 2
    assert summary["validation"]["step"] == 40 and summary["validation"]["samples"] == 72
    assert summary["validation"]["metrics"]["accuracy"] > 0.6, summary["validation"]


def test_a_held_out_class_the_training_channel_lacks_is_refused_by_name_before_training(images: Path, tmp_path: Path) -> None:
    from training.workload.contract import WorkloadError

    validation = held_out(images, tmp_path / "validation", ["class_00"])
    (validation / "class_99").mkdir()
    shutil.copy(next((images / "class_01").iterdir()), validation / "class_99" / "extra.jpg")
    with pytest.raises(WorkloadError, match=r"list_samples raised ChannelError on channel 'validation' .*class folders \['class_99'\] are not among"):
        trainer(images, tmp_path / "run", {"train": images, "validation": validation}, steps=2, warmup_steps=1, eval_channel="validation")


def test_outputs_land_in_the_sagemaker_folders_and_the_model_loads_without_the_platform(images: Path, tmp_path: Path) -> None:
    trainer(images, tmp_path, steps=4, warmup_steps=1, seed=3).run()
    summary = json.loads((tmp_path / "output" / "data" / "summary.json").read_text())
    config = json.loads((tmp_path / "output" / "data" / "config.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert config["seed"] == 3 and config["world_size"] == 1
    card = json.loads((tmp_path / "model" / "workload.json").read_text())
    assert card["module"] == "vision" and card["hyperparameters"]["model"] == "cnn"
    assert card["classes"] == ["class_00", "class_01", "class_02", "class_03"]
    assert (tmp_path / "checkpoints" / "checkpoint.pt").exists()
    model = vision_module().SmallCNN(4, 8)
    model.load_state_dict(torch.load(tmp_path / "model" / "model.pt", weights_only=True))


def test_a_second_run_resumes_from_the_checkpoint(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    first = trainer(images, tmp_path, steps=6, warmup_steps=1, checkpoint_every=3)
    first.run()
    weights = {name: value.clone() for name, value in first.module.state_dict().items()}
    capsys.readouterr()
    # Resumed with another rate and weight decay: the optimizer's moments continue, its settings are this run's.
    resumed = trainer(images, tmp_path, steps=10, warmup_steps=1, learning_rate=0.1, weight_decay=0.002)
    assert resumed.load_checkpoint(resumed.checkpoint_path)["step"] == 6
    assert resumed.scheduler.last_epoch == 6
    assert resumed.scheduler.base_lrs == [0.1, 0.1]
    factor = vision_module().schedule_factor(7, 10, resumed.prepared.hyperparameters["lr_warmup_fraction"])
    assert [group["lr"] for group in resumed.optimizer.param_groups] == pytest.approx([0.1 * factor] * 2)
    assert [group["weight_decay"] for group in resumed.optimizer.param_groups] == [0.002, 0.0]
    assert resumed.optimizer.state_dict()["state"], "the first run's momentum buffers"
    assert all(torch.equal(weights[name], value) for name, value in resumed.module.state_dict().items())
    summary = resumed.run()
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step=")]
    assert summary["start_step"] == 6 and summary["timed_steps"] == 3
    assert steps[0].startswith("step=7/10") and steps[-1].startswith("step=10/10")
    assert resumed.resume_samples == 6 * 16


def test_a_checkpoint_of_an_earlier_release_resumes_in_the_order_its_run_drew(images: Path, tmp_path: Path) -> None:
    """Its epochs were drawn by torch.randperm; this release draws the data hosts' order. A run resumed from
    it goes on in its own order (the rest of the interrupted epoch, nothing twice), and says so in its
    checkpoints, so that a later resume keeps it too."""
    from training.trainers.pytorch_runtime import tagged_order

    first = trainer(images, tmp_path, steps=3, warmup_steps=1)
    first.run()
    saved = torch.load(first.checkpoint_path, weights_only=True)
    assert saved["loop"]["order"] == 2
    del saved["loop"]["order"]  # as an earlier release wrote it
    torch.save(saved, first.checkpoint_path)
    resumed = trainer(images, tmp_path, steps=5, warmup_steps=1)
    resumed.run()
    assert resumed.legacy_order and torch.load(resumed.checkpoint_path, weights_only=True)["loop"]["order"] == 1
    legacy = [index for _, index in itertools.islice(tagged_order(96, rank=0, world_size=1, seed=0, start=0, legacy=True), 96)]
    current = [index for _, index in itertools.islice(tagged_order(96, rank=0, world_size=1, seed=0, start=0), 96)]
    expected = torch.randperm(96, generator=torch.Generator().manual_seed(0 * 1_000_003)).tolist()
    assert legacy == expected and sorted(current) == list(range(96)) and current != legacy


def test_a_checkpoint_of_another_layout_is_refused_by_name(images: Path, tmp_path: Path) -> None:
    from training.trainers.pytorch_runtime import CheckpointFormatError

    run = trainer(images, tmp_path, steps=2, warmup_steps=1)
    run.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
    earlier = {"model": run.module.state_dict(), "optimizer": {}, "lr_scheduler": {}, "scaler": {}, "loop": {"step": 1}}
    torch.save(earlier, run.checkpoint_path)
    with pytest.raises(CheckpointFormatError, match=r"not written by this release's PyTorch runtime \(its keys: loop, lr_scheduler, "):
        run.load_checkpoint(run.checkpoint_path)


def test_the_rate_warms_up_to_the_per_worker_rate_then_decays_to_zero_by_a_cosine(images: Path, tmp_path: Path) -> None:
    run = trainer(images, tmp_path, steps=20, warmup_steps=1, lr_warmup_fraction=0.2, learning_rate=0.1, dataloader_workers=0)
    rates = []
    batches = run.batches()
    for _ in range(20):
        rates.append(run.optimizer.param_groups[0]["lr"])
        run.train_step(next(batches))
    assert rates[:5] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1])  # warm-up over 4 steps, then the peak
    assert all(later < earlier for earlier, later in itertools.pairwise(rates[4:]))  # never constant after the warm-up
    assert rates[-1] == pytest.approx(0.1 * 0.5 * (1 + np.cos(np.pi * 15 / 16)))  # the last step's, near zero
    # Eight workers: eight times the rate (scale_lr), by the module's own optimizer.
    eight = replace(run.ctx, world_size=8)
    _, schedule = vision_module().build_optimizer(torch.nn.Linear(2, 2), eight)
    assert schedule.base_lrs == pytest.approx([0.8, 0.8])


def test_weight_decay_applies_to_convolution_and_linear_weights_only(images: Path, tmp_path: Path) -> None:
    run = trainer(images, tmp_path, steps=2, warmup_steps=1, weight_decay=0.01)
    decayed, free = run.optimizer.param_groups
    assert decayed["weight_decay"] == 0.01 and free["weight_decay"] == 0.0
    assert all(parameter.ndim > 1 for parameter in decayed["params"])
    norms_and_biases = {id(p) for m in run.module.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()}
    norms_and_biases.add(id(run.module.head.bias))
    assert norms_and_biases == {id(parameter) for parameter in free["params"]}


def test_precision_follows_the_device(images: Path, tmp_path: Path) -> None:
    assert resolve_precision("auto", gpu=True, capability=(9, 0)) == "bf16"  # H100/H200
    assert resolve_precision("auto", gpu=True, capability=(8, 0)) == "bf16"  # A100 (ml.p4d)
    assert resolve_precision("auto", gpu=True, capability=(7, 0)) == "fp16"  # V100 (ml.p3): no bf16, loss scaling instead
    assert resolve_precision("fp32", gpu=True, capability=(9, 0)) == "fp32"
    assert resolve_precision("auto", gpu=False) == "fp32"
    run = trainer(images, tmp_path, steps=2, warmup_steps=1)
    assert run.precision == "fp32" and not run.scaler.is_enabled()  # this machine has no GPU


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_train(images: Path, tmp_path: Path, precision: str) -> None:
    run = trainer(images, tmp_path, steps=6, warmup_steps=1, precision=precision)
    summary = run.run()
    assert summary["precision"] == precision and summary["final_loss"] is not None
    assert run.scaler.is_enabled() == (precision == "fp16")  # fp16 scales its loss; bf16 has fp32's range
    assert all(parameter.dtype == torch.float32 for parameter in run.module.parameters())  # fp32 master weights


def test_undecodable_files_are_skipped_and_counted(images: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(images, tmp_path / "images")
    for path in sorted(copy.glob("class_02/*.jpg"))[:5]:
        path.write_bytes(b"not an image")
    summary = trainer(copy, tmp_path / "run", steps=12, warmup_steps=1, dataloader_workers=0).run()
    assert summary["status"] == "completed"
    assert 0 < summary["skipped_samples"] <= 5 * 2 + 2  # each broken file is met about twice in 12 × 16 draws of 96


def test_cached_input_times_the_model_alone(images: Path, tmp_path: Path) -> None:
    run = trainer(images, tmp_path, steps=9, warmup_steps=1, cached_input_batches=3)
    seen = []
    for batch in run.batches():
        seen.append(batch["image"])
        if len(seen) == 7:
            break
    assert all(seen[index] is seen[index % 3] for index in range(7))  # three real batches, cycled
    summary = run.run()
    assert summary["cached_input_batches"] == 3 and summary["data_wait_ms"]["p90"] < 5


def test_tar_shards_are_read_in_their_streaming_order_and_learn_as_the_folder_does(images: Path, image_shards: Path, tmp_path: Path) -> None:
    from training.data_service.dataset import shard_stream_order

    run = trainer(image_shards, tmp_path / "order", steps=2, warmup_steps=1, dataloader_workers=0)
    assert run.samples.shard_ends == (16, 32, 48, 64, 80, 96)
    from training.trainers.pytorch_runtime import TaggedSampler

    order = [index for _, index in itertools.islice(iter(TaggedSampler(96, rank=0, world_size=1, seed=0, start=0,
                                                                       shard_ends=run.samples.shard_ends)), 96)]
    assert order == shard_stream_order(run.samples.shard_ends, np.random.default_rng([0, 0]))
    summaries = {name: trainer(root, tmp_path / name, steps=30, warmup_steps=2).run() for name, root in (("folder", images), ("shards", image_shards))}
    folder, shards = summaries["folder"], summaries["shards"]
    same = ("status", "steps", "timed_steps", "warmup_steps", "batch_size", "world_size", "data_source", "skipped_samples")
    assert {key: shards[key] for key in same} == {key: folder[key] for key in same}
    assert shards["final_loss"] < 0.8 * np.log(4), shards  # learnt: chance is ln 4


def test_time_to_first_batch_counts_from_the_containers_start(images: Path, tmp_path: Path) -> None:
    import time

    from training.host_environment import CONTAINER_STARTED_ENV

    in_process = trainer(images, tmp_path / "a", steps=2, warmup_steps=1).run()
    assert in_process["time_to_first_batch_s"] >= 0  # no launcher: from the loop's start
    launched = single_host_trainer(tmp_path / "b", SMALL | {"steps": 2, "warmup_steps": 1}, {"train": images},
                                   extra_environment={CONTAINER_STARTED_ENV: repr(time.time() - 100)}).run()
    assert launched["time_to_first_batch_s"] >= 100


def test_a_checkpoint_on_a_full_disk_fails_naming_it_and_leaves_no_partial_file(images: Path, tmp_path: Path) -> None:
    """ENOSPC from the kernel itself: the checkpoint's temporary file is /dev/full."""
    run = trainer(images, tmp_path, steps=6, warmup_steps=1, checkpoint_every=3)
    run.paths.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    partial = run.checkpoint_path.with_name(run.checkpoint_name + ".partial")
    partial.symlink_to("/dev/full")
    with pytest.raises(CheckpointWriteError, match=r"disk full writing the checkpoint of step 3 .*volume_size_gb"):
        run.run()
    assert not partial.exists() and not partial.is_symlink() and not run.checkpoint_path.exists()


def test_a_serializers_own_write_error_is_named_disk_full_only_when_the_volume_is() -> None:
    from training.trainers.loop import write_failure_of

    torch_error = RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file data.pkl")
    assert "disk full" in str(write_failure_of("checkpoint of step 3", Path("/c/x.partial"), torch_error, free_bytes=4096))
    elsewhere = str(write_failure_of("checkpoint of step 3", Path("/c/x.partial"), torch_error, free_bytes=50 << 30))
    assert "disk full" not in elsewhere and "51200 MiB free on its volume" in elsewhere and "PytorchStreamWriter" in elsewhere
    denied = str(write_failure_of("model", Path("/m"), PermissionError(13, "Permission denied")))
    assert denied == "could not write the model (/m): PermissionError: Permission denied"


def test_metric_definitions_capture_timed_steps_only() -> None:
    timed = metric_line(12, 100, {"loss": 0.5, "step_time_ms": 86.1, "data_wait_ms": 40.0, "samples_per_s": 2977.0})
    warm = metric_line(2, 100, {"loss": 2.3, "warmup_ms": 900.0})
    assert parse_metric_line(timed) == {"loss": 0.5, "step_time_ms": 86.1, "data_wait_ms": 40.0, "samples_per_s": 2977.0}
    assert parse_metric_line(warm) == {"loss": 2.3, "warmup_ms": 900.0}
    assert set(METRIC_DEFINITIONS) >= {"step_time_ms", "samples_per_s"}


def test_summarize_reports_percentiles() -> None:
    assert summarize([]) is None
    assert summarize([float(value) for value in range(1, 11)]) == {"p50": 5.5, "p90": 10.0, "mean": 5.5}


def _declared(config: type) -> dict[str, object]:
    return {item.name: item.default for item in fields(config) if item.default is not MISSING}


@pytest.mark.parametrize("variant", ["pytorch", "neuron"])
def test_the_lambda_side_settings_of_a_builtin_are_the_loops_and_its_modules(variant: str) -> None:
    """The spec validation (no torch) checks a built-in's hyperparameters against VisionConfig/TextConfig:
    exactly the loop's settings (with the module's LOOP_DEFAULTS) and the module's HYPERPARAMETERS, so
    that what the Lambda accepts is what the hosts accept, with the same defaults."""
    from training.workload.contract import load_workload

    config = VARIANTS[variant].config
    workload = load_workload(BUILTIN_WORKLOADS_DIR, VARIANTS[variant].workloads[0])
    assert config in (VisionConfig, TextConfig)
    assert _declared(config) == _declared(WorkloadConfig) | dict(workload.loop_defaults) | dict(workload.hyperparameters)


def test_a_data_host_serves_tar_shards_in_their_streaming_order(image_shards: Path) -> None:
    """The listing a data host serves keeps the shards' layout (training/workload/serving.host_listing), so
    its epochs stream shard by shard as the homogeneous loader's do, and its labels are class indices."""
    from training.data_service.server import sample_order
    from training.workload.contract import load_workload, resolve_hyperparameters
    from training.workload.serving import host_listing

    vision = load_workload(BUILTIN_WORKLOADS_DIR, "vision")
    listing = host_listing(vision, "train", image_shards, resolve_hyperparameters(vision, {}), {"train": image_shards})
    assert listing.shard_ends == (16, 32, 48, 64, 80, 96) and listing.layout == "tar shards"
    first_epoch = list(itertools.islice(sample_order(len(listing), 5, 0, shard_ends=listing.shard_ends), 96))
    from training.data_service.dataset import shard_stream_order

    assert first_epoch == shard_stream_order(listing.shard_ends, np.random.default_rng([5, 0]))
