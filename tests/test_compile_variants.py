"""Every kernel variant the library can launch compiles with NVRTC for sm_80 and sm_90a (no GPU
needed), and ptxas's resource report stays within budget."""
from __future__ import annotations

import os

import pytest

from cuflash import jit, plan

ARCHS = ("sm_80", "sm_90a")

#: Spill bytes allowed per variant. The paper's head dims on the 16-byte load path must not spill
#: at all (their inner loop is the product); the other buckets and the element-wise load path
#: (odd head dims) may spill a little, outside or at the edge of the inner loop.
MAX_SPILL_BYTES_PRIMARY = 0
MAX_SPILL_BYTES_OTHER = 256
PRIMARY_HEAD_DIMS = (64, 128)


def _is_primary(spec: plan.KernelSpec) -> bool:
    return spec.aligned and spec.head_dim in PRIMARY_HEAD_DIMS


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    cache = tmp_path_factory.mktemp("compile-cache")
    old = os.environ.get("CUFLASH_CACHE_DIR")
    os.environ["CUFLASH_CACHE_DIR"] = str(cache)
    try:
        specs = [s for arch in ARCHS for s in plan.all_fwd_specs(arch)]
        results = jit.precompile(specs, jobs=max(1, min(4, os.cpu_count() or 1)))
        yield specs, {name: header for name, _, header in results}
    finally:
        if old is None:
            del os.environ["CUFLASH_CACHE_DIR"]
        else:
            os.environ["CUFLASH_CACHE_DIR"] = old


@pytest.mark.slow
def test_every_variant_compiles(compiled):
    specs, headers = compiled
    assert len(specs) == len(ARCHS) * len(plan.HEAD_DIM_BUCKETS) * 2 * 2 * 2
    assert set(headers) == {s.name for s in specs}
    for s in specs:
        assert headers[s.name]["arch"] == s.arch


@pytest.mark.slow
def test_registers_and_spills_within_budget(compiled):
    specs, headers = compiled
    problems = []
    for s in specs:
        p = headers[s.name]["ptxas"]
        assert {"registers", "spill_stores", "spill_loads"} <= set(p), (s.name, p)
        budget = MAX_SPILL_BYTES_PRIMARY if _is_primary(s) else MAX_SPILL_BYTES_OTHER
        if p["registers"] > 255:
            problems.append(f"{s.name}: {p['registers']} registers")
        if p["spill_stores"] > budget or p["spill_loads"] > budget:
            problems.append(f"{s.name}: spills {p['spill_stores']}/{p['spill_loads']} bytes > {budget}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_shared_memory_fits(compiled):
    specs, headers = compiled
    for s in specs:
        assert headers[s.name]["smem_bytes"] <= 227 * 1024, s.name
        if s.tile.min_blocks > 1:  # the occupancy the launch bounds ask for must fit an SM (228 KB)
            assert s.tile.min_blocks * (headers[s.name]["smem_bytes"] + 1024) <= 228 * 1024, s.name
