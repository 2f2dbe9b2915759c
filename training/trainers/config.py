"""Typed trainer settings, one frozen dataclass per trainer, built from the job's hyperparameters.

Standard library only: a data host (which never trains) reads the settings it shares with the trainer
(batch size, image size, augmentation) without importing torch, and the platform's spec validation
checks a job's hyperparameters against these classes before anything is launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

MODELS = ("cnn", "resnet18", "resnet50")
KERAS_MODELS = ("cnn", "resnet50")
AUGMENTATIONS = ("standard", "heavy")
# "auto": bf16 where the GPU has it (Ampere and later), fp16 with loss scaling on older GPUs (V100, i.e.
# ml.p3), fp32 on CPUs. The others force one, to compare.
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class AugmentConfig:
    image_size: int
    # "standard": random resized crop, flip, colour jitter (ImageNet training recipe).
    # "heavy": standard plus rotation, blur, sharpness and autocontrast (a preprocessing-bound pipeline).
    augment: str = "standard"

    def __post_init__(self) -> None:
        if self.augment not in AUGMENTATIONS:
            raise ValueError(f"augment must be one of {AUGMENTATIONS}, got {self.augment!r}")
        if not 8 <= self.image_size <= 1024:
            raise ValueError(f"image_size must be in 8..1024, got {self.image_size}")

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)


@dataclass(frozen=True)
class LoopConfig:
    """What every trainer's loop shares (training/trainers/loop.py)."""

    steps: int = 100  # optimizer steps in total, counted across restarts
    warmup_steps: int = 5  # first steps of each run, left out of step-time figures (start-up, compile)
    batch_size: int = 32  # per trainer process
    log_every: int = 1  # a metrics line every N steps
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    seed: int = 0

    def __post_init__(self) -> None:
        _positive(self, "steps", "batch_size", "log_every")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in 0..steps-1 ({self.steps - 1}), got {self.warmup_steps}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be ≥ 0, got {self.checkpoint_every}")


@dataclass(frozen=True)
class ImageClassificationConfig(LoopConfig):
    """What both image-classification trainers take; each names the models it builds (``models``)."""

    models: ClassVar[tuple[str, ...]] = MODELS
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
        _positive(self, "cnn_width", "learning_rate")
        if self.cached_input_batches < 0:
            raise ValueError(f"cached_input_batches must be ≥ 0, got {self.cached_input_batches}")
        _fraction(self, "lr_warmup_fraction")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        AugmentConfig(image_size=self.image_size, augment=self.augment)  # raises on a bad size or augmentation

    @property
    def augment_config(self) -> AugmentConfig:
        return AugmentConfig(image_size=self.image_size, augment=self.augment)


@dataclass(frozen=True)
class VisionConfig(ImageClassificationConfig):
    """The PyTorch image-classification trainer (training/trainers/pytorch_vision.py): "cnn", "resnet18"
    or "resnet50" (torchvision); preprocessing in training/data_service/preprocess.py."""

    model: str = "resnet18"
    dataloader_workers: int = -1  # homogeneous jobs only; -1: this host's CPUs
    channels_last: bool = True  # on GPUs: NHWC memory format, which tensor cores want (ignored on CPUs)
    compile: bool = False  # torch.compile the model (a longer warm-up for a faster step)


@dataclass(frozen=True)
class KerasVisionConfig(ImageClassificationConfig):
    """The TensorFlow (Keras 3) image-classification trainer (training/trainers/tf_vision.py): "cnn" or
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


def _fraction(config: object, name: str) -> None:
    if not 0 <= getattr(config, name) < 1:
        raise ValueError(f"{name} must be in [0, 1), got {getattr(config, name)}")


def _positive(config: object, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(config, name)}")


@dataclass(frozen=True)
class TextConfig(LoopConfig):
    """The PyTorch/XLA sequence-classification trainer (training/trainers/xla_text.py)."""

    model: str = "bert-base-uncased"  # a Hugging Face name already in the image's cache, or a saved model folder
    model_channel: str = ""  # when set, the model and tokenizer load from this input channel instead
    eval_channel: str = ""  # CSV channel to evaluate on at the end (and every eval_every steps)
    eval_every: int = 0  # steps between evaluations; 0: only at the end
    max_seq_len: int = 128  # tokens per example after truncation and padding
    learning_rate: float = 5e-5  # AdamW; the peak, after the warm-up, decaying linearly to zero at the end
    weight_decay: float = 0.01
    lr_warmup_fraction: float = 0.1  # of the steps, linear from zero (the Neuron BERT recipe's schedule)
    tokenize_chunk: int = 4096  # texts per tokenizer call: bounds the tokenising host's memory
    # N > 0: before training, run N steps under the Neuron SDK's neuron_parallel_compile (graph extraction
    # only, outputs discarded), which compiles every graph in parallel into the compile cache.
    precompile_steps: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "max_seq_len", "learning_rate", "tokenize_chunk")
        _fraction(self, "lr_warmup_fraction")
        if not 0 <= self.precompile_steps <= self.steps:
            raise ValueError(f"precompile_steps must be in 0..steps ({self.steps}), got {self.precompile_steps}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be ≥ 0, got {self.eval_every}")
        if self.eval_every and not self.eval_channel:
            raise ValueError("eval_every needs an eval_channel to evaluate on")
