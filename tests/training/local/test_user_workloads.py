"""User workloads on the emulated cluster: the two examples (examples/workloads/), written only against the
workload contract, learn homogeneous and with 1 and 2 data hosts (the text one also on torch-xla's CPU
device), and the fault rows hold for a workload that is not ours: SIGTERM saves its own state and a resume
restores it, a data host lost, a preprocess that raises on one sample, a workload refused on every host
before anything trains."""

from __future__ import annotations

import json
import re
import shutil
import signal
import textwrap
from pathlib import Path

import pytest
import torch

from lambdas.core.job_spec import validate_job_spec
from tests.faults import Faults
from training.local.cluster import EmulatedCluster, EmulationOptions, LineWatcher
from training.metrics import parse_metric_line

REPO = Path(__file__).resolve().parents[3]
IMAGE_EXAMPLE = REPO / "examples" / "workloads" / "augmented_cnn"
TEXT_EXAMPLE = REPO / "examples" / "workloads" / "text_classifier"


def workload_spec(code: Path, *, data_hosts: int, steps: int, variant: str = "pytorch", validation: bool = True, **hyperparameters) -> dict:
    dnn_type = "ml.trn1.2xlarge" if variant == "neuron" else "ml.p3.2xlarge"
    groups = [{"name": "dnn_group", "role": "dnn", "instance_type": dnn_type, "count": 1}]
    inputs = {"train": {"s3_uri": "s3://bucket/train/"}}
    if validation:
        inputs["validation"] = {"s3_uri": "s3://bucket/validation/"}
    if data_hosts:
        groups.insert(0, {"name": "data_group", "role": "data", "instance_type": "ml.c5.xlarge", "count": data_hosts})
        inputs["train"]["groups"] = ["data_group"]
        if validation:
            inputs["validation"]["groups"] = ["dnn_group"]
    settings = {"steps": steps, "log_every": 5, "warmup_steps": 2} | ({"eval_channel": "validation"} if validation else {})
    return {"run_name": "user-workload", "variant": variant, "workload": {"code": str(code), "module": "workload"},
            "instance_groups": groups, "hyperparameters": settings | hyperparameters, "inputs": inputs}


def start(raw: dict, tmp_path: Path, channels: dict[str, Path], **options) -> tuple[EmulatedCluster, LineWatcher]:
    watcher = LineWatcher()
    cluster = EmulatedCluster(validate_job_spec(raw), EmulationOptions(workdir=tmp_path, channels=channels, **options), on_line=watcher)
    cluster.start()
    return cluster, watcher


def run(raw: dict, tmp_path: Path, channels: dict[str, Path], **options):
    cluster, watcher = start(raw, tmp_path, channels, **options)
    try:
        result = cluster.wait()
    finally:
        cluster.close()
    return cluster, watcher, result


def losses(watcher: LineWatcher, host: str) -> list[float]:
    return [values["loss"] for line in watcher.of(host) if "loss" in (values := parse_metric_line(line)) and "eval_" not in line]


def failure_of(cluster: EmulatedCluster, host: str) -> str:
    path = cluster.host(host).base_dir / "output" / "failure"
    return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def reviews(tmp_path_factory) -> Path:
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("make_reviews", TEXT_EXAMPLE / "make_data.py")
    make_data = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(make_data)
    return make_data.write(tmp_path_factory.mktemp("reviews"), train=256, validation=64)


@pytest.fixture(scope="module")
def held_out_images(tmp_path_factory) -> Path:
    from training.local.images import write_dataset

    return write_dataset(tmp_path_factory.mktemp("held-out"), classes=4, per_class=8, size=96, seed=1)


def check_learned(cluster: EmulatedCluster, watcher: LineWatcher, result, *, chance: float) -> dict:
    dnn = cluster.hosts_with_role("dnn")[0].name
    assert result.ok, result.report() + "\n" + "\n".join(watcher.of(dnn)[-30:])
    summary = cluster.summary()
    assert summary["status"] == "completed" and summary["skipped_samples"] == 0
    trained = losses(watcher, dnn)  # every step's (log_every 1): from the untrained model's first step on
    assert sum(trained[-3:]) / 3 < trained[0] * 0.7, trained  # it learns
    validation = summary["validation"]
    assert validation["samples"] > 0 and validation["metrics"]["accuracy"] > chance + 0.3, validation  # well above chance
    assert any(line.startswith(f"step={summary['steps']}/{summary['steps']} eval_loss=") for line in watcher.of(dnn))
    model = cluster.host(dnn).base_dir / "model"
    card = json.loads((model / "workload.json").read_text())
    assert card["module"] == "workload" and (model / "code" / "workload.py").exists() and card["validation"] == validation
    return summary


@pytest.mark.cluster
@pytest.mark.parametrize("data_hosts", [0, 1, 2])
def test_the_image_example_learns_homogeneous_and_from_data_hosts(tmp_path: Path, images: Path, held_out_images: Path, data_hosts: int) -> None:
    raw = workload_spec(IMAGE_EXAMPLE, data_hosts=data_hosts, steps=30, batch_size=8, image_size=32, dataloader_workers=1, log_every=1)
    cluster, watcher, result = run(raw, tmp_path, {"train": images, "validation": held_out_images})
    summary = check_learned(cluster, watcher, result, chance=0.25)
    assert summary["features"] == {"image": "uint8 [3, 32, 32]", "label": "int64 []"}
    if data_hosts:
        assert summary["data_source"] == "data_service"
        assert summary["lost_data_hosts"] == [], summary["lost_data_host_reasons"]  # why, should a loaded machine lose one
        # 30 batches of 8 over 96 images: 2.5 epochs' worth. The hosts split each epoch and the trainer takes
        # batches as they arrive, so a faster host runs ahead into later epochs; the first is whole by then.
        epochs = summary["epochs"]
        assert "0" in epochs["exactly_once"] and epochs["not_exactly_once"] == [] and epochs["duplicates"] == 0, epochs
        assert all(result.outcome(host.name).exit_code == 0 for host in cluster.hosts_with_role("data"))
    assert result.orphans == []


@pytest.mark.cluster
@pytest.mark.parametrize(("variant", "data_hosts"), [("pytorch", 0), ("pytorch", 1), ("pytorch", 2), ("neuron", 0), ("neuron", 1)],
                         ids=["gpu-homogeneous", "gpu-1-data-host", "gpu-2-data-hosts", "xla-homogeneous", "xla-1-data-host"])
def test_the_text_example_learns_on_gpu_and_xla_devices(tmp_path: Path, reviews: Path, variant: str, data_hosts: int) -> None:
    raw = workload_spec(TEXT_EXAMPLE, data_hosts=data_hosts, steps=40, variant=variant, batch_size=16, dataloader_workers=1, log_every=1)
    cluster, watcher, result = run(raw, tmp_path, {"train": reviews / "train", "validation": reviews / "validation"}, processes_per_host=1)
    summary = check_learned(cluster, watcher, result, chance=0.5 - 0.2)  # two classes: accuracy above 0.6
    assert summary["validation"]["samples"] == 64
    assert summary["device"] == ("xla:0" if variant == "neuron" else "cpu")
    assert summary["features"] == {"input_ids": "int32 [32]", "label": "int64 []"}


# Faults with a user workload -------------------------------------------------------------------------------

COUNTING = '''
import numpy as np
import torch

HYPERPARAMETERS = {"fail_on": -1}

def list_samples(ctx):
    return list(range(64))

def preprocess(sample, ctx):
    if sample == ctx.hyperparameters["fail_on"]:
        raise ValueError("a broken record")
    return {"x": np.full(4, sample / 64, dtype=np.float32) + ctx.rng.normal(size=4).astype(np.float32), "y": np.float32(sample % 2)}

def build_model(ctx):
    return torch.nn.Linear(4, 1)

def build_optimizer(model, ctx):  # a schedule computed with NumPy, as the augmented_cnn example's: its state holds np.float64
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 0.5 * (1 + np.cos(np.pi * min(1.0, done / ctx.steps))))

def train_step(model, batch, ctx):
    ctx.state["steps_seen"] = ctx.state.get("steps_seen", 0) + 1  # the workload's own state: checkpointed
    return torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])
'''


def counting_workload(tmp_path: Path) -> Path:
    folder = tmp_path / "counting"
    folder.mkdir()
    (folder / "workload.py").write_text(textwrap.dedent(COUNTING))
    return folder


@pytest.mark.cluster
@pytest.mark.parametrize("data_hosts", [0, 1], ids=["homogeneous", "heterogeneous"])
def test_sigterm_saves_the_workloads_state_and_a_resume_restores_it(tmp_path: Path, data_hosts: int) -> None:
    code = counting_workload(tmp_path)
    channel = tmp_path / "empty-channel"
    channel.mkdir()
    raw = workload_spec(code, data_hosts=data_hosts, steps=10_000, validation=False, batch_size=4, log_every=1, dataloader_workers=1)
    cluster, watcher = start(raw, tmp_path / "first", {"train": channel})
    faults = Faults(cluster, watcher)
    dnn = f"algo-{data_hosts + 1}"
    try:
        faults.when(dnn, r"^step=8/", lambda: [faults.signal_launcher(host.name, signal.SIGTERM) for host in cluster.hosts])
        result = cluster.wait()
    finally:
        cluster.close()
    failure = failure_of(cluster, dnn)
    assert result.outcome(dnn).exit_code != 0 and failure.startswith("TrainingStopped: stopped by SIGTERM after step"), failure
    stopped = int(re.search(r"after step (\d+)", failure).group(1))
    checkpoint = torch.load(cluster.host(dnn).base_dir / "checkpoints" / "checkpoint.pt", weights_only=True)
    assert checkpoint["workload_state"] == {"steps_seen": stopped} and checkpoint["loop"]["step"] == stopped
    # The resumed job: the checkpoint seeds it (as a resume channel would), and it carries on to the end.
    resumed_raw = raw | {"hyperparameters": raw["hyperparameters"] | {"steps": stopped + 6}}
    resumed = EmulatedCluster(validate_job_spec(resumed_raw), EmulationOptions(workdir=tmp_path / "second", channels={"train": channel}))
    resumed.prepare()
    shutil.copytree(cluster.host(dnn).base_dir / "checkpoints", resumed.host(dnn).base_dir / "checkpoints", dirs_exist_ok=True)
    outcome = resumed.run()
    assert outcome.ok, outcome.report()
    final = torch.load(resumed.host(dnn).base_dir / "checkpoints" / "checkpoint.pt", weights_only=True)
    assert final["workload_state"] == {"steps_seen": stopped + 6}  # restored, then counted on: not restarted at 0
    assert resumed.summary()["start_step"] == stopped


@pytest.mark.cluster
def test_a_seed_trains_the_same_batches_and_losses_homogeneous_and_with_a_data_host(tmp_path: Path) -> None:
    """One seed, one order: a data host draws the channel's order as the homogeneous trainer's sampler does,
    and each sample's random draws from (seed, epoch, sample), so the two runs train the same batches and
    print the same losses, step for step, past an epoch's end (64 samples: 16 steps of 4)."""
    code = counting_workload(tmp_path)
    channel = tmp_path / "empty-channel"
    channel.mkdir()
    printed = {}
    for data_hosts in (0, 1):
        raw = workload_spec(code, data_hosts=data_hosts, steps=20, validation=False, batch_size=4, log_every=1, dataloader_workers=1, seed=11)
        cluster, watcher, result = run(raw, tmp_path / f"run-{data_hosts}", {"train": channel}, processes_per_host=1)
        assert result.ok, result.report()
        printed[data_hosts] = [re.search(r"loss=(\S+)", line).group(1) for line in watcher.of(f"algo-{data_hosts + 1}")
                               if re.match(r"step=\d+/20 ", line)]
    assert len(printed[0]) == 20 and printed[1] == printed[0], printed


@pytest.mark.cluster
def test_a_resumed_heterogeneous_run_trains_the_rest_of_its_interrupted_epoch_and_nothing_twice(tmp_path: Path) -> None:
    """Two data hosts split each 64-sample epoch; the job is stopped mid-epoch (with batches prefetched
    in the trainer's queues, never trained), and a second job resumes its checkpoint. The epoch
    accounting spans both jobs: every epoch either trained each sample exactly once or is the last, still
    running; and every sample the two jobs trained is in it once."""
    code = counting_workload(tmp_path)
    channel = tmp_path / "empty-channel"
    channel.mkdir()
    raw = workload_spec(code, data_hosts=2, steps=10_000, validation=False, batch_size=4, log_every=1, dataloader_workers=1)
    # Two ranks: each takes its own batches from each host, so one may stop with a batch untrained that the
    # other's later batches passed (a gap, served first on resuming).
    cluster, watcher = start(raw, tmp_path / "first", {"train": channel}, processes_per_host=2)
    faults = Faults(cluster, watcher)
    try:
        faults.when("algo-3", r"^step=10/", lambda: [faults.signal_launcher(host.name, signal.SIGTERM) for host in cluster.hosts])
        cluster.wait()
    finally:
        cluster.close()
    stopped = int(re.search(r"after step (\d+)", failure_of(cluster, "algo-3")).group(1))
    first = torch.load(cluster.host("algo-3").base_dir / "checkpoints" / "checkpoint.pt", weights_only=True)["loop"]["input"]
    # Per data host that any rank trained from by then (a host slow to start may have served none yet).
    assert set(first["positions"]) <= {"algo-1", "algo-2"} and first["positions"] and first["layout"]["hosts"] == ["algo-1", "algo-2"]
    total = stopped + 20  # 2 ranks of 4 samples a step: three epochs of 64 and a bit over both jobs
    resumed_raw = raw | {"hyperparameters": raw["hyperparameters"] | {"steps": total}}
    resumed = EmulatedCluster(validate_job_spec(resumed_raw), EmulationOptions(workdir=tmp_path / "second", channels={"train": channel},
                                                                               processes_per_host=2))
    resumed.prepare()
    shutil.copytree(cluster.host("algo-3").base_dir / "checkpoints", resumed.host("algo-3").base_dir / "checkpoints", dirs_exist_ok=True)
    outcome = resumed.run()
    assert outcome.ok, outcome.report()
    summary = resumed.summary()
    assert summary["start_step"] == stopped and summary["data_position"]["resumed"] == "exactly", summary["data_position"]
    epochs = summary["epochs"]
    assert epochs["not_exactly_once"] == [] and epochs["duplicates"] == 0, epochs
    assert [str(epoch) for epoch in range(len(epochs["exactly_once"]))] == epochs["exactly_once"] and len(epochs["exactly_once"]) >= 2, epochs
    assert 64 * len(epochs["exactly_once"]) + sum(epochs["incomplete"].values()) == 2 * 4 * total, epochs  # both jobs' samples, each once


@pytest.mark.cluster
@pytest.mark.parametrize("data_hosts", [0, 1], ids=["homogeneous", "heterogeneous"])
def test_a_preprocess_that_raises_on_one_sample_fails_the_job_naming_the_hook_and_the_sample(tmp_path: Path, data_hosts: int) -> None:
    code = counting_workload(tmp_path)
    channel = tmp_path / "empty-channel"
    channel.mkdir()
    raw = workload_spec(code, data_hosts=data_hosts, steps=200, validation=False, batch_size=4, fail_on=37, dataloader_workers=1)
    cluster, watcher, result = run(raw, tmp_path / "run", {"train": channel})
    dnn = f"algo-{data_hosts + 1}"
    failure = failure_of(cluster, dnn)
    assert result.outcome(dnn).exit_code != 0
    assert re.search(r"preprocess raised ValueError at workload.py:\d+ on sample 37 \(37\): a broken record", failure), failure
    assert result.orphans == []


@pytest.mark.cluster
def test_a_workload_off_the_contract_is_refused_on_every_host_before_anything_serves_or_trains(tmp_path: Path) -> None:
    code = counting_workload(tmp_path)
    (code / "workload.py").write_text((code / "workload.py").read_text().replace("def train_step", "def train_stpe"))
    channel = tmp_path / "empty-channel"
    channel.mkdir()
    raw = workload_spec(code, data_hosts=1, steps=20, validation=False, batch_size=4)
    cluster, watcher, result = run(raw, tmp_path / "run", {"train": channel})
    for host in cluster.hosts:
        assert result.outcome(host.name).exit_code == 2
        assert "MissingHookError" in failure_of(cluster, host.name) and "train_step" in failure_of(cluster, host.name)
    assert not any("serving channel" in line for line in watcher.of("algo-1"))
    assert not any("starting the trainer" in line for line in watcher.of("algo-2"))
    assert result.orphans == []


@pytest.mark.cluster
def test_a_data_host_killed_mid_run_leaves_training_to_the_other(tmp_path: Path, reviews: Path) -> None:
    raw = workload_spec(TEXT_EXAMPLE, data_hosts=2, steps=100_000, validation=False, batch_size=16, log_every=10)
    cluster, watcher = start(raw, tmp_path, {"train": reviews / "train"}, data_batch_timeout_s=8)
    faults = Faults(cluster, watcher)
    try:
        faults.when("algo-3", r"^step=20/", lambda: cluster.kill("algo-1"))
        watcher.wait_for("algo-3", r"data host .* lost", timeout=120)
        lost_at = max(int(match.group(1)) for line in watcher.of("algo-3") if (match := re.match(r"step=(\d+)/", line)))
        watcher.wait_for("algo-3", rf"^step={lost_at + 50}/", timeout=120)
        faults.signal_launcher("algo-3", signal.SIGTERM)
        result = cluster.wait()
    finally:
        cluster.close()
    summary = cluster.summary()
    port = cluster.hyperparameters["data_service_port"]
    assert summary["status"] == "stopped" and summary["lost_data_hosts"] == [f"{cluster.host('algo-1').address}:{port}"]
    assert result.outcome("algo-2").exit_code == 0 and result.orphans == []


# The sizing advisor on a user workload ---------------------------------------------------------------------


@pytest.mark.cluster
def test_the_profile_measures_the_workloads_own_preprocessing_and_step_for_the_advisor(tmp_path: Path, images: Path, capsys) -> None:
    """`hetero profile`: the example's own preprocess (in a data host's worker processes, on one CPU) and its
    train-only step (cached batches on the emulated cluster), in the figures the sweep's advisor takes."""
    from lambdas.core.sizing import SizingProfile, data_hosts_needed, ms_per_batch_per_vcpu
    from training.local.profile import main as profile

    raw = workload_spec(IMAGE_EXAMPLE, data_hosts=1, steps=12, validation=False, batch_size=8, image_size=32, blur_passes=4)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(raw))
    assert profile([str(spec_file), "--channel", f"train={images}", "--batches", "6"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["preprocess_ms_per_batch_per_vcpu"] > 0 and figures["train_ms_per_step"] > 0
    advisor = figures["advisor"]
    sizing = SizingProfile(ms_per_batch_per_vcpu(advisor["samples_per_s_per_vcpu"], 8), advisor["train_ms_per_step"])
    assert data_hosts_needed(sizing, vcpus_per_data_host=4) >= 0
    # Heavier augmentation of the same workload costs more per batch: the figure is the workload's own. Both
    # sides are measured the same way, one after the other, at a contrast (no blur against 24 passes) that
    # the load of a parallel suite cannot hide.
    from training.local.profile import preprocess_ms_per_batch

    def ms_per_batch(blur_passes: int) -> float:
        raw["hyperparameters"]["blur_passes"] = blur_passes
        return preprocess_ms_per_batch(validate_job_spec(raw), images, (0,), batches=6, code_dir=IMAGE_EXAMPLE)

    lighter, heavier = ms_per_batch(0), ms_per_batch(24)
    assert heavier > lighter * 1.5, (lighter, heavier)


@pytest.mark.cluster
def test_ddp_ranks_validate_a_channel_smaller_than_the_world_without_a_collective_hang(tmp_path: Path, images: Path) -> None:
    """Two DDP ranks, a BatchNorm model, one validation image: the rank with no validation batch must not
    wait in a DDP buffer broadcast the other never makes (eval_step gets the unwrapped module)."""
    from training.local.images import write_dataset

    one_image = write_dataset(tmp_path / "one", classes=1, per_class=1, size=64)
    raw = workload_spec(IMAGE_EXAMPLE, data_hosts=0, steps=6, batch_size=4, image_size=32, dataloader_workers=0, eval_every=3)
    cluster, watcher, result = run(raw, tmp_path / "run", {"train": images, "validation": one_image}, processes_per_host=2,
                                   trainer_stall_timeout_s=60)
    assert result.ok, result.report() + "\n" + "\n".join(watcher.of("algo-1")[-20:])
    assert cluster.summary()["validation"]["samples"] == 1


def test_a_channel_folder_that_is_absent_or_not_the_specs_is_refused_before_any_host_starts(tmp_path: Path, images: Path) -> None:
    spec = validate_job_spec(workload_spec(IMAGE_EXAMPLE, data_hosts=1, steps=4, validation=False))
    for channels, words in (({"train": tmp_path / "trian"}, "--channel train=.*trian: the folder .*trian does not exist"),
                            ({"train": images, "trian": images},
                             r"--channel trian: the spec has no such input \(did you mean --channel train=.*\? it has \['train'\]\)")):
        cluster = EmulatedCluster(spec, EmulationOptions(workdir=tmp_path / "run", channels=channels))
        with pytest.raises(Exception, match=words):
            cluster.prepare()
