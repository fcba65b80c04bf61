"""The kernels' parameter records: NumPy mirrors of the structs of cuda_src/params.h, and the one
place they are packed.

Each struct is filled on the host as one record and handed to the launch by address, so the driver
copies its bytes as the kernel's by-value argument. tests/test_params_layout.py compiles params.h
with the host C compiler and checks every field's offset and size against these dtypes.
"""
from __future__ import annotations

import functools
import struct

import numpy as np

_PTR = np.uint64
_I64 = np.int64
_I32 = np.int32
_F32 = np.float32

#: Field order, names and types of struct ModParams: the variants' runtime values, the last field
#: ("mod") of every parameter struct.
MOD_FIELDS = [
    ("alibi_slopes", _PTR),
    ("alibi_batch_stride", _I64),
    ("seed", _PTR),
    ("offset", _PTR),
    ("cu_seqlens_q", _PTR),
    ("cu_seqlens_k", _PTR),
    ("seqused_k", _PTR),
    ("block_table", _PTR),
    ("block_table_stride", _I64),
    ("window_left", _I32),
    ("window_right", _I32),
    ("softcap_scale", _F32),
    ("alibi_scale", _F32),
    ("dropout_rp", _F32),
    ("keep_threshold", np.uint32),
    ("page_size", _I32),
    ("num_pages", _I32),
    ("page_capacity", _I32),
    ("diag_shift", _I32),
]

MOD_DTYPE = np.dtype(MOD_FIELDS, align=True)

#: Field order, names and types of struct FastDiv: a divisor and its multiplier (fast_divisor).
FASTDIV_DTYPE = np.dtype([("d", _I32), ("mul", np.uint32), ("shift", np.uint32)], align=True)

#: The FastDiv fields of FwdParams (plan/forward.py fwd_walk fills them, in this order).
WALK_FIELDS = ("walk_step", "walk_items", "walk_units", "walk_group", "walk_tail", "walk_heads", "kv_ratio")


def fast_divisor(d: int) -> tuple[int, int, int]:
    """The FastDiv of ``d`` (1 <= d < 2^31): (d, mul, shift) such that n // d == (n * mul >> 32) >> shift for
    every 0 <= n < 2^31 (d == 1: the kernel takes n itself). mul = ceil(2^(31 + l) / d) with l = ceil(log2 d)
    < 2^32 since d > 2^(l - 1); the error of the rounded-up multiplier, below 2^l / 2^(31 + l) per unit of
    n, never carries n / d past an integer (Granlund and Montgomery 1994)."""
    if not 1 <= d < 1 << 31:
        raise ValueError(f"a FastDiv divisor must be in [1, 2^31), got {d}")
    if d == 1:
        return (1, 0, 0)
    shift = (d - 1).bit_length()  # l = ceil(log2 d)
    return (d, -(-(1 << (31 + shift)) // d), shift - 1)


@functools.lru_cache(maxsize=1024)
def walk_fields(divisors: tuple[int, ...]) -> dict[str, tuple[int, int, int]]:
    """FwdParams' FastDiv fields by name from a Launch's ``walk`` (plan/forward.py fwd_walk), for
    RecordPacker.pack (the dict is shared between calls: copy it before changing it)."""
    if len(divisors) != len(WALK_FIELDS):
        raise ValueError(f"a forward launch's walk holds {len(WALK_FIELDS)} divisors ({', '.join(WALK_FIELDS)}), "
                         f"got {divisors!r}: plan it with plan.plan_forward")  # fmt: skip
    return {name: fast_divisor(d) for name, d in zip(WALK_FIELDS, divisors)}


#: Field order, names and types of struct FwdParams.
FWD_FIELDS = [
    ("q", _PTR),
    ("k", _PTR),
    ("v", _PTR),
    ("o", _PTR),
    ("lse", _PTR),
    ("q_batch_stride", _I64),
    ("q_row_stride", _I64),
    ("q_head_stride", _I64),
    ("k_batch_stride", _I64),
    ("k_row_stride", _I64),
    ("k_head_stride", _I64),
    ("v_batch_stride", _I64),
    ("v_row_stride", _I64),
    ("v_head_stride", _I64),
    ("o_batch_stride", _I64),
    ("o_row_stride", _I64),
    ("o_head_stride", _I64),
    ("batch", _I32),
    ("nheads", _I32),
    ("nheads_kv", _I32),
    ("head_ratio", _I32),
    ("seqlen_q", _I32),
    ("seqlen_k", _I32),
    ("head_dim", _I32),
    ("num_m_blocks", _I32),
    ("softmax_scale", _F32),
    ("scale_log2", _F32),
    ("mod", MOD_DTYPE),
    ("sched_group", _I32),
] + [(name, FASTDIV_DTYPE) for name in WALK_FIELDS]

FWD_DTYPE = np.dtype(FWD_FIELDS, align=True)

#: Field order, names and types of struct BwdParams (shared by the three backward kernels).
BWD_FIELDS = (
    [(name, _PTR) for name in ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "lse_log2", "dsum", "dq_accum", "dq_turn", "item_counter")]
    + [
        (f"{t}_{s}_stride", _I64)
        for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
        for s in ("batch", "row", "head")
    ]
    + [
        (name, _I32)
        for name in (
            "batch", "nheads", "nheads_kv", "head_ratio", "seqlen_q", "seqlen_k", "head_dim", "seqlen_q_pad",
            "dq_accum_cols", "num_m_blocks", "deterministic", "block_m", "dq_q_warps", "dq_tile_rows", "dq_tile_cols",
            "pre_rows_per_warp",
        )
    ]
    + [("softmax_scale", _F32), ("scale_log2", _F32), ("mod", MOD_DTYPE)]
)

BWD_DTYPE = np.dtype(BWD_FIELDS, align=True)

#: Field order, names and types of struct DecodeParams (shared by the two decode kernels).
DECODE_FIELDS = (
    [
        (name, _PTR)
        for name in (
            "q", "k", "v", "k_new", "v_new", "o", "lse", "o_partial", "lse_partial", "split_counters", "seqlens",
            "block_table", "cache_batch_idx", "cache_leftpad",
        )
    ]
    + [
        (f"{t}_{s}_stride", _I64)
        for t in ("q", "k", "v", "k_new", "v_new", "o")
        for s in ("batch", "row", "head")
    ]
    + [("block_table_batch_stride", _I64)]
    + [
        (name, _I32)
        for name in (
            "batch", "nheads", "nheads_kv", "group", "seqlen_q", "rows", "head_dim", "seqlen_const", "seqlen_new",
            "capacity", "page_size", "num_pages", "num_splits", "num_row_blocks", "partial_stride", "is_causal",
            "split_tiles", "split_major",
        )
    ]
    + [("softmax_scale", _F32), ("scale_log2", _F32), ("tail_groups", _I32), ("mod", MOD_DTYPE)]
)  # fmt: skip

DECODE_DTYPE = np.dtype(DECODE_FIELDS, align=True)


#: Field order, names and types of struct RotaryParams (cuda_src/rotary.cuh).
ROTARY_FIELDS = (
    [(name, _PTR) for name in ("x", "out", "cos", "sin", "seqlens", "leftpad")]
    + [(name, _I64) for name in ("x_batch_stride", "x_row_stride", "x_head_stride", "cos_row_stride", "sin_row_stride")]
    + [(name, _I32) for name in ("batch", "seqlen", "nheads", "head_dim", "rotary_dim", "seqlen_ro", "seqlen_const",
                                 "capacity", "per_token")]
)  # fmt: skip

ROTARY_DTYPE = np.dtype(ROTARY_FIELDS, align=True)


def make_record(dtype: np.dtype, **values) -> np.ndarray:
    """A 0-d record of ``dtype`` with every field set (missing or unknown fields are an error)."""
    missing = set(dtype.names) - set(values)
    extra = set(values) - set(dtype.names)
    if missing or extra:
        raise KeyError(f"parameter fields missing {sorted(missing)} / unknown {sorted(extra)}")
    record = np.zeros((), dtype=dtype)  # padding bytes 0, not whatever the allocation held
    record[()] = tuple(values[name] for name in dtype.names)
    return record

class RecordPacker:
    """Packs a record of ``dtype`` into bytes with one precompiled ``struct.Struct``, the fields in the
    dtype's order (a decode step's host time is latency: make_record's NumPy record costs more).
    Padding bytes are 0, as in make_record."""

    _CODES = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i", np.dtype(np.float32): "f",
              np.dtype(np.uint32): "I"}  # fmt: skip

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.names = dtype.names
        # A nested struct field (``mod``) is given as the tuple of its values, in its dtype's order.
        self._nested_at = [(i, (name, len(dtype.fields[name][0].names))) for i, name in enumerate(self.names)
                           if dtype.fields[name][0].names]  # fmt: skip
        self._struct = struct.Struct("<" + self._format(dtype))
        assert self._struct.size == dtype.itemsize
        self.size = dtype.itemsize

    @classmethod
    def _format(cls, dtype: np.dtype) -> str:
        fmt, pos = "", 0
        for name in dtype.names:
            ftype, offset = dtype.fields[name][:2]
            fmt += "x" * (offset - pos) + (cls._format(ftype) if ftype.names else cls._CODES[ftype])
            pos = offset + ftype.itemsize
        return fmt + "x" * (dtype.itemsize - pos)

    def pack(self, **values) -> bytes:
        """The record's bytes with every field set (missing or unknown fields are a KeyError)."""
        if len(values) != len(self.names) or not all(n in values for n in self.names):
            missing = set(self.names) - set(values)
            extra = set(values) - set(self.names)
            raise KeyError(f"parameter fields missing {sorted(missing)} / unknown {sorted(extra)}")
        flat = [values[n] for n in self.names]
        for pos, (n, count) in reversed(self._nested_at):  # splice each nested tuple in (a launch's host time counts)
            if len(flat[pos]) != count:
                raise KeyError(f"parameter field {n!r} needs {count} values, got {len(flat[pos])}")
            flat[pos : pos + 1] = flat[pos]
        return self._struct.pack(*flat)

    def offset(self, name: str) -> int:
        """Byte offset of field ``name``."""
        return self.dtype.fields[name][1]


FWD_PACKER = RecordPacker(FWD_DTYPE)
BWD_PACKER = RecordPacker(BWD_DTYPE)
DECODE_PACKER = RecordPacker(DECODE_DTYPE)
ROTARY_PACKER = RecordPacker(ROTARY_DTYPE)

#: Every C struct of cuda_src/params.h and its NumPy mirror (tests/test_params_layout.py checks them all).
STRUCTS = {"ModParams": MOD_DTYPE, "FastDiv": FASTDIV_DTYPE, "FwdParams": FWD_DTYPE, "BwdParams": BWD_DTYPE,
           "DecodeParams": DECODE_DTYPE, "RotaryParams": ROTARY_DTYPE}
