// Hopper's asynchronous machinery (sm_90a), for the warp-specialized kernels: tensor-memory-accelerator
// (TMA) tile loads and stores, mbarriers that track them, register reallocation between warpgroups, and named
// barriers among a subset of the CTA's warps. Inline PTX only (PTX ISA 8.0+), no CUDA header.
//
//   TmaDesc        a CUtensorMap (128 bytes, 64-byte aligned), built on the host by the driver's
//                  cuTensorMapEncodeTiled (cuflash/tma.py) and passed inside the kernel's
//                  `const __grid_constant__` parameter block, so its address is a parameter-space
//                  address that TMA may read.
//   mbarrier       a 64-bit shared-memory barrier with an arrival count and a transaction (byte) count;
//                  a phase completes when both reach zero. A TMA load adds its bytes on completion
//                  (complete_tx), the producer announces them first (arrive.expect_tx). Waiters name the
//                  phase by its parity: use k of a ring slot of depth S waits for parity (k / S) & 1,
//                  and a fresh barrier reads as if the phase of parity 1 had completed (so a producer's
//                  first pass over an "empty" ring waits for parity ((k / S) & 1) ^ 1 and does not block).
#pragma once

#include "primitives.cuh"

namespace cuflash {

struct alignas(64) TmaDesc {
    unsigned long long words[16];
};

// ---- mbarrier ----
CUFLASH_DEVICE void mbar_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Make initialized barriers visible to the async proxy (TMA) and to the other threads (with a CTA barrier after).
CUFLASH_DEVICE void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival plus `bytes` more expected from asynchronous copies in this phase.
CUFLASH_DEVICE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
CUFLASH_DEVICE void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Block until the phase of parity `parity` has completed (acquire: the copies it tracked are visible).
CUFLASH_DEVICE void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "MBAR_WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra MBAR_WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// ---- TMA ----
CUFLASH_DEVICE void tma_prefetch(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(desc)) : "memory");
}
// One box of a rank-4 tensor map at coordinates (c0 innermost: column, c1 row, c2 head, c3 batch)
// into shared memory at s_dst; its bytes complete on mbarrier `bar`. Elements outside the tensor are
// written as zeros (and still counted).
CUFLASH_DEVICE void tma_load_4d(u32 s_dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(s_dst),
        "l"(reinterpret_cast<unsigned long long>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// One box of shared memory at s_src (the tensor map's box, in its swizzled layout) to a rank-4 tensor
// map at coordinates (c0 column, c1 row, c2 head, c3 batch); elements outside the tensor are not written.
// The issuing thread's bulk async-group: tma_store_commit closes it, tma_store_wait_read<N> waits until
// at most N of its groups still read shared memory (the source may then be written again). Generic
// writes of the source must be fenced to the async proxy (fence_proxy_async_smem) before the store.
CUFLASH_DEVICE void tma_store_4d(const TmaDesc* desc, u32 s_src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
        ::"l"(reinterpret_cast<unsigned long long>(desc)), "r"(s_src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
CUFLASH_DEVICE void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
CUFLASH_DEVICE void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// ---- thread block clusters (sm_90): CTAs launched together that reach each other's shared memory ----
// This CTA's rank in its cluster.
CUFLASH_DEVICE u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Every thread of the cluster (exited ones count as arrived): writes before it are visible after it,
// in every CTA of the cluster (e.g. mbarriers initialized before a peer signals them).
CUFLASH_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// One arrival on the mbarrier at this CTA's offset `bar` in the shared memory of cluster CTA `rank`,
// with the default semantics (release at CTA scope, as CUTLASS's cluster barriers arrive). Enough for
// the one hazard it guards, write after read: the caller's reads of the slot (wgmma operands) have
// completed (wgmma.wait_group) before it arrives, and nothing it wrote is read by the other CTA.
// (.release.cluster compiles to MEMBAR.ALL.GPU per arrival: the forward ran at 0.70x.)
CUFLASH_DEVICE void mbar_arrive_cluster(u32 bar, u32 rank) {
    asm volatile(
        "{\n"
        ".reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
        "}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
}
// tma_load_4d delivered to every CTA of the cluster in `cta_mask` (bit r: rank r), at the same
// shared-memory offset s_dst in each, each completing its bytes on its own mbarrier at offset `bar`.
CUFLASH_DEVICE void tma_load_4d_multicast(u32 s_dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3,
                                          unsigned short cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(s_dst),
        "l"(reinterpret_cast<unsigned long long>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(cta_mask)
        : "memory");
}

// ---- registers: move them from the producer warpgroup to the consumers (every warp of a warpgroup) ----
template <int kRegs>
CUFLASH_DEVICE void regs_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
CUFLASH_DEVICE void regs_claim() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- named barriers (id 0 is __syncthreads); `threads` counts every thread taking part ----
CUFLASH_DEVICE void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
CUFLASH_DEVICE void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace cuflash
