// Hopper (sm_90a) building blocks of the warpgroup-MMA kernels (the grouped expert GEMMs, the fused
// indexer scores, the flash sparse MQA): 16-byte cp.async and TMA bulk tensor copies into
// 128-byte-swizzled operand tiles, the wgmma shared-memory matrix descriptor, the m64nNk16 bf16
// MMA, mbarriers and cluster arrivals, and vector reductions. The grouped GEMM's operand roles and
// accumulator store are the moe family's (ops/moe/grouped_gemm_tiles.cuh).
//
// Shared memory operand tiles use the 128-byte swizzle wgmma reads (PTX "matrix descriptor";
// CuTe's Swizzle<3,4,3>): a 128-byte row's 16-byte chunk c is stored at chunk c ^ (row % 8).
//   K-major (reduction contiguous in memory, e.g. x [rows, K]): [width rows][64] tile, rows 128 B
//     apart, 8-row groups 1024 B apart (SBO). A k16 step advances the start address by 32 B.
//   MN-major (the wide index contiguous, e.g. W [K, N] or X^T): width / 64 atoms [64 k][64], each
//     k row 128 B; atoms 8 KiB apart (LBO), 8-k groups 1024 B apart (SBO). A k16 step advances
//     the start address by 2048 B; wgmma's transpose flag reads it.
//
#pragma once

#include <cstdint>

#include "sparsetron/ops/common/device_util.cuh"
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ST_WGMMA 1
#endif

namespace sparsetron::cuda::wgmma {

constexpr int BM = 128, BK = 64;  // output tile rows, reduction slice

#ifdef ST_WGMMA
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
                 "r"(valid ? 16 : 0));
}

// One operand's slice into its swizzled tile of kWidth x 64, copied by kThreads threads (`tid`
// this thread's index among them). kMajorK: the source's rows are the tile's kWidth rows and the
// reduction is contiguous; otherwise the source's rows are the reduction and the tile's
// kWidth-wide index is contiguous (kWidth / 64 atoms, 8 KiB apart). Out-of-range rows / columns /
// reduction are zero-filled. Walked with one running source pointer per thread (a thread's chunks
// are kThreads / 8 rows, or kThreads / (kWidth / 8) reduction rows, apart), so no per-chunk address
// stays live across slices (unrolled per-chunk addresses spilled at 168 registers).
template <bool kMajorK, int kWidth, int kThreads>
__device__ __forceinline__ void load_tile_walk(uint32_t tile, const bf* src, int64_t ld,
                                               int64_t base, int64_t extent, int64_t k0,
                                               int64_t depth, int tid) {
    constexpr int kChunks = kWidth * BK / 8 / kThreads;
    static_assert(kWidth * BK / 8 % kThreads == 0, "every thread copies the same chunk count");
    if constexpr (kMajorK) {
        constexpr int kRowStep = kThreads / 8;  // tile rows between a thread's chunks
        const int row = tid >> 3, ch = tid & 7;
        const bool k_ok = k0 + ch * 8 < depth;
        const int64_t rows_left = extent - base - row;  // chunks it with it * kRowStep < this
        const bf* g = src + (base + row) * ld + k0 + ch * 8;
        uint32_t s = tile + row * 128 + ((ch ^ (row & 7)) << 4);  // row & 7 is the same each it
        static_assert(kRowStep % 8 == 0, "the swizzle phase repeats every 8 rows");
#pragma unroll
        for (int it = 0; it < kChunks; ++it) {
            const bool ok = k_ok && it * kRowStep < rows_left;
            cp_async16(s, ok ? g : src, ok);
            g += kRowStep * ld;
            s += kRowStep * 128;
        }
    } else {
        constexpr int kChunksPerRow = kWidth / 8, kKStep = kThreads / kChunksPerRow;
        const int kk = tid / kChunksPerRow, mn = tid % kChunksPerRow, atom = mn >> 3, ch = mn & 7;
        const bool mn_ok = base + mn * 8 < extent;
        const int64_t k_left = depth - k0 - kk;
        const bf* g = src + (k0 + kk) * ld + base + mn * 8;
#pragma unroll
        for (int it = 0; it < kChunks; ++it) {
            const int r = kk + it * kKStep;  // reduction row of the tile
            const bool ok = mn_ok && it * kKStep < k_left;
            cp_async16(tile + atom * 8192 + r * 128 + ((ch ^ (r & 7)) << 4), ok ? g : src, ok);
            g += kKStep * ld;
        }
    }
}

// *p += a, p[1] += b as one fire-and-forget L2 reduction: the thread does not wait for the old
// values (the weight gradient's store here, the flash backward's dK'/dV' rows).
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
}
// Four consecutive fp32 values (p 16-byte aligned) in one reduction.
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c),
                 "f"(d)
                 : "memory");
}

// The 64-bit shared memory matrix descriptor: start, leading and stride byte offsets (all in
// 16-byte units), 128-byte swizzle (mode 1 in bits 62-63).
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
           (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}
// The descriptor of k16 step kk of a 64-deep slice tile (see the layouts above).
template <bool kMajorK>
__device__ __forceinline__ uint64_t slice_descriptor(uint32_t tile, int kk) {
    return kMajorK ? descriptor(tile + kk * 32, 16, 1024)
                   : descriptor(tile + kk * 2048, 8192, 1024);
}

// A 64-register accumulator block d[0..63] in an MMA's inline assembly: its registers in the
// instruction text (operands %0..%63) and its operand list (read and written).
#define ST_WGMMA_ACC64_REGS                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "     \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, " \
    "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, " \
    "%55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define ST_WGMMA_ACC64_OPERANDS(d)                                                                 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),            \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63])

// d += A (64 x 16) * B (16 x N), N = 2 x the accumulator count; kTA / kTB: the operand is
// MN-major (transposed). One overload per N the kernels use.
template <int kTA, int kTB>
__device__ __forceinline__ void mma_m64k16(float (&d)[16], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %18, 0;\n"  // scale-d: 1 accumulates into d
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, 1, 1, %19, %20;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(1), "n"(kTA), "n"(kTB));
}
template <int kTA, int kTB>
__device__ __forceinline__ void mma_m64k16(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"  // scale-d: 1 accumulates into d
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, %35, %36;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(1), "n"(kTA), "n"(kTB));
}
template <int kTA, int kTB>
__device__ __forceinline__ void mma_m64k16(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"  // scale-d: 1 accumulates into d
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " ST_WGMMA_ACC64_REGS
        "%64, %65, p, 1, 1, %67, %68;\n"
        "}\n"
        : ST_WGMMA_ACC64_OPERANDS(d)
        : "l"(da), "l"(db), "r"(1), "n"(kTA), "n"(kTB));
}
template <int kTA, int kTB>
__device__ __forceinline__ void mma_m64k16(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"  // scale-d: 1 accumulates into d
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, "
        "%73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, "
        "%91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, "
        "%107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, "
        "%122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, %131, %132;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
          "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
          "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
          "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
          "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1), "n"(kTA), "n"(kTB));
}

// Bulk tensor copies (TMA) into a CTA's own shared memory, completing on an mbarrier as bytes:
// `map` is a __grid_constant__ CUtensorMap parameter (tensor_map.h), coordinates innermost first.
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, int32_t c0, int32_t c1,
                                         uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, int32_t c0, int32_t c1,
                                         int32_t c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
// The same copies multicast to the CTAs of this block's cluster in `mask`, each at the same
// shared memory offset, each completing bytes on its own barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const void* map, int32_t c0,
                                                   int32_t c1, uint32_t bar, uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
        "cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const void* map, int32_t c0,
                                                   int32_t c1, int32_t c2, uint32_t bar,
                                                   uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
        "cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
        : "memory");
}
// A 2-d box from this CTA's shared memory to global memory (elements past the map's bounds are
// not written), in this thread's bulk group.
__device__ __forceinline__ void tma_store(const void* map, uint32_t src, int32_t c0, int32_t c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(c0), "r"(c1), "r"(src)
        : "memory");
}
// A 3-d box from shared to global memory, as tma_store.
__device__ __forceinline__ void tma_store(const void* map, uint32_t src, int32_t c0, int32_t c1,
                                          int32_t c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(c0), "r"(c1), "r"(c2), "r"(src)
        : "memory");
}
// The 3-d box added into global memory (the map's element type: fp32 here), element by element.
__device__ __forceinline__ void tma_reduce_add(const void* map, uint32_t src, int32_t c0,
                                               int32_t c1, int32_t c2) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, "
        "%3}], [%4];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
        "r"(c0), "r"(c1), "r"(c2), "r"(src)
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const void* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// mbarriers in shared memory (32-bit shared addresses): init with an arrival count, arrive
// (release), wait for the phase of the given parity to complete (acquire).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Thread block clusters: this block's rank, a barrier over every thread of the cluster (release /
// acquire), and an mbarrier arrival on CTA `rank`'s barrier at this block's offset `bar` (default
// semantics: a consumer's arrival only says its wgmma reads of the stage are over; a release at
// cluster scope would first wait for the thread's outstanding global stores).
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
            : "memory");
}
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
    asm volatile(
        "{\n"
        ".reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
        "}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
}
// One arrival that also expects `bytes` of bulk copies to complete on the barrier's phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
#endif  // ST_WGMMA

}  // namespace sparsetron::cuda::wgmma
