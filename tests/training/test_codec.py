"""codec: tensors on the wire, and the zero-copy Batch reader checked against protobuf's own parser."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from training.data_service import codec
from training.data_service import data_service_pb2 as pb

DTYPES = st.sampled_from(["uint8", "int64", "float32", "int16", "bool"])


def test_tensor_round_trip() -> None:
    array = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    assert np.array_equal(codec.decode(codec.encode(array)), array)


def test_malformed_tensors_are_refused() -> None:
    with pytest.raises(codec.TensorFormatError, match="do not make"):
        codec.decode(pb.Tensor(dtype="uint8", shape=[2, 2], data=b"abc"))
    with pytest.raises(codec.TensorFormatError, match="unknown dtype"):
        codec.decode(pb.Tensor(dtype="object", shape=[1], data=b"x"))
    with pytest.raises(codec.TensorFormatError, match="negative dimension"):
        codec.decode(pb.Tensor(dtype="uint8", shape=[-1], data=b""))
    with pytest.raises(codec.TensorFormatError, match="cannot be sent"):
        codec.encode(np.array(["a"], dtype=object))


@settings(max_examples=150, deadline=None)
@given(
    images=DTYPES.flatmap(lambda dtype: arrays(dtype, st.tuples(*[st.integers(0, 5)] * 4))),
    labels=arrays("int64", st.tuples(st.integers(0, 6))),
    skipped=st.integers(0, 2**32 - 1),
)
def test_batch_reader_agrees_with_protobuf(images: np.ndarray, labels: np.ndarray, skipped: int) -> None:
    payload = codec.encode_batch(images, labels, skipped)
    ours = codec.decode_batch(payload)
    theirs = pb.Batch.FromString(payload)
    assert ours.images.dtype == images.dtype and ours.images.shape == images.shape
    assert ours.images.tobytes() == codec.decode(theirs.images).tobytes() == images.tobytes()  # bitwise, NaNs too
    assert np.array_equal(ours.labels, labels)
    assert ours.skipped_samples == theirs.skipped_samples == skipped
    assert not ours.end_of_stream


@settings(max_examples=150, deadline=None)
@given(
    images=DTYPES.flatmap(lambda dtype: arrays(dtype, st.tuples(*[st.integers(0, 300)] * 2))),
    labels=arrays("int64", st.tuples(st.integers(0, 200)), elements=st.integers(-(2**63), 2**63 - 1)),
    skipped=st.integers(0, 2**32 - 1),
)
def test_our_batch_writer_writes_what_protobuf_writes(images: np.ndarray, labels: np.ndarray, skipped: int) -> None:
    """Byte for byte, for every dtype, empty tensors (proto3 leaves their data out), dimensions of one
    and of several varint bytes, non-contiguous arrays and every skipped count."""
    theirs = pb.Batch(images=codec.encode(images), labels=codec.encode(labels), skipped_samples=skipped).SerializeToString()
    assert codec.encode_batch(images, labels, skipped) == theirs
    assert codec.encode_batch(images.T, labels[::2]) == pb.Batch(images=codec.encode(images.T), labels=codec.encode(labels[::2])).SerializeToString()


def test_the_batch_writer_refuses_what_cannot_be_sent() -> None:
    with pytest.raises(codec.TensorFormatError, match="cannot be sent"):
        codec.encode_batch(np.array(["a"], dtype=object), np.zeros(1, dtype=np.int64))


def test_batch_reader_views_the_payload_without_copying() -> None:
    payload = codec.encode_batch(np.ones((4, 3, 8, 8), dtype=np.uint8), np.arange(4, dtype=np.int64))
    images = codec.decode_batch(payload).images
    assert images.base is not None and not images.flags.writeable  # a view on the received bytes


def test_end_of_stream_and_unknown_fields() -> None:
    decoded = codec.decode_batch(codec.end_of_stream("shutdown"))
    assert decoded.end_of_stream and decoded.end_reason == "shutdown" and decoded.images is None
    # A newer sender may add fields (here: 9 varint, 10 fixed64, 11 fixed32); readers skip them.
    extra = bytes([9 << 3 | 0, 5, 10 << 3 | 1]) + bytes(8) + bytes([11 << 3 | 5]) + bytes(4)
    decoded = codec.decode_batch(codec.encode_batch(np.zeros((1, 1), np.uint8), np.zeros(1, np.int64)) + extra)
    assert decoded.images.shape == (1, 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_is_refused_with_a_format_error_only(garbage: bytes) -> None:
    try:
        decoded = codec.decode_batch(garbage)
    except codec.TensorFormatError:
        return
    assert isinstance(decoded, codec.DecodedBatch)


@pytest.mark.parametrize("cut", [1, 5, 20, -3])
def test_truncated_batches_are_refused(cut: int) -> None:
    payload = codec.encode_batch(np.ones((2, 3, 4, 4), dtype=np.uint8), np.arange(2, dtype=np.int64))
    with pytest.raises(codec.TensorFormatError):
        codec.decode_batch(payload[:cut])


def test_the_batch_writer_keeps_values_shapes_and_its_field_range() -> None:
    """Values, not bytes: a big-endian array arrives with its values (the dtype name means little-endian
    to the reader); a 0-d array keeps its shape; a count past uint32 is refused, as protobuf refuses it."""
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    decoded = codec.decode_batch(codec.encode_batch(big_endian, np.array(7, dtype=np.int64)))
    assert np.array_equal(decoded.images, big_endian) and decoded.labels.shape == () and int(decoded.labels) == 7
    with pytest.raises(codec.TensorFormatError, match="uint32"):
        codec.encode_batch(np.zeros(1, dtype=np.uint8), np.zeros(1, dtype=np.int64), 2**32)
    with pytest.raises(ValueError):  # protobuf's own refusal of the same count
        pb.Batch(skipped_samples=2**32)


@settings(max_examples=150, deadline=None)
@given(
    sample_ids=st.lists(st.integers(0, 2**64 - 1), max_size=40),
    epochs=st.lists(st.integers(0, 2**32 - 1), max_size=40),
)
def test_each_slots_sample_and_epoch_travel_as_protobuf_writes_and_reads_them(sample_ids: list[int], epochs: list[int]) -> None:
    images, labels = np.zeros((2, 3), np.uint8), np.arange(2, dtype=np.int64)
    ours = codec.encode_batch(images, labels, 0, np.array(sample_ids, dtype=np.uint64), np.array(epochs, dtype=np.uint32))
    theirs = pb.Batch(images=codec.encode(images), labels=codec.encode(labels), sample_ids=sample_ids, epochs=epochs)
    assert ours == theirs.SerializeToString()
    decoded = codec.decode_batch(ours)
    assert decoded.sample_ids.tolist() == list(pb.Batch.FromString(ours).sample_ids) == sample_ids
    assert decoded.epochs.tolist() == epochs
    # Unpacked, one value per field, as another encoder may write repeated scalars: read the same.
    unpacked = b"".join(bytes([7 << 3 | 1]) + value.to_bytes(8, "little") for value in sample_ids)
    unpacked += b"".join(bytes([8 << 3 | 5]) + value.to_bytes(4, "little") for value in epochs)
    both = codec.decode_batch(ours + unpacked)
    assert both.sample_ids.tolist() == list(pb.Batch.FromString(ours + unpacked).sample_ids) == sample_ids * 2
    assert both.epochs.tolist() == epochs * 2


def test_tags_that_do_not_fit_or_do_not_make_whole_values_are_refused() -> None:
    images, labels = np.zeros((2, 3), np.uint8), np.arange(2, dtype=np.int64)
    with pytest.raises(codec.TensorFormatError, match="field 8"):
        codec.encode_batch(images, labels, 0, [1], [2**32])
    with pytest.raises(codec.TensorFormatError, match="field 7"):
        codec.encode_batch(images, labels, 0, [-1], [0])
    cut = codec.encode_batch(images, labels) + bytes([7 << 3 | 2, 5]) + bytes(5)  # 5 bytes: not a whole fixed64
    with pytest.raises(codec.TensorFormatError, match="whole number"):
        codec.decode_batch(cut)


# A peer's batch is checked before it reaches training -------------------------------------------------


def _batch_bytes(images: pb.Tensor, labels: pb.Tensor, **fields) -> bytes:
    """A Batch as protobuf writes it: shapes and counts that our writer would never make."""
    return pb.Batch(images=images, labels=labels, **fields).SerializeToString()


LABELS = pb.Tensor(dtype="int64", shape=[2], data=np.arange(2, dtype=np.int64).tobytes())


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([2**62, 4], "exceeds"),  # numpy's int64 product of these is 0: no bytes seemed to match
        ([2**32, 2**32, 0], "exceeds"),
        ([2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1, 0], "other dimensions no array can have"),
        ([1] * 33, "dimensions"),  # more than numpy holds
        ([-3, -4], "negative dimension"),
    ],
)
def test_shapes_that_overflow_or_no_array_can_have_are_refused_by_name(shape: list[int], message: str) -> None:
    """Every one of these raised ValueError or numpy's own error from reshape: uncaught, it ended the
    stream's thread silently and training reported that its input had ended."""
    payload = _batch_bytes(pb.Tensor(dtype="uint8", shape=shape), LABELS)
    with pytest.raises(codec.TensorFormatError, match=message):
        codec.decode_batch(payload)


def test_an_empty_tensor_with_large_dimensions_still_reads() -> None:
    decoded = codec.decode_batch(_batch_bytes(pb.Tensor(dtype="uint8", shape=[0, 2**31 - 1]), LABELS))
    assert decoded.images.shape == (0, 2**31 - 1)


SPEC = codec.BatchSpec(batch_size=2, sample_shape=(3, 4, 4), num_classes=5)
IMAGES = np.zeros((2, 3, 4, 4), np.uint8)


def _good(**changes) -> bytes:
    fields = dict(images=IMAGES, labels=np.array([0, 4], np.int64), skipped_samples=1, sample_ids=[7, 8, 9], epochs=[0, 0, 0])
    fields.update(changes)
    return codec.encode_batch(fields["images"], fields["labels"], fields["skipped_samples"], fields["sample_ids"], fields["epochs"])


def test_a_batch_of_the_spec_passes_with_or_without_slot_tags() -> None:
    codec.check_batch(codec.decode_batch(_good()), SPEC)
    codec.check_batch(codec.decode_batch(_good(sample_ids=[], epochs=[])), SPEC)
    codec.check_batch(codec.decode_batch(_good(labels=np.array([9, 1], np.int64))), codec.BatchSpec(2, (3, 4, 4)))  # classes unknown


@pytest.mark.parametrize(
    ("payload", "expected", "seen"),
    [
        (_good(images=IMAGES.astype(np.float32)), "images of uint8 [2, 3, 4, 4]", "float32 [2, 3, 4, 4]"),
        (_good(images=IMAGES[0]), "images of uint8 [2, 3, 4, 4]", "uint8 [3, 4, 4]"),  # wrong rank
        (_good(images=IMAGES.transpose(0, 2, 3, 1).copy()), "images of uint8 [2, 3, 4, 4]", "uint8 [2, 4, 4, 3]"),  # NHWC
        (_good(images=np.zeros((3, 3, 4, 4), np.uint8)), "images of uint8 [2, 3, 4, 4]", "uint8 [3, 3, 4, 4]"),
        (_good(labels=np.array([[0, 1]], np.int64)), "labels of int64 [2]", "int64 [1, 2]"),
        (_good(labels=np.array([0], np.int64)), "labels of int64 [2]", "int64 [1]"),  # a count that is not the images'
        (_good(labels=np.array([0, 1], np.int32)), "labels of int64 [2]", "int32 [2]"),
        (_good(labels=np.array([0, 5], np.int64)), "labels in [0, 5)", "labels in [0, 5]"),
        (_good(labels=np.array([-1, 2], np.int64)), "labels in [0, 5)", "labels in [-1, 2]"),
        (_good(sample_ids=[1, 2, 3], epochs=[0, 0]), "as many epochs as sample ids", "3 sample ids and 2 epochs"),
        (_good(sample_ids=[1], epochs=[0]), "2 slot tags", "1"),
        (_good(sample_ids=[1, 2, 3, 4], epochs=[0, 0, 0, 0]), "plus at most the 1 skipped", "4"),
        (pb.Batch(images=codec.encode(IMAGES)).SerializeToString(), "a batch with images and labels", "images only"),
    ],
)
def test_a_batch_that_is_not_the_one_asked_for_is_refused_saying_what_was_expected_and_seen(payload: bytes, expected: str, seen: str) -> None:
    with pytest.raises(codec.MalformedBatchError) as refused:
        codec.check_batch(codec.decode_batch(payload), SPEC)
    assert expected in refused.value.expected and refused.value.seen.endswith(seen), str(refused.value)


def test_a_skipped_count_past_uint32_is_refused() -> None:
    payload = codec.encode_batch(IMAGES, np.zeros(2, np.int64)) + bytes([4 << 3]) + codec._varint_bytes(2**40)
    with pytest.raises(codec.MalformedBatchError, match="uint32"):
        codec.check_batch(codec.decode_batch(payload), SPEC)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_a_batch_with_any_bytes_changed_is_refused_with_a_format_error_or_is_one_of_the_spec(data: st.DataObject) -> None:
    """Whatever a peer changes in a good batch (a shape's varint, a length, a dtype name, a label), the
    reader and the check raise TensorFormatError (MalformedBatchError is one) or pass a batch of the spec."""
    payload = bytearray(_good())
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    try:
        batch = codec.decode_batch(bytes(payload))
        codec.check_batch(batch, SPEC)
    except codec.TensorFormatError:
        return
    assert batch.images.shape == SPEC.image_shape and batch.labels.shape == (2,) and 0 <= batch.labels.min() <= batch.labels.max() < 5
