"""A small CNN whose CPU augmentation dominates the step (the public heterogeneous PyTorch sample's shape):
an example workload, written only against the platform's workload contract.

    hetero local examples/workloads/augmented_cnn/heterogeneous.json --channel train=DIR --channel validation=DIR
"""

import numpy as np
import torch
from PIL import Image, ImageFilter
from torch import nn
from torch.nn import functional as F

HYPERPARAMETERS = {"image_size": 48, "width": 16, "learning_rate": 0.003, "blur_passes": 2}


def list_samples(ctx):
    return ctx.readers.image_folder(ctx.path)  # (file, class index) pairs; ctx.classes from the folders


def preprocess(sample, ctx):
    source, label = sample
    image = Image.fromarray(ctx.readers.decode_image(source))
    if ctx.training:  # random resized crop, rotation, blur passes and a flip: CPU work, per sample
        width, height = image.size
        scale = ctx.rng.uniform(0.6, 1.0)
        crop_w, crop_h = int(width * scale), int(height * scale)
        left, top = ctx.rng.integers(0, width - crop_w + 1), ctx.rng.integers(0, height - crop_h + 1)
        image = image.crop((left, top, left + crop_w, top + crop_h)).rotate(ctx.rng.uniform(-15, 15))
        for _ in range(ctx.hyperparameters["blur_passes"]):
            image = image.filter(ImageFilter.GaussianBlur(ctx.rng.uniform(0.1, 1.0)))
    size = ctx.hyperparameters["image_size"]
    pixels = np.asarray(image.resize((size, size)), dtype=np.uint8)
    if ctx.training and ctx.rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    return {"image": np.ascontiguousarray(pixels.transpose(2, 0, 1)), "label": label}


def build_model(ctx):
    width, layers, channels = ctx.hyperparameters["width"], [], 3
    for out in (width, 2 * width, 4 * width):
        layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, len(ctx.classes)))


def build_optimizer(model, ctx):  # AdamW, warm-up then cosine decay over the run (ctx.steps: a resumed run may extend it)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.hyperparameters["learning_rate"], weight_decay=0.01)
    warmup = max(1, ctx.steps // 20)

    def shape(done):
        return min(1.0, (done + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * min(1.0, done / ctx.steps)))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, shape)


def device_transform(batch, ctx):  # uint8 travels; floats are made on the accelerator
    batch["image"] = batch["image"].float().div(255).sub(0.5).div(0.25)
    return batch


def train_step(model, batch, ctx):
    logits = model(batch["image"])
    return F.cross_entropy(logits, batch["label"]), {"accuracy": (logits.argmax(1) == batch["label"]).float().mean()}


def eval_step(model, batch, ctx):
    logits = model(batch["image"])
    return {"loss": F.cross_entropy(logits, batch["label"], reduction="none"), "accuracy": (logits.argmax(1) == batch["label"]).float()}
