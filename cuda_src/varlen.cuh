// Packed variable-length batches (varlen): where a CTA's sequence lives, and the tile scheduler that
// gives every real (sequence, row tile) pair a CTA without the host knowing the lengths.
//
// Layout (flash-attn's): sequence b owns the packed rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q,
// o, dout, dq and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k, v, dk, dv; its first seqused_k[b] keys
// are used when seqused_k is given. lse is (nheads, total_q). The parameter block then holds
// batch = the number of sequences, seqlen_q / seqlen_k = the packed totals (total_q, total_k); batch
// strides are not read. Every cu_seqlens value is clamped into [0, total] as it is read, so a wrong
// prefix sum gives wrong numbers but never an access outside the tensors (the host checks them when
// it can see them, or with check=True).
//
// Tile scheduler. The tiles of `block` rows of sequence b take the grid indices [f(b), f(b + 1)),
//     f(b) = cu[b] / block + b,
// which holds ceil(len_b / block) tiles (floor(a + l) - floor(a) + 1 >= ceil(l)) and at most one spare
// slot per sequence; the grid is f(batch) <= total / block + batch CTAs long. A CTA finds its sequence
// as the largest b with f(b) <= blockIdx.x, f being increasing: a 32-way search by one warp, one
// coalesced load per level (one level up to 32 sequences, two up to 1024). Spare slots exit at once.
// The backward's per-row scratch (lse_log2, D, dq_accum) uses the same map: sequence b's query tile m
// owns padded rows [(f(b) + m) block, ... + block), so sequences never share a scratch tile.
#pragma once

#include "params.h"
#include "primitives.cuh"

namespace cuflash {

// cu[b] clamped into [0, total].
CUFLASH_DEVICE int varlen_start(const int* cu, int b, int total) { return min(max(__ldg(cu + b), 0), total); }

// The sequence that owns grid tile t: the largest b in [0, batch) with cu[b] / block + b <= t (clamped
// cu). Every lane of the calling warp must call it (ballot over the whole warp).
CUFLASH_DEVICE int varlen_find_seq(const int* cu, int batch, int total, int block, int t) {
    const int lane = threadIdx.x % 32;
    int span = 1;
    while (span < batch) span *= 32;  // batch <= 2^24 (the host checks): no overflow
    int lo = 0;                       // f(lo) <= t holds for valid prefix sums (f(0) = 0)
    for (; span > 1; span /= 32) {
        const int step = span / 32;
        const int idx = lo + lane * step;
        const bool ok = idx < batch && varlen_start(cu, idx, total) / block + idx <= t;
        // f increasing: the lanes that pass are a prefix. (A bad cu[0] >= block can leave none passing: stay at
        // lo, whose slot then lies before its first tile and is skipped, never a sequence -1.)
        lo += max(__popc(__ballot_sync(0xffffffffu, ok)) - 1, 0) * step;
    }
    return lo;
}

// Element offset of key row n0 of a sequence (the first row of a key tile, which never crosses a page:
// page_size is a multiple of the key tile of every kernel planned for paged K/V: plan.fit_key_tile) from the kv head's key 0: packed rows (bt_row null), or
// page bt_row[n0 / page_size] clamped into the pages, slot n0 % page_size (paged K/V).
CUFLASH_DEVICE i64 varlen_kv_tile_off(const ModParams& m, const int* bt_row, int n0, i64 batch_stride, i64 row_stride) {
    if (bt_row == nullptr) return n0 * row_stride;
    const int blk = n0 / m.page_size;
    const int page = min(max(__ldg(bt_row + blk), 0), m.num_pages - 1);
    return page * batch_stride + (n0 - blk * m.page_size) * row_stride;
}

// Where the sequence of a CTA lives. Plain batches: batch b (blockIdx.z), lengths and offsets from the
// parameter block, so every expression is the one the kernels used before varlen existed.
template <bool kVarlen>
struct SeqInfo {
    int b;
    CUFLASH_DEVICE explicit SeqInfo(int b_) : b(b_) {}
    template <class P>
    CUFLASH_DEVICE int len_q(const P& p) const { return p.seqlen_q; }
    template <class P>
    CUFLASH_DEVICE int len_k(const P& p) const { return p.seqlen_k; }
    // Element offset of the sequence's first row in a q-shaped / k-shaped tensor.
    CUFLASH_DEVICE i64 q_off(i64 batch_stride, i64 /*row_stride*/) const { return b * batch_stride; }
    CUFLASH_DEVICE i64 k_off(i64 batch_stride, i64 /*row_stride*/) const { return b * batch_stride; }
    // Tensor-map coordinates (cuflash/tma.py's (batch, rows, heads, head_dim) maps): the batch index and
    // the rows of query row m0 / key row n0 of the sequence.
    CUFLASH_DEVICE int tma_batch() const { return b; }
    CUFLASH_DEVICE int tma_q_row(int m0) const { return m0; }
    CUFLASH_DEVICE int tma_k_row(int n0) const { return n0; }
    // Index of the sequence's first lse value of head h ((batch, nheads, seqlen_q) layout).
    template <class P>
    CUFLASH_DEVICE i64 lse_row(const P& p, int h) const { return ((i64)b * p.nheads + h) * p.seqlen_q; }
    // Backward scratch: first padded row of head h (lse_log2, D, dq_accum rows) and first turn counter.
    CUFLASH_DEVICE i64 scratch_row(const BwdParams& p, int h) const { return ((i64)b * p.nheads + h) * p.seqlen_q_pad; }
    CUFLASH_DEVICE i64 turn_row(const BwdParams& p, int h) const { return ((i64)b * p.nheads + h) * p.num_m_blocks; }
};

// Packed batches: sequence b's rows from the prefix sums (clamped: see the header).
template <>
struct SeqInfo<true> {
    int b;
    int q_start, k_start;  // first packed row of q and of k
    int seqlen_q, seqlen_k;
    int q_tile0;           // f(b) of the block_m scheduler: the sequence's first scratch tile (backward)
    const int* bt_row;     // paged K/V (forward): the sequence's block_table row, or null

    template <class P>
    CUFLASH_DEVICE SeqInfo(const P& p, int b_, int block_m) : b(b_) {
        const ModParams& m = p.mod;
        q_start = varlen_start(m.cu_seqlens_q, b, p.seqlen_q);
        seqlen_q = varlen_start(m.cu_seqlens_q, b + 1, p.seqlen_q) - q_start;
        k_start = varlen_start(m.cu_seqlens_k, b, p.seqlen_k);
        seqlen_k = varlen_start(m.cu_seqlens_k, b + 1, p.seqlen_k) - k_start;
        seqlen_q = max(seqlen_q, 0);
        seqlen_k = max(seqlen_k, 0);
        if (m.seqused_k != nullptr) seqlen_k = min(seqlen_k, max(__ldg(m.seqused_k + b), 0));
        q_tile0 = q_start / block_m + b;
        bt_row = nullptr;
        if (m.block_table != nullptr) {  // paged: keys live in pages, not at packed rows
            bt_row = m.block_table + b * m.block_table_stride;
            k_start = 0;
            seqlen_k = min(seqlen_k, m.page_capacity);
        }
    }

    template <class P>
    CUFLASH_DEVICE int len_q(const P&) const { return seqlen_q; }
    template <class P>
    CUFLASH_DEVICE int len_k(const P&) const { return seqlen_k; }
    CUFLASH_DEVICE i64 q_off(i64, i64 row_stride) const { return q_start * row_stride; }
    CUFLASH_DEVICE i64 k_off(i64, i64 row_stride) const { return k_start * row_stride; }
    // Tensor-map coordinates: one batch of the packed rows (packed K/V: bt_row is null).
    CUFLASH_DEVICE int tma_batch() const { return 0; }
    CUFLASH_DEVICE int tma_q_row(int m0) const { return q_start + m0; }
    CUFLASH_DEVICE int tma_k_row(int n0) const { return k_start + n0; }
    template <class P>
    CUFLASH_DEVICE i64 lse_row(const P& p, int h) const { return (i64)h * p.seqlen_q + q_start; }
    CUFLASH_DEVICE i64 scratch_row(const BwdParams& p, int h) const { return (i64)h * p.seqlen_q_pad + (i64)q_tile0 * p.block_m; }
    CUFLASH_DEVICE i64 turn_row(const BwdParams& p, int h) const { return (i64)h * p.num_m_blocks + q_tile0; }
};

// A CTA's row tile under the scheduler: sequence seq.b, tile m_block (of `block` rows) of its query
// rows, or of its key rows when keys is set; or none (skip: a spare slot, or past the sequence).
// reverse: the sequence's heaviest (last) tiles take its first slots (causal).
template <class P>
struct VarlenTile {
    SeqInfo<true> seq;
    int m_block;
    bool skip;
    CUFLASH_DEVICE VarlenTile(const P& p, bool keys, int block, int block_m_scratch, bool reverse)
        : VarlenTile(p, keys, block, block_m_scratch, reverse, (int)blockIdx.x) {}
    // t: the grid slot (blockIdx.x, or a persistent CTA's work index).
    CUFLASH_DEVICE VarlenTile(const P& p, bool keys, int block, int block_m_scratch, bool reverse, int t)
        : seq(p, varlen_find_seq(keys ? p.mod.cu_seqlens_k : p.mod.cu_seqlens_q, p.batch, keys ? p.seqlen_k : p.seqlen_q,
                                 block, t),
              block_m_scratch) {
        const int start = keys ? seq.k_start : seq.q_start;
        const int len = keys ? seq.seqlen_k : seq.seqlen_q;
        const int slot = t - (start / block + seq.b);
        const int n = (len + block - 1) / block;
        m_block = reverse ? n - 1 - slot : slot;
        skip = m_block < 0 || m_block >= n;
    }
};

}  // namespace cuflash
