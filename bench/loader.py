"""Images per second per preprocessing CPU: a data host's stream against the trainer's own DataLoader.

    python bench/loader.py [--rounds 3] [--batches 60] [--workers 1] [--train-steps 0]

Both sides run the built-in vision workload's preprocess (training/workloads/vision.py: the OpenCV
pipeline of training/data_service/preprocess.py) with ``--workers`` worker processes pinned to the same
CPUs, and are read by a consumer pinned to another CPU that takes batches as fast as they come (no
model: this times the input alone), each side as its job runs it:

- data host: the real gRPC data server (serve() with WorkloadBatchProducer and its worker processes, as
  the launcher's run_workload_data_host sets it up) in its own process, read over loopback by the
  trainer's client (DataServiceDataset), as a heterogeneous job reads;
- DataLoader: the homogeneous job's own loader, from the runtime's trainer built for a one-host job
  (training/local/single_host.py): the endless per-rank sampler, the workers, collate_features.

The dataset is small (128 images of 500 px, 4 batches an epoch), so every run crosses many epoch
boundaries: a loader whose workers drained and restarted at each would show it as a mean batch interval
well above the median. Rounds are interleaved; the median of the per-round ratio is reported.

``--train-steps N`` also runs the homogeneous example job (small CNN, the same dataset) on the emulated
cluster for N steps, many epochs, and reports its step time's mean against its median.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.data_service.augmentation import AugmentConfig  # noqa: E402
from training.data_service.client import DataServiceDataset  # noqa: E402
from training.data_service.server import ServerSettings, serve  # noqa: E402
from training.local.cluster import EmulatedCluster, EmulationOptions, free_port  # noqa: E402
from training.local.demo import LOCAL_OVERRIDES, load_spec, quiet  # noqa: E402
from training.local.images import write_dataset  # noqa: E402
from training.local.single_host import single_host_trainer  # noqa: E402
from training.variants import BUILTIN_WORKLOADS_DIR  # noqa: E402
from training.workload.contract import load_workload, resolve_hyperparameters  # noqa: E402
from training.workload.serving import WorkloadBatchProducer, host_listing, recipe_for, wire_features  # noqa: E402

TOKEN = "loader-benchmark-token"
BATCH_SIZE = 32


def intervals(batches: Iterable, count: int, warmup: int = 4) -> list[float]:
    """Seconds between consecutive batches, ``count`` of them after ``warmup``."""
    iterator = iter(batches)
    for _ in range(warmup):
        next(iterator)
    times = [time.perf_counter()]
    for _ in range(count):
        images = next(iterator)["image"]
        assert images.dtype == torch.uint8
        times.append(time.perf_counter())
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


def data_host(channel: str, augment: AugmentConfig, workers: int, cpus: set[int], port: int) -> None:
    """A data host of the built-in vision workload, set up as the launcher sets one up."""
    os.sched_setaffinity(0, cpus)  # inherited by the spawned preprocessing workers
    vision = load_workload(BUILTIN_WORKLOADS_DIR, "vision")
    hyperparameters = resolve_hyperparameters(vision, {"image_size": str(augment.image_size), "augment": augment.augment})
    listing = host_listing(vision, "train", Path(channel), hyperparameters, {"train": Path(channel)})
    recipe = recipe_for(vision, listing, packages_dir=None, hyperparameters=hyperparameters, seed=0)
    settings = ServerSettings(
        host="bench", bind_address="127.0.92.2", port=port, channel="train", batch_size=BATCH_SIZE,
        shutdown_token=TOKEN, idle_timeout_s=30, start_deadline_s=120, workers=workers, features=wire_features(recipe.features),
    )
    producer = WorkloadBatchProducer(listing, recipe, batch_size=BATCH_SIZE, workers=workers, seed=0, queue_depth=settings.queue_depth)
    serve(settings, listing, threading.Event(), source=producer)


def measure_data_host(channel: Path, augment: AugmentConfig, workers: int, cpus: set[int], count: int) -> list[float]:
    context = multiprocessing.get_context("spawn")
    port = free_port()
    # Not a daemon: the data host starts worker processes of its own.
    server = context.Process(target=data_host, args=(str(channel), augment, workers, cpus, port))
    server.start()
    try:
        dataset = DataServiceDataset([f"127.0.92.2:{port}"], BATCH_SIZE, TOKEN, "bench", connect_timeout_s=60,
                                     features=list(codec_features(channel, augment)))
        return intervals(dataset, count)
    finally:
        server.terminate()  # SIGTERM: the data host stops its workers as it would on SageMaker
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
            server.join()


def codec_features(channel: Path, augment: AugmentConfig) -> tuple:
    """What the vision workload's batches hold (the trainer names them to its client, as the runtime does)."""
    vision = load_workload(BUILTIN_WORKLOADS_DIR, "vision")
    hyperparameters = resolve_hyperparameters(vision, {"image_size": str(augment.image_size), "augment": augment.augment})
    listing = host_listing(vision, "train", channel, hyperparameters, {"train": channel})
    return wire_features(recipe_for(vision, listing, packages_dir=None, hyperparameters=hyperparameters, seed=0).features)


def measure_dataloader(channel: Path, augment: AugmentConfig, workers: int, cpus: set[int], consumer: set[int], count: int) -> list[float]:
    with tempfile.TemporaryDirectory() as scratch:
        trainer = single_host_trainer(Path(scratch), {"model": "cnn", "cnn_width": 8, "image_size": augment.image_size, "augment": augment.augment,
                                                      "batch_size": BATCH_SIZE, "dataloader_workers": workers, "steps": 10**6},
                                      {"train": channel})
        os.sched_setaffinity(0, cpus)  # the workers start with the iterator and keep this affinity
        iterator = trainer.batches()
        first = next(iterator)
        os.sched_setaffinity(0, consumer)
        try:
            return intervals(itertools.chain([first], iterator), count)
        finally:
            iterator.close()  # shuts the workers down


def homogeneous_step_stats(channel: Path, steps: int) -> dict[str, float]:
    """The homogeneous example job's step-time summary (its trainer's DataLoader feeding a small CNN)."""
    workdir = Path(tempfile.mkdtemp(prefix="loader-train-"))
    try:
        spec = load_spec("pytorch-homogeneous.json", LOCAL_OVERRIDES | {"steps": steps})
        cluster = EmulatedCluster(spec, EmulationOptions(workdir=workdir, channels={"train": channel}), on_line=quiet)
        result, summary = cluster.run(), cluster.summary()
        if not result.ok or not summary:
            raise SystemExit(f"the homogeneous job failed:\n{result.report()}")
        return summary["step_time_ms"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--workers", type=int, default=1, help="preprocessing processes (and CPUs) on each side")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--augment", default="standard", choices=("standard", "heavy"))
    parser.add_argument("--train-steps", type=int, default=0)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < args.workers + 1:
        raise SystemExit(f"needs {args.workers + 1} CPUs (a consumer and the workers), this process has {len(cpus)}")
    consumer, workers_cpus = {cpus[0]}, set(cpus[1:1 + args.workers])
    os.sched_setaffinity(0, consumer)
    torch.set_num_threads(1)
    channel = write_dataset(Path(tempfile.mkdtemp(prefix="loader-")) / "images", classes=4, per_class=32, size=500)
    augment = AugmentConfig(args.size, args.augment)
    print(f"{args.workers} preprocessing process(es) on CPU {sorted(workers_cpus)}, consumer on CPU {sorted(consumer)}; "
          f"{args.augment} {args.size}² from 500 px JPEGs, batch {BATCH_SIZE}, 4 batches an epoch; "
          f"{args.rounds} rounds of {args.batches} batches, interleaved\n")
    rounds = []
    for _ in range(args.rounds):
        host = measure_data_host(channel, augment, args.workers, workers_cpus, args.batches)
        loader = measure_dataloader(channel, augment, args.workers, workers_cpus, consumer, args.batches)
        rounds.append((host, loader))
    print("| input | images/s per preprocessing CPU | batch interval p50 ms | mean ms | max ms | mean / p50 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, index in (("data host (gRPC stream)", 0), ("DataLoader (endless sampler)", 1)):
        every = [interval for round_ in rounds for interval in round_[index]]
        rate = statistics.median(BATCH_SIZE / statistics.fmean(round_[index]) / args.workers for round_ in rounds)
        p50, mean = statistics.median(every), statistics.fmean(every)
        print(f"| {name} | {rate:.0f} | {p50 * 1e3:.1f} | {mean * 1e3:.1f} | {max(every) * 1e3:.1f} | {mean / p50:.2f} |")
    ratio = statistics.median(statistics.fmean(host) / statistics.fmean(loader) for host, loader in rounds)
    print(f"\nDataLoader / data host, images/s per CPU: {ratio:.2f} (median of per-round ratios)")
    if args.train_steps:
        stats = homogeneous_step_stats(channel, args.train_steps)
        print(f"homogeneous job, {args.train_steps} steps ({args.train_steps * LOCAL_OVERRIDES['batch_size'] // 128} epochs): "
              f"step p50 {stats['p50']:.1f} ms, p90 {stats['p90']:.1f} ms, mean {stats['mean']:.1f} ms, "
              f"mean / p50 {stats['mean'] / stats['p50']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
