"""Every kernel variant the library can launch (forward and backward) compiles with NVRTC for
sm_80 and sm_90a (no GPU needed), and its registers and local memory (read from the cubin) stay
within budget."""
from __future__ import annotations

import dataclasses
import os

import pytest

from cuflash import jit, plan

ARCHS = ("sm_80", "sm_90a")

#: Local memory (stack frame bytes per thread, read from the cubin: spills live there) allowed per
#: variant, whatever NVRTC version compiles it. hd64 on the 16-byte load path has none at all. The
#: hd128/hd256 tiles run at the 255-register ceiling (as FA2's do) and park a few values outside
#: the MMA loops; other buckets a little more. The element-wise load path (odd head dims, unaligned
#: strides) is a correctness fallback and may spill more.
MAX_STACK_BYTES = {64: 0, 128: 96, 256: 96}
MAX_STACK_BYTES_OTHER = 160
MAX_STACK_BYTES_SCALAR = 640
#: The backward main kernel keeps dK and dV (up to 128 fp32 registers) live through the loop and
#: runs at the 255-register ceiling; a few values live in local memory (at most 80 bytes measured).
#: Its preprocess and convert kernels have none.
MAX_STACK_BYTES_BWD = 96


#: The Hopper kernels keep at most 128 + 64 accumulators per thread and do not spill, except the
#: hd256 backward (dK, dV halves and dQ: 192 accumulators), which parks a few addresses (40 bytes
#: with nvcc 13).
MAX_STACK_BYTES_SM90_BWD_HD256 = 96


def _budget(spec) -> int:
    if spec.family == "flash_bwd_sm90" and spec.head_dim == 256:
        return MAX_STACK_BYTES_SM90_BWD_HD256
    if spec.family in ("flash_fwd_sm90", "flash_fwd_sm90_ws", "flash_bwd_sm90"):
        return 0
    if spec.family.startswith("flash_bwd"):
        return MAX_STACK_BYTES_BWD if spec.family == "flash_bwd" else 0
    if not spec.aligned:
        return MAX_STACK_BYTES_SCALAR
    return MAX_STACK_BYTES.get(spec.head_dim, MAX_STACK_BYTES_OTHER)


def _compile_into(cache, specs):
    """Compile ``specs`` into a cache folder of their own; yields (specs, {name: cache header})."""
    old = os.environ.get("CUFLASH_CACHE_DIR")
    os.environ["CUFLASH_CACHE_DIR"] = str(cache)
    try:
        results = jit.precompile(specs, jobs=max(1, min(4, os.cpu_count() or 1)))
        yield specs, {name: header for name, _, header in results}
    finally:
        if old is None:
            del os.environ["CUFLASH_CACHE_DIR"]
        else:
            os.environ["CUFLASH_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    specs = [s for arch in ARCHS for s in plan.all_fwd_specs(arch) + plan.all_bwd_specs(arch)]
    yield from _compile_into(tmp_path_factory.mktemp("compile-cache"), specs)


@pytest.mark.slow
def test_every_variant_compiles(compiled):
    specs, headers = compiled
    n_main = len(ARCHS) * len(plan.HEAD_DIM_BUCKETS) * 2 * 2 * 2  # buckets x dtypes x causal x load paths
    assert len([s for s in specs if s.family == "flash_fwd"]) == n_main
    # the Hopper forward: sm_90a only, its buckets x dtypes x causal, 16-byte loads only
    hopper = [s for s in specs if s.family == "flash_fwd_sm90"]
    assert len(hopper) == len(plan.FWD_SM90_TILES) * 2 * 2 and {s.arch for s in hopper} == {"sm_90a"}
    ws = [s for s in specs if s.family == "flash_fwd_sm90_ws"]  # the warp-specialized TMA forward, likewise
    tiles = len(plan.FWD_SM90_WS_TILES) + len(plan.FWD_SM90_WS_SHORT_TILES) + len(plan.CLUSTER_KEYS)  # (+ clustered)
    assert len(ws) == tiles * 2 * 2 and sum(s.cluster == 2 for s in ws) == len(plan.CLUSTER_KEYS) * 2 * 2
    assert {s.arch for s in ws} == {"sm_90a"}
    hopper_bwd = [s for s in specs if s.family == "flash_bwd_sm90"]
    assert len(hopper_bwd) == len(plan.BWD_SM90_TILES) * 2 * 2 and {s.arch for s in hopper_bwd} == {"sm_90a"}
    ws_bwd = [s for s in specs if s.family == "flash_bwd_sm90_ws"]
    persistent = len(plan.BWD_SM90_WS_PERSISTENT) * 2  # (the persistent launch where the planner takes it) x dtypes
    assert len(ws_bwd) == len(plan.BWD_SM90_WS_TILES) * 2 * 2 + persistent and {s.arch for s in ws_bwd} == {"sm_90a"}
    assert len([s for s in specs if s.family == "flash_bwd"]) == n_main
    assert len([s for s in specs if s.family in ("flash_bwd_pre", "flash_bwd_convert")]) == len(ARCHS) * 2 * 2 * 2
    assert set(headers) == {s.name for s in specs}
    for s in specs:
        assert headers[s.name]["arch"] == s.arch


@pytest.mark.slow
def test_registers_and_local_memory_within_budget(compiled):
    specs, headers = compiled
    problems = []
    for s in specs:
        p = headers[s.name]["ptxas"]
        assert {"registers", "stack_frame"} <= set(p), (s.name, p)  # read from the cubin: always there
        if not 0 < p["registers"] <= 255:
            problems.append(f"{s.name}: {p['registers']} registers")
        if p["stack_frame"] > _budget(s):
            problems.append(f"{s.name}: {p['stack_frame']} bytes of local memory > {_budget(s)}")
        notes = {k: v for k, v in p.items() if k.startswith("wgmma_")}  # (jit._WGMMA_NOTES: C7513, C7515, C7517)
        if notes:
            problems.append(f"{s.name}: ptxas took the asynchrony out of its wgmma: {notes}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_cluster_tiles_still_compile():
    """No head dim plans clusters of 2 since session 17 (plan.CLUSTER_KEYS is empty, so precompile builds
    none), but the tiles stay selectable: the default tiles of head dims 128 and 256 in clusters compile
    for sm_90a without local memory or wgmma notes, causal or not."""
    for hd in (128, 256):
        for causal in (False, True):
            tile = dataclasses.replace(plan.FWD_SM90_WS_TILES[hd], cluster=2)
            _, header = jit.compile_cubin(plan.fwd_sm90_ws_spec(hd, "bf16", causal, tile))
            p = header["ptxas"]
            assert p["stack_frame"] == 0 and not {k for k in p if k.startswith("wgmma_")}, (hd, causal, p)


@pytest.mark.slow
def test_bwd_wide_query_rows_compile_within_budget():
    """The TMA backward's wide query blocks (tools/tune_bwd.py --block-m): 128 rows at head dim 64 (planned
    there since session 34, but for softcap) and 80 at 128 (a candidate: dQ^T, with the convert kernel's
    transposed builds). Plain (per key block and persistent) and ALiBi builds keep everything in registers,
    and every build keeps its wgmma asynchronous. (Issued before dS^T, as at 64 rows, dV made ptxas serialize
    every wgmma for want of registers, C7512, and park 48 bytes.) Local memory elsewhere (NVRTC 12.9; nvcc 13):
    128 rows with dropout 80 bytes, with every variant but softcap 96 (packed 104); 80 rows with a window 0
    (40), packed 8 (8), both and ALiBi 24."""
    specs = []
    for causal in (False, True):
        for bucket, tile in ((64, plan.BwdSm90WsTile(block_m=128, stages=3)), (128, plan.BwdSm90WsTile(block_m=80))):
            specs += [plan.bwd_sm90_ws_spec(bucket, "bf16", causal, tile, m)
                      for m in (0, plan.MOD_WINDOW, plan.MOD_ALIBI, plan.MOD_VARLEN)]  # fmt: skip
            specs.append(plan.bwd_sm90_ws_spec(bucket, "fp16", causal, dataclasses.replace(tile, stages=2, persistent=True)))
    wide64 = plan.BWD_SM90_WS_TILES[64]
    assert wide64 == plan.BwdSm90WsTile(block_m=128, stages=3)  # (the planned tile)
    every = plan.ALL_MODS & ~plan.MOD_SOFTCAP  # (softcap runs 64 rows)
    specs += [plan.bwd_sm90_ws_spec(64, "bf16", c, wide64, m) for c in (False, True)
              for m in (plan.MOD_DROPOUT, every, every | plan.MOD_VARLEN)]  # fmt: skip
    specs += [plan.BwdAuxSpec("flash_bwd_convert", dt, al, "sm_90a", vl, True)
              for dt in ("bf16", "fp16") for al in (True, False) for vl in (False, True)]  # fmt: skip
    for spec in specs:
        _, header = jit.compile_cubin(spec)
        p = header["ptxas"]
        assert not {k for k in p if k.startswith("wgmma_")}, (spec.name, p)
        mods = getattr(spec, "mods", 0)
        budget = {plan.MOD_WINDOW: 48, plan.MOD_VARLEN: 32}.get(mods, VARIANT_EXTRA_STACK_BYTES if mods & plan.MOD_DROPOUT else 0)
        assert p["stack_frame"] <= budget, (spec.name, p)


@pytest.mark.slow
def test_fwd_look_ahead_compiles_within_budget():
    """The TMA forward's look-ahead (the next item's first S issued before the epilogue, two Q slots;
    a tools/tune_fwd.py --ws candidate, not planned until measured) on the persistent short-key tiles of head dims
    64 and 128: plain, dropout, ALiBi and softcap builds keep everything in registers and every wgmma
    asynchronous, fp16 and bf16, causal or not. (With a window the hd128 tile parks 104 bytes causal and 168
    not, where the same tile without the look-ahead parks 0 and 96.)"""
    specs = []
    for hd in (64, 128):
        tile = dataclasses.replace(plan.FWD_SM90_WS_SHORT_TILES[hd], look_ahead=True)
        for causal in (False, True):
            specs += [plan.fwd_sm90_ws_spec(hd, "bf16", causal, tile, m)
                      for m in (0, plan.MOD_DROPOUT, plan.MOD_ALIBI, plan.MOD_SOFTCAP)]  # fmt: skip
            specs.append(plan.fwd_sm90_ws_spec(hd, "fp16", causal, dataclasses.replace(tile, tma_store=True)))
            deeper = dataclasses.replace(tile, stages=3) if hd == 64 else dataclasses.replace(tile, block_n=64, stages=4)
            specs.append(plan.fwd_sm90_ws_spec(hd, "bf16", causal, deeper))  # (the GPU tests' deeper rings)
    for spec in specs:
        assert spec.tile.look_ahead, spec.name
        _, header = jit.compile_cubin(spec)
        p = header["ptxas"]
        assert p["stack_frame"] == 0 and not {k for k in p if k.startswith("wgmma_")}, (spec.name, p)


@pytest.mark.slow
def test_shared_memory_fits(compiled):
    specs, headers = compiled
    for s in specs:
        assert headers[s.name]["smem_bytes"] <= 227 * 1024, s.name
        if s.min_blocks > 1:  # the occupancy the launch bounds ask for must fit an SM (228 KB)
            assert s.min_blocks * (headers[s.name]["smem_bytes"] + 1024) <= 228 * 1024, s.name


# ---------------------------------------------------------------------------------------------
# Decode (split-KV with the merge of the splits, append)
# ---------------------------------------------------------------------------------------------

#: Local memory of the decode variants (NVRTC 12.9: every 16-byte-path variant has none; the
#: element-wise path spills at most 88 bytes at head dims >= 192).
DECODE_MAX_STACK_BYTES = 0
DECODE_MAX_STACK_BYTES_SCALAR = 256


def _decode_ci_selection(spec) -> bool:
    """The decode variants compiled by default (CI has 2 cores; all of sm_80 and sm_90a, 276 with the
    append and combine kernels, take ~100 s there): every bf16 16-byte variant (each bucket and slab
    count), fp16 at 64/128/256, the element-wise path with one slab at every bucket (and 2 and 4 at
    hd128), and every append, combine and rotary kernel.
    CUFLASH_COMPILE_ALL_DECODE=1 compiles them all."""
    if os.environ.get("CUFLASH_COMPILE_ALL_DECODE") == "1" or spec.family != "flash_decode":
        return True
    if spec.aligned:
        return spec.dtype == "bf16" or (spec.m_slabs == 1 and spec.head_dim in (64, 128, 256))
    return spec.dtype == "bf16" and (spec.m_slabs == 1 or spec.head_dim == 128)


@pytest.fixture(scope="module")
def compiled_decode(tmp_path_factory):
    specs = [s for arch in ARCHS for s in plan.all_decode_specs(arch) if _decode_ci_selection(s)]
    yield from _compile_into(tmp_path_factory.mktemp("compile-cache-decode"), specs)


@pytest.mark.slow
def test_decode_variants_compile_within_budget(compiled_decode):
    specs, headers = compiled_decode
    assert set(headers) == {s.name for s in specs}
    families = {s.family for s in specs}
    assert families == {"flash_decode", "flash_decode_combine", "flash_decode_append", "rotary"}
    problems = []
    for s in specs:
        p = headers[s.name]["ptxas"]
        assert {"registers", "stack_frame"} <= set(p), (s.name, p)
        if not 0 < p["registers"] <= 255:
            problems.append(f"{s.name}: {p['registers']} registers")
        budget = DECODE_MAX_STACK_BYTES_SCALAR if s.family == "flash_decode" and not s.aligned else DECODE_MAX_STACK_BYTES
        if p["stack_frame"] > budget:
            problems.append(f"{s.name}: {p['stack_frame']} bytes of local memory > {budget}")
        assert headers[s.name]["smem_bytes"] <= 227 * 1024, s.name
        if s.min_blocks > 1:  # the CTAs per SM the launch bounds ask for fit the SM's registers and smem
            assert s.min_blocks * s.threads * p["registers"] <= 65536, s.name
            assert s.min_blocks * (s.smem_bytes + 1024) <= plan.smem_per_sm_bytes(s.arch), s.name
    assert not problems, "\n".join(problems)


def _without_arch(spec) -> tuple:
    """A spec's fields but its arch: two archs that plan the same tile for a variant compare equal."""
    fields = dataclasses.asdict(spec)
    fields.pop("arch", None)
    return type(spec).__name__, repr(sorted(fields.items()))


@pytest.mark.slow
def test_smaller_shared_memory_archs_compile_within_budget(tmp_path):
    """GPUs with 100 KB of shared memory per SM (sm_86, sm_89, sm_120: RTX 30xx / 40xx / 50xx, A10, L4, L40) run
    the mma.sync kernels with tiles of their own where sm_80's do not fit (plan.fwd_tile, bwd_tile's
    BWD_FALLBACK_TILES, the decode tiles), untuned for want of such a GPU. Every variant whose tile differs from
    sm_80's (sm_86's; sm_89 plans the same tiles, and sm_120 the same plus its own): it compiles within the
    budgets sm_80's variants are held to, and its shared memory fits the arch. (Session 33, NVRTC 12.9: all 802
    sm_86 / sm_89 / sm_120 variants within budget.)"""
    sm80 = {_without_arch(s) for s in plan.all_fwd_specs("sm_80") + plan.all_bwd_specs("sm_80") + plan.all_decode_specs("sm_80")}
    specs = []
    for arch in ("sm_86", "sm_120"):
        specs += [s for s in plan.all_fwd_specs(arch) + plan.all_bwd_specs(arch) + plan.all_decode_specs(arch)
                  if _without_arch(s) not in sm80 and (arch == "sm_86" or _without_arch(dataclasses.replace(s, arch="sm_86"))
                                                       not in {_without_arch(x) for x in specs})]  # fmt: skip
    assert {s.arch for s in specs} >= {"sm_86"} and {s.family for s in specs} >= {"flash_fwd", "flash_bwd", "flash_decode"}
    problems = []
    for specs_, headers in _compile_into(tmp_path, specs):
        for s in specs_:
            p = headers[s.name]["ptxas"]
            if not 0 < p["registers"] <= 255:
                problems.append(f"{s.name}: {p['registers']} registers")
            if s.family == "flash_decode":
                budget = DECODE_MAX_STACK_BYTES_SCALAR if not s.aligned else DECODE_MAX_STACK_BYTES
            elif s.family.startswith(("flash_fwd", "flash_bwd")):
                budget = _budget(s)
            else:
                budget = 0
            if p["stack_frame"] > budget:
                problems.append(f"{s.name}: {p['stack_frame']} bytes of local memory > {budget}")
            if headers[s.name]["smem_bytes"] > plan.max_smem_bytes(s.arch):
                problems.append(f"{s.name}: {headers[s.name]['smem_bytes']} bytes of shared memory > {plan.max_smem_bytes(s.arch)}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# The attention variants (window, softcap, ALiBi, dropout): a selection of every kernel family
# ---------------------------------------------------------------------------------------------

#: Local memory allowed in a variant kernel (the plain variant's budget plus this): the variants add
#: per-element work (tanh, the ALiBi distance, Philox) to kernels that already run at the 255-register
#: ceiling, so a few more values are parked. (The TMA forward's 192-row hd64 tile, 160 registers per
#: consumer thread, parks 56-72 bytes with window, softcap and ALiBi at once (NVRTC 12.9); with dropout,
#: which parked 128-144 there, the planner takes a 128-row tile: plan.FWD_SM90_WS_DROPOUT_TILES.)
VARIANT_EXTRA_STACK_BYTES = 224
#: ... except the TMA forward with a window, ALiBi or both (the ring's calls run them) at head dims 64 and 128,
#: which keeps everything in registers as the plain kernel does: the diagonal shift once made its window
#: kernels park 56-116 bytes, and the window forward ran 1-3% faster without them (session 26). Not yet the
#: persistent short-key tile of head dim 128 with a window (non-causal builds, the ones a window launches:
#: 96-104 bytes, about as many as before the shift).
NO_SPILL_VARIANTS = (plan.MOD_WINDOW, plan.MOD_ALIBI, plan.MOD_WINDOW | plan.MOD_ALIBI)


def _no_spill(spec) -> bool:
    return (spec.family == "flash_fwd_sm90_ws" and spec.mods in NO_SPILL_VARIANTS and spec.head_dim in (64, 128)
            and not (spec.tile.persistent and spec.mods & plan.MOD_WINDOW and not spec.causal))  # fmt: skip

_SINGLE = (plan.MOD_WINDOW, plan.MOD_SOFTCAP, plan.MOD_ALIBI, plan.MOD_DROPOUT)


def _variant_selection():
    """Every variant alone at head dim 128 and all of them together at 64, 128 and 256, on every kernel
    family (bf16, causal, 16-byte loads; and the element-wise path once), for sm_80 and sm_90a; on sm_90a
    also each variant alone, and all of them non-causal, on head dim 64's TMA forward tile."""
    specs = []
    for arch in ARCHS:
        for hd, mods in [(128, m) for m in _SINGLE] + [(hd, plan.ALL_MODS) for hd in (64, 128, 256)]:
            specs += plan.all_fwd_specs(arch, head_dims=(hd,), dtypes=("bf16",), causals=(True,), aligned=(True,),
                                        mods=(mods,))  # fmt: skip
            specs += [s for s in plan.all_bwd_specs(arch, head_dims=(hd,), dtypes=("bf16",), causals=(True,),
                                                    aligned=(True,), mods=(mods,))
                      if s.family in ("flash_bwd", "flash_bwd_sm90", "flash_bwd_sm90_ws")]  # fmt: skip
            if mods != plan.MOD_DROPOUT:
                specs.append(plan.decode_spec(hd, "bf16", True, 1, arch, mods=mods & ~plan.MOD_DROPOUT))
        specs.append(plan.fwd_spec(96, "fp16", False, False, arch, mods=plan.ALL_MODS))
        specs.append(plan.bwd_spec(96, "fp16", False, False, arch, mods=plan.ALL_MODS))
        # Packed varlen batches at 128, alone and with every variant, and their preprocess / convert kernels
        # (the varlen bit changes the same few lines in every tile shape; the GPU tests run the others).
        if arch == "sm_90a":  # head dim 256's 80-key TMA tile, which dropout (in ALL_MODS) never runs on
            no_dropout = plan.ALL_MODS & ~plan.MOD_DROPOUT
            specs += [plan.fwd_sm90_ws_spec(256, "bf16", True, mods=m) for m in (no_dropout, no_dropout | plan.MOD_VARLEN)]
            # head dim 64's 192-row TMA tile, the one that parks the most: each variant alone (dropout: on its
            # own tile), all of them non-causal, and all but dropout non-causal on the 192 rows (its most: 72 bytes)
            specs += [plan.fwd_sm90_ws_spec(64, "bf16", True, mods=m) for m in _SINGLE]
            specs += [plan.fwd_sm90_ws_spec(64, "bf16", False, mods=m) for m in (plan.ALL_MODS, no_dropout)]
            # the window and ALiBi kernels the library launches: a window always runs a non-causal build
            # (variants.resolve folds causal into the window), ALiBi both
            for hd, mods in [(hd, m) for hd in (64, 128) for m in NO_SPILL_VARIANTS]:
                built = plan.all_fwd_specs(arch, head_dims=(hd,), dtypes=("bf16",), causals=(False,), aligned=(True,),
                                           mods=(mods,))  # fmt: skip
                specs += [s for s in built if s.family == "flash_fwd_sm90_ws"]
        for hd, mods in [(128, plan.MOD_VARLEN), (128, plan.MOD_VARLEN | plan.ALL_MODS)]:
            specs += plan.all_fwd_specs(arch, head_dims=(hd,), dtypes=("bf16",), causals=(True,), aligned=(True,),
                                        mods=(mods,))  # fmt: skip
            specs += plan.all_bwd_specs(arch, head_dims=(hd,), dtypes=("bf16",), causals=(True,), aligned=(True, False),
                                        mods=(mods,))  # fmt: skip
    return list(dict.fromkeys(specs))


@pytest.fixture(scope="module")
def compiled_variants(tmp_path_factory):
    yield from _compile_into(tmp_path_factory.mktemp("compile-cache-variants"), _variant_selection())


@pytest.mark.slow
def test_variant_kernels_compile_within_budget(compiled_variants):
    specs, headers = compiled_variants
    assert {s.family for s in specs} == {"flash_fwd", "flash_fwd_sm90", "flash_fwd_sm90_ws", "flash_bwd",
                                         "flash_bwd_sm90", "flash_bwd_sm90_ws", "flash_decode", "flash_bwd_pre",
                                         "flash_bwd_convert"}  # fmt: skip
    assert all(s.varlen if s.family in ("flash_bwd_pre", "flash_bwd_convert") else s.mods for s in specs)
    assert set(headers) == {s.name for s in specs}
    problems = []
    for s in specs:
        p = headers[s.name]["ptxas"]
        plain = DECODE_MAX_STACK_BYTES if s.family == "flash_decode" else _budget(s)
        if not 0 < p["registers"] <= 255:
            problems.append(f"{s.name}: {p['registers']} registers")
        budget = 0 if _no_spill(s) else plain + VARIANT_EXTRA_STACK_BYTES
        if p["stack_frame"] > budget:
            problems.append(f"{s.name}: {p['stack_frame']} bytes of local memory > {budget}")
        notes = {k: v for k, v in p.items() if k.startswith("wgmma_")}
        if notes:
            problems.append(f"{s.name}: ptxas took the asynchrony out of its wgmma: {notes}")
    assert not problems, "\n".join(problems)
