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
  training/horovod_launch.py); gradients are averaged by ``hvd.DistributedGradientTape`` in a custom
  loop (Horovod's Keras callbacks do not work with Keras 3), and rank 0's variables are broadcast after
  the first step;
* ``mirrored``: one process, ``tf.distribute.MirroredStrategy`` over this host's devices;
* ``none``: one process, one device.

Normalisation to float happens inside the compiled step, on the device. The shared loop
(training/trainers/loop.py) does timing, metric lines, checkpoints and the summary.

    python -m training.trainers.tf_vision
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's INFO lines (oneDNN, CPU features) are noise here

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from training.cluster import ClusterConfigError, host_addresses, load_cluster
from training.data_service.control import DataServiceError, describe, wait_for_port
from training.data_service.dataset import ChannelError, channel_dir, scan_image_folder
from training.data_service.tf_pipeline import DATASET_ID, JOB_NAME, augmentation_pipeline, element_spec
from training.failure import write_failure
from training.hyperparameters import HyperparameterError, load_hyperparameters, parse_settings
from training.trainers.config import KerasVisionConfig
from training.trainers.loop import DataExhaustedError, OutputPaths, TrainingLoop, TrainingStopped, leave_stopped

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

    def tape(self, tape: tf.GradientTape) -> tf.GradientTape:
        return tape

    def sources(self, variables: list) -> list:
        return variables

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

    def tape(self, tape: tf.GradientTape) -> tf.GradientTape:
        return self.hvd.DistributedGradientTape(tape)

    def sources(self, variables: list) -> list:
        # Horovod keys gradients by tf.Variable.ref(); Keras 3 variables wrap a tf.Variable (.value).
        return [variable.value for variable in variables]

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


class KerasVisionTrainer(TrainingLoop[Batch]):
    checkpoint_name = "checkpoint.npz"

    def __init__(
        self,
        config: KerasVisionConfig,
        paths: OutputPaths,
        *,
        distribution: Distribution,
        classes: list[str],
        dataset: tf.data.Dataset,
        source: str,
    ) -> None:
        super().__init__(config, paths, rank=distribution.rank, world_size=distribution.size)
        self.config: KerasVisionConfig = config
        self.distribution = distribution
        self.classes = classes
        self.source = source
        self.dataset = dataset
        keras.utils.set_random_seed(config.seed)
        with distribution.scope():
            self.model = build_model(config, len(classes))
            self.optimizer = keras.optimizers.SGD(
                learning_rate=config.learning_rate, momentum=config.momentum, weight_decay=config.weight_decay
            )
            self.optimizer.build(self.model.trainable_variables)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum_over_batch_size")
        self._first_step = True
        self._compiled_step = tf.function(self._step, jit_compile=False)

    # Hooks ---------------------------------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        dataset = self.dataset
        if self.config.cached_input_batches:
            cached = list(dataset.take(self.config.cached_input_batches))
            return itertools.cycle(cached)
        return self.distribution.distribute(dataset)

    def _step(self, images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            logits = self.model(normalise(images), training=True)
            loss = self.loss_fn(labels, logits)
        gradients = self.distribution.tape(tape).gradient(loss, self.distribution.sources(variables))
        self.optimizer.apply_gradients(zip(gradients, variables, strict=True))
        return loss

    def train_step(self, batch: Batch) -> float:
        images, labels = batch
        loss = self.distribution.run(self._compiled_step, images, labels)
        if self._first_step:
            self.distribution.after_first_step(self.model, self.optimizer)
            self._first_step = False
        return float(loss)  # waits for the device

    def save_checkpoint(self, path: Path, step: int) -> None:
        state = {f"model/{i}": np.asarray(v) for i, v in enumerate(self.model.variables)}
        state |= {f"optimizer/{i}": np.asarray(v) for i, v in enumerate(self.optimizer.variables)}
        buffer = io.BytesIO()
        np.savez(buffer, step=np.int64(step), **state)
        path.write_bytes(buffer.getvalue())

    def load_checkpoint(self, path: Path) -> int:
        with np.load(path) as state:
            for i, variable in enumerate(self.model.variables):
                variable.assign(state[f"model/{i}"])
            for i, variable in enumerate(self.optimizer.variables):
                variable.assign(state[f"optimizer/{i}"])
            return int(state["step"])

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
        return {"framework": "tensorflow", "input_source": self.source, "distribution": self.distribution.name, "model": self.config.model}


def service_dataset(dispatcher: str, config: KerasVisionConfig) -> tf.data.Dataset:
    return tf.data.experimental.service.from_dataset_id(
        processing_mode="parallel_epochs",
        service=f"grpc://{dispatcher}",
        dataset_id=DATASET_ID,
        element_spec=element_spec(config.batch_size, config.image_size),
        job_name=JOB_NAME,
    ).prefetch(2)


def build_trainer(environ: dict[str, str]) -> KerasVisionTrainer:
    cluster = load_cluster(environ)
    settings, config = parse_settings(load_hyperparameters(environ), KerasVisionConfig)
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
        return KerasVisionTrainer(config, paths, classes=list(info.classes), dataset=service_dataset(dispatcher, config), source="tf.data.service", **common)
    folder = scan_image_folder(channel_dir(settings.data_channel, environ), settings.data_channel, cluster.current_group)
    dataset = augmentation_pipeline(
        [path for path, _ in folder.samples], [label for _, label in folder.samples],
        config.batch_size, config.augment_config, seed=config.seed + distribution.rank,
    )
    return KerasVisionTrainer(config, paths, classes=list(folder.classes), dataset=dataset, source="local", **common)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        trainer = build_trainer(dict(os.environ))
        summary = trainer.run()
    except (ClusterConfigError, HyperparameterError, ChannelError, DataServiceError, DataExhaustedError) as error:
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
