"""Float64 NumPy oracle for attention, used to test the cuflash kernels.

Conventions (the same as flash-attn):

* Layout: ``q`` is ``(batch, seqlen_q, nheads, headdim)``; ``k`` and ``v`` are
  ``(batch, seqlen_k, nheads_kv, headdim)``.
* GQA / MQA: ``nheads % nheads_kv == 0`` and query head ``i`` uses kv head
  ``i // (nheads // nheads_kv)``.
* ``softmax_scale`` defaults to ``1 / sqrt(headdim)``.
* Causal masking with ``seqlen_q != seqlen_k`` is aligned to the bottom-right
  corner: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
  A query row that sees no key outputs 0, has ``lse = -inf`` and receives
  (and contributes) zero gradients.
* ``lse`` is float64 with shape ``(batch, nheads, seqlen_q)``: the natural log
  of ``sum_j exp(scale * q_i . k_j)`` over the visible keys ``j``.
* Inputs may be NumPy arrays of any float dtype (float16, ml_dtypes.bfloat16,
  float32, float64), with any strides, or CuPy arrays (anything with a
  ``.get()`` method, which is used to copy it to the host).  Everything is
  converted to float64 before any arithmetic.

Notation follows the FlashAttention papers: ``S = scale * Q K^T`` are the
scores, ``m`` the row maximum, ``l`` the row sum of ``exp(S - m)``,
``P = exp(S - m) / l`` the probabilities, ``O = P V`` the output.

Memory bound: the full ``seqlen_q x seqlen_k`` matrix of a whole batch is
never built.  The code loops over batch and heads and, within one
(batch, head), over chunks of query rows so that a score block holds at most
``MAX_BLOCK_ELEMENTS`` elements (or one row, if a row alone is longer).

Variants (flash-attn's semantics; every public function takes them as keywords): ``window_size``
``(left, right)`` (-1 = unbounded; query ``i`` sees key ``j`` iff ``d - left <= j <= d + right``,
``d = i + seqlen_k - seqlen_q``, plus ``diag_shift`` in attention_forward / attention_backward; causal
sets ``right = 0``), ``softcap`` (``s -> softcap *
tanh(s / softcap)`` on the scaled score), ``alibi_slopes`` (``(nheads,)`` or ``(batch, nheads)``; adds
``-slope * |d - j|`` after the softcap) and ``dropout_p`` with ``rng_state = (seed, offset)`` (each
probability kept with probability ``1 - p``, rounded to a multiple of 1/256 (:func:`keep_probability`, as
flash-attn's 8-bit draws do), and scaled by the inverse of that probability after the normalization;
the keep mask is :func:`dropout_keep_mask`, the kernels' Philox4x32-10 stream, rebuilt here).

Besides the exact oracle, :func:`plain_attention` and
:func:`plain_attention_backward` compute attention the "plain" way in a low
precision (inputs and intermediate probabilities rounded to ``dtype``,
matmuls accumulated in float32).  Their error against the oracle sets the
tolerance of the kernel tests, see :func:`within_tolerance`; the tests take
the worse of two plain orders of rounding (:func:`plain_attention_bar`,
:func:`plain_attention_backward_bar`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

__all__ = [
    "MAX_BLOCK_ELEMENTS",
    "visible_mask",
    "philox4x32_10",
    "dropout_keep_mask",
    "keep_threshold",
    "keep_probability",
    "attention_forward",
    "attention_backward",
    "attention_with_kvcache",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "apply_rotary",
    "plain_attention",
    "plain_attention_bar",
    "plain_attention_backward",
    "plain_attention_backward_bar",
    "worse_of",
    "max_abs_error",
    "within_tolerance",
]

#: Largest number of elements in one score block ``S`` (rows x seqlen_k).
MAX_BLOCK_ELEMENTS = 1 << 24

Rounder = Callable[[np.ndarray], np.ndarray]


# ---------------------------------------------------------------------------
# Input handling
# ---------------------------------------------------------------------------

def _to_host(x):
    """Return ``x`` as something NumPy can read (CuPy arrays via ``.get()``)."""
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    return x


def _to_f64(x, name: str) -> np.ndarray:
    """Convert an array-like (NumPy or CuPy, any float dtype) to float64."""
    try:
        return np.asarray(_to_host(x), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot convert to a float64 array ({exc})") from exc


def _require_shape(x: np.ndarray, name: str, expected: tuple) -> None:
    if x.shape != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {x.shape}")


def _check_ndim4(x: np.ndarray, name: str, layout: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name} must be 4-D {layout}, got shape {x.shape}")


def _check_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, ...]:
    """Validate q, k, v; return (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)."""
    _check_ndim4(q, "q", "(batch, seqlen_q, nheads, headdim)")
    _check_ndim4(k, "k", "(batch, seqlen_k, nheads_kv, headdim)")
    batch, seqlen_q, nheads, headdim = q.shape
    if headdim < 1:
        raise ValueError(f"q: headdim must be >= 1, got shape {q.shape}")
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    _require_shape(k, "k", (batch, seqlen_k, nheads_kv, headdim))
    _require_shape(v, "v", (batch, seqlen_k, nheads_kv, headdim))
    _check_heads(nheads, nheads_kv)
    return batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim


def _check_heads(nheads: int, nheads_kv: int) -> None:
    if nheads_kv < 1 or nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv}) "
            "and nheads_kv must be >= 1"
        )


def _scale(softmax_scale, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _head_pairs(nheads: int, nheads_kv: int) -> Iterator[tuple[int, int]]:
    """Yield (query head, kv head) pairs following the GQA convention."""
    group = nheads // nheads_kv
    for h in range(nheads):
        yield h, h // group


def _row_chunks(seqlen_q: int, seqlen_k: int) -> Iterator[tuple[int, int]]:
    """Split query rows so that a (rows x seqlen_k) block stays bounded."""
    rows = max(1, MAX_BLOCK_ELEMENTS // max(1, seqlen_k))
    for start in range(0, seqlen_q, rows):
        yield start, min(start + rows, seqlen_q)


def _identity(x: np.ndarray) -> np.ndarray:
    return x


# ---------------------------------------------------------------------------
# Mask and softmax
# ---------------------------------------------------------------------------

def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool,
                 q_start: int = 0, q_stop: int | None = None, window_size=(-1, -1), diag_shift: int = 0) -> np.ndarray:
    """Boolean mask of shape (q_stop - q_start, seqlen_k).

    Entry ``[r, j]`` is True when query row ``i = q_start + r`` may see key
    ``j``: always when not causal, else iff ``j <= i + seqlen_k - seqlen_q``;
    with ``window_size = (left, right)`` also only iff ``d - left <= j <= d + right``
    (``d = i + seqlen_k - seqlen_q``; -1 leaves that side unbounded). ``diag_shift`` moves the diagonal:
    ``d = i + seqlen_k - seqlen_q + diag_shift``, in the causal test too.
    """
    if q_stop is None:
        q_stop = seqlen_q
    if not 0 <= q_start <= q_stop <= seqlen_q:
        raise ValueError(
            f"need 0 <= q_start <= q_stop <= seqlen_q, got q_start={q_start}, "
            f"q_stop={q_stop}, seqlen_q={seqlen_q}"
        )
    rows = q_stop - q_start
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return np.ones((rows, seqlen_k), dtype=bool)
    d = np.arange(q_start, q_stop)[:, None] + (seqlen_k - seqlen_q + int(diag_shift))
    j = np.arange(seqlen_k)[None, :]
    visible = np.ones((rows, seqlen_k), dtype=bool)
    if right >= 0:
        visible &= j <= d + right
    if left >= 0:
        visible &= j >= d - left
    return visible


# ---------------------------------------------------------------------------
# Dropout: the kernels' Philox4x32-10 stream (cuda_src/dropout.cuh)
# ---------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def philox4x32_10(counter, key) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 (Salmon et al. 2011; Random123's constants): ``counter`` four uint32 arrays (or
    ints, broadcast), ``key`` two; returns the four uint32 output words. NumPy's own Philox bit
    generator is the 4x64 variant, so the 4x32 one the kernels use is written out here (and tested
    against Random123's known-answer vectors)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _M32 for c in counter)
    k0, k1 = (int(k) & _M32 for k in key)
    for _ in range(10):
        p0 = c0 * np.uint64(0xD2511F53)
        p1 = c2 * np.uint64(0xCD9E8D57)
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & np.uint64(_M32),
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & np.uint64(_M32))  # fmt: skip
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def keep_threshold(dropout_p: float) -> int:
    """An element is kept iff its 8-bit random number is below this: round((1 - p) * 256), clamped to
    [1, 255] when p > 0 (256, every number, when p = 0)."""
    p = float(dropout_p)
    if p <= 0.0:
        return 256
    return min(255, max(1, int(round((1.0 - p) * 256))))


def keep_probability(dropout_p: float) -> float:
    """The probability that dropout keeps an element, keep_threshold / 256: 1 - p rounded to a multiple
    of 1/256 (at most 1/512 away for p in [1/512, 1 - 1/512]). Kept elements are scaled by its
    inverse, so the output's expectation is the output without dropout."""
    return keep_threshold(dropout_p) / 256.0


def dropout_keep_mask(rng_state, b: int, h: int, nheads: int, dropout_p: float,
                      q_start: int, q_stop: int, seqlen_k: int) -> np.ndarray:
    """Boolean keep mask of query rows [q_start, q_stop) x keys [0, seqlen_k) of (batch b, head h), as
    the kernels draw it (cuda_src/dropout.cuh): Philox key (seed_lo, seed_hi ^ offset_hi), counter
    (j // 32, 32 (i // 16) + lane, b nheads + h, offset_lo) with lane = 4 (i % 8) + (j % 8) // 2; the
    element's 8-bit number is byte 2 ((j % 32) // 16) + (i % 16) // 8 of word 2 ((j % 16) // 8) + j % 2."""
    seed, offset = (int(x) for x in rng_state)
    i = np.arange(q_start, q_stop, dtype=np.int64)[:, None]
    j = np.arange(seqlen_k, dtype=np.int64)[None, :]
    lane = 4 * (i % 8) + (j % 8) // 2
    words = philox4x32_10((j // 32, 32 * (i // 16) + lane, (b * nheads + h) & _M32, offset & _M32),
                          (seed & _M32, (seed >> 32) ^ (offset >> 32)))
    word = 2 * ((j % 16) // 8) + j % 2
    chosen = np.choose(np.broadcast_to(word, lane.shape), words)
    r8 = (chosen.astype(np.int64) >> (8 * (2 * ((j % 32) // 16) + (i % 16) // 8))) & 0xFF
    return r8 < keep_threshold(dropout_p)


@dataclass(frozen=True)
class _Mods:
    """The variants of one (batch b, head h): window, softcap, this head's ALiBi slope, dropout."""

    window: tuple = (-1, -1)
    softcap: float = 0.0
    slope: float = 0.0
    dropout_p: float = 0.0
    rng_state: tuple = (0, 0)
    b: int = 0
    h: int = 0
    nheads: int = 1
    diag_shift: int = 0  # d = i + seqlen_k - seqlen_q + diag_shift (mask and ALiBi)

    def keep(self, start: int, stop: int, seqlen_k: int) -> np.ndarray | None:
        """The dropout keep mask of query rows [start, stop), or None without dropout."""
        if self.dropout_p <= 0:
            return None
        return dropout_keep_mask(self.rng_state, self.b, self.h, self.nheads, self.dropout_p, start, stop, seqlen_k)


_NO_MODS = _Mods()


def _variants(batch: int, nheads: int, window_size, softcap, alibi_slopes, dropout_p, rng_state, diag_shift=0):
    """Checked variant arguments -> a function (b, h) -> _Mods."""
    window = tuple(int(w) for w in window_size)
    if len(window) != 2 or min(window) < -1:
        raise ValueError(f"window_size must be (left, right) with values >= -1, got {window_size!r}")
    softcap = float(softcap)
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    slopes = None
    if alibi_slopes is not None:
        slopes = _to_f64(alibi_slopes, "alibi_slopes")
        if slopes.shape == (nheads,):
            slopes = np.broadcast_to(slopes, (batch, nheads))
        _require_shape(slopes, "alibi_slopes", (batch, nheads))
    dropout_p = float(dropout_p)
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state = (seed, offset), the kernels' Philox stream")
    rng = (0, 0) if rng_state is None else tuple(int(x) for x in rng_state)

    def at(b: int, h: int) -> _Mods:
        return _Mods(window, softcap, 0.0 if slopes is None else float(slopes[b, h]), dropout_p, rng, b, h, nheads,
                     int(diag_shift))
    return at


def _scores(q: np.ndarray, k: np.ndarray, scale, mask: np.ndarray, mods: _Mods = _NO_MODS, start: int = 0,
            seqlen_q: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(S, T): S = scale * q k^T, softcapped (softcap * T, T = tanh(scale q k^T / softcap)) and ALiBi'd
    (- slope |d - j|, d = i + seqlen_k - seqlen_q + diag_shift for query row i = start + r), with invisible entries
    set to -inf (dtype of q kept); T is None without softcap."""
    S = (q @ k.T) * scale
    T = None
    if mods.softcap > 0:
        T = np.tanh(S / S.dtype.type(mods.softcap))
        S = S.dtype.type(mods.softcap) * T
    if mods.slope:
        seqlen_k = k.shape[0]
        d = np.arange(start, start + q.shape[0])[:, None] + (seqlen_k - (seqlen_q if seqlen_q is not None else q.shape[0])
                                                             + mods.diag_shift)
        S = S - S.dtype.type(mods.slope) * np.abs(d - np.arange(seqlen_k)[None, :]).astype(S.dtype)
    return np.where(mask, S, -np.inf).astype(S.dtype, copy=False), T


def _exp_rows(S: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unnormalized row softmax of masked scores: (E = exp(S - rowmax), l, lse) with l the row sums
    of E (1 where a row has no visible score: its E is 0 and its lse -inf)."""
    m = S.max(axis=1, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0).astype(S.dtype, copy=False)
    E = np.exp(S - m_safe[:, None])          # masked entries: exp(-inf) = 0
    l = E.sum(axis=1)
    seen = l > 0
    l_safe = np.where(seen, l, 1).astype(S.dtype, copy=False)
    lse = np.where(seen, m_safe + np.log(l_safe), -np.inf)
    return E, l_safe, lse


def _softmax_rows(S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stable row softmax of masked scores; returns (P, lse).

    Rows without a visible (finite) score get P = 0 and lse = -inf.
    """
    E, l, lse = _exp_rows(S)
    return E / l[:, None], lse


# ---------------------------------------------------------------------------
# One (batch, head) slice: q (seqlen_q, d), k and v (seqlen_k, d)
# ---------------------------------------------------------------------------

def _forward_head(q, k, v, scale, causal, rnd: Rounder = _identity, p_order: str = "normalized",
                  mods: _Mods = _NO_MODS):  # fmt: skip
    """Attention of one head.  ``rnd`` rounds P before P @ V (identity = exact); ``p_order`` says
    which P (plain_attention); ``mods`` the variants."""
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    out = np.zeros(q.shape, dtype=q.dtype)
    lse = np.full(seqlen_q, -np.inf)
    rp = q.dtype.type(1.0 / keep_probability(mods.dropout_p))
    for start, stop in _row_chunks(seqlen_q, seqlen_k):
        mask = visible_mask(seqlen_q, seqlen_k, causal, start, stop, mods.window, mods.diag_shift)
        S, _ = _scores(q[start:stop], k, scale, mask, mods, start, seqlen_q)
        E, l, lse[start:stop] = _exp_rows(S)
        keep = mods.keep(start, stop, seqlen_k)
        if keep is not None:  # dropped after the normalization: the row sums count every element
            E = np.where(keep, E, 0).astype(E.dtype, copy=False)
        if p_order == "normalized":
            out[start:stop] = rnd(E / l[:, None]) @ v
        elif p_order == "unnormalized":
            out[start:stop] = (rnd(E) @ v) / l[:, None]
        else:
            raise ValueError(f"p_order must be 'normalized' or 'unnormalized', got {p_order!r}")
        if keep is not None:
            out[start:stop] *= rp
    return out, lse


def _round_toward_zero_f32(x: np.ndarray) -> np.ndarray:
    """float64 values rounded toward zero to float32 (NumPy's cast rounds to nearest)."""
    r = x.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(x)
    r[over] = np.nextafter(r[over], np.float32(0))
    return r


#: Products a tensor-core MMA adds to its float32 accumulator at a time (Fasi et al. 2021, A100).
TENSOR_CORE_BLOCK = 8


def tensor_core_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` of float32 matrices holding fp16 / bf16 values, accumulated the way NVIDIA tensor
    cores accumulate into float32 (Fasi, Higham, Mikaitis, Pranesh 2021, "Numerical behavior of NVIDIA
    tensor cores", PeerJ Comput. Sci. 7:e330): the products exact, added to the accumulator
    TENSOR_CORE_BLOCK at a time, each sum rounded toward zero. (The hardware also truncates while it
    aligns the addends; the exact block sum here is the milder model.)"""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    for i in range(0, a.shape[1], TENSOR_CORE_BLOCK):
        block = a64[:, i : i + TENSOR_CORE_BLOCK] @ b64[i : i + TENSOR_CORE_BLOCK]
        acc = _round_toward_zero_f32(acc.astype(np.float64) + block)
    return acc


def _backward_head(dout, q, k, v, scale, causal, rnd: Rounder = _identity, o=None, d_order: str = "pairwise",
                   dp_order: str = "ieee", mods: _Mods = _NO_MODS, lse=None):  # fmt: skip
    """Gradients (dq, dk, dv) of one head.

    ``rnd`` rounds P, O and dS where a low-precision implementation would
    store them (identity = exact).  The gradients themselves are returned
    unrounded: callers accumulate dk and dv over a GQA group, then round.
    ``o``: the forward output handed to the backward (used for D); None
    recomputes it. ``lse`` (seqlen_q,): the log-sum-exp P is normalized with, as a kernel
    takes it from the forward (a block of a longer softmax: its P sums to less than 1); None
    normalizes over these keys.  ``d_order``: how D = rowsum(dO * O) is summed over the
    head dim, "pairwise" (NumPy's sum) or "sequential" (one running sum per
    row, left to right, as a loop per row would).  ``dp_order``: how dP = dO V^T
    is accumulated, "ieee" (a float32 matmul) or "tensor_core"
    (tensor_core_matmul, as an MMA on tensor cores sums it).
    """
    if d_order not in ("pairwise", "sequential"):
        raise ValueError(f"d_order must be 'pairwise' or 'sequential', got {d_order!r}")
    if dp_order not in ("ieee", "tensor_core"):
        raise ValueError(f"dp_order must be 'ieee' or 'tensor_core', got {dp_order!r}")
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    dq = np.zeros(q.shape, dtype=q.dtype)
    dk = np.zeros(k.shape, dtype=q.dtype)
    dv = np.zeros(v.shape, dtype=q.dtype)
    rp = q.dtype.type(1.0 / keep_probability(mods.dropout_p))
    for start, stop in _row_chunks(seqlen_q, seqlen_k):
        q_c, do_c = q[start:stop], dout[start:stop]
        mask = visible_mask(seqlen_q, seqlen_k, causal, start, stop, mods.window, mods.diag_shift)
        S, T = _scores(q_c, k, scale, mask, mods, start, seqlen_q)
        if lse is None:
            P, _ = _softmax_rows(S)
        else:  # exp(S - lse); rows with lse = -inf saw no key anywhere: P = 0
            lse_c = lse[start:stop, None]
            P = np.where(np.isfinite(lse_c), np.exp(S - np.where(np.isfinite(lse_c), lse_c, 0)), 0).astype(S.dtype)
        keep = mods.keep(start, stop, seqlen_k)
        Pd = P if keep is None else np.where(keep, P * rp, 0).astype(P.dtype, copy=False)  # dropped, scaled
        P_r = rnd(Pd)
        O = rnd(P_r @ v) if o is None else o[start:stop]  # the forward output, recomputed or given
        dv += P_r.T @ do_c                     # dV = Pd^T dO
        dP = do_c @ v.T if dp_order == "ieee" else tensor_core_matmul(do_c, v.T)  # dPd = dO V^T
        if keep is not None:                   # dP = Z dPd / keep probability
            dP = np.where(keep, dP * rp, 0).astype(dP.dtype, copy=False)
        if d_order == "pairwise":              # D = rowsum(dO * O)
            D = np.sum(do_c * O, axis=1)
        else:
            D = np.cumsum(do_c * O, axis=1, dtype=do_c.dtype)[:, -1] if O.shape[1] else np.zeros(len(O), do_c.dtype)
        dS = P * (dP - D[:, None])             # dS = P * (dP - D)
        if T is not None:                      # through the softcap: d(softcap tanh(x / softcap)) = 1 - tanh^2
            dS = dS * (1 - T * T)
        dS = rnd(dS)
        dq[start:stop] = (dS @ k) * scale      # dQ = scale * dS K
        dk += (dS.T @ q_c) * scale             # dK = scale * dS^T Q
    return dq, dk, dv


# ---------------------------------------------------------------------------
# Public oracle
# ---------------------------------------------------------------------------

def attention_forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout_p=0.0, rng_state=None, diag_shift=0):  # fmt: skip
    """Exact attention in float64, with the variants of the module docstring.

    Returns ``(out, lse)``: out ``(batch, seqlen_q, nheads, headdim)`` and
    lse ``(batch, nheads, seqlen_q)``, both float64 (lse of the scores the softmax
    sees: softcapped and ALiBi'd, before dropout). ``diag_shift`` moves the diagonal of causal,
    window and ALiBi (visible_mask).
    """
    q, k, v = _to_f64(q, "q"), _to_f64(k, "k"), _to_f64(v, "v")
    batch, seqlen_q, _, nheads, nheads_kv, headdim = _check_qkv(q, k, v)
    scale = _scale(softmax_scale, headdim)
    mods = _variants(batch, nheads, window_size, softcap, alibi_slopes, dropout_p, rng_state, diag_shift)
    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h, hk in _head_pairs(nheads, nheads_kv):
            out[b, :, h], lse[b, h] = _forward_head(
                q[b, :, h], k[b, :, hk], v[b, :, hk], scale, causal, mods=mods(b, h))
    return out, lse


def attention_backward(dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, dropout_p=0.0, rng_state=None, out=None, lse=None, diag_shift=0):  # fmt: skip
    """Exact gradients of ``sum(out * dout)`` in float64; returns (dq, dk, dv).

    With GQA, dk and dv of a kv head are summed over its query heads. The variants as in
    attention_forward (dropout: the same mask as the forward with the same rng_state).
    ``out`` (shape of q) and ``lse`` (batch, nheads, seqlen_q), as a kernel's backward takes them:
    D from that output, P normalized by that lse. Given the output and lse of attention over more
    keys than k, v hold (a block of a ring or a split), the result is that block's share of the
    gradients of the whole: dq to add up over the blocks, dk and dv of these keys.
    """
    q, k, v = _to_f64(q, "q"), _to_f64(k, "k"), _to_f64(v, "v")
    dout = _to_f64(dout, "dout")
    batch, _, _, nheads, nheads_kv, headdim = _check_qkv(q, k, v)
    _require_shape(dout, "dout", q.shape)
    scale = _scale(softmax_scale, headdim)
    mods = _variants(batch, nheads, window_size, softcap, alibi_slopes, dropout_p, rng_state, diag_shift)
    if lse is not None and out is None:
        raise ValueError("lse without out: a block's share needs the whole's output too (D = rowsum(dout * out))")
    o = None if out is None else _to_f64(out, "out")
    if o is not None:
        _require_shape(o, "out", q.shape)
    lse_all = None if lse is None else np.asarray(_to_host(lse), dtype=np.float64)
    if lse_all is not None:
        _require_shape(lse_all, "lse", (batch, nheads, q.shape[1]))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(batch):
        for h, hk in _head_pairs(nheads, nheads_kv):
            dq_h, dk_h, dv_h = _backward_head(
                dout[b, :, h], q[b, :, h], k[b, :, hk], v[b, :, hk], scale, causal, mods=mods(b, h),
                o=None if o is None else o[b, :, h], lse=None if lse_all is None else lse_all[b, h])
            dq[b, :, h] = dq_h
            dk[b, :, hk] += dk_h
            dv[b, :, hk] += dv_h
    return dq, dk, dv


# ---------------------------------------------------------------------------
# Packed variable-length batches (flash_attn_varlen_func) and rotary embedding
# ---------------------------------------------------------------------------

def _cu_seqlens(cu, total: int, name: str) -> np.ndarray:
    """cu_seqlens as int64 (batch + 1,): starts at 0, never decreases, ends at most at ``total``."""
    cu = np.asarray(_to_host(cu))
    if cu.ndim != 1 or cu.size < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D integer array (batch + 1,), got {cu.dtype} {cu.shape}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > total:
        raise ValueError(f"{name} must start at 0, never decrease and end at most at {total}, got {cu.tolist()}")
    return cu


def _varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k):
    q, k, v = _to_f64(q, "q"), _to_f64(k, "k"), _to_f64(v, "v")
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(f"varlen q, k, v are (total, nheads, headdim), got q {q.shape} and k {k.shape}")
    _require_shape(v, "v", k.shape)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[2]} and {k.shape[2]}")
    _check_heads(q.shape[1], k.shape[1])
    cu_q = _cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = _cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if cu_q.size != cu_k.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_q.size} and {cu_k.size}")
    return q, k, v, cu_q, cu_k


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                             rng_state=None):  # fmt: skip
    """Exact attention of a packed batch (``flash_attn_varlen_func``) in float64.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); sequence b is query rows
    ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` against keys ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]``
    (empty sequences allowed), causal and windows aligned bottom-right per sequence; the variants as in
    attention_forward, ALiBi slopes and the dropout stream of sequence b those of batch index b (a packed
    batch of equal lengths gives exactly the dense call's result). Returns ``(out, lse)``: out like q
    (rows outside every sequence 0), lse (nheads, total_q) as flash-attn returns it (-inf there).
    """
    q, k, v, cu_q, cu_k = _varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k)
    batch, nheads = cu_q.size - 1, q.shape[1]
    mods = _variants(batch, nheads, window_size, softcap, alibi_slopes, dropout_p, rng_state)
    scale = _scale(softmax_scale, q.shape[2])
    out = np.zeros(q.shape)
    lse = np.full((nheads, q.shape[0]), -np.inf)
    for b in range(batch):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start:
            continue
        for h, hk in _head_pairs(nheads, k.shape[1]):
            out[qs, h], lse[h, qs] = _forward_head(q[qs, h], k[ks, hk], v[ks, hk], scale, causal, mods=mods(b, h))
    return out, lse


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                              rng_state=None):  # fmt: skip
    """Exact gradients (dq, dk, dv) of ``sum(out * dout)`` for attention_varlen_forward, packed like q, k, v."""
    q, k, v, cu_q, cu_k = _varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k)
    dout = _to_f64(dout, "dout")
    _require_shape(dout, "dout", q.shape)
    batch, nheads = cu_q.size - 1, q.shape[1]
    mods = _variants(batch, nheads, window_size, softcap, alibi_slopes, dropout_p, rng_state)
    scale = _scale(softmax_scale, q.shape[2])
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(batch):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start or ks.stop == ks.start:
            continue
        for h, hk in _head_pairs(nheads, k.shape[1]):
            dq_h, dk_h, dv_h = _backward_head(dout[qs, h], q[qs, h], k[ks, hk], v[ks, hk], scale, causal,
                                              mods=mods(b, h))  # fmt: skip
            dq[qs, h] = dq_h
            dk[ks, hk] += dk_h
            dv[ks, hk] += dv_h
    return dq, dk, dv


def apply_rotary(x, cos, sin, *, interleaved=False, seqlen_offsets=0):
    """Rotary position embedding (flash-attn's ``apply_rotary_emb``) in float64.

    x: (batch, seqlen, nheads, headdim); cos, sin: (seqlen_ro, rotary_dim / 2) with rotary_dim <=
    headdim; token t of sequence b takes row ``seqlen_offsets[b] + t`` (an int or (batch,) ints) of cos
    and sin. The first rotary_dim channels are rotated, the rest pass through:
      interleaved=False (GPT-NeoX): pairs (i, i + rotary_dim / 2);
      interleaved=True (GPT-J): pairs (2i, 2i + 1);
    each pair (a, b) -> (a cos - b sin, a sin + b cos) with the pair's angle i.
    """
    x = _to_f64(x, "x")
    cos, sin = _to_f64(cos, "cos"), _to_f64(sin, "sin")
    _check_ndim4(x, "x", "(batch, seqlen, nheads, headdim)")
    batch, seqlen, _, headdim = x.shape
    if cos.ndim != 2 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must both be (seqlen_ro, rotary_dim / 2), got {cos.shape} and {sin.shape}")
    half = cos.shape[1]
    if not 0 < 2 * half <= headdim:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {2 * half} must be in [2, headdim = {headdim}]")
    offsets = np.broadcast_to(np.asarray(_to_host(seqlen_offsets), dtype=np.int64), (batch,))
    if np.any(offsets < 0) or np.any(offsets + seqlen > cos.shape[0]):
        raise ValueError(f"seqlen_offsets + seqlen ({seqlen}) must stay within the {cos.shape[0]} rows of cos / sin")
    out = x.copy()
    for b in range(batch):
        rows = np.arange(offsets[b], offsets[b] + seqlen)
        out[b] = _rotate(x[b], cos[rows], sin[rows], interleaved)
    return out


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x (seqlen, nheads, headdim) with token t rotated by row t of cos, sin (seqlen, rotary_dim / 2)."""
    half = cos.shape[1]
    c, s_ = cos[:, None, :], sin[:, None, :]
    lo, hi = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (slice(0, half), slice(half, 2 * half))
    out = x.copy()
    out[:, :, lo] = x[:, :, lo] * c - x[:, :, hi] * s_
    out[:, :, hi] = x[:, :, lo] * s_ + x[:, :, hi] * c
    return out


def _cache_lengths(cache_seqlens, batch: int, capacity: int) -> np.ndarray:
    """cache_seqlens (None, int or (batch,) ints) as an int64 array (batch,)."""
    if cache_seqlens is None:
        lengths = np.full(batch, capacity, dtype=np.int64)
    else:
        raw = np.asarray(_to_host(cache_seqlens))
        if raw.ndim == 0:
            lengths = np.full(batch, int(raw), dtype=np.int64)
        else:
            _require_shape(raw, "cache_seqlens", (batch,))
            if not np.issubdtype(raw.dtype, np.integer):
                raise ValueError(f"cache_seqlens must hold integers, got {raw.dtype}")
            lengths = raw.astype(np.int64)
    if np.any(lengths < 0) or np.any(lengths > capacity):
        raise ValueError(
            f"cache_seqlens must lie in [0, {capacity}], got {lengths.tolist()}")
    return lengths


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None,
                           cache_seqlens=None, block_table=None,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                           cache_batch_idx=None, cache_leftpad=None):
    """Decode-style attention against a KV cache (``flash_attn_with_kvcache``).

    Contiguous cache: k_cache, v_cache ``(batch_cache, seqlen_cache, nheads_kv,
    headdim)`` with ``batch_cache >= batch``; sequence b uses cache row b.
    Paged cache (``block_table`` given, int ``(batch, max_blocks_per_seq)``):
    k_cache, v_cache ``(num_blocks, page_size, nheads_kv, headdim)``; token t of
    sequence b is at ``[block_table[b, t // page_size], t % page_size]``.

    ``cache_seqlens`` (None = full capacity, an int, or ints ``(batch,)``) is
    the number of tokens already cached.  New ``k``, ``v``
    ``(batch, seqlen_new, nheads_kv, headdim)`` are written into float64
    copies of the caches right after them (ValueError if they do not fit);
    the inputs are never modified.  Sequence b then attends to its first
    ``L_b = cache_seqlens[b] + seqlen_new`` keys, causal aligned bottom-right
    against ``L_b``.

    The variants window_size, softcap and alibi_slopes as in attention_forward, aligned
    against ``L_b`` like causal.

    flash-attn's extras: ``cache_batch_idx`` (batch,) ints: sequence b uses cache row
    ``cache_batch_idx[b]`` (contiguous caches only). ``cache_leftpad`` (batch,) ints: cache positions
    before ``cache_leftpad[b]`` are padding; sequence b's keys are positions ``cache_leftpad[b] .. L_b``
    (its positions count from there). ``rotary_cos``, ``rotary_sin`` (seqlen_ro, rotary_dim / 2) with
    ``rotary_interleaved`` (apply_rotary's layouts): the new k is rotated at positions
    ``cache_seqlens[b] - cache_leftpad[b] + t`` before it is written to the cache; q at the same
    positions when causal or windowed, else every query token at position ``cache_seqlens[b] -
    cache_leftpad[b]``.

    Returns ``(out, lse, k_cache_new, v_cache_new)`` in float64.
    """
    q = _to_f64(q, "q")
    _check_ndim4(q, "q", "(batch, seqlen_q, nheads, headdim)")
    batch, seqlen_q, nheads, headdim = q.shape
    k_cache_new = np.array(_to_f64(k_cache, "k_cache"), copy=True)
    v_cache_new = np.array(_to_f64(v_cache, "v_cache"), copy=True)
    _check_ndim4(k_cache_new, "k_cache", "(batch_cache or num_blocks, seqlen, nheads_kv, headdim)")
    rows, slots, nheads_kv = k_cache_new.shape[:3]
    _require_shape(k_cache_new, "k_cache", (rows, slots, nheads_kv, headdim))
    _require_shape(v_cache_new, "v_cache", k_cache_new.shape)
    _check_heads(nheads, nheads_kv)

    cache_rows = np.arange(batch)
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("cache_batch_idx picks rows of a contiguous cache; a paged cache has block_table")
        cache_rows = np.asarray(_to_host(cache_batch_idx)).astype(np.int64)
        _require_shape(cache_rows, "cache_batch_idx", (batch,))
        if np.any(cache_rows < 0) or np.any(cache_rows >= rows):
            raise ValueError(f"cache_batch_idx must lie in [0, {rows}), got {cache_rows.tolist()}")
    if block_table is None:
        if cache_batch_idx is None and rows < batch:
            raise ValueError(f"k_cache has batch_cache={rows} rows, need >= batch={batch}")
        capacity = slots
    else:
        block_table = np.asarray(_to_host(block_table))
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(
                f"block_table must have shape ({batch}, max_blocks_per_seq), "
                f"got {block_table.shape}")
        if not np.issubdtype(block_table.dtype, np.integer):
            raise ValueError(f"block_table must hold integers, got {block_table.dtype}")
        capacity = block_table.shape[1] * slots

    def locate(b: int, positions: np.ndarray):
        """Index (rows, slots) of the given token positions of sequence b."""
        if block_table is None:
            return np.full_like(positions, cache_rows[b]), positions
        pages = block_table[b, positions // slots].astype(np.int64)
        if np.any(pages < 0) or np.any(pages >= rows):
            raise ValueError(f"block_table[{b}] refers to pages outside [0, {rows})")
        return pages, positions % slots

    lengths = _cache_lengths(cache_seqlens, batch, capacity)
    leftpad = np.zeros(batch, dtype=np.int64)
    if cache_leftpad is not None:
        leftpad = np.asarray(_to_host(cache_leftpad)).astype(np.int64)
        _require_shape(leftpad, "cache_leftpad", (batch,))
        if np.any(leftpad < 0) or np.any(leftpad > lengths):
            raise ValueError(f"cache_leftpad must lie in [0, cache_seqlens], got {leftpad.tolist()}")
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos and rotary_sin must be given together")
        cos, sin = _to_f64(rotary_cos, "rotary_cos"), _to_f64(rotary_sin, "rotary_sin")
        if cos.ndim != 2 or sin.shape != cos.shape or not 0 < 2 * cos.shape[1] <= headdim:
            raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), rotary_dim <= "
                             f"{headdim}; got {cos.shape} and {sin.shape}")  # fmt: skip
        first = lengths - leftpad  # the position of the first new token (and of the queries)

        def rotary_rows(pos: np.ndarray):
            if np.any(pos < 0) or np.any(pos >= cos.shape[0]):
                raise ValueError(f"rotary positions {pos.min()}..{pos.max()} outside the {cos.shape[0]} rows of "
                                 "rotary_cos / rotary_sin")
            return cos[pos], sin[pos]

        local = causal or tuple(window_size) != (-1, -1)
        q = q.copy()
        for b in range(batch):
            pos = first[b] + (np.arange(seqlen_q) if local else np.zeros(seqlen_q, dtype=np.int64))
            q[b] = _rotate(q[b], *rotary_rows(pos), rotary_interleaved)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        k, v = _to_f64(k, "k"), _to_f64(v, "v")
        _check_ndim4(k, "k", "(batch, seqlen_new, nheads_kv, headdim)")
        seqlen_new = k.shape[1]
        _require_shape(k, "k", (batch, seqlen_new, nheads_kv, headdim))
        _require_shape(v, "v", (batch, seqlen_new, nheads_kv, headdim))
        if np.any(lengths + seqlen_new > capacity):
            raise ValueError(
                f"{seqlen_new} new tokens do not fit: cache_seqlens "
                f"{lengths.tolist()} + {seqlen_new} exceeds capacity {capacity}")
        for b in range(batch):
            where = locate(b, np.arange(lengths[b], lengths[b] + seqlen_new))
            k_b = _rotate(k[b], *rotary_rows(first[b] + np.arange(seqlen_new)), rotary_interleaved) if rotary else k[b]
            k_cache_new[where] = k_b
            v_cache_new[where] = v[b]
        lengths = lengths + seqlen_new

    out = np.zeros(q.shape)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    slopes = None
    if alibi_slopes is not None:
        slopes = _to_f64(alibi_slopes, "alibi_slopes")
        slopes = np.broadcast_to(slopes, (batch, nheads)) if slopes.shape == (nheads,) else slopes
        _require_shape(slopes, "alibi_slopes", (batch, nheads))
    for b in range(batch):
        where = locate(b, np.arange(leftpad[b], lengths[b]))
        out[b:b + 1], lse[b:b + 1] = attention_forward(
            q[b:b + 1], k_cache_new[where][None], v_cache_new[where][None],
            causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            alibi_slopes=None if slopes is None else slopes[b:b + 1])
    return out, lse, k_cache_new, v_cache_new


# ---------------------------------------------------------------------------
# Plain low-precision implementation (sets the test tolerance)
# ---------------------------------------------------------------------------

_VARIANT_DEFAULTS = {"window_size": (-1, -1), "softcap": 0.0, "alibi_slopes": None, "dropout_p": 0.0, "rng_state": None,
                     "diag_shift": 0}


def _variant_args(variants: dict) -> dict:
    """The variant keywords (of attention_forward), defaults filled in; unknown keywords are an error."""
    unknown = set(variants) - set(_VARIANT_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown keyword arguments {sorted(unknown)}")
    return {**_VARIANT_DEFAULTS, **variants}

def _rounder(dtype) -> Rounder:
    """Round float32 values to ``dtype`` and back to float32."""
    dtype = np.dtype(dtype)

    def rnd(x: np.ndarray) -> np.ndarray:
        return x.astype(dtype).astype(np.float32)
    return rnd


def _round_input(x: np.ndarray, dtype) -> np.ndarray:
    """Round a float64 input straight to ``dtype`` (one rounding), as float32."""
    return x.astype(np.dtype(dtype)).astype(np.float32)


def plain_attention(q, k, v, *, causal=False, softmax_scale=None, dtype, p_order="normalized", **variants):
    """Attention the plain way in precision ``dtype`` (e.g. float16, bfloat16).

    Inputs are rounded to ``dtype``; S and the softmax are computed in float32;
    P is rounded to ``dtype``; P @ V is accumulated in float32 and the output
    rounded to ``dtype``.  Returned as float64 of q's shape.

    ``p_order``: which P is rounded. "normalized": P = softmax(S), the textbook
    order. "unnormalized": E = exp(S - rowmax), with P @ V divided by the row sum
    of the unrounded E afterwards (FlashAttention's order, as the kernels do).
    ``variants``: the variant keywords of attention_forward.
    """
    rnd = _rounder(dtype)
    q, k, v = _to_f64(q, "q"), _to_f64(k, "k"), _to_f64(v, "v")
    batch, _, _, nheads, nheads_kv, headdim = _check_qkv(q, k, v)
    mods = _variants(batch, nheads, **_variant_args(variants))
    q, k, v = (_round_input(x, dtype) for x in (q, k, v))
    scale = np.float32(_scale(softmax_scale, headdim))
    out = np.zeros(q.shape, dtype=np.float32)
    for b in range(batch):
        for h, hk in _head_pairs(nheads, nheads_kv):
            out[b, :, h], _ = _forward_head(
                q[b, :, h], k[b, :, hk], v[b, :, hk], scale, causal, rnd, p_order, mods(b, h))
    return rnd(out).astype(np.float64)


def plain_attention_bar(q, k, v, ref, *, causal=False, softmax_scale=None, dtype, **variants) -> np.ndarray:
    """The plain output the pass rule holds a kernel to (within_tolerance's ``plain_out``): of
    plain_attention's two orders of rounding P, the one farther from ``ref``. Both are plain
    implementations in the kernel's precision, and which lands nearer the exact result varies from
    input to input: e.g. bf16, head dim 1, 4 keys, where the normalized order rounded the output to
    the bf16 neighbour of the exact 0.62373 at 0.625 and FlashAttention's order to 0.621094."""
    outs = [plain_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype, p_order=o, **variants)
            for o in ("normalized", "unnormalized")]
    return worse_of(outs, ref)


def worse_of(outs, ref) -> np.ndarray:
    """The array of ``outs`` with the largest max_abs_error against ``ref`` (NaN counts as largest)."""
    errs = [max_abs_error(o, ref) for o in outs]
    return outs[max(range(len(outs)), key=lambda i: math.inf if math.isnan(errs[i]) else errs[i])]


def plain_attention_backward(dout, q, k, v, *, causal=False, softmax_scale=None, dtype, out=None,
                             d_order="pairwise", dp_order="ieee", **variants):  # fmt: skip
    """Gradients the plain way in precision ``dtype``; returns float64 (dq, dk, dv).

    Inputs are rounded to ``dtype``, the math runs in float32, P, O and dS are
    rounded to ``dtype`` before the matmuls that consume them, and the
    gradients are rounded to ``dtype`` at the end.

    ``out``: the forward output a backward pass is handed (shape of q), as
    ``attention_backward(dout, q, k, v, out, lse)`` receives it; D =
    rowsum(dO * out) then uses it, as any implementation of that API does.
    None recomputes O the plain way. (The difference matters for tiny
    problems: with one query row, D's rounding error alone decides the error
    of every dK / dQ element, and an O recomputed here rounds independently
    of the one the kernel under test was given.)

    ``d_order``: the summation order of D over the head dim ("pairwise" or
    "sequential"); ``dp_order``: how dP = dO V^T is accumulated ("ieee" or
    "tensor_core"); see plain_attention_backward_bar. ``variants``: the variant keywords of
    attention_backward.
    """
    rnd = _rounder(dtype)
    q, k, v = _to_f64(q, "q"), _to_f64(k, "k"), _to_f64(v, "v")
    dout = _to_f64(dout, "dout")
    batch, _, _, nheads, nheads_kv, headdim = _check_qkv(q, k, v)
    mods = _variants(batch, nheads, **_variant_args(variants))
    _require_shape(dout, "dout", q.shape)
    dout, q, k, v = (_round_input(x, dtype) for x in (dout, q, k, v))
    if out is not None:
        out = _round_input(_to_f64(out, "out"), dtype)
        _require_shape(out, "out", q.shape)
    scale = np.float32(_scale(softmax_scale, headdim))
    dq = np.zeros(q.shape, dtype=np.float32)
    dk = np.zeros(k.shape, dtype=np.float32)
    dv = np.zeros(v.shape, dtype=np.float32)
    for b in range(batch):
        for h, hk in _head_pairs(nheads, nheads_kv):
            dq_h, dk_h, dv_h = _backward_head(
                dout[b, :, h], q[b, :, h], k[b, :, hk], v[b, :, hk], scale, causal, rnd,
                None if out is None else out[b, :, h], d_order, dp_order, mods(b, h))
            dq[b, :, h] = dq_h
            dk[b, :, hk] += dk_h
            dv[b, :, hk] += dv_h
    return tuple(rnd(x).astype(np.float64) for x in (dq, dk, dv))


def plain_attention_backward_bar(dout, q, k, v, refs, *, causal=False, softmax_scale=None, dtype, out=None,
                                 **variants):  # fmt: skip
    """The plain gradients the pass rule holds a kernel to: per gradient (dq, dk, dv), of three plain
    implementations in the kernel's precision, the one farther from ``refs`` (the exact gradients):
    D = rowsum(dO * O) summed pairwise or left to right with dP = dO V^T a float32 matmul, and D
    summed pairwise with dP accumulated as on tensor cores (tensor_core_matmul), as a GPU
    implementation computes it. Where dS = P (dP - D) cancels exactly in exact arithmetic (one key:
    P = 1, O = V, D = dP), the gradients dQ and dK are exactly 0 and their error is the rounding of
    dP - D alone, which the summation orders decide: fp16, head dim 128, 30 queries, 1 key: the plain
    dK error is 7.5e-6 with NumPy's pairwise sum and ~4x that summed left to right; fp16, head dim
    224, 1 query, 1 key (Hypothesis seed 258): every IEEE float32 order gives dP - D = 0 exactly,
    the tensor-core accumulation ~3 float32 ulps of dP (the kernel's dQ error on the H200)."""
    per_order = [plain_attention_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype,
                                          out=out, d_order=o, dp_order=p, **variants)
                 for o, p in (("pairwise", "ieee"), ("sequential", "ieee"), ("pairwise", "tensor_core"))]  # fmt: skip
    return tuple(worse_of([g[i] for g in per_order], refs[i]) for i in range(3))


# ---------------------------------------------------------------------------
# Comparison helpers
# ---------------------------------------------------------------------------

def max_abs_error(a, b) -> float:
    """max |a - b| in float64 (0.0 for empty arrays).

    Returns NaN if either array contains NaN.  Entries that are equal
    (including equal infinities, e.g. lse = -inf on both sides) count as 0.
    """
    a, b = _to_f64(a, "a"), _to_f64(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: a has shape {a.shape}, b has shape {b.shape}")
    if np.isnan(a).any() or np.isnan(b).any():
        return float("nan")
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        diff = np.where(a == b, 0.0, np.abs(a - b))
    return float(np.max(diff))


def within_tolerance(kernel_out, ref, plain_out, factor=2.0, atol=1e-5) -> bool:
    """The kernel pass rule:
    ``max|kernel - ref| <= factor * max|plain - ref| + atol``.

    Shapes must match exactly; any NaN (in any argument) fails.
    """
    kernel_out, ref = _to_f64(kernel_out, "kernel_out"), _to_f64(ref, "ref")
    plain_out = _to_f64(plain_out, "plain_out")
    if kernel_out.shape != ref.shape or plain_out.shape != ref.shape:
        return False
    err = max_abs_error(kernel_out, ref)
    bound = factor * max_abs_error(plain_out, ref) + atol
    if math.isnan(err) or math.isnan(bound):
        return False
    return err <= bound
