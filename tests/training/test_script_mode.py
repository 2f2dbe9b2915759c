"""Script mode's parts (training/script_mode.py): step times from a script's lines and the summary they
make, the failure reasons, how the entry point is started, the data host's control plane (a trainer host
whose script ends before a data host is up still reaches it), the emulated hosts' namespaces; the sweep,
the verdict and the dry run of a script job."""

from __future__ import annotations

import copy
import json
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from lambdas.core.results import run_verdict
from lambdas.core.sweep import SweepSpecError, plan_sweep
from training.data_service import data_service_pb2_grpc as pb_grpc
from training.data_service.auth import TokenAuth
from training.data_service.control import request_shutdown
from training.data_service.server import StopReason
from training.hyperparameters import PlatformSettings
from training.local.cluster import EmulationOptions, hosts_file, namespace_command, plan_hosts
from training.metrics import METRIC_DEFINITIONS
from training.script_mode import (
    ScriptError,
    ScriptHostControl,
    StepTiming,
    describe_exit,
    script_command,
    script_failure,
    script_summary,
    step_time_ms,
    tell_data_hosts,
    trainers_gone,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOKEN = "script-mode-token-0123456789"
SHA = "ab" * 32


def settings(**fields) -> PlatformSettings:
    return PlatformSettings(role_map={"data_group": "data", "dnn_group": "dnn"}, workload_sha256=SHA, **fields)


def test_step_times_come_from_the_platforms_lines_or_the_scripts_own_regex() -> None:
    default = StepTiming(METRIC_DEFINITIONS["step_time_ms"])
    assert step_time_ms("step=3/9 loss=1.2 step_time_ms=86.5 data_wait_ms=1.0", default) == 86.5
    assert step_time_ms("warmup_ms=900.0", default) is None and step_time_ms("no_step_time_ms=3", default) is None
    seconds = StepTiming(r"iteration took ([0-9.]+) s", unit="s")
    assert step_time_ms("epoch 1 iteration took 0.25 s", seconds) == 250.0
    assert step_time_ms("iteration took . s", seconds) is None  # captured, but no number


def test_the_summary_leaves_the_warm_up_out_and_bills_the_wall_time_between_steps() -> None:
    timing = StepTiming("x=([0-9.]+)", warmup_steps=2)
    # 5 steps: 2 warm-up (slow), then 3 of 10 ms printed 50 ms apart (40 ms between them were not the step's).
    summary = script_summary([900.0, 800.0, 10.0, 10.0, 10.0], [1.0, 2.0, 2.05, 2.10, 2.15], 0.0, timing, program="train.py", exit_code=0)
    assert summary["timed_steps"] == 3 and summary["warmup_steps"] == 2 and summary["steps"] == 5
    assert summary["step_time_ms"] == {"p50": 10.0, "p90": 10.0, "mean": 10.0}
    assert summary["wall_ms_per_step"] == pytest.approx(50.0)
    assert run_verdict("Completed", summary, None) == ("Completed", None)
    none_timed = script_summary([900.0], [1.0], 0.0, timing, program="train.py", exit_code=0)
    assert none_timed["timed_steps"] == 0 and none_timed["step_time_ms"] is None and none_timed["wall_ms_per_step"] is None
    status, reason = run_verdict("Completed", none_timed, None)
    assert status == "Failed" and reason.startswith("NoStepsTimed: the script printed 1 lines matching its step-time regex 'x=([0-9.]+)'")
    no_warmup = script_summary([5.0, 5.0], [1.0, 2.0], 0.5, StepTiming("x", warmup_steps=0), program="t.py", exit_code=0)
    assert no_warmup["wall_ms_per_step"] == pytest.approx(750.0)  # from the script's start


def test_step_lines_from_every_rank_are_not_taken_for_steps() -> None:
    """Two processes printing 100 ms steps: 20 lines in 1 s would bill 50 ms a step."""
    values = [100.0] * 20
    seen = [0.1 * (index // 2 + 1) for index in range(20)]
    summary = script_summary(values, seen, 0.0, StepTiming("x", warmup_steps=0), program="train.py", exit_code=0)
    assert summary["wall_ms_per_step"] == pytest.approx(50.0) and "print from rank 0 only" in summary["warning"]
    status, reason = run_verdict("Completed", summary, None)
    assert status == "Failed" and reason.startswith("StepLinesNotPerStep")


def test_a_data_host_waits_for_trainer_hosts_still_starting_and_ends_when_each_ended_or_went_silent() -> None:
    trainers = ["algo-2", "algo-3"]

    def verdict(heard: dict, ended: set, now: float):
        return trainers_gone(0.0, heard, ended, trainers, now, idle_timeout_s=10, start_deadline_s=100)

    assert verdict({}, set(), 50) is None
    assert verdict({"algo-2": 1.0}, {"algo-2"}, 50) is None  # algo-3 still starting (pulling, installing): wait
    assert verdict({"algo-2": 1.0}, {"algo-2"}, 101) is StopReason.START_DEADLINE
    assert verdict({"algo-2": 1.0, "algo-3": 45.0}, {"algo-2"}, 50) is None  # algo-3 heard 5 s ago
    assert verdict({"algo-2": 1.0, "algo-3": 30.0}, {"algo-2"}, 50) is StopReason.IDLE  # gone
    assert verdict({"algo-2": 1.0, "algo-3": 49.0}, {"algo-2", "algo-3"}, 50) is StopReason.SHUTDOWN


def test_a_failure_names_the_program_host_group_and_how_it_ended() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(137) == "exited with code 137 (128 + SIGKILL: a process it ran was killed)"
    reason = script_failure("train.py", "algo-2", "dnn_group", -signal.SIGSEGV, ["", "loading", "Traceback", "  x", "Boom", "last"])
    assert reason == ("ScriptFailed: train.py on host algo-2 (instance group dnn_group) was killed by SIGSEGV; "
                      "its last lines: loading | Traceback |   x | Boom | last")
    long = script_failure("train.py", "algo-2", "dnn_group", 1, ["x" * 5000])
    assert len(long) == 1000 and long.endswith("…")  # within SageMaker's FailureReason


def test_the_entry_point_starts_as_the_toolkit_starts_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "run.sh").write_text("")
    assert script_command(settings(script_entry_point="train.py"), tmp_path, ["--lr", "0.1"], python="/py") == ["/py", str(tmp_path / "train.py"), "--lr", "0.1"]
    assert script_command(settings(script_entry_point="run.sh"), tmp_path, ["--a", "1"]) == ["/bin/sh", "-c", '"$0" "$@"', str(tmp_path / "run.sh"), "--a", "1"]
    assert (tmp_path / "run.sh").stat().st_mode & 0o111  # made executable, as the toolkit does: its #! line runs it
    assert script_command(settings(script_command="torchrun t.py --x 1"), tmp_path, ["--lr", "0.1"]) == ["/bin/sh", "-c", "torchrun t.py --x 1"]
    with pytest.raises(ScriptError, match=r"'missing.py' is not in the code folder \(it holds \['run.sh', 'train.py'\]\)"):
        script_command(settings(script_entry_point="missing.py"), tmp_path, [])


def control_server(control: ScriptHostControl) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[TokenAuth(TOKEN)])
    pb_grpc.add_DataServiceServicer_to_server(control, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_data_host_ends_only_once_every_trainer_host_said_so_with_the_jobs_token() -> None:
    control = ScriptHostControl("algo-1", ["algo-2", "algo-3"])
    server, target = control_server(control)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            request_shutdown(target, "not-the-token-of-the-job", "algo-2")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and not control.ended
        request_shutdown(target, TOKEN, "algo-2")
        request_shutdown(target, TOKEN, "intruder")  # holds the token but is no trainer host: not counted
        assert control.verdict(60, 600) is not StopReason.SHUTDOWN
        request_shutdown(target, TOKEN, "algo-3")
        assert control.verdict(60, 600) is StopReason.SHUTDOWN
    finally:
        server.stop(0)


def test_a_trainer_host_whose_script_ended_first_still_reaches_a_data_host_that_comes_up_later() -> None:
    """Found on the emulated cluster: a script that ends in a second told no data host (none was up yet), and
    each waited out its start deadline, billed."""
    control = ScriptHostControl("algo-1", ["algo-2"])
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    servers = []

    def late() -> None:
        time.sleep(2.0)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[TokenAuth(TOKEN)])
        pb_grpc.add_DataServiceServicer_to_server(control, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)

    thread = threading.Thread(target=late)
    thread.start()
    try:
        assert tell_data_hosts([f"127.0.0.1:{port}"], TOKEN, "algo-2", deadline_s=60.0, retry_s=0.2) == ["algo-1"]
        assert control.verdict(60, 600) is StopReason.SHUTDOWN
    finally:
        thread.join()
        for server in servers:
            server.stop(0)
    assert tell_data_hosts([f"127.0.0.1:{port}"], TOKEN, "algo-2", deadline_s=0.5, retry_s=0.2) == []  # gone: gives up at its deadline
    started = time.monotonic()  # one that answered keep-alives and answers no more is gone: asked briefly
    assert tell_data_hosts([f"127.0.0.1:{port}"], TOKEN, "algo-2", deadline_s=60, gone_after_s=0.5, retry_s=0.2,
                           heard={f"127.0.0.1:{port}"}) == []
    assert time.monotonic() - started < 10


def test_the_emulated_hosts_resolve_each_other_in_namespaces_of_their_own(tmp_path: Path) -> None:
    from lambdas.core.job_spec import validate_job_spec

    spec = validate_job_spec(json.loads((EXAMPLES / "pytorch-script.json").read_text()))
    hosts = plan_hosts(spec, EmulationOptions(workdir=tmp_path, channels={}), [0, 1], subnet=77)
    text = hosts_file(hosts, "127.0.0.1\tlocalhost\n")
    assert text == "# the emulated cluster's hosts\n127.0.77.2\talgo-1\n127.0.77.3\talgo-2\n127.0.0.1\tlocalhost\n"
    command = namespace_command(tmp_path / "hosts", "algo-2", hosts[1].base_dir, tmp_path / "s", ["python", "-m", "x"], root=True)
    assert command[:5] == ["unshare", "--mount", "--uts", "--", "/bin/sh"] and command[-3:] == ["python", "-m", "x"]
    assert "--map-root-user" in namespace_command(tmp_path / "hosts", "algo-2", tmp_path, tmp_path, ["x"], root=False)


def test_a_sweep_of_a_script_keeps_its_data_groups_name_and_its_routing() -> None:
    base = json.loads((EXAMPLES / "pytorch-script.json").read_text())
    base["workload"] = {"code": "s3://results-bucket/code/" + SHA + "/sourcedir.tar.gz", "sha256": SHA, "entry_point": "train.py"}
    base["instance_groups"][0]["name"] = "feeders"
    base["inputs"]["train"]["groups"] = ["feeders"]
    plan = plan_sweep({"sweep_name": "script-sweep", "base": base, "data_hosts": [0, 1, 2]})
    specs = {spec["run_name"]: spec for spec in plan.configurations}
    assert [group["name"] for group in specs["existing-script-hetero-d2"]["instance_groups"]] == ["feeders", "dnn_group"]
    assert specs["existing-script-hetero-d2"]["instance_groups"][0]["count"] == 2
    assert specs["existing-script-hetero-d2"]["inputs"]["train"]["groups"] == ["feeders"]
    assert [group["name"] for group in specs["existing-script-hetero-d0"]["instance_groups"]] == ["dnn_group"]
    advised = copy.deepcopy({"sweep_name": "script-sweep", "base": base, "advisor": {"images_per_s_per_vcpu": 100, "train_ms_per_step": 50}})
    with pytest.raises(SweepSpecError, match="list the sizes to run in data_hosts"):
        plan_sweep(advised)


def test_the_dry_run_of_a_script_checks_its_entry_point_and_that_it_compiles(tmp_path: Path) -> None:
    from lambdas.core.job_spec import validate_job_spec
    from training.workload.code import CodeError
    from training.workload.dry_run import dry_run

    raw = json.loads((EXAMPLES / "pytorch-script.json").read_text())
    report = dry_run(validate_job_spec(raw), EXAMPLES / "scripts" / "grpc_feed", {})
    assert report["script"] == "train.py" and report["compiles"] and report["files"] == 1
    (tmp_path / "train.py").write_text("def broken(:\n")
    with pytest.raises(CodeError, match="train.py does not compile: invalid syntax at line 1"):
        dry_run(validate_job_spec(raw), tmp_path, {})
    raw["workload"]["entry_point"] = "src/train.py"
    with pytest.raises(CodeError, match=r"'src/train.py' is not in .* as it is packed \(it holds \['train.py'\]"):
        dry_run(validate_job_spec(raw), tmp_path, {})
