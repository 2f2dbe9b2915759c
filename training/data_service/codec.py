"""numpy arrays ↔ the data service's Tensor messages: raw C-order bytes with dtype and shape beside them.

No pickle crosses the wire: a peer can only send bytes that are read as the dtype it names, and a
message whose byte count disagrees with its shape is refused.
"""

from __future__ import annotations

import numpy as np

from training.data_service import data_service_pb2 as pb

# Only plain numeric dtypes travel; anything else (object, void...) is refused.
ALLOWED_DTYPES = frozenset({"uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"})


class TensorFormatError(ValueError):
    """A Tensor message is malformed (unknown dtype, or bytes that do not match its shape)."""


def encode(array: np.ndarray) -> pb.Tensor:
    if array.dtype.name not in ALLOWED_DTYPES:
        raise TensorFormatError(f"dtype {array.dtype.name} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
    return pb.Tensor(dtype=array.dtype.name, shape=list(array.shape), data=np.ascontiguousarray(array).tobytes())


def decode(message: pb.Tensor) -> np.ndarray:
    """A read-only view on the message's bytes (no copy)."""
    if message.dtype not in ALLOWED_DTYPES:
        raise TensorFormatError(f"unknown dtype {message.dtype!r}")
    dtype = np.dtype(message.dtype)
    shape = tuple(message.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if any(dim < 0 for dim in shape) or expected != len(message.data):
        raise TensorFormatError(f"{len(message.data)} bytes do not make a {message.dtype} tensor of shape {shape}")
    return np.frombuffer(message.data, dtype=dtype).reshape(shape)
