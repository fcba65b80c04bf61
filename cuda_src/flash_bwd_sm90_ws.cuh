// FlashAttention-2 backward main kernel on Hopper, warp specialized (sm_90a only): TMA loads by a
// producer warp, wgmma by two consumer warpgroups, each softmax step overlapped with a GEMM in flight.
//
// Computes exactly what flash_bwd_sm90_pair_kernel (flash_bwd_sm90.cuh) computes, with the same
// tiles, math, masks, variants and outputs: dK and dV of the CTA's 128 keys and its dQ part, added to
// dq_accum with fp32 vector reductions in flash_bwd_convert_kernel's layout. Read that file's header
// first; the preprocess and convert kernels run around this one unchanged.
//
// Grid  (ceil(seqlen_k / 128), nheads_kv, batch): CTA (n, hk, b) owns keys [128 n, 128 n + 128) and
//       walks every (query head of the group, query block of 64 rows) that sees them (BwdQueryWalk).
//       Packed varlen batches: (scheduler slots over the packed keys, nheads_kv, 1), varlen.cuh.
// Roles (384 threads: warpgroup 0 produces, warpgroups 1 and 2 consume)
//   producer   warp 0, lane 0 issues every load: K and V once (cp.async.bulk.tensor, 128-byte swizzle),
//              then per query block Q and dO (tensor maps) and its lse_log2 and D rows (plain bulk
//              copies) into a ring of kStages slots. Each slot has a "full" mbarrier (its bytes
//              landed) and an "empty" one (all 256 consumer threads are done with it). The producer
//              warpgroup hands its registers to the consumers (setmaxnreg: 24 + 2 x 240 per thread).
//   consumers  warpgroup c (c = 0, 1) owns keys [64 c, 64 c + 64) of the CTA; warp i of it key rows
//              64 c + 16 i + (g, g + 8) of every accumulator (g = lane / 4). dK, dV accumulate in
//              registers for the whole walk.
//
//   shared memory:  K, V [128 x d] | Q[kStages], dO[kStages] [64 x d] | dS^T[2] [128 x 64] |
//                   (lse_log2, D)[kStages] [64 + 64 floats] | mbarriers
//                   (tiles in 64-column atoms of the 128-byte swizzle, 1024-byte aligned)
//
// Schedule of one query block (per consumer warpgroup; groups complete in issue order):
//
//   wait slot full | issue S^T = K_c Q^T | issue dP^T = V_c dO^T | wait S^T (dP^T in flight)
//   P^T = exp2(S^T scale_log2 - lse_log2) -> A fragments  | issue dV_c += P^T dO
//   wait dP^T (dV in flight) | dS^T = P^T (dP^T - D) -> A fragments and dS^T[it % 2] in smem
//   issue dK_c += dS^T Q | named barrier of the 256 consumer threads (both halves of dS^T written)
//   issue dQ[:, c d/2 ..] = dS K over all 128 keys | wait all | slot empty | dq_accum += dQ part
//
// so the exponentials run while the tensor cores compute dP^T, and dS^T while they compute dV. dS^T
// is double buffered: a warpgroup writes buffer (it + 2) % 2 only after the barrier of block it + 1,
// which the other warpgroup reaches after its dQ of block it completed.
//
// Preconditions (cuflash/plan/backward.py picks this kernel only then): sm_90a; head-dim bucket 64 or
// 128; head_dim % 8 == 0 and rows / strides 16-byte aligned (TMA's rules). Deterministic mode orders
// the dQ additions of a query block by key block (turn counters), as flash_bwd_kernel does.
// Tensor maps (cuflash/tma.py): q, k, v, dout as (batch, rows, heads, head_dim) (packed varlen
// batches: one batch of the packed rows, SeqInfo::tma_*), boxes of 64 columns x 64 (q, dout) or 128
// (k, v) rows; rows past the tensor arrive as zeros, as the cp.async kernel's zero-filled loads. A
// packed sequence's last key and query tiles bring the next rows of the packed tensor instead: the
// consumers zero them in shared memory (clear_tail) before any wgmma reads them.
#pragma once

#include "flash_bwd_sm90.cuh"  // Sm90BwdConfig, bwd_p_pair, BwdModTile, dq / dK dV epilogues
#include "tma.cuh"

namespace cuflash {

// The kernel's only argument (`const __grid_constant__`): four tensor maps, then the backward's
// parameter block at byte 512 (cuflash/backward.py writes the BwdParams record there).
struct BwdTmaParams {
    TmaDesc tma_q, tma_k, tma_v, tma_do;
    BwdParams p;
};
static_assert(sizeof(BwdTmaParams) == 512 + (sizeof(BwdParams) + 63) / 64 * 64, "p starts at byte 512, after the maps");

template <int kHeadDim_, bool kIsBF16_, bool kIsCausal_, int kMods_ = 0, int kStages_ = 2>
struct Sm90WsBwdConfig : Sm90BwdConfig<kHeadDim_, 128, kIsBF16_, kIsCausal_, kMods_> {
    using Base = Sm90BwdConfig<kHeadDim_, 128, kIsBF16_, kIsCausal_, kMods_>;
    static constexpr int kStages = kStages_;
    static constexpr int kNThreads = 384;
    static constexpr int kProducerRegs = 24;   // 24 x 128 + 240 x 256 = 64512 <= 65536
    static constexpr int kConsumerRegs = 240;
    static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 168 * 384, "setmaxnreg: within the launch's registers");
    static constexpr int kRowsBytes = 2 * Base::kBlockM * 4;  // lse_log2 and D of one query block
    static constexpr int kBarriers = 1 + 2 * kStages;          // K/V full; full, empty per slot
    static constexpr int kSmemBytes = 1024 + 2 * Base::kTileBytesKV + 2 * kStages * Base::kTileBytesQ +
                                      2 * Base::kTileBytesDS + kStages * kRowsBytes + 8 * kBarriers;
    static_assert(!Base::kSplit, "head dims 64 and 128 (256 runs the split cp.async kernel)");
    static_assert(kStages >= 2 && kStages <= 4, "a ring of 2 to 4 query-block slots");
};

// Plain (non-tensor) bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from
// global memory into shared memory; its bytes complete on mbarrier `bar`.
CUFLASH_DEVICE void bulk_load(u32 s_dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(s_dst),
                 "l"(reinterpret_cast<unsigned long long>(src)), "r"(bytes), "r"(bar)
                 : "memory");
}

template <class Cfg>
CUFLASH_DEVICE void flash_bwd_sm90_ws_kernel(const BwdTmaParams& P) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim, kStages = Cfg::kStages;
    constexpr bool kBF16 = Cfg::kIsBF16;
    constexpr int kNB = kBlockM / 8, kQSteps = kBlockM / 16, kDSteps = kHeadDim / 16, kKeySteps = kBlockN / 16;
    constexpr int kAtoms = kHeadDim / 64;
    const BwdParams& p = P.p;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wg = warp / 4;
    const BwdKeyBlock<Cfg> blk = BwdKeyBlock<Cfg>::make(p);  // key block n_block of sequence seq (varlen.cuh)
    if constexpr (BwdKeyBlock<Cfg>::kVarlen) {
        if (blk.skip) return;  // a spare slot of the scheduler (uniform over the CTA)
    }
    const auto& seq = blk.seq;
    const int n_block = blk.n_block, hk = blockIdx.y;
    const int n0 = n_block * kBlockN;
    const int offset = seq.len_k(p) - seq.len_q(p);  // causal: query i sees keys j <= i + offset
    const BwdQueryWalk walk = blk.walk(p, hk);
    const int n_iters = walk.n_iters;
    using Mask = AttnMask<Cfg::kIsCausal, Cfg::kMods>;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 s_k = (smem_u32(smem_raw) + 1023u) & ~1023u;  // the swizzle pattern starts on 1024 bytes
    const u32 s_v = s_k + Cfg::kTileBytesKV;
    const u32 s_q0 = s_v + Cfg::kTileBytesKV;
    const u32 s_do0 = s_q0 + kStages * Cfg::kTileBytesQ;
    const u32 s_ds0 = s_do0 + kStages * Cfg::kTileBytesQ;
    const u32 s_rows0 = s_ds0 + 2 * Cfg::kTileBytesDS;
    const u32 s_bar = s_rows0 + kStages * Cfg::kRowsBytes;
    const u32 full_kv = s_bar;
    auto full = [&](int s) { return s_bar + 8u * (1 + s); };
    auto empty = [&](int s) { return s_bar + 8u * (1 + kStages + s); };

    if (tid == 0) {
        mbar_init(full_kv, 1);
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), 256);  // every consumer thread (see the arrive)
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------- producer ----------------
        regs_release<Cfg::kProducerRegs>();
        if (warp != 0 || lane != 0 || n_iters == 0) return;
        tma_prefetch(&P.tma_q);
        tma_prefetch(&P.tma_do);
        mbar_arrive_expect_tx(full_kv, 2 * Cfg::kTileBytesKV);
#pragma unroll
        for (int a = 0; a < kAtoms; ++a) {
            tma_load_4d(s_k + a * kBlockN * 128, &P.tma_k, full_kv, 64 * a, seq.tma_k_row(n0), hk, seq.tma_batch());
            tma_load_4d(s_v + a * kBlockN * 128, &P.tma_v, full_kv, 64 * a, seq.tma_k_row(n0), hk, seq.tma_batch());
        }
        for (int it = 0; it < n_iters; ++it) {
            const int st = it % kStages;
            const int h = walk.head(it), m0 = walk.m_block(it) * kBlockM, row = seq.tma_q_row(m0);
            mbar_wait(empty(st), ((it / kStages) & 1) ^ 1);
            mbar_arrive_expect_tx(full(st), 2 * Cfg::kTileBytesQ + Cfg::kRowsBytes);
#pragma unroll
            for (int a = 0; a < kAtoms; ++a) {
                tma_load_4d(s_q0 + st * Cfg::kTileBytesQ + a * kBlockM * 128, &P.tma_q, full(st), 64 * a, row, h, seq.tma_batch());
                tma_load_4d(s_do0 + st * Cfg::kTileBytesQ + a * kBlockM * 128, &P.tma_do, full(st), 64 * a, row, h,
                            seq.tma_batch());
            }
            // lse_log2 and D rows are padded to whole query blocks (and 256-byte aligned): no bounds.
            const i64 row0 = seq.scratch_row(p, h) + m0;
            bulk_load(s_rows0 + st * Cfg::kRowsBytes, p.lse_log2 + row0, kBlockM * 4, full(st));
            bulk_load(s_rows0 + st * Cfg::kRowsBytes + kBlockM * 4, p.dsum + row0, kBlockM * 4, full(st));
        }
        return;
    }

    // ---------------- consumers ----------------
    regs_claim<Cfg::kConsumerRegs>();
    const int cwg = wg - 1, cwarp = warp - 4;
    const int g = lane / 4, t = lane % 4;
    const float* rows_ptr = reinterpret_cast<const float*>(smem_raw + (s_rows0 - smem_u32(smem_raw)));

    // Descriptors as in flash_bwd_sm90_pair_kernel (K-major A / B step 32 bytes per k-step inside an
    // atom; N-major B and M-major A: 64-column atoms rows * 128 bytes apart, 2048 bytes per k-step).
    const u64 desc_k_w = sw128_desc(s_k + cwg * 64 * 128, 16);
    const u64 desc_v_w = sw128_desc(s_v + cwg * 64 * 128, 16);
    const u64 desc_q0 = sw128_desc(s_q0, 16);
    const u64 desc_do0 = sw128_desc(s_do0, 16);
    const u64 desc_q0_n = sw128_desc(s_q0, kBlockM * 128);
    const u64 desc_do0_n = sw128_desc(s_do0, kBlockM * 128);
    const u64 desc_ds0 = sw128_desc(s_ds0, kBlockN * 128);
    const u64 desc_k_dq = sw128_desc(s_k + (cwg * Cfg::kDQCols / 64) * kBlockN * 128 + (cwg * Cfg::kDQCols % 64) * 2, kBlockN * 128);
    constexpr u64 kQStage = Cfg::kTileBytesQ >> 4, kDsBuf = Cfg::kTileBytesDS >> 4;

    float acc_dk[kHeadDim / 2], acc_dv[kHeadDim / 2];
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    const int key_local = cwg * 64 + (cwarp % 4) * 16 + g;  // this thread's key rows: key_local, key_local + 8

    // Varlen: rows of a tile past its sequence's keys or queries arrived from the rows that follow in
    // the packed tensor (the next sequence, rows no sequence owns: any bits, NaN included). Their P is
    // 0, but 0 * NaN is not: zero them (whole 128-byte lines of every atom, whatever the swizzle) before
    // any wgmma reads the tile; both consumer warpgroups then meet at named barrier 2. Only a sequence's
    // last key block and last query block stick out. Plain batches need nothing: rows past the tensor
    // arrive as zeros.
    auto clear_tail = [&](u32 s_tile0, u32 s_tile1, int rows, int r0) {
        if constexpr (BwdKeyBlock<Cfg>::kVarlen) {
            if (r0 >= rows) return;  // uniform over the consumers
            const int lines = (rows - r0) * kAtoms;
            for (int i = tid - 128; i < 2 * lines * 8; i += 256) {
                const int line = (i / 8) % lines, a = line % kAtoms, r = r0 + line / kAtoms;
                unsigned char* tile = smem_raw + ((i < lines * 8 ? s_tile0 : s_tile1) - smem_u32(smem_raw));
                *reinterpret_cast<uint4*>(tile + a * rows * 128 + r * 128 + (i % 8) * 16) = make_uint4(0, 0, 0, 0);
            }
            fence_proxy_async_smem();  // generic stores -> the async proxy (wgmma reads, later TMA writes)
            named_sync(2, 256);
        }
    };

    if (n_iters > 0) {
        mbar_wait(full_kv, 0);
        clear_tail(s_k, s_v, kBlockN, seq.len_k(p) - n0);
    }
    for (int it = 0; it < n_iters; ++it) {
        const int st = it % kStages, buf = it & 1;
        const int h = walk.head(it);
        const int m0 = walk.m_block(it) * kBlockM;
        const u32 s_ds = s_ds0 + buf * Cfg::kTileBytesDS;
        mbar_wait(full(st), (it / kStages) & 1);
        clear_tail(s_q0 + st * Cfg::kTileBytesQ, s_do0 + st * Cfg::kTileBytesQ, kBlockM, seq.len_q(p) - m0);

        // ---- issue S^T = K_c Q^T and dP^T = V_c dO^T as two groups
        float S[kNB][4], dP[kNB][4];
        float(&s_acc)[kBlockM / 2] = reinterpret_cast<float(&)[kBlockM / 2]>(S);
        float(&dp_acc)[kBlockM / 2] = reinterpret_cast<float(&)[kBlockM / 2]>(dP);
        wgmma_fence();
        wgmma_ss_kmajor<kBlockM, kBF16, kDSteps, kBlockN, kBlockM>(s_acc, desc_k_w, desc_q0 + st * kQStage);
        wgmma_commit();
        wgmma_ss_kmajor<kBlockM, kBF16, kDSteps, kBlockN, kBlockM>(dp_acc, desc_v_w, desc_do0 + st * kQStage);
        wgmma_commit();
        const BwdModTileOf<Mask, kNB> mods(p, seq, h, m0, n0 + key_local - g, lane);  // (variants) while they run
        wgmma_wait<1>();  // S^T landed; dP^T may still run
        wgmma_fence_operands(s_acc);

        // ---- P^T (fp32 kept in S for dS; variants: P^T (1 - tanh^2)) and its A fragments
        const float* s_lse = rows_ptr + st * 2 * kBlockM;
        const float* s_d = s_lse + kBlockM;
        const bool need_mask = bwd_sm90_needs_mask<Cfg>(p, seq, n0, m0, offset);
        u32 a_p[kQSteps][4], a_ds[kQSteps][4];
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
            const int col = 8 * nb + 2 * t;
            const float2 l2 = *reinterpret_cast<const float2*>(s_lse + col);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float pv[2], pd[2];
                bool kept[2];
                bwd_sm90_probs<Cfg>(p, mods, S[nb][2 * r], S[nb][2 * r + 1], l2, need_mask, nb, r, n0 + key_local + 8 * r,
                                    m0 + col, m0 + 2 * t, offset, seq.len_k(p), pv, pd, kept);
                S[nb][2 * r] = pd[0];  // (kept for dS^T)
                S[nb][2 * r + 1] = pd[1];
                a_p[nb / 2][2 * (nb % 2) + r] = pack2<kBF16>(pv[0], pv[1]);
            }
        }

        // ---- dV += P^T dO (in flight while dS^T is formed)
        wgmma_fence();
        wgmma_rs_ksteps<kHeadDim, kBF16>(acc_dv, a_p, desc_do0_n + st * kQStage);
        wgmma_commit();
        wgmma_wait<1>();  // dP^T landed; dV may still run
        wgmma_fence_operands(dp_acc);

        // ---- dS^T = P^T (dP^T - D[i]), to A fragments and smem (variants: P^T (1 - tanh^2) (Z dP^T / q - D[i]),
        //      q the keep probability)
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
            const int col = 8 * nb + 2 * t;
            const float2 dd = *reinterpret_cast<const float2*>(s_d + col);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const u32 ds = pack2<kBF16>(bwd_sm90_ds<Cfg>(mods, S[nb][2 * r], dP[nb][2 * r], dd.x, mods.kept(nb, r, 0)),
                                            bwd_sm90_ds<Cfg>(mods, S[nb][2 * r + 1], dP[nb][2 * r + 1], dd.y, mods.kept(nb, r, 1)));
                a_ds[nb / 2][2 * (nb % 2) + r] = ds;
                const int row = key_local + 8 * r;  // 16-byte chunk nb of the row, swizzled by the row
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_ds + row * 128 + ((nb ^ (row % 8)) * 16) + 4 * t), "r"(ds));
            }
        }

        // ---- dK += dS^T Q, then dQ part = dS K over the CTA's keys once both halves of dS^T are in smem
        wgmma_fence();
        wgmma_rs_ksteps<kHeadDim, kBF16>(acc_dk, a_ds, desc_q0_n + st * kQStage);
        wgmma_commit();
        fence_proxy_async_smem();
        named_sync(1, 256);
        float acc_dq[Cfg::kDQCols / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeySteps; ++kk) {
            wgmma_ss<Cfg::kDQCols, kBF16, 1, 1>(acc_dq, desc_ds0 + buf * kDsBuf + static_cast<u64>(kk * 128),
                                                desc_k_dq + static_cast<u64>(kk * 128), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(acc_dq);
        wgmma_fence_operands(acc_dv);
        wgmma_fence_operands(acc_dk);
        wgmma_fence_operands(a_p);
        wgmma_fence_operands(a_ds);
        // Q, dO and the lse_log2 / D rows of this slot are no longer read: every consumer thread arrives
        // for its own reads (and its writes of clear_tail's zero rows), so the producer's next refill is
        // ordered after each of them. (One arrive per warp after __syncwarp orders them too, but
        // compute-sanitizer racecheck follows an arrive only for the arriving thread's own accesses.)
        mbar_arrive(empty(st));

        // Deterministic mode: the key blocks that visit this query block add their dQ parts in key-block
        // order (the turn counter, as flash_bwd_kernel): one consumer thread waits for this CTA's turn,
        // named barrier 3 holds the other 255 until then, and after every warp's additions (fenced) the
        // turn passes on. CTAs wait only on lower key blocks, which launch earlier: no deadlock.
        int* turn = p.dq_turn + seq.turn_row(p, h) + walk.m_block(it);
        if (p.deterministic) {
            if (tid == 128) {
                while (ld_acquire_gpu(turn) != blk.dq_turn(p, m0)) {
                }
            }
            named_sync(3, 256);
        }
        bwd_sm90_add_dq<Cfg::kDQCols>(p, acc_dq, seq, h, m0, cwarp, lane);
        if (p.deterministic) {
            __threadfence();  // this thread's additions are visible device-wide ...
            named_sync(3, 256);  // ... for every consumer thread, before the turn passes on
            if (tid == 128) red_release_gpu_add(turn, 1);
        }
    }

    bwd_sm90_store_dkdv<kBF16, kHeadDim>(p, acc_dk, acc_dv, seq, hk, n0 + key_local, 0, t);
}

}  // namespace cuflash
