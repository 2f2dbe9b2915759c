"""The trainers this image can run, and what each supports: the one registry the launcher (which
module to start) and the platform's spec validation (what a job may ask for) both read.

Standard library only, so the validation Lambda can import it without the training stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.trainers.config import KerasVisionConfig, TextConfig, VisionConfig, WorkloadConfig


@dataclass(frozen=True)
class Variant:
    name: str
    module: str  # started on the DNN group (python -m <module>)
    config: type  # the trainer's config dataclass: its fields are the hyperparameters it accepts
    workloads: tuple[str, ...]
    distributions: tuple[str, ...]
    has_data_service: bool  # whether CPU data groups can feed it
    accelerator: str  # "gpu": NVIDIA (or CPU) instances; "trainium": ml.trn* instances
    input_format: str  # what its training channel holds: "images" (files or tar shards), "image_files" or "text" (.csv/.jsonl)
    # What data hosts run for it: "grpc" (training/data_service/server.py) or "tf.data.service".
    data_service: str = "grpc"
    # Whether it trains user workloads (training/workload/): they run on the one PyTorch runtime, GPU or XLA,
    # with the gRPC data service on any data groups.
    user_workloads: bool = False


# The trainer of every user workload, and its settings; the workload's own hyperparameters come on top.
WORKLOAD_TRAINER = "training.trainers.pytorch_runtime"
WORKLOAD_CONFIG = WorkloadConfig
# The name a spec's "workload" takes when it is a user's module ({"code": ..., "module": ...}).
USER_WORKLOAD = "user"


VARIANTS: dict[str, Variant] = {
    "pytorch": Variant(
        name="pytorch",
        module="training.trainers.pytorch_vision",
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
        module="training.trainers.tf_vision",
        config=KerasVisionConfig,
        workloads=("vision",),
        distributions=("horovod", "mirrored", "none"),
        has_data_service=True,
        accelerator="gpu",
        input_format="image_files",  # tf.data reads files by name: no tar shards
        data_service="tf.data.service",
    ),
    "neuron": Variant(
        name="neuron",
        module="training.trainers.xla_text",
        config=TextConfig,
        workloads=("text",),
        distributions=("torchrun",),
        has_data_service=False,  # the text trainer tokenises once per node; no CPU data group feeds it
        accelerator="trainium",
        input_format="text",
        user_workloads=True,
    ),
}
