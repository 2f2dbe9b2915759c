"""Load a model a run saved, without the platform: PyTorch and the workload's own requirements only.

The run's model folder (model.tar.gz, unpacked) holds the weights (``model.pt``), the workload's code
(``code/``), what the model was built with (``workload.json``: the module, its hyperparameters, the
classes, the features a sample has), and this file:

    python load_model.py MODEL_DIR            # prints what it loaded
    from load_model import load; model, card = load("MODEL_DIR")      # in eval mode; card["workload"] is the module
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
    return model.to(device).eval(), card | {"workload": module}


if __name__ == "__main__":
    loaded, meta = load(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
    parameters = sum(parameter.numel() for parameter in loaded.parameters())
    print(f"{meta['module']}: {type(loaded).__name__} with {parameters} parameters, classes {meta['classes']}")
