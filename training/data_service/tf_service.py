"""tf.data.service on a data host: the dispatcher (first data host only) and a worker (every data host).

The launcher's data role runs this module as a child process (``TfDataService``) and keeps the
control plane itself: our gRPC server answers Describe, keep-alives and the token-checked Shutdown
(training/data_service/server.py), and stopping the host ends this child. TensorFlow's servers have no
public stop that returns promptly (workers take 10–20 s), so the launcher ends the process instead:
SIGTERM, then SIGKILL after a grace period. The child also dies with its parent (PR_SET_PDEATHSIG), so
a killed launcher never leaves tf.data.service running, and billing, on its own.

The child is started with no Python code between fork and exec (no ``preexec_fn``): the launcher runs
gRPC, whose at-fork handlers would otherwise run in the forked child and abort it now and then ("epoll_wait
... Bad file descriptor"). It sets its own parent-death signal first thing, then checks that its parent is
still the launcher that started it, which closes the window between the start and that call.

The dispatcher host registers the augmentation pipeline (training/data_service/tf_pipeline.py) under
a fixed dataset id, uncompressed; trainers read it with ``from_dataset_id``, one shared job name and
dynamic sharding, so each batch goes to exactly one trainer process and each file is handed out once per
epoch across the data hosts (an epoch's edge blurred by what a slower worker holds: about once per epoch). The child runs in the channel folder: the pipeline lists files relative
to it, so every worker reads its own host's copy of the channel.

    python -m training.data_service.tf_service --worker-address 10.0.0.5:6200 \
        --dispatcher-address 10.0.0.5:6100 [--dispatcher --batch-size 32 --image-size 224 ...]
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("training.tf_service")

# A lost worker is noticed by the dispatcher after this long without a heartbeat, and its tasks are
# dropped so the trainers stop waiting on it (TensorFlow's default is 10 minutes).
WORKER_HEARTBEAT_MS = 1000
WORKER_TIMEOUT_MS = 10_000
# Printed by the child once its servers run (and, on the dispatcher host, the dataset is registered).
READY_LINE = "tf.data.service ready"
# Printed by the child, before it exits, when the workload cannot be served (the reason follows).
REFUSED_LINE = "tf.data.service refused the workload: "
REFUSED_EXIT = 3
# Seconds between SIGTERM and SIGKILL when the host stops.
STOP_GRACE_S = 3.0


class TfServiceError(RuntimeError):
    """tf.data.service did not start on this data host."""


@dataclass(frozen=True)
class TfServiceSettings:
    dispatcher_address: str  # host:port of the dispatcher (on the first data host)
    worker_address: str  # host:port this host's worker listens on and is reached at
    channel_dir: Path  # the child runs here; the pipeline's file names are relative to it
    dispatcher: bool  # this host also runs the dispatcher and registers the pipeline
    batch_size: int
    image_size: int
    augment: str
    seed: int
    # A user's TensorFlow workload (training/workload/tf_contract.py): its unpacked code, installed
    # requirements and module; the dispatcher host registers its dataset instead of the built-in's.
    workload_dir: str = ""
    workload_packages: str = ""
    workload_module: str = ""

    def command(self, python: str = sys.executable, parent_pid: int | None = None) -> list[str]:
        command = [
            python, "-m", "training.data_service.tf_service",
            "--parent-pid", str(os.getpid() if parent_pid is None else parent_pid),
            "--dispatcher-address", self.dispatcher_address,
            "--worker-address", self.worker_address,
            "--batch-size", str(self.batch_size),
            "--image-size", str(self.image_size),
            "--augment", self.augment,
            "--seed", str(self.seed),
        ]
        if self.workload_module:
            command += ["--workload-dir", self.workload_dir, "--workload-module", self.workload_module,
                        "--workload-packages", self.workload_packages]
        return command + (["--dispatcher"] if self.dispatcher else [])


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def die_with_parent(expected_parent: int) -> None:
    """Runs first in the child: SIGKILL it when the launcher that started it dies; exit at once if that
    launcher is already gone (the child was reparented before it could ask)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != expected_parent:
        print(f"the launcher (pid {expected_parent}) that started tf.data.service is gone; exiting", flush=True)
        os._exit(1)


def start_child(command: list[str], cwd: Path | str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a child process from a process that runs gRPC: no preexec_fn, so Python does not run the
    interpreter's (and gRPC's) at-fork handlers in the child; its output comes back through a pipe."""
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class TfDataService:
    """The tf.data.service child process, as the data host's batch source (server.BatchSource): the
    control server runs in the launcher, the batches flow from this child straight to the trainers."""

    def __init__(self, settings: TfServiceSettings, ready_timeout_s: float = 120.0) -> None:
        self.settings = settings
        self.ready_timeout_s = ready_timeout_s
        self.batches: queue.Queue = queue.Queue()  # never filled: batches do not pass through our server
        self.serves_batches = False  # so the control server does not report a count it cannot know
        self.skipped_samples = 0  # undecodable files are skipped inside the tf.data graph, uncounted
        self._process: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._refusal: str | None = None

    def start(self) -> None:
        self._process = start_child(
            self.settings.command(), cwd=self.settings.channel_dir, env=dict(os.environ) | {"PYTHONPATH": _code_root()}
        )
        self._relay_thread = threading.Thread(target=self._relay, name="tf-service-output", daemon=True)
        self._relay_thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(timeout=0.2):
            if self._process.poll() is not None:
                self._relay_thread.join(timeout=10)  # it ends at the pipe's end: every line read, the refusal's too
                if self._refusal:
                    raise TfServiceError(self._refusal)
                raise TfServiceError(f"tf.data.service exited with code {self._process.returncode} before it was ready")
            if time.monotonic() > deadline:
                self.stop()
                raise TfServiceError(f"tf.data.service was not ready within {self.ready_timeout_s:.0f} s")

    def _relay(self) -> None:
        """Pass the child's output on (so its pipe never fills) and notice when it is ready."""
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            sys.stdout.write(line)
            if line.rstrip().endswith(READY_LINE):
                self._ready.set()
            elif line.startswith(REFUSED_LINE):
                self._refusal = line[len(REFUSED_LINE):].rstrip()

    def begin(self, request: object, served: bool = False) -> None:
        """Nothing to fix: no stream of this server carries batches (tf.data.service's own does)."""

    @property
    def failure(self) -> str | None:
        if self._process is None or self._stopping:
            return None
        code = self._process.poll()
        return None if code is None else f"tf.data.service exited on its own with code {code}"

    def stop(self) -> None:
        self._stopping = True
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _code_root() -> str:
    return str(Path(__file__).resolve().parents[2])


# The child ------------------------------------------------------------------------------------------


def run_servers(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's INFO lines are noise here
    import tensorflow as tf

    from training.data_service.augmentation import AugmentConfig
    from training.data_service.dataset import scan_images
    from training.data_service.tf_pipeline import DATASET_ID, register, relative_samples

    service = tf.data.experimental.service
    dispatcher = None
    if args.dispatcher:
        dispatcher = service.DispatchServer(
            service.DispatcherConfig(port=port_of(args.dispatcher_address), worker_timeout_ms=WORKER_TIMEOUT_MS)
        )
        log.info("dispatcher listening on port %d", port_of(args.dispatcher_address))
    worker = service.WorkerServer(
        service.WorkerConfig(
            dispatcher_address=args.dispatcher_address,
            worker_address=args.worker_address,
            port=port_of(args.worker_address),
            heartbeat_interval_ms=WORKER_HEARTBEAT_MS,
        )
    )
    log.info("worker %s serving for dispatcher %s", args.worker_address, args.dispatcher_address)
    if dispatcher is not None and args.workload_module:
        register_workload(args)
    elif args.workload_module:
        # A worker-only host runs the graph alone, but the module's imports register the custom ops it may
        # use (tensorflow-text, tensorflow-io): import it, with its requirements, as the dispatcher host does.
        from training.workload.tf_contract import load_keras_workload

        load_keras_workload(Path(args.workload_dir), args.workload_module, Path(args.workload_packages) if args.workload_packages else None)
    elif dispatcher is not None:
        # The built-in, through the contract as a user's is (training/workloads/keras_vision.py's build_dataset).
        from training.data_service.tf_pipeline import batched, file_source
        from training.variants import BUILTIN_WORKLOADS_DIR, KERAS_BUILTIN
        from training.workload.tf_contract import KerasContext, build_elements, load_keras_workload

        folder = scan_images(Path.cwd(), "train", "data")
        paths, labels = relative_samples(folder)
        augment = AugmentConfig(image_size=args.image_size, augment=args.augment)
        ctx = KerasContext({"image_size": augment.image_size, "augment": augment.augment}, classes=folder.classes, num_samples=len(paths),
                           batch_size=args.batch_size, seed=args.seed)
        elements = build_elements(load_keras_workload(BUILTIN_WORKLOADS_DIR, KERAS_BUILTIN), file_source(paths, labels, args.seed), ctx)
        register(args.dispatcher_address, batched(elements, args.batch_size, prefetch=False))
        log.info("registered the augmentation pipeline (%d images, %d classes) as %r", len(paths), len(folder.classes), DATASET_ID)
    print(READY_LINE, flush=True)
    worker.join()


def register_workload(args: argparse.Namespace) -> None:
    """Build a user's dataset over this host's channel (the child's working directory) and register it,
    checked as tf_contract says; a refusal is printed as REFUSED_LINE and the child exits REFUSED_EXIT."""
    from training.data_service.dataset import ChannelError
    from training.data_service.tf_pipeline import DATASET_ID, batched, file_source, register, relative_samples
    from training.hyperparameters import HyperparameterError, load_hyperparameters, load_shutdown_token
    from training.trainers.config import KerasWorkloadConfig
    from training.workload.contract import WorkloadError
    from training.workload.host import split_settings
    from training.workload.tf_contract import (
        KerasContext,
        build_elements,
        file_pattern,
        list_channel_files,
        load_keras_workload,
        probe_elements,
    )

    try:
        code_dir = Path(args.workload_dir)
        workload = load_keras_workload(code_dir, args.workload_module, Path(args.workload_packages) if args.workload_packages else None)
        settings, config, hyperparameters = split_settings(load_hyperparameters(), workload, load_shutdown_token(), KerasWorkloadConfig)
        listing = list_channel_files(Path.cwd(), settings.data_channel, file_pattern(code_dir, args.workload_module))
        paths, labels = relative_samples(listing)
        ctx = KerasContext(dict(hyperparameters), classes=listing.classes, num_samples=len(listing), steps=config.steps,
                           batch_size=args.batch_size, seed=args.seed, learning_rate=config.learning_rate)
        probe_elements(workload, paths, labels, ctx)
        dataset = batched(build_elements(workload, file_source(paths, labels, args.seed), ctx), args.batch_size, prefetch=False)
    except (WorkloadError, HyperparameterError, ChannelError) as error:
        print(f"{REFUSED_LINE}{type(error).__name__}: {error}", flush=True)
        os._exit(REFUSED_EXIT)
    register(args.dispatcher_address, dataset)
    log.info("registered %s's dataset (%d files, %d classes) as %r", workload.name, len(paths), len(listing.classes), DATASET_ID)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent-pid", type=int, required=True, help="the launcher's pid: this process dies with it")
    parser.add_argument("--dispatcher-address", required=True)
    parser.add_argument("--worker-address", required=True)
    parser.add_argument("--dispatcher", action="store_true")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--image-size", type=int, required=True)
    parser.add_argument("--augment", default="standard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload-dir", default="")
    parser.add_argument("--workload-module", default="")
    parser.add_argument("--workload-packages", default="")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the servers hold no state worth a slow stop
    run_servers(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
