"""How a torch call reaches the CuPy API: zero-copy tensors, torch's stream, torch's allocator, torch's RNG.

Every op in cuflash.torch.ops runs its CuPy call inside ``call(device)``, which makes

- ``device`` the current CUDA device (torch's and CuPy's: both read the runtime's);
- torch's current stream CuPy's current stream, so the kernels are ordered with the caller's torch
  work and are captured when that stream is capturing a CUDA graph;
- torch's caching allocator CuPy's allocator, so every buffer cuflash allocates (outputs, lse, the
  backward's fp32 scratch, the split-KV workspace, rotary copies) comes from torch: memory shows up in
  ``torch.cuda.max_memory_allocated``, there is one pool instead of two, and under graph capture the
  buffers come from the graph's private pool (CuPy's own pool would call cudaMalloc during capture).

Tensors cross without a copy, the memory shared: a torch tensor becomes a CuPy array over its pointer
and strides (owning a reference to the tensor), and an output CuPy allocated through torch's allocator
becomes a tensor over the storage of the torch block it lives in (not a view of the block). DLPack is the
fallback for anything else (its stream handshake cost ~10 us per tensor on the H200 machine, most of a
decode step's host time).
"""
from __future__ import annotations

import contextlib

import torch

import ml_dtypes
import numpy as np

from ..checks import cupy_module

_ALLOCATORS: dict = {}  # device index -> CuPy allocator function drawing from torch's caching allocator
#: torch dtype -> NumPy dtype of the arrays that cross by pointer (others go through DLPack).
_NUMPY_DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
                 torch.float32: np.dtype(np.float32), torch.int32: np.dtype(np.int32),
                 torch.int64: np.dtype(np.int64)}  # fmt: skip
_TORCH_DTYPES = {v: k for k, v in _NUMPY_DTYPES.items()}


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def needs_copy(t: torch.Tensor) -> bool:
    """Whether ``to_cupy`` copies ``t``: the kernels need a contiguous last dimension."""
    return bool(t.dim()) and t.stride(-1) != 1 and t.shape[-1] > 1


def to_cupy(t: torch.Tensor, name: str = "tensor", copy_ok: bool = True):
    """A CuPy view of ``t`` (same memory). The kernels need a contiguous last dimension: anything else
    is copied once (needs_copy), unless ``copy_ok`` is False (a cache the kernels write in place), then an error."""
    t = t.detach()  # DLPack carries no autograd history; the memory is shared either way
    if needs_copy(t):
        if not copy_ok:
            raise ValueError(
                f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}): cuflash writes it in "
                f"place, and a copy would hide the write from you"
            )
        t = t.contiguous()
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None or not t.is_cuda:
        return cupy_module().from_dlpack(t)
    cp = cupy_module()
    itemsize = dtype.itemsize
    span = 0 if t.numel() == 0 else (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * itemsize
    mem = cp.cuda.UnownedMemory(t.data_ptr(), span, t, t.device.index)
    return cp.ndarray(tuple(t.shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0),
                      strides=tuple(st * itemsize for st in t.stride()))


def desc(t: torch.Tensor) -> tuple | None:
    """What the prepared paths' call signatures (cuflash.kvcache, forward, varlen) hold of an array, for a
    torch tensor: (shape, strides in bytes, NumPy dtype, device index), as ``to_cupy(t)`` would give them
    (None for a dtype that crosses by DLPack, or a tensor ``to_cupy`` would copy: such a call takes the
    whole way)."""
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None or not t.is_cuda or needs_copy(t):
        return None
    n = dtype.itemsize
    return tuple(t.shape), tuple(st * n for st in t.stride()), dtype, t.device.index


def raw_stream(index: int) -> int:
    """The handle of torch's current CUDA stream on device ``index`` (without building a torch.cuda.Stream)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(index) if get is not None else torch.cuda.current_stream(index).cuda_stream


def to_cupy_opt(t, name: str = "tensor"):
    return None if t is None else to_cupy(t, name)


def to_torch(x) -> torch.Tensor:
    """The torch tensor over CuPy array ``x``: over the storage of the torch block it was allocated in (call's
    allocator), else through DLPack. Not a view of the block (``set_``, not ``as_strided``): autograd treats
    the output as it treats the prepared path's ``torch.empty`` ones, so an in-place edit of a saved output
    raises at the backward, on a signature's first call and on later ones alike."""
    owner = getattr(x.data.mem, "_owner", None)
    dtype = _TORCH_DTYPES.get(x.dtype)
    itemsize = x.itemsize
    if isinstance(owner, torch.Tensor) and owner.dtype == torch.uint8 and dtype is not None:
        offset = x.data.ptr - owner.data_ptr()
        if offset % itemsize == 0 and all(s % itemsize == 0 for s in x.strides):
            t = torch.empty(0, dtype=dtype, device=owner.device)
            return t.set_(owner.untyped_storage(), offset // itemsize, x.shape, tuple(s // itemsize for s in x.strides))
    return torch.from_dlpack(x)


_STREAMS: dict = {}  # (device index, stream handle) -> CuPy's view of that stream


class _Handle:
    """A stream handle in the CUDA stream protocol (what CuPy's Stream.from_external takes)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return 0, self.handle


def _stream(index: int):
    """CuPy view of torch's current CUDA stream on device ``index`` (which must be the current device: CuPy
    records the current device in the view it builds; call() holds it), made once per stream handle: through
    the CUDA stream protocol where CuPy has Stream.from_external (CuPy 14 deprecates ExternalStream).
    (torch.cuda.current_stream() builds a Python object per call: ~25 us of a decode step's host time on
    the H200 machine, docs/history/torch.md.)"""
    handle = raw_stream(index)
    stream = _STREAMS.get((index, handle))
    if stream is None:
        cp = cupy_module()
        from_external = getattr(cp.cuda.Stream, "from_external", None)
        if from_external is not None:
            stream = from_external(_Handle(handle))
        else:
            stream = cp.cuda.ExternalStream(handle, index)
        if len(_STREAMS) >= 256:  # (streams come and go in some programs: keep the dict small)
            _STREAMS.clear()
        _STREAMS[(index, handle)] = stream
    return stream


def _allocator(index: int):
    fn = _ALLOCATORS.get(index)
    if fn is None:
        cp = cupy_module()
        device = torch.device("cuda", index)

        def fn(nbytes: int):
            # The tensor owns the block; CuPy's MemoryPointer keeps the tensor alive, and torch reuses
            # the block once the last CuPy array and the last torch tensor over its storage (to_torch) are gone.
            block = torch.empty(-(-max(int(nbytes), 1) // 16) * 16, dtype=torch.uint8, device=device)
            mem = cp.cuda.UnownedMemory(block.data_ptr(), nbytes, block, index)
            return cp.cuda.MemoryPointer(mem, 0)

        _ALLOCATORS[index] = fn
    return fn


@contextlib.contextmanager
def call(device: torch.device):
    """The context of one CuPy call on behalf of torch tensors on ``device`` (see the module docstring)."""
    index = device_index(device)
    cp = cupy_module()
    with torch.cuda.device(index), _stream(index), cp.cuda.using_allocator(_allocator(index)):
        yield cp


# Dropout's random stream: a (seed, offset) pair for cuflash's Philox from torch's CUDA generator.
_U64 = 2**64


def draw_rng(device: torch.device) -> tuple[int, int]:
    """A (seed, offset) from torch's CUDA generator of ``device``: its seed, and an offset reserved by
    advancing the generator (so torch.manual_seed makes runs reproducible and successive calls draw
    different masks)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "cuflash dropout under CUDA graph capture: the Philox seed and offset are host values baked into "
            "the captured launch, so every replay would drop the same elements; capture with dropout_p=0, "
            "or run the dropout step outside the graph"
        )
    gen = torch.cuda.default_generators[device_index(device)]
    offset = gen.get_offset()
    gen.set_offset(offset + 4)  # torch's Philox offsets move in steps of 4
    return gen.initial_seed() % _U64, int(offset)


def rng_tensor(rng: tuple[int, int] | None, device: torch.device) -> torch.Tensor:
    """The (seed, offset) as an int64 CUDA tensor (2,) for the backward (zeros without dropout). The seed
    is stored modulo 2**64 as a signed value."""
    if rng is None:
        return torch.zeros(2, dtype=torch.int64, device=device)
    seed, offset = rng
    signed = seed - _U64 if seed >= 2**63 else seed
    t = torch.empty(2, dtype=torch.int64, device=device)
    t[0].fill_(signed)  # two fill kernels on the stream: a copy from host memory would synchronize it
    t[1].fill_(offset)
    return t


def rng_from_tensor(t: torch.Tensor) -> tuple[int, int]:
    """(seed, offset) back from ``rng_tensor``: a read from the GPU (one synchronization, dropout only)."""
    seed, offset = t.tolist()
    return seed % _U64, offset
