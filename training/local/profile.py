"""Profiling runs on the emulated cluster: what preprocessing alone and training alone cost per batch.

Together they give the ideal a heterogeneous job can reach: with the CPU work moved to data hosts, a step
can be no faster than the slower of the two, ``max(train-only step, preprocessing per batch / data hosts)``.

* preprocessing alone: the data host's real pipeline (the workload's preprocess in WorkloadBatchProducer's
  worker processes, or the tensorflow variant's tf.data graph) in a process pinned to the CPUs a data host gets, timed in steady
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
from training.local.cluster import EmulatedCluster, EmulationOptions, LineCallback, plan_hosts
from training.trainers.config import KerasVisionConfig


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


def _time_workload_pipeline(code_dir: str, module: str, hyperparameters: dict[str, str], channel: str, batch_size: int, seed: int,
                            cpus: tuple[int, ...], batches: int, result: multiprocessing.Queue) -> None:
    """A workload's data-host pipeline (its list_samples and preprocess in WorkloadBatchProducer's worker
    processes), as a data host runs it."""
    from training.workload.contract import load_workload, resolve_hyperparameters
    from training.workload.serving import WorkloadBatchProducer, host_listing, recipe_for

    os.sched_setaffinity(0, cpus)
    workload = load_workload(Path(code_dir), module)
    resolved = resolve_hyperparameters(workload, hyperparameters)
    listing = host_listing(workload, "train", Path(channel), resolved, {"train": Path(channel)})
    recipe = recipe_for(workload, listing, packages_dir=None, hyperparameters=resolved, seed=seed)
    producer = WorkloadBatchProducer(listing, recipe, batch_size=batch_size, workers=len(cpus), seed=seed, queue_depth=2)
    producer.start()
    try:
        result.put(ms_per_batch(lambda: producer.batches.get(timeout=120), batches))
    finally:
        producer.stop()


def preprocess_ms_per_batch(spec: JobSpec, channel: Path, cpus: tuple[int, ...], batches: int = 20, code_dir: Path | None = None) -> float:
    """One data host's preprocessing time per batch of the spec's workload (its batch size, seed and
    settings), with the pipeline its data hosts run: the workload's list_samples and preprocess in
    WorkloadBatchProducer's workers (a built-in's or a user's, from ``code_dir`` or the spec's code), or
    the tensorflow variant's tf.data graph."""
    from training.hyperparameters import build, to_hyperparameter_string
    from training.trainers.config import WorkloadConfig
    from training.variants import BUILTIN_WORKLOADS_DIR, VARIANTS

    raw = {name: to_hyperparameter_string(value) for name, value in spec.hyperparameters.items()}
    variant = VARIANTS[spec.variant]
    if variant.data_service == "tf.data.service":
        config = build(variant.config, raw)
        return _profile_in_process(_time_tf_pipeline, (str(channel), config, cpus, batches))
    loop = build(WorkloadConfig, {name: value for name, value in raw.items() if name in WorkloadConfig.__dataclass_fields__})
    if spec.code is not None:
        source, module = code_dir or Path(spec.code.source), spec.code.module
    else:
        source, module = BUILTIN_WORKLOADS_DIR, variant.workloads[0]
    return _profile_in_process(_time_workload_pipeline, (str(source), module, raw, str(channel), loop.batch_size, loop.seed, cpus, batches))


def _profile_in_process(target: Callable[..., None], args: tuple[object, ...]) -> float:
    """Run a pipeline's timing in a spawned process of its own (pinned to its CPUs there); its figure."""
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    process = context.Process(target=target, args=(*args, result))
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


def main(argv: list[str] | None = None, prog: str = "python -m training.local.profile") -> int:
    """Profile a spec's workload on this machine: the figures the sweep's sizing advisor takes."""
    import argparse
    import json
    import sys
    import tempfile

    from lambdas.core.job_spec import JobSpecError, validate_job_spec
    from training.local.__main__ import key_value, resolve_code

    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("spec", type=Path)
    parser.add_argument("--channel", type=key_value, action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--code", type=Path, help="the workload's code folder (default: the spec's)")
    parser.add_argument("--batches", type=int, default=20, help="batches timed per figure")
    args = parser.parse_args(argv)
    try:
        spec = validate_job_spec(resolve_code(json.loads(args.spec.read_text()), args.spec))
        channels = {name: Path(folder) for name, folder in args.channel}
        if "train" not in channels:
            raise ProfilingError("give the training channel's local folder: --channel train=DIR")
        options = EmulationOptions(workdir=Path(tempfile.mkdtemp(prefix="profile-")), channels=channels, code_dir=args.code)
        one_core = (sorted(os.sched_getaffinity(0))[-1],)
        preprocess = preprocess_ms_per_batch(spec, channels["train"], one_core, args.batches, code_dir=args.code)
        train = train_ms_per_step(spec, options, on_line=lambda _host, _line: None)  # stdout is the figures'
    except (OSError, ValueError, JobSpecError, ProfilingError) as error:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    samples = int(spec.hyperparameters.get("batch_size", 32))
    print(json.dumps({"preprocess_ms_per_batch_per_vcpu": round(preprocess, 2), "train_ms_per_step": round(train, 2),
                      "samples_per_s_per_vcpu": round(samples * 1000 / preprocess, 1),
                      "advisor": {"samples_per_s_per_vcpu": round(samples * 1000 / preprocess, 1), "train_ms_per_step": round(train, 2)}},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
