"""A workload's batches of named features (here a tokenising workload's), from real data-host servers on
loopback to the trainer's client: what a host describes, what the trainer checks, and what it yields
(dicts of tensors)."""

from __future__ import annotations

import contextlib
import itertools
import queue
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import TOKEN
from training.data_service import codec
from training.data_service import data_service_pb2 as pb
from training.data_service.client import DataServiceDataset, stream_options, stream_spec
from training.data_service.control import DataServiceRefusedError, DataServiceUnavailableError, describe
from training.data_service.dataset import ImageDataset
from training.data_service.server import ReadyBatch, ServerSettings, StopReason, put_until_stopped, serve
from training.local.cluster import free_port

BATCH = 4
TEXT = (codec.FeatureSpec("input_ids", "int32", (128,)), codec.FeatureSpec("attention_mask", "int8", (128,)), codec.FeatureSpec("label", "int64"))
_addresses = itertools.count(2)


def text_batch(step: int, *, dtype: str = "int32") -> bytes:
    """Batch ``step`` of a tokenising workload: tagged as samples BATCH*step.. of epoch 0."""
    ids = np.arange(BATCH * 128, dtype=dtype).reshape(BATCH, 128) + step
    features = {"input_ids": ids, "attention_mask": np.ones((BATCH, 128), np.int8), "label": np.arange(BATCH, dtype=np.int64) % 2}
    return codec.encode_features(features, 0, np.arange(BATCH * step, BATCH * (step + 1), dtype=np.uint64), np.zeros(BATCH, np.uint32))


class Payloads:
    """A BatchSource (server.BatchSource) that serves ``make(step)`` for step 0, 1, 2, ..."""

    def __init__(self, make) -> None:
        self.batches: queue.Queue = queue.Queue(maxsize=2)
        self.failure, self.serves_batches, self._stop = None, True, threading.Event()
        self._make = make

    def start(self) -> None:
        threading.Thread(target=self._fill, daemon=True).start()

    def begin(self, request: object, served: bool = False) -> None:
        """Serves the same from any position."""

    def _fill(self) -> None:
        for step in itertools.count():
            if not put_until_stopped(self.batches, ReadyBatch(self._make(step)), self._stop):
                return

    def stop(self) -> None:
        self._stop.set()


@contextlib.contextmanager
def feature_host(make, features: tuple[codec.FeatureSpec, ...] = TEXT) -> Iterator[str]:
    """A real data host (server.serve) whose Describe announces ``features`` and whose batches are ``make(step)``."""
    settings = ServerSettings(host=f"features-{next(_addresses)}", bind_address=f"127.0.81.{next(_addresses)}", port=free_port(), channel="train",
                              batch_size=BATCH, shutdown_token=TOKEN, idle_timeout_s=30, start_deadline_s=30,
                              workers=1, stop_grace_s=0, features=features)
    folder = ImageDataset(Path("."), (), (("unused", 0),))
    stop, result = threading.Event(), {}
    thread = threading.Thread(target=lambda: result.setdefault("reason", serve(settings, folder, stop, source=Payloads(make))), daemon=True)
    thread.start()
    try:
        yield f"{settings.bind_address}:{settings.port}"
    finally:
        stop.set()
        thread.join(20)
    assert result.get("reason") == StopReason.SIGNAL


def take_until(iterator: Iterator, done, timeout_s: float = 30.0) -> list:
    taken, deadline = [], time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        taken.append(next(iterator))
    return taken


# What a host describes ---------------------------------------------------------------------------------


def _info(*features: pb.FeatureSpec, **fields) -> pb.DatasetInfo:
    return pb.DatasetInfo(host="algo-2", features=list(features), **fields)


def test_a_host_describing_features_gets_a_spec_of_those_features() -> None:
    info = _info(*(pb.FeatureSpec(name=f.name, dtype=f.dtype, shape=list(f.shape)) for f in TEXT), sample_shape=[3, 32, 32], classes=["a"])
    spec = stream_spec(8, info)
    assert spec.features == TEXT and spec.batch_size == 8
    assert spec.max_message_bytes >= 8 * 128 * (4 + 1) + 8 * 8
    assert ("grpc.max_receive_message_length", spec.max_message_bytes) in stream_options(spec.max_message_bytes)


@pytest.mark.parametrize(
    ("features", "batch_size", "message"),
    [
        ([pb.FeatureSpec(name="input_ids", dtype="int32", shape=[0])], 8, "feature 'input_ids' of sample shape [0]"),
        ([pb.FeatureSpec(name="image", dtype="uint8", shape=[3, -1, 32])], 8, "feature 'image': negative dimension"),
        ([pb.FeatureSpec(name="input-ids", dtype="int32", shape=[128])], 8, "feature name 'input-ids' is not"),
        ([pb.FeatureSpec(name="x" * 65, dtype="int32")], 8, "is not 1 to 64"),
        ([pb.FeatureSpec(name="ids", dtype="object", shape=[128])], 8, "feature 'ids': dtype 'object' cannot be sent"),
        ([pb.FeatureSpec(name="ids", dtype="int32"), pb.FeatureSpec(name="ids", dtype="int64")], 8, "'ids' is named more than once"),
        ([pb.FeatureSpec(name="label", dtype="int64"), pb.FeatureSpec(name="image", dtype="float32", shape=[3, 512, 512])], 1024,
         "more than one gRPC message can carry (2 GiB); feature 'image' (float32 [3, 512, 512] a sample) takes 3.0 GiB"),
        ([pb.FeatureSpec(name="label", dtype="int64")], 0, "batches of 0 samples"),
    ],
)
def test_a_description_no_batch_can_follow_is_refused_naming_the_feature(features: list, batch_size: int, message: str) -> None:
    with pytest.raises(DataServiceRefusedError, match=re.escape(message)):
        stream_spec(batch_size, _info(*features))


# What the trainer gets ------------------------------------------------------------------------------


def test_a_stream_of_feature_batches_reaches_the_trainer_as_dicts_of_tensors_counted_in_its_epochs() -> None:
    with feature_host(text_batch) as target:
        info = describe([target], TOKEN, timeout_s=10)
        assert [codec.FeatureSpec(f.name, f.dtype, tuple(f.shape)) for f in info.features] == list(TEXT)  # the server's hook
        dataset = DataServiceDataset([target], BATCH, TOKEN, "test")
        assert dataset.features is None  # not described yet
        batches = list(itertools.islice(iter(dataset), 5))
    assert dataset.features == TEXT
    for step, batch in enumerate(batches):
        assert isinstance(batch, dict) and list(batch) == ["input_ids", "attention_mask", "label"]
        assert batch["input_ids"].dtype == torch.int32 and tuple(batch["input_ids"].shape) == (BATCH, 128)
        assert batch["attention_mask"].dtype == torch.int8 and tuple(batch["attention_mask"].shape) == (BATCH, 128)
        assert batch["label"].dtype == torch.int64 and tuple(batch["label"].shape) == (BATCH,)  # a scalar per sample
        assert int(batch["input_ids"][0, 0]) == step and batch["label"].tolist() == [0, 1, 0, 1]
    # Yielded is not trained: the ledger counts what the trainer marks, by the host's name.
    assert dataset.stats.ledger.as_dict()["epochs"] == {}
    dataset.mark_trained(5)
    receipts = dataset.stats.ledger.as_dict()
    assert receipts["epochs"][info.host][0][0] == 5 * BATCH and receipts["untagged_batches"] == 0
    with pytest.raises(RuntimeError, match="no batch yielded"):
        dataset.mark_trained()
    assert dataset.stats.lost_hosts == [] and dataset.stats.hosts[target].batches >= 5


def test_a_trainer_that_names_its_features_takes_them_in_its_own_order() -> None:
    ordered = (TEXT[2], TEXT[0], TEXT[1])
    with feature_host(text_batch) as target:
        batch = next(iter(DataServiceDataset([target], BATCH, TOKEN, "test", features=ordered)))
    assert list(batch) == ["label", "input_ids", "attention_mask"]


def test_a_host_sending_a_wrong_feature_dtype_is_dropped_by_name_while_another_hosts_batches_go_on() -> None:
    def bad(step: int) -> bytes:  # one good batch first: trained on, as it should be
        return text_batch(step, dtype="int32" if step == 0 else "float32")  # as many bytes: within the receive limit

    with feature_host(bad) as faulty, feature_host(text_batch) as healthy:
        dataset = DataServiceDataset([faulty, healthy], BATCH, TOKEN, "test")
        iterator = iter(dataset)
        take_until(iterator, lambda: dataset.stats.lost_hosts and dataset.stats.hosts[healthy].batches)
        assert dataset.stats.lost_hosts == [faulty] and dataset.stats.hosts[faulty].batches == 1
        assert dataset.stats.lost_reasons[faulty] == "MalformedBatchError: expected feature 'input_ids' of int32 [4, 128], got float32 [4, 128]"
        assert faulty in dataset.stats.unavailable_hosts
        later = list(itertools.islice(iterator, 10))
    assert len(later) == 10 and all(batch["input_ids"].dtype == torch.int32 for batch in later)


def test_a_host_that_describes_other_batches_than_the_others_is_refused_by_name() -> None:
    image_features = (codec.FeatureSpec("image", "uint8", (3, 8, 8)), codec.FeatureSpec("label", "int64"))

    def images(step: int) -> bytes:
        return codec.encode_features({"image": np.zeros((BATCH, 3, 8, 8), np.uint8), "label": np.zeros(BATCH, np.int64)})

    with feature_host(images, image_features) as other, feature_host(text_batch) as healthy:
        dataset = DataServiceDataset([other, healthy], BATCH, TOKEN, "test", features=TEXT)
        iterator = iter(dataset)
        take_until(iterator, lambda: dataset.stats.lost_hosts and dataset.stats.hosts[healthy].batches)
        assert dataset.stats.lost_hosts == [other] and dataset.stats.hosts[other].batches == 0
        reason = dataset.stats.lost_reasons[other]
        assert reason.startswith("refused: data host features-") and "describes features 'image' uint8 [3, 8, 8], 'label' int64 []" in reason
        assert "this trainer reads features 'input_ids' int32 [128]" in reason
        assert all(list(batch) == ["input_ids", "attention_mask", "label"] for batch in itertools.islice(iterator, 5))


@pytest.mark.parametrize(
    ("make", "seen"),
    [
        (lambda step: codec.encode_features({"input_ids": np.zeros((BATCH, 128), np.int32), "label": np.zeros(BATCH, np.int64)}),
         "got no feature 'attention_mask'"),
        # More bytes than the batch it described: gRPC does not read it (the stream's receive limit).
        (lambda step: codec.encode_features({"input_ids": np.zeros((BATCH, 4096), np.int32)}), "larger than max"),
    ],
)
def test_a_host_sending_other_features_than_it_described_is_lost_by_name(make, seen: str) -> None:
    with feature_host(make) as target:
        dataset = DataServiceDataset([target], BATCH, TOKEN, "test")
        with pytest.raises(DataServiceUnavailableError, match=f"all 1 data hosts are gone .*MalformedBatchError: expected .*{re.escape(seen)}"):
            next(iter(dataset))
    assert dataset.stats.lost_hosts == [target]


def test_a_host_that_describes_no_features_is_refused_by_name() -> None:
    """A tf.data.service host's control server (its batches go through tf.data.service), or an earlier
    release's image host: nothing this trainer could read comes from it."""
    with feature_host(text_batch, features=()) as target:
        with pytest.raises(DataServiceRefusedError, match="describes no features: it streams no batches this trainer reads"):
            next(iter(DataServiceDataset([target], BATCH, TOKEN, "test")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_a_cuda_trainers_feature_tensors_are_pinned() -> None:
    with feature_host(text_batch) as target:
        batch = next(iter(DataServiceDataset([target], BATCH, TOKEN, "test", pin_memory=True)))
    assert all(tensor.is_pinned() for tensor in batch.values())
