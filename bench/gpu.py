"""The PyTorch trainer on a GPU: what its defaults buy over fp32, and what a data host buys a homogeneous job.

    python bench/gpu.py [--rounds 3] [--steps 60] [--images 3000]      (any CUDA machine; make bench-gpu)
    python bench/gpu.py --dry-run                                        (this script's plumbing, on CPUs)

1. Train-only, input already on the device (ResNet50, 224², batch 128), the runtime's step of the built-in
   vision workload (training/workloads/vision.py, through training/trainers/pytorch_runtime.py):
   fp32 as PyTorch runs by default, against the trainer's defaults (``precision=auto``: bf16 on Ampere and
   later; channels_last; cuDNN autotuning), and the defaults with ``compile=true``. Rounds interleave the
   configurations; each is a mean step over its steps (one step in flight, as in training), the median
   over rounds is reported, with ratios to fp32 (goal: defaults ≥ 1.9× on Hopper).
2. The emulated cluster on this machine's own CPUs: the homogeneous job (DataLoader workers on the DNN
   host's CPUs) against the heterogeneous one (the same CPUs split between the DNN host and one data host
   serving over gRPC), with the same defaults, on JPEGs of ~500 px: step time p50 and mean of each, and
   the ratio.

Timing belongs here, never in a test. Clear nothing by hand: each run gets a fresh work folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.local.cluster import EmulatedCluster, EmulationOptions  # noqa: E402
from training.local.demo import load_spec, quiet  # noqa: E402
from training.local.images import write_dataset  # noqa: E402
from training.local.single_host import single_host_trainer  # noqa: E402

FULL = {"model": "resnet50", "image_size": 224, "batch_size": 128}
DRY = {"model": "cnn", "cnn_width": 8, "image_size": 64, "batch_size": 16}
TRAIN_ONLY = {
    "fp32": {"precision": "fp32", "channels_last": False},
    "defaults": {},
    "defaults+compile": {"compile": True},
}


def train_only_ms(settings: dict, steps: int, warmup: int, classes: Path) -> float:
    """Mean step time of the runtime's train_step for the built-in vision workload (the job's trainer,
    built from a one-host job folder as a job builds it) on a batch already on the device."""
    with tempfile.TemporaryDirectory() as scratch:
        trainer = single_host_trainer(Path(scratch), settings | {"steps": steps + warmup, "warmup_steps": warmup}, {"train": classes})
        size, batch_size = trainer.prepared.hyperparameters["image_size"], trainer.runtime.batch_size
        batch = {
            "image": torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, device=trainer.device),
            "label": torch.randint(0, len(trainer.classes), (batch_size,), device=trainer.device),
        }
        for _ in range(warmup):
            trainer.train_step(batch)
        trainer.settle()
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(batch)  # keeps one step in flight, as in training
        trainer.settle()  # the last step done too
        return (time.perf_counter() - started) * 1000 / steps


def cluster_figures(spec_name: str, overrides: dict, images: Path, workdir: Path, cpus: dict[str, int]) -> dict:
    spec = load_spec(spec_name, overrides)
    shutil.rmtree(workdir, ignore_errors=True)  # a reused folder would resume its checkpoint
    options = EmulationOptions(workdir=workdir, channels={"train": images}, cpus_per_host=cpus, deadline_s=1800)
    cluster = EmulatedCluster(spec, options, on_line=quiet)
    result = cluster.run()
    summary = cluster.summary()
    if not result.ok or not summary:
        raise SystemExit(f"{spec_name} failed:\n{result.report()}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per train-only measurement")
    parser.add_argument("--cluster-steps", type=int, default=300)
    parser.add_argument("--images", type=int, default=3000, help="JPEGs in the emulated jobs' channel")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU: checks the script, measures nothing")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit("no CUDA device here: run on a GPU machine, or with --dry-run to check the script")
    sizes = DRY if args.dry_run else FULL
    if args.dry_run:
        args.rounds, args.steps, args.cluster_steps, args.images = 1, 3, 20, 64
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"
    print(f"device: {device}; torch {torch.__version__}; {len(os.sched_getaffinity(0))} CPUs", flush=True)

    # 1. Train-only.
    names = list(TRAIN_ONLY) if not args.dry_run else ["fp32", "defaults"]
    measured: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as scratch:
        # 1000 class folders of one tiny image: the model's head has ImageNet's 1000 classes.
        classes = write_dataset(Path(scratch) / "classes", classes=10 if args.dry_run else 1000, per_class=1, size=32)
        for _ in range(args.rounds):
            for name in names:
                measured[name].append(train_only_ms(sizes | TRAIN_ONLY[name], args.steps, warmup=5 if args.dry_run else 15, classes=classes))
    fp32 = statistics.median(measured["fp32"])
    print(f"\ntrain-only, {sizes['model']} {sizes['image_size']}² batch {sizes['batch_size']}, input on the device:")
    print(f"{'configuration':<18} {'ms/step':>9} {'images/s':>9} {'× fp32':>7}")
    for name in names:
        ms = statistics.median(measured[name])
        print(f"{name:<18} {ms:>9.1f} {sizes['batch_size'] * 1000 / ms:>9.0f} {fp32 / ms:>7.2f}")

    # 2. Homogeneous against heterogeneous on this machine's CPUs.
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    try:
        per_class = max(1, args.images // 10)
        images = write_dataset(work / "images", classes=10, per_class=per_class, size=96 if args.dry_run else 500)
        cpus = len(os.sched_getaffinity(0))
        dnn_cpus = max(1, cpus // 4)
        overrides = sizes | {"augment": "standard", "steps": args.cluster_steps, "warmup_steps": 5 if args.dry_run else 30}
        homogeneous = cluster_figures("pytorch-homogeneous.json", overrides, images, work / "homogeneous", {"dnn_group": cpus})
        heterogeneous = cluster_figures(
            "pytorch-heterogeneous.json", overrides, images, work / "heterogeneous", {"dnn_group": dnn_cpus, "data_group": cpus - dnn_cpus}
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nemulated cluster, {args.images} JPEGs, {cpus} CPUs: homogeneous on all of them, heterogeneous "
          f"{dnn_cpus} for the DNN host + {cpus - dnn_cpus} for one data host:")
    print(f"{'job':<14} {'p50 ms':>8} {'mean ms':>8} {'images/s':>9} {'precision':>10}")
    for name, summary in (("homogeneous", homogeneous), ("heterogeneous", heterogeneous)):
        step = summary["step_time_ms"]
        print(f"{name:<14} {step['p50']:>8.1f} {step['mean']:>8.1f} {summary['samples_per_s']:>9.0f} {summary['precision']:>10}")
    ratio = homogeneous["step_time_ms"]["mean"] / heterogeneous["step_time_ms"]["mean"]
    mean_over_p50 = homogeneous["step_time_ms"]["mean"] / homogeneous["step_time_ms"]["p50"]
    print(f"\nheterogeneous speed-up (mean step): {ratio:.2f}×; homogeneous mean/p50 {mean_over_p50:.2f} (epoch-turn stalls show here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
