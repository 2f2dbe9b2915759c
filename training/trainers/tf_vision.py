"""TensorFlow (Keras 3) image classification on the DNN group: ResNet50 or a small CNN.

Where its batches come from depends on the job:

* with a data group, every process reads the augmentation pipeline the data hosts registered with
  tf.data.service (training/data_service/tf_service.py), by dataset id and one shared job, so each batch
  is made once, on a data host's CPUs, and consumed by exactly one trainer process;
* without one (the homogeneous baseline), the same tf.data graph (training/data_service/tf_pipeline.py)
  runs in this process, on this host's CPUs;
* with ``cached_input_batches=N``, the first N real batches are cycled from memory: the model alone.

Distribution (the job's ``distribution``):

* ``horovod``: one process per device on every DNN host (started by the launcher,
  training/horovod_launch.py); gradients are averaged by Horovod's grouped all-reduce in a custom loop
  (Horovod's Keras callbacks do not work with Keras 3), outside the XLA-compiled part of the step (its
  XLA ops are not built in), and rank 0's variables are broadcast after the first step;
* ``mirrored``: one process, ``tf.distribute.MirroredStrategy`` over this host's devices;
* ``none``: one process, one device.

Normalisation to float happens inside the compiled step, on the device. On a GPU the defaults are what
it is fast at: mixed precision (``precision``: bf16 on Ampere and later, fp16 with loss scaling on older
GPUs) and XLA compilation of the forward and backward pass (``jit_compile``). The learning rate is per
worker, scaled by the number of workers after a linear warm-up (training/trainers/schedule.py). A
homogeneous job gives each rank its own shard of the files and its own augmentation seed, and a resumed
one reads on from its checkpoint's data position. The shared loop (training/trainers/loop.py) does
timing, metric lines, checkpoints and the summary.

    python -m training.trainers.tf_vision
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's INFO lines (oneDNN, CPU features) are noise here

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from training.cluster import ClusterConfigError, host_addresses, load_cluster
from training.data_service.control import DataServiceError, describe, describe_every, wait_for_port
from training.data_service.dataset import ChannelError, ImageDataset, channel_dir, file_samples, scan_image_files
from training.data_service.tf_pipeline import DATASET_ID, augmentation_pipeline, read_from_service
from training.failure import write_failure
from training.hyperparameters import HyperparameterError, load_settings
from training.trainers.config import KerasVisionConfig
from training.trainers.loop import (
    CheckpointWriteError,
    DataExhaustedError,
    NonFiniteLossError,
    OutputPaths,
    TrainingLoop,
    TrainingStopped,
    leave_stopped,
)
from training.trainers.precision import resolve_precision
from training.trainers.schedule import Schedule

log = logging.getLogger("training.tf_vision")

# ImageNet statistics, applied in the compiled step to the uint8 batches.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)

Batch = tuple[tf.Tensor, tf.Tensor]  # uint8 [B, S, S, 3], int32 [B]


def build_model(config: KerasVisionConfig, num_classes: int) -> keras.Model:
    shape = (config.image_size, config.image_size, 3)
    if config.model == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=num_classes, classifier_activation=None)
    layers: list[keras.layers.Layer] = [keras.Input(shape)]
    for stage in range(3):
        width = config.cnn_width * 2**stage
        for _ in range(2):
            layers += [keras.layers.Conv2D(width, 3, padding="same", use_bias=False), keras.layers.BatchNormalization(), keras.layers.ReLU()]
        layers.append(keras.layers.MaxPooling2D(2))
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(num_classes)]
    return keras.Sequential(layers, name="small_cnn")


def normalise(images: tf.Tensor) -> tf.Tensor:
    return (tf.cast(images, tf.float32) / 255.0 - tf.constant(MEAN)) / tf.constant(STD)


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

    def run(self, step_fn, images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:  # noqa: ANN001
        return step_fn(images, labels)


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

    def run(self, step_fn, images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:  # noqa: ANN001
        losses = self.strategy.run(step_fn, args=(images, labels))
        return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)


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


class KerasVisionTrainer(TrainingLoop[Batch]):
    checkpoint_name = "checkpoint.npz"

    def __init__(
        self,
        config: KerasVisionConfig,
        paths: OutputPaths,
        *,
        distribution: Distribution,
        classes: list[str],
        dataset: DatasetFactory,
        source: str,
        epoch_samples: int = 0,
    ) -> None:
        super().__init__(config, paths, rank=distribution.rank, world_size=distribution.size)
        self.config: KerasVisionConfig = config
        self.distribution = distribution
        self.classes = classes
        self.source = source
        self.epoch_samples = epoch_samples  # the channel's samples: one epoch of the data hosts'
        self.earlier_jobs: list[int] = []  # the samples each earlier job of a resumed run trained
        self.make_dataset = dataset
        gpu, capability = gpu_capability()
        self.precision = resolve_precision(config.precision, gpu=gpu, capability=capability)
        self.jit_compile = config.jit_compile == "true" or (config.jit_compile == "auto" and gpu)
        keras.mixed_precision.set_global_policy(POLICIES[self.precision])
        keras.utils.set_random_seed(config.seed)  # the same initial model on every rank
        self.schedule = Schedule(config.learning_rate, config.steps, config.lr_warmup_fraction, workers=distribution.size,
                                 scale_with_workers=config.scale_lr)
        with distribution.scope():
            self.model = build_model(config, len(classes))
            optimizer = keras.optimizers.SGD(learning_rate=config.learning_rate, momentum=config.momentum, weight_decay=config.weight_decay)
            # fp16's range is too narrow for small gradients: scale the loss up, the gradients back down.
            self.optimizer = keras.optimizers.LossScaleOptimizer(optimizer) if self.precision == "fp16" else optimizer
            self.optimizer.build(self.model.trainable_variables)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum_over_batch_size")
        self._first_step = True
        self._gradients = tf.function(self._forward_backward, jit_compile=self.jit_compile)
        self._compiled_step = tf.function(self._step, jit_compile=False)

    # Hooks ---------------------------------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        dataset = self.make_dataset(self.resume_samples)
        if self.config.cached_input_batches:
            cached = list(dataset.take(self.config.cached_input_batches))
            return itertools.cycle(cached)
        return self.distribution.distribute(dataset)

    def _forward_backward(self, images: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, list]:
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            logits = tf.cast(self.model(normalise(images), training=True), tf.float32)
            loss = self.loss_fn(labels, logits)
            scaled = self.optimizer.scale_loss(loss) if self.precision == "fp16" else loss
        return loss, tape.gradient(scaled, variables)

    def _step(self, images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        loss, gradients = self._gradients(images, labels)
        gradients = self.distribution.allreduce(gradients)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables, strict=True))
        return loss

    def train_step(self, batch: Batch) -> float:
        images, labels = batch
        self.optimizer.learning_rate.assign(self.schedule.at(self._next_step()))
        loss = self.distribution.run(self._compiled_step, images, labels)
        if self._first_step:
            self.distribution.after_first_step(self.model, self.optimizer)
            self._first_step = False
        return float(loss)  # waits for the device

    def _next_step(self) -> int:
        """The optimizer step about to be taken, counted across restarts (1-based)."""
        return int(self.optimizer.iterations.numpy()) + 1

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

    def barrier(self) -> None:
        self.distribution.barrier()

    def reduce_max(self, values: list[float]) -> list[float]:
        return self.distribution.reduce_max(values)

    def gather(self, value: Any) -> list[Any]:
        return self.distribution.gather(value)

    def summary_extra(self) -> dict[str, Any]:
        extra = {"framework": "tensorflow", "input_source": self.source, "distribution": self.distribution.name, "model": self.config.model,
                 "precision": self.precision, "jit_compile": self.jit_compile}
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


def local_dataset(folder: ImageDataset, config: KerasVisionConfig, rank: int, ranks: int) -> DatasetFactory:
    """A homogeneous job's input: this rank's shard of the files, its own augmentation seed (TensorFlow
    fixes an op's seed from the global seed when the op is built), read on from a resumed position. The
    global seed must not depend on the position: the shuffle's order derives from it too, and a resumed
    run skips positions of the first run's order."""

    paths, labels = file_samples(folder)

    def make(skip: int) -> tf.data.Dataset:
        tf.random.set_seed(config.seed * 1_000_003 + rank)
        return augmentation_pipeline(paths, labels, config.batch_size, config.augment_config, seed=config.seed + rank, shard=(rank, ranks), skip=skip)

    return make


def build_trainer(environ: dict[str, str]) -> KerasVisionTrainer:
    cluster = load_cluster(environ)
    settings, config = load_settings(KerasVisionConfig, environ)
    # Threads first: they cannot change once TensorFlow's context exists (a strategy creates it).
    local_processes = int(environ.get("HOROVOD_LOCAL_SIZE", 1))
    tf.config.threading.set_intra_op_parallelism_threads(max(1, len(os.sched_getaffinity(0)) // local_processes))
    tf.config.threading.set_inter_op_parallelism_threads(2)
    distribution = DISTRIBUTIONS[settings.distribution]()
    paths = OutputPaths.from_environment(environ)
    addresses = host_addresses(environ)
    control = settings.data_service_targets(cluster, addresses)
    common: dict[str, Any] = dict(distribution=distribution)
    if control:
        dispatcher, _ = settings.tf_data_service_addresses(cluster, addresses)
        # The dispatcher host's control server answers only once its dataset is registered.
        info = describe(control[:1], settings.shutdown_token, settings.data_connect_timeout_s)
        wait_for_port(dispatcher, settings.data_connect_timeout_s)
        expected = (3, config.image_size, config.image_size)
        if info.batch_size != config.batch_size or tuple(info.sample_shape) != expected:
            raise HyperparameterError(
                f"data host {info.host} makes batches of {info.batch_size} × {tuple(info.sample_shape)}, "
                f"this trainer expects {config.batch_size} × {expected}"
            )
        log.info("rank %d reading %r from tf.data.service at %s (%d data hosts)", distribution.rank, DATASET_ID, dispatcher, len(control))
        # The service's stream has no position to resume from: a resumed job reads a fresh one.
        service = lambda _skip: read_from_service(dispatcher, config.batch_size, config.image_size)  # noqa: E731
        # A sharded channel's epoch is every host's share.
        hosts = describe_every(control, settings.shutdown_token, settings.data_connect_timeout_s) if info.sharded else [info]
        return KerasVisionTrainer(config, paths, classes=list(info.classes), dataset=service, source="tf.data.service",
                                  epoch_samples=sum(int(host.num_samples) for host in hosts), **common)
    folder = scan_image_files(channel_dir(settings.data_channel, environ), settings.data_channel, cluster.current_group)
    dataset = local_dataset(folder, config, distribution.rank, distribution.size)
    return KerasVisionTrainer(config, paths, classes=list(folder.classes), dataset=dataset, source="local", **common)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        trainer = build_trainer(dict(os.environ))
        summary = trainer.run()
    except (ClusterConfigError, HyperparameterError, ChannelError, DataServiceError, DataExhaustedError, CheckpointWriteError,
            NonFiniteLossError) as error:
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
