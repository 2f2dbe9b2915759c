"""Offload efficiency: the heterogeneous job's step time against the ideal its two halves allow.

    python bench/offload.py [--rounds 3] [--steps 80]

Each round measures, back to back on the emulated cluster: the data pipeline alone on one data host's
CPU, the model alone on the DNN host's CPU (real batches cycled in memory), and the heterogeneous example job. The
ideal step is max(train-only, preprocessing per batch / data hosts); efficiency = measured / ideal, 1.0
meaning that moving preprocessing to a data host over gRPC cost the DNN host nothing. The machine is
shared and noisy, so rounds interleave the three runs and the median ratio is reported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.local.cluster import EmulationOptions, plan_hosts  # noqa: E402
from training.local.demo import LOCAL_OVERRIDES, load_spec, quiet, run_job  # noqa: E402
from training.local.images import write_dataset  # noqa: E402
from training.local.profile import Profile, preprocess_ms_per_batch, train_ms_per_step  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="offload-"))
    images = write_dataset(workdir / "images", classes=4, per_class=64, size=320)
    overrides = LOCAL_OVERRIDES | {"steps": args.steps}
    homogeneous = load_spec("pytorch-homogeneous.json", overrides)
    heterogeneous = load_spec("pytorch-heterogeneous.json", overrides)

    def options(name: str) -> EmulationOptions:
        shutil.rmtree(workdir / name, ignore_errors=True)
        return EmulationOptions(workdir=workdir / name, channels={"train": images})

    data_hosts = sum(group.count for group in heterogeneous.data_groups)
    data_cpus = next(h.cpus for h in plan_hosts(heterogeneous, options("plan"), sorted(os.sched_getaffinity(0)), 0) if h.role == "data")
    ratios = []
    print(f"{'round':>5} {'preprocess ms/batch':>20} {'train-only ms':>14} {'ideal ms':>9} {'hetero ms':>10} {'hetero/ideal':>13}")
    for round_number in range(1, args.rounds + 1):
        profile = Profile(
            preprocess_ms_per_batch(homogeneous, images, data_cpus),
            train_ms_per_step(homogeneous, options("train-only"), on_line=quiet),
        )
        hetero = run_job("heterogeneous", heterogeneous, options("heterogeneous"), progress=False)
        ideal = profile.ideal_step_ms(data_hosts)
        ratios.append(hetero.step_ms / ideal)
        print(
            f"{round_number:>5} {profile.preprocess_ms_per_batch:>20.1f} {profile.train_ms_per_step:>14.1f} {ideal:>9.1f} "
            f"{hetero.step_ms:>10.1f} {ratios[-1]:>13.3f}",
            flush=True,
        )
    print(f"\nheterogeneous step time / ideal: median {statistics.median(ratios):.3f} over {args.rounds} rounds (goal ≤ 1.05)")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
