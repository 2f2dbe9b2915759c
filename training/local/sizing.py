"""The data-group sizing advisor checked against the emulated cluster: predicted vs measured data hosts.

1. profiles the job the way the advisor wants it: one batch's preprocessing on one full data core, and
   the DNN host's step with its input in memory (training/local/profile.py);
2. gives every data host a fraction of a core (a cgroup CPU quota) sized so that one data host cannot
   keep up but the predicted number can, all on the one spare core of a small machine;
3. asks the advisor (lambdas/core/sizing.py) how many such hosts the job needs;
4. runs the heterogeneous job with one host fewer than predicted and with the prediction, and calls a run
   input-bound when the trainer spends more than ``INPUT_BOUND_WAIT`` of its step waiting for batches
   (the data wait, not the step time, tells: the step's compute part moves with this shared machine's noise).

    python -m training.local.sizing [--workdir build/sizing] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from lambdas.core.job_spec import JobSpec, validate_job_spec
from lambdas.core.sizing import SizingProfile, data_hosts_needed, predicted_step_ms
from lambdas.core.sweep import with_data_hosts
from training.local.cluster import EmulatedCluster, EmulationOptions
from training.local.cpu_quota import available as quotas_available
from training.local.images import write_dataset
from training.local.profile import data_host_cpus, preprocess_ms_per_batch, train_ms_per_step

REPO = Path(__file__).resolve().parents[2]
# Heavy augmentation on small crops, and a CNN wide enough that training outweighs one batch's
# preprocessing on a full core: then a fraction of a core per data host is what makes the job input-bound.
OVERRIDES = {"model": "cnn", "cnn_width": 16, "image_size": 64, "augment": "heavy"}
# One data host at the chosen quota makes batches this much slower than training needs them.
ONE_HOST_SHORTFALL = 1.8
# A run is input-bound when the trainer waits for batches for more than this share of its step (p50s).
# With one host fewer than needed the wait is ~40% of the step; with enough hosts it is ~1%.
INPUT_BOUND_WAIT = 0.15


@dataclass(frozen=True)
class Measurement:
    data_hosts: int
    predicted_step_ms: float
    step_ms: float
    data_wait_ms: float
    input_bound: bool


@dataclass(frozen=True)
class SizingCheck:
    preprocess_ms_per_batch_per_core: float
    train_ms_per_step: float
    quota_cores: float
    predicted: int
    measurements: tuple[Measurement, ...]

    @property
    def measured(self) -> int | None:
        """The fewest data hosts measured not input-bound, when every smaller count measured was."""
        for measurement in self.measurements:
            if not measurement.input_bound:
                return measurement.data_hosts
        return None

    def render(self) -> str:
        rows = [
            f"profile: preprocessing {self.preprocess_ms_per_batch_per_core:.1f} ms per batch on one core, "
            f"training {self.train_ms_per_step:.1f} ms/step with input in memory",
            f"each data host gets {self.quota_cores:.3f} core (cgroup quota); the advisor predicts {self.predicted} data hosts",
            f"{'data hosts':>10} {'predicted step':>15} {'measured step':>14} {'data wait':>10}  input-bound (waits > {INPUT_BOUND_WAIT:.0%} of its step)",
        ]
        for m in self.measurements:
            rows.append(f"{m.data_hosts:>10} {m.predicted_step_ms:>12.1f} ms {m.step_ms:>11.1f} ms {m.data_wait_ms:>7.1f} ms  {'yes' if m.input_bound else 'no'}")
        rows.append(f"predicted {self.predicted} data hosts, measured {self.measured}")
        return "\n".join(rows)


@dataclass(frozen=True)
class CheckScale:
    """How big the check's job is. The benchmark's default gives steady figures; a test's smaller scale
    exercises the same path (profile, quota, prediction, a run per count) at a fraction of the cost."""

    steps: int = 70
    batch_size: int = 32
    source_image_size: int = 320  # the images on disk, before the heavy augmentation crops them to 64
    images_per_class: int = 64
    profile_batches: int = 20


def base_spec(scale: CheckScale) -> dict:
    raw = json.loads((REPO / "examples" / "pytorch-heterogeneous.json").read_text())
    # The data hosts fill their queues while the trainer starts; the warm-up steps drain that head start,
    # so the timed steps see steady state.
    raw["hyperparameters"] = {
        **raw["hyperparameters"], **OVERRIDES, "batch_size": scale.batch_size, "steps": scale.steps, "warmup_steps": scale.steps * 3 // 7
    }
    return raw


def measure(spec: JobSpec, workdir: Path, images: Path, quota: float) -> tuple[float, float]:
    shutil.rmtree(workdir, ignore_errors=True)
    cluster = EmulatedCluster(
        spec, EmulationOptions(workdir=workdir, channels={"train": images}, cpu_quota={"data_group": quota}), on_line=lambda *_: None
    )
    result = cluster.run()
    summary = cluster.summary()
    if not result.ok or not summary:
        raise SystemExit(f"the sizing run with {spec.data_groups[0].count} data hosts failed:\n{result.report()}")
    return summary["step_time_ms"]["p50"], summary["data_wait_ms"]["p50"]


def run_check(workdir: Path, scale: CheckScale) -> SizingCheck:
    images = write_dataset(workdir / "images", classes=4, per_class=scale.images_per_class, size=scale.source_image_size)
    raw = base_spec(scale)
    hetero = validate_job_spec(raw)
    shutil.rmtree(workdir / "train-only", ignore_errors=True)  # a fresh tree: a profile must not resume a checkpoint
    options = EmulationOptions(workdir=workdir / "train-only", channels={"train": images})
    data_core = data_host_cpus(hetero, options)[0]
    preprocess = preprocess_ms_per_batch(hetero, images, data_core, batches=scale.profile_batches)
    train = train_ms_per_step(hetero, options, on_line=lambda *_: None)
    quota = min(0.45, max(0.05, preprocess / (ONE_HOST_SHORTFALL * train)))
    profile = SizingProfile(preprocess_ms_per_batch_per_vcpu=preprocess, train_ms_per_step=train)
    predicted = max(1, data_hosts_needed(profile, quota))
    measurements = []
    for count in sorted({max(1, predicted - 1), predicted}):
        spec = validate_job_spec(with_data_hosts(raw, count, hetero.data_groups[0].instance_type))
        step, wait = measure(spec, workdir / f"hosts-{count}", images, quota)
        measurements.append(Measurement(count, predicted_step_ms(profile, count, quota), step, wait, wait > INPUT_BOUND_WAIT * step))
    return SizingCheck(preprocess, train, quota, predicted, tuple(measurements))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "sizing")
    parser.add_argument("--steps", type=int, default=70)
    args = parser.parse_args(argv)
    if not quotas_available():
        print("this machine has no writable cgroup CPU controller: CPU quotas, and this check, need one", file=sys.stderr)
        return 2
    check = run_check(args.workdir, CheckScale(steps=args.steps))
    print(check.render())
    return 0 if check.measured == check.predicted else 1


if __name__ == "__main__":
    sys.exit(main())
