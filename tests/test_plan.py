"""CPU tests of cuflash/plan (common, forward): head-dim buckets, arch names, tiles, kernel specs, the
kernel registry, launch plans.

Pure Python: no CuPy, no NVRTC, no GPU.
"""
from __future__ import annotations

import dataclasses
import keyword
import math
import re

import pytest
from hypothesis import example, given, settings, strategies as st

from cuflash import jit, params, plan
from nvrtc_util import compile_static_asserts

#: Opt-in dynamic shared memory per block (CUDA programming guide, compute capabilities table).
MAX_SMEM_PER_BLOCK = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90a": 227 * 1024}
SMEM_PER_SM_SM90 = 228 * 1024
RESERVED_SMEM_PER_CTA = 1024  # the driver keeps 1 KB per resident CTA (sm_80 and newer)


# ---------------------------------------------------------------------------------------------
# Head-dim buckets
# ---------------------------------------------------------------------------------------------


def test_buckets_are_the_multiples_of_32_up_to_256():
    assert plan.HEAD_DIM_BUCKETS == tuple(range(32, 257, 32))


@pytest.mark.parametrize("d", range(1, 257))
def test_head_dim_bucket(d):
    b = plan.head_dim_bucket(d)
    assert b in plan.HEAD_DIM_BUCKETS
    assert b >= d
    assert b - d < 32  # the smallest bucket that holds d
    assert b == 32 * math.ceil(d / 32)


@pytest.mark.parametrize("d", [0, -1, -64, 257, 288, 512])
def test_head_dim_bucket_rejects(d):
    with pytest.raises(ValueError, match="head dim"):
        plan.head_dim_bucket(d)


# ---------------------------------------------------------------------------------------------
# Arch names
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given_, want",
    [
        ("90a", "sm_90a"),
        ("sm_90a", "sm_90a"),
        ("sm90a", "sm_90a"),
        ("SM_90A", "sm_90a"),
        ("compute_90a", "sm_90a"),
        ("9.0a", "sm_90a"),
        ("8.0", "sm_80"),
        ("compute_80", "sm_80"),
        ("sm80", "sm_80"),
        ("80", "sm_80"),
        (" sm_86 ", "sm_86"),
        ("8.9", "sm_89"),
        ("sm_87", "sm_87"),
        # sm_90 is not a target of its own: a Hopper GPU loads sm_90a cubins
        ("sm_90", "sm_90a"),
        ("90", "sm_90a"),
        ("9.0", "sm_90a"),
        ("compute_90", "sm_90a"),
        ("SM90", "sm_90a"),
        ("sm_100", "sm_100"),
        ("10.0", "sm_100"),
        ("sm_103", "sm_103"),
        ("120", "sm_120"),
        ("12.0", "sm_120"),
        ("sm_090", "sm_90a"),  # leading zeros: the same target
        ("sm_090a", "sm_90a"),
        ("08.0", "sm_80"),
        ("sm_101", "sm_101"),  # shipped archs without a limits row: arch_for_capability returns them too
        ("11.0", "sm_110"),
        ("sm_121", "sm_121"),
    ],
)
def test_parse_arch(given_, want):
    assert plan.parse_arch(given_) == want
    assert plan.parse_arch(want) == want  # idempotent


#: The targets cuflash compiles for, as the error message lists them.
KNOWN_ARCHS = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90a", "sm_100", "sm_101", "sm_103", "sm_110", "sm_120", "sm_121")


@pytest.mark.parametrize("bad", ["sm_70", "7.5", "sm_75", "compute_61", "foo", "", "sm_", "sm_8", "a", "sm_90b", "sm_8.0",
                                 "sm_99", "9.9", "sm_100a", "sm_120a", "sm_80a", "sm_102", "sm_111", "sm_1000"])  # fmt: skip
def test_parse_arch_rejects(bad):
    """Only the known targets: an arch NVRTC may compile but no cuflash process would load (sm_99,
    sm_100a) is refused before NVRTC runs, with the list of the targets."""
    with pytest.raises(ValueError, match=f"unsupported arch {bad!r}: cuflash compiles for ") as info:
        plan.parse_arch(bad)
    assert str(info.value).endswith(", ".join(KNOWN_ARCHS) + " (sm_90 means sm_90a)")


def test_every_known_arch_parses_and_has_its_limits():
    for arch in KNOWN_ARCHS:
        assert plan.parse_arch(arch) == arch
        assert plan.max_smem_bytes(arch) <= plan.smem_per_sm_bytes(arch)
    assert {plan.arch_for_capability(cc // 10, cc % 10) for cc in plan.KNOWN_ARCHS} == set(KNOWN_ARCHS)
    assert set(plan.MAX_SMEM_KB) <= set(plan.KNOWN_ARCHS)
    # an arch without a limits row gets the smallest known (a consumer GPU's) limits
    assert plan.max_smem_bytes("sm_121") == 99 * 1024 and plan.smem_per_sm_bytes("sm_110") == 100 * 1024


@pytest.mark.parametrize(
    "cc, want", [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 7), "sm_87"), ((8, 9), "sm_89"), ((9, 0), "sm_90a"), ((10, 0), "sm_100"), ((12, 0), "sm_120")]
)
def test_arch_for_capability(cc, want):
    arch = plan.arch_for_capability(*cc)
    assert arch == want
    assert plan.parse_arch(arch) == arch  # what a device gets is also what --arch accepts


@pytest.mark.parametrize("cc", [(7, 5), (7, 0), (6, 1), (5, 2)])
def test_arch_for_capability_rejects_old_gpus(cc):
    with pytest.raises(RuntimeError, match=r"8\.0 or newer"):
        plan.arch_for_capability(*cc)


# ---------------------------------------------------------------------------------------------
# Tiles
# ---------------------------------------------------------------------------------------------


def test_every_bucket_has_a_tile():
    assert set(plan.FWD_TILES) == set(plan.HEAD_DIM_BUCKETS)


@pytest.mark.parametrize("bucket", plan.HEAD_DIM_BUCKETS)
def test_tiles_satisfy_the_kernel_static_asserts(bucket):
    """The static_asserts of FwdConfig in cuda_src/flash_fwd.cuh, checked before any compile."""
    t = plan.FWD_TILES[bucket]
    assert bucket % 32 == 0 and bucket <= 256
    assert t.block_m % (16 * t.warps) == 0  # every warp owns whole 16-row MMA slabs
    assert t.block_n % 16 == 0  # K/V tiles are whole MMA k-steps
    assert ((bucket + 8) // 8) % 2 == 1  # odd 16-byte smem row stride (ldmatrix conflict free)
    assert t.stages in (1, 2)  # single or double buffered K/V tiles
    assert 1 <= t.warps <= 32 and t.min_blocks >= 1


def test_tile_defaults_to_double_buffering():
    t = plan.Tile(128, 64, 4, False, 2)
    assert t.stages == 2
    single = dataclasses.replace(t, stages=1)
    assert single != t and len({single, t}) == 2  # stages is part of a tile's identity


def test_static_asserts_in_the_source_are_the_ones_checked_here():
    """If the kernel gains or changes an invariant, the test above must be revisited: FwdConfig's in
    flash_fwd.cuh, and WarpTile's (the per-warp tile it runs) in warp_tile.cuh."""
    def conditions(header):
        return re.findall(r"static_assert\((.*?),\s*\"", (jit.source_dir() / header).read_text())

    assert conditions("flash_fwd.cuh") == [
        "kHeadDim % 32 == 0 && kHeadDim <= 256",
        "kBlockM % (16 * kNWarps) == 0",
        "kBlockN % 16 == 0",
        "(kSmemStride / 8) % 2 == 1",
        "kStages == 1 || kStages == 2",
    ]
    assert "warp_tile.cuh" in jit.included_headers(jit.entry_source(plan.fwd_spec(64, "bf16", False, True, "sm_80")))
    assert conditions("warp_tile.cuh") == [
        "!kSwizzled || (kKVStride % 64 == 0)",  # FwdConfig keeps padded K/V rows (kKVSwizzled false)
        "kWriteOut",  # WarpTile::store: only 16-byte-aligned variants stage O for the caller to write
    ]


@pytest.mark.parametrize("bucket", plan.HEAD_DIM_BUCKETS)
def test_tile_shared_memory(bucket):
    t = plan.FWD_TILES[bucket]
    smem = plan.fwd_smem_bytes(bucket, t)
    stride = bucket + 8  # elements per padded smem row, 2 bytes each
    assert smem == 2 * stride * (t.block_m + 2 * t.stages * t.block_n)  # Q + `stages` buffers of K and V
    assert smem <= MAX_SMEM_PER_BLOCK["sm_90a"]
    # __launch_bounds__(threads, min_blocks) promises min_blocks CTAs per SM: their smem must fit.
    assert t.min_blocks * (smem + RESERVED_SMEM_PER_CTA) <= SMEM_PER_SM_SM90
    if t.min_blocks == 2:
        assert 2 * smem <= 228 * 1024
    # registers: the table's budgets assume up to 255 per thread; min_blocks resident CTAs of the
    # 64K-register file must not force ptxas below that (it would spill instead)
    assert 65536 // (t.min_blocks * t.warps * 32) >= 255


def test_smem_grows_with_stages():
    for bucket, t in plan.FWD_TILES.items():
        one = plan.fwd_smem_bytes(bucket, dataclasses.replace(t, stages=1))
        two = plan.fwd_smem_bytes(bucket, dataclasses.replace(t, stages=2))
        assert two - one == 2 * 2 * t.block_n * (bucket + 8)  # one more K and one more V buffer
        assert plan.fwd_smem_bytes(bucket, t) == (one if t.stages == 1 else two)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86"])
def test_tiles_fit_the_smem_of_every_supported_arch(arch):
    too_big = []
    for bucket in plan.HEAD_DIM_BUCKETS:
        launch = plan.plan_forward(batch=1, seqlen_q=1, seqlen_k=1, nheads=1, nheads_kv=1, head_dim=bucket,
                                   dtype="bf16", causal=False, aligned=True, arch=arch)  # fmt: skip
        if launch.smem_bytes > MAX_SMEM_PER_BLOCK[arch]:
            too_big.append(f"hd{bucket}: {launch.smem_bytes} B")
    assert not too_big, f"over {MAX_SMEM_PER_BLOCK[arch]} B per block on {arch}: {', '.join(too_big)}"


def test_fwd_tile_keeps_the_tuned_row_on_hopper_and_shrinks_only_where_needed():
    ctas = plan.ctas_per_sm_by_smem
    for bucket in plan.HEAD_DIM_BUCKETS:
        row = plan.FWD_TILES[bucket]
        assert plan.fwd_tile(bucket, "sm_90a") == row
        assert ctas(plan.fwd_smem_bytes(bucket, row), "sm_90a") >= row.min_blocks  # (the CTAs/SM it was tuned at)
        for arch in ("sm_80", "sm_86", "sm_87", "sm_89", "sm_120"):
            t = plan.fwd_tile(bucket, arch)
            assert plan.fwd_smem_bytes(bucket, t) <= plan.max_smem_bytes(arch)
            single = dataclasses.replace(row, stages=1)
            if ctas(plan.fwd_smem_bytes(bucket, row), arch) < row.min_blocks <= ctas(plan.fwd_smem_bytes(bucket, single), arch):
                assert t == single, (bucket, arch)  # single buffered: the row's CTAs per SM kept
            elif plan.fwd_smem_bytes(bucket, row) <= plan.max_smem_bytes(arch):
                assert t == row, (bucket, arch)
    # the A100 (164 KB per SM): hd128's double-buffered 102 KiB CTA would run alone; single-buffered two fit
    assert plan.fwd_tile(128, "sm_80") == plan.Tile(128, 64, 4, False, 2, stages=1)
    assert ctas(plan.fwd_smem_bytes(128, plan.FWD_TILES[128]), "sm_80") == 1
    assert ctas(plan.fwd_smem_bytes(128, plan.fwd_tile(128, "sm_80")), "sm_80") == 2
    assert [b for b in plan.HEAD_DIM_BUCKETS if plan.fwd_tile(b, "sm_80") != plan.FWD_TILES[b]] == [128, 224]
    with pytest.raises(ValueError, match="shared memory"):
        plan.fwd_spec(256, "bf16", False, True, "sm_86", plan.Tile(128, 64, 8, False, 1, stages=2))


# ---------------------------------------------------------------------------------------------
# Kernel specs and names
# ---------------------------------------------------------------------------------------------

_NAME_RE = re.compile(
    r"^flash_fwd_hd(?P<hd>\d+)_(?P<dtype>fp16|bf16)_(?P<mask>causal|full)_bm(?P<bm>\d+)_bn(?P<bn>\d+)"
    r"_w(?P<w>\d+)_mb(?P<mb>\d+)_st(?P<st>\d+)_(?P<q>qreg|qsmem)_(?P<load>vec16|scalar)_(?P<arch>sm\d+a?)$"
)


def _specs_two_archs():
    """The mma.sync kernel's variants for sm_80 and sm_90a."""
    return [s for s in plan.all_fwd_specs("sm_80") + plan.all_fwd_specs("sm_90a") if s.family == "flash_fwd"]


def test_all_fwd_specs_covers_every_combination():
    specs = plan.all_fwd_specs("sm_90a")
    mma = [s for s in specs if s.family == "flash_fwd"]
    combos = {(s.head_dim, s.dtype, s.causal, s.aligned) for s in mma}
    assert len(mma) == len(combos) == len(plan.HEAD_DIM_BUCKETS) * 2 * 2 * 2
    assert all(s.tile == plan.FWD_TILES[s.head_dim] and s.arch == "sm_90a" for s in mma)
    # plus the Hopper kernel for every aligned combination of its buckets, and nothing else
    hopper = [s for s in specs if s.family == "flash_fwd_sm90"]
    assert {(s.head_dim, s.dtype, s.causal) for s in hopper} == {
        (d, dt, c) for d in plan.FWD_SM90_TILES for dt in plan.DTYPES for c in (False, True)
    }
    ws = [s for s in specs if s.family == "flash_fwd_sm90_ws"]  # and the warp-specialized TMA kernel
    assert {(s.head_dim, s.dtype, s.causal) for s in ws} == {
        (d, dt, c) for d in plan.FWD_SM90_WS_TILES for dt in plan.DTYPES for c in (False, True)
    }
    # each with its default tile, the short-key persistent tile where its bucket has one, and the default
    # tile in clusters of 2 where the bucket takes them for long keys
    for d, default in plan.FWD_SM90_WS_TILES.items():
        tiles = {s.tile for s in ws if s.head_dim == d}
        clustered = {dataclasses.replace(default, cluster=2)} if d in plan.CLUSTER_KEYS else set()
        assert tiles == {default, plan.FWD_SM90_WS_SHORT_TILES.get(d, default)} | clustered
    assert len(hopper) == len(plan.FWD_SM90_TILES) * 4 and len(specs) == len(mma) + len(hopper) + len(ws)
    assert all(s.family == "flash_fwd" for s in plan.all_fwd_specs("sm_80") + plan.all_fwd_specs("sm_86"))
    # head dims map to buckets, duplicates dropped, order kept
    few = plan.all_fwd_specs("sm_80", head_dims=(33, 64, 60, 100), dtypes=("bf16",), causals=(True,))
    assert [(s.head_dim, s.aligned) for s in few] == [(64, True), (64, False), (128, True), (128, False)]


def test_names_spell_every_template_argument():
    specs = _specs_two_archs()
    for s in specs:
        m = _NAME_RE.match(s.name)
        assert m, s.name
        t = s.tile
        assert int(m["hd"]) == s.head_dim and m["dtype"] == s.dtype
        assert (m["mask"] == "causal") == s.causal and (m["load"] == "vec16") == s.aligned
        assert (int(m["bm"]), int(m["bn"]), int(m["w"])) == (t.block_m, t.block_n, t.warps)
        assert (int(m["mb"]), int(m["st"])) == (t.min_blocks, t.stages)
        assert (m["q"] == "qreg") == t.q_in_regs
        assert m["arch"] == s.arch.replace("_", "")
        assert s.name.isidentifier() and not keyword.iskeyword(s.name)  # also the kernel's C symbol
    assert len({s.name for s in specs}) == len(specs) == 2 * 64


#: Another value for each Tile field (a new field fails the test below until it gets one here).
_OTHER_TILE_VALUE = {
    "block_m": lambda t: t.block_m // 2,
    "block_n": lambda t: t.block_n // 2,
    "warps": lambda t: t.warps * 2,
    "q_in_regs": lambda t: not t.q_in_regs,
    "min_blocks": lambda t: 3 - t.min_blocks,
    "stages": lambda t: 3 - t.stages,
}


def test_names_differ_for_every_template_argument():
    base = plan.fwd_spec(64, "fp16", False, True, "sm_80")
    t = base.tile
    assert {f.name for f in dataclasses.fields(plan.Tile)} == set(_OTHER_TILE_VALUE)
    variants = [
        plan.fwd_spec(128, "fp16", False, True, "sm_80"),
        plan.fwd_spec(64, "bf16", False, True, "sm_80"),
        plan.fwd_spec(64, "fp16", True, True, "sm_80"),
        plan.fwd_spec(64, "fp16", False, False, "sm_80"),
        plan.fwd_spec(64, "fp16", False, True, "sm_86"),
    ]
    for field, other in _OTHER_TILE_VALUE.items():
        changed = dataclasses.replace(t, **{field: other(t)})
        assert changed != t, field
        variants.append(plan.with_tile(base, changed))
    names = [base.name] + [v.name for v in variants]
    assert len(set(names)) == len(names)


def test_template_args_follow_the_fwdconfig_parameter_order():
    """template_args() must list values in the order FwdConfig declares its parameters."""
    src = (jit.source_dir() / "flash_fwd.cuh").read_text()
    decl = re.search(r"template\s*<([^>]*)>\s*struct\s+FwdConfig\b", src)
    assert decl, "FwdConfig declaration not found"
    params = [p.split("=")[0].split()[-1] for p in decl.group(1).split(",")]
    spec = plan.fwd_spec(96, "bf16", True, False, "sm_90a", plan.Tile(64, 32, 2, True, 1, stages=1), mods=5)
    value = {
        "kHeadDim_": "96", "kBlockM_": "64", "kBlockN_": "32", "kNWarps_": "2", "kIsBF16_": "true",
        "kIsCausal_": "true", "kAligned_": "false", "kQInRegs_": "true", "kStages_": "1", "kMods_": "5",
    }  # fmt: skip
    assert set(params) == set(value)
    assert spec.template_args() == ", ".join(value[p] for p in params)
    fp16 = plan.fwd_spec(96, "fp16", False, False, "sm_90a", plan.Tile(64, 32, 2, False, 1))
    # stages defaults to 2; no variants: kMods takes its default 0 (the source of a plain variant is unchanged)
    assert fp16.template_args() == "96, 64, 32, 2, false, false, false, false, 2"


@pytest.mark.parametrize("d", [d for d in range(1, 257) if d % 8])
def test_fwd_spec_rejects_aligned_loads_for_odd_head_dims(d):
    with pytest.raises(ValueError, match="head_dim % 8"):
        plan.fwd_spec(d, "bf16", False, True, "sm_80")
    assert plan.fwd_spec(d, "bf16", False, False, "sm_80").head_dim == plan.head_dim_bucket(d)


def test_fwd_spec_accepts_aligned_for_multiples_of_8():
    for d in range(8, 257, 8):
        s = plan.fwd_spec(d, "fp16", True, True, "sm_90a")
        assert s.aligned and s.head_dim == plan.head_dim_bucket(d) and s.causal


@pytest.mark.parametrize("dtype", ["fp32", "float16", "bfloat16", ""])
def test_fwd_spec_rejects_other_dtypes(dtype):
    with pytest.raises(ValueError, match="dtype"):
        plan.fwd_spec(64, dtype, False, True, "sm_80")


def test_specs_are_hashable_and_compare_by_value():
    a = plan.fwd_spec(64, "fp16", False, True, "sm_80")
    b = plan.fwd_spec(60 + 4, "fp16", 0, 1, "sm_80")  # flags are normalized to bool
    assert a == b and hash(a) == hash(b) and a.name == b.name
    assert plan.with_tile(a, a.tile) == a


# ---------------------------------------------------------------------------------------------
# Kernel registry: family -> header, entry kernel, parameter struct (what the JIT needs of a spec)
# ---------------------------------------------------------------------------------------------


def _every_spec():
    return [s for arch in ("sm_80", "sm_90a") for family in plan.ALL_SPECS.values() for s in family(arch)]


def test_every_spec_names_a_registered_family():
    specs = _every_spec()
    assert {s.family for s in specs} == set(plan.KERNEL_FAMILIES)  # every family is built, none is unknown
    for name, fam in plan.KERNEL_FAMILIES.items():
        assert isinstance(fam, plan.KernelFamily)
        assert (jit.source_dir() / fam.header).is_file(), (name, fam.header)
        assert "{args}" in fam.kernel
        if fam.grid_constant:  # the TMA kernels: tensor maps, then Fwd/BwdParams, in the family's own header
            base = {"FwdTmaParams": "FwdParams", "BwdTmaParams": "BwdParams"}[fam.params]
            text = (jit.source_dir() / fam.header).read_text()
            assert f"struct {fam.params} {{" in text and f"{base} p;" in text
            continue
        assert fam.params in ("FwdParams", "BwdParams", "DecodeParams", "RotaryParams")
        assert f"struct {fam.params}" in (jit.source_dir() / "params.h").read_text()


@pytest.mark.parametrize("family", sorted(plan.KERNEL_FAMILIES))
def test_entry_source_of_every_family(family):
    """jit.entry_source is the registry's template filled in: the family's header, the variant's extern
    "C" kernel under its launch bounds, taking the family's parameter struct, calling its entry kernel."""
    spec = next(s for s in _every_spec() if s.family == family)
    fam = spec.kernel_family
    assert fam is plan.KERNEL_FAMILIES[family]
    assert spec.entry_kernel() == fam.kernel.format(args=spec.template_args())
    text = jit.entry_source(spec)
    qual = "__grid_constant__ " if fam.grid_constant else ""  # (TMA reads the maps from parameter space)
    assert fam.grid_constant == (family in ("flash_fwd_sm90_ws", "flash_bwd_sm90_ws"))
    cluster = getattr(spec, "cluster", 1)
    dims = f" __cluster_dims__({cluster}, 1, 1)" if cluster > 1 else ""
    assert text == jit.ENTRY_TEMPLATE.format(header=fam.header, threads=spec.threads, min_blocks=spec.min_blocks,
                                             cluster=dims, name=spec.name, grid_constant=qual, params=fam.params,
                                             kernel=spec.entry_kernel())  # fmt: skip
    assert text.splitlines()[0] == f'#include "{fam.header}"'
    assert f"__launch_bounds__({spec.threads}, {spec.min_blocks}){dims}\n" in text
    assert f"{spec.name}({qual}const cuflash::{fam.params} params)" in text
    assert f"cuflash::{spec.entry_kernel()}(params);" in text


def test_launch_smem_limit():
    """The most dynamic shared memory a launch of a variant may ask for (the limit its loaded function
    gets): its own size, except the split-KV decode kernel, whose launches may be padded to space its
    CTAs out (plan.decode_launch_smem), up to the GPU's per-CTA maximum."""
    for s in _every_spec():
        if s.family == "flash_decode":
            assert s.launch_smem_limit == plan.max_smem_bytes(s.arch) >= s.smem_bytes, s.name
        else:
            assert s.launch_smem_limit == s.smem_bytes, s.name


# ---------------------------------------------------------------------------------------------
# plan_forward
# ---------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=300)
@given(
    batch=st.integers(1, 64),
    seqlen_q=st.integers(1, 20000),
    seqlen_k=st.integers(1, 20000),
    nheads_kv=st.integers(1, 16),
    group=st.integers(1, 8),
    head_dim=st.integers(1, 256),
    dtype=st.sampled_from(plan.DTYPES),
    causal=st.booleans(),
    aligned=st.booleans(),
    arch=st.sampled_from(["sm_80", "sm_86", "sm_90a"]),
)
# (long keys: the default tile, without clusters since session 17)
@example(batch=2, seqlen_q=1000, seqlen_k=10000, nheads_kv=2, group=1, head_dim=128, dtype="bf16", causal=False,
         aligned=True, arch="sm_90a")  # fmt: skip
@example(batch=1, seqlen_q=300, seqlen_k=8192, nheads_kv=1, group=4, head_dim=256, dtype="fp16", causal=True,
         aligned=True, arch="sm_90a")  # fmt: skip
# (hd64's short keys reach 2048 causal since session 31; found by CI's draws on 2026-12-05)
@example(batch=1, seqlen_q=1, seqlen_k=1025, nheads_kv=1, group=1, head_dim=64, dtype="bf16", causal=True,
         aligned=True, arch="sm_90a")  # fmt: skip
@example(batch=1, seqlen_q=1, seqlen_k=2049, nheads_kv=1, group=1, head_dim=64, dtype="bf16", causal=True,
         aligned=True, arch="sm_90a")  # fmt: skip
def test_plan_forward(batch, seqlen_q, seqlen_k, nheads_kv, group, head_dim, dtype, causal, aligned, arch):
    aligned = aligned and head_dim % 8 == 0
    nheads = nheads_kv * group
    launch = plan.plan_forward(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads,
                               nheads_kv=nheads_kv, head_dim=head_dim, dtype=dtype, causal=causal,
                               aligned=aligned, arch=arch, sm_count=132)  # fmt: skip
    spec = launch.spec
    bucket = plan.head_dim_bucket(head_dim)
    if arch == "sm_90a" and aligned and bucket in plan.FWD_SM90_WS_TILES:  # the warp-specialized Hopper kernel
        t = plan.sm90_ws_tile(bucket, seqlen_k, causal)
        short = seqlen_k <= {64: (1024, 2048), 128: (2048, 4096), 256: (512, 512)}.get(bucket, (0, 0))[causal]
        default = plan.FWD_SM90_WS_TILES[bucket]  # (no clusters since session 17: CLUSTER_KEYS is empty)
        assert t == (plan.FWD_SM90_WS_SHORT_TILES.get(bucket, default) if short else default)
        # the hint varlen caches by: the same tile but for clusters, which packed batches never take
        assert plan.sm90_ws_tile(bucket, plan.short_keys_hint(seqlen_k), causal) == dataclasses.replace(t, cluster=1)
        assert plan.short_keys_hint(seqlen_k) <= min(seqlen_k, 4097)
        m_blocks = math.ceil(seqlen_q / t.block_m)
        if not plan.cluster_pays(m_blocks, t.cluster):
            t = dataclasses.replace(t, cluster=1)
        assert spec == plan.Sm90WsKernelSpec(bucket, dtype, causal, t)
        assert launch.smem_bytes == plan.fwd_sm90_ws_smem_bytes(bucket, t) == spec.smem_bytes <= 227 * 1024
        c = t.cluster  # (clusters: pairs of query tiles, whole clusters)
        items = math.ceil(m_blocks / c) * nheads * batch
        assert launch.grid == ((min(items, 132 // c) * c, 1, 1) if t.persistent else (math.ceil(m_blocks / c) * c, nheads, batch))
        assert launch.block == ((t.block_m // 64 + 1) * 128, 1, 1) == (spec.threads, 1, 1)
        return
    t = plan.fwd_tile(bucket, arch)
    assert spec == plan.KernelSpec("flash_fwd", bucket, dtype, causal, aligned, t, arch)
    row = plan.FWD_TILES[bucket]  # (or smaller: single buffered to keep its CTAs per SM, or to fit at all)
    assert t == row or t == dataclasses.replace(row, stages=1) or plan.fwd_smem_bytes(bucket, row) > plan.max_smem_bytes(arch)
    assert launch.grid == (math.ceil(seqlen_q / t.block_m), nheads, batch)
    assert (launch.grid[0] - 1) * t.block_m < seqlen_q <= launch.grid[0] * t.block_m  # every row, once
    assert launch.block == (t.warps * 32, 1, 1) == (spec.threads, 1, 1)
    assert launch.smem_bytes == plan.fwd_smem_bytes(bucket, t) == spec.smem_bytes
    assert launch.smem_bytes <= 227 * 1024


def test_plan_forward_with_a_tile():
    tile = plan.Tile(64, 32, 2, False, 1)
    launch = plan.plan_forward(batch=3, seqlen_q=65, seqlen_k=7, nheads=4, nheads_kv=2, head_dim=80, dtype="fp16",
                               causal=True, aligned=True, arch="sm_80", tile=tile)  # fmt: skip
    assert launch.spec.tile == tile and launch.spec.head_dim == 96
    assert launch.grid == (2, 4, 3) and launch.block == (64, 1, 1)
    assert launch.smem_bytes == 2 * (64 * 104 + 4 * 32 * 104)  # Q + 2 stages of K and V
    single = plan.plan_forward(batch=3, seqlen_q=65, seqlen_k=7, nheads=4, nheads_kv=2, head_dim=80, dtype="fp16",
                               causal=True, aligned=True, arch="sm_80", tile=dataclasses.replace(tile, stages=1))  # fmt: skip
    assert single.smem_bytes == 2 * (64 * 104 + 2 * 32 * 104)  # Q + 1 stage of K and V
    assert single.spec.name != launch.spec.name and single.grid == launch.grid


_OK = dict(batch=2, seqlen_q=10, seqlen_k=12, nheads=8, nheads_kv=2, head_dim=64, dtype="bf16", causal=False,
           aligned=True, arch="sm_90a")  # fmt: skip


def test_plan_forward_accepts_the_base_case():
    assert plan.plan_forward(**_OK).grid == (1, 8, 2)


@pytest.mark.parametrize("nheads, nheads_kv", [(6, 4), (3, 2), (1, 2), (7, 3)])
def test_plan_forward_rejects_head_ratios(nheads, nheads_kv):
    with pytest.raises(ValueError, match="multiple"):
        plan.plan_forward(**{**_OK, "nheads": nheads, "nheads_kv": nheads_kv})


@pytest.mark.parametrize("field", ["batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv"])
@pytest.mark.parametrize("value", [0, -1])
def test_plan_forward_rejects_empty_dims(field, value):
    with pytest.raises(ValueError, match="non-empty"):
        plan.plan_forward(**{**_OK, field: value})


@pytest.mark.parametrize("head_dim", [0, 257])
def test_plan_forward_rejects_head_dims(head_dim):
    with pytest.raises(ValueError, match="head dim"):
        plan.plan_forward(**{**_OK, "head_dim": head_dim})


def test_plan_forward_rejects_aligned_odd_head_dim():
    with pytest.raises(ValueError, match="head_dim % 8"):
        plan.plan_forward(**{**_OK, "head_dim": 60})
    assert plan.plan_forward(**{**_OK, "head_dim": 60, "aligned": False}).spec.head_dim == 64


# ---------------------------------------------------------------------------------------------
# Hopper (wgmma) forward
# ---------------------------------------------------------------------------------------------


def _fwd_plan(head_dim=128, arch="sm_90a", aligned=True, tile=None, seqlen_q=1000):
    return plan.plan_forward(batch=2, seqlen_q=seqlen_q, seqlen_k=1500, nheads=4, nheads_kv=2, head_dim=head_dim,
                             dtype="bf16", causal=True, aligned=aligned, arch=arch, tile=tile)  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 56, 128, 120, 256, 248])
def test_hopper_kernel_runs_where_it_can(head_dim):
    launch = _fwd_plan(head_dim)
    bucket = plan.head_dim_bucket(head_dim)
    t = plan.FWD_SM90_WS_TILES[bucket]
    assert launch.spec.family == "flash_fwd_sm90_ws" and launch.spec.tile == t
    assert launch.grid == (-(-1000 // t.block_m), 4, 2)
    assert launch.block == (128 * (t.block_m // 64 + 1), 1, 1)  # a producer warpgroup + one per 64 rows
    # Q, the K/V ring, 1 + 4 * stages mbarriers, 1024 bytes of alignment slack
    assert launch.smem_bytes == 1024 + 2 * (t.block_m + 2 * t.stages * t.block_n) * bucket + 8 * (2 + 4 * t.stages)
    # the cp.async wgmma kernel when its tile is given (the callers' fallback where TMA cannot describe an input)
    old = _fwd_plan(head_dim, tile=plan.FWD_SM90_TILES[bucket])
    assert old.spec.family == "flash_fwd_sm90" and old.block == (old.spec.tile.block_m * 2, 1, 1)
    assert old.smem_bytes == 1024 + 2 * (old.spec.tile.block_m + 4 * old.spec.tile.block_n) * bucket
    # the mma.sync kernel elsewhere: other archs, unaligned inputs, buckets without a Hopper tile
    assert _fwd_plan(head_dim, arch="sm_80").spec.family == "flash_fwd"
    assert _fwd_plan(head_dim, arch="sm_89").spec.family == "flash_fwd"
    assert _fwd_plan(head_dim, aligned=False).spec.family == "flash_fwd"


def test_tma_store_is_a_schedule_bit():
    """Sm90WsTile.tma_store is the kernel's kSchedTmaStore bit (8) and part of the variant's name; the
    persistent short-key tiles write O with 16-byte stores (their measured choice, plan/forward.py)."""
    W = plan.Sm90WsTile
    assert W(128, 128).sched & 8 and not W(128, 128, tma_store=False).sched & 8
    header = (jit.source_dir() / "flash_fwd_sm90_ws.cuh").read_text()
    assert "constexpr int kSchedTmaStore = 8;" in header
    names = {t: plan.fwd_sm90_ws_spec(128, "bf16", False, tile=t).name for t in (W(128, 128), W(128, 128, tma_store=False))}
    assert "_tmao" in names[W(128, 128)] and "_tmao" not in names[W(128, 128, tma_store=False)]
    assert all(not t.tma_store for t in plan.FWD_SM90_WS_SHORT_TILES.values() if t.persistent)
    assert all(t.tma_store for t in plan.FWD_SM90_WS_SHORT_TILES.values() if not t.persistent)
    assert all(t.tma_store for t in plan.FWD_SM90_WS_TILES.values())
    # packed batches store O with 16-byte stores whatever the tile says: one spec (no _tmao), bit 8 clear
    packed = plan.fwd_sm90_ws_spec(128, "bf16", True, tile=W(128, 128), mods=plan.MOD_VARLEN)
    assert not packed.tile.tma_store and not packed.tile.sched & 8 and "_tmao" not in packed.name
    assert packed == plan.fwd_sm90_ws_spec(128, "bf16", True, tile=W(128, 128, tma_store=False), mods=plan.MOD_VARLEN)


def test_persistent_tma_forward_walks_the_grid_with_one_cta_per_sm():
    """A persistent Sm90WsTile launches min(tiles, SMs) CTAs; m_blocks keeps the query-tile (varlen: slot)
    count the kernel decomposes its work items with."""
    import dataclasses

    tile = dataclasses.replace(plan.FWD_SM90_WS_SHORT_TILES[128], tma_store=True)  # (128 query rows)
    kw = dict(nheads=4, nheads_kv=2, head_dim=128, dtype="bf16", causal=True, aligned=True, arch="sm_90a", tile=tile)
    big = plan.plan_forward(batch=2, seqlen_q=1000, seqlen_k=900, sm_count=132, **kw)
    assert big.grid == (min(8 * 4 * 2, 132), 1, 1) and big.m_blocks == 8
    small = plan.plan_forward(batch=1, seqlen_q=100, seqlen_k=900, sm_count=132, **kw)
    assert small.grid == (4, 1, 1) and small.m_blocks == 1  # never more CTAs than tiles
    packed = plan.plan_forward(batch=5, seqlen_q=3000, seqlen_k=3000, sm_count=132, mods=plan.MOD_VARLEN, **kw)
    assert packed.m_blocks == plan.varlen_tiles(3000, 5, 128) and packed.grid == (min(packed.m_blocks * 4, 132), 1, 1)
    assert "_persistent" in big.spec.name and big.spec.template_args().endswith(f", {1 | 4 | 8 | 64}")  # (TMA store: 8; paired walk: 64)
    with pytest.raises(ValueError, match="sm_count"):
        plan.plan_forward(batch=2, seqlen_q=1000, seqlen_k=900, **kw)
    plain = plan.plan_forward(batch=2, seqlen_q=1000, seqlen_k=1500, **{**kw, "tile": None})
    assert plain.grid == (6, 4, 2) and plain.m_blocks == 6  # (no SM count: the default tile, 192 query rows)


def _persistent_walk(items: int, pairs: int, group: int, m_blocks: int):
    """The persistent forward's item -> (query tile, pair) map (cuda_src/flash_fwd_sm90_ws.cuh, tile_of)."""
    for item in range(items):
        first = item // (group * m_blocks) * group
        size = min(group, pairs - first)
        within = item % (group * m_blocks)
        yield within // size, first + within % size


@pytest.mark.parametrize("pairs,group,m_blocks", [(1, 1, 5), (48, 5, 3), (48, 48, 7), (7, 3, 1), (30, 1, 4), (64, 4, 128)])
def test_persistent_walk_visits_every_tile_once_group_by_group(pairs, group, m_blocks):
    """Every (query tile, pair) once; items of one group name only that group's pairs, with the query
    tile outermost (the last group may be smaller)."""
    walk = list(_persistent_walk(pairs * m_blocks, pairs, group, m_blocks))
    assert sorted(walk) == sorted((x, pr) for x in range(m_blocks) for pr in range(pairs))
    for start in range(0, len(walk), group * m_blocks):
        chunk = walk[start : start + group * m_blocks]
        first = start // m_blocks
        assert {pr for _, pr in chunk} == set(range(first, min(first + group, pairs)))
        assert [x for x, _ in chunk] == sorted(x for x, _ in chunk)  # query tile outermost


def _kernel_m_index(item: int, r: int, pairs: int, group: int, m_items: int, cluster: int) -> int:
    """flash_fwd_sm90_ws.cuh's m_index (persistent), transcribed: the query-tile index of rank r's tile."""
    size = min(group, pairs - item // (group * m_items) * group)
    return item % (group * m_items) // size * cluster + r


def _kernel_tile_of(item: int, r: int, pairs: int, group: int, m_items: int, cluster: int) -> tuple[int, int]:
    """flash_fwd_sm90_ws.cuh's tile_of (persistent), transcribed: (query-tile index, pair) of rank r."""
    group_items = group * m_items
    first = item // group_items * group
    size, within = min(group, pairs - first), item % group_items
    return within // size * cluster + r, first + within % size


@pytest.mark.parametrize("pairs,group,m_blocks", [(1, 1, 5), (48, 5, 3), (48, 48, 8), (7, 3, 1), (64, 4, 128)])
@pytest.mark.parametrize("cluster", [1, 2])
def test_cluster_walk_gives_each_tile_to_one_rank(pairs, group, m_blocks, cluster):
    """The persistent walk with clusters: the kernel's two formulas for a rank's query tile (m_index, which
    decides whether the tile exists, and tile_of, which builds it) agree; every (query tile, pair) is
    taken exactly once over the items and ranks, the ranks of one item holding adjacent tiles of one
    pair; an odd count adds one index past the last tile per pair (a CTA that only helps load)."""
    m_items = -(-m_blocks // cluster)
    walk = []
    for item in range(pairs * m_items):
        here = [_kernel_tile_of(item, r, pairs, group, m_items, cluster) for r in range(cluster)]
        assert [x for x, _ in here] == [_kernel_m_index(item, r, pairs, group, m_items, cluster) for r in range(cluster)]
        assert len({pr for _, pr in here}) == 1 and [x for x, _ in here] == list(range(here[0][0], here[0][0] + cluster))
        walk += here
    real = [(x, pr) for x, pr in walk if x < m_blocks]
    assert sorted(real) == sorted((x, pr) for x in range(m_blocks) for pr in range(pairs))
    assert len(walk) - len(real) == (-m_blocks % cluster) * pairs
    if cluster == 1:  # (the walk the cluster-less kernel always had)
        assert walk == list(_persistent_walk(pairs * m_blocks, pairs, group, m_blocks))


def _fast_div(f: tuple[int, int, int], n: int) -> int:
    """flash_fwd.cuh's fast_div on a FastDiv (d, mul, shift) of cuflash.params.fast_divisor."""
    d, mul, shift = f
    return n if d == 1 else (n * mul >> 32) >> shift


def _kernel_locate(item: int, m: int, pairs: int, group: int, step: int, paired: bool, cluster: int = 1
                   ) -> tuple[int, int]:  # fmt: skip
    """flash_fwd_sm90_ws.cuh's locate, transcribed with the divisors the host hands it (plan.fwd_walk through
    params.walk_fields): (query-tile index before causal's reversal, pair) of a walk item; ``step`` is the
    grid in clusters (item_step)."""
    f = params.walk_fields(plan.fwd_walk(m, cluster, step, group, pairs, 1, 1))
    light = False
    if paired:
        half = m // 2
        units = half * pairs
        whole = _fast_div(f["walk_step"], units) * step
        if item < 2 * whole:
            rnd = _fast_div(f["walk_step"], item)
            unit, light = (rnd >> 1) * step + item - rnd * step, rnd & 1
        else:
            e, left = item - 2 * whole, units - whole
            if e >= 2 * left:
                return half, e - 2 * left  # the middle tiles of an odd count
            unit, light = whole + (e if e < left else e - left), e >= left
        first = _fast_div(f["walk_units"], unit)
        within = unit - first * f["walk_units"][0]
    else:
        first = _fast_div(f["walk_items"], item)
        within = item - first * f["walk_items"][0]
    first *= group
    size = f["walk_tail"] if pairs - first < group else f["walk_group"]
    row = _fast_div(size, within)
    pair = first + within - row * size[0]
    return (m - 1 - row if light else row) if paired else row * cluster, pair


def _plain_locate(item: int, m: int, pairs: int, group: int, step: int, paired: bool, cluster: int = 1
                  ) -> tuple[int, int]:  # fmt: skip
    """The same walk with Python's integer division (what the kernel computed before its FastDiv fields)."""
    if not paired:
        group_items = group * -(-m // cluster)
        first = item // group_items * group
        size, within = min(group, pairs - first), item % group_items
        return within // size * cluster, first + within % size
    half = m // 2
    units = half * pairs
    whole = units // step * step
    if item < 2 * whole:
        unit, light = item // (2 * step) * step + item % step, item // step & 1
    else:
        e, left = item - 2 * whole, units - whole
        if e >= 2 * left:
            return half, e - 2 * left
        unit, light = whole + (e if e < left else e - left), int(e >= left)
    first = unit // (group * half) * group
    size, within = min(group, pairs - first), unit % (group * half)
    return (m - 1 - within // size if light else within // size), first + within % size


def test_fwd_walk_divisors_reproduce_the_walk():
    """The kernel's walk through FastDiv multipliers (FwdParams.walk_*, plan.fwd_walk) maps every item as
    integer division does, for both walks, clusters, partial last groups and strides above and below the
    group's items; and the divisors of a planned launch are the kernel's: its stride in clusters, the
    group's items and units, the last group's pairs, nheads and nheads / nheads_kv."""
    for m, pairs, group, step, cluster in ((1, 1, 1, 1, 1), (4, 1024, 200, 132, 1), (9, 7, 3, 5, 1), (16, 48, 5, 64, 1),
                                           (3, 300, 200, 132, 1), (8, 40, 6, 66, 2), (7, 13, 13, 6, 2),
                                           (33, 1000, 37, 131, 1)):  # fmt: skip
        items = -(-m // cluster) * pairs
        for paired in (False, True) if cluster == 1 else (False,):
            for i in range(items):
                assert _kernel_locate(i, m, pairs, group, step, paired, cluster) == \
                    _plain_locate(i, m, pairs, group, step, paired, cluster), (m, pairs, group, step, paired, i)  # fmt: skip
    kw = dict(seqlen_k=512, head_dim=64, dtype="bf16", aligned=True, arch="sm_90a", sm_count=132, l2_bytes=50 << 20)
    launch = plan.plan_forward(batch=30, seqlen_q=512, nheads=32, nheads_kv=8, causal=True, **kw)
    assert launch.spec.tile.persistent and launch.grid == (132, 1, 1) and launch.m_blocks == 4
    g = launch.sched_group
    assert 1 < g < 960 and launch.walk == (132, 4 * g, 2 * g, g, 960 - (959 // g) * g, 32, 4)
    per_tile = plan.plan_forward(batch=3, seqlen_q=20000, nheads=6, nheads_kv=2, causal=False, **{**kw, "seqlen_k": 20000})
    m = -(-20000 // per_tile.spec.tile.block_m)
    assert not per_tile.spec.tile.persistent and per_tile.walk == (1, m, m // 2, 1, 1, 6, 3)
    with pytest.raises(ValueError, match="walk"):
        params.walk_fields((1, 2))
    with pytest.raises(ValueError, match="2\\^31"):
        plan.fwd_walk(1 << 16, 1, 132, 1, 1 << 15, 1 << 15, 1)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, 16])
@pytest.mark.parametrize("pairs,group", [(1, 1), (7, 3), (48, 5), (48, 48), (300, 200)])
@pytest.mark.parametrize("step", [1, 5, 64, 132])
def test_paired_walk_is_a_permutation_that_pairs_tiles_on_one_cta(m, pairs, group, step):
    """The paired causal walk (Sm90WsTile.paired) takes every (query tile, pair) once over the same n_items
    as the strided walk; in its whole double rounds a CTA takes index u (the heavy tile m - 1 - u once
    reversed) and then m - 1 - u of one pair in consecutive rounds, so each of its units costs m + 1 key
    blocks; the units of a group of pairs hold only that group's pairs."""
    n = m * pairs
    step = min(step, n)
    walk = [_kernel_locate(i, m, pairs, group, step, True) for i in range(n)]
    assert sorted(walk) == sorted((x, pr) for x in range(m) for pr in range(pairs))
    whole = m // 2 * pairs // step * step
    for i in range(2 * whole):
        if i // step % 2 == 0:
            (x, pr), (y, pr2) = walk[i], walk[i + step]
            assert pr == pr2 and x < m // 2 and y == m - 1 - x  # (blocks: (m - x) + (x + 1) = m + 1)
            unit = i // (2 * step) * step + i % step
            assert pr // group == unit // (group * (m // 2))  # the unit's group
    assert walk[2 * (m // 2) * pairs:] == ([(m // 2, pr) for pr in range(pairs)] if m % 2 else [])  # middle tiles last


def test_clusters_launch_whole_clusters_and_only_where_they_pay(monkeypatch):
    """A cluster tile's grid is a multiple of its cluster: per tile, the query tiles rounded up (an odd
    count's last CTA only helps load); persistent, min(items, SMs / 2) clusters of pairs of query tiles.
    The planner takes them on the default tile from CLUSTER_KEYS keys (none since session 17: set here to
    8192 at head dims 128 and 256), but not where spare CTAs would be over 1/8 (1 or 3 query tiles);
    packed batches never take them."""
    assert plan.CLUSTER_KEYS == {} and all(t.cluster == 1 for t in plan.FWD_SM90_WS_TILES.values())
    assert not any(s.cluster == 2 for s in plan.all_fwd_specs("sm_90a") if s.family == "flash_fwd_sm90_ws")
    monkeypatch.setitem(plan.CLUSTER_KEYS, 128, 8192)
    monkeypatch.setitem(plan.CLUSTER_KEYS, 256, 8192)
    assert [m for m in range(1, 12) if plan.cluster_pays(m, 2)] == [2, 4, 6, 7, 8, 9, 10, 11]
    assert plan.cluster_pays(5, 1) and not plan.cluster_pays(1, 2)
    kw = dict(nheads=4, nheads_kv=2, head_dim=128, dtype="bf16", causal=False, aligned=True, arch="sm_90a",
              sm_count=132)  # fmt: skip
    tile = dataclasses.replace(plan.FWD_SM90_WS_SHORT_TILES[128], persistent=False, tma_store=True, cluster=2)
    odd = plan.plan_forward(batch=2, seqlen_q=300, seqlen_k=8000, tile=tile, **kw)
    assert odd.grid == (4, 4, 2) and odd.m_blocks == 3 and odd.spec.cluster == 2 and "_c2_" in odd.spec.name
    assert odd.spec.template_args().endswith(f", {1 | 8 | 16}")
    persistent = dataclasses.replace(tile, persistent=True)
    big = plan.plan_forward(batch=8, seqlen_q=1000, seqlen_k=1000, tile=persistent, **kw)
    assert big.grid == (132, 1, 1) and big.m_blocks == 8
    small = plan.plan_forward(batch=1, seqlen_q=300, seqlen_k=1000, tile=persistent, **kw)
    assert small.grid == (2 * 4 * 2, 1, 1)  # 2 items (pairs of query tiles) x 4 heads, 2 CTAs each
    for seqlen_q, seqlen_k, cluster in ((100, 16384, 1), (500, 16384, 1), (384, 16384, 2), (1300, 8192, 2),
                                        (16384, 16384, 2), (16384, 8191, 1), (16384, 512, 1)):  # fmt: skip
        auto = plan.plan_forward(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, **kw)
        assert auto.spec.cluster == cluster and auto.grid[0] % cluster == 0, (seqlen_q, seqlen_k)
    for d in (64, 128, 256):  # (clusters from CLUSTER_KEYS keys, on the default tile)
        t = plan.sm90_ws_tile(d, 10**6, False)
        assert t == dataclasses.replace(plan.FWD_SM90_WS_TILES[d], cluster=2 if d in plan.CLUSTER_KEYS else 1)
        assert plan.sm90_ws_tile(d, 10**6, True, default_only=True) == plan.FWD_SM90_WS_TILES[d]
    packed = plan.plan_forward(batch=2, seqlen_q=4000, seqlen_k=4000, mods=plan.MOD_VARLEN, tile=tile, **kw)
    assert packed.spec.cluster == 1 and "_c2" not in packed.spec.name
    with pytest.raises(ValueError, match="cluster"):
        plan.fwd_sm90_ws_spec(128, "bf16", False, dataclasses.replace(tile, cluster=4))
    with pytest.raises(ValueError, match="cluster"):
        plan.fwd_sm90_ws_spec(128, "bf16", False, dataclasses.replace(tile, block_n=16 * 3))
    specs = [s for s in plan.all_fwd_specs("sm_90a", head_dims=(128,), dtypes=("bf16",), aligned=(True,))
             if s.family == "flash_fwd_sm90_ws"]  # fmt: skip
    assert {s.cluster for s in specs} == {1, 2}  # (precompile builds both where CLUSTER_KEYS names the head dim)


def test_persistent_group_keeps_a_groups_kv_within_the_l2_share():
    """Pairs per group = as many as keep K/V (4 x seqlen_k x d bytes per kv head, shared by head_ratio
    query heads) within PERSISTENT_L2_SHARE[causal] of the L2; at least 1, at most every pair; no L2
    size: one group. Causal groups are the larger (a round of the walk should carry equal loads)."""
    l2 = 50 << 20
    assert plan.PERSISTENT_L2_SHARE[False] < plan.PERSISTENT_L2_SHARE[True]
    for causal in (False, True):
        share = plan.PERSISTENT_L2_SHARE[causal] * l2
        for seqlen_k, d, ratio in ((16384, 128, 1), (4096, 64, 1), (512, 128, 1), (16384, 128, 8), (100000, 256, 1)):
            g = plan.persistent_group(1000, seqlen_k, d, ratio, l2, causal)
            per = 4 * seqlen_k * d / ratio
            assert g >= 1 and (g == 1 or g * per <= share) and (g + 1) * per > share, (seqlen_k, d, ratio, g)
    assert plan.persistent_group(16, 512, 128, 1, l2, causal=True) == 16  # short keys: one group of every pair
    assert plan.persistent_group(16, 512, 128, 1, l2) == 16  # (0.08 of 50 MiB holds 16 of 256 KiB)
    assert plan.persistent_group(64, 1024, 128, 1, l2) == 8  # 512 KiB per head: 8 heads in 4 MiB
    assert plan.persistent_group(16, 16384, 128, 1, l2, causal=True) == 3  # 8 MiB per head: 3 heads in 25 MiB
    assert plan.persistent_group(16, 16384, 128, 4, l2, causal=True) == 12  # GQA: 4 query heads share each kv head
    assert plan.persistent_group(7, 10**6, 256, 1, l2) == 1
    assert plan.persistent_group(9, 16384, 128, 1, None) == 9
    with pytest.raises(ValueError, match="pairs"):
        plan.persistent_group(0, 1, 64, 1, l2)
    tile = plan.FWD_SM90_WS_SHORT_TILES[128]
    kw = dict(batch=2, seqlen_q=512, nheads=8, nheads_kv=8, head_dim=128, dtype="bf16", causal=False, aligned=True,
              arch="sm_90a", sm_count=132, tile=tile)  # fmt: skip
    assert plan.plan_forward(seqlen_k=512, l2_bytes=l2, **kw).sched_group == 16
    assert plan.plan_forward(seqlen_k=16384, l2_bytes=l2, **kw).sched_group == 1
    assert plan.plan_forward(seqlen_k=16384, l2_bytes=l2, **{**kw, "causal": True}).sched_group == 3
    assert plan.plan_forward(seqlen_k=16384, **{**kw, "tile": None}).sched_group == 0  # (not persistent)


def test_persistent_launch_needs_its_group():
    """The persistent walk divides by FwdParams.sched_group: a Launch of a persistent tile without one
    (0) is refused, as is one without its walk's divisors or with a stride (walk[0]) that is not its grid in
    clusters (the kernel strides by gridDim.x); plan_forward sizes the group from the real head dim (112 in
    bucket 128: K/V of 112 columns)."""
    tile = plan.FWD_SM90_WS_SHORT_TILES[128]
    spec = plan.fwd_sm90_ws_spec(128, "bf16", False, tile)
    walk = plan.fwd_walk(4, 1, 132, 1, 64, 16, 1)
    with pytest.raises(ValueError, match="sched_group"):
        plan.Launch(spec, (132, 1, 1), (spec.threads, 1, 1), spec.smem_bytes, m_blocks=4, walk=walk)
    for bad in ((), plan.fwd_walk(4, 1, 131, 1, 64, 16, 1)):
        with pytest.raises(ValueError, match="walk"):
            plan.Launch(spec, (132, 1, 1), (spec.threads, 1, 1), spec.smem_bytes, m_blocks=4, sched_group=1, walk=bad)
    ok = plan.Launch(spec, (132, 1, 1), (spec.threads, 1, 1), spec.smem_bytes, m_blocks=4, sched_group=1, walk=walk)
    assert ok.sched_group == 1 and ok.walk == walk
    l2 = 50 << 20
    kw = dict(batch=64, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_kv=16, dtype="bf16", causal=False, aligned=True,
              arch="sm_90a", sm_count=132, l2_bytes=l2)  # fmt: skip
    g128, g112 = (plan.plan_forward(head_dim=d, **kw).sched_group for d in (128, 112))
    assert g128 == plan.persistent_group(64 * 16, 1024, 128, 1, l2) == 8
    assert g112 == plan.persistent_group(64 * 16, 1024, 112, 1, l2) == 9  # 448 KiB per head in 0.08 x 50 MiB


def test_short_keys_take_the_short_key_tma_forward():
    """Keys up to SHORT_KEYS[bucket] (hd64: 1024, causal 2048; hd128: 2048, causal 4096; hd256: 512) take
    FWD_SM90_WS_SHORT_TILES' tile (hd64 and hd128 persistent, hd256 a per-tile launch of 64-key tiles),
    longer ones the default tile; packed batches by their longest sequence (max_seqlen_k; unknown: the
    default)."""
    kw = dict(batch=2, seqlen_q=700, nheads=4, nheads_kv=4, dtype="fp16", aligned=True, arch="sm_90a", sm_count=132)
    assert plan.SHORT_KEYS == {64: (1024, 2048), 128: (2048, 4096), 256: (512, 512)}
    assert set(plan.FWD_SM90_WS_SHORT_TILES) == set(plan.SHORT_KEYS) == {64, 128, 256}
    assert plan.FWD_SM90_WS_SHORT_TILES[256] == plan.Sm90WsTile(128, 64, pingpong=False)
    for d, short in plan.FWD_SM90_WS_SHORT_TILES.items():
        assert short.persistent == (d != 256)
        lim, lim_c = plan.SHORT_KEYS[d]
        for seqlen_k, causal, want in ((lim, False, short), (lim + 1, False, plan.FWD_SM90_WS_TILES[d]),
                                       (lim_c, True, short), (lim_c + 1, True, plan.FWD_SM90_WS_TILES[d])):  # fmt: skip
            launch = plan.plan_forward(seqlen_k=seqlen_k, causal=causal, head_dim=d, **kw)
            assert launch.spec.tile == want, (d, seqlen_k, causal)
            m_tiles = -(-700 // want.block_m)
            assert launch.grid == ((min(m_tiles * 4 * 2, 132), 1, 1) if want.persistent else (m_tiles, 4, 2))
        packed = plan.plan_forward(seqlen_k=300, causal=True, head_dim=d, mods=plan.MOD_VARLEN, **kw)
        unboxed = lambda t: dataclasses.replace(t, tma_store=False)  # (packed batches: 16-byte stores)  # noqa: E731
        assert packed.spec.tile == unboxed(plan.FWD_SM90_WS_TILES[d])
        for max_k, causal, want in ((lim, False, short), (lim + 1, False, plan.FWD_SM90_WS_TILES[d]),
                                    (lim_c, True, short), (lim_c + 1, True, plan.FWD_SM90_WS_TILES[d])):  # fmt: skip
            packed = plan.plan_forward(seqlen_k=20000, causal=causal, head_dim=d, mods=plan.MOD_VARLEN, max_seqlen_k=max_k,
                                       **kw)  # fmt: skip
            assert packed.spec.tile == unboxed(want) and packed.m_blocks == 700 // want.block_m + 2, (d, max_k, causal)
            if want.persistent:
                assert packed.grid == (min(packed.m_blocks * 4, 132), 1, 1) and packed.spec.mods == plan.MOD_VARLEN
    # the short tile's key width fits paged K/V and dropout as it is (fit_key_tile keeps it)
    for short in plan.FWD_SM90_WS_SHORT_TILES.values():
        assert plan.fit_key_tile(short, paged=True, mods=plan.MOD_DROPOUT) == short


def test_dropout_takes_its_own_tile_beyond_the_short_keys():
    """With dropout the planner takes FWD_SM90_WS_DROPOUT_TILES beyond the short keys (head dim 64's
    192-row default spills with dropout's keep bits; at 128 the 128-row tile measured faster), for plain and
    packed batches, with other variants too; the short-key tile up to them; and precompile builds it in
    place of the default's dropout variant."""
    W = plan.Sm90WsTile
    assert plan.FWD_SM90_WS_DROPOUT_TILES == {64: W(128, 128, pingpong=False), 128: W(128, 128, pingpong=False)}
    kw = dict(batch=2, seqlen_q=3000, nheads=4, nheads_kv=4, dtype="bf16", aligned=True, arch="sm_90a", sm_count=132)
    for d in (64, 128, 256):
        for causal in (False, True):
            long, short = 20000, plan.SHORT_KEYS[d][causal]
            for mods in (plan.MOD_DROPOUT, plan.MOD_DROPOUT | plan.MOD_WINDOW | plan.MOD_SOFTCAP):
                want = plan.fit_key_tile(plan.FWD_SM90_WS_DROPOUT_TILES.get(d, plan.FWD_SM90_WS_TILES[d]), mods=mods)
                assert plan.ws_default_tile(d, mods) == want  # (the table row, fitted)
                assert plan.ws_default_tile(d, mods & ~plan.MOD_DROPOUT) == plan.FWD_SM90_WS_TILES[d]
                got = plan.plan_forward(seqlen_k=long, causal=causal, head_dim=d, mods=mods, **kw).spec
                assert got.tile == want and got.mods == mods, (d, causal, mods)
                assert plan.plan_forward(seqlen_k=short, causal=causal, head_dim=d, mods=mods, **kw).spec.tile == \
                    plan.FWD_SM90_WS_SHORT_TILES[d]
                assert plan.plan_forward(seqlen_k=long, causal=causal, head_dim=d, mods=mods & ~plan.MOD_DROPOUT,
                                         **kw).spec.tile == plan.FWD_SM90_WS_TILES[d]  # fmt: skip
                packed = plan.plan_forward(seqlen_k=long, causal=causal, head_dim=d, mods=mods | plan.MOD_VARLEN,
                                           max_seqlen_k=long, **kw).spec.tile  # fmt: skip
                assert packed == dataclasses.replace(want, tma_store=False)
                assert plan.fwd_sm90_ws_spec(d, "bf16", causal, mods=mods).tile == want
            # paged K/V (packed batches) with dropout: its own tile, fitted (128 keys divide a page)
            paged = plan.plan_forward(seqlen_k=long, causal=causal, head_dim=d, mods=plan.MOD_DROPOUT | plan.MOD_VARLEN,
                                      max_seqlen_k=long, paged=True, **kw).spec.tile  # fmt: skip
            assert paged == dataclasses.replace(plan.ws_default_tile(d, plan.MOD_DROPOUT, paged=True), tma_store=False)
    # what precompile builds holds what the planner launches: plain and packed, with and without dropout
    varlen_dropout = plan.MOD_VARLEN | plan.MOD_DROPOUT
    specs = plan.all_fwd_specs("sm_90a", head_dims=(64,), dtypes=("bf16",), causals=(True,), aligned=(True,),
                               mods=(0, plan.MOD_DROPOUT, varlen_dropout))  # fmt: skip
    ws = {(s.tile, s.mods) for s in specs if s.family == "flash_fwd_sm90_ws"}
    unboxed = lambda t: dataclasses.replace(t, tma_store=False)  # (packed batches: 16-byte stores)  # noqa: E731
    assert ws == {(plan.FWD_SM90_WS_TILES[64], 0), (plan.FWD_SM90_WS_SHORT_TILES[64], 0),
                  (plan.FWD_SM90_WS_DROPOUT_TILES[64], plan.MOD_DROPOUT),
                  (plan.FWD_SM90_WS_SHORT_TILES[64], plan.MOD_DROPOUT),
                  (unboxed(plan.FWD_SM90_WS_DROPOUT_TILES[64]), varlen_dropout),
                  (unboxed(plan.FWD_SM90_WS_SHORT_TILES[64]), varlen_dropout)}  # fmt: skip
    for d in (64, 128, 256):
        for mods in (plan.MOD_DROPOUT, varlen_dropout):
            specs = plan.all_fwd_specs("sm_90a", head_dims=(d,), dtypes=("bf16",), causals=(True,), aligned=(True,),
                                       mods=(mods,))  # fmt: skip
            launched = plan.plan_forward(seqlen_k=20000, causal=True, head_dim=d, mods=mods,
                                         max_seqlen_k=20000 if mods & plan.MOD_VARLEN else None, **kw).spec  # fmt: skip
            assert launched in specs, (d, mods)


@pytest.mark.parametrize("head_dim", [32, 96, 160, 192, 224])
def test_buckets_without_hopper_tile_use_mma_sync(head_dim):
    assert _fwd_plan(head_dim).spec.family == "flash_fwd"


@pytest.mark.parametrize("head_dim", [100, 4, 63])
def test_odd_head_dims_use_mma_sync(head_dim):  # no 16-byte rows: the element-wise mma.sync path
    assert _fwd_plan(head_dim, aligned=False).spec.family == "flash_fwd"


def test_explicit_tile_picks_the_kernel():
    t = plan.FWD_TILES[128]
    assert _fwd_plan(128, tile=t).spec == plan.fwd_spec(128, "bf16", True, True, "sm_90a", t)
    h = plan.Sm90Tile(128, 64)
    spec = _fwd_plan(128, tile=h).spec
    assert spec.family == "flash_fwd_sm90" and spec.tile == h
    assert spec.template_args() == "128, 128, 64, 2, true, true"
    assert spec.name == "flash_fwd_sm90_hd128_bf16_causal_bm128_bn64_w8_mb1_st2_vec16_sm90a"
    assert spec.threads == 256 and spec.min_blocks == 1
    with pytest.raises(ValueError, match="sm_90a"):
        _fwd_plan(128, arch="sm_80", tile=h)
    with pytest.raises(ValueError, match="sm_90a"):
        _fwd_plan(128, aligned=False, tile=h)


@pytest.mark.parametrize(
    "head_dim,tile,match",
    [
        (96, plan.Sm90Tile(128, 64), "multiples of 64"),  # bucket 96: half a swizzle atom
        (128, plan.Sm90Tile(96, 64), "multiples of 64"),
        (128, plan.Sm90Tile(128, 64, stages=1), "2 stages"),
        (256, plan.Sm90Tile(64, 64), "threads"),  # 128 threads over 32-chunk rows: 4 rows per pass
        (256, plan.Sm90Tile(128, 128), "shared memory"),
        (192, None, "no Hopper forward tile"),
        (60, None, "head_dim % 8"),
    ],
)
def test_hopper_spec_rejects_bad_tiles(head_dim, tile, match):
    with pytest.raises(ValueError, match=match):
        plan.fwd_sm90_spec(head_dim, "bf16", False, tile)


def test_hopper_tiles_fit_and_names_are_unique():
    for bucket, tile in plan.FWD_SM90_TILES.items():
        spec = plan.fwd_sm90_spec(bucket, "fp16", False)
        assert spec.smem_bytes <= plan.max_smem_bytes("sm_90a")
        assert tile.block_m % 64 == 0 and tile.block_n % 64 == 0 and bucket % 64 == 0
    specs = [s for s in plan.all_fwd_specs("sm_90a")]
    assert len({s.name for s in specs}) == len(specs)
    assert all(s.name.isidentifier() for s in specs)


def test_ws_forward_key_tiles_are_multiples_of_16():
    """The warp-specialized forward takes the key tiles of WS_KEY_TILES (multiples of 16 whose wgmma
    shape tools/gen_wgmma.py generates) within the shared memory: FlashAttention-3's 128 x 176 at head
    dim 128 and 128 x 80 at 256 fit; 72, 272, 48, 16, 224 keys (no wgmma generated) and 96 keys at
    256 (262 KB) do not."""
    W = plan.Sm90WsTile
    for bucket, bn in ((128, 176), (128, 144), (256, 80), (64, 112)):
        spec = plan.fwd_sm90_ws_spec(bucket, "bf16", True, W(128, bn, pingpong=False))
        assert spec.smem_bytes <= plan.max_smem_bytes("sm_90a") and f"bn{bn}" in spec.name
    for bucket, bn, match in ((128, 72, "block_n one of"), (64, 272, "block_n one of"), (64, 48, "block_n one of"),
                              (64, 16, "block_n one of"), (64, 224, "block_n one of"), (256, 96, "shared memory")):
        with pytest.raises(ValueError, match=match):
            plan.fwd_sm90_ws_spec(bucket, "bf16", False, W(128, bn, pingpong=False))


def test_ws_forward_smem_matches_the_kernel_config():
    """NVRTC checks, for every warp-specialized forward variant that precompile builds (plain, every variant,
    packed batches) and for persistent tiles with 2-4 K/V slots, that template_args() lands the tile on
    Sm90WsFwdConfig and that its kSmemBytes is the plan's fwd_sm90_ws_smem_bytes (the launch's dynamic
    shared memory; no GPU needed)."""
    specs = [s for s in plan.all_fwd_specs("sm_90a", dtypes=("bf16",), causals=(True,), aligned=(True,),
                                           mods=(0, plan.ALL_MODS, plan.MOD_VARLEN))
             if s.family == "flash_fwd_sm90_ws"]  # fmt: skip
    W = plan.Sm90WsTile
    for hd in (64, 128):
        for stages in (2, 3, 4):
            t = W(128, 128 if hd == 64 else 64, stages, pingpong=False, persistent=True)
            if plan.fwd_sm90_ws_smem_bytes(hd, t) <= plan.max_smem_bytes("sm_90a"):
                specs.append(plan.fwd_sm90_ws_spec(hd, "fp16", False, t))
    for hd in (64, 128):  # the look-ahead (two Q slots, two more mbarriers), with and without TMA stores
        for tma_store in (False, True):
            t = dataclasses.replace(plan.FWD_SM90_WS_SHORT_TILES[hd], look_ahead=True, tma_store=tma_store)
            specs.append(plan.fwd_sm90_ws_spec(hd, "bf16", True, t, plan.MOD_WINDOW))
    assert any(s.tile.persistent and s.tile.stages == 4 for s in specs) and any(s.tile.block_m == 192 for s in specs)
    lines = ['#include "flash_fwd_sm90_ws.cuh"']
    for s in dict.fromkeys(specs):
        c = f"cuflash::Sm90WsFwdConfig<{s.template_args()}>"
        persistent = "true" if s.tile.persistent else "false"
        look_ahead = "true" if s.tile.look_ahead else "false"
        lines.append(f"static_assert({c}::kHeadDim == {s.head_dim} && {c}::kBlockM == {s.tile.block_m} && "
                     f"{c}::kBlockN == {s.tile.block_n} && {c}::kStages == {s.tile.stages} && "
                     f"{c}::kPersistent == {persistent} && {c}::kLookAhead == {look_ahead}, "
                     f'"{s.name}: template argument order");')  # fmt: skip
        lines.append(f'static_assert({c}::kSmemBytes == {s.smem_bytes}, "{s.name}: shared memory");')
    compile_static_asserts(lines, "fwd_ws_config_check.cu")


def test_ws_forward_look_ahead_rules():
    """The look-ahead (Sm90WsTile.look_ahead: kernel bit 32, two Q slots) is a schedule of persistent,
    overlapped 128-row tiles without ping-pong or clusters whose key tiles are no wider than their query tiles (a
    stand-in S reads a Q tile as its B); packed batches drop it (their items come from the varlen
    scheduler); nothing plans it."""
    W = plan.Sm90WsTile
    la = W(128, 128, pingpong=False, persistent=True, tma_store=False, look_ahead=True)
    spec = plan.fwd_sm90_ws_spec(128, "bf16", True, la)
    assert la.sched == 1 | 4 | 32 | 64 and spec.name.endswith("_persistent_la_vec16_sm90a")
    assert spec.smem_bytes == plan.fwd_sm90_ws_smem_bytes(128, dataclasses.replace(la, look_ahead=False)) + 128 * 128 * 2 + 16
    assert spec.smem_bytes <= plan.max_smem_bytes("sm_90a")
    packed = plan.fwd_sm90_ws_spec(128, "bf16", True, la, plan.MOD_VARLEN)
    assert not packed.tile.look_ahead and packed == plan.fwd_sm90_ws_spec(128, "bf16", True, dataclasses.replace(
        la, look_ahead=False), plan.MOD_VARLEN)
    for bad in (dataclasses.replace(la, persistent=False), dataclasses.replace(la, overlap=False),
                dataclasses.replace(la, pingpong=True), dataclasses.replace(la, cluster=2),
                W(128, 176, pingpong=False, persistent=True, look_ahead=True),
                W(192, 128, pingpong=False, persistent=True, look_ahead=True)):
        with pytest.raises(ValueError, match="look_ahead needs"):
            plan.fwd_sm90_ws_spec(64, "bf16", False, bad)
    planned = [s for s in plan.all_fwd_specs("sm_90a", mods=(0, plan.ALL_MODS, plan.MOD_VARLEN))
               if s.family == "flash_fwd_sm90_ws"]  # fmt: skip
    assert planned and not any(s.tile.look_ahead for s in planned)


def test_paged_kv_and_dropout_plan_key_tiles_that_fit():
    """Paged K/V: the planned forward's key tiles divide PAGE_KEYS (page sizes are its multiples); dropout:
    they are multiples of DROPOUT_KEYS (its random bits come in 16 x 32 blocks). Head dim 256's 80-key
    tile becomes 64 keys for either; the other tiles stay; precompile builds both; a forced 80-key
    tile with dropout is refused."""
    assert (plan.PAGE_KEYS, plan.DROPOUT_KEYS) == (128, 32)
    W = plan.Sm90WsTile
    fit = plan.fit_key_tile
    assert fit(W(128, 80, pingpong=False), paged=True) == W(128, 64, pingpong=False)
    assert fit(W(128, 80, pingpong=False), mods=plan.MOD_DROPOUT | plan.MOD_WINDOW) == W(128, 64, pingpong=False)
    assert fit(W(128, 80, pingpong=False), mods=plan.MOD_WINDOW) == W(128, 80, pingpong=False)
    assert fit(W(128, 176, pingpong=False), paged=True) == W(128, 128, pingpong=False)
    assert fit(W(128, 176, pingpong=False), mods=plan.MOD_DROPOUT) == W(128, 128, pingpong=False)
    assert fit(W(128, 160, pingpong=False), mods=plan.MOD_DROPOUT) == W(128, 160, pingpong=False)
    assert fit(W(128, 128, persistent=True), paged=True, mods=plan.MOD_DROPOUT) == W(128, 128, persistent=True)
    assert fit(W(128, 16), mods=plan.MOD_DROPOUT) == W(128, 32)  # (never below DROPOUT_KEYS)
    kw = dict(batch=3, seqlen_q=900, seqlen_k=3000, nheads=4, nheads_kv=2, dtype="bf16", causal=True, aligned=True,
              arch="sm_90a", sm_count=132, max_seqlen_k=1000)  # fmt: skip
    for d in (64, 128, 256):
        for mods, paged in ((plan.MOD_VARLEN, True), (plan.MOD_VARLEN | plan.MOD_DROPOUT, False), (plan.MOD_DROPOUT, False)):
            free = plan.plan_forward(head_dim=d, mods=mods & ~plan.MOD_DROPOUT, **kw).spec.tile
            got = plan.plan_forward(head_dim=d, mods=mods, paged=paged, **kw).spec.tile
            if free == plan.FWD_SM90_WS_TILES[d] and mods & plan.MOD_DROPOUT:  # (3000 keys, not packed: the
                free = plan.FWD_SM90_WS_DROPOUT_TILES.get(d, free)  # default; dropout's own row, unfitted, if it has one)
            assert got == fit(free, paged=paged, mods=mods) and (got != free) == (d == 256), (d, mods, paged)
            assert plan.PAGE_KEYS % got.block_n == 0 and got.block_n % plan.DROPOUT_KEYS == 0
    specs = plan.all_fwd_specs("sm_90a", head_dims=(256,), dtypes=("bf16",), causals=(True,), aligned=(True,),
                               mods=(plan.MOD_VARLEN, plan.MOD_DROPOUT))  # fmt: skip
    ws = {(s.mods, s.tile.block_n) for s in specs if s.family == "flash_fwd_sm90_ws"}
    assert ws == {(plan.MOD_VARLEN, 80), (plan.MOD_VARLEN, 64), (plan.MOD_DROPOUT, 64)}
    with pytest.raises(ValueError, match="dropout needs key tiles of a multiple of 32"):
        plan.fwd_sm90_ws_spec(256, "bf16", False, W(128, 80, pingpong=False), mods=plan.MOD_DROPOUT)


def test_forward_call_signature_of_the_prepared_path():
    """forward._signature, the key under which a dense forward's checks and plan are kept: other pointers
    give the same key; every static property (shape, strides, dtype, device of q, k, v and out, causal,
    scale, window, softcap, the diagonal's shift) another; calls that take the whole way every time
    (ALiBi, dropout, arguments of other types, which the whole way refuses) get None. A fake array type,
    so it runs without a GPU."""
    import numpy as np

    from cuflash import forward

    from fake_arrays import FakeArray
    from fake_arrays import fake_array as arr

    q, k, v = arr((2, 512, 8, 64)), arr((2, 512, 2, 64)), arr((2, 512, 2, 64))
    base = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                diag_shift=0, out=None)  # fmt: skip

    def sig(q=q, k=k, v=v, desc=forward._desc, **kw):
        kw = {**base, **kw}
        return forward._signature(FakeArray, desc, q, k, v, kw["causal"], kw["softmax_scale"], kw["window_size"],
                                  kw["softcap"], kw["alibi_slopes"], kw["dropout_p"], kw["diag_shift"], kw["out"])  # fmt: skip

    key = sig()
    assert key is not None and hash(key) is not None
    assert sig(q=arr((2, 512, 8, 64), ptr=8192), k=arr((2, 512, 2, 64), ptr=1 << 40)) == key  # pointers only
    assert sig(softcap=0, dropout_p=0) == key  # the same values as ints
    for changed in (dict(q=arr((2, 512, 8, 64), strides=(2 * 512 * 1024, 1024, 128, 2))),
                    dict(q=arr((2, 512, 8, 64), device=1)), dict(q=arr((2, 512, 8, 64), dtype=np.float32)),
                    dict(q=arr((2, 511, 8, 64))), dict(k=arr((2, 512, 4, 64))), dict(v=arr((2, 512, 2, 64), ptr=8, strides=(0, 256, 128, 2))),
                    dict(causal=True), dict(softmax_scale=0.1), dict(window_size=(64, 0)), dict(softcap=30.0),
                    dict(diag_shift=3), dict(out=arr((2, 512, 8, 64))),
                    dict(out=arr((2, 512, 8, 64), strides=(2 * 512 * 1024, 1024, 128, 2)))):  # fmt: skip
        other = sig(**changed)
        assert other is not None and other != key, changed
    # a given out is its own slot: contiguous or not, never the key of a call without one
    assert sig(out=arr((2, 512, 8, 64))) != sig(out=arr((2, 512, 8, 64), strides=(2 * 512 * 1024, 1024, 128, 2)))
    for whole_way in (dict(alibi_slopes=arr((8,), np.float32)), dict(dropout_p=0.1), dict(dropout_p=np.float32(0)),
                      dict(window_size=[-1, -1]), dict(window_size=(-1, -1, 0)), dict(window_size=(np.int64(64), 0)),
                      dict(softcap=np.float32(5)), dict(softcap="5"), dict(diag_shift=np.int32(1)), dict(causal=1),
                      dict(causal=np.bool_(True)), dict(softmax_scale=np.float32(0.125)), dict(softmax_scale=1),
                      dict(q=np.zeros((2, 512, 8, 64), np.float16)), dict(k=[1]), dict(v=None),
                      dict(out=np.zeros((2, 512, 8, 64), np.float16))):  # fmt: skip
        assert sig(**whole_way) is None, whole_way
    # An array its desc refuses (cuflash.torch's: a tensor to_cupy would copy) sends the call the whole way.
    out = arr((2, 512, 8, 64))
    for refused in (q, k, v, out):
        assert sig(out=out, desc=lambda x, r=refused: None if x is r else forward._desc(x)) is None


def test_varlen_call_signature_of_the_prepared_path():
    """varlen._signature, the key under which a packed forward's checks and plan are kept: the dense key of
    q, k, v, out and the variants, plus the prefix sums' and seqused_k's descriptions and max_seqlen_k's
    short-key hint. Other pointers give the same key (the prefix sums' values are not part of it: the
    prepared path passes their pointers), as do other max_seqlen values with the same hint; other shapes, a
    max_seqlen_k of another hint or seqused_k's presence another; check=True, paged K/V, ALiBi, dropout,
    negative max_seqlen and arguments of other types None. Fake arrays, no GPU."""
    import numpy as np

    from cuflash import forward, varlen

    from fake_arrays import FakeArray
    from fake_arrays import fake_array as arr

    q, k = arr((1000, 8, 64)), arr((1000, 2, 64))
    cu = arr((5,), np.int32)
    base = dict(q=q, k=k, v=k, cu_q=cu, cu_k=cu, max_q=300, max_k=300, causal=True, softmax_scale=None,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, seqused_k=None, block_table=None,
                out=None, check=False)  # fmt: skip

    def sig(desc=forward._desc, **kw):
        a = {**base, **kw}
        return varlen._signature(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], a["max_q"], a["max_k"], a["causal"],
                                 a["softmax_scale"], a["window_size"], a["softcap"], a["alibi_slopes"], a["dropout_p"],
                                 a["seqused_k"], a["block_table"], a["out"], a["check"], FakeArray, desc)  # fmt: skip

    key = sig()
    assert key is not None and hash(key) is not None
    assert sig(q=arr((1000, 8, 64), ptr=1 << 30), cu_q=arr((5,), np.int32, ptr=64), cu_k=arr((5,), np.int32, ptr=96)) == key
    from cuflash import plan

    longest = max(max(v) for v in plan.SHORT_KEYS.values())
    assert plan.short_keys_hint(299) != plan.short_keys_hint(300) != plan.short_keys_hint(longest + 1)
    assert sig(max_q=7) == key and sig(max_q=0) == key  # (max_seqlen_q reaches no plan)
    assert sig(max_k=longest + 1) == sig(max_k=longest + 500) != key  # one hint past the short keys
    for changed in (dict(q=arr((999, 8, 64))), dict(cu_q=arr((6,), np.int32), cu_k=arr((6,), np.int32)),
                    dict(cu_k=arr((5,), np.int32, device=1)), dict(max_k=299), dict(max_k=2048),
                    dict(seqused_k=arr((4,), np.int32)), dict(causal=False), dict(window_size=(64, 0)),
                    dict(softcap=20.0), dict(out=arr((1000, 8, 64)))):  # fmt: skip
        other = sig(**changed)
        assert other is not None and other != key, changed
    assert sig(seqused_k=arr((4,), np.int32)) == sig(seqused_k=arr((4,), np.int32, ptr=1 << 20))
    for whole_way in (dict(check=True), dict(block_table=arr((4, 3), np.int32)), dict(alibi_slopes=arr((8,), np.float32)),
                      dict(dropout_p=0.1), dict(max_q=np.int64(300)), dict(max_k=300.0), dict(max_q=-1), dict(max_k=-1),
                      dict(max_q=True), dict(cu_q=np.zeros(5, np.int32)),
                      dict(seqused_k=np.zeros(4, np.int32)), dict(q=np.zeros((1000, 8, 64), np.float16))):  # fmt: skip
        assert sig(**whole_way) is None, whole_way
    for refused in (cu, q):  # an array its desc refuses (cuflash.torch's: one to_cupy would copy)
        assert sig(desc=lambda x, r=refused: None if x is r else forward._desc(x)) is None


def test_preparation_keeps_the_tensor_maps_geometry():
    """forward.preparation (what forward.run and varlen.run keep of a launched call): per tensor map the
    array's shape, its strides in elements and the box rows tma.fwd_boxes gives the planned tile; the maps a
    kernel leaves zero counted (the output map of a kernel storing O without TMA); none without maps."""
    import numpy as np

    from cuflash import forward, tma

    from fake_arrays import fake_array as arr

    q = arr((2, 512, 8, 128), dtype=np.float16)
    kv = arr((2, 512, 2, 128), dtype=np.float16)
    for tile in (plan.FWD_SM90_WS_SHORT_TILES[128], plan.FWD_SM90_WS_TILES[128]):
        how = plan.plan_forward(batch=2, seqlen_q=512, seqlen_k=512, nheads=8, nheads_kv=2, head_dim=128, dtype="fp16",
                                causal=False, aligned=True, arch="sm_90a", tile=tile, sm_count=132)  # fmt: skip
        prep = forward.preparation(("args",), how, None, b"rec", "fp16", (q, kv, kv, q), True, True, (2, 8, 512))
        boxes = tma.fwd_boxes(tile.block_m, tile.block_n, tile.tma_store, tile.cluster)
        assert [m[2] for m in prep.maps] == list(boxes) and prep.zero_maps == 4 - len(boxes)
        assert prep.maps[0][:2] == ((2, 512, 8, 128), (512 * 8 * 128, 8 * 128, 128, 1))
        assert prep.maps[1][:2] == ((2, 512, 2, 128), (512 * 2 * 128, 2 * 128, 128, 1))
        assert (prep.plan_args, prep.record, prep.lse_shape, prep.aligned) == (("args",), b"rec", (2, 8, 512), True)
    none = forward.preparation((), how, None, b"", "fp16", (q, kv, kv, q), False, False, (2, 8, 512))
    assert none.maps == () and none.zero_maps == 0
