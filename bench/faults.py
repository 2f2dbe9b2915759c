"""Faults at training speed: what the watchdogs cost a healthy job, and how fast they act on a faulty one.

    python bench/faults.py [--model cnn --image-size 64 --batch-size 32 --data-cpus 1 --steps 300]
    python bench/faults.py --model resnet50 --image-size 224 --batch-size 128 --data-cpus 7   # on a GPU host

On the emulated cluster (2 data hosts, 1 DNN host; the DNN host trains on its GPU when it has one):

1. a healthy heterogeneous run: step time p50 and data wait, with every guard on (the job's token on each
   call, keep-alive pings, the per-batch deadline, the progress marks, the per-step agreement);
2. the same job, endless: one data host frozen (SIGSTOP) at a step; seconds until the DNN host drops it,
   and the step time on the remaining host afterwards; then SIGTERM to the DNN host's launcher: seconds
   until the DNN host exits with a checkpoint and the model saved.

Ratios are measured side by side in one run: the step time after the loss over the healthy one (one data
host of two left; 2.0 when the data hosts bound the step, 1.0 when the accelerator does).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lambdas.core.job_spec import validate_job_spec  # noqa: E402
from training.local.cluster import EmulatedCluster, EmulationOptions, LineWatcher  # noqa: E402
from training.local.images import write_dataset  # noqa: E402
from training.metrics import parse_metric_line  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pytorch-heterogeneous.json"


def spec(args: argparse.Namespace, steps: int, log_every: int = 1):  # noqa: ANN201 (a JobSpec)
    raw = json.loads(EXAMPLE.read_text())
    raw["instance_groups"][0]["count"] = 2  # the data group
    raw["hyperparameters"] = {
        "model": args.model, "image_size": args.image_size, "batch_size": args.batch_size, "augment": "standard",
        "steps": steps, "warmup_steps": 10, "log_every": log_every, "cnn_width": 16,
    }
    return validate_job_spec(raw)


def options(workdir: Path, images: Path, args: argparse.Namespace) -> EmulationOptions:
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh tree: a run must not resume another's checkpoint
    return EmulationOptions(
        workdir=workdir, channels={"train": images}, cpus_per_host={"data_group": args.data_cpus, "dnn_group": 2}, deadline_s=900,
    )


def step_times(lines: list[str], after_step: int = 0) -> list[float]:
    values = []
    for line in lines:
        match = re.match(r"step=(\d+)/", line)
        if match and int(match.group(1)) > after_step and "step_time_ms=" in line:
            values.append(parse_metric_line(line)["step_time_ms"])
    return values


def healthy(args: argparse.Namespace, workdir: Path, images: Path) -> dict:
    cluster = EmulatedCluster(spec(args, args.steps), options(workdir / "healthy", images, args), on_line=lambda *_: None)
    result = cluster.run()
    summary = cluster.summary()
    if not result.ok or not summary:
        raise SystemExit(f"the healthy run failed:\n{result.report()}")
    return summary


def faulty(args: argparse.Namespace, workdir: Path, images: Path) -> dict[str, float]:
    watcher = LineWatcher()
    cluster = EmulatedCluster(spec(args, 10_000_000, log_every=5), options(workdir / "faulty", images, args), on_line=watcher)
    cluster.start()
    dnn, frozen = "algo-3", "algo-1"
    try:
        watcher.wait_for(dnn, r"^step=50/", timeout=600)
        cluster.kill(frozen, signal.SIGSTOP)
        frozen_at = time.monotonic()
        watcher.wait_for(dnn, r"data host .* lost", timeout=300)
        dropped_s = time.monotonic() - frozen_at
        cluster.kill(frozen, signal.SIGCONT)
        lost_at = max(int(m.group(1)) for line in watcher.of(dnn) if (m := re.match(r"step=(\d+)/", line)))
        watcher.wait_for(dnn, rf"^step={lost_at + args.steps // 2 // 5 * 5}/", timeout=600)
        signalled_at = time.monotonic()
        cluster.kill_launcher(dnn, signal.SIGTERM)
        result = cluster.wait()
    finally:
        cluster.close()
    tree = cluster.host(dnn).base_dir
    saved = (tree / "checkpoints" / "checkpoint.pt").exists() and (tree / "model" / "model.pt").exists()
    failure = (tree / "output" / "failure").read_text()
    if not saved or not failure.startswith("TrainingStopped"):
        raise SystemExit(f"SIGTERM did not save the run: {failure}\n{result.report()}")
    return {
        "dropped_s": dropped_s,
        "after_loss_p50_ms": statistics.median(step_times(watcher.of(dnn), after_step=lost_at)),
        "stop_s": result.outcome(dnn).ended_at - signalled_at,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--data-cpus", type=int, default=1, help="CPUs per data host")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="faults-"))
    images = write_dataset(workdir / "images", classes=8, per_class=args.images // 8, size=320)
    ok = healthy(args, workdir, images)
    fault = faulty(args, workdir, images)
    step, wait = ok["step_time_ms"]["p50"], ok["data_wait_ms"]["p50"]
    print(f"model {args.model} {args.image_size}² batch {args.batch_size}, 2 data hosts × {args.data_cpus} CPUs, device {ok['device']}")
    print(f"healthy run: step p50 {step:.1f} ms, data wait p50 {wait:.1f} ms, lost data hosts {ok['lost_data_hosts']}")
    print(f"one data host frozen (SIGSTOP): dropped after {fault['dropped_s']:.1f} s; training went on")
    print(f"step p50 on the remaining host: {fault['after_loss_p50_ms']:.1f} ms = {fault['after_loss_p50_ms'] / step:.2f}× the healthy step")
    print(f"SIGTERM to the DNN host: checkpoint + model saved, host exited after {fault['stop_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
