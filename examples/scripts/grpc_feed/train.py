"""An existing SageMaker heterogeneous-cluster script, in the public PyTorch sample's shape: one entry point
on every host that reads its instance group from SageMaker's environment, serves augmented batches over
gRPC of its own on the CPU group, and trains on the accelerator group. It knows nothing of this platform.

    hetero local examples/pytorch-script.json --channel train=build/images

The data group's server never exits by itself (as in the sample): the platform's launcher ends it when
the trainer group is done. SIGTERM (StopTrainingJob, a spot interruption) saves a checkpoint.
"""

import argparse
import io
import json
import os
import random
import signal
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

METHOD = "/feed.Feed/Batches"  # unary-stream, raw bytes both ways: one .npz batch per message


def load_images(root: Path, size: int) -> tuple[list[np.ndarray], list[int]]:
    from PIL import Image

    classes = sorted(path.name for path in root.iterdir() if path.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((root / name).iterdir()):
            with Image.open(path) as image:
                images.append(np.asarray(image.convert("RGB").resize((size + 4, size + 4)), dtype=np.uint8))
            labels.append(label)
    return images, labels


def serve(args: argparse.Namespace) -> None:
    images, labels = load_images(Path(os.environ["SM_CHANNEL_TRAIN"]), args.image_size)
    host = os.environ["SM_CURRENT_HOST"]

    def batches(request: bytes, context: grpc.ServicerContext):
        rng = random.Random(f"{host}-{context.peer()}")
        while context.is_active():
            picks = [rng.randrange(len(images)) for _ in range(args.batch_size)]
            crops = []
            for index in picks:  # the CPU-heavy part: random crop and flip
                y, x = rng.randrange(5), rng.randrange(5)
                crop = images[index][y:y + args.image_size, x:x + args.image_size]
                crops.append(crop[:, ::-1] if rng.random() < 0.5 else crop)
            buffer = io.BytesIO()
            np.savez(buffer, x=np.stack(crops).transpose(0, 3, 1, 2), y=np.array([labels[i] for i in picks]))
            yield buffer.getvalue()

    handler = grpc.method_handlers_generic_handler("feed.Feed", {"Batches": grpc.unary_stream_rpc_method_handler(batches)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"{host}:{args.port}")  # this host's own name: SageMaker's DNS, or the emulator's hosts file
    server.start()
    print(f"serving {len(images)} images on {host}:{args.port}", flush=True)
    server.wait_for_termination()


def train(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    feeders = json.loads(os.environ["SM_INSTANCE_GROUPS_DICT"])[args.data_group]["hosts"]
    streams = []
    for feeder in feeders:
        channel = grpc.insecure_channel(f"{feeder}:{args.port}")
        grpc.channel_ready_future(channel).result(timeout=300)
        streams.append(channel.unary_stream(METHOD)(b""))
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, args.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)
    checkpoint = Path("/opt/ml/checkpoints")  # CheckpointConfig's LocalPath: SageMaker syncs it to S3
    for step in range(1, args.steps + 1):
        if stopping:
            checkpoint.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "step": step - 1}, checkpoint / "checkpoint.pt")
            print(f"SIGTERM: checkpoint saved at step {step - 1}", flush=True)
            sys.exit(0)
        started = time.perf_counter()
        batch = np.load(io.BytesIO(next(streams[step % len(streams)])))
        x = torch.from_numpy(batch["x"]).float() / 255
        loss = nn.functional.cross_entropy(model(x), torch.from_numpy(batch["y"]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step={step}/{args.steps} loss={loss.item():.4f} step_time_ms={(time.perf_counter() - started) * 1000:.1f}", flush=True)
    torch.save(model.state_dict(), Path(os.environ["SM_MODEL_DIR"]) / "model.pt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name, default in (("batch_size", 16), ("image_size", 32), ("steps", 50), ("classes", 4), ("port", 16000)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--data_group", default="data_group")
    arguments = parser.parse_args()
    if os.environ["SM_CURRENT_INSTANCE_GROUP"] == arguments.data_group:
        serve(arguments)
    else:
        train(arguments)
