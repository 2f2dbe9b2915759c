"""Which numeric precision a trainer computes in: one pure rule for the PyTorch and TensorFlow trainers.

"auto" picks what the GPU is fast at: bf16 where it has it (compute capability 8.0, Ampere, and later:
ml.p4d, ml.p5, ml.g5...), fp16 with loss scaling on older GPUs (V100 is 7.0: ml.p3), fp32 on CPUs, where
half precision is slower. Measured on one H200 (ResNet50, 224², batch 128, train-only): fp32 60.0 ms/step,
bf16 autocast 54.4, bf16 + channels_last 29.4.
"""

from __future__ import annotations


def resolve_precision(requested: str, *, gpu: bool, capability: tuple[int, int] | None = None) -> str:
    """"fp32", "bf16" or "fp16" for ``requested`` (training/trainers/config.PRECISIONS) on this device.
    A forced choice is kept (on a CPU it runs, slowly: that is how the tests run those paths). Pure."""
    if requested != "auto":
        return requested
    if not gpu:
        return "fp32"
    return "bf16" if capability is not None and capability >= (8, 0) else "fp16"
