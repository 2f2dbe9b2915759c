"""Typed trainer settings, one frozen dataclass per trainer, built from the job's hyperparameters.

Standard library only: a data host (which never trains) reads the settings it shares with the trainer
(batch size, image size, augmentation) without importing torch, and the platform's spec validation
checks a job's hyperparameters against these classes before anything is launched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar

from training.data_service.augmentation import AugmentConfig  # re-exported: the trainers' settings name it

MODELS = ("cnn", "resnet18", "resnet50")
KERAS_MODELS = ("cnn", "resnet50")
# "auto": bf16 where the GPU has it (Ampere and later), fp16 with loss scaling on older GPUs (V100, i.e.
# ml.p3), fp32 on CPUs. The others force one, to compare.
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def check_limits(config: object) -> None:
    """Every number of a config within its class's ``limits`` (inclusive ranges, merged along the class
    hierarchy) and finite: a spec asking for 10**30 steps, a batch of 10**9 or a NaN learning rate is
    refused before anything is launched, not discovered by a running job."""
    limits: dict[str, tuple[float, float]] = {}
    for cls in reversed(type(config).__mro__):
        limits |= dict(vars(cls).get("limits", {}))
    for item in fields(config):  # type: ignore[arg-type]
        value = getattr(config, item.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value):
            raise ValueError(f"{item.name} must be a finite number, got {value}")
        low, high = limits.get(item.name, (-math.inf, math.inf))
        if not low <= value <= high:
            raise ValueError(f"{item.name} must be in {_shown(low)}..{_shown(high)}, got {_shown(value)}")


def _shown(number: float) -> str:
    """A bound or value as a person writes it: 10000000, 0.999, 1e+30."""
    return str(int(number)) if float(number).is_integer() and abs(number) < 1e15 else f"{number:g}"


@dataclass(frozen=True)
class LoopConfig:
    """What every trainer's loop shares (training/trainers/loop.py)."""

    # Inclusive ranges of the numbers, checked by check_limits (subclasses add theirs). Far beyond any
    # sensible run, tight enough that an absurd value is a refusal, not a job that runs for days.
    limits: ClassVar[Mapping[str, tuple[float, float]]] = {
        "steps": (1, 10_000_000), "warmup_steps": (0, 10_000_000), "batch_size": (1, 65_536), "log_every": (1, 10_000_000),
        "checkpoint_every": (0, 10_000_000), "seed": (0, 2**32 - 1),
    }

    steps: int = 100  # optimizer steps in total, counted across restarts
    warmup_steps: int = 5  # first steps of each run, left out of step-time figures (start-up, compile)
    batch_size: int = 32  # per trainer process
    log_every: int = 1  # a metrics line every N steps
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    seed: int = 0  # the run's seed: the model's initial weights, the samples' order, the augmentations' draws

    def __post_init__(self) -> None:
        check_limits(self)
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in 0..steps-1 ({self.steps - 1}), got {self.warmup_steps}")


@dataclass(frozen=True)
class ImageClassificationConfig(LoopConfig):
    """What both image-classification trainers take; each names the models it builds (``models``)."""

    models: ClassVar[tuple[str, ...]] = MODELS
    limits: ClassVar[Mapping[str, tuple[float, float]]] = {
        "cnn_width": (1, 1024), "image_size": (8, 1024), "learning_rate": (1e-8, 10.0), "momentum": (0.0, 0.999),
        "weight_decay": (0.0, 1.0), "cached_input_batches": (0, 100_000), "lr_warmup_fraction": (0.0, 0.99),
    }
    model: str = "resnet18"
    cnn_width: int = 32  # channels of the first "cnn" layer; doubles per stage
    image_size: int = 128  # side of the square crops fed to the model
    augment: str = "standard"  # "standard" or "heavy" (the data pipeline of the trainer's variant)
    learning_rate: float = 0.05  # SGD with momentum
    momentum: float = 0.9
    weight_decay: float = 1e-4
    cached_input_batches: int = 0  # N > 0: cycle the first N real batches in memory; the model alone
    # The learning rate is per worker: with W workers the peak is W × learning_rate (linear scaling,
    # Horovod's guidance), reached by a linear warm-up over this fraction of the steps.
    scale_lr: bool = True
    lr_warmup_fraction: float = 0.05
    precision: str = "auto"  # see PRECISIONS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model not in self.models:
            raise ValueError(f"model must be one of {self.models}, got {self.model!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        AugmentConfig(image_size=self.image_size, augment=self.augment)  # raises on a bad size or augmentation

    @property
    def augment_config(self) -> AugmentConfig:
        return AugmentConfig(image_size=self.image_size, augment=self.augment)


@dataclass(frozen=True)
class KerasVisionConfig(ImageClassificationConfig):
    """The TensorFlow (Keras 3) image-classification trainer (training/trainers/keras_runtime.py): "cnn" or
    "resnet50" (keras.applications, untrained); preprocessing in training/data_service/tf_pipeline.py."""

    models: ClassVar[tuple[str, ...]] = KERAS_MODELS
    model: str = "resnet50"
    # XLA-compile the gradient computation ("auto": on GPUs only, where it fuses the mixed-precision
    # casts). Horovod's all-reduce always runs outside the compiled part (its XLA ops are not built in).
    jit_compile: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.jit_compile not in ("auto", "true", "false"):
            raise ValueError(f"jit_compile must be auto, true or false, got {self.jit_compile!r}")


@dataclass(frozen=True)
class WorkloadConfig(LoopConfig):
    """What the platform's loop takes for a user workload (training/trainers/pytorch_runtime.py); the
    workload's own hyperparameters are the ones its module declares (``HYPERPARAMETERS``), checked where
    the module is (``hetero validate``, every host), not here."""

    limits: ClassVar[Mapping[str, tuple[float, float]]] = {
        "eval_every": (0, 10_000_000), "dataloader_workers": (-1, 256), "grad_clip_norm": (0.0, 1e6), "eval_batch_size": (0, 65_536),
        "cached_input_batches": (0, 100_000), "precompile_steps": (0, 10_000_000),
    }
    precision: str = "auto"  # see PRECISIONS: autocast (and loss scaling for fp16) around the user's step
    eval_channel: str = ""  # the validation channel (read on the DNN group), evaluated every eval_every steps and at the end
    eval_every: int = 0  # steps between validations; 0: only at the end (when there is an eval_channel)
    eval_batch_size: int = 0  # 0: batch_size
    dataloader_workers: int = -1  # preprocessing processes per trainer process in a homogeneous job; -1: this host's CPUs
    grad_clip_norm: float = 0.0  # > 0: clip the gradients' global norm to this before each optimizer step
    # N > 0: cycle the first N real batches in memory: the model's step time with no input cost (the
    # train-only figure of the profile, training/local/profile.py, and of bench/offload.py)
    cached_input_batches: int = 0
    compile: bool = False  # torch.compile the model on GPUs and CPUs (a longer warm-up for a faster step; XLA compiles anyway)
    # XLA: N > 0 runs N steps first under the Neuron SDK's neuron_parallel_compile (graph extraction only,
    # outputs discarded), which compiles every graph of the step in parallel into the compile cache.
    precompile_steps: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.eval_every and not self.eval_channel:
            raise ValueError("eval_every needs an eval_channel to validate on")
        if not 0 <= self.precompile_steps <= self.steps:
            raise ValueError(f"precompile_steps must be in 0..steps ({self.steps}), got {self.precompile_steps}")


@dataclass(frozen=True)
class KerasWorkloadConfig(LoopConfig):
    """What the platform's TensorFlow loop takes for a workload (training/trainers/keras_runtime.py); the
    workload's own hyperparameters are the ones its module declares, as for WorkloadConfig."""

    limits: ClassVar[Mapping[str, tuple[float, float]]] = {
        "learning_rate": (1e-8, 10.0), "momentum": (0.0, 0.999), "weight_decay": (0.0, 1.0), "lr_warmup_fraction": (0.0, 0.99),
        "eval_every": (0, 10_000_000), "eval_batch_size": (0, 65_536), "cached_input_batches": (0, 100_000),
    }
    # The default optimizer's (SGD with momentum), when the module defines no build_optimizer: per worker,
    # scaled by the workers after a linear warm-up, as the built-in's. A build_optimizer's rate is its own.
    learning_rate: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    scale_lr: bool = True
    lr_warmup_fraction: float = 0.05
    precision: str = "auto"  # see PRECISIONS: the Keras mixed-precision policy (loss scaling for fp16)
    jit_compile: str = "auto"  # XLA-compile the forward and backward pass: "auto" on GPUs only
    eval_channel: str = ""  # the validation channel (read on the DNN group), evaluated every eval_every steps and at the end
    eval_every: int = 0  # steps between validations; 0: only at the end (when there is an eval_channel)
    eval_batch_size: int = 0  # 0: batch_size
    cached_input_batches: int = 0  # N > 0: cycle the first N real batches in memory; the model alone

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.jit_compile not in ("auto", "true", "false"):
            raise ValueError(f"jit_compile must be auto, true or false, got {self.jit_compile!r}")
        if self.eval_every and not self.eval_channel:
            raise ValueError("eval_every needs an eval_channel to validate on")


# The built-in workloads' settings, for the platform's spec validation (which imports no torch): the
# loop's (WorkloadConfig) and the module's own HYPERPARAMETERS (training/workloads/<name>.py), with the
# module's LOOP_DEFAULTS; tests/training/test_builtin_workloads.py holds them equal to the modules'.


@dataclass(frozen=True)
class VisionConfig(WorkloadConfig):
    """The built-in image classifier (training/workloads/vision.py): "cnn", "resnet18" or "resnet50"
    (torchvision), both augmentation recipes of training/data_service/preprocess.py."""

    models: ClassVar[tuple[str, ...]] = MODELS
    limits: ClassVar[Mapping[str, tuple[float, float]]] = {
        "cnn_width": (1, 1024), "image_size": (8, 1024), "learning_rate": (1e-8, 10.0), "momentum": (0.0, 0.999),
        "weight_decay": (0.0, 1.0), "lr_warmup_fraction": (0.0, 0.99), "label_smoothing": (0.0, 0.5),
    }
    model: str = "resnet18"
    cnn_width: int = 32  # channels of the first "cnn" layer; doubles per stage
    image_size: int = 128  # side of the square crops fed to the model
    augment: str = "standard"  # "standard" or "heavy"
    # SGD with momentum, per worker: with W workers the peak is W × learning_rate (linear scaling), reached
    # by a linear warm-up over lr_warmup_fraction of the steps, then a cosine decay towards zero (reached one step after the last).
    learning_rate: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4  # SGD's (coupled, torchvision's recipe), on convolution and linear weights only: not on norms or biases
    scale_lr: bool = True
    lr_warmup_fraction: float = 0.05
    label_smoothing: float = 0.0
    channels_last: bool = True  # on GPUs: NHWC memory format, which tensor cores want (ignored on CPUs)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model not in self.models:
            raise ValueError(f"model must be one of {self.models}, got {self.model!r}")
        AugmentConfig(image_size=self.image_size, augment=self.augment)  # raises on a bad size or augmentation

    @property
    def augment_config(self) -> AugmentConfig:
        return AugmentConfig(image_size=self.image_size, augment=self.augment)


@dataclass(frozen=True)
class TextConfig(WorkloadConfig):
    """The built-in sequence classifier for Trainium (training/workloads/text.py): a Hugging Face model
    (BERT) fine-tuned with AdamW, tokenised once per node."""

    limits: ClassVar[Mapping[str, tuple[float, float]]] = {
        "max_seq_len": (8, 8192), "learning_rate": (1e-8, 1.0), "weight_decay": (0.0, 1.0), "lr_warmup_fraction": (0.0, 0.99),
        "tokenize_chunk": (1, 1_000_000),
    }
    grad_clip_norm: float = 1.0  # the module's LOOP_DEFAULTS
    model: str = "bert-base-uncased"  # a Hugging Face name already in the image's cache, or a saved model folder
    model_channel: str = ""  # when set, the model and tokenizer load from this input channel instead
    max_seq_len: int = 128  # tokens per example after truncation and padding
    learning_rate: float = 5e-5  # AdamW; the peak, after the warm-up, decaying linearly to zero at the end
    weight_decay: float = 0.01
    lr_warmup_fraction: float = 0.1  # of the steps, linear from zero (the Neuron BERT recipe's schedule)
    tokenize_chunk: int = 4096  # texts per tokenizer call: bounds the tokenising host's memory
