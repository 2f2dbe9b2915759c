"""numpy arrays ↔ the data service's messages: raw C-order bytes with dtype and shape beside them.

No pickle crosses the wire: a peer can only send bytes that are read as the dtype it names, and a tensor
whose byte count disagrees with its shape is refused. Nothing a peer sends is trusted: ``decode_batch``
refuses any message it cannot read exactly (TensorFormatError), and ``check_batch`` refuses a readable batch
that is not the one the trainer asked for (MalformedBatchError: names, dtypes, shapes, counts).

A batch is a workload's (a user's or a built-in's): named features, each [B, *its sample shape] of any
allowed dtype (the vision workload's: uint8 "image" [B, 3, S, S] and int64 "label" [B]), announced by the
data host's Describe (DatasetInfo.features, read as FeatureSpec) and checked against that announcement.

Batches are the hot path. A data host's worker processes serialise each Batch once (``encode_features``),
the gRPC handler sends those bytes as they are, and the trainer side reads them with ``decode_batch``,
which walks the protobuf wire format of Batch and Tensor itself and returns numpy views on the received
bytes: the tensor bytes are never copied after gRPC hands them over (protobuf's own parser would copy them
once more, which measurably slows a stream of multi-megabyte batches). ``decode_batch`` agrees with
protobuf's parser on every message (tests/training/test_codec.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from training.data_service import data_service_pb2 as pb

# Only plain numeric dtypes travel; anything else (object, void...) is refused.
ALLOWED_DTYPES = frozenset({"uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"})

# Wire types (protobuf encoding).
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


# numpy's limit on dimensions (NPY_MAXDIMS is 32 up to numpy 1.x, 64 from 2.0: the smaller holds for both).
MAX_RANK = 32
# No dimension of a tensor that arrived in one gRPC message can exceed that message's byte count, which gRPC
# keeps below 2 GiB (its length prefix is an int32), unless another dimension is 0 and the tensor empty.
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1
MAX_DIMENSION = MAX_GRPC_MESSAGE_BYTES
# Batch.skipped_samples is a uint32.
MAX_UINT32 = 2**32 - 1
# A feature's name: a Python identifier's characters (a key of the user's preprocess dict), 1 to 64 of them.
FEATURE_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
# What one feature adds to a Batch besides its tensor's bytes and its shape's varints, at most: the
# Feature's key and length (6), the name's key, length and bytes (66), the Tensor's key and length (6), the
# dtype's key, length and name (9), the shape's key and length (3), the data's key and length (6). Rounded up.
FEATURE_OVERHEAD_BYTES = 256
# The most bytes of UTF-8 an end-of-stream's reason carries (server.end_reason cuts it there): the receive
# limit (BatchSpec.max_message_bytes) leaves room for it, however small the batches.
END_REASON_BYTES = 1024


class TensorFormatError(ValueError):
    """A Tensor or Batch message is malformed (unknown dtype, bytes that do not match the shape, a
    truncated field)."""


class MalformedBatchError(TensorFormatError):
    """A batch that reads, but is not what the trainer asked its data host for: what was expected, and
    what came."""

    def __init__(self, expected: str, seen: str) -> None:
        super().__init__(f"expected {expected}, got {seen}")
        self.expected, self.seen = expected, seen


def check_feature_name(name: object) -> None:
    """Refuse (TensorFormatError) a feature name that is not 1 to 64 characters of [A-Za-z0-9_]. Pure."""
    if not isinstance(name, str) or not FEATURE_NAME.fullmatch(name):
        raise TensorFormatError(f"feature name {name!r} is not 1 to 64 characters of [A-Za-z0-9_]")


@dataclass(frozen=True)
class FeatureSpec:
    """One named feature of a workload's batches: its dtype, and the shape of ONE sample (empty: a
    scalar per sample). A batch of ``batch_size`` holds it as dtype [batch_size, *shape]. Refuses
    (TensorFormatError) a bad name, a dtype that cannot travel, a negative dimension or too many of them."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_feature_name(self.name)
        if self.dtype not in ALLOWED_DTYPES:
            raise TensorFormatError(f"feature {self.name!r}: dtype {self.dtype!r} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
        object.__setattr__(self, "shape", tuple(int(dimension) for dimension in self.shape))
        if len(self.shape) + 1 > MAX_RANK:
            raise TensorFormatError(f"feature {self.name!r}: a sample of {len(self.shape)} dimensions (a batch holds at most {MAX_RANK})")
        if any(dimension < 0 for dimension in self.shape):
            raise TensorFormatError(f"feature {self.name!r}: negative dimension in sample shape {list(self.shape)}")

    def batch_shape(self, batch_size: int) -> tuple[int, ...]:
        return (batch_size, *self.shape)

    def batch_bytes(self, batch_size: int) -> int:
        return math.prod(self.batch_shape(batch_size)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class DecodedBatch:
    # The batch's features by name, in the order they came (views on the payload); none in an end of stream.
    features: dict[str, np.ndarray] = field(default_factory=dict)
    skipped_samples: int = 0
    end_of_stream: bool = False
    end_reason: str = ""
    # Per slot: the sample whose turn it was, and its data-host epoch (empty from a host that sends none).
    sample_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    epochs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint32))
    # Per slot, the position of its due sample in the host's order (empty from a host that sends none).
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))


@dataclass(frozen=True)
class BatchSpec:
    """The batches a trainer asked a data host for: its StreamRequest's batch size, and the features the
    host's Describe announced. Each batch holds exactly those features, each dtype [batch_size, *shape].
    Refuses (TensorFormatError) no features, or a name twice."""

    batch_size: int
    features: tuple[FeatureSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        if not self.features:
            raise TensorFormatError("a batch holds at least one feature")
        names = [feature.name for feature in self.features]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise TensorFormatError(f"feature {duplicates[0]!r} is named more than once")

    @property
    def max_message_bytes(self) -> int:
        """The most bytes a Batch of this spec can take on the wire: each feature's bytes, plus per feature
        FEATURE_OVERHEAD_BYTES and 10 bytes per dimension of its batch shape (a varint each); per slot at
        most two 12-byte slot tags (its sample, and one due sample that was skipped: see check_batch) and its
        8-byte position; 1 KiB for the counts' keys and lengths; and an end of stream's reason. The
        trainer's receive limit: nothing larger is read."""
        per_feature = sum(
            feature.batch_bytes(self.batch_size) + FEATURE_OVERHEAD_BYTES + 10 * (1 + len(feature.shape)) for feature in self.features
        )
        return per_feature + self.batch_size * (2 * 12 + 8) + 1024 + END_REASON_BYTES


def check_batch(batch: DecodedBatch, spec: BatchSpec) -> None:
    """Refuse (MalformedBatchError) a decoded batch that is not one of ``spec``'s: a peer's bytes reach
    training only as the arrays the trainer expects. Pure."""
    _check_features(batch, spec)
    if batch.skipped_samples > MAX_UINT32:
        raise MalformedBatchError("skipped_samples within a uint32", str(batch.skipped_samples))
    # Slot tags (server.slot_tags): none, from a host that sends none; else one per slot, then one per due
    # sample that did not decode, each of which was also counted as skipped.
    tags, epochs = len(batch.sample_ids), len(batch.epochs)
    if tags != epochs:
        raise MalformedBatchError("as many epochs as sample ids", f"{tags} sample ids and {epochs} epochs")
    if tags and not spec.batch_size <= tags <= spec.batch_size + batch.skipped_samples:
        raise MalformedBatchError(f"{spec.batch_size} slot tags, plus at most the {batch.skipped_samples} skipped samples", f"{tags}")
    if len(batch.positions) not in (0, spec.batch_size):
        raise MalformedBatchError(f"no positions or one per slot ({spec.batch_size})", f"{len(batch.positions)} positions")


def _check_features(batch: DecodedBatch, spec: BatchSpec) -> None:
    expected = [feature.name for feature in spec.features]
    wanted = f"a batch of features {expected} only"
    for name in batch.features:
        if not FEATURE_NAME.fullmatch(name):
            raise MalformedBatchError(f"{wanted} (names of 1 to 64 [A-Za-z0-9_])", f"a feature named {name!r}")
        if name not in expected:
            raise MalformedBatchError(wanted, f"an extra feature {name!r}")
    for feature in spec.features:
        if feature.name not in batch.features:
            raise MalformedBatchError(wanted, f"no feature {feature.name!r}")
        _expect(f"feature {feature.name!r}", batch.features[feature.name], feature.dtype, feature.batch_shape(spec.batch_size))


def _expect(name: str, array: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
    if array.dtype.name != dtype or array.shape != shape:
        raise MalformedBatchError(f"{name} of {dtype} {list(shape)}", f"{array.dtype.name} {list(array.shape)}")


def encode(array: np.ndarray) -> pb.Tensor:
    if array.dtype.name not in ALLOWED_DTYPES:
        raise TensorFormatError(f"dtype {array.dtype.name} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
    return pb.Tensor(dtype=array.dtype.name, shape=list(array.shape), data=np.ascontiguousarray(array).tobytes())


def decode(message: pb.Tensor) -> np.ndarray:
    """A read-only view on the message's bytes."""
    return _tensor_view(message.dtype, tuple(message.shape), message.data, 0, len(message.data))


def encode_features(
    features: Mapping[str, np.ndarray], skipped_samples: int = 0, sample_ids: Sequence[int] = (), epochs: Sequence[int] = (),
    positions: Sequence[int] = (),
) -> bytes:
    """A workload's serialised Batch: ``features`` (each [batch, *sample shape]) in the mapping's order.
    Byte for byte what protobuf's serializer writes (tests/training/test_codec.py), written here with one
    copy of the tensor bytes: protobuf's Python API copies them into the message and again into the
    serialised string, which took 18 ms of a 32 × 224² batch's ~90 ms on a data-host core. Refuses (TensorFormatError) no features, a bad name, a dtype that cannot travel, a
    0-d array, or features whose batch dimensions differ."""
    if not features:
        raise TensorFormatError("a batch of features needs at least one feature")
    counts = _counts_and_tags(skipped_samples, sample_ids, epochs)
    batch_sizes: dict[str, int] = {}
    parts: list[bytes | memoryview] = []
    for name, array in features.items():
        check_feature_name(name)
        if not np.ndim(array):
            raise TensorFormatError(f"feature {name!r} is a 0-d array; each feature is [batch, *sample shape]")
        batch_sizes[name] = np.shape(array)[0]
        try:
            tensor = _tensor_parts(array)
        except TensorFormatError as error:
            raise TensorFormatError(f"feature {name!r}: {error}") from None
        parts += _length_delimited(9, [*_length_delimited(1, [name.encode()]), *_length_delimited(2, tensor)])
    if len(set(batch_sizes.values())) > 1:
        raise TensorFormatError(f"features of different batch sizes: {batch_sizes}")
    # Protobuf writes fields in number order: the counts and tags (4, 7, 8), the features (9), the positions (10).
    return b"".join(counts + parts + _fixed_field(10, positions, np.dtype("<u8")))


def _counts_and_tags(skipped_samples: int, sample_ids: Sequence[int], epochs: Sequence[int]) -> list[bytes | memoryview]:
    """Batch fields 4 (skipped_samples), 7 (sample_ids) and 8 (epochs), as protobuf writes them."""
    if not 0 <= skipped_samples < 2**32:  # a uint32 field
        raise TensorFormatError(f"skipped_samples must fit a uint32, got {skipped_samples}")
    parts: list[bytes | memoryview] = []
    if skipped_samples:
        parts += [_varint_bytes(4 << 3 | VARINT), _varint_bytes(skipped_samples)]
    for number, values, dtype in ((7, sample_ids, np.dtype("<u8")), (8, epochs, np.dtype("<u4"))):
        parts += _fixed_field(number, values, dtype)
    return parts


def _fixed_field(number: int, values: Sequence[int], dtype: np.dtype) -> list[bytes | memoryview]:
    """A repeated fixed-width field, packed (proto3's default: the values' little-endian bytes); none when empty."""
    if not len(values):
        return []
    array = np.asarray(values)
    if array.dtype.kind not in "iu" or array.min() < 0 or array.max() > np.iinfo(dtype).max:
        raise TensorFormatError(f"field {number} values must fit {dtype.name}")
    return _length_delimited(number, [array.astype(dtype).tobytes()])


def _tensor_parts(array: np.ndarray) -> list[bytes | memoryview]:
    """A Tensor message's fields in field order (proto3 leaves out an empty shape and empty data)."""
    if array.dtype.name not in ALLOWED_DTYPES:
        raise TensorFormatError(f"dtype {array.dtype.name} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
    # C order and little-endian, which is what the name means to the reader (np.ascontiguousarray would
    # also turn a 0-d array into a 1-d one).
    array = np.require(array, dtype=array.dtype.newbyteorder("<"), requirements="C")
    parts = _length_delimited(1, [array.dtype.name.encode()])
    if array.ndim:
        parts += _length_delimited(2, [b"".join(_varint_bytes(dimension) for dimension in array.shape)])  # packed
    if array.nbytes:
        parts += _length_delimited(3, [memoryview(array.reshape(-1)).cast("B")])
    return parts


def _length_delimited(number: int, parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    return [_varint_bytes(number << 3 | LENGTH_DELIMITED), _varint_bytes(sum(len(part) for part in parts)), *parts]


def _varint_bytes(value: int) -> bytes:
    encoded = bytearray()
    while value > 0x7F:
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


def end_of_stream(reason: str) -> bytes:
    return pb.Batch(end_of_stream=True, end_reason=reason).SerializeToString()


def decode_batch(payload: bytes) -> DecodedBatch:
    """Read a serialised Batch; its features' tensors are views on ``payload``. Refuses (TensorFormatError)
    a feature named twice, one without a tensor, and any tensor that does not read. Fields it does not know
    (the reserved 2 and 3 of the image batches of earlier releases too) are skipped, as protobuf's parser
    skips them: a batch of them alone holds no features, which check_batch refuses."""
    fields: dict[str, object] = {}
    features: dict[str, np.ndarray] = {}
    for number, wire_type, value in _fields(payload, 0, len(payload)):
        if number == 9 and wire_type == LENGTH_DELIMITED:
            name, array = _decode_feature(payload, *value)
            if name in features:
                raise TensorFormatError(f"feature {name!r} comes twice in one batch")
            features[name] = array
        elif number == 4 and wire_type == VARINT:
            fields["skipped_samples"] = value
        elif number == 5 and wire_type == VARINT:
            fields["end_of_stream"] = bool(value)
        elif number == 6 and wire_type == LENGTH_DELIMITED:
            fields["end_reason"] = _text(payload, *value)
        elif (number, wire_type) in ((7, LENGTH_DELIMITED), (8, LENGTH_DELIMITED), (10, LENGTH_DELIMITED), (7, FIXED64), (8, FIXED32), (10, FIXED64)):
            # Packed (one span of values) or unpacked (one value per field), which parsers must accept too.
            fields.setdefault(number, []).append(_fixed_array(payload, *value, "<u4" if number == 8 else "<u8"))
    return DecodedBatch(
        features=features,
        skipped_samples=int(fields.get("skipped_samples", 0)),
        end_of_stream=bool(fields.get("end_of_stream", False)),
        end_reason=str(fields.get("end_reason", "")),
        sample_ids=_joined(fields.get(7), np.uint64),
        epochs=_joined(fields.get(8), np.uint32),
        positions=_joined(fields.get(10), np.uint64),
    )


def _decode_feature(payload: bytes, start: int, end: int) -> tuple[str, np.ndarray]:
    name, tensor = "", None
    for number, wire_type, value in _fields(payload, start, end):
        if number == 1 and wire_type == LENGTH_DELIMITED:
            name = _text(payload, *value)
        elif number == 2 and wire_type == LENGTH_DELIMITED:
            if tensor is not None:  # protobuf's parser would merge the two; no writer of ours sends that
                raise TensorFormatError(f"feature {name!r} has two tensors")
            tensor = value
    if tensor is None:
        raise TensorFormatError(f"feature {name!r} has no tensor")
    try:
        return name, _decode_tensor(payload, *tensor)
    except TensorFormatError as error:
        raise TensorFormatError(f"feature {name!r}: {error}") from None


def _fixed_array(payload: bytes, start: int, end: int, dtype: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if (end - start) % size:
        raise TensorFormatError(f"{end - start} bytes are not a whole number of {dtype[1:]} values")
    return np.frombuffer(payload, dtype=dtype, count=(end - start) // size, offset=start)


def _joined(parts: list[np.ndarray] | None, dtype: type) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=dtype)
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)).astype(dtype, copy=False)


def _decode_tensor(payload: bytes, start: int, end: int) -> np.ndarray:
    dtype, shape, data = "", [], (start, start)
    for number, wire_type, value in _fields(payload, start, end):
        if number == 1 and wire_type == LENGTH_DELIMITED:
            dtype = _text(payload, *value)
        elif number == 2 and wire_type == LENGTH_DELIMITED:  # packed repeated int64
            position, stop = value
            while position < stop:
                dimension, position = _varint(payload, position, stop)
                shape.append(_signed64(dimension))
        elif number == 2 and wire_type == VARINT:  # unpacked, as some encoders write it
            shape.append(_signed64(value))
        elif number == 3 and wire_type == LENGTH_DELIMITED:
            data = value
    return _tensor_view(dtype, tuple(shape), payload, *data)


def _tensor_view(dtype_name: str, shape: tuple[int, ...], buffer: bytes, start: int, end: int) -> np.ndarray:
    if dtype_name not in ALLOWED_DTYPES:
        raise TensorFormatError(f"unknown dtype {dtype_name!r}")
    dtype = np.dtype(dtype_name)
    if len(shape) > MAX_RANK:
        raise TensorFormatError(f"a shape of {len(shape)} dimensions (numpy holds at most {MAX_RANK})")
    if any(dimension < 0 for dimension in shape):
        raise TensorFormatError(f"negative dimension in shape {shape}")
    if any(dimension > MAX_DIMENSION for dimension in shape):
        raise TensorFormatError(f"a dimension of shape {shape} exceeds {MAX_DIMENSION}, more than a message can hold")
    # Python's integers: numpy's int64 product wraps (2**62 × 4 is 0), which let a shape of no bytes pass
    # this check and then fail in reshape with an error no caller expected.
    count = math.prod(shape)
    if count * dtype.itemsize != end - start:
        raise TensorFormatError(f"{end - start} bytes do not make a {dtype_name} tensor of shape {shape}")
    if not count and math.prod(dimension for dimension in shape if dimension) * dtype.itemsize > np.iinfo(np.intp).max:
        # Empty, but numpy computes the size of the dimensions before the 0 and refuses one that overflows.
        raise TensorFormatError(f"an empty tensor of shape {shape} whose other dimensions no array can have")
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=start).reshape(shape)


def _fields(payload: bytes, position: int, end: int):
    """(field number, wire type, value) for each field in payload[position:end]; a length-delimited
    value is its (start, end) span."""
    while position < end:
        key, position = _varint(payload, position, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == VARINT:
            value, position = _varint(payload, position, end)
        elif wire_type == LENGTH_DELIMITED:
            length, position = _varint(payload, position, end)
            if position + length > end:
                raise TensorFormatError(f"field {number} runs past the end of the message")
            value, position = (position, position + length), position + length
        elif wire_type in (FIXED64, FIXED32):
            start, position = position, position + (8 if wire_type == FIXED64 else 4)
            if position > end:
                raise TensorFormatError(f"field {number} runs past the end of the message")
            value = (start, position)
        else:
            raise TensorFormatError(f"field {number} has unsupported wire type {wire_type}")
        yield number, wire_type, value


def _varint(payload: bytes, position: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= end or shift > 63:
            raise TensorFormatError("truncated or overlong varint")
        byte = payload[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(payload: bytes, start: int, end: int) -> str:
    try:
        return payload[start:end].decode("utf-8")
    except UnicodeDecodeError:
        raise TensorFormatError("a string field is not UTF-8") from None
