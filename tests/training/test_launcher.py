"""The host entrypoint and its roles (training/launcher.py, dnn_host.py, trainer_watch.py, supervisor.py,
processes.py): the command it builds, exit codes, the trainers' watch, the supervisor's heartbeat, and every
bad input refused before anything starts (each case runs the real entrypoint in a fresh process against a
fake /opt/ml)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import hetero_resource_config, platform_hyperparameters, write_host_tree
from training.data_host import data_failure_verdict, dispatcher_lost
from training.dnn_host import EFA_ENVIRONMENT, precompile_command, trainer_command, trainer_environment
from training.hyperparameters import HyperparameterError
from training.processes import CONFIG_ERROR_EXIT, exit_status
from training.supervisor import Heartbeat, heard, heartbeat_lost
from training.trainer_watch import (
    Progress,
    TrainersOutcome,
    TrainerWatch,
    describe_rank_failure,
    failure_to_write,
    observe,
    read_marks,
    trainer_failure,
    trainer_stalled,
    trainers_lingering,
    wait_for_trainers,
)

REPO = Path(__file__).resolve().parents[2]


def test_multi_node_trainium_trainers_get_efa_and_every_neuron_trainer_the_cache() -> None:
    from training.hyperparameters import PlatformSettings

    settings = PlatformSettings(role_map={"trn": "dnn"}, shutdown_token="t" * 16, neuron_compile_cache_uri="s3://bucket/cache/")
    two_nodes = trainer_environment(settings, {"PATH": "/bin"}, instance_type="ml.trn1.32xlarge", nnodes=2)
    assert two_nodes == {"PATH": "/bin", "NEURON_COMPILE_CACHE_URL": "s3://bucket/cache/"} | EFA_ENVIRONMENT
    assert EFA_ENVIRONMENT == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
    assert "FI_PROVIDER" in trainer_environment(settings, {}, instance_type="ml.trn2.48xlarge", nnodes=4)
    assert "FI_PROVIDER" not in trainer_environment(settings, {}, instance_type="ml.trn1.32xlarge", nnodes=1)  # one node
    assert "FI_PROVIDER" not in trainer_environment(settings, {}, instance_type="ml.trn1.2xlarge", nnodes=2)  # no EFA on it
    assert "FI_PROVIDER" not in trainer_environment(settings, {}, instance_type="ml.p4d.24xlarge", nnodes=2)  # NCCL's own
    assert trainer_environment(settings, {"FI_PROVIDER": "sockets"}, instance_type="ml.trn1.32xlarge", nnodes=2)["FI_PROVIDER"] == "sockets"
    assert precompile_command(["python", "-m", "training.torchrun", "-m", "x"])[:2] == ["neuron_parallel_compile", "python"]


def test_pre_compilation_without_the_neuron_sdk_is_refused_before_anything_runs(tmp_path: Path) -> None:
    from training.dnn_host import _precompile

    with pytest.raises(HyperparameterError, match="precompile_steps needs neuron_parallel_compile"):
        _precompile(["python", "-c", "raise SystemExit(3)"], {"PATH": str(tmp_path)}, threading.Event(), "algo-1")


def test_torchrun_spans_the_dnn_group() -> None:
    command = trainer_command(
        "training.trainers.pytorch_runtime", distribution="torchrun", nnodes=2, processes_per_host=4, node_rank=1,
        master_address="10.0.0.7", master_port=29500, python="python",
    )
    assert command == [
        "python", "-m", "training.torchrun", "--nnodes=2", "--nproc-per-node=4", "--node-rank=1",
        "--master-addr=10.0.0.7", "--master-port=29500", "-m", "training.trainers.pytorch_runtime",
    ]


def test_no_distribution_runs_one_plain_process_and_refuses_more() -> None:
    kwargs = dict(distribution="none", node_rank=0, master_address="a", master_port=29500, python="python")
    assert trainer_command("m", nnodes=1, processes_per_host=1, **kwargs) == ["python", "-m", "m"]
    with pytest.raises(HyperparameterError, match="use torchrun \\(PyTorch\\) or horovod \\(TensorFlow\\)"):
        trainer_command("m", nnodes=1, processes_per_host=2, **kwargs)


def test_horovod_and_mirrored_start_the_module_itself_and_mirrored_stays_on_one_host() -> None:
    kwargs = dict(node_rank=0, master_address="a", master_port=29500, python="python")
    assert trainer_command("m", distribution="horovod", nnodes=2, processes_per_host=8, **kwargs) == ["python", "-m", "m"]
    assert trainer_command("m", distribution="mirrored", nnodes=1, processes_per_host=8, **kwargs) == ["python", "-m", "m"]
    with pytest.raises(HyperparameterError, match="'mirrored' runs on one host .* use distribution 'horovod'"):
        trainer_command("m", distribution="mirrored", nnodes=2, processes_per_host=1, **kwargs)


@pytest.mark.parametrize(("returncode", "status"), [(0, 0), (1, 1), (-9, 137), (-15, 143)])
def test_a_killed_trainer_is_a_failure(returncode: int, status: int) -> None:
    assert exit_status(returncode) == status


def run_launcher(base: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"SAGEMAKER_BASE_DIR": str(base), "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "training.launcher"], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30, "a refused job must end fast"
    return result


def empty_channel(tmp_path: Path) -> Path:
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    return tmp_path / "empty"


CASES = {
    "missing resourceconfig": (lambda tmp, images: (None, platform_hyperparameters(), {}), "resourceconfig.json does not exist"),
    "malformed resourceconfig": (lambda tmp, images: ("{oops", platform_hyperparameters(), {}), "is not valid JSON"),
    "group missing from the role map": (
        lambda tmp, images: (hetero_resource_config("algo-1"), platform_hyperparameters(role_map=json.dumps({"dnn_group": "dnn"})), {}),
        "RoleMapError: instance group 'data_group' is not in the role map",
    ),
    "unknown hyperparameter": (
        lambda tmp, images: (hetero_resource_config("algo-1"), platform_hyperparameters() | {"lerning_rate": "0.1"}, {}),
        "unknown hyperparameter 'lerning_rate' (did you mean 'learning_rate'?)",
    ),
    "unknown variant": (
        lambda tmp, images: (hetero_resource_config("algo-1"), platform_hyperparameters(variant="jax"), {}),
        "variant 'jax' has no trainer",
    ),
    "data host without its channel": (
        lambda tmp, images: (hetero_resource_config("algo-1"), platform_hyperparameters(data_connect_timeout_s=1), {}),
        "ChannelNotRoutedError: the workload asks for channel 'train', which this job does not route to this host's group",
    ),
    "data host with an empty channel": (
        lambda tmp, images: (hetero_resource_config("algo-2"), platform_hyperparameters(data_connect_timeout_s=1), {"train": empty_channel(tmp)}),
        "EmptyChannelError",
    ),
    "homogeneous host without its channel": (
        lambda tmp, images: (
            {"current_host": "algo-1", "hosts": ["algo-1"]},
            platform_hyperparameters(role_map=json.dumps({"homogeneousCluster": "dnn"})),
            {},
        ),
        "ChannelNotRoutedError: the workload asks for channel 'train', which this job does not route to this host's group; it has []",
    ),
    "one process asked, several hosts": (
        lambda tmp, images: (
            {"current_host": "algo-1", "hosts": ["algo-1", "algo-2"]},
            platform_hyperparameters(role_map=json.dumps({"homogeneousCluster": "dnn"}), distribution="none"),
            {"train": images},
        ),
        "use torchrun (PyTorch) or horovod (TensorFlow)",
    ),
    "tensorflow with a PyTorch distribution": (
        lambda tmp, images: (hetero_resource_config("algo-3"), platform_hyperparameters(variant="tensorflow", distribution="torchrun"), {}),
        "variant 'tensorflow' runs with distribution ['horovod', 'mirrored', 'none'], not 'torchrun'",
    ),
    "tensorflow data host without its channel": (
        lambda tmp, images: (
            hetero_resource_config("algo-2"), platform_hyperparameters(variant="tensorflow", distribution="horovod", data_connect_timeout_s=1), {}
        ),
        "MissingChannelError: channel 'train' is not on this host",
    ),
    "precompile_steps on a GPU job's data host": (
        lambda tmp, images: (hetero_resource_config("algo-1"), platform_hyperparameters(precompile_steps=2), {"train": images}),
        "precompile_steps pre-compiles a Trainium job's Neuron graphs: variant 'pytorch' has none",
    ),
    "a ResNet18 asked of the Keras trainer": (
        lambda tmp, images: (hetero_resource_config("algo-3"), platform_hyperparameters(variant="tensorflow", distribution="horovod", model="resnet18"), {}),
        "model must be one of ('cnn', 'resnet50'), got 'resnet18'",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_ends_the_host_with_one_clear_line(tmp_path: Path, images: Path, case: str) -> None:
    make, message = CASES[case]
    resource_config, hyperparameters, channels = make(tmp_path, images)
    base = write_host_tree(tmp_path / "opt" / "ml", resource_config, hyperparameters, channels)
    result = run_launcher(base)
    assert result.returncode == CONFIG_ERROR_EXIT, result.stdout + result.stderr
    assert message in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert not (base / "output" / "data" / "summary.json").exists()
    assert message in (base / "output" / "failure").read_text()  # becomes the job's FailureReason


def run_dnn_host_without_its_data_hosts(tmp_path: Path, subnet: int, hyperparameters: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path, float]:
    """The DNN host's launcher of a heterogeneous job whose data hosts never come up; returns the
    result, the host's /opt/ml and how long it took."""
    addresses = {name: f"127.0.{subnet}.{index + 2}" for index, name in enumerate(("algo-1", "algo-2", "algo-3"))}
    base = write_host_tree(tmp_path / "opt" / "ml", hetero_resource_config("algo-3"), hyperparameters)
    env = os.environ | {"SAGEMAKER_BASE_DIR": str(base), "PYTHONPATH": str(REPO), "TRAINING_HOST_ADDRESSES": json.dumps(addresses)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "training.launcher"], env=env, capture_output=True, text=True, timeout=120)
    return result, base, time.monotonic() - started


def test_a_dnn_host_whose_data_hosts_never_come_fails_within_the_bound(tmp_path: Path) -> None:
    hyperparameters = platform_hyperparameters(data_connect_timeout_s=3, master_port=29731, data_service_port=29732) | {
        "model": "cnn", "cnn_width": "8", "image_size": "32", "batch_size": "8", "steps": "5", "warmup_steps": "1",
    }
    result, base, elapsed = run_dnn_host_without_its_data_hosts(tmp_path, 79, hyperparameters)
    assert result.returncode == 1, result.stdout[-2000:]
    assert elapsed < 60
    failure = (base / "output" / "failure").read_text()
    assert failure.startswith("DataServiceUnavailableError: no data host answered within 3 s")


# How a DNN host decides that its job cannot go on ---------------------------------------------------------


def test_one_failed_data_host_of_several_is_not_a_reason_to_stop() -> None:
    hosts = ["algo-1", "algo-2"]
    assert data_failure_verdict({}, hosts) is None
    assert data_failure_verdict({"algo-2": "EmptyChannelError: no images"}, hosts) is None
    assert data_failure_verdict({"algo-1": "a", "algo-2": "b"}, hosts) == "every data host failed: algo-1: a; algo-2: b"
    assert data_failure_verdict({"algo-1": "PortInUseError: x"}, ["algo-1"]) == "data host algo-1 failed: PortInUseError: x"
    # tf.data.service cannot go on without its dispatcher's host, whatever the others do.
    assert data_failure_verdict({"algo-1": "x"}, hosts, essential="algo-1").startswith("data host algo-1 (the tf.data.service dispatcher) failed")


@pytest.mark.parametrize(
    ("answered", "silent_s", "no_progress_s", "lost"),
    [
        (False, 500, 500, False),  # never answered: starting late, and the start bound governs
        (True, 31, 5, False),  # silent, but batches still arrive: the workers serve on
        (True, 10, 500, False),  # no progress (a long first step), but the dispatcher answers
        (True, 31, 31, True),
    ],
)
def test_the_dispatcher_is_lost_only_when_it_went_silent_and_batches_stopped(answered: bool, silent_s: float, no_progress_s: float, lost: bool) -> None:
    reason = dispatcher_lost("10.0.0.5:7000", answered=answered, silent_s=silent_s, no_progress_s=no_progress_s, bound_s=30)
    assert (reason is not None) == lost


def test_progress_is_any_change_of_a_mark_timed_on_the_launchers_clock(tmp_path: Path) -> None:
    progress = observe(Progress(since=100.0, seen_at=100.0), read_marks(tmp_path), now=101.0)
    assert (progress.since, progress.step, progress.done_at) == (100.0, 0, None)  # no mark yet
    for rank, (text, mtime) in enumerate((("7", 5_000.0), ("8", 5_001.0))):
        mark = tmp_path / f"rank-{rank}"
        mark.write_text(text)
        os.utime(mark, (mtime, mtime))
    progress = observe(progress, read_marks(tmp_path), now=102.0)
    assert (progress.since, progress.step) == (102.0, 8)
    assert observe(progress, read_marks(tmp_path), now=103.0).since == 102.0  # nothing changed
    # The wall clock stepped back an hour: the next step's mark is older than the last, and still news.
    (tmp_path / "rank-1").write_text("9")
    os.utime(tmp_path / "rank-1", (1_401.0, 1_401.0))
    progress = observe(progress, read_marks(tmp_path), now=104.0)
    assert (progress.since, progress.step) == (104.0, 9)
    (tmp_path / "rank-0").write_text("done 9")
    assert observe(progress, read_marks(tmp_path), now=105.0).done_at == 105.0


def test_a_host_whose_trainers_make_no_step_for_the_bound_has_stalled() -> None:
    def stalled(progress: Progress, now: float) -> str | None:
        return trainer_stalled(progress, now, host="algo-3", bound_s=60, first_step_bound_s=600)

    stepping = Progress(since=1_000.0, seen_at=1_000.0, marks={"rank-0": (1, "41")}, step=41)
    assert stalled(stepping, 1_060.0) is None
    assert stalled(stepping, 1_061.0) == (
        "TrainerStalled: no training step on algo-3 for 61 s (last step 41; bound 60 s): "
        "a frozen or deadlocked rank holds every rank in its next collective"
    )
    starting = Progress(since=1_000.0, seen_at=1_000.0)  # the first step waits for imports, data hosts, compiles
    assert stalled(starting, 1_500.0) is None
    assert stalled(starting, 1_601.0).startswith("TrainerStalled: no training step on algo-3 601 s after the trainers started")
    assert trainer_stalled(stepping, 9_999.0, host="algo-3", bound_s=0, first_step_bound_s=0) is None  # turned off
    finished = Progress(since=1_000.0, seen_at=1_000.0, marks={"rank-0": (1, "done 41")}, step=41, done_at=1_000.0)
    assert stalled(finished, 9_999.0) is None
    assert not trainers_lingering(finished, 1_030.0, bound_s=30) and trainers_lingering(finished, 1_031.0, bound_s=30)
    assert not trainers_lingering(stepping, 9_999.0, bound_s=30) and not trainers_lingering(finished, 9_999.0, bound_s=0)


def test_a_launcher_that_did_not_run_for_a_while_does_not_blame_its_trainers_for_it() -> None:
    # The whole host was frozen for 500 s (its launcher too), then continued: the trainers' marks did not
    # change while nobody looked, but the launcher's own gap is not their silence.
    progress = Progress(since=1_000.0, seen_at=1_050.0, marks={"rank-0": (1, "41")}, step=41)
    progress = observe(progress, {"rank-0": (1, "41")}, now=1_550.0)
    assert progress.since == 1_500.0
    assert trainer_stalled(progress, 1_551.0, host="algo-3", bound_s=60, first_step_bound_s=600) is None


def test_the_first_process_blames_a_launcher_only_after_its_first_beat_and_its_bound() -> None:
    beat = Heartbeat(checked_at=0.0)
    beat, frozen = heartbeat_lost(beat, 1_000.0)
    assert frozen is None  # never beat: a launcher that runs without beats is never blamed
    beat = heard(beat, b'{"bound_s": 30, "host": "algo-1"}\n{"bound_s": 30, "ho', 1_000.0)  # a torn second line
    assert (beat.heard_at, beat.bound_s, beat.host) == (1_000.0, 30.0, "algo-1")
    beat = heard(beat, b'st": "algo-1"}\n', 1_002.0)
    assert beat.heard_at == 1_002.0
    for now in range(1_003, 1_033):
        beat, frozen = heartbeat_lost(beat, float(now))
        assert frozen is None
    beat, frozen = heartbeat_lost(beat, 1_033.0)
    assert frozen == "LauncherFrozen: the launcher on algo-1 sent no heartbeat for 31 s (bound 30 s)"
    # The supervisor itself did not run for 100 s (the whole instance frozen): the gap is not the launcher's.
    paused, frozen = heartbeat_lost(Heartbeat(checked_at=1_010.0, heard_at=1_009.0, bound_s=30, host="algo-1"), 1_110.0)
    assert frozen is None and paused.heard_at == 1_109.0


@pytest.mark.parametrize(("role", "status"), [("dnn", 1), ("", 1), ("data", 0)])
def test_the_first_process_kills_a_frozen_launcher_and_all_it_started_and_names_it(tmp_path: Path, role: str, status: int) -> None:
    # A frozen DNN host (or one whose role is unknown) fails the job; a frozen data host does not (the
    # trainers go on with the other data hosts): it exits 0, its reason logged and left in its output/data.
    launcher = (
        "import os, signal, subprocess, sys, time\n"
        "from training.supervisor import start_heartbeat\n"
        f"assert start_heartbeat(2.0, 'algo-1', {role!r})\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(1)\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"  # frozen, every thread of it: no beat any more
    )
    supervisor = subprocess.Popen(
        [sys.executable, "-c", f"import sys; from training.supervisor import supervise; sys.exit(supervise([sys.executable, '-c', {launcher!r}]))"],
        env=os.environ | {"PYTHONPATH": str(REPO), "SAGEMAKER_BASE_DIR": str(tmp_path)}, stdout=subprocess.PIPE, text=True,
    )
    grandchild = int(supervisor.stdout.readline())
    assert supervisor.wait(timeout=60) == status
    failure_file, note = tmp_path / "output" / "failure", tmp_path / "output" / "data" / "LauncherFrozen-algo-1.txt"
    reason = (note if role == "data" else failure_file).read_text()
    assert reason.startswith("LauncherFrozen: the launcher on algo-1 sent no heartbeat for ") and "it was stopped" in reason, reason
    assert not (failure_file if role == "data" else note).exists()  # a lost data host is not the job's FailureReason
    assert not Path(f"/proc/{grandchild}").exists()  # what it started went with it


def test_the_heartbeat_says_the_hosts_role_and_a_frozen_data_host_exits_0() -> None:
    from training.supervisor import LAUNCHER_FROZEN_EXIT, frozen_exit_status

    beat = heard(Heartbeat(checked_at=0.0), b'{"bound_s": 30, "host": "algo-1", "role": "data"}\n', 1.0)
    assert (beat.host, beat.role) == ("algo-1", "data")
    assert heard(Heartbeat(checked_at=0.0), b'{"bound_s": 30, "host": "algo-1"}\n', 1.0).role == ""  # an older launcher's beat
    assert (frozen_exit_status("data"), frozen_exit_status("dnn"), frozen_exit_status("")) == (0, LAUNCHER_FROZEN_EXIT, LAUNCHER_FROZEN_EXIT)


def stopped_tree() -> subprocess.Popen:
    """A process whose child runs in a session of its own (as torchrun's ranks do), both then SIGSTOPped."""
    code = (
        "import os, signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "os.kill(child.pid, signal.SIGSTOP); os.kill(os.getpid(), signal.SIGSTOP)\n"
        "time.sleep(120)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_an_abort_kills_the_trainers_whole_tree_at_once_even_when_frozen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    frozen = stopped_tree()
    rank = int(frozen.stdout.readline())
    started = time.monotonic()
    outcome = wait_for_trainers([frozen], threading.Event(), abort=lambda: "TrainerStalled: x", peer_grace_s=40)
    assert (outcome.status, outcome.abort_reason, frozen.returncode) == (1, "TrainerStalled: x", -signal.SIGKILL)
    assert time.monotonic() - started < 20  # not the 40 s grace: an abort saves nothing
    deadline = time.monotonic() + 10
    while Path(f"/proc/{rank}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # killed; the init process (or a subreaper) collects it
    assert not Path(f"/proc/{rank}").exists() or Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_trainers_that_finished_but_do_not_exit_are_killed_and_the_host_succeeds() -> None:
    hung = stopped_tree()  # a torchrun frozen after its ranks were done
    hung.stdout.readline()
    outcome = wait_for_trainers([hung], threading.Event(), abort=lambda: None, finished=lambda: True)
    assert (outcome.status, outcome.abort_reason, hung.returncode) == (0, None, -signal.SIGKILL)


def stepping_trainer(progress_dir: Path, rank: int, steps: int, end: str = "raise SystemExit(0)") -> subprocess.Popen:
    """A trainer process that writes its step mark every 0.1 s, then its done mark, then ``end``."""
    code = (
        "import os, pathlib, signal, time\n"
        f"mark = pathlib.Path({str(progress_dir / f'rank-{rank}')!r})\n"
        f"for step in range(1, {steps} + 1):\n"
        "    time.sleep(0.1)\n"
        "    mark.write_text(str(step))\n"
        f"mark.write_text('done {steps}')\n"
        f"{end}\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def watch_of(progress_dir: Path, local_ranks: int = 1, exit_timeout_s: float = 0.5) -> TrainerWatch:
    return TrainerWatch(progress_dir, host="algo-1", stall_timeout_s=10, first_step_timeout_s=30, exit_timeout_s=exit_timeout_s,
                        local_ranks=local_ranks)


def test_done_marks_left_before_the_trainers_started_do_not_end_them(tmp_path: Path) -> None:
    # The graph-extraction run (precompile_steps) finished in this folder: its "done" marks are there
    # when the real trainers start. They are not the real run's: healthy trainers must not be killed for
    # lingering, and the stall rule must stay on.
    progress_dir = tmp_path / "progress"
    progress_dir.mkdir()
    for rank in (0, 1):
        (progress_dir / f"rank-{rank}").write_text("done 3")
    watch = watch_of(progress_dir, local_ranks=2, exit_timeout_s=0.5)
    assert (watch.progress.marks, watch.progress.done_at) == ({}, None)
    trainers = [stepping_trainer(progress_dir, rank, steps=25) for rank in (0, 1)]  # 2.5 s, five exit timeouts
    outcome = wait_for_trainers(trainers, threading.Event(), abort=watch.abort, finished=watch.finished, saved=watch.saved)
    assert (outcome.status, [trainer.returncode for trainer in trainers]) == (0, [0, 0])  # ended by themselves
    assert watch.look().step == 25 and watch.progress.done == 2
    # An unchanged leftover mark is no progress either: the first-step bound governs, and it runs out.
    (progress_dir / "rank-0").write_text("done 3")
    stale = observe(Progress(since=0.0, seen_at=0.0, stale=read_marks(progress_dir)), read_marks(progress_dir), now=1.0)
    assert (stale.marks, stale.done_at, stale.done) == ({}, None, 0)
    assert trainer_stalled(stale, 31.0, host="algo-1", bound_s=10, first_step_bound_s=30).startswith("TrainerStalled")


def test_the_graph_extraction_run_writes_no_marks_where_the_real_run_writes_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from training.dnn_host import _precompile
    from training.host_environment import PROGRESS_DIR_ENV

    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    tool = tmp_path / "neuron_parallel_compile"
    tool.write_text('#!/bin/sh\nexec "$@"\n')
    tool.chmod(0o755)
    told = [sys.executable, "-c", f"import os, sys; sys.exit(3 if {PROGRESS_DIR_ENV!r} in os.environ else 0)"]
    environment = {"PATH": f"{tmp_path}:{os.environ['PATH']}", PROGRESS_DIR_ENV: str(tmp_path / "progress")}
    assert _precompile(told, environment, threading.Event(), "algo-1") == 0


def test_a_crash_after_every_local_rank_finished_and_saved_leaves_the_host_succeeded(tmp_path: Path) -> None:
    # A teardown crash (NCCL, XLA) after the final barrier: the model and the summary are saved.
    progress_dir = tmp_path / "progress"
    progress_dir.mkdir()
    watch = watch_of(progress_dir, exit_timeout_s=60)
    crashed = stepping_trainer(progress_dir, 0, steps=3, end="os.kill(os.getpid(), signal.SIGSEGV)")
    outcome = wait_for_trainers([crashed], threading.Event(), abort=watch.abort, finished=watch.finished, saved=watch.saved)
    assert (outcome.status, crashed.returncode) == (0, -signal.SIGSEGV)
    # Two local ranks, both done; one crashes as the other lingers in its teardown: killed, the host succeeds.
    progress_dir = tmp_path / "two"
    progress_dir.mkdir()
    watch = watch_of(progress_dir, local_ranks=2, exit_timeout_s=60)
    ranks = [stepping_trainer(progress_dir, 0, steps=3, end="time.sleep(0.5); raise SystemExit(1)"),
             stepping_trainer(progress_dir, 1, steps=3, end="time.sleep(120)")]
    outcome = wait_for_trainers(ranks, threading.Event(), abort=watch.abort, finished=watch.finished, saved=watch.saved, peer_grace_s=30)
    assert (outcome.status, [rank.returncode for rank in ranks]) == (0, [1, -signal.SIGKILL])


def test_a_crash_before_every_local_rank_finished_fails_the_host(tmp_path: Path) -> None:
    progress_dir = tmp_path / "progress"
    progress_dir.mkdir()
    watch = watch_of(progress_dir, local_ranks=2, exit_timeout_s=60)
    ranks = [stepping_trainer(progress_dir, 0, steps=3, end="raise SystemExit(1)"),  # done, then crashed
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])]  # rank 1 never got there
    outcome = wait_for_trainers(ranks, threading.Event(), abort=watch.abort, finished=watch.finished, saved=watch.saved, peer_grace_s=5)
    assert (outcome.status, ranks[0].returncode) == (1, 1)


def test_a_rank_failure_names_the_rank_and_the_signal() -> None:
    assert describe_rank_failure({"rank": 3, "local_rank": 1, "exitcode": -9, "signal": "SIGKILL"}).startswith(
        "rank 3 (local rank 1) was killed by SIGKILL (the kernel's OOM killer"
    )
    assert describe_rank_failure({"rank": 0, "local_rank": 0, "exitcode": 2, "signal": None}) == "rank 0 (local rank 0) exited with status 2"
    assert trainer_failure(-15, None) == "the trainer was killed by SIGTERM"
    assert trainer_failure(1, None) == "the trainer exited with status 1"


def sleeper(handle_sigterm: bool = False) -> subprocess.Popen:
    code = "import signal, time\n"
    if handle_sigterm:  # a rank that takes a while to save before it leaves
        code += "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.5), exit(143)))\n"
    code += "time.sleep(120)\n"
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_the_first_failed_rank_stops_the_others_and_decides_the_status(failing_rank: int) -> None:
    failing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); exit(3)"])
    survivor = sleeper()
    ranks = [failing, survivor] if failing_rank == 0 else [survivor, failing]  # rank 1 failing while rank 0 runs
    outcome = wait_for_trainers(ranks, threading.Event(), peer_grace_s=5)
    assert (outcome.status, outcome.returncode, outcome.abort_reason) == (3, 3, None)
    assert survivor.returncode == -signal.SIGINT  # ended, not left waiting on a dead peer, and not asked to save


def test_sigterm_gives_the_trainers_the_stop_grace_and_a_watchdog_reason_stops_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stop = threading.Event()
    saving = sleeper(handle_sigterm=True)
    threading.Timer(0.5, stop.set).start()
    outcome = wait_for_trainers([saving], stop, stop_grace_s=30, peer_grace_s=0.2)
    assert (outcome.status, saving.returncode) == (143, 143)  # it had its 1.5 s to save: the short grace was not used
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    outcome = wait_for_trainers([sleeper()], threading.Event(), abort=lambda: "the dispatcher is gone")
    assert (outcome.status, outcome.abort_reason) == (1, "the dispatcher is gone")
    assert (tmp_path / "output" / "failure").read_text() == "the dispatcher is gone"


@pytest.mark.parametrize(
    ("outcome", "stopped", "written", "rank_failure", "expected"),
    [
        (TrainersOutcome(0, 0), True, "", None, None),  # SIGTERM during the final save of a finished run
        # The launcher's own reason, not the trainers' "stopped" that it caused.
        (TrainersOutcome(1, 1, "every data host failed: x"), False, "TrainingStopped: stopped by SIGTERM after step 9", None,
         "every data host failed: x"),
        (TrainersOutcome(143, 143), True, "TrainingStopped: stopped by SIGTERM after step 9", None, None),
        (TrainersOutcome(1, 1), True, "RuntimeError: CUDA out of memory", None, None),  # a real failure in the stop window
        (TrainersOutcome(1, 1), True, "", None, "stopped by SIGTERM (StopTrainingJob or a spot interruption) before the trainers reached a step boundary"),
        (TrainersOutcome(1, 1), False, "RuntimeError: gloo: connection closed by peer", "rank 1 (local rank 1) was killed by SIGKILL",
         "rank 1 (local rank 1) was killed by SIGKILL on algo-3"),
        (TrainersOutcome(1, 1), False, "DataServiceUnavailableError: all gone", "rank 0 (local rank 0) exited with status 1", None),
        (TrainersOutcome(137, -9), False, "", None, "the trainer was killed by SIGKILL on algo-3"),
        # A Horovod rank killed by the OOM killer: its peers' dying words are not the cause.
        (TrainersOutcome(137, -9), False, "RuntimeError: gloo: connection closed by peer", None, "the trainer was killed by SIGKILL on algo-3"),
    ],
)
def test_the_failure_reason_is_the_cause_not_its_consequences(outcome, stopped, written, rank_failure, expected) -> None:
    assert failure_to_write(outcome, stopped=stopped, written=written, rank_failure=rank_failure, host="algo-3") == expected


def test_as_the_containers_first_process_it_passes_sigterm_on_and_exits_with_the_launchers_status(tmp_path: Path) -> None:
    marker = tmp_path / "got-sigterm"
    launcher = (
        "import signal, sys, time, subprocess\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1)'])  # left behind: an orphan to reap\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (open({str(marker)!r}, 'w').close(), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    supervisor = subprocess.Popen(
        [sys.executable, "-c", f"import sys; from training.supervisor import supervise; sys.exit(supervise([sys.executable, '-c', {launcher!r}]))"],
        env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )
    assert supervisor.stdout.readline().strip() == "ready"
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=30) == 7 and marker.exists()


def test_a_resuming_run_starts_from_the_earlier_runs_checkpoints_and_a_restart_keeps_its_own(tmp_path: Path) -> None:
    from training.cluster import BASE_DIR_ENV
    from training.dnn_host import seed_checkpoints
    from training.host_environment import HostEnvironment

    host = HostEnvironment.read({BASE_DIR_ENV: str(write_host_tree(tmp_path, hetero_resource_config("algo-3")))})
    earlier = tmp_path / "input" / "data" / "resume"
    (earlier / "rank-0").mkdir(parents=True)
    (earlier / "checkpoint.pt").write_bytes(b"step 60")
    (earlier / "rank-0" / "rng.bin").write_bytes(b"rng")
    assert seed_checkpoints(host) == 2
    assert (tmp_path / "checkpoints" / "checkpoint.pt").read_bytes() == b"step 60"
    # A restart of this run (spot, a retried host) has checkpoints of its own: they are kept.
    (tmp_path / "checkpoints" / "checkpoint.pt").write_bytes(b"step 80")
    assert seed_checkpoints(host) == 0 and (tmp_path / "checkpoints" / "checkpoint.pt").read_bytes() == b"step 80"
    elsewhere = HostEnvironment.read({BASE_DIR_ENV: str(write_host_tree(tmp_path / "elsewhere", hetero_resource_config("algo-3")))})
    assert seed_checkpoints(elsewhere) == 0  # no resume channel: nothing to do
