"""Stand-ins for CuPy arrays in the CPU tests of the prepared paths' call signatures (kvcache._signature,
forward._signature): what a signature reads of an array (shape, byte strides, dtype, device) without a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np


class FakeArray(SimpleNamespace):
    """The array type a signature is asked to accept (its ``nd`` argument)."""


def fake_array(shape, dtype=np.float16, device=0, ptr=4096, strides=None) -> FakeArray:
    """A FakeArray of ``shape`` (C-contiguous byte strides unless given) at device address ``ptr``."""
    item = np.dtype(dtype).itemsize
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) * item for i in range(len(shape)))
    return FakeArray(shape=shape, strides=strides, dtype=np.dtype(dtype), data=SimpleNamespace(ptr=ptr, device_id=device))
