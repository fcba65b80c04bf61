"""Planning: shapes, dtype, flags and device facts -> which kernel variant to run and how.

Pure Python (no CuPy, no GPU): everything here is testable on a CPU machine. The JIT layer
(cuflash/jit.py) turns a KernelSpec into source text and a compiled function; the API layer
(cuflash/attention.py) checks arguments and calls plan_forward.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

#: Head-dim buckets a kernel is compiled for. A head dim d runs in the smallest bucket >= d; the
#: columns between d and the bucket are zero-filled by predicated loads inside the kernel.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)

DTYPES = ("fp16", "bf16")

#: Oldest architecture the mma.sync / ldmatrix / cp.async kernels run on.
MIN_COMPUTE_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Tile:
    """Tile shape of one forward variant (see FWD_TILES for the reason of each choice)."""

    block_m: int  # query rows per CTA
    block_n: int  # key rows per K/V tile
    warps: int  # warps per CTA; each owns block_m / warps query rows
    q_in_regs: bool  # Q MMA fragments held in registers for the whole loop (else re-read from smem)
    min_blocks: int  # __launch_bounds__ minimum CTAs per SM (caps registers per thread)
    stages: int = 2  # smem buffers per K and per V tile: 2 = double buffered, 1 = FA2's single buffer


#: Forward tiles per head-dim bucket, one row each, with the reason.
#: Register budget per thread ~ O accumulator (rows_per_warp * d / 32) + S accumulator
#: (rows_per_warp * block_n / 32) + Q fragments if q_in_regs (rows_per_warp * d / 64).
#: Shared memory = 2 * (block_m + 2 * stages * block_n) * (d + 8) bytes (Q + stages x (K, V)).
FWD_TILES: dict[int, Tile] = {
    # Measured on the H200 with tools/tune_fwd.py (ratios vs torch's FA2, median of 6 grid points).
    # 32 rows/warp: O 32 + S 128 + Q 16 regs; single-buffered 128-key tiles, 2 CTAs/SM (1.07x).
    32: Tile(128, 128, 4, True, 2, stages=1),
    # 32 rows/warp: O 64 + S 64 + Q 32 regs; single buffer (55 KB) beat double (0.99x vs 0.93x).
    64: Tile(128, 64, 4, True, 2, stages=1),
    # 32 rows/warp: O 96 + S 64 regs, Q re-read from smem; single buffer (0.85x vs 0.81x).
    96: Tile(128, 64, 4, False, 2, stages=1),
    # FA2's tile: 32 rows/warp, O 128 + S 64 regs, Q from smem, 2 CTAs/SM (104 KB); double
    # buffering measured 0.95x against 0.94x single, 0.87x for 32-key tiles.
    128: Tile(128, 64, 4, False, 2, stages=2),
    # 32 rows/warp with 32-key tiles: O 160 + S 32 regs fits; 63 KB single buffer, 2 CTAs/SM (1.17x;
    # 8 warps of 16 rows 1.01x).
    160: Tile(128, 32, 4, False, 2, stages=1),
    # 8 warps of 16 rows: O 96 + S 32 + Q 48 regs, 158 KB double buffer, 1 CTA/SM (0.78x; 64x64 of 4 warps 0.75x).
    192: Tile(128, 64, 8, True, 1, stages=2),
    # 8 warps of 16 rows: O 112 + S 32 regs, Q from smem, 178 KB, 1 CTA/SM (0.99x; 64x64 of 4 warps 0.76x).
    224: Tile(128, 64, 8, False, 1, stages=2),
    # Torch's FA2 tile for 256: 4 warps of 16 rows, single buffer (99 KB) so 2 CTAs/SM (0.93x, against
    # 0.82x for 128x64 of 8 warps double buffered at 1 CTA/SM).
    256: Tile(64, 64, 4, False, 2, stages=1),
}


def head_dim_bucket(head_dim: int) -> int:
    """Smallest compiled head-dim bucket that holds ``head_dim``."""
    if head_dim < 1 or head_dim > HEAD_DIM_BUCKETS[-1]:
        raise ValueError(f"head dim must be between 1 and {HEAD_DIM_BUCKETS[-1]}, got {head_dim}")
    return next(b for b in HEAD_DIM_BUCKETS if b >= head_dim)


def fwd_smem_bytes(head_dim_bucket: int, tile: Tile) -> int:
    """Dynamic shared memory of the forward kernel: must match FwdConfig::kSmemBytes."""
    stride = head_dim_bucket + 8
    return 2 * (tile.block_m * stride + 2 * tile.stages * tile.block_n * stride)


@dataclass(frozen=True)
class Sm90Tile:
    """Tile shape of one Hopper (wgmma) forward variant: 64 query rows per warpgroup of 4 warps."""

    block_m: int  # query rows per CTA (block_m / 64 warpgroups)
    block_n: int  # key rows per K/V tile (the N of S = Q K^T)
    stages: int = 2  # smem buffers per K and per V tile
    min_blocks: int = 1  # __launch_bounds__ minimum CTAs per SM

    @property
    def warps(self) -> int:
        return self.block_m // 16


#: Hopper forward tiles (cuda_src/flash_fwd_sm90.cuh) per head-dim bucket; buckets not listed (and
#: unaligned inputs) run the mma.sync kernel. Registers per thread ~ O (d / 2) + S (block_n / 2) + P
#: fragments (block_n / 4). Shared memory = 1024 + 2 * (block_m + 2 * stages * block_n) * d bytes.
#: The loader needs threads % (d / 8) == 0 with 8 | threads / (d / 8), so d = 192 waits for a
#: 3-warpgroup tile.
FWD_SM90_TILES: dict[int, Sm90Tile] = {
    # Measured on the H200 with tools/tune_fwd.py --sm90 (median ratio to torch's FA2 over 1k/4k/16k,
    # causal and not, bf16).
    # 2 warpgroups x 64-key tiles: O 32 + S 32 regs, 50 KB (1.30x; 128-key tiles 1.09x, 192-row CTAs 1.14x).
    64: Sm90Tile(128, 64),
    # 2 warpgroups x 128-key tiles: O 64 + S 64 regs, 161 KB, 1 CTA/SM (1.34x; 64-key tiles 1.13x,
    # 3 warpgroups x 64 keys 1.24x).
    128: Sm90Tile(128, 128),
    # 2 warpgroups x 64-key tiles: O 128 + S 32 regs, 193 KB, 1 CTA/SM (1.55x; the only shape that fits).
    256: Sm90Tile(128, 64),
}


def fwd_sm90_smem_bytes(head_dim_bucket: int, tile: Sm90Tile) -> int:
    """Dynamic shared memory of the Hopper forward kernel: must match Sm90FwdConfig::kSmemBytes."""
    return 1024 + 2 * (tile.block_m + 2 * tile.stages * tile.block_n) * head_dim_bucket


def arch_for_capability(major: int, minor: int) -> str:
    """NVRTC target for a device of compute capability (major, minor)."""
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"cuflash needs a GPU of compute capability 8.0 or newer (Ampere, Ada, Hopper); "
            f"this one is {major}.{minor}"
        )
    # sm_90a: the Hopper-specific target (wgmma, setmaxnreg); its cubins run on every 9.0 device.
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


_ARCH_RE = re.compile(r"^sm_(\d{2,3})(a?)$")


def parse_arch(arch: str) -> str:
    """Normalize a user-given arch ('90a', 'sm_90a', 'sm80', '8.0', 'compute_80') to 'sm_XY[a]'."""
    a = arch.strip().lower().replace("compute_", "sm_")
    if "." in a:
        major, minor = a.split(".", 1)
        a = f"sm_{major}{minor}"
    if a.startswith("sm") and not a.startswith("sm_"):
        a = "sm_" + a[2:]
    if not a.startswith("sm_"):
        a = "sm_" + a
    m = _ARCH_RE.match(a)
    # The "a" (arch-specific feature) targets exist from sm_90 on.
    if not m or int(m.group(1)) < 80 or (m.group(2) and int(m.group(1)) < 90):
        raise ValueError(f"unsupported arch {arch!r}: expected sm_80 or newer, e.g. sm_80, sm_86, sm_90a")
    return a


#: Dynamic shared memory one CTA may use, in KB, per architecture (CUDA programming guide, compute
#: capabilities table); unknown architectures get the smallest of these.
MAX_SMEM_KB = {80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227, 103: 227, 120: 99}


def max_smem_bytes(arch: str) -> int:
    return MAX_SMEM_KB.get(int(_ARCH_RE.match(arch).group(1)), 99) * 1024


def fwd_tile(bucket: int, arch: str) -> Tile:
    """The forward tile for a head-dim bucket on ``arch``: the FWD_TILES row (tuned on the H200),
    or, where that needs more shared memory than the arch has, the first smaller shape that fits:
    single-buffered, then 32-key tiles, then 64 query rows of 4 warps (untuned on those GPUs)."""
    t = FWD_TILES[bucket]
    candidates = (
        t,
        dataclasses.replace(t, stages=1),
        dataclasses.replace(t, stages=1, block_n=32),
        Tile(64, 32, 4, False, 1, stages=1),
    )
    limit = max_smem_bytes(arch)
    for c in candidates:
        if fwd_smem_bytes(bucket, c) <= limit:
            return c
    raise ValueError(f"no forward tile for head dim {bucket} fits the {limit // 1024} KB of shared memory of {arch}")


def _load_tag(aligned: bool) -> str:
    """The load path in a variant name: 16-byte vector loads or element-wise loads."""
    return "vec16" if aligned else "scalar"


def _arch_tag(arch: str) -> str:
    """The arch in a variant name (and kernel symbol): sm_90a -> sm90a."""
    return arch.replace("_", "")


def _cpp_bool(x: bool) -> str:
    """A Python bool as a C++ template argument."""
    return "true" if x else "false"


class _TiledSpec:
    """What the forward and backward main-kernel specs share: threads and min_blocks from ``tile``, and
    the variant name (family, head dim, dtype, causal, the tile's common fields, ``tile_fields``, load
    path, arch)."""

    tile: Tile

    def _variant_name(self, tile_fields: str) -> str:
        t = self.tile
        return (
            f"{self.family}_hd{self.head_dim}_{self.dtype}_{'causal' if self.causal else 'full'}"
            f"_bm{t.block_m}_bn{t.block_n}_w{t.warps}_mb{t.min_blocks}_st{t.stages}{tile_fields}"
            f"_{_load_tag(self.aligned)}_{_arch_tag(self.arch)}"
        )

    @property
    def threads(self) -> int:
        return self.tile.warps * 32

    @property
    def min_blocks(self) -> int:
        return self.tile.min_blocks


@dataclass(frozen=True)
class KernelSpec(_TiledSpec):
    """One compiled kernel variant: every template argument, and the target arch."""

    family: str  # "flash_fwd"
    head_dim: int  # bucket
    dtype: str  # "fp16" | "bf16"
    causal: bool
    aligned: bool  # 16-byte vector loads (else element-wise loads for odd head dims / strides)
    tile: Tile
    arch: str  # "sm_80", "sm_90a", ...

    @property
    def name(self) -> str:
        """Human-readable name spelling every template argument; also the kernel's symbol."""
        return self._variant_name(f"_{'qreg' if self.tile.q_in_regs else 'qsmem'}")

    @property
    def smem_bytes(self) -> int:
        return fwd_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        """C++ template argument list of cuflash::FwdConfig for this variant."""
        t, b = self.tile, _cpp_bool
        return (
            f"{self.head_dim}, {t.block_m}, {t.block_n}, {t.warps}, {b(self.dtype == 'bf16')}, "
            f"{b(self.causal)}, {b(self.aligned)}, {b(t.q_in_regs)}, {t.stages}"
        )


@dataclass(frozen=True)
class _HopperSpec(_TiledSpec):
    """What the Hopper (wgmma) kernel specs share: sm_90a, the 16-byte load path, a name spelling the
    tile's common fields."""

    head_dim: int  # bucket
    dtype: str
    causal: bool
    tile: object
    arch: str = "sm_90a"
    family: str = ""
    aligned: bool = True

    @property
    def name(self) -> str:
        return self._variant_name("")


@dataclass(frozen=True)
class Sm90KernelSpec(_HopperSpec):
    """One Hopper forward variant (wgmma, sm_90a, 16-byte loads only)."""

    tile: Sm90Tile
    family: str = "flash_fwd_sm90"

    @property
    def smem_bytes(self) -> int:
        return fwd_sm90_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        """C++ template argument list of cuflash::Sm90FwdConfig for this variant."""
        t, b = self.tile, _cpp_bool
        return f"{self.head_dim}, {t.block_m}, {t.block_n}, {t.stages}, {b(self.dtype == 'bf16')}, {b(self.causal)}"


def fwd_sm90_spec(head_dim: int, dtype: str, causal: bool, tile: Sm90Tile | None = None) -> Sm90KernelSpec:
    """The Hopper forward variant for ``head_dim`` (its bucket must have a FWD_SM90_TILES row, or give ``tile``)."""
    bucket = head_dim_bucket(head_dim)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if head_dim % 8 != 0:
        raise ValueError("the Hopper kernel loads 16-byte chunks: it needs head_dim % 8 == 0")
    if tile is None:
        if bucket not in FWD_SM90_TILES:
            raise ValueError(f"no Hopper forward tile for head-dim bucket {bucket} (have {sorted(FWD_SM90_TILES)})")
        tile = FWD_SM90_TILES[bucket]
    if bucket % 64 or tile.block_m % 64 or tile.block_n % 64 or tile.stages != 2:
        raise ValueError(f"Hopper tile {tile} for bucket {bucket}: needs multiples of 64 and 2 stages")
    threads, chunks = tile.warps * 32, bucket // 8
    if threads % chunks or (threads // chunks) % 8:
        raise ValueError(f"Hopper tile {tile}: {threads} threads do not split {chunks}-chunk rows evenly")
    if fwd_sm90_smem_bytes(bucket, tile) > max_smem_bytes("sm_90a"):
        raise ValueError(f"Hopper tile {tile} needs {fwd_sm90_smem_bytes(bucket, tile)} bytes of shared memory")
    return Sm90KernelSpec(bucket, dtype, bool(causal), tile)


def uses_sm90_forward(head_dim: int, aligned: bool, arch: str) -> bool:
    """True when the forward runs the Hopper wgmma kernel: sm_90a, 16-byte loads, a tuned bucket."""
    return arch == "sm_90a" and aligned and head_dim % 8 == 0 and head_dim_bucket(head_dim) in FWD_SM90_TILES


@dataclass(frozen=True)
class Launch:
    spec: KernelSpec | Sm90KernelSpec
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    # Programmatic dependent launch (cuflash/jit.py launch): the kernel waits (griddepcontrol) for the
    # one before it on the stream, which may then let it start early. Only kernels written for it.
    pdl: bool = False


def supports_pdl(arch: str) -> bool:
    """Programmatic dependent launch (griddepcontrol) exists from sm_90 on."""
    return int(_ARCH_RE.match(arch).group(1)) >= 90


def fwd_spec(head_dim: int, dtype: str, causal: bool, aligned: bool, arch: str, tile: Tile | None = None) -> KernelSpec:
    bucket = head_dim_bucket(head_dim)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if aligned and head_dim % 8 != 0:
        raise ValueError("the 16-byte load path needs head_dim % 8 == 0")
    tile = tile or fwd_tile(bucket, arch)
    if fwd_smem_bytes(bucket, tile) > max_smem_bytes(arch):
        raise ValueError(
            f"tile {tile} needs {fwd_smem_bytes(bucket, tile)} bytes of shared memory; {arch} allows "
            f"{max_smem_bytes(arch)}"
        )
    return KernelSpec("flash_fwd", bucket, dtype, bool(causal), bool(aligned), tile, arch)


def plan_forward(
    *,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_kv: int,
    head_dim: int,
    dtype: str,
    causal: bool,
    aligned: bool,
    arch: str,
    tile: Tile | Sm90Tile | None = None,
) -> Launch:
    """Kernel variant, grid, block and shared memory for one forward call (all sizes >= 1).

    On sm_90a with 16-byte aligned inputs and a bucket of FWD_SM90_TILES the Hopper (wgmma) kernel
    runs, else the mma.sync kernel; a given ``tile`` picks the kernel by its type."""
    if min(batch, seqlen_q, seqlen_k, nheads, nheads_kv) < 1:
        raise ValueError("plan_forward needs non-empty dimensions; empty inputs never launch")
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if isinstance(tile, Sm90Tile) or (tile is None and uses_sm90_forward(head_dim, aligned, arch)):
        if arch != "sm_90a" or not aligned:
            raise ValueError("the Hopper forward kernel needs arch sm_90a and 16-byte aligned inputs")
        spec = fwd_sm90_spec(head_dim, dtype, causal, tile)
    else:
        spec = fwd_spec(head_dim, dtype, causal, aligned, arch, tile)
    num_m_blocks = -(-seqlen_q // spec.tile.block_m)
    return Launch(spec, (num_m_blocks, nheads, batch), (spec.threads, 1, 1), spec.smem_bytes)


def all_fwd_specs(arch: str, head_dims=HEAD_DIM_BUCKETS, dtypes=DTYPES, causals=(False, True), aligned=(True, False)):
    """Every forward variant the library can launch for ``arch`` (what `cuflash precompile --all` builds):
    the mma.sync kernel for every combination, and on sm_90a the Hopper kernel for the aligned ones
    of its buckets."""
    specs = []
    for d in head_dims:
        bucket = head_dim_bucket(d)
        for dt in dtypes:
            for c in causals:
                for al in aligned:
                    specs.append(KernelSpec("flash_fwd", bucket, dt, c, al, fwd_tile(bucket, arch), arch))
                    if al and uses_sm90_forward(bucket, True, arch):
                        specs.append(fwd_sm90_spec(bucket, dt, c))
    return list(dict.fromkeys(specs))  # unique, order kept


def with_tile(spec: KernelSpec, tile: Tile) -> KernelSpec:
    """The same variant with another tile (for tuning sweeps)."""
    return dataclasses.replace(spec, tile=tile)


# ---------------------------------------------------------------------------------------------
# Backward (cuda_src/flash_bwd.cuh)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BwdTile:
    """Tile shape of one backward main-kernel variant (see BWD_TILES for the reasons).

    Each of the kernel's three phases spreads its output over the warps as a grid (BwdConfig in
    cuda_src/flash_bwd.cuh): S^T (block_n x block_m) with s_key_warps warps along the keys, dK/dV
    (block_n x d) with kv_key_warps along the keys, dQ (block_m x d) with dq_q_warps along the queries;
    the other factor of ``warps`` runs along the second dimension.
    """

    block_m: int  # query rows per iteration
    block_n: int  # keys per CTA
    warps: int
    stages: int  # buffers of the query-side tiles (Q, dO, lse, D): 2 = next block prefetched
    s_key_warps: int
    kv_key_warps: int
    dq_q_warps: int
    min_blocks: int = 1  # __launch_bounds__ minimum CTAs per SM

    def warp_tiles(self, head_dim_bucket: int) -> dict[str, tuple[int, int]]:
        """(rows, columns) of one warp's tile in each phase."""
        w, d = self.warps, head_dim_bucket
        return {
            "scores": (self.block_n // self.s_key_warps, self.block_m // (w // self.s_key_warps)),
            "dkdv": (self.block_n // self.kv_key_warps, d // (w // self.kv_key_warps)),
            "dq": (self.block_m // self.dq_q_warps, d // (w // self.dq_q_warps)),
        }

    def valid_for(self, head_dim_bucket: int) -> bool:
        """The layout rules BwdConfig static_asserts (whole 16-row slabs, 16-column pairs, full grids)."""
        if self.stages not in (1, 2) or self.block_m % 16 or self.block_m // 2 > 32 * self.warps:
            return False
        if self.block_m * (head_dim_bucket + 8) > CONVERT_SMEM_ELEMS:  # the dQ convert stages one tile
            return False
        if any(self.warps % x for x in (self.s_key_warps, self.kv_key_warps, self.dq_q_warps)):
            return False
        for phase, (rows, cols) in self.warp_tiles(head_dim_bucket).items():
            if rows < 16 or rows % 16 or cols < 16 or cols % 16:
                return False
        return True

    def registers(self, head_dim_bucket: int) -> dict[str, int]:
        """fp32 accumulator registers per thread: dK + dV (live all along), S^T + dP^T, dQ."""
        tiles = self.warp_tiles(head_dim_bucket)
        per_thread = lambda rc: rc[0] * rc[1] // 32  # noqa: E731
        return {"dkdv": 2 * per_thread(tiles["dkdv"]), "scores": 2 * per_thread(tiles["scores"]),
                "dq": per_thread(tiles["dq"])}  # fmt: skip


#: Backward tiles per head-dim bucket. Warp tiles of R x C elements read (R + C) * 32 bytes of
#: shared memory per 16-deep k-step for R * C / 128 MMAs, and mma.sync on Hopper is fed faster than
#: shared memory can deliver 16-row tiles: the layouts aim for 32-row tiles in every phase. Registers
#: per thread ~ dK + dV accumulators (kept all along) + S^T and dP^T (BwdTile.registers). Shared
#: memory = 2 * (2 * block_n + 2 * stages * block_m) * (d + 8) + 4 * block_n * (block_m + 8) +
#: 8 * stages * block_m bytes (K, V, Q, dO, P^T, dS^T, lse, D).
BWD_TILES: dict[int, BwdTile] = {
    # 128 keys x 128 queries (FA2's hd64 shape): scores 32 x 64, dK/dV 32 x 32 (hd64), dQ 32 x 32.
    32: BwdTile(128, 128, 8, 2, s_key_warps=4, kv_key_warps=4, dq_q_warps=4),
    64: BwdTile(128, 128, 8, 2, s_key_warps=4, kv_key_warps=4, dq_q_warps=4),
    # 128 keys x 64 queries (FA2's hd128 shape): scores 32 x 32, dK/dV 32 x 64 (128 regs), dQ 32 x 32.
    96: BwdTile(64, 128, 8, 2, s_key_warps=4, kv_key_warps=4, dq_q_warps=4),  # dQ 16 x 48 (48 / 4 splits)
    128: BwdTile(64, 128, 8, 2, s_key_warps=4, kv_key_warps=4, dq_q_warps=2),
    # 64 keys x 64 queries: dK/dV at most 128 regs; hd160 / hd224 split the head dim in halves of
    # 80 / 112 columns (quarters would not be whole 16-column pairs).
    160: BwdTile(64, 64, 8, 2, s_key_warps=2, kv_key_warps=4, dq_q_warps=4),
    192: BwdTile(64, 64, 8, 2, s_key_warps=2, kv_key_warps=2, dq_q_warps=2),
    224: BwdTile(64, 64, 8, 2, s_key_warps=2, kv_key_warps=4, dq_q_warps=4),
    256: BwdTile(64, 64, 8, 2, s_key_warps=2, kv_key_warps=2, dq_q_warps=2),
}

#: Threads of the preprocess / convert kernels (one warp per query row / one CTA per query block).
BWD_AUX_THREADS = 256
#: Elements of the convert kernel's smem tile (flash_bwd.cuh kConvertSmemElems): every backward
#: tile's block_m * (bucket + 8) must fit.
CONVERT_SMEM_ELEMS = 64 * (256 + 8)


def bwd_smem_bytes(head_dim_bucket: int, tile: BwdTile) -> int:
    """Dynamic shared memory of the backward main kernel: must match BwdConfig::kSmemBytes."""
    stride = head_dim_bucket + 8
    kv, q, pp = tile.block_n * stride, tile.block_m * stride, tile.block_n * (tile.block_m + 8)
    return 2 * (2 * kv + 2 * tile.stages * q + 2 * pp) + 4 * 2 * tile.stages * tile.block_m


#: Smaller tiles for GPUs with less shared memory (tried in order; compile-tested only).
BWD_FALLBACK_TILES = (
    BwdTile(64, 64, 4, 1, s_key_warps=2, kv_key_warps=2, dq_q_warps=2),
    BwdTile(32, 32, 4, 1, s_key_warps=2, kv_key_warps=2, dq_q_warps=2),
)


def bwd_tile(bucket: int, arch: str) -> BwdTile:
    """The backward tile for ``bucket`` on ``arch``: the BWD_TILES row, or where that needs more shared
    memory than the arch has, its single-buffered form, then BWD_FALLBACK_TILES (untuned)."""
    t = BWD_TILES[bucket]
    limit = max_smem_bytes(arch)
    for c in (t, dataclasses.replace(t, stages=1)) + BWD_FALLBACK_TILES:
        if bwd_smem_bytes(bucket, c) <= limit and c.valid_for(bucket) and c.registers(bucket)["dkdv"] <= 128:
            return c
    raise ValueError(f"no backward tile for head dim {bucket} fits the {limit // 1024} KB of shared memory of {arch}")


@dataclass(frozen=True)
class BwdSpec(_TiledSpec):
    """One backward main-kernel variant."""

    head_dim: int  # bucket
    dtype: str
    causal: bool
    aligned: bool
    tile: BwdTile
    arch: str
    family: str = "flash_bwd"

    @property
    def name(self) -> str:
        t = self.tile
        return self._variant_name(f"_s{t.s_key_warps}kv{t.kv_key_warps}dq{t.dq_q_warps}")

    @property
    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        t, b = self.tile, _cpp_bool
        return (
            f"{self.head_dim}, {t.block_m}, {t.block_n}, {t.warps}, {b(self.dtype == 'bf16')}, {b(self.causal)}, "
            f"{b(self.aligned)}, {t.stages}, {t.s_key_warps}, {t.kv_key_warps}, {t.dq_q_warps}"
        )


@dataclass(frozen=True)
class BwdAuxSpec:
    """The preprocess (D, lse_log2) or dQ-convert kernel: one warp per row, any head dim."""

    family: str  # "flash_bwd_pre" | "flash_bwd_convert"
    dtype: str
    aligned: bool
    arch: str

    @property
    def name(self) -> str:
        return f"{self.family}_{self.dtype}_{_load_tag(self.aligned)}_{_arch_tag(self.arch)}"

    threads = BWD_AUX_THREADS
    min_blocks = 1
    smem_bytes = 0

    def template_args(self) -> str:
        return f"{_cpp_bool(self.dtype == 'bf16')}, {_cpp_bool(self.aligned)}"


@dataclass(frozen=True)
class BwdSm90Tile:
    """Tile of the Hopper (wgmma) backward main kernel (cuda_src/flash_bwd_sm90.cuh): two warpgroups,
    query blocks of 64 rows, and block_n keys per CTA: 128 (one warpgroup per 64 keys) or 64 (the
    warpgroups split the work and the head dim, for d = 256). Either way the dQ tile layout (what the
    convert kernel reads) is 4 warps of 16 query rows x one head-dim half per warpgroup."""

    block_n: int = 128
    block_m: int = 64
    stages: int = 2
    min_blocks: int = 1

    @property
    def warps(self) -> int:
        return 8

    @property
    def dq_q_warps(self) -> int:
        return 4

    def warp_tiles(self, head_dim_bucket: int) -> dict[str, tuple[int, int]]:
        return {"dq": (16, head_dim_bucket // 2)}


#: Hopper backward tiles. dK + dV accumulators of 64 keys x d per warpgroup take d registers per
#: thread: d <= 128 gives each warpgroup its own 64 keys; d = 256 splits the head dim between the
#: warpgroups instead (64 keys per CTA). Other buckets run the mma.sync kernel.
BWD_SM90_TILES: dict[int, BwdSm90Tile] = {64: BwdSm90Tile(), 128: BwdSm90Tile(), 256: BwdSm90Tile(block_n=64)}


def bwd_sm90_smem_bytes(head_dim_bucket: int, tile: BwdSm90Tile) -> int:
    """Must match Sm90BwdConfig::kSmemBytes: K, V, 2 x (Q, dO), dS^T, the fp32 P^T exchange of the
    split (64-key) kernel, 2 x (lse_log2, D), 1 KB alignment."""
    d, n, m = head_dim_bucket, tile.block_n, tile.block_m
    exchange = n * (m + 4) * 4 if n == 64 else 0
    return 1024 + 2 * n * d * 2 + 4 * m * d * 2 + n * m * 2 + exchange + 2 * 2 * m * 4


@dataclass(frozen=True)
class BwdSm90Spec(_HopperSpec):
    """One Hopper backward main-kernel variant (sm_90a, 16-byte loads, atomic dQ)."""

    tile: BwdSm90Tile
    family: str = "flash_bwd_sm90"

    @property
    def smem_bytes(self) -> int:
        return bwd_sm90_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        b = _cpp_bool
        return f"{self.head_dim}, {self.tile.block_n}, {b(self.dtype == 'bf16')}, {b(self.causal)}"


def uses_sm90_backward(head_dim: int, aligned: bool, arch: str, deterministic: bool) -> bool:
    """True when the backward's main kernel is the Hopper one: sm_90a, 16-byte loads, a bucket of
    BWD_SM90_TILES, and atomic dQ (deterministic mode runs the mma.sync kernel's ordered additions)."""
    return (arch == "sm_90a" and aligned and not deterministic and head_dim % 8 == 0
            and head_dim_bucket(head_dim) in BWD_SM90_TILES)  # fmt: skip


@dataclass(frozen=True)
class BwdPlan:
    pre: Launch
    main: Launch
    convert: Launch
    seqlen_q_pad: int  # rows of the lse_log2 / D / dq_accum buffers per (batch, head)
    dq_accum_cols: int  # columns of dq_accum (the head-dim bucket)
    num_m_blocks: int


def bwd_spec(head_dim: int, dtype: str, causal: bool, aligned: bool, arch: str, tile: BwdTile | None = None) -> BwdSpec:
    bucket = head_dim_bucket(head_dim)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if aligned and head_dim % 8 != 0:
        raise ValueError("the 16-byte load path needs head_dim % 8 == 0")
    tile = tile or bwd_tile(bucket, arch)
    if not tile.valid_for(bucket):
        raise ValueError(f"tile {tile} breaks the backward kernel's warp layout rules for head dim {bucket}")
    if bwd_smem_bytes(bucket, tile) > max_smem_bytes(arch):
        raise ValueError(
            f"tile {tile} needs {bwd_smem_bytes(bucket, tile)} bytes of shared memory; {arch} allows {max_smem_bytes(arch)}"
        )
    return BwdSpec(bucket, dtype, bool(causal), bool(aligned), tile, arch)


def plan_backward(
    *,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_kv: int,
    head_dim: int,
    dtype: str,
    causal: bool,
    aligned: bool,
    arch: str,
    tile: BwdTile | BwdSm90Tile | None = None,
    deterministic: bool = False,
) -> BwdPlan:
    """The three launches of one backward call (all sizes >= 1). The main kernel is the Hopper one
    where uses_sm90_backward says so (or a BwdSm90Tile is given), else the mma.sync one."""
    if min(batch, seqlen_q, seqlen_k, nheads, nheads_kv) < 1:
        raise ValueError("plan_backward needs non-empty dimensions; empty inputs never launch")
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if isinstance(tile, BwdSm90Tile) or (tile is None and uses_sm90_backward(head_dim, aligned, arch, deterministic)):
        if arch != "sm_90a" or not aligned or deterministic or head_dim % 8:
            raise ValueError("the Hopper backward kernel needs sm_90a, 16-byte aligned inputs and deterministic=False")
        spec = bwd_sm90_spec(head_dim, dtype, causal, tile)
    else:
        spec = bwd_spec(head_dim, dtype, causal, aligned, arch, tile)
    num_m_blocks = -(-seqlen_q // spec.tile.block_m)
    seqlen_q_pad = num_m_blocks * spec.tile.block_m
    rows_per_cta = BWD_AUX_THREADS // 32
    aux_block = (BWD_AUX_THREADS, 1, 1)
    pre = Launch(BwdAuxSpec("flash_bwd_pre", dtype, aligned, arch), (-(-seqlen_q_pad // rows_per_cta), nheads, batch), aux_block, 0)
    main = Launch(spec, (-(-seqlen_k // spec.tile.block_n), nheads_kv, batch), (spec.threads, 1, 1), spec.smem_bytes)
    # One CTA per query block (its dQ tile is staged in CONVERT_SMEM_ELEMS of smem: BwdTile.valid_for).
    convert = Launch(BwdAuxSpec("flash_bwd_convert", dtype, aligned, arch), (num_m_blocks, nheads, batch), aux_block, 0)
    return BwdPlan(pre, main, convert, seqlen_q_pad, spec.head_dim, num_m_blocks)


def bwd_sm90_spec(head_dim: int, dtype: str, causal: bool, tile: BwdSm90Tile | None = None) -> BwdSm90Spec:
    bucket = head_dim_bucket(head_dim)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if bucket not in BWD_SM90_TILES:
        raise ValueError(f"no Hopper backward tile for head-dim bucket {bucket} (have {sorted(BWD_SM90_TILES)})")
    tile = tile or BWD_SM90_TILES[bucket]
    if tile.block_n != (64 if bucket == 256 else 128) or tile.block_m != 64 or tile.stages != 2:
        raise ValueError(
            f"the Hopper backward kernel runs 128 keys (64 for head dim 256) x 64 queries, 2 stages; got {tile}"
        )
    return BwdSm90Spec(bucket, dtype, bool(causal), tile)


def all_bwd_specs(arch: str, head_dims=HEAD_DIM_BUCKETS, dtypes=DTYPES, causals=(False, True), aligned=(True, False)):
    """Every backward variant (main, preprocess, convert) for ``arch``; on sm_90a also the Hopper main
    kernel for the aligned variants of its buckets."""
    specs: list = []
    for dt in dtypes:
        for al in aligned:
            specs += [BwdAuxSpec("flash_bwd_pre", dt, al, arch), BwdAuxSpec("flash_bwd_convert", dt, al, arch)]
            for d in head_dims:
                bucket = head_dim_bucket(d)
                for c in causals:
                    specs.append(BwdSpec(bucket, dt, c, al, bwd_tile(bucket, arch), arch))
                    if al and uses_sm90_backward(bucket, True, arch, False):
                        specs.append(bwd_sm90_spec(bucket, dt, c))
    return list(dict.fromkeys(specs))


# ---------------------------------------------------------------------------------------------
# Decode with a KV cache: split-KV attention (Flash-Decoding), cuda_src/flash_decode.cuh
# ---------------------------------------------------------------------------------------------

#: Every decode kernel runs 4 warps (cuda_src/flash_decode.cuh: kDecodeThreads).
DECODE_THREADS = 128
#: 16-row slabs of packed query rows (group * seqlen_q rows of one kv head) per CTA. A CTA of m slabs
#: arranges its 4 warps as m slab rows x 4 / m key columns, so every warp holds one 16-row slab.
DECODE_M_SLABS = (1, 2, 4)
#: Most key splits per sequence (kDecodeMaxSplits: the merge loads every lse of a chunk in one batch).
MAX_DECODE_SPLITS = 128
#: Fewest keys a split gets from the heuristic: below this a CTA's pipeline fill and its partial
#: row (written, then read by the merge) weigh more than the tiles it streams.
MIN_DECODE_KEYS_PER_SPLIT = 256
#: Most keys a split gets from the heuristic: a CTA streaming more ends further from its neighbours
#: (b=8 L=32k h_kv=32: one split of 32k keys per CTA 2% slower than four of 8k on the H200).
MAX_DECODE_KEYS_PER_SPLIT = 16384
#: Split CTAs that stream at least this many keys run at most DECODE_LONG_CTAS_PER_SM per SM (their
#: shared memory padded, decode_launch_smem), shorter ones as many as the tile holds. Measured on the
#: H200 (tools/sweep_splits.py --ctas-per-sm 2, hd128, 26 shapes up to 4.3 GB of cache, CUDA-event
#: us per call): where CTAs are long, about 2 per SM in whole waves (cuDNN's grids) stream faster than
#: 3 per SM: b=8 L=4k h_kv=32 1 split at 2/SM 135.5 vs the best at 3/SM 139.7 (3 splits); b=64 L=4k
#: h_kv=8 255.2 vs 263.6; b=64 L=8k h_kv=8 494.8 vs 509.4; b=8 L=16k h_kv=8 137.1 vs 139.6. Where
#: they are short (b=8 L=4k h_kv=8: 11 tiles a CTA; b=1 up to 16k keys), 3 per SM hide each CTA's
#: pipeline fill and epilogue better: 46.3 us at 3/SM vs 50.6 at 2/SM. Over the 26 shapes the
#: heuristic's time / the best (s, CTAs per SM) measured went from mean 1.020 to 1.014. (Deep grids of
#: whole groups, DECODE_DEEP_MIN_WAVES, run CTAs of up to 4096 keys at 3 per SM.)
DECODE_LONG_CTA_KEYS = 3072
DECODE_LONG_CTAS_PER_SM = 2


def decode_cta_loads(tile: DecodeTile, per_sm: int) -> bool:
    """Whether split CTAs of ``tile`` launched ``per_sm`` per SM load each K/V tile as a whole CTA,
    with CTA barriers (flash_decode.cuh kCtaLoads), rather than per key column of warps: where the
    plan spaces a tile sized for more CTAs per SM to DECODE_LONG_CTAS_PER_SM (its long splits). On the
    H200 (tools/ab_decode.py, hd128 bf16, CTA loads / column loads in the same run, three calls;
    docs/ab-decode-h200-2026-12-01-loads.txt): median 1.006, 1.004, 1.006 over the shapes launched 2
    per SM, b=8 L=4k h_kv=32 1.013, 1.019, 1.022. At 3 per SM (short splits) CTA loads measured
    0.975-0.994 on 3 shapes in one call, where that call's A/A pairs gave 0.986-0.997: no better, so
    those keep column loads."""
    return tile.stages > 1 and per_sm == DECODE_LONG_CTAS_PER_SM < tile.min_blocks


#: Fixed cost of one CTA in units of one K/V tile's streaming time (pipeline fill, epilogue, the
#: merge's share); the split heuristic's cost model.
DECODE_CTA_OVERHEAD_TILES = 1
#: Partial rows of one group (the packed query rows of a CTA x the splits) above which the splits are
#: merged by the combine kernel (one CTA per output row, launched after the split kernel) instead of
#: by the last split CTA of each group to finish. That CTA merges alone, on an SM still streaming
#: other CTAs' tiles: on the H200 (tools/trace_decode.py) its merge took ~2-3 us for 12 and 24
#: partial rows (MHA 1 row x 12 splits, GQA 4 rows x 6) but ~7.5 us for 4 rows x 49 splits. The
#: combine kernel takes ~3.5 us plus ~1 us between the kernels; device span of one call, in-kernel ->
#: combine kernel (cuDNN): b=1 h_kv=8 L=16k 27.4 -> 25.6 (23.1), 32k 42.7 -> 40.2 (37.9), 64k
#: 72.3 -> 70.2 (67.4), 128k 132.0 -> 128.9 (127.5) us. The boundary (64) itself is not measured.
DECODE_IN_KERNEL_MERGE_MAX = 64
#: The combine kernel's two variants (DecodeCombineSpec, decode_combine_lean). The wide one (each warp
#: loads up to 32 partial rows at once) holds ~185 registers a thread, so 2 CTAs per SM: with one CTA
#: per output row, a call of many rows ran it in waves of 264 (b=128 L=4k with one kv head, 4096
#: rows of 3 splits: the split kernel 71.6 us, then ~40 us of combine; cuDNN's whole call 66-80).
#: The lean one loads 4 per warp and runs DECODE_COMBINE_LEAN_CTAS_PER_SM per SM.
DECODE_COMBINE_WIDE_CTAS_PER_SM = 2
DECODE_COMBINE_LEAN_BATCH = 4
DECODE_COMBINE_LEAN_CTAS_PER_SM = 8
#: The filled grid (_filled_grid): where the split plan's last wave of CTAs (at DECODE_LONG_CTAS_PER_SM
#: per SM) leaves slots empty, the splits are made a little longer and each sequence's remaining keys
#: go to one more, short, split, started last (a split-major grid: the block scheduler's usual order,
#: not a CUDA guarantee; only the speed depends on it): the long splits take the slots they took
#: before, the tails stream through the last wave's free slots meanwhile. Each split CTA streams at
#: about the same rate however many run, so a grid of 256 CTAs on the H200's 264 slots reads ~3%
#: slower than it could (with 33 heads instead of 32, 264 CTAs, cuflash was level with or ahead of
#: cuDNN on six MHA shapes where 32 heads gave 0.982-0.998: tools/wave_fill_decode.py, perf-notes
#: tenth decode pass). Against equal splits in the same run (tools/ab_fill_decode.py, the 21 bench
#: shapes it changes, long splits in 1 to 62 waves; perf-notes eleventh decode pass), time / equal's
#: median on two H200s: 0.988 (one-wave shapes 0.991, multi-wave 0.987) and 1.005 (1.007, 0.995);
#: the two machines' mean per shape 0.982-1.006 (slowest: b=8 L=8k h_kv=32, b=8 L=16k h_kv=8,
#: b=64 L=8k h_kv=8, tails of 3-4 tiles; fastest: b=8 L=128k h_kv=32, b=64 L=64k). Where the split
#: plan has no merge (one split), the tail adds one at the end of the call, so the grid is filled
#: there only from DECODE_FILL_MIN_UNSPLIT_TILES tiles per split (b=64 L=4k h_kv=32, 63 tiles and a
#: tail of one: 1.6% and 1.9% slower than equal splits in two runs).
#: (A lean grid, 264 CTAs of equal work cutting across the (sequence, kv head) groups, was slower:
#: its CTAs no longer read the same keys of neighbouring heads at the same time; 9634e60.)
DECODE_FILL_MIN_UNSPLIT_TILES = 96
#: ... and where that one-split grid's last wave is nearly full (fewer than DECODE_FILL_UNSPLIT_MIN_FREE
#: of its slots empty), only from DECODE_FILL_MIN_UNSPLIT_TILES_FULL tiles: the slots a filled grid
#: recovers are few there, the merge it adds to every group the same. Measured with
#: tools/ab_fill_decode.py (filled time / one whole split's, same call): b=64 L=8k h_kv=8 (128 tiles,
#: last wave 248 of 264) 1.009, 1.003, 1.000, 1.008, 1.010, 1.009, 1.010, 1.007 over six H200s; b=96
#: L=8k h_kv=8 1.010; b=8 L=8k h_kv=32 (one wave, 256 of 264) 1.014, 0.998, 0.998, 1.002; b=16 and
#: b=24 L=8k h_kv=32 0.997, 0.998. With 256 tiles a group (b=8 L=16k h_kv=32, b=64 L=16k h_kv=8) the
#: filled grid was ahead in 6 of 8, with 64 slots empty (b=64 L=8k h_kv=32) in 5 of 6: those keep it.
#: The split count is chosen as before (the model prices the one-split fill regardless): the rule only
#: turns a one-split filled grid into whole groups.
DECODE_FILL_UNSPLIT_MIN_FREE = 0.1
DECODE_FILL_MIN_UNSPLIT_TILES_FULL = 192
#: The tail-split grid (_tail_split): where the plan runs every group whole (one split) in several
#: waves and the last wave is partly empty, the groups of that wave are split instead (equal splits,
#: merged in the kernel) and their CTAs started last (the block scheduler's usual order, not a CUDA
#: guarantee; only the speed depends on it), so they spread over the slots the whole groups leave
#: free instead of a few long CTAs running on alone. Measured on the H200 (tools/ab_fill_decode.py,
#: hd128 bf16, the same call with and without it, cuDNN alongside; perf-notes fourteenth decode pass,
#: docs/ab-tail-split-h200-2026-12-01.txt). First run, 14 shapes: time 2.2-3.6% lower where the last
#: wave was 52-69% full (b=58, 62, 70 at 4k keys, b=58 at 2k; b=128 at 4k 1.5%), level where it was
#: 73-79% full (b=56, 64, 72 at 4k: -0.3 to +0.7%; but b=64 at 6k +1.5%), 5% slower at b=60 with 8
#: kv heads (82% full after one whole wave), mixed with groups of 16 tiles (b=128 at 1k 1.7% slower,
#: b=70 at 1k 1.7% faster). A lone CTA streams ~1.45x faster than in a full wave (1.3 vs 1.9 us per
#: tile), so a wave over ~70% full runs near the full rate anyway. The rule below, drawn from that
#: run, on 13 other shapes and 2 repeats in a second run: time median 0.976 of the whole-group grid,
#: 14 of 15 faster, cuflash / cuDNN median 0.984 -> 1.002. Taken for hd128 one-slab calls on sm_90+
#: (the kTailGrid variants) where the last wave is at most DECODE_TAIL_SPLIT_MAX_FILL full, after at
#: least DECODE_TAIL_SPLIT_MIN_WAVES whole waves, with at least DECODE_TAIL_SPLIT_MIN_TILES tiles per
#: group, and the modeled time (decode_num_splits's: waves x (tiles per CTA +
#: DECODE_CTA_OVERHEAD_TILES), plus one overhead for the merge) drops by at least
#: DECODE_TAIL_SPLIT_MIN_GAIN.
DECODE_TAIL_SPLIT_BUCKETS = (128,)
DECODE_TAIL_SPLIT_MAX_FILL = 0.7
DECODE_TAIL_SPLIT_MIN_WAVES = 2
DECODE_TAIL_SPLIT_MIN_TILES = 32
DECODE_TAIL_SPLIT_MIN_GAIN = 0.01
#: Deep grids (_deep_grid): where every group runs whole in at least DECODE_DEEP_MIN_WAVES waves of the
#: tile's min_blocks CTAs per SM (3 for hd128), its groups are at most DECODE_DEEP_MAX_KEYS keys long and
#: the tail-split grid takes that grid's last wave, the plan runs it so, unless the split model's own
#: plan is already whole groups with a tail split: at 3 per SM a CTA's start and end are covered by
#: the two others on its SM, and the tail split removes the few whole groups of a last wave that ran
#: on alone and made such grids lose before (ninth pass). The split model sees neither: it picked 2
#: splits at 3 per SM for 2048 groups of 32 tiles and 4 for 1600 groups of 64. Measured on four H200s
#: (tools/ab_fill_decode.py, the same call under each plan, 15 samples, cuDNN alongside;
#: docs/ab-deep-grid-h200-2026-12-01.txt). Drawn from two calls, where it was faster at b=64 L=2k
#: h_kv=32 (6.5%, 7.8%), b=256 L=2k h_kv=8 (7.2%, 7.1%), b=200 L=4k h_kv=8 (4.2%, 3.6%, 3.8%), b=64
#: L=4k h_kv=32 (0.6%, 0.4%, 0.2%), b=56 and b=66 L=4k (0.4%, 0.5%), and slower or mixed with groups
#: longer than 4k keys (b=64 L=16k h_kv=32 +1.6%, +1.8%) or no tail split at 3 per SM (b=72, b=96 at
#: 4k, b=48 at 8k: up to +1.8%). A third call, on shapes not used for it: faster on all 6 where it
#: replaced the split model's grid (b=100, b=400 L=2k: 3.3%, 3.7%; b=200 L=3k h_kv=8 3.1%; b=300 L=4k
#: h_kv=8 2.4%; b=100 L=4k 1.3%; b=64 L=3k 0.8%) and at the bench's b=64 L=4k h_kv=32 (0.7%), but
#: 0.3-1.0% slower at 3 of the 4 whose old plan was whole groups with a tail split at 2 per SM (b=62,
#: b=150 at 4k, b=250 at 4k h_kv=8; b=128 at 3k 0.4% faster): hence the exception above. A fourth call
#: with the landed rule, 5 new shapes and the bench's b=64 L=4k h_kv=32: all faster (0.6-4.8%; b=180
#: L=2k h_kv=16 713.9 -> 679.3 us, b=64 L=4k 975.8 -> 960.3).
#: Whole groups at 3 per SM without the tail split are machine-dependent (b=64 L=4k h_kv=32: 1.0%
#: faster on one H200, 2.7% and 3.3% slower on another).
DECODE_DEEP_MIN_WAVES = 4
DECODE_DEEP_MAX_KEYS = 4096
#: The unsplit wave (_unsplit_wave): where the (sequence, kv head) groups (x row blocks) give one CTA to
#: at least DECODE_ONE_WAVE_MIN_FILL of the SMs and no SM a second, the plan runs every group whole,
#: one CTA per SM (shared memory padded): no partial rows, no merge, one start per SM. Since a lone
#: CTA's loads step one pointer instead of locating every row (1fed2a0), one CTA per SM reads at about
#: the memory's rate. On the H200 (tools/ab_fill_decode.py, the same call planned with and without it,
#: 15 samples, cuDNN alongside; perf-notes sixteenth decode pass): b=16 L=4k h_kv=8 69.4 vs 72.5 us (3
#: splits at 3 per SM; cuDNN, which runs these 128 unsplit CTAs too, 68.7), b=16 L=8k h_kv=8 127.5 vs
#: 130.1 (a filled grid: 2 splits of 63 tiles and a tail of 2; cuDNN 126.2), b=32 L=4k h_kv=4 70.1
#: vs 74.8. The same one wave made of 2 to 16 splits per group was mixed (b=2 L=16k h_kv=16 4 splits
#: 1.4% faster than 12 at 3 per SM; b=1 L=32k h_kv=32 4 splits 1.0% slower than the filled grid; b=8
#: L=32k h_kv=8 2 splits 1.2% slower): the merge it adds costs what the wave saves, so only unsplit
#: groups take it. On sm_90+, for the measured bucket (hd128, one slab: the variants with the stepped
#: loads), with num_splits=0 and the plan's CTAs per SM, where a group is DECODE_LONG_CTA_KEYS to
#: MAX_DECODE_KEYS_PER_SPLIT keys, and only with one length for all (uniform_lengths; all it was
#: measured with): with ragged lengths the longest sequence's whole groups would set the call's time,
#: where splits share them out.
DECODE_ONE_WAVE_BUCKETS = (128,)
DECODE_ONE_WAVE_MIN_FILL = 0.95
#: gridDim.x limit (CUDA programming guide, technical specifications).
_MAX_GRID_X = 2**31 - 1
#: Shared memory per SM in KB (CUDA programming guide, compute capabilities table), for the CTAs
#: per SM the decode tiles are sized for; the driver reserves 1 KB of it per resident CTA.
SMEM_PER_SM_KB = {80: 164, 86: 100, 87: 164, 89: 100, 90: 228, 100: 228, 103: 228, 120: 100}


@dataclass(frozen=True)
class DecodeTile:
    """K/V tiling of one split-KV variant (see DECODE_TILES for the reason of each row)."""

    block_n: int  # keys per K/V tile, shared by the CTA's warps (each key column of warps takes an equal part)
    stages: int  # K/V tiles in the cp.async ring: stages - 1 in flight while one is used
    min_blocks: int  # CTAs per SM the shared memory is sized for (__launch_bounds__ minimum)


#: Split-KV tiles per head-dim bucket (Hopper: 227 KB per CTA, 228 KB per SM). Decode streams the
#: cache once, so the rows are about bytes in flight: at ~4.5 TB/s and ~1 us of loaded latency an
#: SM needs ~35 KB of loads outstanding; every row keeps >= 2 tiles (>= 32 KB) in flight per CTA.
#: K/V rows are unpadded (XOR-swizzled chunks) where the bucket is a multiple of 64, else padded by 8
#: elements (decode_kv_row_elements). Shared memory = 2 * 16 * m_slabs * (d + 8) (Q) + 512 (m, l) +
#: 4 * stages * block_n * kv_row (K and V stages). Registers per thread: O 16 * d / 32 + S
#: block_n * m_slabs / 8 (FA2's per-warp steps on one 16-row slab). hd128 swept on the H200 with
#: tools/tune_decode.py; the other rows follow the same bytes-in-flight reasoning, untuned.
DECODE_TILES: dict[int, DecodeTile] = {
    # 20 KB stages of 128 keys (a K tile is 8 KB): 4 stages = 82 KB, 2 CTAs/SM, 96 KB in flight per SM.
    32: DecodeTile(128, 4, 2),
    # 16 KB stages of 64 keys: 4 stages = 66 KB, 2 CTAs/SM, 96 KB in flight per SM.
    64: DecodeTile(64, 4, 2),
    # 27 KB stages: 3 stages = 80 KB, 2 CTAs/SM.
    96: DecodeTile(64, 3, 2),
    # 32 KB stages: 2 stages (69 KB with Q) at 3 CTAs/SM. Measured with the swizzled rows (KV TB/s vs
    # cuDNN, median of 9 shapes): 2 stages x 3 CTAs 0.988, 3 x 2 0.982, 4 x 1 0.874, 128-key tiles
    # 2 x 1 0.761 (before the swizzle: 2 x 3 0.895, 4 x 2 0.884, 3 x 2 0.878, 128-key 2 x 1 0.748).
    128: DecodeTile(64, 2, 3),
    # 43 KB stages: 2 stages (86 KB) keep 2 CTAs/SM, 86 KB in flight per SM.
    160: DecodeTile(64, 2, 2),
    # 48 KB stages: 2 stages (99 KB), 2 CTAs/SM.
    192: DecodeTile(64, 2, 2),
    # 59 KB stages: 2 would not fit twice per SM; 3 stages (178 KB) at 1 CTA/SM, 119 KB in flight.
    224: DecodeTile(64, 3, 1),
    # 64 KB stages (66 KB padded, with more than one slab): 3 stages (<= 203 KB) at 1 CTA/SM.
    256: DecodeTile(64, 3, 1),
}


def smem_per_sm_bytes(arch: str) -> int:
    return SMEM_PER_SM_KB.get(int(_ARCH_RE.match(arch).group(1)), 100) * 1024


def decode_kv_row_elements(head_dim_bucket: int, m_slabs: int) -> int:
    """Elements per K/V smem row of the split-KV kernel (DecodeConfig::kKVStride): unpadded, with
    XOR-swizzled 16-byte chunks, where the bucket is whole 128-byte groups (except hd256 with more
    than one slab, which would spill); padded by 8 otherwise."""
    swizzled = head_dim_bucket % 64 == 0 and not (head_dim_bucket == 256 and m_slabs > 1)
    return head_dim_bucket if swizzled else head_dim_bucket + 8


def decode_smem_bytes(head_dim_bucket: int, m_slabs: int, tile: DecodeTile) -> int:
    """Dynamic shared memory of the split-KV kernel: must match DecodeConfig::kSmemBytes."""
    stride = head_dim_bucket + 8
    kv_stride = decode_kv_row_elements(head_dim_bucket, m_slabs)
    warps_n = 4 // m_slabs
    q = 2 * 16 * m_slabs * stride
    ml = 2 * 4 * warps_n * 16 * m_slabs
    pipe = 2 * 2 * tile.stages * tile.block_n * kv_stride
    merge = 4 * warps_n * 16 * m_slabs * stride  # fp32 merge of the warp columns, over the K/V stages
    return q + ml + max(pipe, merge)


def _decode_fits(bucket: int, m_slabs: int, tile: DecodeTile, arch: str) -> bool:
    smem = decode_smem_bytes(bucket, m_slabs, tile)
    return smem <= max_smem_bytes(arch) and tile.min_blocks * (smem + 1024) <= smem_per_sm_bytes(arch)


def decode_launch_smem(spec_smem: int, ctas_per_sm: int, arch: str) -> int:
    """Dynamic shared memory to launch the split kernel with so that at most ``ctas_per_sm`` of its
    CTAs are resident per SM: the kernel's own ``spec_smem``, padded up to a whole ``ctas_per_sm``-th
    of the SM's shared memory (less the 1 KB the driver reserves per CTA) when that holds fewer CTAs
    than the kernel's size would. The padding is never touched; it only spaces the CTAs out."""
    if ctas_per_sm < 1:
        raise ValueError(f"ctas_per_sm must be >= 1, got {ctas_per_sm}")
    share = min(smem_per_sm_bytes(arch) // ctas_per_sm - 1024, max_smem_bytes(arch))
    return max(spec_smem, share)


def max_launch_smem(spec) -> int:
    """The most dynamic shared memory a launch of ``spec`` may ask for (the limit a loaded function is
    given): split-KV decode launches may be padded (decode_launch_smem) up to the GPU's per-CTA
    maximum; every other kernel asks for exactly its own."""
    return max_smem_bytes(spec.arch) if isinstance(spec, DecodeSpec) else spec.smem_bytes


def decode_tile(bucket: int, m_slabs: int, arch: str) -> DecodeTile:
    """The split-KV tile for ``bucket`` and ``m_slabs`` on ``arch``: the DECODE_TILES row, or where its
    CTAs do not fit min_blocks per SM, fewer stages (down to 2), then fewer CTAs per SM with the
    row's stages and down to a single stage (untuned on those GPUs). ValueError if nothing fits."""
    t = DECODE_TILES[bucket]
    for mb in range(t.min_blocks, 0, -1):
        for st in range(t.stages, 0 if mb == 1 else 1, -1):
            c = DecodeTile(t.block_n, st, mb)
            if _decode_fits(bucket, m_slabs, c, arch):
                return c
    raise ValueError(
        f"no decode tile for head dim {bucket} with {16 * m_slabs}-row CTAs fits the shared memory of {arch}"
    )


def decode_m_slabs_options(bucket: int, arch: str) -> tuple[int, ...]:
    """The slab counts whose CTAs fit ``arch`` for ``bucket`` (all of DECODE_M_SLABS on sm_80 / sm_90)."""
    out = []
    for m in DECODE_M_SLABS:
        try:
            decode_tile(bucket, m, arch)
        except ValueError:
            continue
        out.append(m)
    return tuple(out)


@dataclass(frozen=True)
class DecodeSpec:
    """One split-KV attention variant (the causal mask is a run-time flag: it costs one compare per tile)."""

    head_dim: int  # bucket
    dtype: str
    aligned: bool  # 16-byte cp.async loads (else element-wise loads for odd head dims / strides)
    m_slabs: int  # 16-row slabs of packed query rows per CTA
    tile: DecodeTile
    arch: str
    cta_loads: bool = False  # the CTA loads each K/V tile together (else each key column of warps its rows)
    tail_grid: bool = False  # the tail-split grid's 1-D CTA mapping (_tail_split), else the split grids'
    family: str = "flash_decode"

    @property
    def name(self) -> str:
        t = self.tile
        return (
            f"{self.family}_hd{self.head_dim}_{self.dtype}_ms{self.m_slabs}_bn{t.block_n}_st{t.stages}"
            f"_mb{t.min_blocks}{'_cta' if self.cta_loads else ''}{'_tail' if self.tail_grid else ''}"
            f"_{_load_tag(self.aligned)}_{_arch_tag(self.arch)}"
        )

    threads = DECODE_THREADS

    @property
    def min_blocks(self) -> int:
        return self.tile.min_blocks

    @property
    def smem_bytes(self) -> int:
        return decode_smem_bytes(self.head_dim, self.m_slabs, self.tile)

    def template_args(self) -> str:
        """C++ template argument list of cuflash::DecodeConfig for this variant."""
        t, b = self.tile, _cpp_bool
        return (f"{self.head_dim}, {t.block_n}, {self.m_slabs}, {t.stages}, {b(self.dtype == 'bf16')}, {b(self.aligned)}, "
                f"{b(self.cta_loads)}, {b(self.tail_grid)}")


class _DecodeHelperKernel:
    """Launch shape of the decode helper kernels (append, combine): 4 warps, static shared memory only,
    no CTAs-per-SM target."""

    threads = DECODE_THREADS
    min_blocks = 1
    smem_bytes = 0


@dataclass(frozen=True)
class DecodeAppendSpec(_DecodeHelperKernel):
    """The in-place append of new tokens into the cache: dtype-free 2-byte copies, any head dim."""

    aligned: bool  # 16-byte copies (else element-wise)
    arch: str
    family: str = "flash_decode_append"

    @property
    def name(self) -> str:
        return f"{self.family}_{_load_tag(self.aligned)}_{_arch_tag(self.arch)}"

    def template_args(self) -> str:
        return _cpp_bool(self.aligned)


@dataclass(frozen=True)
class DecodeCombineSpec(_DecodeHelperKernel):
    """The merge of the splits' partial rows as a kernel of its own: one CTA per output row. Wide: each
    warp loads up to 32 (hd > 128: 16) of its splits at once; lean: 4, at DECODE_COMBINE_LEAN_CTAS_PER_SM
    CTAs per SM (see decode_combine_lean)."""

    head_dim: int  # bucket (floats per partial row)
    dtype: str
    arch: str
    lean: bool = False
    family: str = "flash_decode_combine"

    @property
    def name(self) -> str:
        return f"{self.family}_hd{self.head_dim}_{self.dtype}{'_lean' if self.lean else ''}_{_arch_tag(self.arch)}"

    @property
    def min_blocks(self) -> int:
        return DECODE_COMBINE_LEAN_CTAS_PER_SM if self.lean else 1

    @property
    def splits_in_flight(self) -> int:
        """Partial rows each warp loads at once (the kernel's kBatch)."""
        return DECODE_COMBINE_LEAN_BATCH if self.lean else 32 // -(-self.head_dim // 128)

    def template_args(self) -> str:
        return f"{self.head_dim}, {_cpp_bool(self.dtype == 'bf16')}, {self.splits_in_flight}"


@dataclass(frozen=True)
class DecodePlan:
    attn: Launch  # split-KV attention: grid (num_splits * num_row_blocks, nheads_kv, batch), or split_major (nheads_kv, batch, that)
    append: Launch | None  # new tokens into the cache; None without new tokens
    num_splits: int
    num_row_blocks: int  # CTAs per (split, kv head, sequence) along the packed query rows
    combine: Launch | None = None  # merge of the splits after attn; None: one split, or merged inside attn
    ctas_per_sm: int = 0  # split CTAs resident per SM (attn's shared memory padded where below the tile's)
    split_tiles: int = 0  # K/V tiles per split, the last one taking the rest; 0: equal splits (the kernel's ceil)
    split_major: bool = False  # attn's grid is (nheads_kv, batch, splits): the last split's CTAs start last
    tail_groups: int = 0  # > 0: attn's grid is 1-D: the last tail_groups groups in num_splits splits, the rest whole


def decode_separate_combine(rows_per_cta: int, num_splits: int) -> bool:
    """Whether the combine kernel merges the splits (else the last split CTA of each group does):
    more than DECODE_IN_KERNEL_MERGE_MAX partial rows per group."""
    return num_splits > 1 and rows_per_cta * num_splits > DECODE_IN_KERNEL_MERGE_MAX


def decode_combine_lean(out_rows: int, num_splits: int, num_sms: int) -> bool:
    """Whether the combine kernel runs lean (DecodeCombineSpec): where every warp's splits still fit
    one batch of DECODE_COMBINE_LEAN_BATCH (the lean kernel then waits as long as the wide one), or
    where the wide kernel's CTAs (one per output row) would take more than one wave of
    DECODE_COMBINE_WIDE_CTAS_PER_SM per SM."""
    one_batch = num_splits <= DECODE_COMBINE_LEAN_BATCH * (DECODE_THREADS // 32)
    return one_batch or out_rows > DECODE_COMBINE_WIDE_CTAS_PER_SM * num_sms


def decode_spec(head_dim: int, dtype: str, aligned: bool, m_slabs: int, arch: str) -> DecodeSpec:
    bucket = head_dim_bucket(head_dim)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if aligned and head_dim % 8 != 0:
        raise ValueError("the 16-byte load path needs head_dim % 8 == 0")
    if m_slabs not in DECODE_M_SLABS:
        raise ValueError(f"m_slabs must be one of {DECODE_M_SLABS}, got {m_slabs}")
    return DecodeSpec(bucket, dtype, bool(aligned), m_slabs, decode_tile(bucket, m_slabs, arch), arch)


def decode_m_slabs(rows: int, bucket: int, arch: str) -> int:
    """Fewest slabs that hold ``rows`` packed query rows in one CTA, else the most that fit ``arch``
    (the rows are then spread over row blocks, which read the same K/V through L2)."""
    options = decode_m_slabs_options(bucket, arch)
    if not options:
        raise ValueError(f"no decode tile for head dim {bucket} fits the shared memory of {arch}")
    return next((m for m in options if 16 * m >= rows), options[-1])


def decode_num_splits(*, ctas: int, n_tiles: int, slots: int, min_tiles: int, max_tiles: int = 0,
                      filled_tiles=None) -> int:  # fmt: skip
    """Key splits per sequence that fill the GPU: the s in [s_min, s_max] minimizing the modeled time
    ceil(ctas * s / slots) * (ceil(n_tiles / s) + DECODE_CTA_OVERHEAD_TILES) (waves of resident CTAs,
    times the tiles one CTA streams plus its fixed cost), taking the smallest s within 2% of the best.
    filled_tiles(s): the tiles of a long split where s splits would be planned as a filled grid (the
    tails ride in the last wave's free slots), else None; the model then counts those instead.

    ctas: CTAs without splitting (batch * nheads_kv * row blocks); n_tiles: K/V tiles of the longest
    sequence; slots: CTAs resident at once (SMs x CTAs per SM); s_max: min(MAX_DECODE_SPLITS,
    n_tiles // min_tiles), so a split gets at least min_tiles tiles; s_min: ceil(n_tiles / max_tiles)
    (at most s_max), so a split gets at most max_tiles tiles (0: no limit).
    """
    if min(ctas, n_tiles, slots, min_tiles) < 1 or max_tiles < 0:
        raise ValueError("decode_num_splits needs positive ctas, n_tiles, slots and min_tiles, and max_tiles >= 0")
    s_max = max(1, min(MAX_DECODE_SPLITS, n_tiles // min_tiles))
    s_min = min(s_max, -(-n_tiles // max_tiles)) if max_tiles else 1
    def tiles(s: int) -> int:
        filled = filled_tiles(s) if filled_tiles else None
        return -(-n_tiles // s) if filled is None else filled

    cost = {s: -(-ctas * s // slots) * (tiles(s) + DECODE_CTA_OVERHEAD_TILES) for s in range(s_min, s_max + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= best * 1.02)


def plan_decode(
    *,
    batch: int,
    seqlen_q: int,
    nheads: int,
    nheads_kv: int,
    head_dim: int,
    dtype: str,
    aligned: bool,
    max_seqlen: int,
    num_splits: int,
    num_sms: int,
    arch: str,
    seqlen_new: int = 0,
    append_aligned: bool = False,
    ctas_per_sm: int = 0,
    uniform_lengths: bool = False,
) -> DecodePlan:
    """Kernels, grids and split count of one decode call (batch, seqlen_q, heads >= 1).

    max_seqlen: the most keys any sequence attends to (after the append), or an upper bound (the
    capacity) where the lengths live on the GPU. num_splits: 0 = heuristic (decode_num_splits),
    else that many, at most MAX_DECODE_SPLITS and at most one per K/V tile. num_sms: the GPU's SMs.
    ctas_per_sm: split CTAs resident per SM, 1 to the tile's min_blocks (fewer by padding their shared
    memory, decode_launch_smem); 0 = the plan's: with num_splits=0, decode_num_splits for
    DECODE_LONG_CTAS_PER_SM per SM if its splits stream at least DECODE_LONG_CTA_KEYS keys, else
    decode_num_splits for the tile's min_blocks per SM (the count and the CTAs per SM it was chosen
    for stay together); with a given num_splits, DECODE_LONG_CTAS_PER_SM where its splits are that
    long, else min_blocks. uniform_lengths: every sequence attends to the same number of keys, within
    the last 64-key step below max_seqlen (one length for all, known on the host), which the filled
    and the tail-split grids need; with num_splits=0 and ctas_per_sm=0 the plan may then take one
    (_filled_grid, _tail_split), and the deep grid (_deep_grid: whole groups at the tile's CTAs per SM
    with a tail split) instead of the split model's plan; before all of these, the unsplit wave
    (_unsplit_wave: about one group per SM, each whole, one CTA per SM) where it applies.
    """
    if min(batch, seqlen_q, nheads, nheads_kv, num_sms) < 1:
        raise ValueError("plan_decode needs non-empty dimensions and num_sms >= 1; empty inputs never launch")
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if num_splits < 0 or max_seqlen < 0 or seqlen_new < 0:
        raise ValueError(f"num_splits, max_seqlen and seqlen_new must be >= 0, got {num_splits}, {max_seqlen}, {seqlen_new}")
    if nheads_kv > 65535 or batch > 65535:
        raise ValueError(f"nheads_kv and batch must each be at most 65535 (grid limits), got {nheads_kv} and {batch}")
    bucket = head_dim_bucket(head_dim)
    rows = (nheads // nheads_kv) * seqlen_q
    m_slabs = decode_m_slabs(rows, bucket, arch)
    spec = decode_spec(head_dim, dtype, aligned, m_slabs, arch)
    row_blocks = -(-rows // (16 * m_slabs))
    n_tiles = -(-max_seqlen // spec.tile.block_n)
    if isinstance(ctas_per_sm, bool) or not 0 <= ctas_per_sm <= spec.tile.min_blocks:
        raise ValueError(f"ctas_per_sm must be 0 (the tile's) or 1..{spec.tile.min_blocks}, got {ctas_per_sm!r}")
    bn = spec.tile.block_n
    spaced = min(DECODE_LONG_CTAS_PER_SM, spec.tile.min_blocks)
    groups = batch * nheads_kv  # (sequence, kv head) groups

    def long_ctas(s: int) -> bool:
        return -(-n_tiles // s) * bn >= DECODE_LONG_CTA_KEYS

    own_grid = uniform_lengths and num_splits == 0 and ctas_per_sm == 0  # the plan may pick the grid's shape
    unsplit_wave = own_grid and _unsplit_wave(groups * row_blocks, n_tiles, spec, num_sms)
    may_fill = own_grid and not unsplit_wave
    tail = None  # (splits, tail_groups) of a tail-split grid (_tail_split, _deep_grid)
    if unsplit_wave:
        splits, per_sm = 1, 1
    elif num_splits == 0:
        def auto(per_sm: int) -> int:
            def filled_tiles(s: int) -> int | None:  # the split count as _filled_grid below would plan it
                got = _filled_grid(groups, n_tiles, s, per_sm, row_blocks, rows, spec, num_sms, for_model=True)
                return None if got is None else got[1]

            return decode_num_splits(ctas=groups * row_blocks, n_tiles=max(1, n_tiles),
                                     slots=num_sms * per_sm, min_tiles=-(-MIN_DECODE_KEYS_PER_SPLIT // bn),
                                     max_tiles=MAX_DECODE_KEYS_PER_SPLIT // bn,
                                     filled_tiles=filled_tiles if may_fill and n_tiles else None)  # fmt: skip

        # The split count and the CTAs per SM it was chosen for go together: a count picked for the
        # tile's slots is launched with them even where its splits come out long.
        per_sm = ctas_per_sm or spaced
        splits = auto(per_sm)
        if not ctas_per_sm and not long_ctas(splits):
            per_sm = spec.tile.min_blocks  # short CTAs: as many per SM as fit
            splits = auto(per_sm)
        if may_fill and splits == 1:  # the split model's whole groups, their last wave split where that pays
            tail = _tail_split(groups, n_tiles, per_sm, row_blocks, rows, spec, num_sms)
        if may_fill and tail is None:
            tail = _deep_grid(groups, n_tiles, row_blocks, rows, spec, num_sms)
            if tail is not None:
                per_sm, splits = spec.tile.min_blocks, 1  # whole groups and a tail split, at the tile's CTAs per SM
    else:
        splits = max(1, min(num_splits, MAX_DECODE_SPLITS, n_tiles))
        per_sm = ctas_per_sm or (spaced if long_ctas(splits) else spec.tile.min_blocks)
    block = (DECODE_THREADS, 1, 1)
    pdl = supports_pdl(arch)  # every decode kernel waits for the one before it (flash_decode.cuh)
    filled = None
    if may_fill:
        filled = _filled_grid(groups, n_tiles, splits, per_sm, row_blocks, rows, spec, num_sms)
    split_tiles = tail_groups = 0
    if filled is not None:
        splits, split_tiles = filled
        grid = (nheads_kv, batch, splits)
    elif tail is not None:  # the filled grid, where both apply (one split of >= 96 tiles), takes precedence
        splits, tail_groups = tail
        grid = (groups + (splits - 1) * tail_groups, 1, 1)
        spec = dataclasses.replace(spec, tail_grid=True)
    else:
        grid = (splits * row_blocks, nheads_kv, batch)
    smem = spec.smem_bytes if per_sm == spec.tile.min_blocks else decode_launch_smem(spec.smem_bytes, per_sm, arch)
    if decode_cta_loads(spec.tile, per_sm):
        spec = dataclasses.replace(spec, cta_loads=True)
    attn = Launch(spec, grid, block, smem, pdl)
    append = None
    if seqlen_new > 0:
        chunks = -(-head_dim // 8) if append_aligned else head_dim
        total = batch * seqlen_new * nheads_kv * chunks
        append = Launch(DecodeAppendSpec(bool(append_aligned), arch), (min(-(-total // DECODE_THREADS), 1 << 20), 1, 1), block,
                        0, pdl)  # fmt: skip
    combine = None
    if decode_separate_combine(min(rows, 16 * m_slabs), splits):
        out_rows = batch * nheads * seqlen_q
        if out_rows > _MAX_GRID_X:
            raise ValueError(f"batch * nheads * seqlen_q = {out_rows} output rows exceed the grid limit {_MAX_GRID_X}")
        lean = decode_combine_lean(out_rows, splits, num_sms)
        combine = Launch(DecodeCombineSpec(spec.head_dim, dtype, arch, lean), (out_rows, 1, 1), block, 0, pdl)
    return DecodePlan(attn, append, splits, row_blocks, combine, per_sm, split_tiles, filled is not None, tail_groups)


def _unsplit_wave(ctas: int, n_tiles: int, spec: DecodeSpec, num_sms: int) -> bool:
    """Whether ``ctas`` unsplit CTAs (groups x row blocks) of ``n_tiles`` tiles run as the unsplit wave,
    one per SM (see DECODE_ONE_WAVE_MIN_FILL)."""
    if not (supports_pdl(spec.arch) and spec.head_dim in DECODE_ONE_WAVE_BUCKETS and spec.m_slabs == 1
            and spec.aligned):
        return False
    keys = n_tiles * spec.tile.block_n
    return DECODE_ONE_WAVE_MIN_FILL * num_sms <= ctas <= num_sms and DECODE_LONG_CTA_KEYS <= keys <= MAX_DECODE_KEYS_PER_SPLIT


def _filled_grid(groups: int, n_tiles: int, splits: int, per_sm: int, row_blocks: int, rows: int, spec: DecodeSpec,
                 num_sms: int, *, for_model: bool = False) -> tuple[int, int] | None:  # fmt: skip
    """(splits, tiles per split) of the filled grid where it replaces the split plan's (splits, per_sm)
    grid of equal splits, else None (see DECODE_FILL_MIN_UNSPLIT_TILES and DECODE_FILL_UNSPLIT_MIN_FREE).
    for_model: as the split count's model prices it, without the nearly-full rule for one split, so
    that rule decides how a one-split count runs (filled or whole), never the count itself (else a
    refused one-split fill could tip the model to a filled grid of more splits, which was not measured).

    The ``splits`` long splits of every group run in waves of ``slots`` CTAs; the last wave leaves
    ``free`` slots empty, through which the groups' tails go in rounds = ceil(groups / free) one
    after another while that wave runs, so a tail gets about 1 / rounds of a long split: the long
    splits get B = ceil(n_tiles * rounds / (splits * rounds + 1)) tiles, the tail the rest, and the
    rounds of tails end before the last wave of long splits does."""
    slots = num_sms * DECODE_LONG_CTAS_PER_SM
    free = -(-splits * groups // slots) * slots - splits * groups  # slots the long splits leave empty in their last wave
    if not (supports_pdl(spec.arch) and row_blocks == 1 and per_sm == DECODE_LONG_CTAS_PER_SM and free > 0):
        return None
    rounds = -(-groups // free)
    if rounds == 1:  # a free slot for every tail: that is one more equal split, not a filled grid
        return None
    long_tiles = -(-n_tiles * rounds // (splits * rounds + 1))
    tail = n_tiles - splits * long_tiles
    if splits > 1:
        need = -(-DECODE_LONG_CTA_KEYS // spec.tile.block_n)
    elif not for_model and free < DECODE_FILL_UNSPLIT_MIN_FREE * slots:
        need = DECODE_FILL_MIN_UNSPLIT_TILES_FULL
    else:
        need = DECODE_FILL_MIN_UNSPLIT_TILES
    if tail < 1 or long_tiles < need or rounds * tail > long_tiles:
        return None
    if splits + 1 > MAX_DECODE_SPLITS or decode_separate_combine(rows, splits + 1):
        return None
    return splits + 1, long_tiles


def decode_tail_grid_variant(bucket: int, m_slabs: int, arch: str) -> bool:
    """Whether a tail-split variant (DecodeSpec.tail_grid) of this bucket and slab count exists for
    ``arch``: one slab (the kernel's mapping), the measured buckets (DECODE_TAIL_SPLIT_BUCKETS), sm_90+."""
    return m_slabs == 1 and bucket in DECODE_TAIL_SPLIT_BUCKETS and supports_pdl(arch)


def _tail_split(groups: int, n_tiles: int, per_sm: int, row_blocks: int, rows: int, spec: DecodeSpec,
                num_sms: int) -> tuple[int, int] | None:  # fmt: skip
    """(splits, tail_groups) of the tail-split grid where it replaces a one-split grid of ``groups``
    whole groups of ``n_tiles`` tiles at ``per_sm`` CTAs per SM, else None (see
    DECODE_TAIL_SPLIT_MIN_GAIN).

    The whole groups run in ``waves`` full waves of ``slots`` CTAs; the ``tail`` groups left over
    would run as one more wave with slots empty. Split s ways, they are tail * s CTAs of
    ceil(n_tiles / s) tiles in ceil(tail * s / slots) waves of their own. s: at least 2, at most
    MAX_DECODE_SPLITS, splits of at least MIN_DECODE_KEYS_PER_SPLIT keys, merged in the kernel (at most
    DECODE_IN_KERNEL_MERGE_MAX partial rows); the modeled cheapest, the smallest of equals. Only where
    a kTailGrid variant exists (decode_tail_grid_variant), in one row block."""
    slots = num_sms * per_sm
    waves, tail = divmod(groups, slots)
    if not (decode_tail_grid_variant(spec.head_dim, spec.m_slabs, spec.arch) and row_blocks == 1 and tail > 0):
        return None
    if waves < DECODE_TAIL_SPLIT_MIN_WAVES or tail > DECODE_TAIL_SPLIT_MAX_FILL * slots:
        return None
    if n_tiles < DECODE_TAIL_SPLIT_MIN_TILES:
        return None
    over = DECODE_CTA_OVERHEAD_TILES

    def last_waves(s: int) -> int:  # the tail groups' time in the model, in tiles
        return -(-tail * s // slots) * (-(-n_tiles // s) + over) + (over if s > 1 else 0)

    s_max = min(MAX_DECODE_SPLITS, n_tiles // -(-MIN_DECODE_KEYS_PER_SPLIT // spec.tile.block_n))
    options = [s for s in range(2, s_max + 1) if not decode_separate_combine(rows, s)]
    if not options:
        return None
    best = min(options, key=lambda s: (last_waves(s), s))
    whole = waves * (n_tiles + over)
    if whole + last_waves(best) > (1 - DECODE_TAIL_SPLIT_MIN_GAIN) * (whole + last_waves(1)):
        return None
    if groups + (best - 1) * tail > _MAX_GRID_X:
        return None
    return best, tail


def _deep_grid(groups: int, n_tiles: int, row_blocks: int, rows: int, spec: DecodeSpec,
               num_sms: int) -> tuple[int, int] | None:  # fmt: skip
    """(splits, tail_groups) of the tail split where ``groups`` whole groups of ``n_tiles`` tiles run
    at the tile's min_blocks CTAs per SM rather than as the split model plans them (see
    DECODE_DEEP_MIN_WAVES), else None: the tile holds more CTAs per SM than DECODE_LONG_CTAS_PER_SM,
    the groups fill at least DECODE_DEEP_MIN_WAVES waves at min_blocks per SM, are at most
    DECODE_DEEP_MAX_KEYS keys, and _tail_split takes the last wave."""
    per_sm = spec.tile.min_blocks
    if per_sm <= DECODE_LONG_CTAS_PER_SM or n_tiles * spec.tile.block_n > DECODE_DEEP_MAX_KEYS:
        return None
    if groups < DECODE_DEEP_MIN_WAVES * num_sms * per_sm:
        return None
    return _tail_split(groups, n_tiles, per_sm, row_blocks, rows, spec, num_sms)


def all_decode_specs(arch: str, head_dims=HEAD_DIM_BUCKETS, dtypes=DTYPES, causals=None, aligned=(True, False),
                     m_slabs=DECODE_M_SLABS):  # fmt: skip
    """Every decode variant (split-KV attention, append) for ``arch``. ``causals`` is accepted
    for the precompile command's uniform call and ignored: causal is a run-time flag in decode."""
    specs: list = []
    for dt in dtypes:
        for d in head_dims:
            bucket = head_dim_bucket(d)
            fitting = decode_m_slabs_options(bucket, arch)
            for al in aligned:
                for m in m_slabs:
                    if m in fitting:
                        tile = decode_tile(bucket, m, arch)
                        specs.append(DecodeSpec(bucket, dt, al, m, tile, arch))
                        if decode_cta_loads(tile, DECODE_LONG_CTAS_PER_SM):  # the plan's long splits
                            specs.append(DecodeSpec(bucket, dt, al, m, tile, arch, cta_loads=True))
                        if decode_tail_grid_variant(bucket, m, arch):  # _tail_split's, at both CTAs per SM
                            specs += [DecodeSpec(bucket, dt, al, m, tile, arch, cta_loads=c, tail_grid=True)
                                      for c in sorted({False, decode_cta_loads(tile, DECODE_LONG_CTAS_PER_SM)})]
    specs += [DecodeCombineSpec(head_dim_bucket(d), dt, arch, lean) for dt in dtypes for d in head_dims
              for lean in (False, True)]
    specs += [DecodeAppendSpec(al, arch) for al in aligned]
    return list(dict.fromkeys(specs))
