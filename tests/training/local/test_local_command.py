"""`hetero local` (training/local/__main__.py) as a user meets it: what goes to stdout and stderr, the
refusals of its channels before any host starts, its deadline, and Ctrl-C or SIGTERM leaving nothing
running. The pure parts first, then real emulated clusters started as a user starts them."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from lambdas.core.job_spec import validate_job_spec
from training.local.__main__ import HostLines, emulated_cost_per_1k_steps, job_table, progress_text
from training.local.cluster import (
    HOST_TAG_ENV,
    ClusterResult,
    EmulatedCluster,
    EmulatedHost,
    EmulationError,
    EmulationOptions,
    HostOutcome,
    LineWatcher,
    check_channels,
    orphan_deadline,
)

from ..test_stop_signals import as_if_started_in_the_background
from .test_cluster import spec

REPO = Path(__file__).resolve().parents[3]
SUMMARY = {"steps": 12, "timed_steps": 10, "step_time_ms": {"p50": 12.0, "p90": 14.0, "mean": 12.5}, "wall_ms_per_step": 15.0,
           "samples_per_s": 580.0, "data_wait_ms": {"p50": 0.5, "p90": 1.0, "mean": 0.6}}


def host(name: str, group: str, role: str) -> EmulatedHost:
    return EmulatedHost(name, group, group, role, "ml.p3.2xlarge" if role == "dnn" else "ml.c5.9xlarge", "127.0.0.2", (0,), Path("/x"))


# Channels, refused before anything starts ------------------------------------------------------------


def test_a_missing_channel_folder_is_named_as_missing(tmp_path: Path) -> None:
    with pytest.raises(EmulationError, match=f"the folder {tmp_path / 'nope'} does not exist"):
        check_channels(["train"], {"train": tmp_path / "nope"})
    (tmp_path / "file").write_text("")
    with pytest.raises(EmulationError, match="is a file, not a folder"):
        check_channels(["train"], {"train": tmp_path / "file"})
    check_channels(["train"], {"train": tmp_path})


def test_a_channel_the_spec_lacks_names_the_nearest_one_it_has(tmp_path: Path) -> None:
    with pytest.raises(EmulationError, match=r"did you mean --channel train=.*\? it has \['train', 'validation'\]"):
        check_channels(["train", "validation"], {"trian": tmp_path, "validation": tmp_path})
    with pytest.raises(EmulationError) as far:
        check_channels(["train"], {"zzz": tmp_path})
    assert "did you mean" not in str(far.value)


def local(*args: str, timeout: float = 120, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero.cli", "local", *args], cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=timeout, **popen)


def test_hetero_local_refuses_a_missing_folder_before_any_host_starts(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec(data_hosts=1)))
    result = local(str(path), "--channel", f"train={tmp_path / 'absent'}", "--workdir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: EmulationError: --channel train={tmp_path / 'absent'}: the folder {tmp_path / 'absent'} does not exist"
    assert result.stdout == "" and not (tmp_path / "run" / "logs").exists()  # nothing planned, nothing started


# Deadline and orphans --------------------------------------------------------------------------------


def test_the_deadline_is_the_specs_max_runtime_unless_one_is_given(tmp_path: Path) -> None:
    raw = spec(data_hosts=1) | {"max_runtime_s": 900}
    cluster = EmulatedCluster(validate_job_spec(raw), EmulationOptions(workdir=tmp_path, channels={}))
    assert cluster.deadline_s == 900.0
    given = EmulatedCluster(validate_job_spec(raw), EmulationOptions(workdir=tmp_path, channels={}, deadline_s=30))
    assert given.deadline_s == 30.0


def test_a_data_host_whose_dnn_group_never_trained_has_its_start_deadline_before_it_is_an_orphan(tmp_path: Path) -> None:
    options = EmulationOptions(workdir=tmp_path, channels={}, orphan_grace_s=30, data_start_deadline_s=120)
    assert orphan_deadline(1000.0, options, trained=True) == 1030.0
    assert orphan_deadline(1000.0, options, trained=False) == 1150.0


# Output ----------------------------------------------------------------------------------------------


def test_completed_failed_timed_out_and_stopped_are_four_outcomes_each_with_its_exit_status(tmp_path: Path) -> None:
    from training.local.__main__ import write_result
    from training.local.cluster import EXIT_STATUS

    def outcomes(dnn_exit: int, failure: str = "") -> list[HostOutcome]:
        return [HostOutcome(host("algo-1", "data_group", "data"), exit_code=0),
                HostOutcome(host("algo-2", "dnn_group", "dnn"), exit_code=dnn_exit, failure=failure)]

    completed = ClusterResult(outcomes(0), elapsed_s=9.0)
    failed = ClusterResult(outcomes(1, "AlgorithmError: boom"), elapsed_s=9.0)
    timed_out = ClusterResult(outcomes(-9), elapsed_s=9.0, deadline_exceeded=True)
    stopped = ClusterResult(outcomes(143, "TrainingStopped: stopped by SIGTERM after step 7 of 100; checkpoint and model saved"),
                            elapsed_s=9.0, stopped_by="Ctrl-C")
    assert [result.status for result in (completed, failed, timed_out, stopped)] == ["Completed", "Failed", "TimedOut", "Stopped"]
    assert [result.ok for result in (completed, failed, timed_out, stopped)] == [True, False, False, False]
    assert [EXIT_STATUS.get(result.status) for result in (completed, failed, timed_out)] == [0, 1, 124]
    assert [result.report().splitlines()[-1] for result in (completed, failed, timed_out, stopped)] == [
        "cluster succeeded in 9.0 s", "cluster FAILED in 9.0 s", "cluster TIMED OUT (its deadline) in 9.0 s", "cluster STOPPED (Ctrl-C) in 9.0 s"]
    write_result(tmp_path / "result.json", stopped, None, stopped.status, None, 130)
    document = json.loads((tmp_path / "result.json").read_text())
    assert (document["status"], document["exit_status"], document["reason"]) == ("Stopped", 130, stopped.outcomes[1].failure)
    write_result(tmp_path / "result.json", completed, {"steps": 12}, completed.status, None, 0)
    assert json.loads((tmp_path / "result.json").read_text())["reason"] is None


def test_the_result_is_a_short_table_of_hosts_and_the_jobs_figures_with_an_emulated_cost(tmp_path: Path) -> None:
    job = validate_job_spec(spec(data_hosts=1))
    result = ClusterResult([HostOutcome(host("algo-1", "data_group", "data"), exit_code=0),
                            HostOutcome(host("algo-2", "dnn_group", "dnn"), exit_code=0)], elapsed_s=15.2)
    table = job_table(result, job, SUMMARY, tmp_path).splitlines()
    assert len(table) <= 10
    assert table[1].split()[:4] == ["algo-1", "data_group", "data", "0"] and table[2].split()[:4] == ["algo-2", "dnn_group", "dnn", "0"]
    rows = {line[:24].strip(): line[24:] for line in table[4:]}
    assert rows["step time p50"] == "12.0 ms" and rows["samples/s"] == "580.0" and rows["data wait p50"] == "0.5 ms"
    # ml.c5.9xlarge $1.836/h + ml.p3.2xlarge $3.825/h = $5.661/h, for 15 ms per step: $0.0236 per 1k steps.
    cost, basis = emulated_cost_per_1k_steps(job, SUMMARY)
    assert cost == pytest.approx(5.661 * 15.0 / 3600)
    assert rows["$ per 1k steps"].startswith(f"${cost:.4f} (emulated: 15.0 ms per step at $5.661/h") and "fallback prices" in basis
    assert table[-1] == f"host trees and logs: {tmp_path} (logs/<host>.log)"
    assert table[-2].startswith("p50: the median training step") and "data wait:" in table[-2] and "$ per 1k steps:" in table[-2]


def test_a_spec_without_fallback_prices_says_so_instead_of_a_cost() -> None:
    raw = json.loads((REPO / "examples" / "neuron-trn1-2xlarge.json").read_text())  # the fallback table has no Trainium
    cost, basis = emulated_cost_per_1k_steps(validate_job_spec(raw), SUMMARY)
    assert cost is None and "ml.trn1.2xlarge" in basis


def test_host_lines_go_to_the_stream_and_progress_is_drawn_only_when_live() -> None:
    clock = iter([0.0, 10.0, 20.0]).__next__
    piped, terminal = io.StringIO(), io.StringIO()
    dnn = host("algo-2", "dnn_group", "dnn")
    for lines in (HostLines(piped, live=False, clock=clock), HostLines(terminal, live=True, clock=iter([0.0, 10.0]).__next__)):
        lines(host("algo-1", "data_group", "data"), "serving \x1b[1mchannel\x1b[0m")
        lines(dnn, "step=10/110 loss=1.0")
        lines(dnn, "step=20/110 loss=0.9")
        lines.finish()
    assert piped.getvalue() == "[algo-1 data_group] serving channel\n[algo-2 dnn_group] step=10/110 loss=1.0\n[algo-2 dnn_group] step=20/110 loss=0.9\n"
    drawn = terminal.getvalue()
    assert "step 20/110, ETA 1:30" in drawn and drawn.endswith("\r\x1b[K")  # 90 steps left at 1 step/s, then cleared
    assert progress_text(5, 10, None) == "step 5/10, ETA –"


# Real clusters, started as a user starts them --------------------------------------------------------


def spec_file(tmp_path: Path, steps: int) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec(data_hosts=1, steps=steps)))
    return path


@pytest.mark.cluster
def test_stdout_is_the_table_or_with_json_the_summary_alone_and_the_logs_go_to_stderr(tmp_path: Path, images: Path) -> None:
    path = spec_file(tmp_path, steps=12)
    shown = local(str(path), "--channel", f"train={images}", "--workdir", str(tmp_path / "a"))
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert len(shown.stdout.splitlines()) <= 10 and "[algo-" not in shown.stdout and "{" not in shown.stdout
    assert "step time p50" in shown.stdout and "(emulated:" in shown.stdout
    assert "[algo-2 dnn_group] step=12/12" in shown.stderr and "\x1b[K" not in shown.stderr  # stderr is no terminal here
    assert (tmp_path / "a" / "logs" / "algo-2.log").read_text().count("step=") >= 10
    scripted = local(str(path), "--channel", f"train={images}", "--workdir", str(tmp_path / "b"), "--json")
    assert scripted.returncode == 0, scripted.stderr[-3000:]
    summary = json.loads(scripted.stdout)
    assert summary["steps"] == 12 and summary["step_time_ms"]["p50"] > 0


def emulated_processes(parent: int) -> list[psutil.Process]:
    """Every process of an emulated host of the cluster that process ``parent`` runs (the cluster's id,
    in each host's tag, starts with its pid), wherever it was reparented."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(HOST_TAG_ENV, "").startswith(f"{parent}-"):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def started_local(tmp_path: Path, images: Path, workdir: Path, *, in_the_background: bool) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """`hetero local` of a long job (1 data host), running until its DNN host has trained a step: the process
    and every process of its hosts. ``in_the_background``: started as a background job of a
    non-interactive shell is (a CI runner, `nohup … &`), with SIGINT inherited as ignored."""
    command = [sys.executable, "-m", "hetero.cli", "local", str(spec_file(tmp_path, steps=100_000)), "--channel", f"train={images}",
               "--workdir", str(workdir)]
    errors = (tmp_path / "stderr").open("w")
    process = subprocess.Popen(as_if_started_in_the_background(command) if in_the_background else command, cwd=REPO,
                               env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=errors, text=True)
    errors.close()
    give_up = time.monotonic() + 120
    log = workdir / "logs" / "algo-2.log"
    while not (log.exists() and "step=" in log.read_text()) and time.monotonic() < give_up and process.poll() is None:
        time.sleep(0.5)
    hosts = psutil.Process(process.pid).children(recursive=True) + emulated_processes(process.pid)
    assert len(hosts) >= 2, (tmp_path / "stderr").read_text()[-3000:]
    return process, hosts


@pytest.mark.cluster
def test_ctrl_c_stops_as_stop_training_job_and_the_run_resumes_from_its_checkpoint(tmp_path: Path, images: Path) -> None:
    """Ctrl-C, to a `hetero local` started in the background (SIGINT inherited as ignored, the strictest
    case): SIGTERM to every host, the DNN host saves a checkpoint and the model, every host exits, the
    run is Stopped (exit 130, the table, result.json); then --resume-from its folder carries it on."""
    workdir = tmp_path / "run"
    process, hosts = started_local(tmp_path, images, workdir, in_the_background=True)
    try:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 130
    finally:
        if process.poll() is None:
            process.kill()
    _, alive = psutil.wait_procs(hosts, timeout=10)
    assert alive == [] and emulated_processes(process.pid) == []
    said, table = (tmp_path / "stderr").read_text(), process.stdout.read()
    assert ("Ctrl-C: stopping the emulated cluster as StopTrainingJob does: SIGTERM to algo-1 (data_group, data), algo-2 (dnn_group, dnn)"
            in said), said[-3000:]
    assert "cluster STOPPED (Ctrl-C)" in table and "Traceback" not in said
    result = json.loads((workdir / "result.json").read_text())
    assert (result["status"], result["stopped_by"], result["exit_status"]) == ("Stopped", "Ctrl-C", 130)
    stopped = int(re.search(r"TrainingStopped: stopped by SIGTERM after step (\d+)", result["reason"]).group(1))
    assert f"--resume-from {workdir}" in said
    # Carried on in a new folder: the earlier run's checkpoint seeds it, and it trains only the steps left.
    resumed = local(str(tmp_path / "spec.json"), "--channel", f"train={images}", "--workdir", str(tmp_path / "resumed"),
                    "--resume-from", str(workdir), "--set", f"steps={stopped + 3}", "--json", timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert (summary["start_step"], summary["steps"]) == (stopped, stopped + 3)
    assert json.loads((tmp_path / "resumed" / "result.json").read_text())["status"] == "Completed"


@pytest.mark.cluster
def test_a_second_stop_kills_every_host_at_once(tmp_path: Path, images: Path) -> None:
    """SIGTERM (a scheduler's, `kill`) starts the stop; Ctrl-C during its grace kills every host now."""
    workdir = tmp_path / "run"
    process, hosts = started_local(tmp_path, images, workdir, in_the_background=False)
    try:
        process.send_signal(signal.SIGTERM)
        give_up = time.monotonic() + 30
        while "stopping the emulated cluster" not in (tmp_path / "stderr").read_text() and time.monotonic() < give_up:
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 143  # the stop's own status: the first signal's
    finally:
        if process.poll() is None:
            process.kill()
    _, alive = psutil.wait_procs(hosts, timeout=10)
    assert alive == [] and emulated_processes(process.pid) == []
    said = (tmp_path / "stderr").read_text()
    assert f"Ctrl-C: killed the emulated cluster at once: algo-1 (data_group, data), algo-2 (dnn_group, dnn); host trees and logs: {workdir}" in said
    assert "Traceback" not in said


def test_a_resume_from_a_folder_without_a_checkpoint_is_refused_before_any_host_starts(tmp_path: Path, images: Path) -> None:
    refused = local(str(spec_file(tmp_path, steps=12)), "--channel", f"train={images}", "--workdir", str(tmp_path / "run"),
                    "--resume-from", str(tmp_path / "nothing-here"))
    assert refused.returncode == 2 and "--resume-from" in refused.stderr and "no checkpoint in" in refused.stderr
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.cluster
def test_a_data_host_left_without_a_client_ends_at_its_start_deadline_and_is_no_orphan(tmp_path: Path, images: Path) -> None:
    """The DNN host dies before its trainer connects: the data host waits for a client until its start
    deadline (10 s here), then exits 3 on its own, as documented; later than the orphan grace (5 s) after
    the DNN group ended, but not an orphan."""
    watcher = LineWatcher()
    options = EmulationOptions(workdir=tmp_path, channels={"train": images}, data_start_deadline_s=10, orphan_grace_s=5)
    cluster = EmulatedCluster(validate_job_spec(spec(data_hosts=1, steps=10_000)), options, on_line=watcher)
    cluster.start()
    try:
        watcher.wait_for("algo-2", r"role dnn")
        cluster.kill("algo-2")
        result = cluster.wait()
    finally:
        cluster.close()
    data = result.outcome("algo-1")
    assert result.orphans == [] and not data.orphaned and data.exit_code == 3, result.report()
    assert any("stopping (start deadline)" in line for line in watcher.of("algo-1"))
    assert "ORPHAN" not in result.report()


# A runtime `make venv` does not build ----------------------------------------------------------------

# This interpreter as a machine without Horovod: its import is refused, as on an environment where
# `make horovod` never ran (the suite's own has it).
WITHOUT_HOROVOD = """
import runpy, sys
class NoHorovod:
    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoHorovod())
sys.argv = ["hetero", *sys.argv[1:]]
runpy.run_module("hetero.cli", run_name="__main__")
"""


def test_without_horovod_a_horovod_job_is_refused_at_once_naming_make_horovod_and_validate_says_so(tmp_path: Path) -> None:
    from training.local.cluster import missing_runtime

    assert missing_runtime("torchrun") is None and missing_runtime("horovod", find=lambda _module: object()) is None
    assert "run `make horovod`" in missing_runtime("horovod", find=lambda _module: None)
    spec = REPO / "examples" / "tensorflow-homogeneous.json"

    def hetero(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", WITHOUT_HOROVOD, *args], cwd=tmp_path, env=os.environ | {"PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=120)

    run = hetero("local", str(spec), "--channel", f"train={tmp_path}", "--workdir", str(tmp_path / "run"))
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: EmulationError: distribution 'horovod' runs its trainers with horovod") and "run `make horovod`" in run.stderr
    assert not (tmp_path / "run" / "logs").exists()  # nothing planned, nothing started
    checked = hetero("validate", str(spec))
    assert checked.returncode == 0, checked.stdout + checked.stderr  # a valid spec: the platform's image has Horovod
    assert "ok" in checked.stdout and "note: not on this machine yet" in checked.stdout and "make horovod" in checked.stdout
    assert "note" not in hetero("validate", str(REPO / "examples" / "pytorch-homogeneous.json")).stdout


def test_the_emulators_commands_parse_and_show_their_options_under_the_hetero_name_the_user_typed(tmp_path: Path) -> None:
    """`hetero local`, `hetero demo`, `hetero profile`: one entry point; each error's usage names it."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec(data_hosts=1)))
    typo = local(str(path), "--chanel", f"train={tmp_path}")
    assert typo.returncode == 2 and "usage: hetero local" in typo.stderr and "hetero local: error: unrecognized arguments: --chanel" in typo.stderr
    assert "python -m training.local" not in typo.stderr

    def hetero(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hetero.cli", *args], cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=60)

    shown = hetero("demo", "--help")
    assert shown.returncode == 0 and "usage: hetero demo" in shown.stdout and "--workload WORKLOAD" in shown.stdout and "--steps" in shown.stdout
    wrong = hetero("demo", "--stepz", "3")
    assert wrong.returncode == 2 and "hetero demo: error: unrecognized arguments: --stepz 3" in wrong.stderr
    assert "usage: hetero profile" in hetero("profile", str(path), "--batchez", "2").stderr


def test_temporary_work_folders_keep_the_newest_of_each_run_name_and_never_one_given_or_not_ours(tmp_path: Path) -> None:
    from training.local.__main__ import TEMPORARY_MARK, prune_temporary_workdirs, temporary_workdir

    made = []
    for _ in range(4):
        made.append(temporary_workdir("run", parent=tmp_path))
        time.sleep(0.01)  # distinct mtimes: the order they were made in
    longer = temporary_workdir("run-fast", parent=tmp_path)  # another run name that starts the same
    given = tmp_path / "run-mine1234"  # a folder the user named (no mark): never ours to remove
    given.mkdir()
    removed = prune_temporary_workdirs("run", keep=3, parent=tmp_path, spare=(made[-1],))
    assert removed == [made[0]] and [folder.exists() for folder in made] == [False, True, True, True]  # three kept, this one included
    assert given.exists() and longer.exists() and (made[-1] / TEMPORARY_MARK).read_text().strip() == "run"
    # The folder a run resumes from is spared, even when it is the oldest; it counts against keep.
    assert prune_temporary_workdirs("run", keep=2, parent=tmp_path, spare=(made[-1], made[1])) == [made[2]]
    assert made[1].exists() and made[3].exists()


def test_a_refused_run_leaves_no_temporary_folder_behind(tmp_path: Path) -> None:
    from training.local.__main__ import is_temporary_workdir_of

    path = tmp_path / "spec.json"
    raw = spec(data_hosts=1) | {"run_name": "prune-check-" + os.urandom(3).hex()}
    path.write_text(json.dumps(raw))
    before = set(Path(tempfile.gettempdir()).glob(raw["run_name"] + "-*"))
    refused = local(str(path), "--channel", f"train={tmp_path / 'absent'}")
    assert refused.returncode == 2 and set(Path(tempfile.gettempdir()).glob(raw["run_name"] + "-*")) == before  # none left behind
    assert local(str(path), "--keep-runs", "0").returncode == 2
    assert not is_temporary_workdir_of(tmp_path, raw["run_name"])
