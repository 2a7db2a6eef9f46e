// bf16 matmul on Intel AMX tiles for radixserve's linear layers, loaded with cpu_kernels.cpp.
//
// Why native: decode multiplies a few rows by every weight of the model, so its linears are bound by
// how fast the weights stream from memory. oneDNN reached ~16 GB/s there on a 2-core Xeon; this
// kernel streams a layout made for it at ~20-28 GB/s and, with the right blocking, also beats oneDNN
// on prefill-sized matmuls (measured in docs/architecture.md).
//
// Weight layout (made by radixserve/kernels/cpu_ops.py, pack_linear): W [N, K] as
// [N / 32][K / 32][2][16][16][2]: for each block of 32 output columns and each step of 32 inputs, two
// B tiles of 16 columns in AMX's VNNI order (row kk holds inputs 2kk and 2kk+1 of each column). A
// block's tiles are contiguous, so a block streams as one sequential read.
//
// Numerics: products of bf16 are exact in fp32 and summed in fp32; bias and residual are added to the
// fp32 sum, which is rounded to bf16 once (round to nearest even).

#include <omp.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include "amx_common.h"

namespace {

#ifdef RADIXSERVE_AMX

using radixserve_amx::configure_tiles;
using radixserve_amx::widen_bf16;

constexpr int64_t kBlockColumns = 32;  // output columns per block: two 16-column C tiles
constexpr int64_t kStepInputs = 32;    // inputs per step: one A tile row of bf16
constexpr int64_t kTileElements = 512;  // 16 rows x 64 bytes of bf16
constexpr int64_t kChunkBytes = 1 << 20;  // weights of the column blocks sharing each A block (in L2)
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of the tile loads the weights are fetched
constexpr int64_t kParallelWork = 1 << 18;  // m * n * k below which one thread does it all

// Rows of two 16-column fp32 tiles (+ bias, + residual) rounded into 32 bf16 columns of out.
void store_rows(const float *left, const float *right, int rows, uint16_t *out, int64_t out_stride,
                const uint16_t *bias, const uint16_t *residual, int64_t residual_stride) {
    const __m512 bias_left = bias ? widen_bf16(bias) : _mm512_setzero_ps();
    const __m512 bias_right = bias ? widen_bf16(bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m512 a = _mm512_add_ps(_mm512_load_ps(left + r * 16), bias_left);
        __m512 b = _mm512_add_ps(_mm512_load_ps(right + r * 16), bias_right);
        if (residual) {
            a = _mm512_add_ps(a, widen_bf16(residual + r * residual_stride));
            b = _mm512_add_ps(b, widen_bf16(residual + r * residual_stride + 16));
        }
        _mm512_storeu_si512(out + r * out_stride, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
    }
}

// Output rows [row, row + rows) (rows <= 32) of column block `block`.
inline void block_product(const uint16_t *x, int64_t x_stride, const uint16_t *packed, uint16_t *out,
                          int64_t out_stride, const uint16_t *bias, const uint16_t *residual,
                          int64_t residual_stride, int64_t row, int rows, int64_t block, int64_t steps,
                          bool prefetch, float (*c)[256]) {
    const int top = rows < 16 ? rows : 16, bottom = rows - top;
    const uint16_t *weights = packed + block * steps * 2 * kTileElements;
    const uint16_t *a_top = x + row * x_stride, *a_bottom = a_top + 16 * x_stride;
    _tile_zero(4);
    _tile_zero(5);
    if (bottom) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int64_t s = 0; s < steps; s++) {
        if (prefetch) {
            const char *ahead = reinterpret_cast<const char *>(weights) + kPrefetchBytes;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
        }
        _tile_loadd(2, weights, 64);
        _tile_loadd(3, weights + kTileElements, 64);
        _tile_loadd(0, a_top + s * kStepInputs, x_stride * 2);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (bottom) {
            _tile_loadd(1, a_bottom + s * kStepInputs, x_stride * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
        weights += 2 * kTileElements;
    }
    const int64_t column = block * kBlockColumns;
    const uint16_t *block_bias = bias ? bias + column : nullptr;
    const uint16_t *res = residual ? residual + row * residual_stride + column : nullptr;
    _tile_stored(4, c[0], 64);
    _tile_stored(5, c[1], 64);
    store_rows(c[0], c[1], top, out + row * out_stride + column, out_stride, block_bias, res, residual_stride);
    if (bottom) {
        _tile_stored(6, c[2], 64);
        _tile_stored(7, c[3], 64);
        store_rows(c[2], c[3], bottom, out + (row + 16) * out_stride + column, out_stride, block_bias,
                   res ? res + 16 * residual_stride : nullptr, residual_stride);
    }
}

void amx_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, uint16_t *out, int64_t out_stride,
                const uint16_t *bias, const uint16_t *residual, int64_t residual_stride, int64_t m, int64_t n,
                int64_t k) {
    const int64_t blocks = n / kBlockColumns, steps = k / kStepInputs, row_blocks = (m + 31) / 32;
#pragma omp parallel if (m * n * k >= kParallelWork)
    {
        // Threads split the column blocks (each streams its own part of the weights) unless there are
        // too few of them; then they split the rows.
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const bool split_columns = blocks >= threads;
        const int64_t parts = split_columns ? blocks : row_blocks;
        const int64_t share = (parts + threads - 1) / threads;
        const int64_t first = thread * share, last = first + share < parts ? first + share : parts;
        const int64_t block_begin = split_columns ? first : 0, block_end = split_columns ? last : blocks;
        const int64_t row_begin = split_columns ? 0 : first * 32, row_end = split_columns ? m : last * 32;
        alignas(64) float c[4][256];
        int configured_rows = -1;
        // Chunks of column blocks: an A block (32 rows) stays in L1 across a chunk, and the chunk's
        // weights (up to kChunkBytes, in equal chunks) stay in L2 across the row blocks. Fewer,
        // larger chunks mean fewer passes over A, which a prefill's thousands of rows keep in L3.
        const int64_t block_bytes = steps * 2 * kTileElements * 2, my_blocks = block_end - block_begin;
        const int64_t most = std::max<int64_t>(1, kChunkBytes / block_bytes);
        const int64_t chunks = std::max<int64_t>(1, (my_blocks + most - 1) / most);
        const int64_t per_chunk = std::max<int64_t>(1, (my_blocks + chunks - 1) / chunks);
        for (int64_t chunk = block_begin; chunk < block_end; chunk += per_chunk) {
            const int64_t chunk_end = std::min(chunk + per_chunk, block_end);
            for (int64_t row = row_begin; row < row_end && row < m; row += 32) {
                const int rows = static_cast<int>(m - row < 32 ? m - row : 32);
                if (rows != configured_rows) {
                    // 0, 1: the block's top 16 rows and the rest; 2, 3: a step's B tiles; 4, 5: C of
                    // the top rows, 6, 7: C of the rest.
                    const int top = rows < 16 ? rows : 16, rest = rows - top;
                    configure_tiles({top, rest, 16, 16, top, top, rest, rest});
                    configured_rows = rows;
                }
                for (int64_t block = chunk; block < chunk_end; block++)
                    block_product(x, x_stride, packed, out, out_stride, bias, residual, residual_stride, row, rows,
                                  block, steps, row == row_begin, c);
            }
        }
        if (configured_rows != -1) _tile_release();
    }
}

#endif  // RADIXSERVE_AMX

}  // namespace

// 1 when this build has the AMX kernel and the OS lets this process use AMX tiles (Linux asks each
// process to request them: arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
extern "C" int amx_linear_available() {
#ifdef RADIXSERVE_AMX
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0 ? 1 : 0;
#else
    return 0;
#endif
}

// out [m, n] (rows out_stride apart) = x [m, k] (rows x_stride apart) W^T (+ bias [n]) (+ residual
// [m, n], rows residual_stride apart), for W packed as above; n and k multiples of 32. bias and
// residual may be null.
extern "C" void amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, uint16_t *out,
                                int64_t out_stride, const uint16_t *bias, const uint16_t *residual,
                                int64_t residual_stride, int64_t m, int64_t n, int64_t k) {
#ifdef RADIXSERVE_AMX
    amx_linear(x, x_stride, packed, out, out_stride, bias, residual, residual_stride, m, n, k);
#else
    (void)x, (void)x_stride, (void)packed, (void)out, (void)out_stride, (void)bias, (void)residual;
    (void)residual_stride, (void)m, (void)n, (void)k;
#endif
}
