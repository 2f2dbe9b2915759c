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


@st.composite
def image_batches(draw: st.DrawFn, max_side: int = 5, rank: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """The vision workload's two features at any dtype and size (0 included): an "image" of ``rank``
    dimensions, and an int64 "label" per sample at any value."""
    images = draw(DTYPES.flatmap(lambda dtype: arrays(dtype, st.tuples(*[st.integers(0, max_side)] * rank))))
    labels = draw(arrays("int64", (images.shape[0],), elements=st.integers(-(2**63), 2**63 - 1)))
    return images, labels


def _vision(images: np.ndarray, labels: np.ndarray, **fields) -> bytes:
    """The batch as protobuf's own writer serialises it."""
    features = [pb.Feature(name="image", tensor=codec.encode(images)), pb.Feature(name="label", tensor=codec.encode(labels))]
    return pb.Batch(features=features, **fields).SerializeToString()


@settings(max_examples=150, deadline=None)
@given(batch=image_batches(), skipped=st.integers(0, 2**32 - 1))
def test_batch_reader_agrees_with_protobuf(batch: tuple[np.ndarray, np.ndarray], skipped: int) -> None:
    images, labels = batch
    payload = codec.encode_features({"image": images, "label": labels}, skipped)
    ours = codec.decode_batch(payload)
    theirs = pb.Batch.FromString(payload)
    image = ours.features["image"]
    assert image.dtype == images.dtype and image.shape == images.shape
    assert image.tobytes() == codec.decode(theirs.features[0].tensor).tobytes() == images.tobytes()  # bitwise, NaNs too
    assert np.array_equal(ours.features["label"], labels) and np.array_equal(codec.decode(theirs.features[1].tensor), labels)
    assert ours.skipped_samples == theirs.skipped_samples == skipped
    assert not ours.end_of_stream


@settings(max_examples=150, deadline=None)
@given(batch=image_batches(max_side=300, rank=2), skipped=st.integers(0, 2**32 - 1))
def test_our_batch_writer_writes_what_protobuf_writes(batch: tuple[np.ndarray, np.ndarray], skipped: int) -> None:
    """Byte for byte, for every dtype, empty tensors (proto3 leaves their data out), dimensions of one
    and of several varint bytes, non-contiguous arrays and every skipped count."""
    images, labels = batch
    assert codec.encode_features({"image": images, "label": labels}, skipped) == _vision(images, labels, skipped_samples=skipped)
    strided, every_other = images[::2, ::-1], labels[::2]
    assert codec.encode_features({"image": strided, "label": every_other}) == _vision(strided, every_other)


def test_end_of_stream_and_unknown_fields() -> None:
    decoded = codec.decode_batch(codec.end_of_stream("shutdown"))
    assert decoded.end_of_stream and decoded.end_reason == "shutdown" and decoded.features == {}
    # A newer sender may add fields (here: 10 varint, 11 fixed64, 12 fixed32); readers skip them, and the
    # reserved 2 and 3 (the images and labels of earlier releases' image batches) too.
    extra = bytes([10 << 3 | 0, 5, 11 << 3 | 1]) + bytes(8) + bytes([12 << 3 | 5]) + bytes(4) + image_batch_of_earlier_releases()
    decoded = codec.decode_batch(codec.encode_features({"label": np.zeros(1, np.int64)}) + extra)
    assert list(decoded.features) == ["label"] and decoded.features["label"].shape == (1,)


def image_batch_of_earlier_releases(images: np.ndarray | None = None, labels: np.ndarray | None = None) -> bytes:
    """A Batch of the image format this release no longer reads: Tensor fields 2 (images) and 3 (labels)."""
    images = np.zeros((2, 3, 4, 4), np.uint8) if images is None else images
    labels = np.zeros(len(images), np.int64) if labels is None else labels
    return b"".join([*codec._length_delimited(2, codec._tensor_parts(images)), *codec._length_delimited(3, codec._tensor_parts(labels))])


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
    payload = codec.encode_features({"image": np.ones((2, 3, 4, 4), dtype=np.uint8), "label": np.arange(2, dtype=np.int64)})
    with pytest.raises(codec.TensorFormatError):
        codec.decode_batch(payload[:cut])


def test_the_batch_writer_keeps_values_shapes_and_its_field_range() -> None:
    """Values, not bytes: a big-endian array arrives with its values (the dtype name means little-endian
    to the reader); a count past uint32 is refused, as protobuf refuses it."""
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    decoded = codec.decode_batch(codec.encode_features({"ids": big_endian, "label": np.array([7, 8], dtype=">i8")}))
    assert np.array_equal(decoded.features["ids"], big_endian) and decoded.features["label"].tolist() == [7, 8]
    with pytest.raises(codec.TensorFormatError, match="uint32"):
        codec.encode_features({"label": np.zeros(1, dtype=np.int64)}, 2**32)
    with pytest.raises(ValueError):  # protobuf's own refusal of the same count
        pb.Batch(skipped_samples=2**32)


@settings(max_examples=150, deadline=None)
@given(
    sample_ids=st.lists(st.integers(0, 2**64 - 1), max_size=40),
    epochs=st.lists(st.integers(0, 2**32 - 1), max_size=40),
)
def test_each_slots_sample_and_epoch_travel_as_protobuf_writes_and_reads_them(sample_ids: list[int], epochs: list[int]) -> None:
    images, labels = np.zeros((2, 3), np.uint8), np.arange(2, dtype=np.int64)
    ours = codec.encode_features({"image": images, "label": labels}, 0, np.array(sample_ids, dtype=np.uint64), np.array(epochs, dtype=np.uint32))
    assert ours == _vision(images, labels, sample_ids=sample_ids, epochs=epochs)
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
    features = {"image": np.zeros((2, 3), np.uint8), "label": np.arange(2, dtype=np.int64)}
    with pytest.raises(codec.TensorFormatError, match="field 8"):
        codec.encode_features(features, 0, [1], [2**32])
    with pytest.raises(codec.TensorFormatError, match="field 7"):
        codec.encode_features(features, 0, [-1], [0])
    cut = codec.encode_features(features) + bytes([7 << 3 | 2, 5]) + bytes(5)  # 5 bytes: not a whole fixed64
    with pytest.raises(codec.TensorFormatError, match="whole number"):
        codec.decode_batch(cut)


# A peer's batch is checked before it reaches training -------------------------------------------------


def _batch_bytes(image: pb.Tensor) -> bytes:
    """A Batch as protobuf writes it: shapes and counts that our writer would never make."""
    label = pb.Tensor(dtype="int64", shape=[2], data=np.arange(2, dtype=np.int64).tobytes())
    return pb.Batch(features=[pb.Feature(name="image", tensor=image), pb.Feature(name="label", tensor=label)]).SerializeToString()


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
    payload = _batch_bytes(pb.Tensor(dtype="uint8", shape=shape))
    with pytest.raises(codec.TensorFormatError, match=f"feature 'image': .*{message}"):
        codec.decode_batch(payload)


def test_an_empty_tensor_with_large_dimensions_still_reads() -> None:
    decoded = codec.decode_batch(_batch_bytes(pb.Tensor(dtype="uint8", shape=[0, 2**31 - 1])))
    assert decoded.features["image"].shape == (0, 2**31 - 1)


# Named features of any dtype and shape, as a user's workload makes them --------------------------------------------------------------

FEATURE_DTYPES = st.sampled_from(sorted(codec.ALLOWED_DTYPES))
NAMES = st.from_regex(r"[A-Za-z0-9_]{1,64}", fullmatch=True)


@st.composite
def feature_batches(draw: st.DrawFn) -> dict[str, np.ndarray]:
    """1 to 4 features of one batch size (0 included), each of any allowed dtype and sample shape (a scalar
    per sample included), some of them non-contiguous."""
    batch = draw(st.integers(0, 6))
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    features = {}
    for name in names:
        sample = draw(st.lists(st.integers(0, 5), max_size=3))
        array = draw(arrays(draw(FEATURE_DTYPES), (batch, *sample)))
        features[name] = array[:, ::-1] if array.ndim > 1 and draw(st.booleans()) else array
    return features


def _protobuf_features(features: dict[str, np.ndarray], **fields) -> bytes:
    return pb.Batch(features=[pb.Feature(name=name, tensor=codec.encode(array)) for name, array in features.items()], **fields).SerializeToString()


@settings(max_examples=200, deadline=None)
@given(
    features=feature_batches(),
    skipped=st.integers(0, 2**32 - 1),
    sample_ids=st.lists(st.integers(0, 2**64 - 1), max_size=8),
    epochs=st.lists(st.integers(0, 2**32 - 1), max_size=8),
)
def test_our_feature_writer_writes_what_protobuf_writes_and_both_readers_agree(
    features: dict[str, np.ndarray], skipped: int, sample_ids: list[int], epochs: list[int]
) -> None:
    """Byte for byte, every allowed dtype, scalar-per-sample features, empty batches (proto3 leaves their
    data out), non-contiguous arrays; protobuf's parser and decode_batch read the same features back."""
    ours = codec.encode_features(features, skipped, np.array(sample_ids, dtype=np.uint64), np.array(epochs, dtype=np.uint32))
    assert ours == _protobuf_features(features, skipped_samples=skipped, sample_ids=sample_ids, epochs=epochs)
    decoded, theirs = codec.decode_batch(ours), pb.Batch.FromString(ours)
    assert list(decoded.features) == [feature.name for feature in theirs.features] == list(features)  # the mapping's order
    for feature in theirs.features:
        sent, read = features[feature.name], decoded.features[feature.name]
        assert read.dtype == sent.dtype and read.shape == sent.shape == codec.decode(feature.tensor).shape
        assert read.tobytes() == codec.decode(feature.tensor).tobytes() == sent.tobytes()  # bitwise, NaNs too
    assert not decoded.end_of_stream
    assert decoded.skipped_samples == skipped and decoded.sample_ids.tolist() == sample_ids and decoded.epochs.tolist() == epochs


def test_features_round_trip_with_their_values_dtypes_and_per_sample_shapes() -> None:
    features = {
        "image": np.arange(4 * 3 * 8 * 8, dtype=np.uint8).reshape(4, 3, 8, 8),
        "input_ids": np.arange(4 * 16, dtype=np.int32).reshape(4, 16),
        "attention_mask": np.ones((4, 16), np.int8),
        "weight": np.linspace(0, 1, 4).astype(np.float16),
        "keep": np.array([True, False, True, True]),
        "label": np.array([3, 0, 2, 1], np.int64),  # a scalar per sample: [batch]
    }
    decoded = codec.decode_batch(codec.encode_features(features, 1, [5, 6, 7, 8, 9], [0, 0, 1, 1, 1]))
    assert list(decoded.features) == list(features)
    for name, array in features.items():
        assert decoded.features[name].dtype == array.dtype and np.array_equal(decoded.features[name], array), name
    empty = codec.decode_batch(codec.encode_features({"label": np.zeros(0, np.int64), "tokens": np.zeros((0, 128), np.int32)}))
    assert empty.features["label"].shape == (0,) and empty.features["tokens"].shape == (0, 128)
    codec.check_batch(empty, codec.BatchSpec(0, features=(codec.FeatureSpec("label", "int64"), codec.FeatureSpec("tokens", "int32", (128,)))))


def test_features_are_views_on_the_payload_without_copying() -> None:
    payload = codec.encode_features({"image": np.ones((4, 3, 8, 8), np.uint8), "label": np.arange(4, dtype=np.int64)})
    for array in codec.decode_batch(payload).features.values():
        assert array.base is not None and not array.flags.writeable


@pytest.mark.parametrize(
    ("features", "message"),
    [
        ({}, "at least one feature"),
        ({"": np.zeros(2, np.int64)}, "feature name ''"),
        ({"input-ids": np.zeros(2, np.int64)}, "feature name 'input-ids'"),
        ({"x" * 65: np.zeros(2, np.int64)}, "is not 1 to 64"),
        ({"é": np.zeros(2, np.int64)}, "feature name 'é'"),
        ({"text": np.array(["a", "b"], dtype=object)}, "feature 'text': dtype object cannot be sent"),
        ({"ids": np.zeros(2, np.uint16)}, "feature 'ids': dtype uint16 cannot be sent"),
        ({"label": np.array(3, np.int64)}, "0-d array"),
        ({"image": np.zeros((2, 3), np.uint8), "label": np.zeros(3, np.int64)}, "different batch sizes"),
    ],
)
def test_the_feature_writer_refuses_what_cannot_be_sent(features: dict, message: str) -> None:
    with pytest.raises(codec.TensorFormatError, match=message):
        codec.encode_features(features)


def _feature(name: str, tensor: pb.Tensor | None) -> pb.Feature:
    return pb.Feature(name=name) if tensor is None else pb.Feature(name=name, tensor=tensor)


@pytest.mark.parametrize(
    ("features", "message"),
    [
        ([_feature("ids", codec.encode(np.zeros(2, np.int64)))] * 2, "feature 'ids' comes twice"),
        ([_feature("ids", pb.Tensor(dtype="object", shape=[2], data=b"ab"))], "feature 'ids': unknown dtype 'object'"),
        ([_feature("ids", pb.Tensor(dtype="int64", shape=[2], data=b"abc"))], "feature 'ids': 3 bytes do not make"),
        ([_feature("ids", None)], "feature 'ids' has no tensor"),
    ],
)
def test_the_reader_refuses_features_named_twice_of_unknown_dtype_or_that_do_not_read(features: list, message: str) -> None:
    with pytest.raises(codec.TensorFormatError, match=message):
        codec.decode_batch(pb.Batch(features=features).SerializeToString())


def test_a_feature_with_two_tensors_or_cut_short_is_refused() -> None:
    tensor = codec.encode(np.zeros(2, np.int64)).SerializeToString()
    inner = b"\x0a\x03ids" + b"\x12" + codec._varint_bytes(len(tensor)) + tensor
    twice = inner + b"\x12" + codec._varint_bytes(len(tensor)) + tensor
    with pytest.raises(codec.TensorFormatError, match="two tensors"):
        codec.decode_batch(b"\x4a" + codec._varint_bytes(len(twice)) + twice)
    payload = codec.encode_features({"ids": np.zeros(2, np.int64)})
    for cut in (1, 3, len(payload) - 2):
        with pytest.raises(codec.TensorFormatError):
            codec.decode_batch(payload[:cut])


FEATURES = (codec.FeatureSpec("image", "uint8", (3, 4, 4)), codec.FeatureSpec("label", "int64"))
FEATURE_SPEC = codec.BatchSpec(batch_size=2, features=FEATURES)


def _good_features(**changes) -> bytes:
    features = {"image": np.zeros((2, 3, 4, 4), np.uint8), "label": np.array([0, 9], np.int64)}
    tags = dict(skipped_samples=1, sample_ids=[7, 8, 9], epochs=[0, 0, 0])
    for name, value in changes.items():
        if name in tags:
            tags[name] = value
        elif value is None:
            features.pop(name)
        else:
            features[name] = value
    return codec.encode_features(features, tags["skipped_samples"], tags["sample_ids"], tags["epochs"])


def test_a_batch_of_the_features_described_passes_with_or_without_slot_tags_in_any_order() -> None:
    codec.check_batch(codec.decode_batch(_good_features()), FEATURE_SPEC)
    codec.check_batch(codec.decode_batch(_good_features(sample_ids=[], epochs=[])), FEATURE_SPEC)
    reordered = codec.encode_features({"label": np.zeros(2, np.int64), "image": np.zeros((2, 3, 4, 4), np.uint8)})
    codec.check_batch(codec.decode_batch(reordered), FEATURE_SPEC)


FEATURES_ONLY = "a batch of features ['image', 'label'] only"


@pytest.mark.parametrize(
    ("payload", "expected", "seen"),
    [
        (_good_features(image=np.zeros((2, 3, 4, 4), np.float32)), "feature 'image' of uint8 [2, 3, 4, 4]", "float32 [2, 3, 4, 4]"),
        (_good_features(image=np.zeros((2, 4, 4, 3), np.uint8)), "feature 'image' of uint8 [2, 3, 4, 4]", "uint8 [2, 4, 4, 3]"),
        (_good_features(image=np.zeros((2, 48), np.uint8)), "feature 'image' of uint8 [2, 3, 4, 4]", "uint8 [2, 48]"),  # another rank
        (_good_features(image=np.zeros((3, 3, 4, 4), np.uint8), label=np.zeros(3, np.int64)), "feature 'image' of uint8 [2, 3, 4, 4]",
         "uint8 [3, 3, 4, 4]"),  # another batch size
        (_good_features(label=np.zeros((2, 1), np.int64)), "feature 'label' of int64 [2]", "int64 [2, 1]"),  # not a scalar per sample
        (_good_features(label=np.zeros(2, np.int32)), "feature 'label' of int64 [2]", "int32 [2]"),
        # A label count that is not the images' (our writer refuses that; protobuf's writes it).
        (_protobuf_features({"image": np.zeros((2, 3, 4, 4), np.uint8), "label": np.zeros(1, np.int64)}), "feature 'label' of int64 [2]",
         "int64 [1]"),
        (_good_features(label=None), FEATURES_ONLY, "no feature 'label'"),
        (_good_features(mask=np.zeros((2, 4), np.int8)), FEATURES_ONLY, "an extra feature 'mask'"),
        (_protobuf_features({"image": np.zeros((2, 3, 4, 4), np.uint8), "label": np.zeros(2, np.int64), "bad-name": np.zeros(2, np.int8)}),
         "names of 1 to 64 [A-Za-z0-9_]", "a feature named 'bad-name'"),
        # Earlier releases' image batches (Batch fields 2 and 3, now reserved) hold no features.
        (image_batch_of_earlier_releases(), FEATURES_ONLY, "no feature 'image'"),
        (image_batch_of_earlier_releases() + codec.encode_features({"label": np.zeros(2, np.int64)}), FEATURES_ONLY, "no feature 'image'"),
        (codec.end_of_stream("shutdown")[:0], FEATURES_ONLY, "no feature 'image'"),  # an empty message: no features at all
        (_good_features(sample_ids=[1, 2, 3], epochs=[0, 0]), "as many epochs as sample ids", "3 sample ids and 2 epochs"),
        (_good_features(sample_ids=[1], epochs=[0]), "2 slot tags", "1"),
        (_good_features(sample_ids=[1, 2, 3, 4], epochs=[0, 0, 0, 0]), "plus at most the 1 skipped", "4"),
    ],
)
def test_a_feature_batch_that_is_not_the_one_described_is_refused_naming_the_feature(payload: bytes, expected: str, seen: str) -> None:
    with pytest.raises(codec.MalformedBatchError) as refused:
        codec.check_batch(codec.decode_batch(payload), FEATURE_SPEC)
    assert expected in refused.value.expected and refused.value.seen.endswith(seen), str(refused.value)


def test_a_skipped_count_past_uint32_is_refused() -> None:
    payload = _good_features(skipped_samples=0) + bytes([4 << 3]) + codec._varint_bytes(2**40)
    with pytest.raises(codec.MalformedBatchError, match="uint32"):
        codec.check_batch(codec.decode_batch(payload), FEATURE_SPEC)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: codec.FeatureSpec("input-ids", "int32", (128,)), "feature name 'input-ids'"),
        (lambda: codec.FeatureSpec("", "int32"), "feature name ''"),
        (lambda: codec.FeatureSpec("ids", "uint16", (128,)), "feature 'ids': dtype 'uint16' cannot be sent"),
        (lambda: codec.FeatureSpec("ids", "int32", (-1,)), "feature 'ids': negative dimension"),
        (lambda: codec.FeatureSpec("ids", "int32", (1,) * 32), "feature 'ids': a sample of 32 dimensions"),
        (lambda: codec.BatchSpec(2, (codec.FeatureSpec("ids", "int32"), codec.FeatureSpec("ids", "int64"))), "'ids' is named more than once"),
        (lambda: codec.BatchSpec(2, ()), "at least one feature"),
    ],
)
def test_feature_specs_refuse_what_no_batch_can_carry(make, message: str) -> None:
    with pytest.raises(codec.TensorFormatError, match=message):
        make()


@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_the_receive_limit_of_features_holds_their_largest_batch(batch_size: int) -> None:
    """Names at their longest, every dtype, a scalar per sample, shapes of many dimensions and of wide varints,
    every slot tagged twice and every count at its widest."""
    specs = (
        codec.FeatureSpec("i" * 64, "uint8", (3, 64, 64)),
        codec.FeatureSpec("t" * 64, "int32", (2**14,)),
        codec.FeatureSpec("m" * 64, "float64", (1,) * 30),
        codec.FeatureSpec("l" * 64, "int64"),
        codec.FeatureSpec("b" * 64, "bool", (3, 5)),
    )
    spec = codec.BatchSpec(batch_size, specs)
    features = {feature.name: np.zeros(feature.batch_shape(batch_size), feature.dtype) for feature in specs}
    tags = np.full(2 * batch_size, 2**64 - 1, dtype=np.uint64)
    payload = codec.encode_features(features, 2**32 - 1, tags, np.full(2 * batch_size, 2**32 - 1, dtype=np.uint32))
    codec.check_batch(codec.decode_batch(payload), spec)
    assert len(payload) <= spec.max_message_bytes < len(payload) + 1024 + codec.END_REASON_BYTES + len(specs) * (codec.FEATURE_OVERHEAD_BYTES + 320)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_a_feature_batch_with_any_bytes_changed_is_refused_with_a_format_error_or_is_one_of_the_spec(data: st.DataObject) -> None:
    payload = bytearray(_good_features())
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    try:
        batch = codec.decode_batch(bytes(payload))
        codec.check_batch(batch, FEATURE_SPEC)
    except codec.TensorFormatError:
        return
    assert sorted(batch.features) == ["image", "label"]
    assert batch.features["image"].shape == (2, 3, 4, 4) and batch.features["image"].dtype == np.uint8
    assert batch.features["label"].shape == (2,) and batch.features["label"].dtype == np.int64
