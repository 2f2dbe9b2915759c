"""The loop every trainer shares: timing, metric lines, checkpoints with resume, the summary and outputs.

A variant (PyTorch vision here; TensorFlow and XLA later) subclasses TrainingLoop and fills in the hooks:
where batches come from, one optimizer step, and how its state is saved. The loop owns everything that
must look the same across variants:

* step time = wall time from the end of one step to the end of the next, data wait included (an input-
  bound job is slow because of that wait); the first ``warmup_steps`` of each run are left out; its
  p50/p90/mean describe the steps, and ``wall_ms_per_step`` (the timed steps' whole wall time, with the
  evaluations, checkpoints and stalls between them, per step) is what a step costs;
* time to first batch = from the container's start (the launcher's stamp in
  ``TRAINING_CONTAINER_STARTED_AT``) to the moment the last rank had its first batch: imports, the data
  hosts' listing and start, connecting, a FastFile channel's first reads (a File channel's copy happens
  before the container starts: results.py adds it from the job's status transitions);
* metric lines (training/metrics.py) from the chief process only, with every rank's figures in them:
  the data wait is the longest any rank waited for that step (``reduce_max``), since one rank starved of
  batches holds every rank up in the next collective; the summary's counts are summed over ranks;
* checkpoints in ``/opt/ml/checkpoints`` (synced to S3 by SageMaker's CheckpointConfig), written to a
  temporary name then renamed, and resumed from at start: the step, the data position (samples each rank
  has consumed, so a resumed run skips them instead of replaying its first batches; with data hosts, the
  positions of their streams that every rank trained: ``input_state``, training/data_service/positions.py)
  and every rank's random-number state travel with the model and optimizer; every rank settles its device
  work (an XLA step's pending collectives) before the chief saves;
* the loss is read from the device only on the steps that print it (``loss_value``): on XLA, reading it
  inside the step would execute a second graph;
* SIGTERM (StopTrainingJob, a spot interruption: SageMaker waits 120 s before SIGKILL) ends training at
  the end of the step in which any rank received it (the ranks vote after every step): a checkpoint, the
  model and a summary with status ``stopped`` are written, and TrainingStopped says after which step;
* the model in ``/opt/ml/model``, and ``summary.json`` plus the resolved ``config.json`` in
  ``/opt/ml/output/data`` (and the config beside the model);
* a progress mark per process (a file in the folder the launcher names in ``TRAINING_PROGRESS_DIR``,
  rewritten with the step's number after every step, with ``<phase> <count> <step>`` during the long
  phases that run no step (``mark_progress``: each evaluation batch, the start and end of a checkpoint
  write, of the summary, of the model's save), and with ``done <step>`` once every rank passed the final
  barrier): how the launcher tells a stalled or frozen rank, or a job whose batches stopped coming, from
  a slow one, and a finished run whose processes do not exit from one still working.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import logging
import math
import os
import random
import signal
import statistics
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from training.failure import write_failure
from training.host_environment import OutputPaths
from training.hyperparameters import config_to_dict
from training.metrics import metric_line
from training.trainers.config import LoopConfig

log = logging.getLogger(__name__)

BatchT = TypeVar("BatchT")


# Every trainer process writes its step into a file of the launcher's progress folder (OutputPaths'
# progress_dir) after each step, and DONE_MARK and the step once the run finished and was saved
# (training/trainer_watch.py reads them).
DONE_MARK = "done"


class DataExhaustedError(RuntimeError):
    """The input ended before the configured number of steps."""


class NonFiniteLossError(ValueError):
    """The loss became NaN or infinite: the run fails, naming the step, and saves no model."""


def check_finite(value: float, step: int) -> float:
    """``value``, or NonFiniteLossError naming the step. Pure."""
    if not math.isfinite(value):
        raise NonFiniteLossError(f"the loss is {value} at step {step}: training diverged (lower the learning rate, clip the gradients "
                                 "with grad_clip_norm, or check the inputs); no model is saved")
    return value


class CheckpointWriteError(RuntimeError):
    """A checkpoint, the model or the summary could not be written (a full disk, most often): the run fails
    with that reason, and no half-written checkpoint is left for a resumed run to read."""


def write_failure_of(what: str, path: Path, error: OSError | RuntimeError, free_bytes: int | None = None) -> CheckpointWriteError:
    """The error for ``what`` not written to ``path``, naming a full disk as such: an ENOSPC, or a
    serializer's own write error (torch's PytorchStreamWriter raises RuntimeError) with no room left on the
    volume. Pure: ``free_bytes`` is the volume's, read by the caller."""
    full = (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)) or (free_bytes is not None and free_bytes < 1 << 20)
    detail = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    if full:
        return CheckpointWriteError(f"disk full writing the {what} ({path}): {detail}; raise the job's volume_size_gb "
                                    "or keep fewer or smaller files there")
    room = f" ({free_bytes >> 20} MiB free on its volume)" if free_bytes is not None else ""
    return CheckpointWriteError(f"could not write the {what} ({path}){room}: {type(error).__name__}: {detail}")


def free_bytes_at(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the volume of ``path``'s folder (None: unknown)."""
    try:
        stats = os.statvfs(path.parent)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


class TrainingStopped(RuntimeError):
    """SIGTERM asked training to stop; it did at a step boundary, with its state saved."""

    exit_code = 128 + signal.SIGTERM


def leave_stopped(stopped: TrainingStopped) -> int:
    """What a trainer's main does with TrainingStopped: the reason for SageMaker, and 128 + SIGTERM."""
    log.warning("%s", stopped)
    write_failure(f"{type(stopped).__name__}: {stopped}")
    return TrainingStopped.exit_code


class StopRequest:
    """Remembers a SIGTERM for the loop to act on at the next agreed step boundary, while in use as a
    context manager (signal handlers belong to the main thread; elsewhere it never fires)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: Any = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *_: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal = signal.Signals(signum).name


def elementwise_max(series: list[list[float]]) -> list[float]:
    """Per-step maximum over ranks of equally long per-rank series. Pure."""
    return [max(values) for values in zip(*series, strict=True)] if series else []


def summarize(values_ms: list[float]) -> dict[str, float] | None:
    if not values_ms:
        return None
    ordered = sorted(values_ms)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
        "mean": round(statistics.fmean(ordered), 3),
    }


# How a run draws its epochs' orders, written into each checkpoint: 2 since the data hosts and the
# homogeneous samplers draw one order (dataset.channel_epoch_order); a checkpoint without it, the earlier one.
ORDER_VERSION = 2


class TrainingLoop(ABC, Generic[BatchT]):
    checkpoint_name = "checkpoint"

    def __init__(self, config: LoopConfig, paths: OutputPaths, *, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.paths = paths
        self.rank = rank
        self.world_size = world_size
        # False for a run whose figures mean nothing (Neuron's graph extraction): no metric lines then.
        self.report_metrics = True
        # Samples this rank consumed in earlier runs of the job (from the checkpoint): where ``batches``
        # starts, so that a resumed run does not replay what was already trained on.
        self.resume_samples = 0
        # Resumed from a checkpoint whose run drew its epochs in the earlier order (sampling.epoch_order).
        self.legacy_order = False
        self.stopping = False  # set once a stop vote ended training, before the summary: a variant may skip work
        self._marked_step = 0  # the last step this process's mark reported
        self._phase_marks = 0  # phase marks written: each one's text differs from the last
        # The container's start (its door's TrainerEnvironment.container_started_at): time to first batch
        # counts from it; None outside a launcher (a trainer run in-process), from the loop's own start.
        self.container_started_at: float | None = None

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    # Hooks ---------------------------------------------------------------------------------------

    @abstractmethod
    def batches(self) -> Iterator[BatchT]:
        """The training input, one batch per step."""

    @abstractmethod
    def train_step(self, batch: BatchT) -> Any:
        """One optimizer step, finished on the device when it returns (the step time is the wall time);
        returns the loss in whatever form is cheapest (``loss_value`` reads it when it is printed)."""

    def loss_value(self, loss: Any) -> float:
        """The loss ``train_step`` returned, as a Python float; called only on the steps that log it."""
        return float(loss)

    def logged_metrics(self, loss: Any) -> dict[str, float]:
        """Further values for the metric line of a step that logs (a user workload's own), from what
        ``train_step`` returned."""
        return {}

    @abstractmethod
    def save_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        """Write the model and optimizer, and the loop's ``state`` (JSON-able: step, data position and
        every rank's RNG state) with them, to ``path`` (chief only)."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore the model and optimizer from ``path`` on every process; return the loop's state."""

    def settle(self) -> None:
        """Wait until this process's device work is done (pending graphs and their collectives); every
        rank calls it before the chief saves a checkpoint."""

    def rng_state(self) -> dict[str, Any]:
        """This process's random-number state, JSON-able; variants add their framework's generators."""
        kind, keys, position, has_gauss, gauss = np.random.get_state()
        return {"python": _encode(random.getstate()), "numpy": [kind, keys.tolist(), position, has_gauss, gauss]}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        random.setstate(_decode(state["python"]))
        kind, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, gauss))

    @abstractmethod
    def save_model(self, model_dir: Path) -> None:
        """Write the trained model (chief only)."""

    def after_step(self, step: int) -> None:
        """Runs on every process after each step (periodic evaluation, for instance)."""

    def barrier(self) -> None:
        """Wait for every process of the job; a no-op for a single process."""

    def reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of ``values`` over every process (a collective: every rank calls it at the
        same steps); a single process returns its own."""
        return values

    def gather(self, value: Any) -> list[Any]:
        """Every process's ``value``, in rank order (a collective); a single process gets its own."""
        return [value]

    def gather_to_chief(self, value: Any) -> list[Any] | None:
        """Every process's ``value``, in rank order, on the chief; None on the others (a collective)."""
        gathered = self.gather(value)
        return gathered if self.is_chief else None

    def summary_extra(self) -> dict[str, Any]:
        """The variant's part of the summary; runs on every process, so it may gather across them."""
        return {}

    def input_state(self) -> Any:
        """This process's account of its input since the last checkpoint (JSON-able; gathered to the chief
        at each checkpoint): what it trained, for a resumed run to start where this one stopped."""
        return None

    def checkpoint_input(self, ranks: list[Any]) -> Any:
        """The chief's: the checkpoint's record of the input (JSON-able), from every rank's input_state;
        None: the checkpoint holds none."""
        return None

    def restore_input(self, saved: Any) -> None:
        """Every process, on resuming: the checkpoint's record of the input (None when it holds none),
        before ``batches`` is first iterated."""

    def mark_progress(self, phase: str) -> None:
        """Tell the launcher that this process works on in a phase that runs no training step (call it per
        evaluation batch, for instance): its stall rule counts any change of the mark as progress, and a
        phase that writes none for ``trainer_stall_timeout_s`` is taken for a frozen rank. Cheap (one small
        file write); a no-op outside a launcher."""
        self._phase_marks += 1
        self._write_mark(f"{phase} {self._phase_marks} {self._marked_step}")

    def _write_mark(self, text: str) -> None:
        if self.paths.progress_dir is not None:
            (self.paths.progress_dir / f"rank-{self.rank}").write_text(text)

    # The loop ------------------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return self.paths.checkpoint_dir / self.checkpoint_name

    def run(self) -> dict[str, Any]:
        with StopRequest() as stop:
            return self._run(stop)

    def _run(self, stop: StopRequest) -> dict[str, Any]:
        config = self.config
        started = time.perf_counter()
        container_started = self.container_started_at or time.time()
        first_batch_s = float("nan")
        start_step = self._restore()
        self._marked_step = start_step
        if self.is_chief:
            self._write_config()
        step_ms: list[float] = []
        wait_ms: list[float] = []
        warmup_ms: list[float] = []
        loss: Any = float("nan")
        self._steps_this_run = 0
        batches = iter(self.batches())
        last = time.perf_counter()
        step = start_step
        stopped = False
        # The wall time the timed steps took together, from the first one's start to the last one's end:
        # with the evaluations, checkpoints and stalls between them, which step times leave out and the
        # job is billed for (the cost per step is computed from it: lambdas/core/results.py).
        timed_from = timed_to = None
        for step in range(start_step + 1, config.steps + 1):
            try:
                batch = next(batches)
            except StopIteration:
                raise DataExhaustedError(f"the input ended after step {step - 1} of {config.steps}") from None
            fetched = time.perf_counter()
            if step == start_step + 1:
                first_batch_s = time.time() - container_started
            loss = self.train_step(batch)
            self._steps_this_run = step - start_step
            now = time.perf_counter()
            self._marked_step = step
            self._write_mark(str(step))
            elapsed, waited = (now - last) * 1000, (fetched - last) * 1000
            timed = step - start_step > config.warmup_steps
            (step_ms if timed else warmup_ms).append(elapsed)
            if timed:
                wait_ms.append(waited)
                timed_from, timed_to = last if timed_from is None else timed_from, now
            # Every rank reaches this line at every step: the one collective of the loop's own, two host
            # floats. All ranks stop after the same step (a rank that stopped alone would leave the others
            # waiting in the next gradient all-reduce), and as soon as any of them was told to.
            longest_wait, stop_votes = self.reduce_max([waited, 1.0 if stop.signal else 0.0])
            stopped = stop_votes > 0 and step < config.steps  # a finished run is finished, not stopped
            if self.is_chief and self.report_metrics and (step % config.log_every == 0 or step == config.steps):
                values = {"loss": self.loss_value(loss)} | self.logged_metrics(loss)
                if timed:
                    values |= {
                        "step_time_ms": elapsed,
                        "data_wait_ms": longest_wait,
                        "samples_per_s": config.batch_size * self.world_size * 1000 / elapsed,
                    }
                else:
                    values["warmup_ms"] = elapsed
                print(metric_line(step, config.steps, values), flush=True)
                check_finite(values["loss"], step)  # its line printed first: the log shows the nan
            if stopped:
                break
            self.after_step(step)
            if config.checkpoint_every and step % config.checkpoint_every == 0 and step < config.steps:
                check_finite(self.loss_value(loss), step)  # on every rank: no checkpoint of diverged weights
                self._checkpoint(step)
            last = time.perf_counter()  # evaluation and checkpoints are not the next step's time
        self.stopping = stopped
        loss = self.loss_value(loss)
        if self._steps_this_run:  # before the last checkpoint and the model (a run with no step left has no loss)
            check_finite(loss, step)
        self._checkpoint(step)
        self.barrier()
        # One collective for both: every rank's waits and its first batch.
        ranks = self.gather((wait_ms, first_batch_s))
        # The longest wait of any rank, per step (equal lengths: every rank timed the same steps).
        wait_ms = elementwise_max([waits for waits, _ in ranks])
        # Training starts when the last rank has its first batch (a rank that trained no step has none).
        first_batches = [first for _, first in ranks if first == first]
        self.mark_progress("summary")  # the variant's part may evaluate (which marks each batch) or gather
        summary = self._summary(start_step, step_ms, wait_ms, warmup_ms, loss, time.perf_counter() - started)
        summary["wall_ms_per_step"] = round((timed_to - timed_from) * 1000 / len(step_ms), 3) if step_ms else None
        summary["time_to_first_batch_s"] = round(max(first_batches), 3) if first_batches else None
        # The instants too (wall clock, NTP-synced on SageMaker): results.py counts from the job's billing start.
        summary["container_started_at"] = round(container_started, 3)
        summary["first_batch_at"] = round(container_started + max(first_batches), 3) if first_batches else None
        if stopped:
            summary |= {"status": "stopped", "stopped_after_step": step}
        if self.is_chief:
            self.mark_progress("save-model")
            try:
                self.paths.model_dir.mkdir(parents=True, exist_ok=True)
                self.save_model(self.paths.model_dir)
            except OSError as error:
                raise write_failure_of("model", self.paths.model_dir, error, free_bytes_at(self.paths.model_dir / "model")) from None
            self.mark_progress("saved-model")
            try:
                _write_json(self.paths.output_data_dir / "summary.json", summary)
            except OSError as error:
                summary_path = self.paths.output_data_dir / "summary.json"
                raise write_failure_of("summary", summary_path, error, free_bytes_at(summary_path)) from None
        # No rank leaves before the chief saved: torchrun would take an early exit (143 on a stop) for a
        # failure and close the chief within its 30 s.
        self.barrier()
        if not stopped:
            # Past the final barrier: the chief saved the model and the summary, so the run's work is done
            # whatever happens to these processes now (the launcher ends them if they do not exit).
            self._write_mark(f"{DONE_MARK} {step}")
        if stopped:
            raise TrainingStopped(f"stopped by SIGTERM after step {step} of {config.steps}; checkpoint and model saved")
        return summary

    def _restore(self) -> int:
        if not self.checkpoint_path.exists():
            return 0
        state = self.load_checkpoint(self.checkpoint_path)
        step = int(state["step"])
        self.resume_samples = int(state.get("samples_per_rank", step * self.config.batch_size))
        # A checkpoint of an earlier release drew its epochs' orders otherwise: the run goes on with that order.
        self.legacy_order = int(state.get("order", 1)) < ORDER_VERSION
        self.restore_input(state.get("input"))
        rng = state.get("rng") or []
        if len(rng) == self.world_size:
            self.set_rng_state(rng[self.rank])
        else:  # a different world size: fresh streams, still apart per rank and from the first run's
            self.set_rng_state(self._fresh_rng(step))
        log.info("resumed from %s after step %d (%d samples per rank consumed)", self.checkpoint_path, step, self.resume_samples)
        return min(step, self.config.steps)

    def _fresh_rng(self, step: int) -> dict[str, Any]:
        random.seed(f"{self.config.seed}/{self.rank}/{step}")
        np.random.seed([self.config.seed, self.rank, step])
        return self.rng_state()

    def _checkpoint(self, step: int) -> None:
        self.mark_progress("checkpoint")
        self.settle()  # every rank: no collective of the last step may still be pending while the chief saves
        ranks = self.gather_to_chief((self.rng_state(), self.input_state()))
        if self.is_chief:
            assert ranks is not None
            state = {"step": step, "samples_per_rank": self.resume_samples + self._steps_this_run * self.config.batch_size,
                     "rng": [rng for rng, _ in ranks], "order": 1 if self.legacy_order else ORDER_VERSION}
            recorded = self.checkpoint_input([input_state for _, input_state in ranks])
            if recorded is not None:
                state["input"] = recorded
            self.paths.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            partial = self.checkpoint_path.with_name(self.checkpoint_name + ".partial")
            try:
                self.save_checkpoint(partial, state)
                os.replace(partial, self.checkpoint_path)
            except (OSError, RuntimeError) as error:  # RuntimeError: torch's serializer reports a failed write so
                with contextlib.suppress(OSError):
                    partial.unlink(missing_ok=True)  # the space it took, and nothing half-written for a resume to find
                if isinstance(error, RuntimeError) and "writ" not in str(error):
                    raise  # not a write that failed: the error as it is
                raise write_failure_of(f"checkpoint of step {step}", partial, error, free_bytes_at(partial)) from None
            self.mark_progress("checkpointed")
        self.barrier()

    def _write_config(self) -> None:
        resolved = config_to_dict(self.config) | {"world_size": self.world_size}
        for directory in (self.paths.output_data_dir, self.paths.model_dir):
            _write_json(directory / "config.json", resolved)

    def _summary(
        self, start_step: int, step_ms: list[float], wait_ms: list[float], warmup_ms: list[float], loss: float, elapsed_s: float
    ) -> dict[str, Any]:
        step_stats = summarize(step_ms)
        return {
            "status": "completed",
            "steps": self.config.steps,
            "start_step": start_step,
            "timed_steps": len(step_ms),
            "warmup_steps": len(warmup_ms),
            "warmup_s": round(sum(warmup_ms) / 1000, 3),
            "step_time_ms": step_stats,
            "data_wait_ms": summarize(wait_ms),
            "samples_per_s": (
                round(self.config.batch_size * self.world_size * 1000 / step_stats["mean"], 2) if step_stats else None
            ),
            "final_loss": None if loss != loss else round(loss, 5),
            "batch_size": self.config.batch_size,
            "world_size": self.world_size,
            "elapsed_s": round(elapsed_s, 3),
        } | self.summary_extra()


def _encode(value: Any) -> Any:
    """Python's random state (nested tuples of ints) as JSON-able lists."""
    return [_encode(item) for item in value] if isinstance(value, (tuple, list)) else value


def _decode(value: Any) -> Any:
    return tuple(_decode(item) for item in value) if isinstance(value, list) else value


def encode_bytes(data: bytes) -> str:
    """Framework RNG states (byte tensors) as text a JSON-able checkpoint state can hold."""
    return base64.b64encode(data).decode("ascii")


def decode_bytes(text: str) -> bytes:
    return base64.b64decode(text)


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
