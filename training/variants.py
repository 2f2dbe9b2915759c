"""The trainers this image can run, and what each supports: the one registry the launcher (which
module to start) and the platform's spec validation (what a job may ask for) both read.

Standard library only, so the validation Lambda can import it without the training stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from training.trainers.config import KerasVisionConfig, KerasWorkloadConfig, TextConfig, VisionConfig, WorkloadConfig


@dataclass(frozen=True)
class Variant:
    name: str
    module: str  # started on the DNN group (python -m <module>)
    # The hyperparameters its built-in workload accepts (a dataclass); for the PyTorch variants, the loop's
    # and the built-in module's (training/workloads/<workload>.py), held equal to them by a test.
    config: type
    workloads: tuple[str, ...]
    distributions: tuple[str, ...]
    has_data_service: bool  # whether CPU data groups can feed it
    accelerator: str  # "gpu": NVIDIA (or CPU) instances; "trainium": ml.trn* instances
    input_format: str  # what its training channel holds: "images" (files or tar shards), "image_files" or "text" (.csv/.jsonl)
    # What data hosts run for it: "grpc" (training/data_service/server.py) or "tf.data.service".
    data_service: str = "grpc"
    # Whether it trains user workloads (training/workload/), and to which contract: "pytorch" (the one PyTorch
    # runtime, GPU or XLA, the gRPC data service on any data groups) or "tensorflow" (the Keras loop,
    # tf.data.service on the data groups; training/workload/tf_contract.py).
    user_workloads: bool = False
    contract: str = "pytorch"
    workload_config: type = WorkloadConfig  # the platform loop's settings for a user workload


# The trainer of every PyTorch workload, built-in or a user's, and its settings; the workload's own
# hyperparameters come on top.
WORKLOAD_TRAINER = "training.trainers.pytorch_runtime"
WORKLOAD_CONFIG = WorkloadConfig
# The name a spec's "workload" takes when it is a user's module ({"code": ..., "module": ...}).
USER_WORKLOAD = "user"
# The built-in PyTorch workloads: contract modules (vision.py, text.py) in this folder of the image, loaded
# exactly as a user's code folder is (on the import path, by module name, checked against the contract).
BUILTIN_WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"
# The tensorflow variant's built-in, a module of the TensorFlow contract in the same folder.
KERAS_BUILTIN = "keras_vision"


VARIANTS: dict[str, Variant] = {
    "pytorch": Variant(
        name="pytorch",
        module=WORKLOAD_TRAINER,
        config=VisionConfig,
        workloads=("vision",),
        distributions=("torchrun", "none"),
        has_data_service=True,
        accelerator="gpu",
        input_format="images",
        user_workloads=True,
    ),
    "tensorflow": Variant(
        name="tensorflow",
        module="training.trainers.keras_runtime",
        config=KerasVisionConfig,
        workloads=("vision",),
        distributions=("horovod", "mirrored", "none"),
        has_data_service=True,
        accelerator="gpu",
        input_format="image_files",  # tf.data reads files by name: no tar shards
        data_service="tf.data.service",
        user_workloads=True,
        contract="tensorflow",
        workload_config=KerasWorkloadConfig,
    ),
    "neuron": Variant(
        name="neuron",
        module=WORKLOAD_TRAINER,
        config=TextConfig,
        workloads=("text",),
        distributions=("torchrun",),
        has_data_service=False,  # the text trainer tokenises once per node; no CPU data group feeds it
        accelerator="trainium",
        input_format="text",
        user_workloads=True,
    ),
}
