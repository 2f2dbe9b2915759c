"""Script mode on the emulated cluster: existing SageMaker scripts that know nothing of the platform run
unchanged. The example (examples/scripts/grpc_feed, the public PyTorch sample's shape) and scripts these
tests write: the data group's hosts end when the trainer group ends though no script tells them to,
SIGTERM reaches the script, a failed or killed script names its host, group and signal, a data host's
failure ends the trainers, every host gets the toolkit's environment and SageMaker's host names."""

from __future__ import annotations

import json
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from lambdas.core.job_spec import validate_job_spec
from tests.faults import Faults
from training.local.cluster import EmulatedCluster, EmulationOptions, LineWatcher
from training.script_env import MachineFacts, script_hyperparameters, script_inputs, toolkit_environment, training_env

REPO = Path(__file__).resolve().parents[3]
EXAMPLE_SPEC = REPO / "examples" / "pytorch-script.json"
EXAMPLE_CODE = REPO / "examples" / "scripts" / "grpc_feed"


def script_spec(code: Path, *, data_hosts: int = 1, trainer_hosts: int = 1, entry_point: str = "train.py", **hyperparameters) -> dict:
    groups = [{"name": "dnn_group", "role": "dnn", "instance_type": "ml.p3.2xlarge", "count": trainer_hosts}]
    inputs = {"train": {"s3_uri": "s3://bucket/train/"}}
    if data_hosts:
        groups.insert(0, {"name": "data_group", "role": "data", "instance_type": "ml.c5.xlarge", "count": data_hosts})
        inputs["train"]["groups"] = ["data_group"]
    return {"run_name": "existing-script", "variant": "pytorch", "workload": {"code": str(code), "entry_point": entry_point, "warmup_steps": 2},
            "instance_groups": groups, "hyperparameters": hyperparameters, "inputs": inputs}


def example_spec(**hyperparameters) -> dict:
    raw = json.loads(EXAMPLE_SPEC.read_text())
    raw["workload"]["code"] = str(EXAMPLE_CODE)
    raw["hyperparameters"] |= hyperparameters
    return raw


def start(raw: dict, tmp_path: Path, channels: dict[str, Path], **options) -> tuple[EmulatedCluster, LineWatcher]:
    watcher = LineWatcher()
    options = {"data_idle_timeout_s": 10.0, "orphan_grace_s": 30.0, "deadline_s": 240.0} | options
    cluster = EmulatedCluster(validate_job_spec(raw), EmulationOptions(workdir=tmp_path / "cluster", channels=channels, **options),
                              on_line=watcher)
    cluster.start()
    return cluster, watcher


def finish(cluster: EmulatedCluster):
    try:
        return cluster.wait()
    finally:
        cluster.close()


def failure_of(cluster: EmulatedCluster, host: str) -> str:
    path = cluster.host(host).base_dir / "output" / "failure"
    return path.read_text() if path.exists() else ""


def write_script(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(textwrap.dedent(body))
    return folder


# A data group whose script serves for ever and never hears of the end: only the launcher can end it.
SERVES_FOR_EVER = """
    import os, sys, time
    if os.environ["SM_CURRENT_INSTANCE_GROUP"] == "data_group":
        print("serving", flush=True)
        while True:
            time.sleep(1)
"""


@pytest.mark.cluster
def test_the_example_script_trains_from_its_own_data_service_and_its_data_host_is_ended_with_the_trainer(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(example_spec(steps=30), tmp_path, {"train": images})
    result = finish(cluster)
    assert result.ok and result.orphans == [], result.report()
    trainer, data = cluster.hosts_with_role("dnn")[0].name, cluster.hosts_with_role("data")[0].name
    # The script served until the launcher ended it: it never exits by itself.
    assert any("ending this data host's script" in line for line in watcher.of(data)), watcher.of(data)[-10:]
    assert result.outcome(data).exit_code == 0 and result.outcome(data).leftovers == 0
    losses = [float(line.split("loss=")[1].split()[0]) for line in watcher.of(trainer) if line.startswith("step=")]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0], losses
    summary = cluster.summary()
    assert summary["mode"] == "script" and summary["program"] == "train.py"
    assert summary["steps"] == 30 and summary["timed_steps"] == 28 and summary["warmup_steps"] == 2 and summary["exit_code"] == 0
    assert summary["step_time_ms"]["p50"] > 0 and summary["wall_ms_per_step"] >= summary["step_time_ms"]["p50"] * 0.9
    assert "warning" not in summary  # one line per step
    assert (cluster.host(trainer).base_dir / "model" / "model.pt").is_file()


@pytest.mark.cluster
def test_every_host_gets_the_toolkits_environment_arguments_host_names_and_its_own_opt_ml(tmp_path: Path, images: Path) -> None:
    code = write_script(tmp_path / "code", """
        import json, os, socket, sys
        from pathlib import Path
        host = os.environ["SM_CURRENT_HOST"]
        seen = {"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k.startswith("SM_")},
                "cwd": os.getcwd(), "hostname": socket.gethostname(), "python": __import__("shutil").which("python"),
                "resolved": {other: socket.gethostbyname(other) for other in json.loads(os.environ["SM_HOSTS"])},
                "fixed_path_host": json.loads(Path("/opt/ml/input/config/resourceconfig.json").read_text())["current_host"]}
        Path(os.environ["SM_OUTPUT_DATA_DIR"], f"seen-{host}.json").write_text(json.dumps(seen))
        if os.environ["SM_CURRENT_INSTANCE_GROUP"] == "data_group":
            import time
            while True:
                time.sleep(1)
    """)
    raw = script_spec(code, data_hosts=2, learning_rate=0.1, epochs=2, name="x")
    cluster, _ = start(raw, tmp_path, {"train": images})
    result = finish(cluster)
    assert result.ok and result.orphans == [], result.report()
    for host in cluster.hosts:
        seen = json.loads((host.base_dir / "output" / "data" / f"seen-{host.name}.json").read_text())
        config = host.base_dir / "input" / "config"
        hyperparameters = json.loads((config / "hyperparameters.json").read_text())
        unpacked = Path(seen["cwd"])
        # What the toolkit computes from the same files (tests/sdk/test_script_environment.py holds training_env to it).
        expected = toolkit_environment(training_env(
            json.loads((config / "resourceconfig.json").read_text()), script_inputs(json.loads((config / "inputdataconfig.json").read_text())),
            script_hyperparameters(hyperparameters) | {"sagemaker_submit_directory": str(unpacked)}, base_dir=host.base_dir,
            facts=MachineFacts(num_cpus=len(host.cpus))))
        assert seen["env"] == expected, host.name
        assert seen["env"]["SM_CURRENT_INSTANCE_GROUP"] == host.spec_group and seen["env"]["SM_CURRENT_HOST"] == host.name
        assert json.loads(seen["env"]["SM_CHANNELS"]) == (["train"] if host.role == "data" else [])  # the platform's channels are not its
        assert json.loads(seen["env"]["SM_HPS"]) == {"epochs": 2, "learning_rate": 0.1, "name": "x"}
        assert seen["argv"] == ["--epochs", "2", "--learning_rate", "0.1", "--name", "x"]
        assert seen["env"]["SM_USER_ENTRY_POINT"] == "train.py" and (unpacked / "train.py").is_file()
        assert seen["hostname"] == host.name and seen["fixed_path_host"] == host.name
        assert seen["python"] == str(Path(sys.executable).parent / "python")  # a command's python is the image's
        assert json.loads(seen["env"]["SM_DISTRIBUTION_INSTANCE_GROUPS"]) == ["dnn_group"]  # the master is a trainer host
        assert seen["resolved"] == {other.name: other.address for other in cluster.hosts}
    assert socket.gethostname() not in {host.name for host in cluster.hosts}  # the machine's own name is untouched


@pytest.mark.cluster
def test_sigterm_reaches_the_script_which_saves_and_the_data_host_ends(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(example_spec(steps=100_000), tmp_path, {"train": images})
    trainer = cluster.hosts_with_role("dnn")[0].name
    Faults(cluster, watcher).when(trainer, r"^step=5/", lambda: cluster.kill_launcher(trainer, signal.SIGTERM))
    result = finish(cluster)
    assert result.orphans == [] and result.outcome(trainer).exit_code == 0, result.report()
    assert any(line.startswith("SIGTERM: checkpoint saved at step") for line in watcher.of(trainer)), watcher.of(trainer)[-10:]
    assert (cluster.host(trainer).base_dir / "checkpoints" / "checkpoint.pt").is_file()
    assert all(result.outcome(host.name).exit_code == 0 for host in cluster.hosts_with_role("data")), result.report()


@pytest.mark.cluster
def test_a_lost_trainer_host_ends_the_data_hosts_at_their_idle_timeout(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(example_spec(steps=100_000), tmp_path, {"train": images}, data_idle_timeout_s=5.0)
    trainer = cluster.hosts_with_role("dnn")[0].name
    Faults(cluster, watcher).when(trainer, r"^step=3/", lambda: cluster.kill(trainer))
    result = finish(cluster)
    data = cluster.hosts_with_role("data")[0].name
    assert result.orphans == [] and result.outcome(data).exit_code == 0, result.report()
    assert any("no trainer host heard from" in line for line in watcher.of(data))


@pytest.mark.cluster
def test_a_trainer_script_killed_by_a_signal_fails_naming_host_group_and_signal(tmp_path: Path, images: Path) -> None:
    code = write_script(tmp_path / "code", SERVES_FOR_EVER + """
    print("step=1/9 step_time_ms=3.0", flush=True)
    print("about to crash", flush=True)
    os.kill(os.getpid(), 9)
    """)
    cluster, _ = start(script_spec(code), tmp_path, {"train": images})
    result = finish(cluster)
    trainer = cluster.hosts_with_role("dnn")[0].name
    assert not result.ok and result.orphans == [] and result.outcome(trainer).exit_code == 128 + signal.SIGKILL, result.report()
    assert failure_of(cluster, trainer) == ("ScriptFailed: train.py on host algo-2 (instance group dnn_group) was killed by SIGKILL; "
                                            "its last lines: step=1/9 step_time_ms=3.0 | about to crash")
    assert result.outcome("algo-1").exit_code == 0  # ended with the trainer group


@pytest.mark.cluster
def test_a_failed_data_host_script_fails_the_trainers_with_its_reason(tmp_path: Path, images: Path) -> None:
    code = write_script(tmp_path / "code", """
        import os, sys, time
        if os.environ["SM_CURRENT_INSTANCE_GROUP"] == "data_group":
            print("cannot read the channel", file=sys.stderr, flush=True)
            sys.exit(3)
        while True:  # a trainer waiting on a data service that never comes
            time.sleep(1)
    """)
    cluster, _ = start(script_spec(code), tmp_path, {"train": images})
    result = finish(cluster)
    assert result.outcome("algo-1").exit_code == 3 and result.outcome("algo-2").exit_code == 1, result.report()
    reason = "ScriptFailed: train.py on host algo-1 (instance group data_group) exited with code 3; its last lines: cannot read the channel"
    assert failure_of(cluster, "algo-1") == reason
    assert failure_of(cluster, "algo-2") == f"DataHostFailed: data host algo-1 failed: {reason}"


@pytest.mark.cluster
def test_the_data_hosts_wait_for_every_trainer_host(tmp_path: Path, images: Path) -> None:
    code = write_script(tmp_path / "code", SERVES_FOR_EVER + """
    time.sleep(1 if os.environ["SM_CURRENT_HOST"] == "algo-2" else 8)
    print("step=1/1 step_time_ms=5.0", flush=True)
    """)
    cluster, watcher = start(script_spec(code, trainer_hosts=2), tmp_path, {"train": images})
    result = finish(cluster)
    assert result.ok and result.orphans == [], result.report()
    data_lines = watcher.of("algo-1")
    waited = next(index for index, line in enumerate(data_lines) if "algo-2 says its script ended; waiting for ['algo-3']" in line)
    ended = next(index for index, line in enumerate(data_lines) if "ending this data host's script" in line)
    assert waited < ended
    assert result.outcome("algo-1").ended_at > result.outcome("algo-3").ended_at - 1 > result.outcome("algo-2").ended_at


@pytest.mark.cluster
def test_an_entry_point_missing_from_the_code_is_refused_on_every_host(tmp_path: Path, images: Path) -> None:
    code = write_script(tmp_path / "code", "print('never runs')\n")
    cluster, _ = start(script_spec(code, entry_point="missing.py"), tmp_path, {"train": images})
    result = finish(cluster)
    assert [outcome.exit_code for outcome in result.outcomes] == [2, 2], result.report()
    assert all("the entry point 'missing.py' is not in the code folder (it holds ['train.py'])" in failure_of(cluster, host.name)
               for host in cluster.hosts)


TF_DATA_SERVICE_SCRIPT = """
    # The public TensorFlow sample's shape: tf.data.service's dispatcher and a worker on the data group, which
    # never exit by themselves; the trainer group registers its pipeline there and trains a Keras model.
    import argparse, json, os, time
    import tensorflow as tf

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dispatcher_port", type=int, default=16100)
    parser.add_argument("--worker_port", type=int, default=16101)
    args = parser.parse_args()
    groups = json.loads(os.environ["SM_INSTANCE_GROUPS_DICT"])
    dispatcher = groups["data_group"]["hosts"][0]
    host = os.environ["SM_CURRENT_HOST"]
    if os.environ["SM_CURRENT_INSTANCE_GROUP"] == "data_group":
        if host == dispatcher:  # kept: a server that is collected stops
            dispatch_server = tf.data.experimental.service.DispatchServer(tf.data.experimental.service.DispatcherConfig(port=args.dispatcher_port))
        worker = tf.data.experimental.service.WorkerServer(tf.data.experimental.service.WorkerConfig(
            dispatcher_address=f"{dispatcher}:{args.dispatcher_port}", worker_address=f"{host}:{args.worker_port}", port=args.worker_port))
        print("tf.data.service worker up", flush=True)
        worker.join()
    else:
        def augment(x):
            return tf.image.random_flip_left_right(tf.random.uniform([16, 16, 3])), tf.cast(x % 2, tf.int64)
        dataset = tf.data.Dataset.range(10_000).map(augment).batch(8).repeat()
        dataset = dataset.apply(tf.data.experimental.service.distribute("parallel_epochs", f"grpc://{dispatcher}:{args.dispatcher_port}"))
        model = tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        batches = iter(dataset)
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            loss = model.train_on_batch(*next(batches))
            print(f"step={step}/{args.steps} loss={float(loss):.4f} step_time_ms={(time.perf_counter() - started) * 1000:.1f}", flush=True)
"""


@pytest.mark.cluster
def test_a_tf_data_service_script_trains_and_its_dispatcher_and_worker_are_ended(tmp_path: Path, images: Path) -> None:
    code = write_script(tmp_path / "code", TF_DATA_SERVICE_SCRIPT)
    raw = script_spec(code, steps=12) | {"variant": "tensorflow"}
    cluster, watcher = start(raw, tmp_path, {"train": images})
    result = finish(cluster)
    assert result.ok and result.orphans == [], result.report() + "\n".join(watcher.of("algo-2")[-20:])
    assert any("tf.data.service worker up" in line for line in watcher.of("algo-1"))
    summary = cluster.summary()
    assert summary["steps"] == 12 and summary["timed_steps"] == 10


@pytest.mark.cluster
def test_a_stop_of_the_job_reaches_every_hosts_script_and_no_host_waits_on_another(tmp_path: Path, images: Path) -> None:
    """StopTrainingJob signals every host at once: every script gets SIGTERM, and the trainer does not wait
    for a data host that is gone (it would bill to SageMaker's SIGKILL, its summary unwritten)."""
    cluster, watcher = start(example_spec(steps=100_000), tmp_path, {"train": images}, data_start_deadline_s=120.0)
    trainer = cluster.hosts_with_role("dnn")[0].name
    signalled = Faults(cluster, watcher).when(trainer, r"^step=5/", lambda: [cluster.kill_launcher(host.name, signal.SIGTERM) for host in cluster.hosts])
    result = finish(cluster)
    assert result.orphans == [] and not result.deadline_exceeded, result.report()
    # Every script got its SIGTERM (the trainer's may save, or die on its data service's end first: the
    # data host's script is stopped at the same moment, as on SageMaker).
    assert all(any("SIGTERM: passed to the script" in line for line in watcher.of(host.name)) for host in cluster.hosts)
    assert result.outcome(trainer).ended_at - signalled < 60  # far below the 120 s start deadline it used to wait out
    assert cluster.summary()["mode"] == "script"


@pytest.mark.cluster
def test_a_data_host_whose_script_ends_by_itself_early_holds_no_trainer(tmp_path: Path, images: Path) -> None:
    code = write_script(tmp_path / "code", """
        import os, time
        if os.environ["SM_CURRENT_INSTANCE_GROUP"] == "data_group":
            time.sleep(4)  # up long enough for the trainer host's keep-alives to reach it, then gone
            print("nothing to serve", flush=True)
        else:
            for step in range(1, 4):
                time.sleep(3)
                print(f"step={step}/3 step_time_ms=1000.0", flush=True)
    """)
    cluster, watcher = start(script_spec(code), tmp_path, {"train": images}, data_start_deadline_s=120.0)
    result = finish(cluster)
    assert result.ok and result.orphans == [], result.report()
    assert result.outcome("algo-2").ended_at - result.outcome("algo-1").ended_at < 60  # not the start deadline
    assert any("did not hear that this host's script ended" in line for line in watcher.of("algo-2"))


@pytest.mark.cluster
def test_a_shell_entry_point_runs_under_its_own_interpreter_with_the_arguments(tmp_path: Path, images: Path) -> None:
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "train.sh").write_text(textwrap.dedent("""\
        #!/bin/bash
        set -euo pipefail
        if [[ "$SM_CURRENT_INSTANCE_GROUP" == "data_group" ]]; then while true; do sleep 1; done; fi
        echo "args: $*"
        echo "step=1/1 step_time_ms=5.0"
    """))
    cluster, watcher = start(script_spec(folder, entry_point="train.sh", epochs=2), tmp_path, {"train": images})
    result = finish(cluster)
    assert result.ok and result.orphans == [], result.report() + "\n".join(watcher.of("algo-2")[-10:])
    assert "args: --epochs 2" in watcher.of("algo-2")


@pytest.mark.cluster
def test_the_scripts_own_failure_reason_and_summary_are_kept(tmp_path: Path, images: Path) -> None:
    code = write_script(tmp_path / "code", SERVES_FOR_EVER + """
    from pathlib import Path
    Path(os.environ["SM_OUTPUT_DATA_DIR"], "summary.json").write_text('{"mine": 1}')
    Path("/opt/ml/output/failure").write_text("MyReason: the loss diverged")
    print("step=1/1 step_time_ms=5.0", flush=True)
    sys.exit(3)
    """)
    cluster, _ = start(script_spec(code), tmp_path, {"train": images})
    result = finish(cluster)
    assert result.outcome("algo-2").exit_code == 3 and result.orphans == [], result.report()
    assert failure_of(cluster, "algo-2") == ("ScriptFailed: train.py on host algo-2 (instance group dnn_group) exited with code 3; its last "
                                             "lines: step=1/1 step_time_ms=5.0 (the script's own reason: MyReason: the loss diverged)")
    data = cluster.host("algo-2").base_dir / "output" / "data"
    assert json.loads((data / "summary.script.json").read_text()) == {"mine": 1} and cluster.summary()["mode"] == "script"
