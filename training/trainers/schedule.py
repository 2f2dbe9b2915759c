"""Learning-rate schedules the trainers share: pure functions of the step.

* Vision (SGD, ``scale_lr``): the configured rate is per worker; with W workers the effective batch is W
  times larger, so the peak rate is W times larger too (Goyal et al., "Accurate, Large Minibatch SGD";
  Horovod's guidance), reached by a linear warm-up, since starting large diverges; then a cosine from the
  peak towards zero, which it would reach one step after the last (``cosine``: the TensorFlow loop's
  default, as the PyTorch built-in's own schedule in training/workloads/vision.py).
* Text (AdamW fine-tuning, the Neuron BERT recipe and Hugging Face's ``get_linear_schedule_with_warmup``):
  linear warm-up to the configured rate, then linear decay to zero at the last step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    base: float  # the configured learning rate (per worker when scaled)
    total_steps: int
    warmup_fraction: float = 0.0  # of total_steps
    workers: int = 1
    scale_with_workers: bool = False
    decay: bool = False  # linear to zero at total_steps
    cosine: bool = False  # a cosine from the peak towards zero after the warm-up

    @property
    def peak(self) -> float:
        return self.base * (self.workers if self.scale_with_workers else 1)

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_fraction * self.total_steps)

    def at(self, step: int) -> float:
        """The rate for optimizer step ``step`` (1-based, counted across restarts)."""
        warmup = self.warmup_steps
        if warmup and step <= warmup:
            return self.peak * step / warmup
        if self.cosine:
            # Step warmup + 1 runs at the peak; zero would come one step after the last: every step trains.
            progress = (step - warmup - 1) / max(1, self.total_steps - warmup)
            return self.peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        if self.decay:
            # Step warmup + 1 runs at the peak and the last step at peak / (decay steps): never at zero.
            return self.peak * max(0.0, (self.total_steps - step + 1) / max(1, self.total_steps - warmup))
        return self.peak

    def factor(self, step: int) -> float:
        """``at(step)`` relative to ``base`` (what torch's LambdaLR multiplies by)."""
        return self.at(step) / self.base
