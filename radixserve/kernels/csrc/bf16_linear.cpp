// bf16 matmul for CPUs without AMX (AVX-512 BF16, AVX-512F or AVX2 + FMA), loaded with cpu_kernels.cpp.
//
// Why native: decode multiplies a few rows by every weight of the model, so its linears are bound by
// how fast the weights stream from memory; a layout made for one sequential read per column block,
// read once per call whatever the row count, streams faster than oneDNN's or F.linear's. On an AVX2
// CPU oneDNN cannot pack bf16 at all, and F.linear's bf16 path is slower still (docs/architecture.md).
//
// Weight layout (made by radixserve/kernels/cpu_ops.py, pack_linear): W [N, K] as
// [N / 16][K / 2][16][2]: for each block of 16 output columns and each pair of inputs (2p, 2p + 1),
// the 16 columns' two weights side by side (the pair order vdpbf16ps reads). A block is one
// sequential run of K * 32 bytes; one 64-byte line per input pair.
//
// Numerics: products of bf16 are exact in fp32. Every output element is summed in one fixed order,
// the same for every row count, row tile, thread count and call: acc = 0, then for p = 0 .. K/2 - 1:
// acc += x[2p + 1] * w[2p + 1]; acc += x[2p] * w[2p] (each add rounded to fp32). Then (acc + bias)
// + residual in fp32, rounded once to bf16 (round to nearest even). With FMA the exact products make
// fma(x, w, acc) that same rounded add, so the AVX2 and AVX-512F builds give the same bits; vdpbf16ps
// is documented (Intel SDM) to add the odd product, then the even one, as above, but it flushes
// denormals, so the AVX-512 BF16 build can differ where a sum or input is denormal.

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "vec16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define RADIXSERVE_LINEAR_ISA 4
#elif defined(__AVX512F__)
#define RADIXSERVE_LINEAR_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define RADIXSERVE_LINEAR_ISA 1
#else
#define RADIXSERVE_LINEAR_ISA 0
#endif

namespace {

#if RADIXSERVE_LINEAR_ISA

using radixserve_vec::v16f;

constexpr int64_t kBlockColumns = 16;
constexpr int64_t kPairElements = 32;    // one input pair of a block: 16 columns x 2 bf16
constexpr int64_t kChunkBytes = 256 << 10;  // weights of the blocks sharing each row tile (in L2)
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead of the loads each block's stream is fetched
constexpr int64_t kParallelWork = 1 << 18;  // m * n * k below which one thread does it all
// Rows of a register tile: as many sums as the registers hold beside the weights in use.
#if RADIXSERVE_LINEAR_ISA >= 2
constexpr int kMaxRows = 4;
#else
constexpr int kMaxRows = 6;
#endif

// 16 fp32 lanes: one zmm, or two ymm.
#if RADIXSERVE_LINEAR_ISA >= 2
struct Acc {
    __m512 v;
};
inline Acc zero() { return {_mm512_setzero_ps()}; }
inline v16f to_v16f(Acc a) {
    v16f f;
    memcpy(&f, &a.v, 64);
    return f;
}
#else
struct Acc {
    __m256 lo, hi;
};
inline Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline v16f to_v16f(Acc a) {
    v16f f;
    memcpy(&f, &a.lo, 32);
    memcpy(reinterpret_cast<char *>(&f) + 32, &a.hi, 32);
    return f;
}
#endif

// Blocks per register tile for a tile of R rows: enough independent sums to hide the FMA latency
// at one row, no more than the registers hold at four.
template <int R>
constexpr int tile_blocks() {
#if RADIXSERVE_LINEAR_ISA >= 2
    return 4;  // up to 16 zmm sums
#else
    return R == 1 ? 4 : (R == 2 ? 2 : 1);  // up to 4 x 2 ymm sums
#endif
}

// The most blocks of any row count's tile (one row's).
constexpr int64_t kWidestTile = tile_blocks<1>();
// The fewest blocks a chunk holds. On AVX-512 every row count's tile spans 4 blocks, and a chunk of
// fewer (a K of 4,096 or more fills 256 KB with 1-2 blocks) left it 4-8 sums, too few to hide
// vdpbf16ps's latency: reading a whole tile's blocks past L2, from L3 for the later row tiles, ran
// such linears faster. The AVX2 tile of 3-6 rows is one block wide, and its chunks stay in L2.
#if RADIXSERVE_LINEAR_ISA >= 2
constexpr int64_t kMinChunkBlocks = kWidestTile;
#else
constexpr int64_t kMinChunkBlocks = 1;
#endif

struct Call {
    const uint16_t *x;  // bf16 rows (the vdpbf16ps build reads them as they are)
    float *xf;          // the same rows widened to fp32, k apart (the FMA builds)
    int64_t x_stride;
    const uint16_t *packed;
    uint16_t *out;
    int64_t out_stride;
    const uint16_t *bias, *residual;
    int64_t residual_stride, m, n, k;
};

// Rows [row, row + R) x blocks [block, block + B): the register tile, in the summation order above.
template <int R, int B>
void tile(const Call &c, int64_t row, int64_t block, bool prefetch) {
    const int64_t pairs = c.k / 2;
    const uint16_t *w[B];
    for (int b = 0; b < B; b++) w[b] = c.packed + (block + b) * pairs * kPairElements;
    Acc acc[R][B];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = zero();
    for (int64_t p = 0; p < pairs; p++) {
        for (int b = 0; b < B; b++) {
            const uint16_t *line = w[b] + p * kPairElements;
            if (prefetch) _mm_prefetch(reinterpret_cast<const char *>(line) + kPrefetchBytes, _MM_HINT_T0);
#if RADIXSERVE_LINEAR_ISA == 4
            const __m512bh weights = (__m512bh)_mm512_loadu_si512(line);
            for (int r = 0; r < R; r++) {
                uint32_t both;
                memcpy(&both, c.x + (row + r) * c.x_stride + 2 * p, 4);
                const __m512bh inputs = (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
                acc[r][b].v = _mm512_dpbf16_ps(acc[r][b].v, weights, inputs);
            }
#elif RADIXSERVE_LINEAR_ISA == 2
            // A lane holds (w[2p], w[2p + 1]) as its low and high 16 bits: each is an fp32 by itself
            // once moved to (or masked in) the high half.
            const __m512i both = _mm512_loadu_si512(line);
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32(-65536)));
            for (int r = 0; r < R; r++) {
                const float *inputs = c.xf + (row + r) * c.k + 2 * p;
                acc[r][b].v = _mm512_fmadd_ps(_mm512_set1_ps(inputs[1]), odd, acc[r][b].v);
                acc[r][b].v = _mm512_fmadd_ps(_mm512_set1_ps(inputs[0]), even, acc[r][b].v);
            }
#else
            const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(line));
            const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(line + 16));
            const __m256i mask = _mm256_set1_epi32(-65536);
            const __m256 even_lo = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
            const __m256 even_hi = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
            const __m256 odd_lo = _mm256_castsi256_ps(_mm256_and_si256(lo, mask));
            const __m256 odd_hi = _mm256_castsi256_ps(_mm256_and_si256(hi, mask));
            for (int r = 0; r < R; r++) {
                const float *inputs = c.xf + (row + r) * c.k + 2 * p;
                const __m256 x_odd = _mm256_broadcast_ss(inputs + 1), x_even = _mm256_broadcast_ss(inputs);
                acc[r][b].lo = _mm256_fmadd_ps(x_odd, odd_lo, acc[r][b].lo);
                acc[r][b].hi = _mm256_fmadd_ps(x_odd, odd_hi, acc[r][b].hi);
                acc[r][b].lo = _mm256_fmadd_ps(x_even, even_lo, acc[r][b].lo);
                acc[r][b].hi = _mm256_fmadd_ps(x_even, even_hi, acc[r][b].hi);
            }
#endif
        }
    }
    for (int r = 0; r < R; r++) {
        for (int b = 0; b < B; b++) {
            const int64_t column = (block + b) * kBlockColumns;
            v16f sum = to_v16f(acc[r][b]);
            if (c.bias) sum = sum + radixserve_vec::load16(c.bias + column);
            if (c.residual) sum = sum + radixserve_vec::load16(c.residual + (row + r) * c.residual_stride + column);
            radixserve_vec::store16(c.out + (row + r) * c.out_stride + column, sum);
        }
    }
}

#if RADIXSERVE_LINEAR_ISA == 1
// The AVX2 register tile of 3 to 6 rows by one block, in assembly. Why: it needs all 16 ymm registers
// (12 sums of 6 rows x 16 columns, two weight vectors, one broadcast input, the mask), and the
// compiler, given the same loop in intrinsics, hoists the input broadcasts and spills sums to the
// stack on every pair; that capped the C tile at about a third of the FMA peak. Each pair: the
// odd weights of the line (the mask keeps each lane's high half), every row's odd FMA; then the even
// weights (shifted up), every row's even FMA. So each sum takes its two adds per pair in the order
// above, and the bits equal the C tile's and the AVX-512F build's.
// Registers: ymm0-5 the sums of columns 0-7 of rows 0-5, ymm6-11 of columns 8-15, ymm12-13 the
// weights, ymm14 the broadcast input, ymm15 the mask.
#define RADIXSERVE_ROW(addr, lo, hi)        \
    "vbroadcastss " addr ", %%ymm14\n\t"    \
    "vfmadd231ps %%ymm12, %%ymm14, " lo "\n\t" \
    "vfmadd231ps %%ymm13, %%ymm14, " hi "\n\t"
#define RADIXSERVE_ROWS3(off)                                                       \
    RADIXSERVE_ROW(off "(%[x0])", "%%ymm0", "%%ymm6")                               \
    RADIXSERVE_ROW(off "(%[x0],%[s],1)", "%%ymm1", "%%ymm7")                        \
    RADIXSERVE_ROW(off "(%[x0],%[s],2)", "%%ymm2", "%%ymm8")
#define RADIXSERVE_ROWS4(off) RADIXSERVE_ROWS3(off) RADIXSERVE_ROW(off "(%[x3])", "%%ymm3", "%%ymm9")
#define RADIXSERVE_ROWS5(off) \
    RADIXSERVE_ROWS4(off) RADIXSERVE_ROW(off "(%[x3],%[s],1)", "%%ymm4", "%%ymm10")
#define RADIXSERVE_ROWS6(off) \
    RADIXSERVE_ROWS5(off) RADIXSERVE_ROW(off "(%[x3],%[s],2)", "%%ymm5", "%%ymm11")
#define RADIXSERVE_TILE(ROWS)                                                                  \
    asm volatile(                                                                              \
        "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"                                                    \
        "vmovaps %%ymm0, %%ymm1\n\t" "vmovaps %%ymm0, %%ymm2\n\t" "vmovaps %%ymm0, %%ymm3\n\t" \
        "vmovaps %%ymm0, %%ymm4\n\t" "vmovaps %%ymm0, %%ymm5\n\t" "vmovaps %%ymm0, %%ymm6\n\t" \
        "vmovaps %%ymm0, %%ymm7\n\t" "vmovaps %%ymm0, %%ymm8\n\t" "vmovaps %%ymm0, %%ymm9\n\t" \
        "vmovaps %%ymm0, %%ymm10\n\t" "vmovaps %%ymm0, %%ymm11\n\t"                            \
        "vpcmpeqd %%ymm15, %%ymm15, %%ymm15\n\t"                                               \
        "vpslld $16, %%ymm15, %%ymm15\n\t"                                                     \
        "1:\n\t"                                                                               \
        "prefetcht0 (%[pf])\n\t"                                                               \
        "vpand (%[w]), %%ymm15, %%ymm12\n\t"                                                   \
        "vpand 32(%[w]), %%ymm15, %%ymm13\n\t" ROWS("4")                                       \
        "vmovdqu (%[w]), %%ymm12\n\t"                                                          \
        "vpslld $16, %%ymm12, %%ymm12\n\t"                                                     \
        "vmovdqu 32(%[w]), %%ymm13\n\t"                                                        \
        "vpslld $16, %%ymm13, %%ymm13\n\t" ROWS("0")                                           \
        "add $64, %[w]\n\t"                                                                    \
        "add %[pf_step], %[pf]\n\t"                                                            \
        "add $8, %[x0]\n\t"                                                                    \
        "add $8, %[x3]\n\t"                                                                    \
        "dec %[n]\n\t"                                                                         \
        "jnz 1b\n\t"                                                                           \
        "vmovups %%ymm0, (%[out])\n\t" "vmovups %%ymm6, 32(%[out])\n\t"                        \
        "vmovups %%ymm1, 64(%[out])\n\t" "vmovups %%ymm7, 96(%[out])\n\t"                      \
        "vmovups %%ymm2, 128(%[out])\n\t" "vmovups %%ymm8, 160(%[out])\n\t"                    \
        "vmovups %%ymm3, 192(%[out])\n\t" "vmovups %%ymm9, 224(%[out])\n\t"                    \
        "vmovups %%ymm4, 256(%[out])\n\t" "vmovups %%ymm10, 288(%[out])\n\t"                   \
        "vmovups %%ymm5, 320(%[out])\n\t" "vmovups %%ymm11, 352(%[out])\n\t"                   \
        : [w] "+r"(w), [pf] "+r"(pf), [x0] "+r"(x0), [x3] "+r"(x3), [n] "+r"(pairs)            \
        : [s] "r"(s), [pf_step] "r"(pf_step), [out] "r"(sums)                                  \
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",       \
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory")

template <int R>
void tile_asm(const Call &c, int64_t row, int64_t block, bool prefetch) {
    static_assert(R >= 3 && R <= 6, "the assembly tile has 3 to 6 rows");
    int64_t pairs = c.k / 2;
    const uint16_t *w = c.packed + block * pairs * kPairElements;
    // Without prefetching (row tiles after the first read the chunk from L2) the prefetch address
    // stays on the first line, which costs nothing.
    const char *pf = reinterpret_cast<const char *>(w) + (prefetch ? kPrefetchBytes : 0);
    const int64_t pf_step = prefetch ? kPairElements * 2 : 0;
    const float *x0 = c.xf + row * c.k, *x3 = x0 + 3 * c.k;
    const int64_t s = c.k * 4;  // bytes between rows
    float sums[6][16];          // row r's 16 sums
    if (pairs <= 0) return;     // k is at least 2 (a multiple of 2, never 0 for a linear)
    if constexpr (R == 3) RADIXSERVE_TILE(RADIXSERVE_ROWS3);
    if constexpr (R == 4) RADIXSERVE_TILE(RADIXSERVE_ROWS4);
    if constexpr (R == 5) RADIXSERVE_TILE(RADIXSERVE_ROWS5);
    if constexpr (R == 6) RADIXSERVE_TILE(RADIXSERVE_ROWS6);
    const int64_t column = block * kBlockColumns;
    for (int r = 0; r < R; r++) {
        v16f sum = radixserve_vec::load16(sums[r]);
        if (c.bias) sum = sum + radixserve_vec::load16(c.bias + column);
        if (c.residual) sum = sum + radixserve_vec::load16(c.residual + (row + r) * c.residual_stride + column);
        radixserve_vec::store16(c.out + (row + r) * c.out_stride + column, sum);
    }
}
#undef RADIXSERVE_ROW
#undef RADIXSERVE_ROWS3
#undef RADIXSERVE_ROWS4
#undef RADIXSERVE_ROWS5
#undef RADIXSERVE_ROWS6
#undef RADIXSERVE_TILE
#endif

// Rows [row, row + R) over blocks [first, last): whole tiles, then the blocks left in one narrower
// tile. Why not single blocks: a tile of one block has R sums, too few to hide the multiply-add's
// latency, and ran a chunk's last blocks at a fraction of the rate of the rest.
template <int R>
void row_tile(const Call &c, int64_t row, int64_t first, int64_t last, bool prefetch) {
#if RADIXSERVE_LINEAR_ISA == 1
    if constexpr (R >= 3) {
        for (int64_t block = first; block < last; block++) tile_asm<R>(c, row, block, prefetch);
        return;
    }
#endif
    constexpr int B = tile_blocks<R>();
    int64_t block = first;
    for (; block + B <= last; block += B) tile<R, B>(c, row, block, prefetch);
    const int64_t left = last - block;  // fewer than B
    if constexpr (B > 3) {
        if (left == 3) return tile<R, 3>(c, row, block, prefetch);
    }
    if constexpr (B > 2) {
        if (left == 2) return tile<R, 2>(c, row, block, prefetch);
    }
    if (left == 1) tile<R, 1>(c, row, block, prefetch);
}

void linear(const Call &c) {
    const int64_t blocks = c.n / kBlockColumns;
    const int64_t block_bytes = c.k * kBlockColumns * 2;
#pragma omp parallel if (c.m * c.n * c.k >= kParallelWork)
    {
#if RADIXSERVE_LINEAR_ISA != 4
        // The inputs widened once per call, not once per column block.
        float *xf = c.xf;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < c.m; r++) {
            const uint16_t *src = c.x + r * c.x_stride;
            for (int64_t i = 0; i < c.k; i++) xf[r * c.k + i] = radixserve_vec::to_float(src[i]);
        }
#endif
        // Each thread streams its own contiguous run of column blocks.
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t share = (blocks + threads - 1) / threads;
        const int64_t begin = std::min(blocks, thread * share), end = std::min(blocks, begin + share);
        // Chunks of blocks whose weights stay in L2 while every row tile passes over them: read from
        // memory once (by the first row tile, which prefetches), from L2 after. A whole number of the
        // widest tiles where more than one fits, so that only a thread's last chunk has blocks left;
        // on AVX-512 at least one such tile, even past L2 (a long K's blocks: see kMinChunkBlocks).
        int64_t most = std::max<int64_t>(kMinChunkBlocks, kChunkBytes / block_bytes);
        if (most > kWidestTile) most -= most % kWidestTile;
        for (int64_t chunk = begin; chunk < end; chunk += most) {
            const int64_t chunk_end = std::min(end, chunk + most);
            // Rows split evenly into the fewest tiles of at most kMaxRows (8 rows: 4 + 4, not 6 + 2,
            // whose 2-row tile has too few sums to keep the FMAs busy).
            const int64_t tiles = (c.m + kMaxRows - 1) / kMaxRows;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t row = t * c.m / tiles, rows = (t + 1) * c.m / tiles - row;
                const bool prefetch = t == 0;
                switch (rows) {
                    case 1: row_tile<1>(c, row, chunk, chunk_end, prefetch); break;
                    case 2: row_tile<2>(c, row, chunk, chunk_end, prefetch); break;
                    case 3: row_tile<3>(c, row, chunk, chunk_end, prefetch); break;
#if RADIXSERVE_LINEAR_ISA >= 2
                    default: row_tile<4>(c, row, chunk, chunk_end, prefetch); break;
#else
                    case 4: row_tile<4>(c, row, chunk, chunk_end, prefetch); break;
                    case 5: row_tile<5>(c, row, chunk, chunk_end, prefetch); break;
                    default: row_tile<6>(c, row, chunk, chunk_end, prefetch); break;
#endif
                }
            }
        }
    }
}

#endif  // RADIXSERVE_LINEAR_ISA

}  // namespace

// Which variant this build has: 4 AVX-512 BF16 (vdpbf16ps), 2 AVX-512F, 1 AVX2 + FMA, 0 none (then
// bf16_linear does nothing and the callers use another kernel).
extern "C" int bf16_linear_isa() { return RADIXSERVE_LINEAR_ISA; }

// out [m, n] (rows out_stride apart) = x [m, k] (rows x_stride apart) W^T (+ bias [n]) (+ residual
// [m, n], rows residual_stride apart), for W packed as above; n a multiple of 16, k of 2. bias and
// residual may be null. The contract of amx_linear_bf16, on another layout.
extern "C" void bf16_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, uint16_t *out,
                            int64_t out_stride, const uint16_t *bias, const uint16_t *residual,
                            int64_t residual_stride, int64_t m, int64_t n, int64_t k) {
#if RADIXSERVE_LINEAR_ISA
    if (m <= 0) return;
    static thread_local std::vector<float> widened;
#if RADIXSERVE_LINEAR_ISA != 4
    if (widened.size() < static_cast<size_t>(m * k)) widened.resize(m * k);
#endif
    linear({x, widened.data(), x_stride, packed, out, out_stride, bias, residual, residual_stride, m, n, k});
#else
    (void)x, (void)x_stride, (void)packed, (void)out, (void)out_stride, (void)bias, (void)residual;
    (void)residual_stride, (void)m, (void)n, (void)k;
#endif
}
