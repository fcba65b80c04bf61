"""The attention variants at the API boundary: sliding window, softcap, ALiBi and dropout, checked and
turned into what the kernels take (which variant bits to compile, cuda_src/masks.cuh; the ModParams
record, cuda_src/params.h).

Semantics (flash-attn's): for query i of seqlen_q against seqlen_k keys, d = i + seqlen_k - seqlen_q is
the key it is aligned to (bottom-right, like causal).
  window_size = (left, right), -1 = unbounded: key j is visible iff d - left <= j <= d + right; causal
      is the window (-1, 0), and with both the right side is 0.
  softcap > 0: the scaled score s becomes softcap * tanh(s / softcap).
  alibi_slopes (nheads,) or (batch, nheads) float32: the score gets - slope * |d - j| (after the softcap).
  dropout_p in [0, 1): each probability is kept with probability 1 - p, rounded to a multiple of 1/256
      (8-bit random numbers, as flash-attn; reference.keep_probability), and scaled by the inverse of
      that probability, after the normalization; the keep mask is a Philox4x32-10 stream of rng_state = (seed, offset)
      (cuda_src/dropout.cuh, reproduced by cuflash.reference.dropout_keep_mask).
  diag_shift (forward and backward): d = i + seqlen_k - seqlen_q + diag_shift, for the causal mask, the
      window and ALiBi alike: a call on a piece of a longer sequence (query i at absolute position
      q0 + i, key j at k0 + j) passes diag_shift = q0 - k0 - (seqlen_k - seqlen_q) to see the whole's
      masks and biases (ring attention's chunk pairs). A shifted causal mask runs on the window kernels.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from .plan import MOD_ALIBI, MOD_DROPOUT, MOD_SOFTCAP, MOD_WINDOW
from .reference import keep_probability, keep_threshold

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class Variants:
    """One call's variants as the kernels run them."""

    mods: int = 0  # MOD_* bits compiled into the kernel
    causal: bool = False  # the kernel's causal flag (a window kernel carries causal in window_right = 0)
    window: tuple[int, int] = (0, 0)  # (left, right) the kernel applies (MOD_WINDOW), both >= 0
    softcap: float = 0.0
    alibi_ptr: int = 0  # float32 slopes on the device
    alibi_batch_stride: int = 0  # elements between batch rows (0: one row for every batch)
    dropout_p: float = 0.0
    rng_state: tuple[int, int] | None = None  # (seed, offset), with dropout
    diag_shift: int = 0  # moves the diagonal (window and ALiBi kernels; 0 in every other)

    def unit_scale(self, softmax_scale: float) -> float:
        """The softmax's unit scale: what the kernel's softmax multiplies its working scores by
        (softcap with softcap: the working score is tanh(s softmax_scale / softcap))."""
        return self.softcap if self.mods & MOD_SOFTCAP else softmax_scale

    def record(self, softmax_scale: float, cu_seqlens_q: int = 0, cu_seqlens_k: int = 0, seqused_k: int = 0,
               paged: tuple = (0, 0, 0, 0, 0)) -> tuple:  # fmt: skip
        """The ModParams fields (cuflash/params.py MOD_FIELDS order); the cu_seqlens / seqused_k device
        pointers of a varlen call (0 otherwise) and its paged K/V (block_table pointer, its row stride,
        page_size, num_pages, page_capacity); diag_shift last."""
        seed, offset = self.rng_state or (0, 0)
        unit = self.unit_scale(softmax_scale)
        softcap_scale = softmax_scale / self.softcap if self.mods & MOD_SOFTCAP else 0.0
        keep = keep_threshold(self.dropout_p) if self.mods & MOD_DROPOUT else 0
        bt, bt_stride, page_size, num_pages, capacity = paged
        return (self.alibi_ptr, self.alibi_batch_stride, seed, offset, cu_seqlens_q, cu_seqlens_k, seqused_k, bt,
                bt_stride, self.window[0], self.window[1], softcap_scale, 1.0 / unit, 1.0 / keep_probability(self.dropout_p), keep,
                page_size, num_pages, capacity, self.diag_shift)  # fmt: skip



def resolve(
    *,
    causal: bool,
    window_size,
    softcap,
    alibi_slopes,
    dropout_p,
    rng_state,
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    device_id: int,
    cupy,
    allow_dropout: bool = True,
    new_rng_state: bool = True,
    diag_shift: int = 0,
) -> Variants:
    """Check the variant arguments of one call and resolve them for the kernels. seqlen_k: the keys
    a query may see at most (decode: the cache capacity plus new tokens). A window that reaches past
    every key on a side is unbounded on that side; what is left decides the kernel: plain, causal,
    or windowed. new_rng_state: with dropout and rng_state None, draw a fresh (seed, 0) (the forward);
    else rng_state is required (the backward replays the forward's). diag_shift: moves the diagonal
    (module docstring); it changes nothing in a call without causal, window or ALiBi."""
    if type(window_size) is tuple and window_size == (-1, -1) and alibi_slopes is None and type(softcap) in (int, float) and softcap == 0 \
            and type(dropout_p) in (int, float) and dropout_p == 0 and type(diag_shift) is int \
            and (diag_shift == 0 or not causal and abs(diag_shift) <= _MAX_SHIFT):
        return _PLAIN_CAUSAL if causal else _PLAIN  # every call without variants: nothing to check or build
    shift = _diag_shift(diag_shift)
    left, right = _window(window_size)
    softcap = _softcap(softcap)
    dropout_p = _dropout_p(dropout_p)
    if dropout_p > 0 and not allow_dropout:
        raise ValueError("dropout_p must be 0 here: dropout is a training feature; decode with a KV cache has none")
    mods = 0
    kernel_causal = False
    window = (0, 0)
    if causal:
        right = 0
    # Rows' diagonals d run over [seqlen_k - seqlen_q + shift, seqlen_k - 1 + shift].
    left_open = left < 0 or left >= seqlen_k - 1 + shift  # d - left <= 0 for every row: every key on the left
    right_open = right < 0 or right >= seqlen_q - 1 - shift  # d + right >= seqlen_k - 1 for every row
    open_left, open_right = max(seqlen_k, seqlen_k + shift), max(seqlen_q, seqlen_q - shift)  # as wide as unbounded
    if not left_open:
        mods |= MOD_WINDOW
        window = (left, open_right if right_open else right)
    elif shift == 0 and (causal or right == 0 and not right_open):
        kernel_causal = True  # the window (-1, 0) is causal
    elif not right_open:
        mods |= MOD_WINDOW  # (a shifted causal mask too: only the window kernels read diag_shift)
        window = (open_left, right)
    if softcap > 0:
        mods |= MOD_SOFTCAP
    alibi_ptr = alibi_stride = 0
    if alibi_slopes is not None:
        alibi_ptr, alibi_stride = _alibi(alibi_slopes, batch, nheads, device_id, cupy)
        mods |= MOD_ALIBI
    state = None
    if dropout_p > 0:
        mods |= MOD_DROPOUT
        if rng_state is None:
            if not new_rng_state:
                raise ValueError("dropout_p > 0: pass the rng_state the forward returned (it regenerates the same mask)")
            rng_state = (secrets.randbits(64), 0)
        state = _rng_state(rng_state)
    shift = shift if mods & (MOD_WINDOW | MOD_ALIBI) else 0  # (nothing else depends on the diagonal)
    return Variants(mods, kernel_causal, window, softcap, alibi_ptr, alibi_stride, dropout_p, state, shift)


_PLAIN, _PLAIN_CAUSAL = Variants(), Variants(causal=True)


def _window(window_size) -> tuple[int, int]:
    try:
        left, right = window_size
        left, right = _int(left), _int(right)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of ints (left, right), -1 meaning unbounded; got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size values must be >= -1 (-1: unbounded), got {window_size!r}")
    return left, right


_MAX_SHIFT = 2**24  # |diag_shift| bound: ALiBi's distances are floats in the kernels (exact integers below 2^24)


def _diag_shift(diag_shift) -> int:
    try:
        shift = _int(diag_shift)
    except TypeError:
        raise ValueError(f"diag_shift must be an int, got {diag_shift!r}") from None
    if abs(shift) > _MAX_SHIFT:
        raise ValueError(f"diag_shift must be within +-2**24, got {shift}")
    return shift


def _int(x) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(x)
    return int(x)


def _softcap(softcap) -> float:
    try:
        value = float(softcap)
    except (TypeError, ValueError):
        raise ValueError(f"softcap must be a number >= 0 (0: off), got {softcap!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    return value


def _dropout_p(dropout_p) -> float:
    try:
        value = float(dropout_p)
    except (TypeError, ValueError):
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}") from None
    if not 0 <= value < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return value


def _rng_state(rng_state) -> tuple[int, int]:
    try:
        seed, offset = rng_state
        seed, offset = _int(seed), _int(offset)
    except (TypeError, ValueError):
        raise ValueError(f"rng_state must be (seed, offset), two ints in [0, 2**64), got {rng_state!r}") from None
    if not (0 <= seed < 2**64 and 0 <= offset < 2**64):
        raise ValueError(f"rng_state must be (seed, offset), two ints in [0, 2**64), got {rng_state!r}")
    return seed, offset


def _alibi(alibi_slopes, batch: int, nheads: int, device_id: int, cupy) -> tuple[int, int]:
    """(device pointer, batch stride in elements) of checked ALiBi slopes."""
    if not isinstance(alibi_slopes, cupy.ndarray):
        raise TypeError(f"alibi_slopes must be a cupy.ndarray of float32 on q's device, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != np.float32:
        raise ValueError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads}), "
                         f"got {alibi_slopes.shape}")  # fmt: skip
    if alibi_slopes.device.id != device_id:
        raise ValueError(f"alibi_slopes is on device {alibi_slopes.device.id}, q on device {device_id}")
    strides = [s // 4 for s in alibi_slopes.strides]
    if nheads > 1 and strides[-1] != 1:
        raise ValueError("alibi_slopes must be contiguous along the heads; pass cupy.ascontiguousarray(alibi_slopes)")
    batch_stride = strides[0] if alibi_slopes.ndim == 2 and batch > 1 else 0
    return alibi_slopes.data.ptr, batch_stride
