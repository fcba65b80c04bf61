"""The host side of the TMA kernels (cuflash/tma.py): tensor-map geometry from array shapes and strides,
the arguments handed to the driver's cuTensorMapEncodeTiled, and the parameter record of the
warp-specialized forward. No GPU needed (the driver call is replaced where one is made)."""
from __future__ import annotations

import ctypes

import pytest

from cuflash import jit, launch, tma
from cuflash.params import FWD_PACKER


def test_geometry_is_innermost_first_in_bytes():
    # (batch 2, rows 100, heads 8, d 128), contiguous: rows 8 * 128 elements apart
    dims, strides = tma.map_geometry((2, 100, 8, 128), (100 * 8 * 128, 8 * 128, 128, 1))
    assert dims == (128, 100, 8, 2)
    assert strides == (8 * 128 * 2, 128 * 2, 100 * 8 * 128 * 2)


def test_size_one_dims_get_a_packed_stride():
    """A dim of size 1 is never stepped (cuflash accepts any stride there); the driver still wants a
    multiple of 16, so it gets the packed one."""
    dims, strides = tma.map_geometry((1, 1, 1, 64), (7, 3, 5, 1))
    assert dims == (64, 1, 1, 1) and strides == (128, 128, 128)
    dims, strides = tma.map_geometry((1, 300, 4, 8), (0, 3 * 4 * 8, 8, 1))  # varlen's q[None]: batch 1
    assert strides == (192, 16, 64)  # (the batch's: the last stride x its count, a multiple of 16)


def test_geometry_checks_name_the_driver_rules():
    assert tma.check_geometry(256, (2, 10, 4, 64), (2560, 256, 64, 1)) is None
    assert "16-byte" in tma.check_geometry(8, (2, 10, 4, 64), (2560, 256, 64, 1))
    assert "multiples of 16" in tma.check_geometry(256, (2, 10, 4, 64), (2560, 260, 64, 1))  # 520-byte rows
    assert "dimensions" in tma.check_geometry(256, (2, 0, 4, 64), (2560, 256, 64, 1))  # no rows


def test_encode_passes_the_map_to_the_driver(monkeypatch):
    seen = {}

    def fake(addr, dtype, rank, ptr, dims, strides, box, elem, interleave, swizzle, l2, oob):
        seen.update(addr=addr, dtype=dtype, rank=rank, ptr=ptr, dims=list(dims), strides=list(strides),
                    box=list(box), elem=list(elem), flags=(interleave, swizzle, l2, oob))  # fmt: skip
        ctypes.memmove(addr, bytes(range(128)), 128)
        return 0

    monkeypatch.setattr(tma, "_encode_tiled", lambda: fake)
    tma.encode.cache_clear()
    try:
        got = tma.encode(4096, (2, 100, 8, 120), (100 * 8 * 128, 8 * 128, 128, 1), "bf16", 128)
    finally:
        tma.encode.cache_clear()
    assert got == bytes(range(128))
    assert seen["addr"] % 64 == 0 and seen["rank"] == 4 and seen["ptr"] == 4096 and seen["dtype"] == tma.DATA_TYPE["bf16"]
    assert seen["dims"] == [120, 100, 8, 2]  # the real head dim: the bucket's other columns arrive as zeros
    assert seen["strides"] == [2048, 256, 204800] and seen["box"] == [64, 128, 1, 1] and seen["elem"] == [1, 1, 1, 1]
    assert seen["flags"] == (tma.INTERLEAVE_NONE, tma.SWIZZLE_128B, tma.L2_PROMOTION_128B, tma.OOB_FILL_ZEROS)


def test_refusals_raise_tensor_map_error(monkeypatch):
    monkeypatch.setattr(tma, "_encode_tiled", lambda: (lambda *a: 1))  # CUDA_ERROR_INVALID_VALUE
    tma.encode.cache_clear()
    try:
        with pytest.raises(tma.TensorMapError, match="CUresult 1"):
            tma.encode(4096, (1, 10, 1, 64), (640, 64, 64, 1), "fp16", 64)
        with pytest.raises(tma.TensorMapError, match="16-byte"):
            tma.encode(4100, (1, 10, 1, 64), (640, 64, 64, 1), "fp16", 64)
        monkeypatch.setattr(tma, "_encode_tiled", lambda: None)
        with pytest.raises(tma.TensorMapError, match="no CUDA driver"):
            tma.encode(4096, (1, 10, 1, 64), (640, 64, 64, 1), "fp16", 64)
    finally:
        tma.encode.cache_clear()


_PACKED = (100 * 4 * 64 * 2, 4 * 64 * 2, 64 * 2, 2)  # byte strides of a packed (2, 100, 4, 64) bf16 tensor


class View:
    """What fwd_maps reads of a CuPy array: the data pointer, a (2, 100, 4, 64) shape, byte strides."""

    def __init__(self, ptr, strides=_PACKED):
        self.data = type("Data", (), {"ptr": ptr})()
        self.shape, self.strides = (2, 100, 4, 64), strides


def test_the_output_map_only_where_the_kernel_stores_by_tma(monkeypatch):
    """fwd_maps encodes four maps (q, k, v, o) for a kernel that stores O with TMA; for one that does not
    (store_o=False: persistent tiles, packed batches) the o map is 128 zero bytes and the output's
    geometry is never given to the driver (an output no tensor map describes is then fine)."""

    seen = []

    def fake(addr, dtype, rank, ptr, dims, strides, box, *rest):
        seen.append(ptr)
        ctypes.memmove(addr, bytes([ptr // 4096]) * 128, 128)
        return 0

    monkeypatch.setattr(tma, "_encode_tiled", lambda: fake)
    q, k, v, o = (View(4096 * (i + 1)) for i in range(4))
    backwards = View(4096 * 9, (100 * 4 * 64 * 2, -4 * 64 * 2, 64 * 2, 2))  # rows run backwards: no map
    tma.encode.cache_clear()
    try:
        four = tma.fwd_maps(q, k, v, o, "bf16", 128, 128)
        assert seen == [4096, 8192, 12288, 16384] and four[384:] == bytes([4]) * 128
        seen.clear()
        three = tma.fwd_maps(q, k, v, backwards, "bf16", 128, 128, store_o=False)
        assert seen == [] and three == four[:384] + bytes(128)  # (q, k, v from the cache)
        with pytest.raises(tma.TensorMapError):
            tma.fwd_maps(q, k, v, backwards, "bf16", 128, 128)
    finally:
        tma.encode.cache_clear()


def test_cluster_maps_box_each_ctas_share_of_a_key_tile(monkeypatch):
    """With clusters (each CTA loads block_n / cluster rows of every K/V tile and multicasts them), the
    K and V boxes are that share; Q's and O's boxes do not change; a share that is not whole is refused."""

    boxes = []

    def fake(addr, dtype, rank, ptr, dims, strides, box, *rest):
        boxes.append(box[1])
        return 0

    monkeypatch.setattr(tma, "_encode_tiled", lambda: fake)
    tma.encode.cache_clear()
    try:
        q, k, v, o = (View(4096 * (i + 1)) for i in range(4))
        tma.fwd_maps(q, k, v, o, "bf16", 128, 80, cluster=2)
        assert boxes == [128, 40, 40, tma.O_BOX_ROWS]
        boxes.clear()
        tma.fwd_maps(q, k, v, o, "bf16", 128, 80)
        assert boxes == [80, 80]  # (q and o from the cache)
        with pytest.raises(ValueError, match="cluster"):
            tma.fwd_maps(q, k, v, o, "bf16", 128, 80, cluster=3)
    finally:
        tma.encode.cache_clear()


def test_the_record_fits_the_aligned_launch_buffer():
    """FwdTmaParams = 4 maps of 128 bytes (q, k, v, o), then FwdParams at offset 512 (the kernel header
    asserts it); the launch buffer holds it, its size rounded up to the maps' 64-byte alignment, and is 64-byte
    aligned, as a CUtensorMap must be."""
    assert 4 * tma.MAP_BYTES + -(-FWD_PACKER.size // 64) * 64 <= len(launch.ARGS.buf)
    header = (jit.source_dir() / "flash_fwd_sm90_ws.cuh").read_text()
    assert "TmaDesc tma_q, tma_k, tma_v, tma_o;" in header and "sizeof(FwdTmaParams) == 512 +" in header
    assert f"constexpr int kOBoxRows = {tma.O_BOX_ROWS};" in header
    assert ctypes.addressof(launch.ARGS.buf) % 64 == 0
