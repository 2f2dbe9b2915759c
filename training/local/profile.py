"""Profiling runs on the emulated cluster: what preprocessing alone and training alone cost per batch.

Together they give the ideal a heterogeneous job can reach: with the CPU work moved to data hosts, a step
can be no faster than the slower of the two, ``max(train-only step, preprocessing per batch / data hosts)``.

* preprocessing alone: the data host's real pipeline (BatchProducer and its worker processes, or the
  tensorflow variant's tf.data graph) in a process pinned to the CPUs a data host gets, timed in steady
  state;
* training alone: the real job on the emulated cluster with ``cached_input_batches``: real batches made
  once and cycled in memory, so the step time is the model's alone.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

from lambdas.core.job_spec import JobSpec
from training.data_service.dataset import scan_images
from training.data_service.server import BatchProducer
from training.local.cluster import EmulatedCluster, EmulationOptions, LineCallback, plan_hosts
from training.trainers.config import KerasVisionConfig, VisionConfig


@dataclass(frozen=True)
class Profile:
    preprocess_ms_per_batch: float  # one data host's pipeline on its CPUs
    train_ms_per_step: float  # the DNN host with input already in memory

    def ideal_step_ms(self, data_hosts: int) -> float:
        """The fastest step a job with this many data hosts can reach (0: preprocessing on the DNN host,
        which shares its CPUs with training, so the two add up)."""
        if data_hosts == 0:
            return self.preprocess_ms_per_batch + self.train_ms_per_step
        return max(self.train_ms_per_step, self.preprocess_ms_per_batch / data_hosts)


# Enough distinct batches that the model does not just memorise a handful.
CACHED_BATCHES = 8


class ProfilingError(RuntimeError):
    pass


def ms_per_batch(next_batch: Callable[[], object], batches: int, warmup: int = 3) -> float:
    """Steady-state milliseconds per batch: ``warmup`` batches (start-up, autotuning) left out."""
    for _ in range(warmup):
        next_batch()
    started = time.perf_counter()
    for _ in range(batches):
        next_batch()
    return (time.perf_counter() - started) * 1000 / batches


def data_host_cpus(spec: JobSpec, options: EmulationOptions) -> list[tuple[int, ...]]:
    """The CPU set each data host of ``spec`` gets on this machine, as the emulated cluster plans them."""
    return [host.cpus for host in plan_hosts(spec, options, sorted(os.sched_getaffinity(0)), 0) if host.role == "data"]


def _time_pipeline(channel: str, config: VisionConfig, cpus: tuple[int, ...], batches: int, result: multiprocessing.Queue) -> None:
    os.sched_setaffinity(0, cpus)  # inherited by the spawned preprocessing workers
    producer = BatchProducer(
        scan_images(Path(channel), "train", "profile"),
        batch_size=config.batch_size,
        augment=config.augment_config,
        workers=len(cpus),
        seed=config.seed,
        queue_depth=2,
    )
    producer.start()
    try:
        result.put(ms_per_batch(lambda: producer.batches.get(timeout=120), batches))
    finally:
        producer.stop()


def _time_tf_pipeline(channel: str, config: KerasVisionConfig, cpus: tuple[int, ...], batches: int, result: multiprocessing.Queue) -> None:
    os.sched_setaffinity(0, cpus)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from training.data_service.tf_pipeline import augmentation_pipeline

    tf.config.threading.set_intra_op_parallelism_threads(len(cpus))
    folder = scan_images(Path(channel), "train", "profile")
    dataset = augmentation_pipeline(
        [path for path, _ in folder.samples], [label for _, label in folder.samples], config.batch_size, config.augment_config, config.seed
    )
    iterator = iter(dataset)
    result.put(ms_per_batch(lambda: next(iterator), batches))


def preprocess_ms_per_batch(
    channel: Path, config: VisionConfig | KerasVisionConfig, cpus: tuple[int, ...], batches: int = 20, data_service: str = "grpc"
) -> float:
    """One data host's preprocessing time per batch, with the pipeline its variant's data hosts run."""
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    target = _time_tf_pipeline if data_service == "tf.data.service" else _time_pipeline
    process = context.Process(target=target, args=(str(channel), config, cpus, batches, result))
    process.start()
    try:
        # Read before joining: a child does not exit until what it put on the queue has been taken.
        ms_per_batch = result.get(timeout=600)
    except queue.Empty:
        raise ProfilingError(f"the preprocessing profile gave no figure (exit code {process.exitcode})") from None
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    return ms_per_batch


def train_ms_per_step(spec: JobSpec, options: EmulationOptions, on_line: LineCallback | None = None) -> float:
    """The DNN host's step time with its input already in memory: the spec run homogeneously, on the
    same CPUs, cycling real batches."""
    homogeneous = replace(
        spec,
        instance_groups=(spec.dnn_group,),
        inputs=tuple(replace(channel, groups=()) for channel in spec.inputs),
        hyperparameters=MappingProxyType({**spec.hyperparameters, "cached_input_batches": CACHED_BATCHES}),
    )
    cluster = EmulatedCluster(homogeneous, options, on_line=on_line)
    result = cluster.run()
    summary = cluster.summary()
    if not result.ok or not summary or not summary["step_time_ms"]:
        raise ProfilingError(f"the train-only profile failed:\n{result.report()}")
    return summary["step_time_ms"]["p50"]
