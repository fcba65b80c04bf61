// Decode with a KV cache: the combine kernel, the merge of the splits as a kernel of its own, launched
// after the split kernel where a group has too many partial rows for its last CTA to merge them
// quickly (cuflash/plan/decode.py decode_separate_combine). flash_decode.cuh describes the operation,
// decode_merge.cuh the merge.
#pragma once

#include "decode_merge.cuh"

namespace cuflash {

// Combine kernel: one CTA (kDecodeThreads) per output row `row` = (b * nheads + h) * seqlen_q + i merges
// its num_splits partial rows: lse = m + ln l, O = acc / l with m = max_s lse_s, w_s = e^{lse_s - m},
// l = sum_s w_s, acc = sum_s w_s O_s. Thread s loads lse_s (num_splits <= kDecodeThreads); warp w adds
// splits w, w + 4, ...; lane l owns columns [4 l + 128 j, 4 l + 128 j + 4) of the row (j < kCC). The
// partial rows of a batch of kBatch splits per warp are all loaded into registers before the first is
// used, and the first batch is on its way while the lse values give the weights: two L2 round trips
// per CTA where each warp's splits fit one batch, one more per further batch. Two variants
// (cuflash/plan/decode_kernels.py DecodeCombineSpec, cuflash/plan/decode.py decode_combine_lean): wide, kBatch = 32 / kCC (at hd <= 128
// every split in one batch; ~185 registers, 2 CTAs per SM), for calls of few output rows and many
// splits; lean, kBatch = 4 (one batch up to 16 splits; ~52 registers, 8+ CTAs per SM), where the
// splits fit that one batch or the rows are too many for one wave of the wide one. Each warp adds
// its splits in the same order in both (a padded slot adds 0 * 0), so both give the same bits.
template <int kHeadDim, bool kIsBF16, int kBatch>
CUFLASH_DEVICE void flash_decode_combine_kernel(const DecodeParams& p) {
    constexpr int kW = kDecodeThreads / 32;
    constexpr int kCC = (kHeadDim + 127) / 128;  // float4 columns per lane
    static_assert(kBatch >= 1 && kBatch * kCC <= 32, "splits in flight per warp: at most 32 float4 registers");
    static_assert(kDecodeMaxSplits <= kDecodeThreads, "one lse per thread");
    __shared__ float s_w[kDecodeMaxSplits];          // weight of each split
    __shared__ float s_max[kW];
    __shared__ __align__(16) float s_acc[kW - 1][kCC * 128];  // warps 1.. hand their sums to warp 0
    grid_dependency_wait();  // the split kernel's partial rows are complete and visible
    grid_launch_dependents();
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const i64 row = blockIdx.x;
    const i64 n_rows = (i64)p.batch * p.nheads * p.seqlen_q;
    const int n_splits = p.num_splits;
    const int n_own = (n_splits - warp + kW - 1) / kW;  // this warp's splits: warp + kW q, q < n_own
    const float* g_row = p.o_partial + row * p.partial_stride;
    const i64 split_stride = n_rows * p.partial_stride;

    float4 v[kBatch][kCC];
    auto load = [&](int q0) {  // own splits [q0, q0 + kBatch) into v (zeros past the last)
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
#pragma unroll
            for (int j = 0; j < kCC; ++j) {
                const int c = 4 * lane + 128 * j;
                const bool ok = q0 + u < n_own && c < kHeadDim;
                v[u][j] = ok ? __ldcg(reinterpret_cast<const float4*>(g_row + (warp + kW * (q0 + u)) * split_stride + c))
                             : make_float4(0.f, 0.f, 0.f, 0.f);
            }
    };
    load(0);
    const float x = tid < n_splits ? __ldcg(p.lse_partial + row + tid * n_rows) : -kInf;
    const float m_warp = decode_warp_max(x);
    if (lane == 0) s_max[warp] = m_warp;
    __syncthreads();
    float m = s_max[0];
#pragma unroll
    for (int w = 1; w < kW; ++w) m = fmaxf(m, s_max[w]);
    if (tid < n_splits) s_w[tid] = x == -kInf ? 0.f : fast_exp2((x - m) * kLog2e);  // m finite if x is
    __syncthreads();

    float4 acc[kCC];
#pragma unroll
    for (int j = 0; j < kCC; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q0 = 0; q0 < n_own; q0 += kBatch) {
        if (q0 > 0) load(q0);
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const float w = q0 + u < n_own ? s_w[warp + kW * (q0 + u)] : 0.f;
#pragma unroll
            for (int j = 0; j < kCC; ++j)
                acc[j] = make_float4(fmaf(w, v[u][j].x, acc[j].x), fmaf(w, v[u][j].y, acc[j].y),
                                     fmaf(w, v[u][j].z, acc[j].z), fmaf(w, v[u][j].w, acc[j].w));
        }
    }
    if (warp > 0) {
#pragma unroll
        for (int j = 0; j < kCC; ++j) *reinterpret_cast<float4*>(&s_acc[warp - 1][4 * lane + 128 * j]) = acc[j];
    }
    __syncthreads();
    if (warp != 0) return;
    float l_lane = 0.f;
    for (int s = lane; s < n_splits; s += 32) l_lane += s_w[s];
    const float l = decode_warp_sum(l_lane);
#pragma unroll
    for (int j = 0; j < kCC; ++j)
#pragma unroll
        for (int w = 1; w < kW; ++w) {
            const float4 o = *reinterpret_cast<const float4*>(&s_acc[w - 1][4 * lane + 128 * j]);
            acc[j] = make_float4(acc[j].x + o.x, acc[j].y + o.y, acc[j].z + o.z, acc[j].w + o.w);
        }
    decode_store_merged_row<kIsBF16>(p, row, acc, m, l, lane);
}
}  // namespace cuflash
