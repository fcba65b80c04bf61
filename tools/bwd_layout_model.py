"""A CPU model of the TMA backward pair consumer's shared-memory layouts, wgmma operand reads and dQ
hand-over, to check without a GPU that each GEMM of the 64-, 128- and 80-row query blocks reads the logical
elements it means to, and that every dQ accumulator element reaches its place in dQ.

    python tools/bwd_layout_model.py

The data are tags (tensor, row, column). The writers (TMA boxes with SWIZZLE_128B, the dS^T stmatrix) and the
readers (wgmma descriptors: start, leading byte offset, 1024-byte stride, K-major or MN-major) are written
from the kernel's address formulas (cuda_src/flash_bwd_sm90_ws.cuh, sm90_tile.cuh), so a change there must
be made here too; the dQ layout (warps along the rows, warp tiles, transposed) comes from cuflash.plan, and
the convert kernel's reading of it from flash_bwd_convert_kernel. The 128-byte swizzle: address bits [4:6]
^= bits [7:9]. The model is how the kernels take the hardware to work (its 64-row paths pass on the GPU); it
cannot tell whether the hardware accepts an operand (e.g. an MN-major B of 80 columns, 1.25 swizzle atoms).
Written for session 32, when the wide blocks could not run on a GPU: it finds the dQ^T operand bug a second
agent found in 4ec44d3, and a dS^T written into one atom only."""
from __future__ import annotations

import itertools
import sys

def phys(addr):
    return addr ^ (((addr >> 7) & 7) << 4)

class Smem:
    def __init__(self): self.m = {}
    def put(self, addr, tag):  # addr: physical byte address of a 2-byte element
        assert addr % 2 == 0
        self.m[addr] = tag
    def get(self, addr): return self.m.get(addr, ("?", addr))

def tma_tile(sm, base, rows, cols, name):
    """A (rows x cols) tile loaded as 64-column boxes with SWIZZLE_128B: atom a at base + a rows 128."""
    assert base % 1024 == 0
    for a in range(cols // 64):
        for r in range(rows):
            for c in range(64):
                sm.put(phys(base + a * rows * 128 + r * 128 + c * 2), (name, r, 64 * a + c))

def stmatrix_dsT(sm, s_ds, block_m, block_n):
    """flash_bwd_sm90_ws_pair_consumer's stmatrix of dS^T: both consumer warpgroups, all k-steps."""
    for cwg, w, kk, lane in itertools.product(range(2), range(4), range(block_m // 16), range(32)):
        cwarp = 4 * cwg + w
        g = lane // 4
        key_local = cwg * 64 + (cwarp % 4) * 16 + g
        st_row = key_local - g + 8 * ((lane // 8) % 2) + lane % 8
        st_chunk = (lane // 16) ^ (lane % 8)
        atom = s_ds + (kk // 4) * block_n * 128 if block_m > 64 else s_ds
        addr = atom + st_row * 128 + ((st_chunk ^ (2 * (kk % 4))) << 4)
        m, i = lane // 8, lane % 8  # stored matrix m, row i = fragment m's row i
        key = cwg * 64 + (cwarp % 4) * 16 + 8 * (m % 2) + i
        q0 = 16 * kk + 8 * (m // 2)
        for e in range(8):
            sm.put(addr + 2 * e, ("dsT", key, q0 + e))

def read(sm, start, lbo, trans, rows):
    """One k-step (16) of a wgmma operand: rows x 16 tags. K-major: (row, k) at start + (row / 8) 1024 +
    (row % 8) 128 + 2 k; MN-major: (mn, k) at start + (mn / 64) lbo + (k / 8) 1024 + (k % 8) 128 + 2 (mn % 64)."""
    out = []
    for r in range(rows):
        row = []
        for k in range(16):
            if not trans:
                a = start + (r // 8) * 1024 + (r % 8) * 128 + 2 * k
            else:
                a = start + (r // 64) * lbo + (k // 8) * 1024 + (k % 8) * 128 + 2 * (r % 64)
            row.append(sm.get(phys(a)))
        out.append(row)
    return out

def kmajor_kstep(rows, ks): return (ks // 4) * rows * 128 + (ks % 4) * 32

def check(hd, block_m, block_n=128, stages=2):
    """Every GEMM operand of both consumer warpgroups for one query block (slot 0, dS^T buffer 1)."""
    kt_kv, kt_q = block_n * hd * 2, block_m * hd * 2
    ds_bytes = block_n * 128 * -(-block_m // 64)
    base = 1024 * 64
    k, v = base, base + kt_kv
    q0 = v + kt_kv
    do0 = q0 + stages * kt_q
    ds0 = do0 + stages * kt_q
    for x in (k, v, q0, do0, ds0): assert x % 1024 == 0
    sm = Smem()
    tma_tile(sm, k, block_n, hd, "K"); tma_tile(sm, v, block_n, hd, "V")
    tma_tile(sm, q0, block_m, hd, "Q"); tma_tile(sm, do0, block_m, hd, "dO")
    buf = 1
    s_ds = ds0 + buf * ds_bytes
    stmatrix_dsT(sm, s_ds, block_m, block_n)
    rows_per_wg = block_m == 128
    dqt = block_m == 80
    dq_cols = hd if rows_per_wg else (block_m if dqt else hd // 2)
    bad = []
    def expect(name, got, want):
        if got != want:
            bad.append(name)
    for cwg in range(2):
        # S^T = K_c Q^T, dP^T = V_c dO^T: A K-major (64 keys), B K-major (block_m queries)
        for (a_base, a_name, b_base, b_name) in ((k, "K", q0, "Q"), (v, "V", do0, "dO")):
            for ks in range(hd // 16):
                A = read(sm, a_base + cwg * 64 * 128 + kmajor_kstep(block_n, ks), 16, 0, 64)
                B = read(sm, b_base + kmajor_kstep(block_m, ks), 16, 0, block_m)
                expect(f"S A {a_name}", A, [[(a_name, 64 * cwg + r, 16 * ks + c) for c in range(16)] for r in range(64)])
                expect(f"S B {b_name}", B, [[(b_name, r, 16 * ks + c) for c in range(16)] for r in range(block_m)])
        # dV += P^T dO, dK += dS^T Q: B N-major (N = hd), 16-query k-steps
        for b_base, b_name in ((do0, "dO"), (q0, "Q")):
            for kk in range(block_m // 16):
                B = read(sm, b_base + kk * 16 * 128, block_m * 128, 1, hd)
                expect(f"dKV B {b_name}", B, [[(b_name, 16 * kk + c, n) for c in range(16)] for n in range(hd)])
        # dQ
        desc_ds0 = (ds0 + cwg * block_n * 128) if rows_per_wg else ds0
        if rows_per_wg:
            desc_k_dq = k
        elif dqt:
            desc_k_dq = k + cwg * block_n * 128
        else:
            desc_k_dq = k + (cwg * dq_cols // 64) * block_n * 128 + (cwg * dq_cols % 64) * 2
        for kk in range(block_n // 16):
            if dqt:  # dQ^T = K^T dS^T: A = K atom (M = head dim) MN-major, B = dS^T (N = queries) MN-major
                A = read(sm, desc_k_dq + kk * 2048, block_n * 128, 1, 64)
                B = read(sm, desc_ds0 + buf * ds_bytes + kk * 2048, block_n * 128, 1, block_m)
                expect("dQt A K", A, [[("K", 16 * kk + c, 64 * cwg + r) for c in range(16)] for r in range(64)])
                expect("dQt B dsT", B, [[("dsT", 16 * kk + c, n) for c in range(16)] for n in range(block_m)])
            else:  # dQ = dS K: A = dS^T rows read M-major (64 queries), B = K (N = dq_cols) MN-major
                A = read(sm, desc_ds0 + buf * ds_bytes + kk * 2048, block_n * 128, 1, 64)
                B = read(sm, desc_k_dq + kk * 2048, block_n * 128, 1, dq_cols)
                q_off = 64 * cwg if rows_per_wg else 0
                col0 = 0 if rows_per_wg else cwg * dq_cols
                expect("dQ A dsT", A, [[("dsT", 16 * kk + c, q_off + r) for c in range(16)] for r in range(64)])
                expect("dQ B K", B, [[("K", 16 * kk + c, col0 + n) for c in range(16)] for n in range(dq_cols)])
    return sorted(set(bad))

def dq_roundtrip(hd, block_m):
    """Accumulator element -> dq_accum float (bwd_sm90_add_dq) -> dQ (row, col) the convert kernel writes,
    with the planner's dQ layout of the tile: (wrong places, whether every (row, col) of the block is hit)."""
    from cuflash import plan

    tile = plan.BwdSm90WsTile(block_m=block_m)
    rows_per_wg, dqt = block_m == 128, block_m == 80
    assert tile.dq_transposed == dqt
    kcols = hd if rows_per_wg else (block_m if dqt else hd // 2)
    q_warps = tile.dq_q_warps
    rows_w, cols_w = tile.warp_tiles(hd)["dq"]
    where = {}
    for cwarp, lane in itertools.product(range(8), range(32)):
        g, t, cwg, i = lane // 4, lane % 4, cwarp // 4, cwarp % 4
        for j in range(kcols // 8):
            for e in range(4):
                r, c = 16 * i + g + 8 * (e // 2), 8 * j + 2 * t + e % 2  # accumulator (row, col) of this warpgroup
                if dqt:
                    logical = (c, 64 * cwg + r)           # dQ^T: rows head-dim, cols queries
                elif rows_per_wg:
                    logical = (64 * cwg + r, c)
                else:
                    logical = (r, cwg * kcols + c)
                f = (cwarp * (kcols // 8)) * 128 + lane * 4 + j * 128 + e  # bwd_sm90_add_dq
                where[f] = logical
    blocks = cols_w // 8
    per_warp = (rows_w // 16) * blocks
    out = {}
    for grp in range(block_m * hd // 128):
        w, s, db = grp // per_warp, (grp % per_warp) // blocks, grp % blocks
        wq, wc = w % q_warps, w // q_warps
        for lane in range(32):
            r, c = wq * rows_w + 16 * s + lane // 4, wc * cols_w + 8 * db + 2 * (lane % 4)
            cells = [(r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1)]
            if dqt:
                cells = [(c, r), (c + 1, r), (c, r + 8), (c + 1, r + 8)]
            for e in range(4):
                out[grp * 128 + lane * 4 + e] = cells[e]
    assert set(where) == set(out), (len(where), len(out))
    bad = [f for f in where if where[f] != out[f]]
    cover = sorted(set(where.values())) == [(q, d) for q in range(block_m) for d in range(hd)]
    return len(bad), cover

#: (head dim, query rows) of the pair consumer's tiles: 64 rows at head dims 64 and 128 (run on the GPU), the
#: wide blocks 128 at 64 and 80 at 128
TILES = ((64, 64), (128, 64), (64, 128), (128, 80))


def main() -> int:
    failed = 0
    for hd, bm in TILES:
        bad, (wrong, covers) = check(hd, bm), dq_roundtrip(hd, bm)
        failed += bool(bad) or bool(wrong) or not covers
        print(f"hd{hd} {bm}-row blocks: operands read wrong: {bad or 'none'}; dQ elements misplaced: {wrong}, "
              f"every element placed: {covers}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
