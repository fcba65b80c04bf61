// Decode with a KV cache: the merge of the splits' partial rows (flash_decode.cuh describes the
// operation). With several splits per (sequence, kv head), each split CTA writes its packed rows as
// fp32 partial rows O_s (normalized) with their lse_s; the merge computes, per output row,
//     lse = m + ln l,  O = acc / l,   m = max_s lse_s,  l = sum_s e^(lse_s - m),  acc = sum_s e^(lse_s - m) O_s
// either inside the split kernel, by the last CTA of each group to finish (decode_merge_if_last), or in
// the combine kernel (flash_decode_combine.cuh), which shares decode_store_merged_row.
#pragma once

#include "decode_common.cuh"

namespace cuflash {

// Output row `row` = (b * nheads + h) * seqlen_q + i of a merge of the splits: this lane's columns
// [4 lane + 128 j, 4 lane + 128 j + 4) of acc / l in the output's dtype and, by lane 0, lse = m + ln l.
// A row no split saw (l == 0) gets O = 0 and lse = -inf.
template <bool kBF16, int kCC>
CUFLASH_DEVICE void decode_store_merged_row(const DecodeParams& p, i64 row, const float4 (&acc)[kCC], float m, float l,
                                            int lane) {
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
    const int i = static_cast<int>(row % p.seqlen_q);
    const i64 bh = row / p.seqlen_q;
    const int h = static_cast<int>(bh % p.nheads), b = static_cast<int>(bh / p.nheads);
    u16* g_o = static_cast<u16*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
    for (int j = 0; j < kCC; ++j) {
        const int c = 4 * lane + 128 * j;
        const u32 lo = pack2<kBF16>(acc[j].x * inv_l, acc[j].y * inv_l);
        const u32 hi = pack2<kBF16>(acc[j].z * inv_l, acc[j].w * inv_l);
        if (c < p.head_dim) g_o[c] = static_cast<u16>(lo & 0xffffu);
        if (c + 1 < p.head_dim) g_o[c + 1] = static_cast<u16>(lo >> 16);
        if (c + 2 < p.head_dim) g_o[c + 2] = static_cast<u16>(hi & 0xffffu);
        if (c + 3 < p.head_dim) g_o[c + 3] = static_cast<u16>(hi >> 16);
    }
    if (lane == 0 && p.lse != nullptr) p.lse[row] = l > 0.f ? m + __logf(l) : -kInf;
}

// Merge of the splits, by the CTA that finishes a group last (decode_merge_if_last):
//   lse = m + ln l,  O = acc / l,  with m = max_s lse_s, l = sum_s e^{lse_s - m}, acc = sum_s e^{lse_s - m} O_s.
// It runs at the very end of the kernel, where nothing hides its latency, so the partial rows are
// staged: every warp copies the partial rows it needs into the free K/V stages with cp.async, as
// many as fit, loads their lse meanwhile and waits once; the arithmetic then reads shared memory.
// (With register loads each lane has only a handful of 16-byte loads in flight and the L2 round trips
// queue up; index arithmetic per copy, or a shared-memory store between loads, also showed: a lone
// warp per scheduler runs this. A per-CTA timeline measured each on the H200: docs/history/decode.md.)
//   Rows: rows_valid packed rows, in rounds of kNWarps / team rows; a team of `team` warps shares a
//         row (team = kNWarps with one row, as in MHA decode, 2 with two or three rows, else 1). Warp
//         `sub` of a team stages and folds splits sub, sub + team, ... of its row, on its own; the
//         team's partial sums meet in shared memory at the end of the round.
//   Chunks: the splits of a round, staged up to capacity (DecodeMergeLayout::kCap partial rows) at a
//         time; a chunk is folded into the running (m, l, acc) with one max, one weight per split
//         and FMAs.
//   Lane l owns columns [4 l + 128 j, 4 l + 128 j + 4) of its row, j < kColChunks.
constexpr int kMergeLseBatch = 4;  // lse values per thread in flight while the merge stages a chunk

template <class Cfg>
struct DecodeMergeLayout {
    static constexpr int kColChunks = (Cfg::kHeadDim + 127) / 128;
    static constexpr int kRedFloats = kColChunks * 128 + 4;  // a warp's acc row, then m and l (16-byte rows)
    static constexpr int kTeamFloats = Cfg::kNWarps * kRedFloats;
    static constexpr int kRowFloats = Cfg::kHeadDim;  // a partial row: the whole bucket (partial_stride)
    static constexpr int kCap = (Cfg::kSmemPipeBytes / 4 - kTeamFloats) / (kRowFloats + 1);  // staged rows
    static_assert(kCap >= Cfg::kNWarps, "a chunk holds at least one split of every row of a round");
    static_assert(kMergeLseBatch * 32 >= kDecodeMaxSplits, "one batch of lse loads covers every split of a chunk");
};

// The running merge of one row, per lane: (m, l) and the lane's columns of acc.
template <int kColChunks>
struct DecodeMergeRow {
    float m = -kInf, l = 0.f;  // max lse so far (natural log), sum of e^{lse_s - m}
    float4 acc[kColChunks];

    // Rescale to a new max m_new >= m (nothing to rescale while m is -inf: l and acc are still 0).
    CUFLASH_DEVICE float rescale(float m_new) {
        const float c = m == -kInf ? 0.f : fast_exp2((m - m_new) * kLog2e);
        m = m_new;
        l *= c;
#pragma unroll
        for (int j = 0; j < kColChunks; ++j) acc[j] = make_float4(acc[j].x * c, acc[j].y * c, acc[j].z * c, acc[j].w * c);
        return c;
    }
    // acc += w * (this lane's columns of o, a row of kRowFloats); columns past the row stay 0 (the next
    // slot of staged rows may be another warp's, still being filled).
    template <int kRowFloats>
    CUFLASH_DEVICE void add(float w, const float* o, int lane) {
#pragma unroll
        for (int j = 0; j < kColChunks; ++j) {
            if (4 * lane + 128 * j >= kRowFloats) continue;
            const float4 v = *reinterpret_cast<const float4*>(o + 4 * lane + 128 * j);
            acc[j] = make_float4(fmaf(w, v.x, acc[j].x), fmaf(w, v.y, acc[j].y), fmaf(w, v.z, acc[j].z),
                                 fmaf(w, v.w, acc[j].w));
        }
    }
};

// The CTA's merge of packed rows [row0, row0 + rows_valid) of (b, hk). Every thread of the CTA calls
// it (it has block barriers); smem: the K/V stages (kSmemPipeBytes), free by now. The partial rows
// were written by other CTAs: they are read through L2 (cp.async.cg, ld.global.cg), never from L1.
template <class Cfg>
CUFLASH_DEVICE void decode_merge_rows(const DecodeParams& p, int b, int hk, int row0, int rows_valid, int n_splits,
                                      float* smem, int tid) {
    using Lay = DecodeMergeLayout<Cfg>;
    constexpr int kW = Cfg::kNWarps, kCC = Lay::kColChunks, kRowF = Lay::kRowFloats;
    constexpr int kChunks16 = kRowF / 4;  // 16-byte pieces of a partial row
    float* s_team = smem;                                   // [kW][kRedFloats]
    float* s_rows = smem + Lay::kTeamFloats;                // [kCap][kRowF]: staged partial rows
    float* s_w = s_rows + Lay::kCap * kRowF;                // [kCap]: their weights
    const int warp = tid / 32, lane = tid % 32;
    const int team = rows_valid >= kW ? 1 : (rows_valid >= 2 ? kW / 2 : kW);  // warps per row (divides kW)
    const int sub = warp % team, rows_per_round = kW / team;
    const i64 n_rows = (i64)p.batch * p.nheads * p.seqlen_q;
    const i64 split_stride = n_rows * p.partial_stride;  // floats from one split's partial rows to the next
    // Splits staged at once per row. Row slot k of a round (k = warp / team) owns the same area in
    // every round and chunk: with a warp per row nothing synchronizes the warps between rounds, so
    // a warp ahead by a round must not reach into another's area.
    const int per_chunk = min(n_splits, Lay::kCap / rows_per_round);
    // Rounds are uniform over the CTA (the team meeting below has block barriers).
    for (int r0 = 0; r0 < rows_valid; r0 += rows_per_round) {
        const int r = r0 + warp / team;  // this warp's row (>= rows_valid: none this round)
        i64 row = 0;
        if (r < rows_valid) {
            int i, h;
            decode_unpack_row(p, hk, row0 + r, i, h);
            row = decode_row_index(p, 0, b, h, i);
        }
        DecodeMergeRow<kCC> st;
#pragma unroll
        for (int j = 0; j < kCC; ++j) st.acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        // Each warp stages and folds only its own splits of its own row: from here to the team's
        // meeting below, its lanes synchronize among themselves only.
        if (r < rows_valid) {
            const int k = warp / team;
            const float* g_rows = p.o_partial + row * p.partial_stride;
            for (int s_lo = 0; s_lo < n_splits; s_lo += per_chunk) {
                const int n_s = min(per_chunk, n_splits - s_lo);
                // Row slot k's area: the staged partial row of split s_lo + s at rows_k[s * kRowF], its
                // weight at w_k[s] (the team's warps take disjoint s).
                float* rows_k = s_rows + k * per_chunk * kRowF;
                float* w_k = s_w + k * per_chunk;
                __syncwarp();  // this warp is done with its previous chunk
                for (int s = sub; s < n_s; s += team) {
                    const float* g = g_rows + (s_lo + s) * split_stride;
#pragma unroll
                    for (int c16 = lane; c16 < kChunks16; c16 += 32) {
                        cp_async_16(smem_u32(rows_k + s * kRowF + 4 * c16), g + 4 * c16, true);
                    }
                }
                cp_async_commit();
                // The lse values into registers while the rows are on their way (n_s <= 128 splits).
                float x[kMergeLseBatch];
#pragma unroll
                for (int u = 0; u < kMergeLseBatch; ++u) {
                    const int s = sub + team * (lane + 32 * u);
                    x[u] = s < n_s ? __ldcg(p.lse_partial + row + (s_lo + s) * n_rows) : -kInf;
                }
                // New max over this warp's splits of the chunk (s = sub + team t), then their weights.
                float m_c = -kInf;
#pragma unroll
                for (int u = 0; u < kMergeLseBatch; ++u) m_c = fmaxf(m_c, x[u]);
                m_c = decode_warp_max(m_c);
                const float m_new = fmaxf(st.m, m_c);
                st.rescale(m_new);
                float l_c = 0.f;
#pragma unroll
                for (int u = 0; u < kMergeLseBatch; ++u) {
                    const int s = sub + team * (lane + 32 * u);
                    const float w = x[u] == -kInf ? 0.f : fast_exp2((x[u] - m_new) * kLog2e);  // m_new finite if x is
                    if (s < n_s) w_k[s] = w;
                    l_c += w;
                }
                st.l += decode_warp_sum(l_c);
                cp_async_wait<0>();
                __syncwarp();  // the warp's staged rows and weights visible to all its lanes
                for (int s = sub; s < n_s; s += team) st.template add<kRowF>(w_k[s], rows_k + s * kRowF, lane);
            }
        }
        if (team > 1) {  // the team's partial sums meet in shared memory; its first warp finishes the row
            float* red = s_team + warp * Lay::kRedFloats;
#pragma unroll
            for (int j = 0; j < kCC; ++j) *reinterpret_cast<float4*>(red + 4 * lane + 128 * j) = st.acc[j];
            if (lane == 0) {
                red[Lay::kRedFloats - 4] = st.m;
                red[Lay::kRedFloats - 3] = st.l;
            }
            __syncthreads();
            if (sub == 0 && r < rows_valid) {
                for (int w = 1; w < team; ++w) {
                    const float* o = s_team + (warp + w) * Lay::kRedFloats;
                    const float m_w = o[Lay::kRedFloats - 4], l_w = o[Lay::kRedFloats - 3];
                    if (m_w == -kInf) continue;  // that warp's splits all saw no key
                    // (m_w, l_w, acc_w) joins like one more split of weight e^{m_w - m} and sums l_w, acc_w.
                    if (m_w > st.m) st.rescale(m_w);
                    const float c_w = fast_exp2((m_w - st.m) * kLog2e);
                    st.l = fmaf(c_w, l_w, st.l);
                    st.template add<kRowF>(c_w, o, lane);
                }
            }
            if (r0 + rows_per_round < rows_valid) __syncthreads();  // s_team read before the next round writes it
        }
        if (sub == 0 && r < rows_valid) decode_store_merged_row<Cfg::kIsBF16>(p, row, st.acc, st.m, st.l, lane);
    }
}

// End of a split CTA when num_splits > 1: count it in the group (sequence b, kv head hk, row block
// rb), and if it is the last of the group's num_splits CTAs to finish, merge the group's packed rows
// [row0, row0 + rows_valid) (decode_merge_rows). The counter returns to 0 for the next launch. The
// fence before the count publishes this CTA's partial rows; the last CTA sees every other count, so
// it reads every partial row after it was written (threadfence reduction, CUDA programming guide).
// smem: the K/V stages, s_flag: one int, both free shared memory by now.
template <class Cfg>
CUFLASH_DEVICE void decode_merge_if_last(const DecodeParams& p, int b, int hk, int rb, int row0, int rows_valid,
                                         int n_splits, float* smem, int* s_flag, int tid) {
    __threadfence();  // this thread's partial rows reach device scope before the count
    __syncthreads();  // ... for every thread of the CTA; and everyone is done with the smem reused below
    if (tid == 0) {
        int* counter = p.split_counters + ((i64)b * p.nheads_kv + hk) * p.num_row_blocks + rb;
        const bool last = atomicAdd(counter, 1) == n_splits - 1;
        if (last) *counter = 0;  // every split of the group has counted: reset for the next launch
        *s_flag = last;
    }
    __syncthreads();
    if (!*s_flag) return;
    __threadfence();
    decode_merge_rows<Cfg>(p, b, hk, row0, rows_valid, n_splits, smem, tid);
}

}  // namespace cuflash
