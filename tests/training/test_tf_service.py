"""tf.data.service's child process on a data host: how it starts from a launcher that already runs gRPC,
and that it never outlives that launcher."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.conftest import TOKEN
from tests.training.test_data_service import data_host
from training.data_service.client import DataServiceDataset
from training.data_service.tf_service import start_child

REPO = Path(__file__).resolve().parents[2]
STARTS = 300


def test_children_started_while_grpc_streams_in_this_process_all_start(images: Path) -> None:
    """The launcher's gRPC server and clients run while the child starts. Forked with a preexec_fn,
    1 start in 60 died of SIGABRT here (gRPC's at-fork handlers in the child); none may."""
    with data_host(images) as host:
        stop = threading.Event()
        dataset = DataServiceDataset([host.target], 8, TOKEN, "busy")

        def keep_streaming() -> None:
            for _ in itertools.takewhile(lambda _: not stop.is_set(), dataset):
                pass

        streaming = threading.Thread(target=keep_streaming, daemon=True)
        streaming.start()
        try:
            codes = [start_child(["/bin/true"]).wait(timeout=30) for _ in range(STARTS)]
        finally:
            stop.set()
            streaming.join(10)
    assert dataset.stats.hosts[host.target].batches > 0, "gRPC must have been busy during the starts"
    assert codes == [0] * STARTS, f"{sum(code != 0 for code in codes)} of {STARTS} starts failed: {set(codes)}"


def test_the_child_exits_at_once_when_its_launcher_is_already_gone(tmp_path: Path) -> None:
    command = [
        # This test's parent: alive, and not the child's parent (this process is).
        sys.executable, "-m", "training.data_service.tf_service", "--parent-pid", str(os.getppid()),
        "--dispatcher-address", "127.0.0.1:1", "--worker-address", "127.0.0.1:2", "--batch-size", "8", "--image-size", "32",
    ]
    result = subprocess.run(command, cwd=tmp_path, env=os.environ | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "that started tf.data.service is gone" in result.stdout


def test_the_child_dies_with_its_launcher(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL takes its tf.data.service child with it (PR_SET_PDEATHSIG)."""
    launcher = (
        "import sys, time\n"
        "from training.data_service.tf_service import start_child\n"
        "child = start_child([sys.executable, '-c', "
        "'import os, time; from training.data_service.tf_service import die_with_parent; "
        "die_with_parent(os.getppid()); print(os.getpid(), flush=True); time.sleep(60)'])\n"
        "print(child.stdout.readline().strip(), flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    for _ in range(50):
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return
        threading.Event().wait(0.1)
    os.kill(child_pid, 9)
    raise AssertionError("the child outlived its launcher")
