"""Load a model a run saved, without the platform: PyTorch and the workload's own requirements only.

The run's model folder (model.tar.gz, unpacked) holds the weights (``model.pt``), the workload's code
(``code/``), what the model was built with (``workload.json``: the module, its hyperparameters, the
classes, the features a sample has), and this file:

    python load_model.py MODEL_DIR            # prints what it loaded
    from load_model import load; model, card = load("MODEL_DIR")      # in eval mode; card["workload"] is the module

To predict as validation did: ``card["ctx"]`` is an inference context (``training=False``, the device, the
hyperparameters, the classes, a seeded ``rng``, ``Skip``, ``readers`` for files) for the module's ``preprocess(sample, ctx)`` and
``device_transform(batch, ctx)``. (The platform's built-in workloads' preprocess imports the platform's
image code: run theirs with this repository on the path.)
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace


def load(model_dir: str | Path, device: str = "cpu"):
    """(the model with its trained weights, in eval mode, and the model card) from a run's model folder.
    The workload's module comes back as ``card["workload"]``: its preprocess (with ``training=False``) and
    device_transform make an input as validation made it."""
    import torch

    folder = Path(model_dir).resolve()
    card = json.loads((folder / "workload.json").read_text())
    code = str(folder / card["code"])
    # This model's own code: a module of the same name loaded before (another model's) is not it.
    for name in [name for name in sys.modules if name == card["module"] or name.startswith(card["module"] + ".")]:
        del sys.modules[name]
    if code in sys.path:
        sys.path.remove(code)
    sys.path.insert(0, code)
    module = importlib.import_module(card["module"])
    # What build_model reads of its context when training; nothing else of the platform is needed.
    ctx = SimpleNamespace(hyperparameters=card["hyperparameters"], classes=tuple(card["classes"]), num_samples=card["num_samples"],
                          device=torch.device(device), rank=0, world_size=1, local_rank=0, step=0, steps=0, precision="fp32",
                          is_xla=False, state={})
    model = module.build_model(ctx)
    model.load_state_dict(torch.load(folder / card["weights"], map_location=device, weights_only=True))
    return model.to(device).eval(), card | {"workload": module, "ctx": inference_context(card, torch.device(device))}


class SkipSample(Exception):
    """What ``preprocess`` raises for an input it cannot use (the platform's ctx.Skip)."""


class FileReaders:
    """The platform's ``ctx.readers`` for a sample that is a file: its bytes, or the image in it."""

    @staticmethod
    def read_bytes(source):
        import numpy as np

        return np.fromfile(str(source), dtype=np.uint8)

    @staticmethod
    def decode_image(source):
        import numpy as np
        from PIL import Image

        try:
            with Image.open(str(source)) as image:
                return np.asarray(image.convert("RGB"))
        except (OSError, SyntaxError, ValueError) as error:
            raise SkipSample(f"{source}: not a decodable image ({error})") from None


def inference_context(card: dict, device):
    """What preprocess and device_transform read of their contexts, as validation gave them (one process,
    fp32, on ``device``)."""
    import numpy as np

    return SimpleNamespace(hyperparameters=card["hyperparameters"], classes=tuple(card["classes"]), num_samples=card["num_samples"],
                           device=device, training=False, rng=np.random.default_rng(0), epoch=0, index=0, Skip=SkipSample,
                           readers=FileReaders(), rank=0, world_size=1, local_rank=0, step=0, steps=0, precision="fp32",
                           is_xla=False, state={})


if __name__ == "__main__":
    loaded, meta = load(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
    parameters = sum(parameter.numel() for parameter in loaded.parameters())
    print(f"{meta['module']}: {type(loaded).__name__} with {parameters} parameters, classes {meta['classes']}")
