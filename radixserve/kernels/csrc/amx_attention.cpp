// Attention of many queries over one run of keys they all see in full, on AMX tiles: the prefix
// every request of a batch shares (cascade attention, radixserve/attention/).
//
// Why: all of a decode batch's queries over a 512-token shared prefix are a small GEMM pair, and
// torch's CPU flash kernel spent ~130-155 us per layer on it (SmolLM2-135M, 32 requests), about as
// long as AVX512-BF16 dot products would take. AMX tiles do the two products in a few microseconds;
// what is left is packing the operands and the softmax.
//
// Shapes: q [N, H, D] (row n's head j at q + n * q_stride + j * D); keys and values rows of [*, Hkv,
// D] (key i's head h at k + row(i) * kv_stride + h * D, row(i) = slots[i], or i without slots); out [Hkv, N * G, D] and lse [Hkv, N * G] (row n * G + g: query g of
// K/V head h of row n, G = H / Hkv), lse in natural log, as torch's flash kernel returns it.
//
// Numerics as torch's flash kernel for bf16: scores and softmax in fp32, probabilities rounded to
// bf16 for the product with V, fp32 sums, one rounding of the output.

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "amx_common.h"
#include "vec16.h"

namespace {

#ifdef RADIXSERVE_AMX

using namespace radixserve_vec;
using radixserve_amx::configure_tiles;

constexpr int64_t kTileElements = 512;  // bf16 in a tile of 16 rows x 64 bytes

struct PrefixAttention {
    const uint16_t *q;
    int64_t q_stride;
    const uint16_t *k, *v;
    int64_t kv_stride;
    const int64_t *slots;  // the keys' rows in k and v; null: rows 0 .. length - 1
    uint16_t *out;
    int64_t out_token, out_head, out_query;  // query g of K/V head h of token t: out + t * out_token
                                              // + h * out_head + g * out_query
    float *lse;                               // [Hkv, N * G], or null
    int64_t n, kv_heads, group, dim, length;
    float scale;
    int64_t causal_offset;  // < 0: every query sees every key; else token t sees keys < offset + t + 1

    int64_t rows() const { return n * group; }                  // query rows of one K/V head
    // Keys row r sees (rows of a block see nondecreasing counts).
    int64_t visible(int64_t r) const {
        return causal_offset < 0 ? length : std::min(length, causal_offset + r / group + 1);
    }
    int64_t padded_rows() const { return (rows() + 15) / 16 * 16; }
    int64_t padded_length() const { return (length + 31) / 32 * 32; }
    // Byte offset of key i's row in k and v.
    int64_t row_offset(int64_t i) const { return (slots ? slots[i] : i) * kv_stride * 2; }
};

// Query rows of head h, 16 from `block`, copied contiguous ([rows][D]; rows past the end zero).
void pack_queries(const PrefixAttention &p, int64_t h, int64_t block, uint16_t *dst) {
    for (int64_t r = block * 16; r < block * 16 + 16; r++) {
        uint16_t *row = dst + r * p.dim;
        if (r < p.rows()) {
            const int64_t token = r / p.group, head = h * p.group + r % p.group;
            memcpy(row, p.q + token * p.q_stride + head * p.dim, p.dim * 2);
        } else {
            memset(row, 0, p.dim * 2);
        }
    }
}

// Keys [16 * block, +16) of head h as B tiles of Q K^T, one per 32 dimensions: row kk holds the
// dimension pair (2kk, 2kk+1) of each of the 16 keys, i.e. a 16 x 16 transpose of 32-bit pairs.
void pack_keys(const PrefixAttention &p, int64_t h, int64_t block, uint16_t *dst) {
    const int64_t first = block * 16;
    const unsigned present = p.length - first >= 16 ? 0xffffu : (1u << (p.length - first)) - 1;
    alignas(64) int64_t rows[16];
    for (int n = 0; n < 16; n++) rows[n] = first + n < p.length ? p.row_offset(first + n) : 0;
    const __m512i low = _mm512_load_si512(rows), high = _mm512_load_si512(rows + 8);
    for (int64_t step = 0; step < p.dim / 32; step++) {
        const char *base = reinterpret_cast<const char *>(p.k + h * p.dim + step * 32);
        uint16_t *tile = dst + step * kTileElements;
        for (int kk = 0; kk < 16; kk++) {
            const __m256i first_eight = _mm512_mask_i64gather_epi32(
                _mm256_setzero_si256(), static_cast<__mmask8>(present), low, base + 4 * kk, 1);
            const __m256i last_eight = _mm512_mask_i64gather_epi32(
                _mm256_setzero_si256(), static_cast<__mmask8>(present >> 8), high, base + 4 * kk, 1);
            _mm512_storeu_si512(tile + kk * 32,
                                _mm512_inserti64x4(_mm512_castsi256_si512(first_eight), last_eight, 1));
        }
    }
}

// Values [32 * step, +32) of head h as B tiles of P V, one per 16 dimensions: row kk holds keys
// 2kk and 2kk+1 interleaved, dimension by dimension.
void pack_values(const PrefixAttention &p, int64_t h, int64_t step, uint16_t *dst) {
    for (int64_t block = 0; block < p.dim / 16; block++) {
        uint16_t *tile = dst + block * kTileElements;
        for (int kk = 0; kk < 16; kk++) {
            const int64_t even = step * 32 + 2 * kk, odd = even + 1;
            __m512i pair = _mm512_setzero_si512();
            const char *values = reinterpret_cast<const char *>(p.v + h * p.dim + block * 16);
            if (even < p.length) {
                const __m256i row =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i *>(values + p.row_offset(even)));
                pair = _mm512_cvtepu16_epi32(row);
            }
            if (odd < p.length) {
                const __m256i row =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i *>(values + p.row_offset(odd)));
                pair = _mm512_or_si512(pair, _mm512_slli_epi32(_mm512_cvtepu16_epi32(row), 16));
            }
            _mm512_storeu_si512(tile + kk * 32, pair);
        }
    }
}

// Softmax of one row of scores (fp32) over its first `visible` keys into bf16 probabilities, zero
// up to `width` (a multiple of 32); returns the fp32 sum of the probabilities and sets *row_max.
float softmax_row(const PrefixAttention &p, const float *scores, int64_t visible, int64_t width,
                  uint16_t *probabilities, float *row_max) {
    v16f top = v16f{} - INFINITY;
    for (int64_t i = 0; i < width; i += 16) {
        v16f s = load16(scores + i);
        if (i + 16 > visible)
            for (int lane = 0; lane < 16; lane++)
                if (i + lane >= visible) s[lane] = -INFINITY;
        top = top > s ? top : s;
    }
    float m = top[0];
    for (int lane = 1; lane < 16; lane++) m = top[lane] > m ? top[lane] : m;
    const float to_exp2 = p.scale * 1.44269504088896341f;
    v16f sum = v16f{};
    for (int64_t i = 0; i < width; i += 16) {
        v16f e = exp2_nonpositive((load16(scores + i) - m) * to_exp2);
        if (i + 16 > visible)
            for (int lane = 0; lane < 16; lane++)
                if (i + lane >= visible) e[lane] = 0.0f;
        sum += e;
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(probabilities + i),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(e))));
    }
    *row_max = m;
    return hsum(sum);
}

// Rows [16 * block, +16) of head h: scores, softmax, product with V, written to out and lse.
void attend_rows(const PrefixAttention &p, int64_t h, int64_t block, const uint16_t *queries,
                 const uint16_t *keys, const uint16_t *values, float *scores, uint16_t *probabilities) {
    const int64_t padded = p.padded_length(), steps = p.dim / 32;
    const uint16_t *q_rows = queries + block * 16 * p.dim;
    // Only the keys some row of the block sees (causal: its last row sees the most), in whole 32s.
    const int64_t last_row = std::min(block * 16 + 15, p.rows() - 1);
    const int64_t width = (p.visible(last_row) + 31) / 32 * 32;
    // Scores, two blocks of 16 keys at a time (C tiles 4 and 5; Q in 0, keys in 1 and 2).
    for (int64_t kb = 0; kb < width / 16; kb += 2) {
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t step = 0; step < steps; step++) {
            _tile_loadd(0, q_rows + step * 32, p.dim * 2);
            _tile_loadd(1, keys + (kb * steps + step) * kTileElements, 64);
            _tile_loadd(2, keys + ((kb + 1) * steps + step) * kTileElements, 64);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
        }
        _tile_stored(4, scores + kb * 16, padded * 4);
        _tile_stored(5, scores + (kb + 1) * 16, padded * 4);
    }
    float sums[16], maxima[16];
    for (int r = 0; r < 16; r++) {
        const int64_t row = block * 16 + r;
        if (row < p.rows())
            sums[r] = softmax_row(p, scores + r * padded, p.visible(row), width, probabilities + r * padded,
                                  &maxima[r]);
        else
            memset(probabilities + r * padded, 0, width * 2);
    }
    // P V, 64 output dimensions at a time (C tiles 4-7; P in 0, values in 1-3).
    alignas(64) float acc[16 * 64];
    for (int64_t d0 = 0; d0 < p.dim; d0 += 64) {
        const bool wide = p.dim - d0 >= 64;  // else 32 dimensions: tiles 4 and 5 only
        _tile_zero(4);
        _tile_zero(5);
        if (wide) {
            _tile_zero(6);
            _tile_zero(7);
        }
        for (int64_t step = 0; step < width / 32; step++) {
            const uint16_t *v_tiles = values + (step * (p.dim / 16) + d0 / 16) * kTileElements;
            _tile_loadd(0, probabilities + step * 32, padded * 2);
            _tile_loadd(1, v_tiles, 64);
            _tile_loadd(2, v_tiles + kTileElements, 64);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
            if (wide) {
                _tile_loadd(3, v_tiles + 2 * kTileElements, 64);
                _tile_dpbf16ps(6, 0, 3);
                _tile_loadd(1, v_tiles + 3 * kTileElements, 64);
                _tile_dpbf16ps(7, 0, 1);
            }
        }
        _tile_stored(4, acc, 64 * 4);
        _tile_stored(5, acc + 16, 64 * 4);
        if (wide) {
            _tile_stored(6, acc + 32, 64 * 4);
            _tile_stored(7, acc + 48, 64 * 4);
        }
        const int64_t columns = wide ? 64 : 32;
        for (int r = 0; r < 16; r++) {
            const int64_t row = block * 16 + r;
            if (row >= p.rows()) break;
            uint16_t *dst =
                p.out + (row / p.group) * p.out_token + h * p.out_head + (row % p.group) * p.out_query + d0;
            const float inverse = 1.0f / sums[r];
            for (int64_t c = 0; c < columns; c += 16) store16(dst + c, load16(acc + r * 64 + c) * inverse);
        }
    }
    if (p.lse)
        for (int r = 0; r < 16 && block * 16 + r < p.rows(); r++)
            p.lse[h * p.rows() + block * 16 + r] = maxima[r] * p.scale + logf(sums[r]);
}

void prefix_attention(const PrefixAttention &p) {
    const int64_t row_blocks = p.padded_rows() / 16, key_blocks = p.padded_length() / 16;
    const int64_t per_head_q = p.padded_rows() * p.dim, per_head_kv = p.padded_length() * p.dim;
    // Reused between calls of this thread (no zero-filling either: every element read is written
    // first).
    static thread_local std::vector<uint16_t> packed;
    const size_t needed = static_cast<size_t>(p.kv_heads * (per_head_q + 2 * per_head_kv));
    if (packed.size() < needed) packed.resize(needed);
    uint16_t *queries = packed.data(), *keys = queries + p.kv_heads * per_head_q,
             *values = keys + p.kv_heads * per_head_kv;
#pragma omp parallel
    {
        // Packing: the queries' row blocks, the keys' 16-key blocks and the values' 32-key steps of
        // every head, as one list of tasks (one barrier).
        const int64_t q_tasks = p.kv_heads * row_blocks, k_tasks = p.kv_heads * key_blocks;
        const int64_t v_tasks = p.kv_heads * (key_blocks / 2);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < q_tasks + k_tasks + v_tasks; task++) {
            if (task < q_tasks) {
                const int64_t h = task / row_blocks;
                pack_queries(p, h, task % row_blocks, queries + h * per_head_q);
            } else if (task < q_tasks + k_tasks) {
                const int64_t h = (task - q_tasks) / key_blocks, block = (task - q_tasks) % key_blocks;
                pack_keys(p, h, block, keys + h * per_head_kv + block * 16 * p.dim);
            } else {
                const int64_t h = (task - q_tasks - k_tasks) / (key_blocks / 2);
                const int64_t step = (task - q_tasks - k_tasks) % (key_blocks / 2);
                pack_values(p, h, step, values + h * per_head_kv + step * 32 * p.dim);
            }
        }
        static thread_local std::vector<float> scores;
        static thread_local std::vector<uint16_t> probabilities;
        if (scores.size() < static_cast<size_t>(16 * p.padded_length())) {
            scores.resize(16 * p.padded_length());
            probabilities.resize(16 * p.padded_length());
        }
        configure_tiles({16, 16, 16, 16, 16, 16, 16, 16});
#pragma omp for schedule(static) nowait
        for (int64_t task = 0; task < p.kv_heads * row_blocks; task++) {
            const int64_t h = task / row_blocks;
            attend_rows(p, h, task % row_blocks, queries + h * per_head_q, keys + h * per_head_kv,
                        values + h * per_head_kv, scores.data(), probabilities.data());
        }
        _tile_release();
    }
}

#endif  // RADIXSERVE_AMX

}  // namespace

// 0 when done; 1 when this build or shape has no kernel (no AMX, head_dim not a multiple of 32 up
// to 256, or heads not a multiple of kv_heads): the caller then uses torch.
// slots: the keys' rows in k and v, or null for rows 0 .. length - 1. out [Hkv, N * G, D] (and lse
// [Hkv, N * G]) when out_token is 0; else [N, H, D] with rows out_token apart, lse unused (null).
// causal_offset < 0: every query sees every key; else token t sees keys < causal_offset + t + 1.
extern "C" int amx_prefix_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                                         int64_t kv_stride, const int64_t *slots, uint16_t *out, int64_t out_token,
                                         float *lse, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim,
                                         int64_t length, float scale, int64_t causal_offset) {
#ifdef RADIXSERVE_AMX
    if (dim % 32 || dim > 256 || kv_heads <= 0 || heads % kv_heads || length <= 0 || n <= 0) return 1;
    const int64_t group = heads / kv_heads;
    // [Hkv, N * G, D]: token t's query g of head h at row t * G + g of head h's block.
    const int64_t token = out_token ? out_token : group * dim, head = out_token ? group * dim : n * group * dim;
    prefix_attention({q, q_stride, k, v, kv_stride, slots, out, token, head, dim, lse, n, kv_heads, group, dim,
                      length, scale, causal_offset});
    return 0;
#else
    (void)q, (void)q_stride, (void)k, (void)v, (void)kv_stride, (void)slots, (void)out, (void)out_token;
    (void)lse, (void)n, (void)heads, (void)kv_heads, (void)dim, (void)length, (void)scale, (void)causal_offset;
    return 1;
#endif
}
