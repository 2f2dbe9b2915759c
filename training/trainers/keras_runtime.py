"""The TensorFlow (Keras 3) trainer of every TensorFlow workload: a user's (training/workload/tf_contract.py)
or the built-in image classifier (training/workloads/keras_vision.py, ResNet50 or a small CNN), which is
written against the same contract.

Where its batches come from depends on the job:

* with a data group, every process reads the workload's dataset that the dispatcher host registered with
  tf.data.service (training/data_service/tf_service.py), by dataset id and one shared job, so each batch
  is made once, on a data host's CPUs, and consumed by exactly one trainer process;
* without one (the homogeneous baseline), the same build_dataset runs in this process, on this host's
  CPUs, over this rank's shard of the files (training/data_service/tf_pipeline.py's file_source);
* with ``cached_input_batches=N``, the first N real batches are cycled from memory: the model alone.

Distribution (the job's ``distribution``):

* ``horovod``: one process per device on every DNN host (started by the launcher,
  training/horovod_launch.py); gradients are averaged by Horovod's grouped all-reduce in a custom loop
  (Horovod's Keras callbacks do not work with Keras 3), outside the XLA-compiled part of the step (its
  XLA ops are not built in), and rank 0's variables are broadcast after the first step;
* ``mirrored``: one process, ``tf.distribute.MirroredStrategy`` over this host's devices;
* ``none``: one process, one device.

The workload's train_step runs inside the compiled step, under the GradientTape. On a GPU the defaults
are what it is fast at: mixed precision (``precision``: bf16 on Ampere and later, fp16 with loss scaling
on older GPUs) and XLA compilation of the forward and backward pass (``jit_compile``). The default
optimizer (SGD with momentum, when the workload has no build_optimizer) has a learning rate per worker,
scaled by the number of workers after a linear warm-up, then a cosine towards zero by the last step
(training/trainers/schedule.py), and decays convolution and dense kernels only (not biases or the norms'
scales and shifts). A homogeneous job gives each rank its own shard of the files and its own
augmentation seed, and a resumed one reads on from its checkpoint's data position. With an
``eval_channel``, the workload's eval_step runs over it every ``eval_every`` steps and at the end. The
shared loop (training/trainers/loop.py) does timing, metric lines, the stop vote, checkpoints and the summary.

    python -m training.trainers.keras_runtime
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's INFO lines (oneDNN, CPU features) are noise here

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from training.cluster import ClusterConfigError  # noqa: E402
from training.data_service.control import DataServiceError, describe, describe_every, wait_for_port  # noqa: E402
from training.data_service.dataset import ChannelError, ImageDataset, file_samples, scan_image_files  # noqa: E402
from training.data_service.tf_pipeline import DATASET_ID, batched, element_spec, file_source, read_from_service  # noqa: E402
from training.failure import write_failure  # noqa: E402
from training.host_environment import HostEnvironment, OutputPaths, TrainerEnvironment  # noqa: E402
from training.hyperparameters import HyperparameterError, PlatformSettings, parse_settings  # noqa: E402
from training.metrics import metric_line  # noqa: E402
from training.trainers.config import KerasVisionConfig, KerasWorkloadConfig  # noqa: E402
from training.trainers.loop import (  # noqa: E402
    CheckpointWriteError,
    DataExhaustedError,
    NonFiniteLossError,
    TrainingLoop,
    TrainingStopped,
    leave_stopped,
)
from training.trainers.precision import resolve_precision  # noqa: E402
from training.trainers.schedule import Schedule  # noqa: E402
from training.variants import BUILTIN_WORKLOADS_DIR, KERAS_BUILTIN  # noqa: E402
from training.workload.contract import CONTRACT_VERSION, Workload, WorkloadError, user_frame  # noqa: E402
from training.workload.host import channel_folders, split_settings  # noqa: E402
from training.workload.tf_contract import (  # noqa: E402
    KerasContext,
    ModelBuildError,
    StepOutputError,
    build_elements,
    build_model,
    file_pattern,
    flatten_structure,
    list_channel_files,
    load_keras_workload,
    probe_elements,
    split_loss,
    structure_error,
)

log = logging.getLogger("training.keras_runtime")

Batch = Any  # what the workload's dataset yields, batched: a tuple or dict of tensors


class Distribution:
    """How gradients are combined across trainer processes; a single process by default."""

    name = "none"
    rank, size, local_rank, local_size = 0, 1, 0, 1

    def scope(self):  # noqa: ANN201 (a context manager)
        return tf.distribute.get_strategy().scope()

    def allreduce(self, gradients: list) -> list:
        """The gradients averaged over every process (outside any XLA-compiled function)."""
        return gradients

    def after_first_step(self, model: keras.Model, optimizer: keras.optimizers.Optimizer) -> None:
        pass

    def barrier(self) -> None:
        pass

    def reduce_max(self, values: list[float]) -> list[float]:
        return values

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def distribute(self, dataset: tf.data.Dataset) -> Iterator[Batch]:
        return iter(dataset)

    def run(self, step_fn, batch: Batch) -> Any:  # noqa: ANN001
        return step_fn(batch)


class HorovodDistribution(Distribution):
    name = "horovod"

    def __init__(self) -> None:
        import horovod.tensorflow as hvd

        self.hvd = hvd
        hvd.init()
        self.rank, self.size, self.local_rank, self.local_size = hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:  # one device per process
            tf.config.set_visible_devices(gpus[self.local_rank % len(gpus)], "GPU")
            tf.config.experimental.set_memory_growth(gpus[self.local_rank % len(gpus)], True)

    def allreduce(self, gradients: list) -> list:
        return self.hvd.grouped_allreduce(gradients, op=self.hvd.Average)

    def after_first_step(self, model: keras.Model, optimizer: keras.optimizers.Optimizer) -> None:
        # Every rank starts from rank 0's weights and optimizer state (built by the first step).
        self.hvd.broadcast_variables([variable.value for variable in model.variables], root_rank=0)
        self.hvd.broadcast_variables([variable.value for variable in optimizer.variables], root_rank=0)

    def barrier(self) -> None:
        self.hvd.allreduce(tf.constant(0.0), name="barrier", op=self.hvd.Sum)

    def reduce_max(self, values: list[float]) -> list[float]:
        return self.hvd.allreduce(tf.constant(values, tf.float64), name="step_metrics", op=self.hvd.Max).numpy().tolist()

    def gather(self, value: Any) -> list[Any]:
        return self.hvd.allgather_object(value, name="gather")


class MirroredDistribution(Distribution):
    name = "mirrored"

    def __init__(self) -> None:
        self.strategy = tf.distribute.MirroredStrategy()

    def scope(self):  # noqa: ANN201
        return self.strategy.scope()

    def distribute(self, dataset: tf.data.Dataset) -> Iterator[Batch]:
        return iter(self.strategy.experimental_distribute_dataset(dataset))

    def run(self, step_fn, batch: Batch) -> Any:  # noqa: ANN001
        outputs = self.strategy.run(step_fn, args=(batch,))
        return tf.nest.map_structure(lambda value: self.strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None), outputs)


DISTRIBUTIONS = {"horovod": HorovodDistribution, "mirrored": MirroredDistribution, "none": Distribution}


# What a trainer's input is, given the samples this rank already consumed (a resumed job skips them).
DatasetFactory = Callable[[int], tf.data.Dataset]


def gpu_capability() -> tuple[bool, tuple[int, int] | None]:
    """(whether this process has a GPU, its compute capability)."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return False, None
    return True, tf.config.experimental.get_device_details(gpus[0]).get("compute_capability")


POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}



class KerasTrainer(TrainingLoop[Batch]):
    """The platform's loop around a TensorFlow workload's hooks."""

    checkpoint_name = "checkpoint.npz"

    def __init__(
        self,
        config: Any,  # KerasWorkloadConfig, or the built-in's KerasVisionConfig
        paths: OutputPaths,
        *,
        distribution: Distribution,
        workload: Workload,
        hyperparameters: Mapping[str, Any],
        classes: Sequence[str],
        dataset: DatasetFactory,
        source: str,
        num_samples: int = 0,
        epoch_samples: int = 0,
        evaluation: tuple[list[str], list[int]] | None = None,
        sha256: str = "",
        channels: Mapping[str, Path] | None = None,
    ) -> None:
        super().__init__(config, paths, rank=distribution.rank, world_size=distribution.size)
        self.config = config
        self.distribution = distribution
        self.workload = workload
        self.classes = list(classes)
        self.source = source
        self.sha256 = sha256
        self.epoch_samples = epoch_samples  # the channel's samples: one epoch of the data hosts'
        self.earlier_jobs: list[int] = []  # the samples each earlier job of a resumed run trained
        self.make_dataset = dataset
        self.evaluation = evaluation  # (paths, labels) of the validation channel, this process reads its share
        self.validation: dict[str, Any] | None = None
        gpu, capability = gpu_capability()
        self.precision = resolve_precision(config.precision, gpu=gpu, capability=capability)
        self.jit_compile = config.jit_compile == "true" or (config.jit_compile == "auto" and gpu)
        keras.mixed_precision.set_global_policy(POLICIES[self.precision])
        keras.utils.set_random_seed(config.seed)  # the same initial model on every rank
        self.ctx = KerasContext(dict(hyperparameters), classes=tuple(classes), num_samples=num_samples, rank=distribution.rank,
                                world_size=distribution.size, steps=config.steps, batch_size=config.batch_size, seed=config.seed,
                                learning_rate=config.learning_rate, precision=self.precision, channels=dict(channels or {}))
        self.schedule = Schedule(config.learning_rate, config.steps, config.lr_warmup_fraction, workers=distribution.size,
                                 scale_with_workers=config.scale_lr, cosine=True)
        self.own_rate = not workload.has("build_optimizer")  # a build_optimizer's rate (or schedule) is the module's
        with distribution.scope():
            self.model = build_model(workload, self.ctx)
            optimizer = self._optimizer()
            # fp16's range is too narrow for small gradients: scale the loss up, the gradients back down.
            self.optimizer = keras.optimizers.LossScaleOptimizer(optimizer) if self.precision == "fp16" else optimizer
            self.optimizer.build(self.model.trainable_variables)
        self._first_step = True
        self._element_spec: Any = None
        self._gradients = tf.function(self._forward_backward, jit_compile=self.jit_compile)
        self._compiled_step = tf.function(self._step, jit_compile=False)
        self._evaluate = tf.function(self._eval_step, reduce_retracing=True) if evaluation is not None else None

    def _optimizer(self) -> keras.optimizers.Optimizer:
        if self.own_rate:
            optimizer = keras.optimizers.SGD(learning_rate=self.config.learning_rate, momentum=self.config.momentum,
                                             weight_decay=self.config.weight_decay or None)
            # Decay on convolution and dense kernels only, as the PyTorch built-in: decaying the norms' scales
            # and shifts and the biases only pulls them from where the data puts them.
            optimizer.exclude_from_weight_decay(var_list=[variable for variable in self.model.trainable_variables
                                                          if len(variable.shape) <= 1])
            return optimizer
        try:
            optimizer = self.workload.build_optimizer(self.model, self.ctx)
        except Exception as error:  # noqa: BLE001 — the user's code
            raise ModelBuildError(f"build_optimizer raised {type(error).__name__}{user_frame(error)}: {error}") from error
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ModelBuildError(f"build_optimizer in {self.workload.file} returned a {type(optimizer).__name__}, not a keras optimizer")
        return optimizer

    # Hooks ---------------------------------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        dataset = self.make_dataset(self.resume_samples)
        self._element_spec = dataset.element_spec
        if self.config.cached_input_batches:
            cached = list(dataset.take(self.config.cached_input_batches))
            return itertools.cycle(cached)
        return self.distribution.distribute(dataset)

    def _forward_backward(self, batch: Batch) -> tuple[tf.Tensor, dict[str, tf.Tensor], list]:
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss, metrics = split_loss(self.workload.train_step(self.model, batch, self.ctx))
            loss = tf.cast(loss, tf.float32)
            scaled = self.optimizer.scale_loss(loss) if self.precision == "fp16" else loss
        if loss.shape.rank not in (0, None):
            raise StepOutputError(f"train_step in {self.workload.file} returned a loss of shape {loss.shape}: return a scalar (reduce_mean it)")
        bad = [name for name, value in metrics.items() if tf.convert_to_tensor(value).shape.rank not in (0, None)]
        if bad:
            raise StepOutputError(f"train_step in {self.workload.file} returned non-scalar metrics {bad}: return scalars")
        gradients = tape.gradient(scaled, variables)
        if all(gradient is None for gradient in gradients):
            raise StepOutputError(f"train_step in {self.workload.file} returned a loss that does not depend on the model's weights")
        # A weight the step does not use (a head left out) has no gradient; Horovod's all-reduce takes tensors only.
        gradients = [tf.zeros_like(variable) if gradient is None else gradient for gradient, variable in zip(gradients, variables, strict=True)]
        return loss, {name: tf.cast(value, tf.float32) for name, value in metrics.items()}, gradients

    def _step(self, batch: Batch) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        loss, metrics, gradients = self._gradients(batch)
        gradients = self.distribution.allreduce(gradients)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables, strict=True))
        return loss, metrics

    def train_step(self, batch: Batch) -> tuple[float, dict[str, float]]:
        if self.own_rate:
            self.optimizer.learning_rate.assign(self.schedule.at(self._next_step()))
        if self._first_step:
            try:
                loss, metrics = self.distribution.run(self._compiled_step, batch)
            except (StepOutputError, WorkloadError):
                raise
            except Exception as error:
                # Raised while tracing, our own refusal comes back wrapped by autograph (StagingError): unwrap it.
                own = re.search(r"\bStepOutputError: (.+)", str(error))
                if own:
                    raise StepOutputError(own.group(1).strip()) from None
                if isinstance(error, TypeError | ValueError | KeyError | IndexError | AttributeError | tf.errors.InvalidArgumentError):
                    raise structure_error(error, self._element_spec, self.model, batch) from error
                raise
            self.distribution.after_first_step(self.model, self.optimizer)
            self._first_step = False
        else:
            loss, metrics = self.distribution.run(self._compiled_step, batch)
        return float(loss), {name: float(value) for name, value in metrics.items()}  # waits for the device

    def loss_value(self, loss: Any) -> float:
        return loss[0]

    def logged_metrics(self, loss: Any) -> dict[str, float]:
        return loss[1]

    def _next_step(self) -> int:
        """The optimizer step about to be taken, counted across restarts (1-based)."""
        return int(self.optimizer.iterations.numpy()) + 1

    # Validation -------------------------------------------------------------------------------------

    def after_step(self, step: int) -> None:
        every = getattr(self.config, "eval_every", 0)
        if self.evaluation is not None and every and step % every == 0 and step < self.config.steps:
            self.validate(step)

    def _eval_step(self, batch: Batch) -> dict[str, tf.Tensor]:
        output = self.workload.eval_step(self.model, batch, self.ctx)
        if not isinstance(output, Mapping) or not output:
            raise StepOutputError(f"eval_step returned a {type(output).__name__}: return {{name: per-sample values [B] or a scalar}}")
        return {str(name): tf.cast(value, tf.float32) for name, value in output.items()}

    def validate(self, step: int) -> dict[str, Any]:
        """eval_step over this process's share of the validation channel, each file once; each metric the
        mean of its per-sample values over every process (a scalar counts for its batch's samples)."""
        assert self.evaluation is not None and self._evaluate is not None
        paths, labels = self.evaluation
        sums: dict[str, float] = {}
        count = 0
        self.ctx.training = False
        try:
            share = paths[self.rank::self.world_size]
            if share:
                files = file_source(paths, labels, self.config.seed, shard=(self.rank, self.world_size), repeat=False)
                size = getattr(self.config, "eval_batch_size", 0) or self.config.batch_size
                for batch in batched(build_elements(self.workload, files, self.ctx), size, drop_remainder=False):
                    samples = int(tf.shape(tf.nest.flatten(batch)[0])[0])
                    for name, value in self._evaluate(batch).items():
                        value = value.numpy()
                        if value.size == 1:
                            total = float(value.reshape(())) * samples
                        elif value.shape == (samples,):
                            total = float(value.sum())
                        else:
                            raise StepOutputError(f"eval_step's {name!r} has shape {list(value.shape)}: per-sample values [{samples}] or a scalar")
                        sums[name] = sums.get(name, 0.0) + total
                    count += samples
                    self.mark_progress("evaluate")
        finally:
            self.ctx.training = True
        ranks = self.gather({"sums": sums, "count": count})
        total = sum(rank["count"] for rank in ranks)
        names = sorted({name for rank in ranks for name in rank["sums"]})
        metrics = {name: sum(rank["sums"].get(name, 0.0) for rank in ranks) / total for name in names} if total else {}
        self.validation = {"step": step, "samples": int(total), "metrics": {name: round(value, 6) for name, value in metrics.items()}}
        if self.is_chief:
            print(metric_line(step, self.config.steps, {f"eval_{name}": value for name, value in metrics.items()}), flush=True)
        return self.validation

    # State and outputs ------------------------------------------------------------------------------

    def save_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        arrays = {f"model/{i}": np.asarray(v) for i, v in enumerate(self.model.variables)}
        arrays |= {f"optimizer/{i}": np.asarray(v) for i, v in enumerate(self.optimizer.variables)}
        buffer = io.BytesIO()
        np.savez(buffer, loop=np.array(json.dumps(state)), **arrays)
        path.write_bytes(buffer.getvalue())

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        with np.load(path) as saved:
            for i, variable in enumerate(self.model.variables):
                variable.assign(saved[f"model/{i}"])
            for i, variable in enumerate(self.optimizer.variables):
                variable.assign(saved[f"optimizer/{i}"])
            return json.loads(str(saved["loop"]))

    def save_model(self, model_dir: Path) -> None:
        self.model.save(model_dir / "model.keras")
        (model_dir / "classes.txt").write_text("\n".join(self.classes) + "\n")
        if self.sha256:  # a user's: its code beside the model, which custom layers need to load
            code = model_dir / "code"
            shutil.rmtree(code, ignore_errors=True)
            shutil.copytree(self.workload.code_dir, code, ignore=shutil.ignore_patterns(".packages", "__pycache__", "wheels"))
            card = {"contract_version": CONTRACT_VERSION, "framework": "tensorflow", "module": self.workload.name, "code": "code",
                    "model": "model.keras", "hyperparameters": dict(self.ctx.hyperparameters), "classes": self.classes,
                    "sha256": self.sha256, "validation": self.validation}
            (model_dir / "workload.json").write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")

    def barrier(self) -> None:
        self.distribution.barrier()

    def reduce_max(self, values: list[float]) -> list[float]:
        return self.distribution.reduce_max(values)

    def gather(self, value: Any) -> list[Any]:
        return self.distribution.gather(value)

    def summary_extra(self) -> dict[str, Any]:
        # Not on a stop: the model and the summary come first before SageMaker's SIGKILL.
        if self.evaluation is not None and not self.stopping:
            self.validate(self.config.steps)
        extra = {"framework": "tensorflow", "input_source": self.source, "distribution": self.distribution.name,
                 "workload": self.workload.name, "precision": self.precision, "jit_compile": self.jit_compile,
                 "classes": len(self.classes), "validation": self.validation}
        if "model" in self.ctx.hyperparameters and not self.sha256:
            extra["model"] = self.ctx.hyperparameters["model"]
        if self.sha256:
            extra["workload_sha256"] = self.sha256
        if self.source == "tf.data.service" and self.earlier_jobs:
            extra["data_position"] = service_resume_summary(self.earlier_jobs, self.epoch_samples)
        return extra

    # What each job of a resumed tf.data.service run trained (the loop's checkpoint record) ------------

    def checkpoint_input(self, ranks: list[Any]) -> Any:
        if self.source != "tf.data.service":
            return None
        return {"trained_per_job": [*self.earlier_jobs, self._steps_this_run * self.config.batch_size * self.world_size]}

    def restore_input(self, saved: Any) -> None:
        if self.source != "tf.data.service":
            return
        # A checkpoint without the record (an earlier release's): its steps, as one job of this world size.
        self.earlier_jobs = list((saved or {}).get("trained_per_job") or [self.resume_samples * self.world_size])


def service_resume_summary(trained_per_job: list[int], epoch_samples: int) -> dict[str, Any]:
    """What a resumed tf.data.service job says about its input: the service keeps no position a new job
    can resume (its dispatcher's state belongs to the job that ran it), so each job's data hosts start
    their order afresh, and what each earlier job trained of its last, interrupted epoch is trained again
    (dynamic sharding reads each file about once per epoch: about that many). Pure."""
    repeated = sum(trained % epoch_samples for trained in trained_per_job) if epoch_samples else None
    return {"resumed": "from the start of the data hosts' order",
            "why": "tf.data.service keeps no position a new job can resume from",
            "samples_trained_before": sum(trained_per_job), "samples_repeated_about": repeated}


def local_dataset(workload: Workload, ctx: KerasContext, folder: ImageDataset, batch_size: int, seed: int, rank: int,
                  ranks: int) -> DatasetFactory:
    """A homogeneous job's input: this rank's shard of the files, its own augmentation seed (TensorFlow
    fixes an op's seed from the global seed when the op is built), read on from a resumed position. The
    global seed must not depend on the position: the shuffle's order derives from it too, and a resumed
    run skips positions of the first run's order."""

    paths, labels = file_samples(folder)
    probe_elements(workload, paths, labels, ctx)

    def make(skip: int) -> tf.data.Dataset:
        tf.random.set_seed(seed * 1_000_003 + rank)
        files = file_source(paths, labels, seed + rank, shard=(rank, ranks), skip=skip)
        return batched(build_elements(workload, files, ctx), batch_size)

    return make


@dataclass(frozen=True)
class KerasJob:
    """This job's TensorFlow workload, loaded, and its settings split for it."""

    workload: Workload
    settings: PlatformSettings
    config: Any
    hyperparameters: Mapping[str, Any]
    pattern: str  # the workload's FILE_PATTERN: the built-in reads image files
    sha256: str  # the code's, for a user's; "" for the built-in

    def listing(self, root: Path, channel: str, group: str, classes: Sequence[str] | None = None) -> ImageDataset:
        if self.sha256:
            return list_channel_files(root, channel, self.pattern, classes)
        return scan_image_files(root, channel, group)


def load_keras_job(process: TrainerEnvironment) -> KerasJob:
    """The job's workload: a user's (its module, unpacked by the launcher), or the built-in."""
    raw, token = process.host.hyperparameters, process.host.shutdown_token
    if raw.get("workload_module"):
        code_dir, packages = process.code()
        workload = load_keras_workload(code_dir, str(raw["workload_module"]), packages)
        settings, config, hyperparameters = split_settings(raw, workload, token, KerasWorkloadConfig)
        if config.eval_channel and not workload.has("eval_step"):
            raise WorkloadError(f"the job validates on {config.eval_channel!r} (eval_channel), but {workload.file} defines no eval_step()")
        return KerasJob(workload, settings, config, hyperparameters, file_pattern(code_dir, workload.name), settings.workload_sha256)
    settings, config = parse_settings(raw, KerasVisionConfig, token)
    workload, hyperparameters = builtin_workload(config)
    return KerasJob(workload, settings, config, hyperparameters, "*", "")


def builtin_workload(config: KerasVisionConfig) -> tuple[Workload, dict[str, Any]]:
    """The built-in module, and its hyperparameters from the config the spec validated."""
    workload = load_keras_workload(BUILTIN_WORKLOADS_DIR, KERAS_BUILTIN)
    return workload, {name: getattr(config, name) for name in workload.hyperparameters}


def build_trainer(process: TrainerEnvironment) -> KerasTrainer:
    """This process's trainer, from what its door read (``TrainerEnvironment.read``): the job's workload
    (a user's, unpacked by its launcher, or the built-in), and tf.data.service when the job has data hosts."""
    host = process.host
    cluster = host.cluster
    job = load_keras_job(process)
    settings, config = job.settings, job.config
    # Threads first: they cannot change once TensorFlow's context exists (a strategy creates it).
    tf.config.threading.set_intra_op_parallelism_threads(max(1, len(os.sched_getaffinity(0)) // process.local_world_size))
    tf.config.threading.set_inter_op_parallelism_threads(2)
    distribution = DISTRIBUTIONS[settings.distribution]()
    paths = process.outputs
    addresses = host.addresses
    control = settings.data_service_targets(cluster, addresses)
    channels = channel_folders(host)
    common: dict[str, Any] = dict(distribution=distribution, workload=job.workload, hyperparameters=job.hyperparameters, sha256=job.sha256,
                                  channels=channels)
    if control:
        dispatcher, _ = settings.tf_data_service_addresses(cluster, addresses)
        # The dispatcher host's control server answers only once its dataset is registered.
        info = describe(control[:1], settings.shutdown_token, settings.data_connect_timeout_s)
        wait_for_port(dispatcher, settings.data_connect_timeout_s)
        expected = () if job.sha256 else (3, config.image_size, config.image_size)
        if info.batch_size != config.batch_size or tuple(info.sample_shape) != expected:
            raise HyperparameterError(
                f"data host {info.host} makes batches of {info.batch_size} × {tuple(info.sample_shape)}, "
                f"this trainer expects {config.batch_size} × {expected}"
            )
        log.info("rank %d reading %r from tf.data.service at %s (%d data hosts)", distribution.rank, DATASET_ID, dispatcher, len(control))
        # The built-in's element spec is known here; a user's comes from the dispatcher, as registered.
        spec = element_spec(config.batch_size, config.image_size) if not job.sha256 else None
        # The service's stream has no position to resume from: a resumed job reads a fresh one.
        service = lambda _skip: read_from_service(dispatcher, spec)  # noqa: E731
        # A sharded channel's epoch is every host's share.
        hosts = describe_every(control, settings.shutdown_token, settings.data_connect_timeout_s) if info.sharded else [info]
        classes = list(info.classes)
        return started_at(process, KerasTrainer(config, paths, classes=classes, dataset=service, source="tf.data.service",
                                                num_samples=int(info.num_samples), epoch_samples=sum(int(peer.num_samples) for peer in hosts),
                                                evaluation=_evaluation(job, host, classes), **common))
    folder = job.listing(host.channel(settings.data_channel), settings.data_channel, cluster.current_group)
    ctx = KerasContext(dict(job.hyperparameters), classes=folder.classes, num_samples=len(folder), rank=distribution.rank,
                       world_size=distribution.size, steps=config.steps, batch_size=config.batch_size, seed=config.seed,
                       learning_rate=config.learning_rate, channels=channels)
    dataset = local_dataset(job.workload, ctx, folder, config.batch_size, config.seed, distribution.rank, distribution.size)
    return started_at(process, KerasTrainer(config, paths, classes=list(folder.classes), dataset=dataset, source="local",
                                            num_samples=len(folder), evaluation=_evaluation(job, host, list(folder.classes)), **common))


def started_at(process: TrainerEnvironment, trainer: KerasTrainer) -> KerasTrainer:
    """``trainer``, its time to first batch counted from its container's start."""
    trainer.container_started_at = process.container_started_at
    return trainer


def _evaluation(job: KerasJob, host: HostEnvironment, classes: list[str]) -> tuple[list[str], list[int]] | None:
    channel = getattr(job.config, "eval_channel", "")
    if not channel:
        return None
    return file_samples(job.listing(host.channel(channel), channel, host.cluster.current_group, classes), channel)


def keras_trial(workload: Workload, config: KerasWorkloadConfig, hyperparameters: Mapping[str, Any], channels: Mapping[str, Path],
                batch_size: int = 4) -> dict[str, Any]:
    """``hetero validate``'s check of a TensorFlow workload: two steps of this loop, on this process's CPU
    in fp32, over local channel folders (and a validation over ``eval_channel`` when it is among them),
    into a scratch folder. What the hosts would refuse is refused here, by the same code."""
    import tempfile

    listing = list_channel_files(Path(channels["train"]).resolve(), "train", file_pattern(workload.code_dir, workload.name))
    trial = dataclasses.replace(config, steps=2, warmup_steps=0, checkpoint_every=0, eval_every=0, log_every=1, cached_input_batches=0,
                                batch_size=min(config.batch_size, batch_size, len(listing)), precision="fp32", jit_compile="false")
    evaluation = None
    if trial.eval_channel in channels:
        evaluation = file_samples(list_channel_files(Path(channels[trial.eval_channel]).resolve(), trial.eval_channel,
                                                     file_pattern(workload.code_dir, workload.name), listing.classes), trial.eval_channel)
    ctx = KerasContext(dict(hyperparameters), classes=listing.classes, num_samples=len(listing), steps=trial.steps,
                       batch_size=trial.batch_size, seed=trial.seed, channels=dict(channels))
    with tempfile.TemporaryDirectory(prefix="keras-trial-") as scratch:
        trainer = KerasTrainer(trial, OutputPaths.under(Path(scratch)), distribution=Distribution(), workload=workload,
                               hyperparameters=hyperparameters, classes=listing.classes,
                               dataset=local_dataset(workload, ctx, listing, trial.batch_size, trial.seed, 0, 1), source="local",
                               num_samples=len(listing), evaluation=evaluation, sha256="0" * 64, channels=dict(channels))
        summary = trainer.run()
    return {"samples": len(listing), "classes": list(listing.classes), "trial_loss": summary["final_loss"],
            "trial_eval": (trainer.validation or {}).get("metrics", {}), "features": {path: str(spec) for path, spec in flatten_structure(trainer._element_spec)}}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        trainer = build_trainer(TrainerEnvironment.read())
        summary = trainer.run()
    except (ClusterConfigError, HyperparameterError, ChannelError, DataServiceError, DataExhaustedError, CheckpointWriteError,
            NonFiniteLossError, WorkloadError) as error:
        log.error("training failed: %s: %s", type(error).__name__, error)
        write_failure(f"{type(error).__name__}: {error}")
        return 1
    except tf.errors.OpError as error:  # e.g. the tf.data.service dispatcher lost mid-run
        log.error("training failed: %s: %s", type(error).__name__, error.message)
        write_failure(f"{type(error).__name__}: {error.message}")
        return 1
    except TrainingStopped as stopped:
        return leave_stopped(stopped)
    if trainer.is_chief:
        log.info("training finished: %d steps, step time p50 %s ms", summary["steps"], (summary["step_time_ms"] or {}).get("p50"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
