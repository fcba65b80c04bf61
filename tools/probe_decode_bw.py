"""How fast can a decode kernel stream a KV cache on this GPU? Read-only bandwidth probes on the
decode layout, with no attention math, to separate the memory side from the rest of the kernel.

    python tools/probe_decode_bw.py [--shapes 8,32768,32,3 ...] [--probes ring_t64_s2_o3 ...] [--repeats 10]

A shape is batch,cache_len,kv_heads,splits; K and V are (batch, cache_len, kv_heads, 128) bf16. The
`flat*` probes read both buffers front to back; every other probe walks them as a decode kernel
does: CTA (split, kv head, sequence) reads the 256-byte rows of its keys of one head, one tile of
keys at a time, into shared memory (or registers). Probe names:
    flat            grid-stride 16-byte ld.global.nc over both buffers (the read ceiling)
    flatcp_oO       cp.async 16-byte chunks of contiguous 16 KB blocks of K and V, 2-stage ring
    ring_tT_sS_oO   cp.async by all 128 threads into an S-stage ring of T-key (K, V) tiles, one
                    barrier per tile (the split kernel's first scheme, padded rows); _hk: kv head
                    fastest in the grid; _ns: no key split (one CTA per head and sequence)
    ringw[_kK]_sS[_cC]_oO the split kernel's current memory side: each warp loads its 16 (K) keys of every
                    64-key (4 K) tile (swizzled unpadded rows), its own S-stage ring, refilled before
                    waiting; _cC: C cycles of busy work per tile before the refill (the math's place)
    altw_kK_oO      FA2's order on swizzled rows, per warp: a K and a V buffer of K keys, each its own
                    commit group, K(t + 1) issued when K(t) is used and V(t + 1) when V(t) is
    tmaw_sS_oO      as ringw, with TMA: each warp's lane 0 loads its 16 keys as four 2 KB boxes
                    (cp.async.bulk.tensor, 128-byte swizzle) on a full mbarrier per stage (sm_90)
    tma_sS_oO       thread 0 loads whole 64-key tiles by TMA (four 8 KB boxes), full / empty mbarriers
    alt_tT_oO       one T-key K buffer and one V buffer, loaded alternately (FlashAttention-2's scheme:
                    the V load flies while S would be computed, the next K load during P V)
    ldg_tT_oO       16-byte ld.global.nc into registers, all of a thread's loads of a tile in flight
    ringd_sS_oO     ringw with dynamic work: every warp claims 16-key units of its head from a counter
                    shared by the head's CTAs, so a slow warp takes fewer (balancing within a head)
    ringsteal_sS_oO ringw whose warps, once their split is used up, take their shares of the other
                    splits' tiles of the head from the back (claims on counters, one tile ahead)
    ringw2_sS_oO    ringw with two adjacent kv heads per CTA (512 contiguous bytes per key), 32-key
                    tiles; grid (2 splits, kv heads / 2, b)
    bulk_sS         one producer warp, cp.async.bulk per 256-byte row, full / empty mbarriers (sm_90)
O is the CTAs per SM the probe's shared memory allows (set by padding its dynamic shared memory).
Prints KV TB/s (2 * b * L * h * 128 * 2 bytes / time) per probe and shape, medians of CUDA-event times.
"""
import argparse
import statistics

SOURCE = r"""
typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
__device__ __forceinline__ uint4 ldg16(const void* p) {
    uint4 x;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "l"(p));
    return x;
}

extern "C" __global__ void flat(const uint4* a, const uint4* b, long long n, float* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 x = ldg16(a + i), y = ldg16(b + i);
        acc.x ^= x.x ^ y.x; acc.y ^= x.y ^ y.y; acc.z ^= x.z ^ y.z; acc.w ^= x.w ^ y.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[0] = 1.f;
}

// Contiguous 16 KB blocks of K and of V (n16: 16-byte chunks per buffer), 2-stage cp.async ring.
extern "C" __global__ void __launch_bounds__(128) flatcp(const uint4* a, const uint4* b, long long n16, float* sink) {
    extern __shared__ __align__(128) unsigned char smem_flat[];
    uint4* s = (uint4*)smem_flat;  // [2][2][1024]
    const long long blocks = n16 / 1024;
    auto issue = [&](long long blk, int st) {
        if (blk < blocks)
            for (int c = threadIdx.x; c < 1024; c += 128) {
                cp16(smem_u32(s + (st * 2 + 0) * 1024 + c), a + blk * 1024 + c, true);
                cp16(smem_u32(s + (st * 2 + 1) * 1024 + c), b + blk * 1024 + c, true);
            }
        commit();
    };
    int st = 0;
    issue(blockIdx.x, 0);
    u32 acc = 0;
    for (long long blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        wait_group<0>();
        __syncthreads();
        issue(blk + gridDim.x, st ^ 1);
        acc ^= s[st * 2048 + threadIdx.x].x;
        st ^= 1;
    }
    if (acc == 0x12345678u) sink[0] = 1.f;
}

struct Walk {  // CTA -> its keys of one head
    const u16 *gk, *gv;
    long long row;
    int n0, n1;
    __device__ Walk(const u16* K, const u16* V, int L, int H, int kps, bool hk_first) {
        const int split = hk_first ? blockIdx.y : blockIdx.x, hk = hk_first ? blockIdx.x : blockIdx.y, b = blockIdx.z;
        n0 = split * kps;
        n1 = min(L, n0 + kps);
        row = (long long)H * 128;
        gk = K + (long long)b * L * row + hk * 128;
        gv = V + (long long)b * L * row + hk * 128;
    }
    template <int kTile>
    __device__ void load(const u16* g, u16* s, int t) const {
        for (int c = threadIdx.x; c < kTile * 16; c += 128) {
            const int r = c / 16, col = (c % 16) * 8, n = n0 + t * kTile + r;
            const bool ok = n < n1;
            cp16(smem_u32(s + r * 136 + col), ok ? g + n * row + col : g, ok);
        }
    }
};

template <int kTile, int kStages, bool kHkFirst>
__device__ void ring_probe(const u16* K, const u16* V, int L, int H, int kps, float* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    u16* sk = (u16*)smem;
    u16* sv = sk + kStages * kTile * 136;
    const Walk w(K, V, L, H, kps, kHkFirst);
    const int tiles = (w.n1 - w.n0 + kTile - 1) / kTile;
    auto issue = [&](int t, int s) {
        if (t < tiles) {
            w.load<kTile>(w.gk, sk + s * kTile * 136, t);
            w.load<kTile>(w.gv, sv + s * kTile * 136, t);
        }
        commit();
    };
    for (int s = 0; s < kStages - 1; ++s) issue(s, s);
    float acc = 0.f;
    for (int t = 0; t < tiles; ++t) {
        wait_group<kStages - 2>();
        __syncthreads();
        issue(t + kStages - 1, (t + kStages - 1) % kStages);
        const int s = t % kStages;
        acc += (float)sk[(s * kTile + threadIdx.x % kTile) * 136] + (float)sv[(s * kTile + threadIdx.x % kTile) * 136];
    }
    if (acc == 1234.5f) sink[0] = acc;
}

template <int kTile>
__device__ void alt_probe(const u16* K, const u16* V, int L, int H, int kps, float* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    u16* sk = (u16*)smem;
    u16* sv = sk + kTile * 136;
    const Walk w(K, V, L, H, kps, false);
    const int tiles = (w.n1 - w.n0 + kTile - 1) / kTile;
    float acc = 0.f;
    if (tiles > 0) w.load<kTile>(w.gk, sk, 0);
    commit();
    for (int t = 0; t < tiles; ++t) {
        wait_group<0>();
        __syncthreads();  // K(t) landed; V(t - 1) consumed
        w.load<kTile>(w.gv, sv, t);
        commit();
        acc += (float)sk[(threadIdx.x % kTile) * 136];
        wait_group<0>();
        __syncthreads();  // V(t) landed; K(t) consumed
        if (t + 1 < tiles) w.load<kTile>(w.gk, sk, t + 1);
        commit();
        acc += (float)sv[(threadIdx.x % kTile) * 136];
    }
    if (acc == 1234.5f) sink[0] = acc;
}

template <int kTile>
__device__ void ldg_probe(const u16* K, const u16* V, int L, int H, int kps, float* sink) {
    const Walk w(K, V, L, H, kps, false);
    const int tiles = (w.n1 - w.n0 + kTile - 1) / kTile;
    constexpr int kPer = kTile * 16 / 128;
    u32 acc = 0;
    for (int t = 0; t < tiles; ++t) {
        uint4 xk[kPer], xv[kPer];
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
            const int c = threadIdx.x + 128 * i, r = c / 16, col = (c % 16) * 8, n = min(w.n0 + t * kTile + r, w.n1 - 1);
            xk[i] = ldg16(w.gk + n * w.row + col);
            xv[i] = ldg16(w.gv + n * w.row + col);
        }
#pragma unroll
        for (int i = 0; i < kPer; ++i) acc ^= xk[i].x ^ xv[i].y;
    }
    if (acc == 0x12345678u) sink[0] = 1.f;
}

__device__ __forceinline__ void mbar_init(u32 a, int count) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count)); }
__device__ __forceinline__ void mbar_expect_arrive(u32 a, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 a) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory"); }
__device__ __forceinline__ void mbar_wait(u32 a, int parity) {
    asm volatile("{\n.reg .pred P1;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n@!P1 bra WAIT;\n}\n"
                 ::"r"(a), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_row(u32 dst, const void* src, u32 bytes, u32 mbar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(mbar) : "memory");
}

template <int kStages>
__device__ void bulk_probe(const u16* K, const u16* V, int L, int H, int kps, float* sink) {
    constexpr int kTile = 64;
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* bars = (unsigned long long*)smem;  // full[kStages], empty[kStages]
    u16* sk = (u16*)(smem + 256);
    u16* sv = sk + kStages * kTile * 136;
    const Walk w(K, V, L, H, kps, false);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tiles = (w.n1 - w.n0 + kTile - 1) / kTile;
    if (threadIdx.x < kStages) {
        mbar_init(smem_u32(bars + threadIdx.x), 1);
        mbar_init(smem_u32(bars + kStages + threadIdx.x), 3);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    if (warp == 0) {
        for (int t = 0; t < tiles; ++t) {
            const int s = t % kStages;
            if (t >= kStages) mbar_wait(smem_u32(bars + kStages + s), ((t / kStages) - 1) & 1);
            const int rows = min(kTile, w.n1 - (w.n0 + t * kTile));
            if (lane == 0) mbar_expect_arrive(smem_u32(bars + s), rows * 256 * 2);
            __syncwarp();
            for (int r = lane; r < rows; r += 32) {
                const long long n = w.n0 + t * kTile + r;
                bulk_row(smem_u32(sk + (s * kTile + r) * 136), w.gk + n * w.row, 256, smem_u32(bars + s));
                bulk_row(smem_u32(sv + (s * kTile + r) * 136), w.gv + n * w.row, 256, smem_u32(bars + s));
            }
        }
    } else {
        float acc = 0.f;
        for (int t = 0; t < tiles; ++t) {
            const int s = t % kStages;
            mbar_wait(smem_u32(bars + s), (t / kStages) & 1);
            acc += (float)sk[(s * kTile + lane) * 136] + (float)sv[(s * kTile + lane) * 136];
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_u32(bars + kStages + s));
        }
        if (acc == 1234.5f) sink[0] = acc;
    }
}

// A warp's own cp.async ring of kStages tiles: fill every stage, then per tile refill the stage of the
// tile before (once the warp is done with it, __syncwarp), wait for this tile and hand its stage to
// use(t, stage). issue(t, stage) commits one group per call, past the last tile too.
template <int kStages, class Issue, class Use>
__device__ __forceinline__ void warp_ring(int tiles, Issue&& issue, Use&& use) {
    for (int s = 0; s < kStages; ++s) issue(s, s);
    for (int t = 0; t < tiles; ++t) {
        if (t > 0) {
            __syncwarp();
            issue(t - 1 + kStages, (t - 1) % kStages);
        }
        wait_group<kStages - 1>();
        __syncwarp();
        use(t, t % kStages);
    }
}

// The current split kernel's memory side: each warp loads and reads its own kKW keys of every
// 4 kKW-key tile (unpadded 256-byte rows, chunk c of row r at c ^ (r % 8)), a kStages ring refilled
// before the next tile is waited for, __syncwarp only (kKW = 16: the split kernel's 64-key tiles).
template <int kStages, int kKW = 16, int kSpin = 0>
__device__ void ringw_probe(const u16* K, const u16* V, int L, int H, int kps, float* sink) {
    constexpr int kT = 4 * kKW;  // keys per tile
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u16* sk = (u16*)smem + warp * kKW * 128;  // stage s at + s * kT * 128 (K), V after the K stages
    u16* sv = sk + kStages * kT * 128;
    const Walk w(K, V, L, H, kps, false);
    const int tiles = (w.n1 - w.n0 + kT - 1) / kT;
    auto issue = [&](int t, int s) {
        if (t < tiles)
            for (int c = lane; c < kKW * 16; c += 32) {
                const int r = c / 16, ch = c % 16, n = w.n0 + t * kT + warp * kKW + r;
                const bool ok = n < w.n1;
                const int off = (s * kT + r) * 128 + ((ch & 8) | ((ch ^ r) & 7)) * 8;
                cp16(smem_u32(sk + off), ok ? w.gk + n * w.row + ch * 8 : w.gk, ok);
                cp16(smem_u32(sv + off), ok ? w.gv + n * w.row + ch * 8 : w.gv, ok);
            }
        commit();
    };
    float acc = 0.f;
    warp_ring<kStages>(tiles, issue, [&](int, int s) {
        acc += (float)sk[(s * kT + lane % 16) * 128] + (float)sv[(s * kT + lane % 16) * 128];
        if (kSpin > 0) {  // stands in for the attention math on the tile: kSpin cycles before the refill
            const long long t0 = clock64();
            while (clock64() - t0 < kSpin) {
            }
        }
    });
    if (acc == 1234.5f) sink[0] = acc;
}

// FlashAttention-2's order per warp, on swizzled rows: one K buffer and one V buffer of the warp's
// kKW keys of each 4 kKW-key tile, each its own commit group: K(t + 1) is issued once K(t) is used
// (while V(t) is still on its way), V(t + 1) once V(t) is used. 1-2 buffers in flight per warp.
template <int kKW>
__device__ void altw_probe(const u16* K, const u16* V, int L, int H, int kps, float* sink) {
    constexpr int kT = 4 * kKW;
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u16* sk = (u16*)smem + warp * kKW * 128;
    u16* sv = sk + kT * 128;
    const Walk w(K, V, L, H, kps, false);
    const int tiles = (w.n1 - w.n0 + kT - 1) / kT;
    auto issue = [&](const u16* g, u16* s_dst, int t) {
        if (t < tiles)
            for (int c = lane; c < kKW * 16; c += 32) {
                const int r = c / 16, ch = c % 16, n = w.n0 + t * kT + warp * kKW + r;
                const bool ok = n < w.n1;
                cp16(smem_u32(s_dst + r * 128 + ((ch & 8) | ((ch ^ r) & 7)) * 8), ok ? g + n * w.row + ch * 8 : g, ok);
            }
        commit();
    };
    issue(w.gk, sk, 0);
    issue(w.gv, sv, 0);
    float acc = 0.f;
    for (int t = 0; t < tiles; ++t) {
        wait_group<1>();  // K(t)
        __syncwarp();
        acc += (float)sk[(lane % 16) * 128];
        __syncwarp();
        issue(w.gk, sk, t + 1);
        wait_group<1>();  // V(t)
        __syncwarp();
        acc += (float)sv[(lane % 16) * 128];
        __syncwarp();
        issue(w.gv, sv, t + 1);
    }
    if (acc == 1234.5f) sink[0] = acc;
}

// K and V of kv head blockIdx.y of sequence blockIdx.z, and a warp's loads of 16 of its keys into its
// 16 rows of a 64-key stage (swizzled as ringw's): keys [n0, n0 + 16), those >= L zero-filled.
struct HeadRows {
    const u16 *gk, *gv;
    long long row;  // elements from one key to the next
    // ... and this warp's K and V rows of stage 0 (16 rows of 64 per stage; the V stages after the K ones).
    __device__ HeadRows(const u16* K, const u16* V, int L, int H, unsigned char* smem, int stages, u16*& sk, u16*& sv)
        : row((long long)H * 128) {
        gk = K + (long long)blockIdx.z * L * row + blockIdx.y * 128;
        gv = V + (long long)blockIdx.z * L * row + blockIdx.y * 128;
        sk = (u16*)smem + threadIdx.x / 32 * 16 * 128;
        sv = sk + stages * 64 * 128;
    }
    __device__ void load16(u16* sk, u16* sv, int st, int n0, int L, int lane) const {
        for (int c = lane; c < 16 * 16; c += 32) {
            const int r = c / 16, ch = c % 16, n = n0 + r;
            const bool ok = n < L;
            const int off = (st * 64 + r) * 128 + ((ch & 8) | ((ch ^ r) & 7)) * 8;
            cp16(smem_u32(sk + off), ok ? gk + n * row + ch * 8 : gk, ok);
            cp16(smem_u32(sv + off), ok ? gv + n * row + ch * 8 : gv, ok);
        }
    }
};

// As ringw_probe, but every warp is a worker that takes 16-key units of its (kv head, sequence)
// dynamically: the gridDim.x CTAs of a head share its units through a counter (sink + 32 as ints, one
// 128-byte line per head, zeroed before the launch). Worker w = 4 split + warp starts with the static
// units w + j W (j < kStages, W = 4 gridDim.x), then claims kStages W + atomicAdd(counter, 1), one
// claim ahead of its use (lane 0; the other lanes get it by shuffle). A slow warp takes fewer units.
template <int kStages>
__device__ void ringd_probe(const u16* K, const u16* V, int L, int H, int kps, float* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u16 *sk, *sv;
    const HeadRows head(K, V, L, H, smem, kStages, sk, sv);
    int* counter = (int*)(sink + 32) + 32 * (blockIdx.z * H + blockIdx.y);
    const int units = (L + 15) / 16, W = 4 * gridDim.x, w = 4 * blockIdx.x + warp;
    auto issue = [&](int u, int s) {
        if (u < units) head.load16(sk, sv, s, u * 16, L, lane);
        commit();
    };
    int q[kStages];  // q[j]: the unit of step k + j
#pragma unroll
    for (int j = 0; j < kStages; ++j) q[j] = w + j * W;
    int pending = 0;
    if (lane == 0 && q[kStages - 1] < units) pending = atomicAdd(counter, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) issue(q[s], s);
    float acc = 0.f;
    int s = 0, done = 0;
    for (int k = 0; q[0] < units; ++k) {
        if (k > 0) {
            __syncwarp();
            const int u_new = q[kStages - 1] < units ? kStages * W + __shfl_sync(0xffffffffu, pending, 0) : units;
            if (lane == 0 && u_new < units) pending = atomicAdd(counter, 1);
#pragma unroll
            for (int j = 0; j + 1 < kStages; ++j) q[j] = q[j + 1];
            q[kStages - 1] = u_new;
            issue(u_new, s == 0 ? kStages - 1 : s - 1);
            if (q[0] >= units) break;
        }
        wait_group<kStages - 1>();
        __syncwarp();
        acc += (float)sk[(s * 64 + lane % 16) * 128] + (float)sv[(s * 64 + lane % 16) * 128];
        s = s + 1 == kStages ? 0 : s + 1;
        done += 1;
    }
    if (lane == 0) atomicAdd(counter + 1, done);  // units read, summed per head: checked on the host
    if (acc == 1234.5f) sink[0] = acc;
}

// As ringw_probe, plus stealing at the end: warp w of split s takes its 16-key shares of the split's
// tiles front to back by claims on a counter of (sequence, head, split, w) -- one 64-bit word: the
// front claims in the high half, the back claims in the low half; a claim is valid while front +
// back < the split's tiles -- and once its own split is used up, takes shares w of the other splits
// of its head from their back ends. Same loads and order as ringw while no one steals. Counters at
// sink + 32 (zeroed before each launch), 4 words per (split, w); the shares each warp read are summed
// in the word after, checked on the host.
template <int kStages>
__device__ void ringsteal_probe(const u16* K, const u16* V, int L, int H, int kps, float* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u16 *sk, *sv;
    const HeadRows head(K, V, L, H, smem, kStages, sk, sv);
    const int S = gridDim.x, n_tiles = (L + 63) / 64, T = kps / 64;
    unsigned long long* ctr = (unsigned long long*)(sink + 32) + 4 * ((long long)(blockIdx.z * H + blockIdx.y) * S * 4);
    auto word = [&](int split) { return ctr + 4 * (split * 4 + warp); };
    auto split_tiles = [&](int split) { return max(0, min(T, n_tiles - split * T)); };
    int victim = 0;  // 0: own split, then blockIdx.x + victim (mod S) from the back; S: nothing left
    unsigned long long pending = 0;  // lane 0: the claim in flight on the current victim
    auto request = [&]() {
        if (victim < S && lane == 0) pending = atomicAdd(word((blockIdx.x + victim) % S), victim == 0 ? (1ull << 32) : 1ull);
    };
    // The next tile of this warp: the claim in flight (one tile ahead), or claims on the next victims
    // while the current one is used up; then the next claim goes out.
    auto claim = [&]() -> int {
        while (victim < S) {
            const int sp = (blockIdx.x + victim) % S;
            const unsigned long long old = __shfl_sync(0xffffffffu, pending, 0);
            const int f = (int)(old >> 32), bk = (int)(old & 0xffffffffu), cnt = split_tiles(sp);
            if (f + bk < cnt) {
                const int tile = sp * T + (victim == 0 ? f : cnt - 1 - bk);
                request();
                return tile;
            }
            ++victim;
            request();
        }
        return -1;
    };
    request();
    auto issue = [&](int tile, int st) {
        if (tile >= 0) head.load16(sk, sv, st, tile * 64 + warp * 16, L, lane);
        commit();
    };
    int q[kStages];  // tiles of the ring's stages, in use order (-1: none)
#pragma unroll
    for (int j = 0; j < kStages; ++j) {
        q[j] = claim();
        issue(q[j], j);
    }
    float acc = 0.f;
    int st = 0, done = 0;
    while (q[0] >= 0) {
        wait_group<kStages - 1>();
        __syncwarp();
        acc += (float)sk[(st * 64 + lane % 16) * 128] + (float)sv[(st * 64 + lane % 16) * 128];
        done += 1;
        __syncwarp();
        const int next = claim();
#pragma unroll
        for (int j = 0; j + 1 < kStages; ++j) q[j] = q[j + 1];
        q[kStages - 1] = next;
        issue(next, st);  // the stage just used takes the tile kStages on
        st = st + 1 == kStages ? 0 : st + 1;
    }
    if (lane == 0) atomicAdd(word(blockIdx.x) + 1, (unsigned long long)done);
    if (acc == 1234.5f) sink[0] = acc;
}

// As ringw_probe with two kv heads per CTA (heads 2 blockIdx.y and 2 blockIdx.y + 1, adjacent in
// memory): each key's row is 512 contiguous bytes; tiles of 32 keys keep ringw's 16 KB per K stage
// (each warp loads 8 keys of both heads).
template <int kStages>
__device__ void ringw2_probe(const u16* K, const u16* V, int L, int H, int kps, float* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    u16* sk = (u16*)smem + warp * 8 * 256;  // stage s at + s * 32 * 256 (K), V after the K stages
    u16* sv = sk + kStages * 32 * 256;
    const long long row = (long long)H * 128;
    const u16* gk = K + (long long)blockIdx.z * L * row + 2 * blockIdx.y * 128;
    const u16* gv = V + (long long)blockIdx.z * L * row + 2 * blockIdx.y * 128;
    const int n0 = blockIdx.x * kps, n1 = min(L, n0 + kps);
    const int tiles = (n1 - n0 + 31) / 32;
    auto issue = [&](int t, int s) {
        if (t < tiles)
            for (int c = lane; c < 8 * 32; c += 32) {
                const int r = c / 32, ch = c % 32, n = n0 + t * 32 + warp * 8 + r;
                const bool ok = n < n1;
                const int off = (s * 32 + r) * 256 + ch * 8;
                cp16(smem_u32(sk + off), ok ? gk + n * row + ch * 8 : gk, ok);
                cp16(smem_u32(sv + off), ok ? gv + n * row + ch * 8 : gv, ok);
            }
        commit();
    };
    float acc = 0.f;
    warp_ring<kStages>(tiles, issue, [&](int, int s) {
        acc += (float)sk[(s * 32 + lane % 8) * 256] + (float)sv[(s * 32 + lane % 8) * 256];
    });
    if (acc == 1234.5f) sink[0] = acc;
}

// TMA (cp.async.bulk.tensor) with 128-byte swizzle. Tensor maps (in global memory) over K or V as
// (d = 128, kv head, b * L rows), boxes of 64 elements (128 bytes) x 1 head x R rows.
__device__ __forceinline__ void tma3(u32 dst, const void* map, int c0, int c1, int c2, u32 mbar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(mbar) : "memory");
}

// Each warp a private ring of its 16 keys (4 boxes of 16 rows per tile), one full barrier per
// stage, refilled after __syncwarp: no cross-warp sync at all.
template <int kStages>
__device__ void tmaw_probe(const void* mk, const void* mv, int L, int H, int kps, float* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 base = (smem_u32(smem) + 1024 + 1023) & ~1023u;  // barriers below, data 1024-aligned
    const u32 bars = smem_u32(smem) + warp * kStages * 8;
    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int n0 = split * kps, n1 = min(L, n0 + kps), tiles = (n1 - n0 + 63) / 64;
    if (lane == 0)
        for (int s = 0; s < kStages; ++s) mbar_init(bars + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    auto slot = [&](int s) { return base + (u32)((s * 4 + warp) * 8192); };  // K lo, K hi, V lo, V hi: 2 KB each
    auto issue = [&](int t, int s) {
        if (lane == 0 && t < tiles) {
            const u32 bar = bars + 8 * s, dst = slot(s);
            const int row = b * L + n0 + t * 64 + warp * 16;
            mbar_expect_arrive(bar, 8192);
            tma3(dst, mk, 0, hk, row, bar);
            tma3(dst + 2048, mk, 64, hk, row, bar);
            tma3(dst + 4096, mv, 0, hk, row, bar);
            tma3(dst + 6144, mv, 64, hk, row, bar);
        }
    };
    for (int s = 0; s < kStages; ++s) issue(s, s);
    float acc = 0.f;
    for (int t = 0; t < tiles; ++t) {
        if (t > 0) {
            __syncwarp();
            issue(t - 1 + kStages, (t - 1) % kStages);
        }
        const int s = t % kStages;
        mbar_wait(bars + 8 * s, (t / kStages) & 1);
        u16 x;
        asm volatile("ld.shared.u16 %0, [%1];" : "=h"(x) : "r"(slot(s) + lane * 256));
        acc += (float)x;
    }
    if (acc == 1234.5f) sink[0] = acc;
}

// Thread 0 loads whole 64-key tiles (4 boxes of 64 rows) into a kStages ring; full barriers (1
// arrival + bytes) and empty barriers (one arrival per warp).
template <int kStages>
__device__ void tma_probe(const void* mk, const void* mv, int L, int H, int kps, float* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 base = (smem_u32(smem) + 1024 + 1023) & ~1023u;
    const u32 full = smem_u32(smem), empty = full + 8 * kStages;
    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int n0 = split * kps, n1 = min(L, n0 + kps), tiles = (n1 - n0 + 63) / 64;
    if (threadIdx.x == 0)
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 4);
        }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    auto issue = [&](int t, int s) {
        const u32 bar = full + 8 * s, dst = base + (u32)(s * 32768);
        const int row = b * L + n0 + t * 64;
        mbar_expect_arrive(bar, 32768);
        tma3(dst, mk, 0, hk, row, bar);
        tma3(dst + 8192, mk, 64, hk, row, bar);
        tma3(dst + 16384, mv, 0, hk, row, bar);
        tma3(dst + 24576, mv, 64, hk, row, bar);
    };
    if (threadIdx.x == 0)
        for (int s = 0; s < kStages && s < tiles; ++s) issue(s, s);
    float acc = 0.f;
    for (int t = 0; t < tiles; ++t) {
        if (threadIdx.x == 0 && t > 0 && t - 1 + kStages < tiles) {
            const int s = (t - 1) % kStages;
            mbar_wait(empty + 8 * s, ((t - 1) / kStages) & 1);
            issue(t - 1 + kStages, s);
        }
        const int s = t % kStages;
        mbar_wait(full + 8 * s, (t / kStages) & 1);
        u16 x;
        asm volatile("ld.shared.u16 %0, [%1];" : "=h"(x) : "r"(base + (u32)(s * 32768) + threadIdx.x * 256));
        acc += (float)x;
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * s);
    }
    if (acc == 1234.5f) sink[0] = acc;
}

#define PROBE(name, fn) \
    extern "C" __global__ void __launch_bounds__(128) name(const u16* K, const u16* V, int L, int H, int kps, float* sink) { \
        (fn)(K, V, L, H, kps, sink); \
    }
"""

#: The probe kernels SOURCE instantiates (extern "C" name -> the templated body it calls).
KERNELS = {
    "ring_t64_s2": "ring_probe<64, 2, false>",
    "ring_t64_s3": "ring_probe<64, 3, false>",
    "ring_t64_s2_hk": "ring_probe<64, 2, true>",
    "ring_t128_s2": "ring_probe<128, 2, false>",
    "ring_t32_s4": "ring_probe<32, 4, false>",
    "alt_t64": "alt_probe<64>",
    "alt_t128": "alt_probe<128>",
    "ldg_t64": "ldg_probe<64>",
    "ldg_t32": "ldg_probe<32>",
    "bulk_s2": "bulk_probe<2>",
    "ringw_s2": "ringw_probe<2>",
    "ringw_s3": "ringw_probe<3>",
    "ringw_s1": "ringw_probe<1>",
    "ringw_s2_c300": "ringw_probe<2, 16, 300>",
    "ringw_s2_c600": "ringw_probe<2, 16, 600>",
    "ringw_s2_c1200": "ringw_probe<2, 16, 1200>",
    "ringw_s3_c600": "ringw_probe<3, 16, 600>",
    "ringw_s3_c1200": "ringw_probe<3, 16, 1200>",
    "ringw_k32_s1": "ringw_probe<1, 32>",
    "ringw_k32_s2": "ringw_probe<2, 32>",
    "altw_k32": "altw_probe<32>",
    "altw_k16": "altw_probe<16>",
    "ringd_s2": "ringd_probe<2>",
    "ringd_s3": "ringd_probe<3>",
    "ringw2_s2": "ringw2_probe<2>",
    "ringsteal_s2": "ringsteal_probe<2>",
    "ringsteal_s3": "ringsteal_probe<3>",
    "tmaw_s2": "tmaw_probe<2>",
    "tmaw_s3": "tmaw_probe<3>",
    "tmaw_s4": "tmaw_probe<4>",
    "tma_s2": "tma_probe<2>",
    "tma_s3": "tma_probe<3>",
    "tma_s4": "tma_probe<4>",
}
SOURCE += "".join(f"PROBE({name}, ({body}))\n" for name, body in KERNELS.items())


# name -> (kernel, shared memory the kernel needs, CTAs per SM to pad to (0: as many as fit), grid)
# grid: "split" (splits, h, b), "hk" (h, splits, b), "nosplit" (1, h, b), "flat"
PROBES = {
    "flat": ("flat", 0, 0, "flat"),
    "flatcp_o3": ("flatcp", 65536, 3, "flat"),
    "ring_t64_s2_o3": ("ring_t64_s2", 69632, 3, "split"),
    "ring_t64_s2_o2": ("ring_t64_s2", 69632, 2, "split"),
    "ring_t64_s3_o2": ("ring_t64_s3", 104448, 2, "split"),
    "ring_t64_s2_o3_hk": ("ring_t64_s2_hk", 69632, 3, "hk"),
    "ring_t64_s2_o3_ns": ("ring_t64_s2", 69632, 3, "nosplit"),
    "ring_t128_s2_o1": ("ring_t128_s2", 139264, 1, "split"),
    "ring_t32_s4_o3": ("ring_t32_s4", 69632, 3, "split"),
    "alt_t128_o2": ("alt_t128", 69632, 2, "split"),
    "alt_t128_o3": ("alt_t128", 69632, 3, "split"),
    "alt_t128_o2_ns": ("alt_t128", 69632, 2, "nosplit"),
    "alt_t64_o4": ("alt_t64", 34816, 4, "split"),
    "ldg_t64_o3": ("ldg_t64", 0, 3, "split"),
    "ldg_t32_o6": ("ldg_t32", 0, 6, "split"),
    "bulk_s2": ("bulk_s2", 69888, 3, "split"),
    "ringw_s2_o3": ("ringw_s2", 65536, 3, "split"),
    "ringw_s3_o2": ("ringw_s3", 98304, 2, "split"),
    "ringw_s2_o3_ns": ("ringw_s2", 65536, 3, "nosplit"),
    "ringw_s3_o2_ns": ("ringw_s3", 98304, 2, "nosplit"),
    "ringw_s2_o2": ("ringw_s2", 65536, 2, "split"),
    "ringw_s1_o2": ("ringw_s1", 32768, 2, "split"),
    "ringw_s2_c300_o2": ("ringw_s2_c300", 65536, 2, "split"),
    "ringw_s2_c600_o2": ("ringw_s2_c600", 65536, 2, "split"),
    "ringw_s2_c1200_o2": ("ringw_s2_c1200", 65536, 2, "split"),
    "ringw_s3_c600_o2": ("ringw_s3_c600", 98304, 2, "split"),
    "ringw_s3_c1200_o2": ("ringw_s3_c1200", 98304, 2, "split"),
    "ringw_s2_c600_o3": ("ringw_s2_c600", 65536, 3, "split"),
    "ringw_s1_o3": ("ringw_s1", 32768, 3, "split"),
    "ringw_s1_o4": ("ringw_s1", 32768, 4, "split"),
    "ringw_k32_s1_o2": ("ringw_k32_s1", 65536, 2, "split"),
    "ringw_k32_s2_o1": ("ringw_k32_s2", 131072, 1, "split"),
    "altw_k32_o2": ("altw_k32", 65536, 2, "split"),
    "altw_k32_o3": ("altw_k32", 65536, 3, "split"),
    "altw_k16_o3": ("altw_k16", 32768, 3, "split"),
    "altw_k16_o4": ("altw_k16", 32768, 4, "split"),
    "ringd_s2_o3": ("ringd_s2", 65536, 3, "split"),
    "ringd_s2_o2": ("ringd_s2", 65536, 2, "split"),
    "ringd_s3_o2": ("ringd_s3", 98304, 2, "split"),
    "ringw2_s2_o3": ("ringw2_s2", 65536, 3, "pair"),
    "ringsteal_s2_o2": ("ringsteal_s2", 65536, 2, "split"),
    "ringsteal_s2_o3": ("ringsteal_s2", 65536, 3, "split"),
    "ringsteal_s3_o2": ("ringsteal_s3", 98304, 2, "split"),
    # tma*: K and V are passed as tensor maps (kernel name prefix); shared memory + 2 KB for the
    # barriers and the 1024-byte alignment of the swizzled boxes.
    "tmaw_s2_o3": ("tmaw_s2", 67584, 3, "split"),
    "tmaw_s3_o2": ("tmaw_s3", 100352, 2, "split"),
    "tmaw_s4_o1": ("tmaw_s4", 133120, 1, "split"),
    "tmaw_s3_o2_ns": ("tmaw_s3", 100352, 2, "nosplit"),
    "tma_s2_o3": ("tma_s2", 67584, 3, "split"),
    "tma_s3_o2": ("tma_s3", 100352, 2, "split"),
    "tma_s3_o2_ns": ("tma_s3", 100352, 2, "nosplit"),
    "tma_s4_o1": ("tma_s4", 133120, 1, "split"),
}
SHAPES = ["1,32768,32,12", "1,131072,32,12", "8,4096,32,3", "8,32768,32,3", "64,4096,32,2", "64,32768,32,3",
          "8,32768,8,6", "8,131072,8,6", "64,4096,8,3", "64,32768,8,3"]
SMEM_PER_SM = 233472  # 228 KB on sm_90; the driver reserves 1 KB per CTA


def tensor_map(buf, box_rows: int):
    """A CUtensorMap (driver cuTensorMapEncodeTiled through ctypes) over the (b, L, H, 128) cache
    ``buf`` seen as (d = 128, kv head, b * L rows), 64 x 1 x box_rows boxes, 128-byte swizzle; copied
    to the GPU (128 bytes, 64-byte aligned) for the kernel to read."""
    import ctypes

    import cupy
    import numpy as np

    b, L, H, d = buf.shape
    raw = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(raw) + 63) // 64 * 64
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled(
        ctypes.c_void_p(addr), 1, 3, ctypes.c_void_p(buf.data.ptr), (u64 * 3)(d, H, b * L), (u64 * 2)(2 * d, 2 * d * H),
        (u32 * 3)(64, 1, box_rows), (u32 * 3)(1, 1, 1), 0, 3, 3, 0)  # uint16, no interleave, 128B swizzle, L2 256B
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: CUresult {rc}")
    return cupy.asarray(np.frombuffer(ctypes.string_at(addr, 128), dtype=np.uint8))


def padded_smem(need: int, per_sm: int) -> int:
    return need if per_sm == 0 else max(need, SMEM_PER_SM // per_sm - 1024)


def main():
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--probes", nargs="*", default=list(PROBES))
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    mod = cupy.RawModule(code=SOURCE, options=("-std=c++17", "-arch=sm_90a"))
    sink = cupy.zeros(1, dtype=cupy.float32)  # ringd* probes: then 32 floats on, a counter line per head
    print(f"{'shape (b,L,h,splits)':24} {'probe':20} {'TB/s':>6}", flush=True)
    for shape in a.shapes:
        b, L, H, splits = map(int, shape.split(","))
        K = cupy.empty((b, L, H, 128), dtype=cupy.uint16)
        V = cupy.empty_like(K)
        K.view(cupy.float16)[...] = 0.5
        V.view(cupy.float16)[...] = 0.25
        nbytes = 2 * K.nbytes
        if any(name.startswith(("ringd", "ringsteal")) for name in a.probes):  # counters: ringd 32 ints per
            sink = cupy.zeros(32 + max(32, 32 * splits) * b * H, dtype=cupy.float32)  # head, ringsteal 32 per split
        for name in a.probes:
            kernel, need, per_sm, grid_kind = PROBES[name]
            fn = mod.get_function(kernel)
            sm = padded_smem(need, per_sm)
            if sm > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = sm
            if grid_kind == "flat":
                n16 = K.nbytes // 16
                grid = (132 * 16,) if kernel == "flat" else (132 * per_sm,)
                args = (K, V, cupy.int64(n16), sink)
            else:
                s = 1 if grid_kind == "nosplit" else splits
                grid = {"split": (s, H, b), "nosplit": (1, H, b), "hk": (H, s, b), "pair": (2 * s, H // 2, b)}[grid_kind]
                kps = -(-L // (s * 64)) * 64 if grid_kind != "pair" else -(-L // (2 * s * 32)) * 32
                args = (K, V, cupy.int32(L), cupy.int32(H), cupy.int32(kps), sink)
                if kernel.startswith("tma"):
                    rows = 16 if kernel.startswith("tmaw") else 64
                    args = (tensor_map(K, rows), tensor_map(V, rows)) + args[2:]
            block = (256,) if kernel == "flat" else (128,)
            reset = kernel.startswith(("ringd", "ringsteal"))  # the claim counters start at 0 in every launch
            for _ in range(3):
                if reset:
                    sink.fill(0)
                fn(grid, block, args, shared_mem=sm)
            ts = []
            for _ in range(a.repeats):
                if reset:
                    sink.fill(0)
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record()
                fn(grid, block, args, shared_mem=sm)
                e1.record()
                e1.synchronize()
                ts.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e-3)
            if reset and kernel.startswith("ringd"):  # every unit of every head read exactly once
                done = sink[32:32 + 32 * b * H].view(cupy.int32).reshape(b * H, 32)[:, 1]
                if not bool((done == -(-L // 16)).all()):
                    raise RuntimeError(f"{name} at {shape}: units read per head {done.get()} != {-(-L // 16)}")
            if reset and kernel.startswith("ringsteal"):  # every warp share of every tile read exactly once
                done = sink[32:32 + 32 * splits * b * H].view(cupy.uint64).reshape(b * H, splits, 4, 4)[:, :, :, 1]
                if not bool((done.sum(axis=1) == -(-L // 64)).all()):
                    raise RuntimeError(f"{name} at {shape}: tile shares read per head and warp {done.sum(axis=1).get()}")
            print(f"{shape:24} {name:20} {nbytes / statistics.median(ts) / 1e12:6.2f}", flush=True)
        del K, V
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
