"""Faults injected into emulated clusters (tests/faults.py), one test per row of the README's fault table.

Each test prints the seconds from the fault to the outcome (pytest -s shows them); the README's table
quotes them. None asserts on speed beyond generous bounds that separate "noticed" from "waited out a
timeout".
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from lambdas.core.job_spec import validate_job_spec
from tests.faults import Faults, send, taken_port
from tests.training.local.test_cluster import spec, start
from training.local.cluster import EmulatedCluster, EmulationOptions, LineWatcher
from training.metrics import parse_metric_line


def failure_of(cluster: EmulatedCluster, host: str) -> str:
    path = cluster.host(host).base_dir / "output" / "failure"
    return path.read_text() if path.exists() else ""


def report(what: str, seconds: float) -> None:
    print(f"\n[fault] {what}: {seconds:.1f} s")


# A data host that hangs (SIGSTOP) ------------------------------------------------------------------------


def last_step(watcher: LineWatcher, host: str) -> int:
    steps = [int(match.group(1)) for line in watcher.of(host) if (match := re.match(r"step=(\d+)/", line))]
    return max(steps, default=0)


@pytest.mark.cluster
def test_a_hung_data_host_is_dropped_and_training_goes_on_with_the_others(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(spec(data_hosts=2, steps=1_000_000, log_every=10), tmp_path, images, data_batch_timeout_s=8)
    faults = Faults(cluster, watcher)
    try:
        stopped_at = faults.when("algo-3", r"^step=10/", lambda: faults.signal_host("algo-1", signal.SIGSTOP))
        watcher.wait_for("algo-3", r"data host .* lost", timeout=120)
        report("hung data host dropped", time.monotonic() - stopped_at)
        faults.signal_host("algo-1", signal.SIGCONT)
        lost_at_step = last_step(watcher, "algo-3")
        watcher.wait_for("algo-3", rf"^step={lost_at_step + 100}/", timeout=120)  # training goes on without it
        faults.signal_launcher("algo-3", signal.SIGTERM)  # end the endless run (saved, as any stop is)
        result = cluster.wait()
    finally:
        cluster.close()
    summary = cluster.summary()
    assert summary["status"] == "stopped" and summary["stopped_after_step"] > lost_at_step
    port = cluster.hyperparameters["data_service_port"]
    assert summary["lost_data_hosts"] == [f"{cluster.host('algo-1').address}:{port}"]
    # ... and why: its stall, not the "unreachable" of the reconnects after it
    assert "no batch for 8 s: the host is hung" in summary["lost_data_host_reasons"][f"{cluster.host('algo-1').address}:{port}"]
    assert result.outcome("algo-1").exit_code == 0 and result.outcome("algo-2").exit_code == 0  # both shut down
    assert result.orphans == []


@pytest.mark.cluster
def test_a_job_whose_only_data_host_hangs_fails_with_a_named_error(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(spec(data_hosts=1, steps=10_000), tmp_path, images, data_batch_timeout_s=8)
    faults = Faults(cluster, watcher)
    try:
        stopped_at = faults.when("algo-2", r"^step=3/", lambda: faults.signal_host("algo-1", signal.SIGSTOP))
        watcher.wait_for("algo-2", r"DataServiceUnavailableError", timeout=120)
        report("only data host hung → named error", time.monotonic() - stopped_at)
        faults.signal_host("algo-1", signal.SIGCONT)
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.outcome("algo-2").exit_code == 1
    assert failure_of(cluster, "algo-2").startswith("DataServiceUnavailableError: all 1 data hosts are gone")
    assert "no batch for 8 s: the host is hung" in failure_of(cluster, "algo-2")
    assert result.orphans == []


# A data host that cannot serve ---------------------------------------------------------------------------


def corrupt_channel(root: Path) -> Path:
    for label in range(2):
        folder = root / "corrupt" / f"class_{label}"
        folder.mkdir(parents=True)
        for index in range(8):
            (folder / f"{index}.jpg").write_bytes(b"not a jpeg at all" * 10)
    return root / "corrupt"


def empty_channel(root: Path) -> Path:
    (root / "empty" / "class_0").mkdir(parents=True)
    return root / "empty"


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("undecodable channel", "AllSkippedError: preprocess skipped the first 16 samples: the channel holds no usable sample"),
        ("empty channel", "EmptyChannelError"),
        ("taken port", "PortInUseError: cannot listen on"),
    ],
)
def test_a_data_host_that_cannot_serve_fails_the_job_at_once_with_its_reason(tmp_path: Path, images: Path, case: str, reason: str) -> None:
    channel = {"undecodable channel": corrupt_channel(tmp_path), "empty channel": empty_channel(tmp_path)}.get(case, images)
    watcher = LineWatcher()
    cluster = EmulatedCluster(
        validate_job_spec(spec(data_hosts=1, steps=20)),
        # A connect timeout far longer than the outcome may take: the DNN host must not wait it out.
        EmulationOptions(workdir=tmp_path / "run", channels={"train": channel}, data_connect_timeout_s=180),
        on_line=watcher,
    )
    cluster.prepare()
    data_host = cluster.host("algo-1")
    with taken_port(data_host.address, int(cluster.hyperparameters["data_service_port"])) if case == "taken port" else contextlib.nullcontext():
        started = time.monotonic()
        cluster.start()
        try:
            result = cluster.wait()
        finally:
            cluster.close()
    dnn, data = result.outcome("algo-2"), result.outcome("algo-1")
    report(f"data host with a {case} → DNN host failed", dnn.ended_at - started)
    # The data host exits once a DNN host heard its reason; from there, "at once" is a kill of the
    # trainers, not torchrun's 30 s close of ranks blocked on the dead host, nor the launcher's 40 s grace.
    report(f"data host with a {case}: reason heard → DNN host exited", dnn.ended_at - data.ended_at)
    assert data.exit_code not in (0, None)
    assert reason in failure_of(cluster, "algo-1")
    assert dnn.exit_code == 1 and dnn.ended_at - started < 90
    assert dnn.ended_at - data.ended_at < 20
    assert failure_of(cluster, "algo-2").startswith("data host algo-1 failed: ") and reason in failure_of(cluster, "algo-2")
    assert "Traceback" not in "\n".join(watcher.of("algo-1"))


# Frozen processes: a rank, a data host's launcher, a torchrun after training -------------------------------


@pytest.mark.cluster
def test_a_frozen_rank_fails_its_host_with_trainer_stalled_and_every_host_exits(tmp_path: Path, images: Path) -> None:
    """Rank 1 stopped (SIGSTOP): rank 0 waits in the next all-reduce for torch's 30-minute timeout, and the
    data host is kept alive by the DNN launcher's keep-alives. The stall rule ends it all."""
    cluster, watcher = start(
        spec(data_hosts=1, steps=100_000), tmp_path, images, processes_per_host=2, trainer_stall_timeout_s=15, deadline_s=300,
    )
    faults = Faults(cluster, watcher)
    try:
        frozen_at = faults.when("algo-2", r"^step=5/", lambda: faults.signal_trainer("algo-2", signal.SIGSTOP, local_rank=1))
        result = cluster.wait()
    finally:
        cluster.close()
    dnn = result.outcome("algo-2")
    report("frozen rank → TrainerStalled, DNN host exited", dnn.ended_at - frozen_at)
    report("frozen rank → every host exited", max(outcome.ended_at for outcome in result.outcomes) - frozen_at)
    failure = failure_of(cluster, "algo-2")
    assert dnn.exit_code == 1 and failure.startswith("TrainerStalled: no training step on algo-2 for "), failure
    assert int(re.search(r"last step (\d+)", failure).group(1)) >= 5
    assert result.outcome("algo-1").exit_code == 0  # told to shut down by the DNN host
    assert any("stopping (shutdown)" in line for line in watcher.of("algo-1"))
    assert not result.deadline_exceeded and result.orphans == []
    assert dnn.ended_at - frozen_at < 120  # the 15 s bound and a kill, not torch's collective timeout


@pytest.mark.cluster
def test_a_frozen_data_host_is_ended_by_its_first_process_and_every_host_exits_after_training(tmp_path: Path, images: Path) -> None:
    """A data host's launcher and all it started stopped (its first process alive): the trainers drop it
    and finish with the other, but DNN node 0's shutdown cannot reach it; on SageMaker the job would stay
    InProgress, billing every instance, until its deadline. Its first process ends it, and the host exits
    0: the job trained on with the other data host, and a non-zero exit would have failed it (SageMaker
    fails a job when any container does), with no model."""
    cluster, watcher = start(
        spec(data_hosts=2, steps=200, log_every=10), tmp_path, images, data_batch_timeout_s=8, launcher_heartbeat_timeout_s=10,
        deadline_s=300,
    )
    faults = Faults(cluster, watcher)
    try:
        frozen_at = faults.when("algo-3", r"^step=10/", lambda: faults.freeze_launcher("algo-1"))
        result = cluster.wait()
    finally:
        cluster.close()
    frozen = result.outcome("algo-1")
    report("frozen data host → LauncherFrozen, its host exited", frozen.ended_at - frozen_at)
    report("frozen data host → every host exited", max(outcome.ended_at for outcome in result.outcomes) - frozen_at)
    assert result.ok, result.report()  # the emulated cluster's verdict: the job succeeded
    assert frozen.exit_code == 0 and failure_of(cluster, "algo-1") == ""  # no FailureReason of its own
    note = (cluster.host("algo-1").base_dir / "output" / "data" / "LauncherFrozen-algo-1.txt").read_text()
    assert note.startswith("LauncherFrozen: the launcher on algo-1 sent no heartbeat for ") and "it was stopped" in note, note
    assert result.outcome("algo-3").exit_code == 0 and cluster.summary() is not None  # trained on with algo-2
    assert result.outcome("algo-2").exit_code == 0
    assert not result.deadline_exceeded and result.orphans == []


@pytest.mark.cluster
def test_a_torchrun_that_hangs_after_training_is_ended_and_its_host_exits_0(tmp_path: Path, images: Path) -> None:
    """torchrun stopped (SIGSTOP) while its ranks train: they finish, save and exit, and torchrun never
    does. Once the done marks are older than trainer_exit_timeout_s the launcher kills it: the work is
    saved, so the host succeeds (SageMaker uploads the model of a completed job only)."""
    cluster, watcher = start(spec(data_hosts=0, steps=40), tmp_path, images, processes_per_host=2, trainer_exit_timeout_s=5, deadline_s=300)
    faults = Faults(cluster, watcher)
    try:
        faults.when("algo-1", r"^step=3/", lambda: faults.signal_torchrun("algo-1", signal.SIGSTOP))
        finished_at = faults.when("algo-1", r"^step=40/", lambda: None)
        result = cluster.wait()
    finally:
        cluster.close()
    outcome = result.outcome("algo-1")
    report("torchrun hung after training → host exited 0", outcome.ended_at - finished_at)
    assert outcome.exit_code == 0, result.report()
    assert failure_of(cluster, "algo-1") == ""
    tree = cluster.host("algo-1").base_dir
    assert (tree / "model" / "model.pt").stat().st_size > 0 and cluster.summary().get("status") != "stopped"
    assert any("TrainerExitTimeout" in line for line in watcher.of("algo-1"))
    assert not result.deadline_exceeded


# SIGTERM: StopTrainingJob or a spot interruption ----------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("data_hosts", "hyperparameters"),
    [
        (1, {}),  # StopTrainingJob signals every instance: the data host serves on until told to stop
        (0, {"dataloader_workers": 1}),  # torchrun signals each rank's process group: its DataLoader workers too
    ],
    ids=["heterogeneous, every host signalled", "homogeneous, DataLoader workers"],
)
def test_sigterm_saves_a_checkpoint_and_the_model_and_says_stopped(tmp_path: Path, images: Path, data_hosts: int, hyperparameters: dict) -> None:
    cluster, watcher = start(spec(data_hosts=data_hosts, steps=10_000, **hyperparameters), tmp_path, images, processes_per_host=2)
    faults = Faults(cluster, watcher)
    dnn = f"algo-{data_hosts + 1}"

    def stop_the_job() -> None:
        for host in cluster.hosts:
            faults.signal_launcher(host.name, signal.SIGTERM)

    try:
        signalled_at = faults.when(dnn, r"^step=6/", stop_the_job)
        result = cluster.wait()
    finally:
        cluster.close()
    outcome = result.outcome(dnn)
    report(f"SIGTERM → checkpoint, model, exit ({data_hosts} data hosts)", outcome.ended_at - signalled_at)
    tree = cluster.host(dnn).base_dir
    failure = failure_of(cluster, dnn)
    assert outcome.exit_code != 0 and failure.startswith("TrainingStopped: stopped by SIGTERM after step"), failure
    step = int(re.search(r"after step (\d+)", failure).group(1))
    checkpoint = torch.load(tree / "checkpoints" / "checkpoint.pt", weights_only=True)
    assert checkpoint["loop"]["step"] == step >= 6
    assert (tree / "model" / "model.pt").stat().st_size > 0
    summary = json.loads((tree / "output" / "data" / "summary.json").read_text())
    assert (summary["status"], summary["stopped_after_step"]) == ("stopped", step)
    # A stop reads as one: torchrun leaves with 128 + SIGTERM and a line, not its traceback.
    log = "\n".join(watcher.of(dnn))
    assert outcome.exit_code == 128 + signal.SIGTERM and "Traceback" not in log and "the trainer stopped (SIGTERM) after saving" in log, log[-3000:]
    if data_hosts:
        assert result.outcome("algo-1").exit_code == 0  # served on, then told to shut down by the DNN host
        assert any("stopping (shutdown)" in line for line in watcher.of("algo-1"))
    assert result.orphans == []


# A trainer killed under torchrun, and an emulated host killed in part -----------------------------------


@pytest.mark.cluster
def test_a_rank_killed_by_the_oom_killer_is_named_in_the_failure(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(spec(data_hosts=0, steps=10_000), tmp_path, images, processes_per_host=2)
    faults = Faults(cluster, watcher)
    try:
        faults.when("algo-1", r"^step=3/", lambda: faults.signal_trainer("algo-1", signal.SIGKILL, local_rank=1))
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.outcome("algo-1").exit_code not in (0, None)
    assert failure_of(cluster, "algo-1").startswith("rank 1 (local rank 1) was killed by SIGKILL")
    assert failure_of(cluster, "algo-1").endswith("on algo-1")


@pytest.mark.cluster
@pytest.mark.parametrize("part", ["launcher", "torchrun"])
def test_killing_part_of_a_host_leaves_nothing_of_it_running(tmp_path: Path, images: Path, part: str) -> None:
    cluster, watcher = start(spec(data_hosts=0, steps=10_000), tmp_path, images, processes_per_host=2)
    faults = Faults(cluster, watcher)
    kill = {"launcher": faults.signal_launcher, "torchrun": faults.signal_torchrun}[part]
    try:
        killed_at = faults.when("algo-1", r"^step=3/", lambda: kill("algo-1", signal.SIGKILL))
        result = cluster.wait()
        report(f"{part} killed → host ended, nothing left", result.outcome("algo-1").ended_at - killed_at)
        assert cluster.host_pids("algo-1") == []  # trainers did not train on after their host ended
    finally:
        cluster.close()
    outcome = result.outcome("algo-1")
    assert outcome.exit_code not in (0, None)
    log = (tmp_path / "logs" / "algo-1.log").read_text()
    assert "step=3/" in log  # the host's log holds what it printed up to the kill
    if part == "launcher":
        assert outcome.leftovers >= 3  # torchrun and its two trainers, killed with the host
    else:
        assert failure_of(cluster, "algo-1") == "the trainer was killed by SIGKILL on algo-1"


# Metrics from every rank ---------------------------------------------------------------------------------


@pytest.mark.cluster
def test_a_data_stall_on_another_rank_shows_as_data_wait(tmp_path: Path, images: Path) -> None:
    """Rank 1's DataLoader worker stops for 4 s; rank 0 waits for it in the gradient all-reduce. The
    step's metric line must say data wait (rank 1's), not compute (rank 0's)."""
    cluster, watcher = start(spec(data_hosts=0, steps=40, dataloader_workers=1), tmp_path, images, processes_per_host=2)
    faults = Faults(cluster, watcher)
    try:
        def stall() -> None:
            workers = faults.trainer_children("algo-1", local_rank=1)
            assert workers, "rank 1 has no DataLoader worker"
            send(workers, signal.SIGSTOP)
            time.sleep(4)
            send(workers, signal.SIGCONT)

        faults.when("algo-1", r"^step=8/", stall)
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.ok, result.report()
    timed = [parse_metric_line(line) for line in watcher.of("algo-1") if "step_time_ms=" in line]
    stalled = max(timed, key=lambda metrics: metrics["step_time_ms"])
    assert stalled["step_time_ms"] > 2000
    assert stalled["data_wait_ms"] > 0.5 * stalled["step_time_ms"], stalled
    assert cluster.summary()["data_wait_ms"]["mean"] > 0  # the summary takes every rank's wait too
