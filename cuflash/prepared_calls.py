"""What the prepared paths of the decode step (cuflash/kvcache.py), the dense forward (cuflash/forward.py) and
the packed forward (cuflash/varlen.py) share: a per-thread memo of prepared call signatures, and a CuPy
array's description in a signature.

A signature is everything a call's checks and plan depend on but its pointers; a call whose signature an
earlier call in the thread prepared launches from its pointers (docs/design/torch.md, docs/design/decode.md).
"""
from __future__ import annotations

import threading


class PreparedCalls(threading.local):
    """This thread's prepared calls (``calls``: signature -> preparation), at most ``limit`` of them."""

    def __init__(self, limit: int = 256):
        self.calls = {}
        self.limit = limit

    def room(self) -> dict:
        """``calls``, emptied first when full (a program has a handful of signatures; one that makes new
        ones without end must not grow the memo without end)."""
        if len(self.calls) >= self.limit:
            self.calls.clear()
        return self.calls


def desc(x) -> tuple:
    """A CuPy array's static description in a signature: shape, strides, dtype, device."""
    return x.shape, x.strides, x.dtype, x.data.device_id
