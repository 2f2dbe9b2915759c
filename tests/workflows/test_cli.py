"""The `hetero` command against the real synthesized state machines (the workflow harness: moto's Step
Functions interpreter running our Lambda handlers, moto's SageMaker scripted), with the stack's outputs
in moto's CloudFormation as `cdk deploy` leaves them: start, follow, list, show, stop, logs, report, and
the refusals and missing stacks or credentials a user meets."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import boto3
import pytest
from typer.testing import CliRunner

from hetero.cli import app
from tests.infra.conftest import REGION
from tests.lambdas.conftest import ENVIRONMENT, RESULTS_BUCKET
from tests.workflows.conftest import EXAMPLES, SPEC, Scenario

SUMMARY = {"timed_steps": 100, "step_time_ms": {"p50": 184.0, "p90": 190.0, "mean": 186.0}, "samples_per_s": 347.8}
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
LAUNCH_SETTINGS = ("JOB_NAME_PREFIX", "IMAGE_URIS", "SAGEMAKER_ROLE_ARN", "OUTPUT_S3_URI", "CHECKPOINT_S3_URI", "CONTROL_S3_URI",
                   "INPUT_BUCKETS", "RUN_COST_CEILING_USD", "SWEEP_COST_CEILING_USD", "CEILING_PRICES")


def runner() -> CliRunner:
    return CliRunner()


def deploy(harness) -> None:
    """The stack's outputs, as the platform's stack has them."""
    template = {
        "Resources": {"Queue": {"Type": "AWS::SQS::Queue"}},
        "Outputs": {"TrainingRunStateMachine": {"Value": harness.state_machine_arn},
                    "BenchmarkSweepStateMachine": {"Value": harness.sweep_arn},
                    "ResultsBucket": {"Value": RESULTS_BUCKET},
                    # The launch function's settings (tests/infra checks the stack exports exactly those).
                    "LaunchSettings": {"Value": json.dumps({key: ENVIRONMENT[key] for key in LAUNCH_SETTINGS})}},
    }
    boto3.client("cloudformation", region_name=REGION).create_stack(StackName="HeteroTrainingPlatform", TemplateBody=json.dumps(template))


def spec_file(tmp_path: Path, spec: dict = SPEC) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def write_logs(harness, lines_by_host: dict[str, list[str]], timeout_s: float = 30) -> threading.Thread:
    """Once the run's job exists, write its hosts' log lines as SageMaker does (stream <job>/<host>-<time>)."""

    def write() -> None:
        give_up = time.monotonic() + timeout_s
        while not harness.training_jobs() and time.monotonic() < give_up:
            time.sleep(0.05)
        job = harness.training_jobs()[0]
        logs = boto3.client("logs", region_name=REGION)
        try:
            logs.create_log_group(logGroupName=LOG_GROUP)
        except logs.exceptions.ResourceAlreadyExistsException:
            pass
        now = int(time.time() * 1000)
        for host, lines in lines_by_host.items():
            stream = f"{job}/{host}-1764000000"
            logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
            logs.put_log_events(logGroupName=LOG_GROUP, logStreamName=stream,
                                logEvents=[{"timestamp": now + index, "message": line} for index, line in enumerate(lines)])

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


HOST_LINES = {
    "algo-1": ["host algo-1 is in instance group data_group (ml.c5.9xlarge): role data", "data host algo-1 serving channel 'train'"],
    "algo-2": ["host algo-2 is in instance group dnn_group (ml.p3.2xlarge): role dnn",
               "step=5/10 loss=1.2 step_time_ms=190.0 data_wait_ms=2.0 samples_per_s=340.0",
               "step=10/10 loss=0.9 step_time_ms=184.0 data_wait_ms=1.0 samples_per_s=347.8"],
}


def test_run_follow_shows_the_job_its_steps_and_the_result_and_exits_0(run, tmp_path: Path) -> None:
    # The job ends once the CLI has seen it running (it polls every second), however late its first poll.
    harness = run(Scenario(summary=SUMMARY, runs_for_s=0.5, ends_once_followed=True))
    deploy(harness)
    write_logs(harness, HOST_LINES)
    result = runner().invoke(app, ["run", str(spec_file(tmp_path)), "--name", "cli-ok", "--follow", "--poll-s", "1"])
    assert result.exit_code == 0, result.output + result.stderr
    assert "started run cli-ok" in result.stderr and "10/10 steps" in result.stderr
    assert "job: InProgress" in result.stderr and "SUCCEEDED" in result.stderr
    assert "184.0 / 190.0 ms" in result.stdout and "Completed" in result.stdout
    assert harness.result("cli-ok")["status"] == "Completed"


def test_run_follow_of_a_failing_run_shows_why_and_exits_1(run, tmp_path: Path) -> None:
    harness = run(Scenario(final_status="Failed", failure_reason="AlgorithmError: trainer exited with 137"))
    deploy(harness)
    result = runner().invoke(app, ["run", str(spec_file(tmp_path)), "--name", "cli-bad", "--follow", "--poll-s", "1", "--json"])
    assert result.exit_code == 1, result.output
    assert "FAILED" in result.stderr
    document = json.loads(result.stdout)
    assert document["run"] == "cli-bad" and document["status"] == "FAILED" and document["error"] == "TrainingJobFailed"
    assert document["result"]["failure_reason"].startswith("AlgorithmError")


def test_a_run_refused_by_the_deployment_before_any_job_says_why(run, tmp_path: Path) -> None:
    """Offline validation passes; the deployment's cost ceiling refuses it at the start."""
    harness = run(Scenario())
    deploy(harness)
    costly = SPEC | {"max_runtime_s": 5 * 24 * 3600, "instance_groups": [
        SPEC["instance_groups"][0], SPEC["instance_groups"][1] | {"instance_type": "ml.p4d.24xlarge", "count": 20}]}
    result = runner().invoke(app, ["run", str(spec_file(tmp_path, costly)), "--name", "cli-costly", "--follow", "--poll-s", "1"])
    assert result.exit_code == 1
    assert "InvalidJobSpec" in result.stderr and "above the ceiling of $1,000.00" in result.stderr.replace("\n", " ")
    assert harness.training_jobs() == []


def test_text_from_outside_is_shown_as_it_is_and_json_stays_json(run, tmp_path: Path) -> None:
    """Log lines, failure reasons and spec fields are text, not Rich markup; --json is plain JSON even
    when colour is forced."""
    harness = run(Scenario(final_status="Failed", failure_reason="expected input[batch, 3, 224, 224] got [b, 1] [/]"))
    deploy(harness)
    write_logs(harness, {"algo-1": ["[rank0]: RuntimeError: bad [/] :thumbs_up:"]})
    assert runner().invoke(app, ["run", str(spec_file(tmp_path)), "--name", "cli-text", "--follow", "--poll-s", "1"]).exit_code == 1
    lines = runner().invoke(app, ["logs", "cli-text"])
    assert lines.exit_code == 0 and "[algo-1] [rank0]: RuntimeError: bad [/] :thumbs_up:" in lines.stdout
    shown = runner().invoke(app, ["show", "cli-text"], terminal_width=200)
    assert "expected input[batch, 3, 224, 224] got [b, 1] [/]" in shown.stdout
    odd = spec_file(tmp_path, SPEC | {"[/]": 1})
    checked = runner().invoke(app, ["validate", str(odd), "--json"], env={"FORCE_COLOR": "1"})
    assert checked.exit_code == 2 and json.loads(checked.stdout)[0]["field"] == "[/]"


def test_runs_show_and_stop(run, tmp_path: Path) -> None:
    harness = run(Scenario(summary=SUMMARY, runs_for_s=30))
    deploy(harness)
    long_name = "vision-hetero-" + "x" * 50 + "-20261201-101500"  # a long id, as the default names are
    started = runner().invoke(app, ["run", str(spec_file(tmp_path)), "--name", long_name, "--quiet"])
    assert started.exit_code == 0 and started.stdout.strip() == long_name
    listed = runner().invoke(app, ["runs", "--json"])
    assert listed.exit_code == 0 and [row["run"] for row in json.loads(listed.stdout)] == [long_name]
    assert json.loads(listed.stdout)[0]["status"] == "RUNNING"
    table = runner().invoke(app, ["runs"], terminal_width=80)
    assert f"{long_name}\tRUNNING\t" in table.stdout  # a pipe gets whole ids, tab-separated: what the other commands take
    assert runner().invoke(app, ["stop", long_name]).exit_code == 0
    assert harness.wait(harness.state_machine_arn.replace(":stateMachine:", ":execution:") + f":{long_name}", timeout_s=30)["status"] == "ABORTED"
    # Another run of its own name (the platform refuses a run name whose job is still running).
    started = runner().invoke(app, ["run", str(spec_file(tmp_path, SPEC | {"run_name": "second"})), "--name", "cli-long", "--quiet"])
    shown = runner().invoke(app, ["show", "cli-long", "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["status"] == "RUNNING"
    stopped = runner().invoke(app, ["stop", "cli-long"])
    assert stopped.exit_code == 0 and "stopping cli-long" in stopped.stdout
    assert harness.wait(harness.state_machine_arn.replace(":stateMachine:", ":execution:") + ":cli-long", timeout_s=30)["status"] == "ABORTED"
    again = runner().invoke(app, ["stop", "cli-long"])
    assert again.exit_code == 1 and "is not running (ABORTED)" in again.stderr
    unknown = runner().invoke(app, ["show", "no-such-run"])
    assert unknown.exit_code == 1 and "no run 'no-such-run'" in unknown.stderr


def test_run_direct_without_the_sdk_sends_the_builders_request_by_boto3_and_says_so(run, tmp_path: Path) -> None:
    """This environment has no SageMaker SDK (tests/sdk/ checks the SDK's path in .venv-sdk)."""
    harness = run(Scenario(summary=SUMMARY))
    deploy(harness)
    elsewhere = SPEC | {"inputs": {"train": {"s3_uri": "s3://someone-elses-bucket/x/", "groups": ["data_group"]}}}
    refused = runner().invoke(app, ["run", str(spec_file(tmp_path, elsewhere)), "--direct"])
    assert refused.exit_code == 2 and "inputs.train" in refused.stderr and harness.training_jobs() == []
    started = runner().invoke(app, ["run", str(spec_file(tmp_path)), "--direct", "--name", "direct-1"])
    assert started.exit_code == 0, started.output
    (job,) = harness.training_jobs()
    assert started.stdout.strip() == job and job.startswith("hetero-vision-hetero-")
    assert "sent by boto3" in started.stderr and "sagemaker-train is not installed" in started.stderr
    described = harness.sagemaker.describe_training_job(TrainingJobName=job)
    assert described["InputDataConfig"][-1]["DataSource"]["S3DataSource"]["S3Uri"] == f"s3://{RESULTS_BUCKET}/control/direct.runs/direct-1/"
    assert harness.s3.get_object(Bucket=RESULTS_BUCKET, Key="control/direct.runs/direct-1/shutdown_token")["Body"].read()
    shown = runner().invoke(app, ["show", job, "--direct", "--json"])  # moto's job completed at once, without figures
    assert shown.exit_code == 0 and json.loads(shown.stdout)["failure_reason"].startswith("NoSummary")
    stopped = runner().invoke(app, ["stop", job, "--direct"])
    assert stopped.exit_code == 1 and "is not running (Completed)" in stopped.stderr
    write_logs(harness, {"algo-1": ["host algo-1 is in instance group data_group", "serving"],
                         "algo-2": ["host algo-2 is in instance group dnn_group", "step=1/500 loss=2.3"]}).join()
    logs = runner().invoke(app, ["logs", job, "--direct", "--group", "dnn_group", "--json"])
    assert logs.exit_code == 0 and [line["line"] for line in json.loads(logs.stdout)] == ["host algo-2 is in instance group dnn_group", "step=1/500 loss=2.3"]
    again = runner().invoke(app, ["run", str(spec_file(tmp_path)), "--direct", "--name", "direct-1"])
    assert again.exit_code == 2 and "launched before" in again.stderr and len(harness.training_jobs()) == 1


def test_logs_are_filtered_by_host_and_by_instance_group(run, tmp_path: Path) -> None:
    harness = run(Scenario(summary=SUMMARY, runs_for_s=30))
    deploy(harness)
    assert runner().invoke(app, ["run", str(spec_file(tmp_path)), "--name", "cli-logs", "--quiet"]).exit_code == 0
    write_logs(harness, HOST_LINES).join()
    by_host = runner().invoke(app, ["logs", "cli-logs", "--host", "algo-1", "--json"])
    assert by_host.exit_code == 0 and {line["host"] for line in json.loads(by_host.stdout)} == {"algo-1"}
    by_group = runner().invoke(app, ["logs", "cli-logs", "--group", "dnn_group"])
    assert by_group.exit_code == 0 and "[algo-2] step=10/10" in by_group.stdout and "algo-1" not in by_group.stdout
    everything = json.loads(runner().invoke(app, ["logs", "cli-logs", "--json"]).stdout)
    assert len(everything) == 5
    last = json.loads(runner().invoke(app, ["logs", "cli-logs", "--json", "--tail", "2"]).stdout)
    assert [line["line"] for line in last] == [line["line"] for line in everything[-2:]]
    assert len(json.loads(runner().invoke(app, ["logs", "cli-logs", "--json", "--since", "1h"]).stdout)) == 5
    assert runner().invoke(app, ["logs", "cli-logs", "--since", "yesterday"]).exit_code == 2
    assert runner().invoke(app, ["stop", "cli-logs"]).exit_code == 0  # no execution outlives the test's fake AWS
    assert harness.wait(harness.state_machine_arn.replace(":stateMachine:", ":execution:") + ":cli-logs", timeout_s=30)["status"] == "ABORTED"


def test_report_renders_the_sweeps_markdown_and_saves_its_chart(run, tmp_path: Path) -> None:
    harness = run(Scenario(summary=SUMMARY))
    deploy(harness)
    for key, body in (("report.md", b"# resnet sweep\n\n| configuration | status |\n|---|---|\n| d2 | succeeded |\n"),
                      ("report.json", json.dumps({"recommended": "d2"}).encode()), ("chart.png", b"\x89PNG chart")):
        harness.s3.put_object(Bucket=RESULTS_BUCKET, Key=f"benchmarks/sweep-1/{key}", Body=body)
    shown = runner().invoke(app, ["report", "sweep-1", "--out-dir", str(tmp_path)])
    assert shown.exit_code == 0 and "resnet sweep" in shown.stdout and "d2" in shown.stdout
    assert (tmp_path / "sweep-1-chart.png").read_bytes() == b"\x89PNG chart"
    as_json = runner().invoke(app, ["report", "sweep-1", "--json", "--out-dir", str(tmp_path)])
    assert json.loads(as_json.stdout)["recommended"] == "d2"
    missing = runner().invoke(app, ["report", "sweep-2"])
    assert missing.exit_code == 1 and "no report for sweep 'sweep-2'" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_bad_specs_are_refused_by_validate_and_by_run_before_anything_starts(run, tmp_path: Path) -> None:
    harness = run(Scenario(summary=SUMMARY))
    deploy(harness)
    bad = spec_file(tmp_path, SPEC | {"instance_groups": []})
    checked = runner().invoke(app, ["validate", str(bad), str(EXAMPLES / "pytorch-heterogeneous.json")])
    assert checked.exit_code == 2 and "refused" in checked.stdout and "instance_groups" in checked.stdout
    assert "ok      " in checked.stdout
    started = runner().invoke(app, ["run", str(bad)])
    assert started.exit_code == 2 and "instance_groups" in started.stderr
    assert harness.sfn.list_executions(stateMachineArn=harness.state_machine_arn)["executions"] == []
    assert runner().invoke(app, ["run", str(tmp_path / "absent.json")]).exit_code == 2
    for name in ("a.b", "x" * 81):
        named = runner().invoke(app, ["run", str(EXAMPLES / "pytorch-heterogeneous.json"), "--name", name])
        assert named.exit_code == 2 and "--name" in named.stderr
    assert harness.sfn.list_executions(stateMachineArn=harness.state_machine_arn)["executions"] == []


# A user workload's code ------------------------------------------------------------------------------

USER_SPEC = SPEC | {"workload": {"code": "my_workload", "requirements": "requirements.txt"}, "hyperparameters": {"steps": 10, "hidden": 8}}


# The contract's required hooks, as the client reads them from the source (it imports nothing).
HOOKS = ("def list_samples(ctx):\n    return []\n\ndef preprocess(sample, ctx):\n    return {}\n\n"
         "def build_model(ctx):\n    return None\n\n")


def workload_folder(root: Path, body: str = HOOKS + "def train_step(model, batch, ctx):\n    return model(batch)\n") -> Path:
    """A user's code folder, with what packing leaves behind (a cache, a virtual environment)."""
    folder = root / "my_workload"
    (folder / "__pycache__").mkdir(parents=True, exist_ok=True)
    (folder / ".venv" / "lib").mkdir(parents=True, exist_ok=True)
    (folder / "workload.py").write_text(body)
    (folder / "requirements.txt").write_text("# nothing to install\n")
    (folder / "__pycache__" / "workload.cpython-311.pyc").write_bytes(b"\0")
    (folder / ".venv" / "lib" / "big.so").write_bytes(b"\0" * 1000)
    return folder


def execution_input(harness, name: str) -> dict:
    arn = harness.state_machine_arn.replace(":stateMachine:", ":execution:") + f":{name}"
    return json.loads(harness.sfn.describe_execution(executionArn=arn)["input"])


def code_objects(harness) -> list[tuple[str, int]]:
    """(key, versions) of every object under code/ (the results bucket is versioned, as the stack's is)."""
    versions = harness.s3.list_object_versions(Bucket=RESULTS_BUCKET, Prefix="code/").get("Versions", [])
    return sorted({(v["Key"], sum(other["Key"] == v["Key"] for other in versions)) for v in versions})


def test_run_packs_a_local_workload_folder_uploads_it_once_by_its_hash_and_starts_the_run_naming_it(run, tmp_path: Path) -> None:
    """The folder is relative to the spec's file, wherever the command runs; the upload is content addressed:
    a second run of the same code uploads nothing, a changed file is another archive."""
    from training.workload.code import pack_code

    harness = run(Scenario(summary=SUMMARY, runs_for_s=0.5))
    deploy(harness)
    harness.s3.put_bucket_versioning(Bucket=RESULTS_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    folder = workload_folder(tmp_path / "project")
    spec = spec_file(tmp_path / "project", USER_SPEC)  # the command runs elsewhere (the repository)
    packed = pack_code(folder)
    assert packed.files == ("requirements.txt", "workload.py")  # no cache, no environment
    for name in ("user-1", "user-2"):
        started = runner().invoke(app, ["run", str(spec), "--name", name, "--quiet"])
        assert started.exit_code == 0, started.output
    key = f"code/{packed.sha256}/sourcedir.tar.gz"
    assert code_objects(harness) == [(key, 1)]  # uploaded once for both runs
    assert harness.s3.get_object(Bucket=RESULTS_BUCKET, Key=key)["Body"].read() == packed.archive
    sent = execution_input(harness, "user-1")
    assert sent["workload"] == {"code": f"s3://{RESULTS_BUCKET}/{key}", "sha256": packed.sha256, "module": "workload",
                                "requirements": "requirements.txt"}
    assert execution_input(harness, "user-2")["workload"] == sent["workload"]
    assert harness.wait(harness.state_machine_arn.replace(":stateMachine:", ":execution:") + ":user-1")["status"] == "SUCCEEDED"
    job = harness.sagemaker.describe_training_job(TrainingJobName=harness.job_of(
        harness.state_machine_arn.replace(":stateMachine:", ":execution:") + ":user-1", "vision-hetero"))
    (code,) = [channel for channel in job["InputDataConfig"] if channel["ChannelName"] == "code"]
    assert code["DataSource"]["S3DataSource"]["S3Uri"] == f"s3://{RESULTS_BUCKET}/{key}"
    assert code["DataSource"]["S3DataSource"]["InstanceGroupNames"] == ["data_group", "dnn_group"]
    assert job["HyperParameters"]["workload_sha256"] == packed.sha256 and job["HyperParameters"]["hidden"] == "8"
    # One changed file: another archive, under its own hash; the first stays for the runs that name it.
    (folder / "workload.py").write_text(HOOKS + "def train_step(model, batch, ctx):\n    return model(batch).mean()\n")
    changed = pack_code(folder)
    assert changed.sha256 != packed.sha256
    assert runner().invoke(app, ["run", str(spec), "--name", "user-3", "--quiet"]).exit_code == 0
    assert code_objects(harness) == sorted([(key, 1), (changed.key, 1)])
    assert execution_input(harness, "user-3")["workload"]["sha256"] == changed.sha256
    for name in ("user-2", "user-3"):
        harness.wait(harness.state_machine_arn.replace(":stateMachine:", ":execution:") + f":{name}")


def test_a_sweep_packs_each_distinct_folder_of_its_configurations_once(run, tmp_path: Path) -> None:
    harness = run(Scenario(summary=SUMMARY, runs_for_s=0.5))
    deploy(harness)
    workload_folder(tmp_path)
    configurations = [USER_SPEC | {"run_name": "user-a"},
                      USER_SPEC | {"run_name": "user-b", "workload": {"code": "./my_workload/", "requirements": "requirements.txt"}},
                      SPEC | {"run_name": "builtin"}]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"sweep_name": "mine", "configurations": configurations}))
    started = runner().invoke(app, ["sweep", str(sweep), "--name", "mine-1"])
    assert started.exit_code == 0, started.output
    ((key, versions),) = code_objects(harness)
    assert versions == 1
    arn = harness.sweep_arn.replace(":stateMachine:", ":execution:") + ":mine-1"
    sent = json.loads(harness.sfn.describe_execution(executionArn=arn)["input"])["configurations"]
    assert sent[0]["workload"] == sent[1]["workload"] and sent[0]["workload"]["code"] == f"s3://{RESULTS_BUCKET}/{key}"
    assert sent[2]["workload"] == "vision"
    assert harness.wait(arn, timeout_s=90)["status"] == "SUCCEEDED"


def test_bad_workload_code_is_refused_before_any_aws_call(run, tmp_path: Path) -> None:
    harness = run(Scenario(summary=SUMMARY))
    deploy(harness)
    missing = runner().invoke(app, ["run", str(spec_file(tmp_path, USER_SPEC))])  # no my_workload/ beside the spec
    assert missing.exit_code == 2 and "workload.code" in missing.stderr and "does not exist" in missing.stderr
    workload_folder(tmp_path)
    misspelt = runner().invoke(app, ["run", str(spec_file(tmp_path, USER_SPEC | {"workload": {"code": "my_workload", "module": "wrkload"}}))])
    assert misspelt.exit_code == 2 and "workload.module" in misspelt.stderr and "wrkload.py" in misspelt.stderr
    no_file = runner().invoke(app, ["run", str(spec_file(tmp_path, USER_SPEC | {"workload": {"code": "my_workload", "requirements": "reqs.txt"}}))])
    assert no_file.exit_code == 2 and "workload.requirements" in no_file.stderr
    (tmp_path / "my_workload" / "workload.py").write_text(HOOKS.replace("def preprocess(sample, ctx)", "def preprocess(sample)"))
    hooks = runner().invoke(app, ["run", str(spec_file(tmp_path, USER_SPEC))])  # read from the source: no train_step, a wrong signature
    assert hooks.exit_code == 2 and "workload.module" in hooks.stderr and "defines no train_step()" in hooks.stderr
    (tmp_path / "my_workload" / "workload.py").write_text(HOOKS.replace("def preprocess(sample, ctx)", "def preprocess(sample)")
                                                          + "def train_step(model, batch, ctx):\n    return 0\n")
    arity = runner().invoke(app, ["run", str(spec_file(tmp_path, USER_SPEC))])
    assert arity.exit_code == 2 and "preprocess in" in arity.stderr and "calls preprocess(sample, ctx)" in arity.stderr
    workload_folder(tmp_path)
    tensorflow = runner().invoke(app, ["run", str(spec_file(tmp_path, USER_SPEC | {"variant": "tensorflow", "distribution": "horovod"}))])
    # The tensorflow variant reads the same module against its own contract: a PyTorch module is not one.
    assert tensorflow.exit_code == 2 and "defines no build_dataset()" in tensorflow.stderr and "rename it" not in tensorflow.stderr
    assert harness.sfn.list_executions(stateMachineArn=harness.state_machine_arn)["executions"] == []
    assert code_objects(harness) == []


def test_an_upload_that_meets_another_clients_of_the_same_archive_goes_on_and_other_bytes_are_refused(run, tmp_path: Path, monkeypatch) -> None:
    """Two clients pack the same folder at once: the second's conditional write meets the first's object
    (412), checks that its bytes are the archive, and starts its run; an object of other bytes under the
    archive's name is refused before anything runs (every host would refuse it, billed)."""
    from training.workload.code import pack_code

    harness = run(Scenario(summary=SUMMARY, runs_for_s=0.5))
    deploy(harness)
    folder = workload_folder(tmp_path / "project")
    spec = spec_file(tmp_path / "project", USER_SPEC)
    packed = pack_code(folder)

    raced: list[str] = []

    def the_other_client_first(params, **_):  # at the AWS boundary: the other client's PutObject lands first
        if params.get("Key") == packed.key and not raced:
            raced.append(packed.key)  # once; this client's own conditional write then meets the other's object
            harness.s3.put_object(Bucket=RESULTS_BUCKET, Key=packed.key, Body=packed.archive, IfNoneMatch="*")

    import boto3

    real_session = boto3.Session

    def session_with_the_race(*args, **kwargs):  # the client's own sessions (Platform.session) see the other's write
        session = real_session(*args, **kwargs)
        session.events.register("before-parameter-build.s3.PutObject", the_other_client_first)
        return session

    monkeypatch.setattr(boto3, "Session", session_with_the_race)
    started = runner().invoke(app, ["run", str(spec), "--name", "race-1", "--quiet"])
    monkeypatch.setattr(boto3, "Session", real_session)
    assert started.exit_code == 0, started.output
    assert raced and harness.s3.get_object(Bucket=RESULTS_BUCKET, Key=packed.key)["Body"].read() == packed.archive
    harness.wait(harness.state_machine_arn.replace(":stateMachine:", ":execution:") + ":race-1")
    # Other bytes under the name (planted by hand): refused, nothing started.
    (folder / "workload.py").write_text(HOOKS + "def train_step(model, batch, ctx):\n    return 1\n")
    other = pack_code(folder)
    harness.s3.put_object(Bucket=RESULTS_BUCKET, Key=other.key, Body=b"not the archive", IfNoneMatch="*")
    refused = runner().invoke(app, ["run", str(spec), "--name", "race-2", "--quiet"])
    assert refused.exit_code != 0 and "holds other bytes than its name says" in refused.stderr
    assert [e["name"] for e in harness.sfn.list_executions(stateMachineArn=harness.state_machine_arn)["executions"]] == ["race-1"]


def test_run_direct_uploads_the_code_and_routes_it_to_every_group(run, tmp_path: Path) -> None:
    harness = run(Scenario(summary=SUMMARY))
    deploy(harness)
    workload_folder(tmp_path)
    started = runner().invoke(app, ["run", str(spec_file(tmp_path, USER_SPEC)), "--direct", "--name", "direct-user"])
    assert started.exit_code == 0, started.output
    (job,) = harness.training_jobs()
    ((key, _),) = code_objects(harness)
    described = harness.sagemaker.describe_training_job(TrainingJobName=job)
    (code,) = [channel for channel in described["InputDataConfig"] if channel["ChannelName"] == "code"]
    assert code["DataSource"]["S3DataSource"] == {"S3DataType": "S3Prefix", "S3Uri": f"s3://{RESULTS_BUCKET}/{key}",
                                                  "S3DataDistributionType": "FullyReplicated", "InstanceGroupNames": ["data_group", "dnn_group"]}
    assert key == f"code/{described['HyperParameters']['workload_sha256']}/sourcedir.tar.gz"


def test_a_missing_stack_is_one_clear_line(run, tmp_path: Path) -> None:
    run(Scenario(summary=SUMMARY))  # no stack deployed
    result = runner().invoke(app, ["runs"])
    assert result.exit_code == 1 and result.stderr.strip() == (
        "hetero: stack 'HeteroTrainingPlatform' not found: deploy the platform (`cdk deploy`) or pass --stack/--region")
    # The AWS CLI's options may come before the command too; the command's own win.
    before = runner().invoke(app, ["--stack", "Elsewhere", "runs"])
    assert before.exit_code == 1 and "stack 'Elsewhere' not found" in before.stderr
    both = runner().invoke(app, ["--stack", "Elsewhere", "show", "x", "--stack", "Mine"])
    assert both.exit_code == 1 and "stack 'Mine' not found" in both.stderr


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with no AWS credentials anywhere boto3 looks (no moto: the calls would go out)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_missing_credentials_are_one_clear_line(no_credentials) -> None:
    result = runner().invoke(app, ["runs", "--region", REGION])
    assert result.exit_code == 1 and "no AWS credentials" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# Every command that talks to AWS, each way it does (a run or a direct job).
AWS_COMMANDS = [
    ["run", str(EXAMPLES / "pytorch-heterogeneous.json")], ["run", str(EXAMPLES / "pytorch-heterogeneous.json"), "--direct", "--no-sdk"],
    ["follow", "run-1"], ["follow", "job-1", "--direct"], ["show", "run-1"], ["show", "job-1", "--direct"],
    ["stop", "run-1"], ["stop", "job-1", "--direct"], ["logs", "run-1"], ["logs", "job-1", "--direct"],
    ["sweep", str(EXAMPLES / "sweep.json")], ["runs"], ["report", "sweep-1"], ["prices", "ml.p3.2xlarge", "--live"],
]


@pytest.mark.parametrize("args", AWS_COMMANDS, ids=lambda args: " ".join(part for part in args if "/" not in part))
def test_every_command_that_talks_to_aws_says_missing_credentials_in_one_line(no_credentials, args: list[str]) -> None:
    result = runner().invoke(app, [*args, "--region", REGION])
    assert result.exit_code == 1, result.output
    assert "AWS credentials" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


# Names no run, sweep or job could have (Step Functions refuses an execution name that is empty, over 80
# characters, or holds whitespace, "." is not one the results' keys and job names carry): refused before
# any AWS call, so without credentials too.
BAD_NAMES = [
    ["run", str(EXAMPLES / "pytorch-heterogeneous.json"), "--name", ""],
    ["run", str(EXAMPLES / "pytorch-heterogeneous.json"), "--name", "a b"],
    ["run", str(EXAMPLES / "pytorch-heterogeneous.json"), "--direct", "--name", ""],
    ["run", str(EXAMPLES / "pytorch-heterogeneous.json"), "--direct", "--name", "x:y"],
    ["sweep", str(EXAMPLES / "sweep.json"), "--name", ""],
    ["sweep", str(EXAMPLES / "sweep.json"), "--name", "x" * 78],
    ["follow", "a b"], ["show", "a/b"], ["stop", "x" * 81], ["logs", "run#1"], ["follow", ""],
    ["show", "job_1", "--direct"], ["follow", "job-", "--direct"], ["report", "sweep 1"],
]


@pytest.mark.parametrize("args", BAD_NAMES, ids=lambda args: " ".join(part[:12] for part in args if "/" not in part) or "empty")
def test_a_bad_name_is_refused_before_any_aws_call(no_credentials, args: list[str]) -> None:
    result = runner().invoke(app, [*args, "--region", REGION])
    assert result.exit_code == 2, result.output
    assert "credentials" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert any(word in result.stderr for word in ("--name", "RUN", "SWEEP_ID")), result.stderr


def help_texts() -> str:
    """The module docstring, the app's help and every command's, as a user reads them."""
    import typer.main

    from hetero import cli

    texts = [cli.__doc__ or "", runner().invoke(app, ["--help"], terminal_width=500).stdout]
    for name in typer.main.get_command(app).commands:
        texts.append(runner().invoke(app, [name, "--help"], terminal_width=500).stdout)
    return "\n".join(texts)


def test_every_example_the_help_names_exists_and_every_example_passes_validate() -> None:
    import re

    named = set(re.findall(r"examples/[\w.*/-]*\w", help_texts()))
    assert "examples/sweep.json" in named  # the help shows a sweep
    for path in sorted(named):
        assert list(EXAMPLES.parent.glob(path)), f"the help names {path}, which does not exist"
    checked = runner().invoke(app, ["validate", *map(str, sorted(EXAMPLES.glob("*.json"))), "--json"])
    verdicts = json.loads(checked.stdout)
    assert checked.exit_code == 0, [verdict for verdict in verdicts if not verdict["ok"]]
    assert any(verdict["spec"].endswith("sweep.json") for verdict in verdicts)


def test_local_hands_its_options_to_the_emulated_cluster(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    bad = spec_file(tmp_path, SPEC | {"instance_groups": []})
    result = runner().invoke(app, ["local", str(bad), "--channel", f"train={tmp_path}", "--set", "steps=3"])
    assert result.exit_code == 2  # the emulated cluster's own refusal, with its exit code
    assert "JobSpecError: instance_groups: must be a non-empty list" in capfd.readouterr().err + result.stderr
    unknown = runner().invoke(app, ["local", str(EXAMPLES / "pytorch-heterogeneous.json"), "--no-such-option"])
    assert unknown.exit_code == 2


def test_local_help_lists_every_option_of_the_emulated_cluster() -> None:
    """`hetero local` forwards its options to training/local/options.py's parser: its help is that
    parser's, every option of it shown, as `hetero local` names itself."""
    from training.local.options import run_parser

    shown = runner().invoke(app, ["local", "--help"], terminal_width=200)
    assert shown.exit_code == 0 and shown.stdout.startswith("usage: hetero local ")
    options = [name for action in run_parser("x")._actions for name in action.option_strings if name.startswith("--")]
    assert {"--channel", "--set", "--cpus", "--deadline-s", "--json"} <= set(options)
    for option in options:
        assert option in shown.stdout, option
    assert runner().invoke(app, ["local", "spec.json", "--help"]).stdout == shown.stdout


def script_project(tmp_path: Path, code: str, timing) -> tuple[Path, dict]:
    """A project folder holding the example script (feed/), and the example script spec naming it as
    ``code`` with ``timing``'s regex, reading the harness's input bucket."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(Path(__file__).resolve().parents[2] / "examples" / "scripts" / "grpc_feed", project / "feed")
    raw = json.loads((Path(__file__).resolve().parents[2] / "examples" / "pytorch-script.json").read_text())
    raw["workload"] = {"code": code, "entry_point": "train.py", "step_time_regex": timing.regex, "warmup_steps": timing.warmup_steps}
    raw["inputs"]["train"]["s3_uri"] = SPEC["inputs"]["train"]["s3_uri"]
    return project, raw


def test_run_of_an_existing_script_uploads_it_and_the_state_machine_runs_it_to_a_costed_result(run, tmp_path: Path) -> None:
    """Script mode through the deployed platform: `hetero run` packs the script's folder (its entry point
    checked among the packed files), the execution's spec keeps every script field, the launch's request
    passes botocore with the entry point and the script's own hyperparameters, and the summary the
    launcher writes from the script's step lines makes a result with a cost per step."""

    from training.script_mode import StepTiming, script_summary

    timing = StepTiming(r"took ([0-9.]+) ms", warmup_steps=1)
    summary = script_summary([900.0, 180.0, 190.0], [1.0, 1.2, 1.4], 0.0, timing, program="train.py", exit_code=0)
    harness = run(Scenario(summary=summary, runs_for_s=0.5))
    deploy(harness)
    project, raw = script_project(tmp_path, "feed", timing)
    refused = runner().invoke(app, ["run", str(spec_file(project, raw | {"workload": raw["workload"] | {"entry_point": "nope.py"}})),
                                    "--name", "script-0", "--quiet"])
    assert refused.exit_code == 2 and "workload.entry_point" in refused.output and harness.training_jobs() == []
    spec = spec_file(project, raw | {"max_runtime_s": 60})
    started = runner().invoke(app, ["run", str(spec), "--name", "script-1", "--quiet"])
    assert started.exit_code == 0, started.output
    sent = execution_input(harness, "script-1")["workload"]
    assert sent["entry_point"] == "train.py" and sent["step_time_regex"] == timing.regex and sent["code"].startswith(f"s3://{RESULTS_BUCKET}/code/")
    arn = harness.state_machine_arn.replace(":stateMachine:", ":execution:") + ":script-1"
    assert harness.wait(arn)["status"] == "SUCCEEDED"
    job = harness.sagemaker.describe_training_job(TrainingJobName=harness.job_of(arn, raw["run_name"]))
    assert job["HyperParameters"]["script_entry_point"] == "train.py" and job["HyperParameters"]["sagemaker_program"] == '"train.py"'
    assert job["HyperParameters"]["data_group"] == '"data_group"' and job["HyperParameters"]["workload_module"] == ""
    result = harness.result("script-1")
    assert result["status"] == "Completed" and result["step_time_ms"]["p50"] == 185.0
    assert result["billed_ms_per_step"] == 200.0 and result["cost_per_1k_steps_usd"] > 0


def test_a_sweep_of_an_existing_script_varies_its_data_group_and_costs_each_size_from_the_scripts_own_step_times(run, tmp_path: Path) -> None:
    """A sweep of a script job (no workload contract): `hetero sweep` packs the script's folder once, each
    configuration's job carries the entry point and its data group's size, and the report prices each size
    from the step times the script printed (its own regex), recommending the cheapest per step."""

    from training.script_mode import StepTiming, script_summary

    timing = StepTiming(r"took ([0-9.]+) ms", warmup_steps=1)

    def summary(step_ms: float) -> dict:
        return script_summary([900.0] + [step_ms] * 20, [1.0 + i * step_ms / 1000 for i in range(21)], 0.0, timing,
                              program="train.py", exit_code=0)

    harness = run(Scenario(summary=summary(1193.0), runs_for_s=0.5))
    deploy(harness)
    project, base = script_project(tmp_path, "../feed", timing)  # the sweep's file sits in sweeps/
    (project / "sweeps").mkdir()
    sweep = project / "sweeps" / "script.json"
    sweep.write_text(json.dumps({"sweep_name": "script-sizes", "base": base, "data_hosts": [1, 2]}))
    harness.scenario.summaries = {"existing-script-hetero-d1": summary(184.0), "existing-script-hetero-d2": summary(180.0)}
    started = runner().invoke(app, ["sweep", str(sweep), "--name", "script-sizes-1"])
    assert started.exit_code == 0, started.output
    ((key, versions),) = code_objects(harness)
    assert versions == 1
    arn = harness.sweep_arn.replace(":stateMachine:", ":execution:") + ":script-sizes-1"
    sent = json.loads(harness.sfn.describe_execution(executionArn=arn)["input"])
    assert sent["base"]["workload"]["code"] == f"s3://{RESULTS_BUCKET}/{key}" and sent["base"]["workload"]["entry_point"] == "train.py"
    execution = harness.wait(arn, timeout_s=120)
    assert execution["status"] == "SUCCEEDED", execution
    report = json.loads(execution["output"])["report"]
    assert report["failed"] == [] and report["recommended"] == "existing-script-hetero-d1"
    published = json.loads(harness.s3.get_object(Bucket=RESULTS_BUCKET, Key="benchmarks/script-sizes-1/report.json")["Body"].read())
    rows = {row["name"]: row for row in published["configurations"]}
    # Billed per step from the wall time between the script's own step lines; d2's extra host costs more than its 4 ms save.
    assert [round(rows[f"existing-script-hetero-d{n}"]["billed_ms_per_step"]) for n in (1, 2)] == [184, 180]
    assert rows["existing-script-hetero-d1"]["cost_per_1k_steps_usd"] < rows["existing-script-hetero-d2"]["cost_per_1k_steps_usd"]
    assert {harness.result(f"script-sizes-1-{index}")["status"] for index in (0, 1)} == {"Completed"}
    sizes = {}
    for job_name in harness.training_jobs():
        job = harness.sagemaker.describe_training_job(TrainingJobName=job_name)
        assert job["HyperParameters"]["script_entry_point"] == "train.py"
        (data,) = [g for g in job["ResourceConfig"]["InstanceGroups"] if g["InstanceGroupName"] == "data_group"]
        sizes[job_name.split("-hetero-")[1][:2]] = data["InstanceCount"]
    assert sizes == {"d1": 1, "d2": 2}
