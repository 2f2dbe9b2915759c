"""The emulated cluster: planning (pure), then real clusters of processes on loopback, including the
faults the platform must survive."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from lambdas.core.job_spec import validate_job_spec
from training.cluster import BASE_DIR_ENV, parse_resource_config
from training.local.cluster import (
    EmulatedCluster,
    EmulationError,
    EmulationOptions,
    LineWatcher,
    assign_cpus,
    plan_hosts,
    resource_config,
)
from training.metrics import parse_metric_line

REPO = Path(__file__).resolve().parents[3]
TINY = {"model": "cnn", "cnn_width": 8, "image_size": 32, "batch_size": 8, "warmup_steps": 2, "augment": "standard"}


def spec(data_hosts: int = 2, steps: int = 12, variant: str = "pytorch", distribution: str | None = None, **hyperparameters) -> dict:
    """A tiny vision job (the variant's default distribution unless one is given)."""
    groups = [{"name": "dnn_group", "role": "dnn", "instance_type": "ml.p3.2xlarge", "count": 1}]
    inputs = {"train": {"s3_uri": "s3://bucket/images/"}}
    if data_hosts:
        groups.insert(0, {"name": "data_group", "role": "data", "instance_type": "ml.c5.9xlarge", "count": data_hosts})
        inputs["train"]["groups"] = ["data_group"]
    return {
        "run_name": "test-run", "variant": variant, "workload": "vision", "instance_groups": groups,
        "hyperparameters": TINY | {"steps": steps} | hyperparameters, "inputs": inputs,
    } | ({"distribution": distribution} if distribution else {})


def start(raw_spec: dict, tmp_path: Path, images: Path, **options) -> tuple[EmulatedCluster, LineWatcher]:
    watcher = LineWatcher()
    cluster = EmulatedCluster(
        validate_job_spec(raw_spec), EmulationOptions(workdir=tmp_path, channels={"train": images}, **options), on_line=watcher
    )
    cluster.start()
    return cluster, watcher


# Planning -------------------------------------------------------------------------------------------


def test_dnn_hosts_get_their_own_cores_and_data_hosts_share_the_rest() -> None:
    assert assign_cpus(["data", "data", "dnn"], [1, 1, 1], [0, 1]) == [(1,), (1,), (0,)]
    assert assign_cpus(["dnn", "data"], [2, 1], [0, 1, 2, 3]) == [(0, 1), (2,)]
    assert assign_cpus(["dnn", "data"], [2, 2], [0, 1]) == [(0, 1), (0, 1)]  # nothing left: share everything
    with pytest.raises(EmulationError):
        assign_cpus(["dnn"], [1], [])


def test_hosts_are_planned_as_sagemaker_names_and_groups_them(tmp_path: Path) -> None:
    options = EmulationOptions(workdir=tmp_path, channels={})
    hosts = plan_hosts(validate_job_spec(spec(data_hosts=2)), options, [0, 1], subnet=9)
    assert [(h.name, h.group, h.role, h.address) for h in hosts] == [
        ("algo-1", "data_group", "data", "127.0.9.2"),
        ("algo-2", "data_group", "data", "127.0.9.3"),
        ("algo-3", "dnn_group", "dnn", "127.0.9.4"),
    ]
    for host in hosts:
        cluster = parse_resource_config(resource_config(host, hosts))
        assert (cluster.current_host, cluster.current_group) == (host.name, host.group)
    homogeneous = plan_hosts(validate_job_spec(spec(data_hosts=0)), options, [0, 1], subnet=9)
    assert [(h.group, h.spec_group) for h in homogeneous] == [("homogeneousCluster", "dnn_group")]
    with pytest.raises(EmulationError, match="does not have"):
        plan_hosts(validate_job_spec(spec()), EmulationOptions(workdir=tmp_path, channels={}, cpus_per_host={"gpu": 2}), [0], 9)


def test_a_channel_without_a_local_folder_is_refused(tmp_path: Path) -> None:
    cluster = EmulatedCluster(validate_job_spec(spec()), EmulationOptions(workdir=tmp_path, channels={}))
    with pytest.raises(EmulationError, match="--channel train=PATH"):
        cluster.start()


def test_each_job_in_a_reused_work_folder_starts_with_fresh_outputs_and_keeps_the_checkpoints(tmp_path: Path, images: Path) -> None:
    """What an earlier job left in the same --workdir (a failure reason, a summary, a model) is not read
    as the next job's: SageMaker gives each job a fresh /opt/ml, and syncs back only its checkpoints."""
    first = EmulatedCluster(validate_job_spec(spec()), EmulationOptions(workdir=tmp_path, channels={"train": images}))
    first.prepare()
    for host in first.hosts:
        (host.base_dir / "output" / "failure").write_text("AlgorithmError: the first job's")
        (host.base_dir / "output" / "data" / "summary.json").write_text("{}")
        (host.base_dir / "model" / "model.pt").write_bytes(b"first")
        (host.base_dir / "checkpoints" / "checkpoint.pt").write_bytes(b"step 60")
    second = EmulatedCluster(validate_job_spec(spec()), EmulationOptions(workdir=tmp_path, channels={"train": images}))
    second.prepare()
    for host in second.hosts:
        assert not (host.base_dir / "output" / "failure").exists() and list((host.base_dir / "output" / "data").iterdir()) == []
        assert list((host.base_dir / "model").iterdir()) == []
        assert (host.base_dir / "checkpoints" / "checkpoint.pt").read_bytes() == b"step 60"  # a rerun resumes
    assert second.summary() is None
    second.prepare()  # a second call of the same job (start calls it) keeps what the job wrote meanwhile
    (second.hosts[0].base_dir / "output" / "failure").write_text("this job's")
    second.prepare()
    assert (second.hosts[0].base_dir / "output" / "failure").read_text() == "this job's"


# Real clusters ---------------------------------------------------------------------------------------



def run_cli_with_two_data_hosts(raw_spec: dict, tmp_path: Path, images: Path) -> str:
    """Run a spec (1 DNN host × 2 processes, 2 data hosts, 12 steps) through the CLI; check that every
    host exited 0 and the DNN host printed 10 timed metric lines; return the hosts' lines (stderr)."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(raw_spec))
    result = subprocess.run(
        [sys.executable, "-m", "training.local", "run", str(spec_path), "--channel", f"train={images}",
         "--workdir", str(tmp_path / "run"), "--processes-per-host", "2", "--deadline-s", "240"],
        cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    table, logs = result.stdout, result.stderr  # the result on stdout, the hosts' lines on stderr
    assert re.search(r"^algo-3\s+dnn_group\s+dnn\s+0", table, re.M) and len(re.findall(r"^algo-[12]\s+data_group\s+data\s+0", table, re.M)) == 2
    assert "[algo-" not in table
    timed = [parse_metric_line(line) for line in logs.splitlines() if line.startswith("[algo-3 dnn_group] step=") and "step_time_ms=" in line]
    assert len(timed) == 10 and all(metrics["step_time_ms"] > 0 for metrics in timed)
    return logs


def assert_epochs_add_up(summary: dict) -> None:
    """No data-host epoch reached training other than exactly once, and every sample trained (each rank's
    batch at every step) is in a whole epoch, an incomplete one or among the spares."""
    epochs = summary["epochs"]
    assert epochs["duplicates"] == 0 and epochs["not_exactly_once"] == [] and epochs["untagged_batches"] == 0, epochs
    per_epoch = epochs["samples_per_epoch"]
    assert set(per_epoch) == (set(summary["data_host_names"]) if epochs["scope"] == "data host" else {"channel"})
    whole = sum(per_epoch[name.rsplit("/", 1)[0]] if "/" in name else per_epoch["channel"] for name in epochs["exactly_once"])
    turns = whole + sum(epochs["incomplete"].values())
    trained = summary["steps"] * summary["batch_size"] * summary["world_size"]
    # Each undecodable sample's turn counts too, beside the spare trained in its place.
    assert trained <= turns + epochs["spares"] <= trained + summary["skipped_samples"], epochs


@pytest.mark.cluster
def test_one_dnn_host_with_two_processes_and_two_data_hosts(tmp_path: Path, images: Path) -> None:
    out = run_cli_with_two_data_hosts(spec(data_hosts=2, steps=12), tmp_path, images)
    summary = json.loads((tmp_path / "run" / "algo-3" / "opt" / "ml" / "output" / "data" / "summary.json").read_text())
    assert (summary["steps"], summary["timed_steps"], summary["world_size"], summary["data_source"]) == (12, 10, 2, "data_service")
    assert len(summary["data_hosts"]) == 2 and summary["lost_data_hosts"] == []
    assert all(count > 0 for count in summary["batches_per_data_host"].values())
    assert sum(summary["batches_per_data_host"].values()) >= 12 * 2  # what every rank took, not rank 0's alone
    assert_epochs_add_up(summary)
    assert out.count("stopping (shutdown)") == 2  # both data hosts stopped on the trainer's authenticated request
    assert "[algo-1 data_group]" in out and "[algo-2 data_group]" in out


@pytest.mark.cluster
def test_training_finishes_when_a_data_host_dies(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(spec(data_hosts=2, steps=40), tmp_path, images)
    try:
        watcher.wait_for("algo-3", r"^step=5/40")
        cluster.kill("algo-1")
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.outcome("algo-3").exit_code == 0 and result.outcome("algo-2").exit_code == 0
    assert result.outcome("algo-1").exit_code == -9 and not result.ok  # a lost instance still fails the job
    summary = cluster.summary()
    assert summary["steps"] == 40 and summary["lost_data_hosts"] == [f"{cluster.host('algo-1').address}:{cluster.hyperparameters['data_service_port']}"]


def assert_data_hosts_exit_soon_after_the_dnn_host_dies(raw_spec: dict, tmp_path: Path, images: Path) -> None:
    """Kill the DNN host at step 3 of a long run; both data hosts must end by their idle timeout, with
    exit code 0, within 30 s, and none may be left as an orphan."""
    cluster, watcher = start(raw_spec, tmp_path, images)
    try:
        watcher.wait_for("algo-3", r"^step=3/")
        cluster.kill("algo-3")
        killed_at = time.monotonic()
        result = cluster.wait()
    finally:
        cluster.close()
    for name in ("algo-1", "algo-2"):
        outcome = result.outcome(name)
        assert outcome.exit_code == 0 and not outcome.orphaned
        assert outcome.ended_at - killed_at < 30
        assert any("stopping (idle timeout)" in line for line in watcher.of(name))
    assert result.orphans == []


@pytest.mark.cluster
def test_every_data_host_exits_soon_after_the_dnn_host_dies(tmp_path: Path, images: Path) -> None:
    assert_data_hosts_exit_soon_after_the_dnn_host_dies(spec(data_hosts=2, steps=10_000), tmp_path, images)


@pytest.mark.cluster
def test_a_data_host_outliving_the_dnn_group_is_killed_and_reported_as_an_orphan(tmp_path: Path, images: Path) -> None:
    cluster, watcher = start(spec(data_hosts=1, steps=10_000), tmp_path, images, data_idle_timeout_s=600, orphan_grace_s=3)
    try:
        watcher.wait_for("algo-2", r"^step=3/")
        cluster.kill("algo-2")
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.orphans == ["algo-1"] and not result.ok
    assert "ORPHAN" in result.report()


@pytest.mark.cluster
def test_the_deadline_kills_everything_and_fails(tmp_path: Path, images: Path) -> None:
    cluster, _ = start(spec(data_hosts=1, steps=10_000), tmp_path, images, deadline_s=12)
    try:
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.deadline_exceeded and not result.ok
    assert all(outcome.killed_at_deadline for outcome in result.outcomes)
    assert result.elapsed_s < 20


def run_homogeneous(raw_spec: dict, tmp_path: Path, images: Path) -> tuple[dict, LineWatcher]:
    """Run a single-group spec to its end; it must succeed. Returns its summary and its lines."""
    cluster, watcher = start(raw_spec, tmp_path, images)
    try:
        result = cluster.wait()
    finally:
        cluster.close()
    assert result.ok, result.report() + "\n".join(watcher.of("algo-1")[-30:])
    return cluster.summary(), watcher


@pytest.mark.cluster
def test_homogeneous_job_preprocesses_on_its_own_cpus(tmp_path: Path, images: Path) -> None:
    summary, watcher = run_homogeneous(spec(data_hosts=0, steps=8), tmp_path, images)
    assert summary["data_source"] == "local" and summary["timed_steps"] == 6
    assert any("instance group homogeneousCluster" in line for line in watcher.of("algo-1"))


def test_the_cli_refuses_a_bad_spec_with_a_named_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(spec() | {"instance_groups": []}))
    result = subprocess.run(
        [sys.executable, "-m", "training.local", "run", str(bad)], cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "JobSpecError: instance_groups: must be a non-empty list" in result.stderr


# Channels ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("distribution", ["replicated", "sharded"])
def test_each_data_host_gets_the_channel_as_its_distribution_says(tmp_path: Path, images: Path, distribution: str) -> None:
    """Replicated: every host gets every file. Sharded: each host only its share, the shares disjoint and
    together the dataset, and the host learns which it has from inputdataconfig.json, as on SageMaker."""
    from training.data_service.dataset import channel_is_sharded, scan_images

    raw = spec(data_hosts=2)
    raw["inputs"]["train"] |= {"distribution": distribution, "input_mode": "fastfile"}
    cluster = EmulatedCluster(validate_job_spec(raw), EmulationOptions(workdir=tmp_path, channels={"train": images}))
    cluster.prepare()
    every = {str(path.relative_to(images)) for path in images.rglob("*.jpg")}
    shares = []
    for host in cluster.hosts_with_role("data"):
        root = host.base_dir / "input" / "data" / "train"
        shares.append({str(Path(path).relative_to(root)) for path, _ in scan_images(root, "train", "data_group").samples})
        config = json.loads((host.base_dir / "input" / "config" / "inputdataconfig.json").read_text())
        assert config["train"]["TrainingInputMode"] == "FastFile"
        assert channel_is_sharded("train", {BASE_DIR_ENV: str(host.base_dir)}) == (distribution == "sharded")
    if distribution == "replicated":
        assert shares[0] == shares[1] == every
    else:
        assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] == every
        assert abs(len(shares[0]) - len(shares[1])) <= 1
    assert not (cluster.hosts_with_role("dnn")[0].base_dir / "input" / "data" / "train").exists()  # routed to the data group


@pytest.mark.cluster
def test_shards_that_hold_different_classes_fail_the_job_by_name_before_training(tmp_path: Path) -> None:
    """A class with fewer files than data hosts leaves one host's shard without it: its labels would
    mean other classes. The trainer compares every data host's classes and refuses."""
    from training.local.images import write_dataset

    images = write_dataset(tmp_path / "images", classes=3, per_class=4, size=32)
    for extra in sorted((images / "class_00").glob("*.jpg"))[1:]:
        extra.unlink()  # class_00 keeps one file: only one of the two hosts gets it
    raw = spec(data_hosts=2, steps=4)
    raw["inputs"]["train"]["distribution"] = "sharded"
    cluster, watcher = start(raw, tmp_path / "run", images)
    try:
        result = cluster.wait()
    finally:
        cluster.close()
    assert not result.ok
    trainer = "\n".join(watcher.of("algo-3"))
    assert "shards of a sharded channel hold different class folders" in trainer and "class_00" in trainer
    assert not any(line.startswith("step=") for line in watcher.of("algo-3"))


@pytest.mark.cluster
def test_two_data_hosts_each_serving_its_own_shard_train_the_job_from_files_or_tar_shards(
    tmp_path: Path, images: Path, image_shards: Path
) -> None:
    """The launcher reads the shard from inputdataconfig.json and serves what it holds: both hosts serve,
    and each says it serves its share of the images. The same images as tar shards train the same job
    and report the same figures; a tar member that does not decode is skipped and counted."""
    from training.local.images import add_member

    shards = tmp_path / "shards"
    shutil.copytree(image_shards, shards)
    with tarfile.open(shards / "shard-000006.tar", mode="w", format=tarfile.USTAR_FORMAT) as archive:
        add_member(archive, "broken/00000.jpg", b"\xff\xd8 cut off")
        add_member(archive, "broken/00000.cls", b"0")
    summaries = {}
    for layout, channel, total in (("files", images, 96), ("tar", shards, 97)):
        raw = spec(data_hosts=2, steps=12)
        raw["inputs"]["train"]["distribution"] = "sharded"
        cluster, watcher = start(raw, tmp_path / layout, channel)
        try:
            result = cluster.wait()
        finally:
            cluster.close()
        assert result.ok, result.report()
        summary = summaries[layout] = cluster.summary()
        # Both hosts are streams of the job; which one brings the first batches is a race the load decides
        # (a host that starts late may bring none in 12 steps): the logs below show each serves its share.
        batches = summary["batches_per_data_host"]
        assert summary["steps"] == 12 and len(batches) == 2 and sum(batches.values()) >= 12, batches
        assert summary["time_to_first_batch_s"] > 0  # from the DNN host launcher's start
        assert_epochs_add_up(summary)
        logs = {host: "\n".join(watcher.of(host)) for host in ("algo-1", "algo-2")}
        served = [re.search(r"serving channel 'train' \((\d+) samples from ([\w. ]+),", text) for text in logs.values()]
        assert all(served) and sum(int(match.group(1)) for match in served) == total, logs
        # The built-in's own listing names it, over the layout it found (not "ImageFolder" for any listing).
        assert {match.group(2) for match in served} == {"vision.list_samples" if layout == "files" else "vision.list_samples over tar shards"}
    # Each data host makes batches ahead (a queue of 8 of 8 images) beyond its ~49 images: every
    # sample of its first epoch is decoded, the broken one too.
    assert re.search(r"skipped 1 undecodable files", "\n".join(line for host in ("algo-1", "algo-2") for line in watcher.of(host)))
    assert summaries["tar"].keys() == summaries["files"].keys()
    same = ("status", "steps", "timed_steps", "warmup_steps", "batch_size", "world_size", "data_source")
    assert {key: summaries["tar"][key] for key in same} == {key: summaries["files"][key] for key in same}
