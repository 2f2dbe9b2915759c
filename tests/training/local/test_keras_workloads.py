"""A TensorFlow user workload on the emulated cluster: the example (examples/workloads/keras_shapes/), written
only against the TensorFlow side of the workload contract, learns homogeneous and fed by 1 and 2
tf.data.service data hosts, and the fault rows hold for it: SIGTERM saves, a data host lost."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from tests.faults import Faults
from tests.training.local.test_user_workloads import REPO, failure_of, losses, run, start, workload_spec
from training.local.images import write_dataset

KERAS_EXAMPLE = REPO / "examples" / "workloads" / "keras_shapes"


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("held-out"), classes=4, per_class=8, size=96, seed=1)


@pytest.mark.cluster
@pytest.mark.parametrize("data_hosts", [0, 1, 2])
def test_the_keras_example_learns_homogeneous_and_from_data_hosts(tmp_path: Path, images: Path, held_out: Path, data_hosts: int) -> None:
    raw = workload_spec(KERAS_EXAMPLE, data_hosts=data_hosts, steps=40, variant="tensorflow", batch_size=16, eval_every=20, log_every=1)
    cluster, watcher, result = run(raw, tmp_path, {"train": images, "validation": held_out})
    dnn = f"algo-{data_hosts + 1}"
    assert result.ok, result.report() + "\n".join(watcher.of(dnn)[-30:])
    summary = cluster.summary()
    assert summary["input_source"] == ("tf.data.service" if data_hosts else "local") and summary["workload"] == "workload"
    trained = losses(watcher, dnn)
    # Every step's loss (log_every 1), from the untrained model's first; a later first line (step 5) may
    # already be near zero on these shapes, and one noisy batch of 16 then outweighs it.
    assert sum(trained[-3:]) / 3 < trained[0] * 0.7, trained  # it learns
    validation = summary["validation"]
    assert validation["step"] == 40 and validation["samples"] == 32 and validation["metrics"]["accuracy"] >= 0.6, validation  # chance: 0.25
    assert sum("eval_accuracy=" in line for line in watcher.of(dnn)) == 2  # every 20 steps: at 20 and at the end
    registered = [line for host in cluster.hosts for line in watcher.of(host.name) if "registered workload's dataset (96 files, 4 classes)" in line]
    assert len(registered) == (1 if data_hosts else 0)  # by the dispatcher host alone
    card = json.loads((cluster.host(dnn).base_dir / "model" / "workload.json").read_text())
    assert card["framework"] == "tensorflow" and (cluster.host(dnn).base_dir / "model" / "code" / "workload.py").exists()


@pytest.mark.cluster
def test_sigterm_saves_a_keras_workload_at_one_step(tmp_path: Path, images: Path) -> None:
    raw = workload_spec(KERAS_EXAMPLE, data_hosts=1, steps=10_000, variant="tensorflow", validation=False, batch_size=8, log_every=1)
    cluster, watcher = start(raw, tmp_path, {"train": images})
    faults = Faults(cluster, watcher)
    try:
        faults.when("algo-2", r"^step=6/", lambda: [faults.signal_launcher(host.name, signal.SIGTERM) for host in cluster.hosts])
        result = cluster.wait()
    finally:
        cluster.close()
    failure = failure_of(cluster, "algo-2")
    assert result.outcome("algo-2").exit_code != 0 and failure.startswith("TrainingStopped: stopped by SIGTERM after step"), failure
    tree = cluster.host("algo-2").base_dir
    assert (tree / "checkpoints" / "checkpoint.npz").exists() and (tree / "model" / "model.keras").stat().st_size > 0
    assert result.outcome("algo-1").exit_code == 0 and result.orphans == []


@pytest.mark.cluster
def test_a_keras_workload_trains_on_when_a_worker_only_data_host_dies(tmp_path: Path, images: Path) -> None:
    raw = workload_spec(KERAS_EXAMPLE, data_hosts=2, steps=60, variant="tensorflow", validation=False, batch_size=8)
    cluster, watcher = start(raw, tmp_path, {"train": images})
    try:
        watcher.wait_for("algo-3", r"^step=5/60")
        cluster.kill("algo-2")  # a worker-only host; algo-1 also runs the dispatcher
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.outcome("algo-3").exit_code == 0 and result.outcome("algo-1").exit_code == 0
    assert result.outcome("algo-2").exit_code == -9 and not result.ok  # a lost instance still fails the job
    assert cluster.summary()["steps"] == 60 and result.orphans == []


@pytest.mark.cluster
def test_a_dataset_with_python_in_its_graph_fails_every_host_with_the_reason_before_a_step(tmp_path: Path, images: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    source = (KERAS_EXAMPLE / "workload.py").read_text()
    refused = source.replace("return files.map(load, num_parallel_calls=tf.data.AUTOTUNE)",
                             'return files.map(lambda f: load({"path": tf.py_function(lambda p: p, [f["path"]], tf.string), "label": f["label"]}))')
    assert refused != source
    (code / "workload.py").write_text(refused)
    raw = workload_spec(code, data_hosts=1, steps=40, variant="tensorflow", validation=False, batch_size=8)
    cluster, watcher, result = run(raw, tmp_path / "run", {"train": images})
    reason = "PythonInGraphError: build_dataset in .* uses tf.py_function"
    assert result.outcome("algo-1").exit_code != 0 and result.outcome("algo-2").exit_code != 0
    for host in ("algo-1", "algo-2"):
        assert re.search(reason, failure_of(cluster, host)), (host, failure_of(cluster, host))
    assert not any("step=" in line for line in watcher.of("algo-2")) and result.orphans == []
