"""The built-in image classifier, as a workload module: the first user of the workload contract
(training/workload/contract.py), loaded from this folder exactly as a user's code folder is.

* ``list_samples``: an ImageFolder (``<class>/<file>``) or WebDataset tar shards, by the platform's
  reader; tar shards keep their streaming order (each epoch reads the shards through, shuffled).
* ``preprocess`` (on data hosts, or DataLoader workers): the fast OpenCV pipeline of
  training/data_service/preprocess.py, "standard" (random resized crop, flip, colour jitter: the
  ImageNet recipe) or "heavy" (plus rotation, blur, sharpness, autocontrast: a preprocessing-bound
  pipeline, the public heterogeneous sample's kind); validation samples get the centre crop. uint8
  (3, S, S) images travel, a quarter of float32's bytes; an undecodable file is skipped and counted.
* ``device_transform``: to float, ImageNet normalisation and channels_last, on the device.
* ``build_model``: "cnn" (three conv stages with batch norm) or torchvision's resnet18/resnet50, untrained.
* ``build_optimizer``: SGD with momentum, weight decay on convolution and linear weights only (decaying
  batch norm's scales and shifts, and biases, only fights the normalisation: torchvision's recipe sets
  them apart), the rate per worker (× the workers: the linear scaling rule), a linear warm-up, then a
  cosine decay towards zero, which it would reach one step after the last (a rate that never decays leaves the last steps' loss spikes in
  the saved model).
* ``train_step``/``eval_step``: cross-entropy (optionally label-smoothed); validation reports per-sample
  loss and accuracy.

The platform imports it by name (``vision``) on every host; it imports the platform's preprocessing only
inside the hooks, as the contract asks.
"""

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

HYPERPARAMETERS = {
    "model": "resnet18",  # "cnn", "resnet18" or "resnet50"
    "cnn_width": 32,  # channels of the first "cnn" layer; doubles per stage
    "image_size": 128,  # side of the square crops fed to the model
    "augment": "standard",  # "standard" or "heavy"
    "learning_rate": 0.05,  # per worker
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "scale_lr": True,  # the peak rate is the workers × learning_rate
    "lr_warmup_fraction": 0.05,
    "label_smoothing": 0.0,
    "channels_last": True,  # NHWC on GPUs, which tensor cores want
}
# ImageNet statistics, applied on the device to the uint8 batches.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def list_samples(ctx):
    # While the validation channel is listed, its labels index the training channel's classes (ctx.classes).
    return ctx.readers.image_folder(ctx.path)


def preprocess(sample, ctx):
    from training.data_service.augmentation import AugmentConfig
    from training.data_service.preprocess import DECODE_ERRORS, load_and_augment, load_for_eval

    source, label = sample
    size = ctx.hyperparameters["image_size"]
    try:
        if ctx.training:
            image = load_and_augment(source, ctx.rng, AugmentConfig(size, ctx.hyperparameters["augment"]))
        else:
            image = load_for_eval(source, size)
    except DECODE_ERRORS as error:
        raise ctx.Skip(f"{source}: {error}") from None
    return {"image": image, "label": np.int64(label)}


class SmallCNN(nn.Module):
    """Three conv stages (width, 2×, 4× channels) with batch norm, global pooling and a linear head."""

    def __init__(self, num_classes, width):
        super().__init__()
        layers, channels = [], 3
        for stage in range(3):
            out = width * 2**stage
            layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            layers += [nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            layers.append(nn.MaxPool2d(2))
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def build_model(ctx):
    name, classes = ctx.hyperparameters["model"], len(ctx.classes)
    if name == "cnn":
        model = SmallCNN(classes, ctx.hyperparameters["cnn_width"])
    else:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=classes)
    return model.to(memory_format=torch.channels_last) if _channels_last(ctx) else model


def _channels_last(ctx):
    return ctx.hyperparameters["channels_last"] and getattr(ctx.device, "type", "") == "cuda"


def schedule_factor(step, steps, warmup_fraction):
    """The rate of optimizer step ``step`` (1-based) relative to the peak: linear warm-up over the first
    ``warmup_fraction`` of the steps, then a cosine from the peak (the step after the warm-up) towards
    zero, which it would reach one step after the last (every step trains). Pure."""
    warmup = int(warmup_fraction * steps)
    if warmup and step <= warmup:
        return step / warmup
    progress = (step - warmup - 1) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model, ctx):
    hp = ctx.hyperparameters
    decayed = [p for p in model.parameters() if p.ndim > 1]  # convolution and linear weights
    others = [p for p in model.parameters() if p.ndim <= 1]  # norms' scales and shifts, biases
    peak = hp["learning_rate"] * (ctx.world_size if hp["scale_lr"] else 1)
    optimizer = torch.optim.SGD([{"params": decayed, "weight_decay": hp["weight_decay"]}, {"params": others, "weight_decay": 0.0}],
                                lr=peak, momentum=hp["momentum"])
    # LambdaLR counts the steps taken (from 0); the schedule, the step about to be taken (from 1).
    steps, warmup = ctx.steps, hp["lr_warmup_fraction"]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: schedule_factor(done + 1, steps, warmup))


def device_transform(batch, ctx):
    mean = torch.tensor(MEAN, device=batch["image"].device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=batch["image"].device).view(1, 3, 1, 1)
    image = batch["image"].float().div_(255).sub_(mean).div_(std)
    if _channels_last(ctx):
        image = image.contiguous(memory_format=torch.channels_last)
    return {"image": image, "label": batch["label"]}


def train_step(model, batch, ctx):
    return F.cross_entropy(model(batch["image"]), batch["label"], label_smoothing=ctx.hyperparameters["label_smoothing"])


def eval_step(model, batch, ctx):
    logits = model(batch["image"])
    return {"loss": F.cross_entropy(logits, batch["label"], reduction="none"), "accuracy": (logits.argmax(1) == batch["label"]).float()}
