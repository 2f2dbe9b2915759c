"""The tensorflow variant on the emulated cluster, for real: Horovod ranks (gloo) on the DNN host,
tf.data.service dispatcher and workers on the data hosts, and the faults it must survive."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

# Fails loudly, never skips: `make test` installs Horovod (training/images/tensorflow/build-horovod.sh).
import horovod.tensorflow  # noqa: E402, F401
import pytest

from lambdas.core.job_spec import validate_job_spec
from tests.conftest import platform_hyperparameters
from tests.training.local.test_cluster import (
    TINY,
    assert_data_hosts_exit_soon_after_the_dnn_host_dies,
    run_cli_with_two_data_hosts,
    run_homogeneous,
    start,
)
from tests.training.local.test_cluster import spec as cluster_spec
from tests.training.test_launcher import run_dnn_host_without_its_data_hosts
from training.local.cluster import EmulatedCluster, EmulationOptions


def spec(data_hosts: int = 2, steps: int = 12, distribution: str = "horovod", **hyperparameters) -> dict:
    return cluster_spec(data_hosts, steps, variant="tensorflow", distribution=distribution, **hyperparameters)


@pytest.mark.cluster
def test_two_horovod_ranks_fed_by_two_tf_data_service_hosts(tmp_path: Path, images: Path) -> None:
    out = run_cli_with_two_data_hosts(spec(data_hosts=2, steps=12), tmp_path, images)
    assert "Horovod ranks [0, 1] of 2" in out
    assert "registered the augmentation pipeline (96 images, 4 classes)" in out  # by the dispatcher host only
    assert out.count("tf.data.service ready") == 2
    dnn_tree = tmp_path / "run" / "algo-3" / "opt" / "ml"
    summary = json.loads((dnn_tree / "output" / "data" / "summary.json").read_text())
    assert (summary["steps"], summary["timed_steps"], summary["world_size"]) == (12, 10, 2)
    assert (summary["input_source"], summary["distribution"], summary["framework"]) == ("tf.data.service", "horovod", "tensorflow")
    assert (dnn_tree / "model" / "model.keras").stat().st_size > 0 and (dnn_tree / "checkpoints" / "checkpoint.npz").exists()
    assert out.count("stopping (shutdown)") == 2  # both data hosts stopped on the trainer's authenticated request


@pytest.mark.cluster
def test_training_finishes_when_a_tf_data_service_worker_host_dies(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(spec(data_hosts=2, steps=60), tmp_path, images)
    try:
        watcher.wait_for("algo-3", r"^step=5/60")
        cluster.kill("algo-2")  # a worker-only host; algo-1 also runs the dispatcher
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.outcome("algo-3").exit_code == 0 and result.outcome("algo-1").exit_code == 0
    assert result.outcome("algo-2").exit_code == -9 and not result.ok  # a lost instance still fails the job
    assert cluster.summary()["steps"] == 60
    assert result.orphans == []


@pytest.mark.cluster
def test_every_tf_data_host_exits_soon_after_the_dnn_host_dies(tmp_path: Path, images: Path) -> None:
    assert_data_hosts_exit_soon_after_the_dnn_host_dies(spec(data_hosts=2, steps=10_000), tmp_path, images)
    # Nothing of tf.data.service outlives its host: no process still runs the service module.
    leftovers = subprocess.run(["pgrep", "-f", "training.data_service.tf_service"], capture_output=True, text=True).stdout.split()
    assert not [pid for pid in leftovers if str(tmp_path) in Path(f"/proc/{pid}/environ").read_text(errors="replace")]


@pytest.mark.cluster
def test_homogeneous_mirrored_job_runs_the_same_pipeline_on_its_own_cpus(tmp_path: Path, images: Path) -> None:
    summary, _ = run_homogeneous(spec(data_hosts=0, steps=8, distribution="mirrored"), tmp_path, images)
    assert (summary["input_source"], summary["distribution"], summary["timed_steps"]) == ("local", "mirrored", 6)


def test_an_unreachable_dispatcher_fails_the_trainer_within_the_bound(tmp_path: Path) -> None:
    hyperparameters = platform_hyperparameters(
        variant="tensorflow", distribution="none", data_connect_timeout_s=3, master_port=29741, data_service_port=29742,
    ) | {key: str(value) for key, value in TINY.items()} | {"steps": "5"}
    result, base, elapsed = run_dnn_host_without_its_data_hosts(tmp_path, 81, hyperparameters)
    assert result.returncode == 1, result.stdout[-2000:]
    assert elapsed < 60
    assert (base / "output" / "failure").read_text().startswith("DataServiceUnavailableError: no data host answered within 3 s")


@pytest.mark.cluster
def test_losing_the_only_data_host_fails_the_job_once_batches_stop(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(spec(data_hosts=1, steps=10_000), tmp_path, images)
    try:
        watcher.wait_for("algo-2", r"^step=3/")
        cluster.kill("algo-1")  # the dispatcher's host, and the only worker: no batch can come any more
        killed_at = time.monotonic()
        result = cluster.wait()
    finally:
        cluster.close()
    dnn = result.outcome("algo-2")
    print(f"\n[fault] tf.data.service dispatcher host lost → job failed: {dnn.ended_at - killed_at:.1f} s")
    assert dnn.exit_code == 1 and dnn.ended_at - killed_at < 90
    failure = (cluster.host("algo-2").base_dir / "output" / "failure").read_text()
    assert failure.startswith("the tf.data.service dispatcher host") and "no batch has reached a trainer for" in failure


@pytest.mark.cluster
def test_losing_the_dispatcher_host_fails_the_job_even_with_another_worker_alive(tmp_path: Path, images: Path) -> None:
    """With dynamic sharding (each file once per epoch across the data hosts), the dispatcher hands out
    every file: without it the other host's worker soon has nothing to decode, and the job fails with the
    dispatcher's loss as its reason instead of hanging."""
    cluster, watcher = start(spec(data_hosts=2, steps=10_000, log_every=20), tmp_path, images)
    try:
        watcher.wait_for("algo-3", r"^step=20/")
        cluster.kill("algo-1")
        killed_at = time.monotonic()
        result = cluster.wait()
    finally:
        cluster.close()
    dnn = result.outcome("algo-3")
    print(f"\n[fault] dispatcher host lost, a worker alive → job failed: {dnn.ended_at - killed_at:.1f} s")
    assert dnn.exit_code == 1 and dnn.ended_at - killed_at < 90
    failure = (cluster.host("algo-3").base_dir / "output" / "failure").read_text()
    assert failure.startswith("the tf.data.service dispatcher host")
    assert result.outcome("algo-2").exit_code is not None and result.orphans == []


@pytest.mark.cluster
def test_a_dispatcher_host_that_comes_up_late_does_not_fail_a_healthy_job(tmp_path: Path, images: Path) -> None:
    """Until the dispatcher's host first answers, the start bound (data_connect_timeout_s, 150 s here)
    governs, not the silence rule (dispatcher_silence_s, 5 s here): a host 12 s late is late, not lost."""
    cluster, watcher = start(spec(data_hosts=1, steps=12), tmp_path, images, data_connect_timeout_s=150, dispatcher_silence_s=5)
    try:
        cluster.kill("algo-1", signal.SIGSTOP)  # frozen before it binds anything
        watcher.wait_for("algo-2", r"starting (the trainer|Horovod ranks)")
        time.sleep(12)
        cluster.kill("algo-1", signal.SIGCONT)
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.ok, result.report()
    assert cluster.summary()["steps"] == 12


@pytest.mark.cluster
def test_sigterm_stops_horovod_ranks_at_one_step_with_their_state_saved(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(spec(data_hosts=1, steps=10_000), tmp_path, images, processes_per_host=2)
    try:
        watcher.wait_for("algo-2", r"^step=6/")
        for host in cluster.hosts:  # StopTrainingJob signals every instance
            cluster.kill_launcher(host.name, signal.SIGTERM)
        result = cluster.wait()
    finally:
        cluster.close()
    tree = cluster.host("algo-2").base_dir
    failure = (tree / "output" / "failure").read_text()
    assert result.outcome("algo-2").exit_code != 0 and failure.startswith("TrainingStopped: stopped by SIGTERM after step"), failure
    summary = json.loads((tree / "output" / "data" / "summary.json").read_text())
    assert summary["status"] == "stopped" and f"after step {summary['stopped_after_step']} " in failure
    assert (tree / "checkpoints" / "checkpoint.npz").exists() and (tree / "model" / "model.keras").stat().st_size > 0
    assert result.outcome("algo-1").exit_code == 0 and result.orphans == []
    # A resumed job carries on from the checkpoint; tf.data.service has no position to resume, and its
    # summary says so, with about how many samples of the interrupted epoch it trains again.
    stopped = summary["stopped_after_step"]
    resumed = EmulatedCluster(validate_job_spec(spec(data_hosts=1, steps=stopped + 3)),
                              EmulationOptions(workdir=tmp_path / "resumed", channels={"train": images}, processes_per_host=2))
    resumed.prepare()
    shutil.copytree(tree / "checkpoints", resumed.host("algo-2").base_dir / "checkpoints", dirs_exist_ok=True)
    outcome = resumed.run()
    assert outcome.ok, outcome.report()
    position = resumed.summary()["data_position"]
    trained = stopped * 8 * 2  # steps × batch × ranks
    assert position == {"resumed": "from the start of the data hosts' order", "why": "tf.data.service keeps no position a new job can resume from",
                        "samples_trained_before": trained, "samples_repeated_about": trained % 96}, position
