"""What goes into a PyTorch checkpoint so that a resume can load it.

Checkpoints load with ``torch.load(weights_only=True)``: no arbitrary object is unpickled from S3, only
tensors, Python numbers and strings, and lists, tuples and dicts of them. A user's optimizer and scheduler
are built by the user's code, and their state picks up whatever that code computed with: a ``LambdaLR``
whose schedule returns ``np.cos(...)`` keeps NumPy scalars in its ``_last_lr`` and in the optimizer's
``lr``, which ``weights_only`` refuses, hours later, at the resume. So their state is made plain on save
(``plain``), and the first checkpoint a run writes is loaded back at once as a resume loads it
(``check_loads_back``): state that still cannot be restored fails the run at that step, naming the part.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The parts of a checkpoint, as a user reads them in a message.
PART_NAMES = {"model": "the model's state_dict", "optimizer": "the optimizer's state_dict", "scheduler": "the scheduler's state_dict",
              "scaler": "the gradient scaler's state", "workload_state": "ctx.state", "loop": "the loop's state"}


class UnrestorableCheckpointError(RuntimeError):
    """A checkpoint just written that a resume could not load: the run stops now rather than at the resume."""


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars as Python numbers and NumPy arrays as tensors, through dicts, lists
    and tuples; everything else as it is. Pure."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    return value


def refusal(value: Any) -> str | None:
    """Why ``weights_only`` would refuse to load ``value`` (its first line), or None if it loads."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message goes on to offer add_safe_globals, which is the platform's to decide, not the user's.
        lines = [line.strip() for line in str(error).splitlines() if "Unsupported" in line or "GLOBAL" in line]
        return (lines or [str(error).splitlines()[0]])[0].split(" was not an allowed global")[0].removeprefix("WeightsUnpickler error: ")
    return None


def check_loads_back(path: Path, saved: Mapping[str, Any], step: int) -> None:
    """Load the checkpoint at ``path`` as a resume does; UnrestorableCheckpointError naming the part of
    ``saved`` (what was written) that it refuses and why."""
    try:
        torch.load(path, map_location="cpu", weights_only=True)
        return
    except pickle.UnpicklingError:
        pass
    for name, value in saved.items():
        if (why := refusal(value)) is not None:
            raise UnrestorableCheckpointError(
                f"the checkpoint of step {step} could not be resumed: {PART_NAMES.get(name, name)} holds an object that checkpoints "
                f"cannot load (they load with weights_only: tensors, Python numbers, strings, and lists or dicts of them): {why}")
    raise UnrestorableCheckpointError(f"the checkpoint of step {step} ({path}) could not be loaded back as a resume loads it")
