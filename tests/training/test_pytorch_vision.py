"""The shared loop and the PyTorch vision trainer, in-process on the CPU: learning, metric lines,
outputs, checkpoint resume, undecodable files."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from training.data_service.dataset import scan_images
from training.metrics import METRIC_DEFINITIONS, metric_line, parse_metric_line
from training.trainers.config import VisionConfig
from training.trainers.loop import CheckpointWriteError, OutputPaths, summarize
from training.trainers.precision import resolve_precision
from training.trainers.pytorch_vision import VisionTrainer, build_model, local_loader

SMALL = dict(model="cnn", cnn_width=8, image_size=32, batch_size=16, learning_rate=0.05, dataloader_workers=1)


def trainer(images: Path, base: Path, **overrides) -> VisionTrainer:
    folder = scan_images(images, "train", "homogeneousCluster")
    config = VisionConfig(**(SMALL | overrides))
    return VisionTrainer(config, OutputPaths.under(base), classes=list(folder.classes), source="local", local_folder=folder)


def metric_lines(text: str) -> list[dict[str, float]]:
    return [parse_metric_line(line) for line in text.splitlines() if line.startswith("step=")]


def test_training_learns_and_logs_one_metric_line_per_step(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    summary = trainer(images, tmp_path, steps=40, warmup_steps=3).run()
    lines = metric_lines(capsys.readouterr().out)
    assert len(lines) == 40
    assert [("warmup_ms" in line, "step_time_ms" in line) for line in lines[:3]] == [(True, False)] * 3
    assert all("step_time_ms" in line and "data_wait_ms" in line and "warmup_ms" not in line for line in lines[3:])
    losses = [line["loss"] for line in lines]
    assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8, losses
    assert summary["timed_steps"] == 37 and summary["warmup_steps"] == 3
    step_times = sorted(line["step_time_ms"] for line in lines[3:])
    assert summary["step_time_ms"]["p50"] == pytest.approx(step_times[len(step_times) // 2], rel=0.05)
    assert summary["data_source"] == "local" and summary["skipped_samples"] == 0


def test_outputs_land_in_the_sagemaker_folders(images: Path, tmp_path: Path) -> None:
    trainer(images, tmp_path, steps=4, warmup_steps=1, seed=3).run()
    summary = json.loads((tmp_path / "output" / "data" / "summary.json").read_text())
    config = json.loads((tmp_path / "output" / "data" / "config.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert config["seed"] == 3 and config["model"] == "cnn" and config["world_size"] == 1
    assert json.loads((tmp_path / "model" / "config.json").read_text()) == config
    model = build_model(VisionConfig(**SMALL), num_classes=4)
    model.load_state_dict(torch.load(tmp_path / "model" / "model.pt", weights_only=True))
    assert (tmp_path / "model" / "classes.txt").read_text().split() == ["class_00", "class_01", "class_02", "class_03"]
    assert (tmp_path / "checkpoints" / "checkpoint.pt").exists()


def test_a_second_run_resumes_from_the_checkpoint(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    first = trainer(images, tmp_path, steps=6, warmup_steps=1, checkpoint_every=3)
    first.run()
    weights = {name: value.clone() for name, value in first.module.state_dict().items()}
    capsys.readouterr()
    resumed = trainer(images, tmp_path, steps=10, warmup_steps=1)
    assert resumed.load_checkpoint(resumed.checkpoint_path)["step"] == 6
    assert resumed.lr_scheduler.last_epoch == 6
    assert all(torch.equal(weights[name], value) for name, value in resumed.module.state_dict().items())
    summary = resumed.run()
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step=")]
    assert summary["start_step"] == 6 and summary["timed_steps"] == 3
    assert steps[0].startswith("step=7/10") and steps[-1].startswith("step=10/10")
    assert resumed.resume_samples == 6 * 16  # its loader read on from there (test_sampling: where that is)


class Probe(torch.utils.data.Dataset):
    """What a DataLoader worker is: its process and the seed its augmentations draw from."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        import os

        return index, os.getpid(), torch.utils.data.get_worker_info().seed


def _probe(rank: int, start: int = 0, batches: int = 6) -> list[tuple[int, int, int]]:
    loader = local_loader(Probe(), batch_size=2, rank=rank, world_size=2, seed=0, start=start, workers=2, pin_memory=False,
                          collate_fn=lambda items: items)
    return [item for batch in itertools.islice(loader, batches) for item in batch]


def test_each_rank_draws_its_own_augmentations_and_workers_never_restart() -> None:
    rank_0, rank_1, resumed = _probe(0), _probe(1), _probe(0, start=4)
    seeds = lambda items: {seed for _, _, seed in items}  # noqa: E731
    assert len(seeds(rank_0)) == 2 and not seeds(rank_0) & seeds(rank_1)  # worker k of each rank: different crops
    assert not seeds(rank_0) & seeds(resumed)  # a resumed run does not replay the first run's crops either
    # Six batches are three epochs of a 4-sample shard: the same two worker processes all along.
    assert len({pid for _, pid, _ in rank_0}) == 2
    first_epochs = [index for index, _, _ in rank_0[:4] + rank_1[:4]]
    assert sorted(first_epochs) == list(range(8))  # the two ranks' halves of an epoch: the whole set, once


def test_precision_follows_the_device() -> None:
    assert resolve_precision("auto", gpu=True, capability=(9, 0)) == "bf16"  # H100/H200
    assert resolve_precision("auto", gpu=True, capability=(8, 0)) == "bf16"  # A100 (ml.p4d)
    assert resolve_precision("auto", gpu=True, capability=(7, 0)) == "fp16"  # V100 (ml.p3): no bf16, loss scaling instead
    assert resolve_precision("fp32", gpu=True, capability=(9, 0)) == "fp32"
    assert resolve_precision("auto", gpu=False) == "fp32"
    assert resolve_precision("bf16", gpu=False) == "bf16"  # forced: kept (slow on a CPU, but how tests run it)
    run = VisionTrainer(VisionConfig(**SMALL), OutputPaths.under(Path("/nonexistent")), classes=["a", "b"], source="local")
    assert run.precision == "fp32" and not run.scaler.is_enabled()  # this machine has no GPU


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_train(images: Path, tmp_path: Path, precision: str) -> None:
    run = trainer(images, tmp_path, steps=6, warmup_steps=1, precision=precision)
    summary = run.run()
    assert summary["precision"] == precision and summary["final_loss"] is not None
    assert run.scaler.is_enabled() == (precision == "fp16")  # fp16 scales its loss; bf16 has fp32's range
    assert all(parameter.dtype == torch.float32 for parameter in run.module.parameters())  # fp32 master weights


def test_the_rate_warms_up_to_the_per_worker_rate(images: Path, tmp_path: Path) -> None:
    run = trainer(images, tmp_path, steps=20, warmup_steps=1, lr_warmup_fraction=0.2, learning_rate=0.1)
    rates = []
    batches = run.batches()
    for _ in range(6):
        rates.append(run.optimizer.param_groups[0]["lr"])
        run.train_step(next(batches))
    assert rates == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])  # one worker: the configured rate
    assert run.schedule.at(10) == pytest.approx(0.1)
    assert replace(run.schedule, workers=8).at(10) == pytest.approx(0.8)  # eight: eight times the rate


def test_undecodable_files_are_skipped_and_counted(images: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(images, tmp_path / "images")
    for path in sorted(copy.glob("class_02/*.jpg"))[:5]:
        path.write_bytes(b"not an image")
    summary = trainer(copy, tmp_path / "run", steps=12, warmup_steps=1, dataloader_workers=0).run()
    assert summary["status"] == "completed"
    assert 0 < summary["skipped_samples"] <= 5 * 2  # each broken file is met at most twice in 12 × 16 draws of 96


def test_cached_input_times_the_model_alone(images: Path, tmp_path: Path) -> None:
    run = trainer(images, tmp_path, steps=9, warmup_steps=1, cached_input_batches=3)
    seen = []
    for batch in run.batches():
        seen.append(batch.images)
        if len(seen) == 7:
            break
    assert all(seen[index] is seen[index % 3] for index in range(7))  # three real batches, cycled
    summary = run.run()
    assert summary["cached_input_batches"] == 3 and summary["data_wait_ms"]["p90"] < 5


def test_metric_definitions_capture_timed_steps_only() -> None:
    timed = metric_line(12, 100, {"loss": 0.5, "step_time_ms": 86.1, "data_wait_ms": 40.0, "samples_per_s": 2977.0})
    warm = metric_line(2, 100, {"loss": 2.3, "warmup_ms": 900.0})
    assert parse_metric_line(timed) == {"loss": 0.5, "step_time_ms": 86.1, "data_wait_ms": 40.0, "samples_per_s": 2977.0}
    assert parse_metric_line(warm) == {"loss": 2.3, "warmup_ms": 900.0}
    assert set(METRIC_DEFINITIONS) >= {"step_time_ms", "samples_per_s"}


def test_summarize_reports_percentiles() -> None:
    assert summarize([]) is None
    assert summarize([float(value) for value in range(1, 11)]) == {"p50": 5.5, "p90": 10.0, "mean": 5.5}


def test_time_to_first_batch_counts_from_the_containers_start(images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from training.trainers.loop import CONTAINER_STARTED_ENV

    in_process = trainer(images, tmp_path / "a", steps=2, warmup_steps=1).run()
    assert in_process["time_to_first_batch_s"] >= 0  # no launcher: from the loop's start
    monkeypatch.setenv(CONTAINER_STARTED_ENV, repr(time.time() - 100))
    launched = trainer(images, tmp_path / "b", steps=2, warmup_steps=1).run()
    assert launched["time_to_first_batch_s"] >= 100


def test_a_checkpoint_on_a_full_disk_fails_naming_it_and_leaves_no_partial_file(images: Path, tmp_path: Path) -> None:
    """ENOSPC from the kernel itself: the checkpoint's temporary file is /dev/full."""
    run = trainer(images, tmp_path, steps=6, warmup_steps=1, checkpoint_every=3)
    run.paths.checkpoint_dir.mkdir(parents=True)
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
