"""training/trainers/loop.py's progress marks: what the launcher's stall rule sees in the phases that run
no training step (evaluation, checkpoints, the model's save), with a loop whose hooks are plain Python."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from training.host_environment import OutputPaths
from training.trainer_watch import Progress, observe, parse_mark, trainer_stalled
from training.trainers.config import LoopConfig
from training.trainers.loop import TrainingLoop


class RecordingLoop(TrainingLoop[int]):
    """Trains on nothing; records its progress mark as each phase begins, and evaluates (three batches,
    one mark each) after every second step."""

    def __init__(self, config: LoopConfig, paths: OutputPaths, mark: Path) -> None:
        super().__init__(config, paths)
        self.mark, self.seen = mark, []

    def _saw(self, phase: str) -> None:
        self.seen.append((phase, self.mark.read_text()))

    def batches(self) -> Iterator[int]:
        yield from range(self.config.steps)

    def train_step(self, batch: int) -> float:
        return 0.0

    def save_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        self._saw("save_checkpoint")
        path.write_text(json.dumps(state))

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return json.loads(path.read_text())

    def save_model(self, model_dir: Path) -> None:
        self._saw("save_model")
        (model_dir / "model.txt").write_text("trained")

    def after_step(self, step: int) -> None:
        if step % 2 == 0:
            for _ in range(3):  # an evaluation: one mark per batch
                self.mark_progress("evaluate")
                self._saw("evaluate")

    def summary_extra(self) -> dict[str, Any]:
        self._saw("summary_extra")
        return {}


def test_every_phase_without_a_step_writes_marks_the_stall_rule_counts(tmp_path: Path) -> None:
    progress_dir = tmp_path / "progress"
    progress_dir.mkdir()
    loop = RecordingLoop(LoopConfig(steps=4, warmup_steps=0, checkpoint_every=2), OutputPaths.under(tmp_path, progress_dir), progress_dir / "rank-0")
    loop.run()
    phases = [(phase, text.split()[0]) for phase, text in loop.seen]
    assert phases == [
        ("evaluate", "evaluate"), ("evaluate", "evaluate"), ("evaluate", "evaluate"),  # after step 2
        ("save_checkpoint", "checkpoint"),  # the periodic one, step 2
        ("evaluate", "evaluate"), ("evaluate", "evaluate"), ("evaluate", "evaluate"),  # after step 4
        ("save_checkpoint", "checkpoint"),  # the final one
        ("summary_extra", "summary"),
        ("save_model", "save-model"),
    ]
    texts = [text for _, text in loop.seen]
    assert len(set(texts)) == len(texts)  # every mark differs from the one before it: each is news
    assert [parse_mark(text) for text in texts[:4]] == [(2, False)] * 4  # the step a phase mark reports is the last one trained
    assert (progress_dir / "rank-0").read_text() == "done 4"
    # The launcher's rule: an evaluation that marks each batch is progress however long it runs in all.
    progress = Progress(since=0.0, seen_at=0.0, marks={"rank-0": (1, "2")}, step=2)
    for second, text in enumerate(texts[:3], start=1):
        progress = observe(progress, {"rank-0": (1, text)}, now=second * 4.0)
        assert trainer_stalled(progress, second * 4.0 + 4.5, host="algo-1", bound_s=5, first_step_bound_s=60) is None
    assert (progress.since, progress.step) == (12.0, 2)
    assert trainer_stalled(progress, 17.5, host="algo-1", bound_s=5, first_step_bound_s=60).startswith("TrainerStalled")


def test_outside_a_launcher_no_mark_is_written(tmp_path: Path) -> None:
    loop = RecordingLoop(LoopConfig(steps=2, warmup_steps=0), OutputPaths.under(tmp_path), tmp_path / "rank-0")
    loop.mark_progress("evaluate")
    assert not (tmp_path / "rank-0").exists()


class StallingLoop(RecordingLoop):
    """Steps of ~5 ms, and a 60 ms evaluation after every fifth: a median step that leaves the stalls out."""

    def _saw(self, phase: str) -> None:
        pass

    def train_step(self, batch: int) -> float:
        time.sleep(0.005)
        return 0.0

    def after_step(self, step: int) -> None:
        if step % 5 == 0:
            time.sleep(0.06)


def test_the_wall_time_per_step_holds_the_evaluations_the_step_times_leave_out(tmp_path: Path) -> None:
    summary = StallingLoop(LoopConfig(steps=21, warmup_steps=1), OutputPaths.under(tmp_path), tmp_path / "mark").run()
    stats, wall = summary["step_time_ms"], summary["wall_ms_per_step"]
    # 20 timed steps (2..21) with the evaluations after steps 5, 10, 15 and 20 between them: 4 × 60 ms.
    assert stats["p50"] < 30 and wall >= stats["mean"] + 4 * 60 / 20 * 0.9, (stats, wall)
    assert summary["timed_steps"] == 20


class DivergingLoop(RecordingLoop):
    """A loss that turns NaN after step 5 (a trainer of any framework: the loop reads it as a float)."""

    def _saw(self, phase: str) -> None:
        pass

    def train_step(self, batch: int) -> float:
        return float("nan") if batch >= 5 else 1.0 / (batch + 1)


@pytest.mark.parametrize("log_every", [1, 100])
def test_a_loss_that_turns_nan_fails_the_run_naming_the_step_with_only_healthy_checkpoints(tmp_path: Path, log_every: int,
                                                                                             capsys: pytest.CaptureFixture) -> None:
    """Caught when it is printed, and in any case before a checkpoint or the model would keep it (the
    TensorFlow trainer reads its loss only then): the last checkpoint is the healthy step 4's."""
    from training.trainers.loop import NonFiniteLossError

    paths = OutputPaths.under(tmp_path)
    loop = DivergingLoop(LoopConfig(steps=12, warmup_steps=1, checkpoint_every=4, log_every=log_every), paths, tmp_path / "mark")
    step = 6 if log_every == 1 else 8  # printed at once, or found at the next checkpoint
    with pytest.raises(NonFiniteLossError, match=rf"the loss is nan at step {step}"):
        loop.run()
    assert json.loads(loop.checkpoint_path.read_text())["step"] == 4
    assert not (paths.model_dir / "model.txt").exists()
    assert ("step=6/12 loss=nan" in capsys.readouterr().out) == (log_every == 1)  # the log shows the diverged step
