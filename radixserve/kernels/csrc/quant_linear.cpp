// Matmul on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), loaded with
// cpu_kernels.cpp; the formats themselves are described in quant_formats.h.
//
// Why native: a decode step reads every weight once, so it runs at the speed the weights stream from
// memory; kept in the file's own blocks (4.5 to 8.5 bits a weight) they stream 2-3.5x faster than bf16.
//
// Method: integer dot products on 16-bit activations, with the weights packed at load so that one
// vector instruction multiplies 16 output columns at once.
// - Activations: each row's blocks of 32 are rounded to int16 (scale = max |x| / 32767, rounded half
//   to even), with their sums per 16. Their rounding error is 1/256 of an 8-bit block's (llama.cpp's
//   method), below what the bf16 residual stream carries (docs/architecture.md, "Quantized weights").
// - Weights (quant_pack): 16 columns interleaved per block, every value's bits in the word it
//   multiplies: a 32-byte chunk widens to 32 int16 (column c, inputs 2s and 2s + 1 in words 2c and
//   2c + 1), its low nibbles one step s and its high nibbles step s + 8; a fifth bit comes from a
//   bit plane (a mask register's worth per step), Q6_K's two high bits from 2-bit fields packed 4
//   steps to a byte. Headers keep each column's scales in the same order. The
//   packed bytes are as many as the file's (Q4_K, Q5_K: 2% more, the 6-bit scales as bytes).
// - Product: vpdpwssd (AVX-512 VNNI) or vpmaddwd + vpaddd (AVX-512, AVX2) sums each sub-block's products
//   per column exactly in int32 (a format's zero point, -8, -16 or -32, folded in as minus the
//   activations' sum); one fp32 fma per sub-block then adds it times (weight scale x activation
//   scale), and one more its minimum (Q4_1, Q5_1, Q4_K, Q5_K) times the activations' sum.
//
// Numerics: the integer sums are exact, and each output's fp32 steps run in one order, sub-block
// after sub-block, for every row count, tile, thread count and ISA (FMA intrinsics, never a
// contraction the compiler chooses): the kernel is row-invariant, a request's numbers never depend on
// its batch.
//
// Needs AVX2 + FMA + F16C (any x86-64-v3 CPU); quant_linear_isa() says 0 on a build without them and
// the weights are dequantized at load instead.

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "quant_formats.h"
#include "quant_vectors.h"
#include "vec16.h"

namespace {

using namespace quant_formats;

constexpr int kColumns = 16;            // columns per packed group
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead a tile's stream is prefetched

// Bytes of one packed sub-block of 32 inputs x 16 columns: the nibbles (or Q8_0's bytes), then a 5-bit
// format's bit plane (32 bits a step) or Q6_K's 2-bit fields (4 chunks of 32 bytes, chunk s % 4 holding
// step s's at bits 2 (s / 4) of each word's byte).
template <class F>
constexpr int sub_bytes() {
    return F::kBits == 8 ? 512 : 256 + 64 * (F::kBits - 4);
}
// Bytes of one packed block (a format block of each of the 16 columns).
template <class F>
constexpr int64_t group_block_bytes() {
    return F::kHeader + F::kSubs * sub_bytes<F>();
}
template <class F>
int64_t group_bytes(int64_t k) {
    return k / (32 * F::kSubs) * group_block_bytes<F>();
}

// Columns [16 g, 16 g + 16) of W (rows row_bytes apart; missing columns packed as zeros) into `out`.
template <class F>
void pack_group(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t k, int64_t g, uint8_t *out) {
    const int64_t blocks = k / (32 * F::kSubs);
    memset(out, 0, static_cast<size_t>(group_bytes<F>(k)));
    for (int c = 0; c < kColumns && kColumns * g + c < n; ++c) {
        const uint8_t *row = w + (kColumns * g + c) * row_bytes;
        for (int64_t blk = 0; blk < blocks; ++blk) {
            const uint8_t *b = row + blk * F::kBytes;
            uint8_t *h = out + blk * group_block_bytes<F>();
            F::pack_header(b, c, h);
            for (int sub = 0; sub < F::kSubs; ++sub) {
                uint8_t q[32];
                F::unpack_scalar(b, sub, q);
                uint8_t *dst = h + F::kHeader + sub * sub_bytes<F>();
                for (int s = 0; s < 16; ++s) {
                    for (int j = 0; j < 2; ++j) {
                        const int word = 2 * c + j, value = q[2 * s + j];
                        if constexpr (F::kBits == 8) {
                            dst[32 * s + word] = static_cast<uint8_t>(value);
                            continue;
                        }
                        dst[32 * (s % 8) + word] |= static_cast<uint8_t>((value & 0xf) << (s < 8 ? 0 : 4));
                        if constexpr (F::kBits == 6) {  // 2-bit fields: byte `word` of chunk s % 4
                            dst[256 + 32 * (s % 4) + word] |= static_cast<uint8_t>((value >> 4) << (2 * (s / 4)));
                            continue;
                        }
                        for (int bit = 4; bit < F::kBits; ++bit) {
                            uint32_t plane;
                            uint8_t *at = dst + 256 + 64 * (bit - 4) + 4 * s;
                            memcpy(&plane, at, 4);
                            plane |= static_cast<uint32_t>((value >> bit) & 1) << word;
                            memcpy(at, &plane, 4);
                        }
                    }
                }
            }
        }
    }
}

// The activations of one call: per row k int16 values, k / 32 fp32 scales, and the values' int32
// sums per 16 (which the formats' zero points and minimums multiply).
struct Activations {
    int16_t *values;
    float *scales;
    int32_t *sums;
    int64_t k;

    const int16_t *row_values(int64_t r) const { return values + r * k; }
    const float *row_scales(int64_t r) const { return scales + r * (k / 32); }
    const int32_t *row_sums(int64_t r) const { return sums + r * (k / 16); }

    static int64_t bytes(int64_t m, int64_t k) { return m * (2 * k + 4 * (k / 32) + 4 * (k / 16)); }
    static Activations in(uint8_t *buffer, int64_t m, int64_t k) {
        int16_t *values = reinterpret_cast<int16_t *>(buffer);
        float *scales = reinterpret_cast<float *>(buffer + 2 * m * k);
        return {values, scales, reinterpret_cast<int32_t *>(scales + m * (k / 32)), k};
    }
};

// One block of 32 inputs: scale = max |x| / 32767, values = round-half-even(x / scale).
inline void quantize_block(const float *x, int16_t *values, float *scale, int32_t *sums) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, x[i] < 0 ? -x[i] : x[i]);
    const float d = amax / 32767.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t lo = 0, hi = 0;
    for (int i = 0; i < 32; ++i) {
        const int v = std::clamp(static_cast<int>(__builtin_nearbyintf(x[i] * inverse)), -32767, 32767);
        values[i] = static_cast<int16_t>(v);
        (i < 16 ? lo : hi) += v;
    }
    *scale = d;
    sums[0] = lo;
    sums[1] = hi;
}

#if RADIXSERVE_QUANT_ISA

using namespace quant_vectors;

// One sub-block's coefficients for the 16 columns: the scale of its first and second 16 inputs
// (equal but for Q6_K) and the minimum it adds per unit of input (zero for most formats).
struct SubScales {
    Floats lo, hi, offset;
};
template <class F>
inline SubScales sub_scales(const uint8_t *h, int sub) {
    const Floats d = halves(h);
    if constexpr (F::kSubs == 1) {
        if constexpr (F::kMinimum) return {d, d, halves(h + 32)};  // Q4_1, Q5_1: d * q + m
        return {d, d, zero_f()};
    } else if constexpr (F::kSplit) {  // Q6_K
        return {mul(d, bytes_s8(h + 32 + 16 * (2 * sub))), mul(d, bytes_s8(h + 32 + 16 * (2 * sub + 1))), zero_f()};
    } else {  // Q4_K, Q5_K: d * scale * q - dmin * min
        const Floats scale = mul(d, bytes_u8(h + 64 + 16 * sub));
        return {scale, scale, neg(mul(halves(h + 32), bytes_u8(h + 192 + 16 * sub)))};
    }
}

// Step t's weights (inputs 2t, 2t + 1 of the sub-block, lo) and step t + 8's (inputs 16 + 2t, 17 + 2t, hi).
template <class F>
inline void unpack_steps(const uint8_t *q, int t, Ints &lo, Ints &hi) {
    if constexpr (F::kBits == 8) {
        lo = widen_s8(q + 32 * t);
        hi = widen_s8(q + 32 * (t + 8));
    } else {
        const Ints both = widen_u8(q + 32 * t);
        lo = low4(both);
        hi = high4(both);
        if constexpr (F::kBits == 6) {
            const Ints fields = widen_u8(q + 256 + 32 * (t % 4));
            lo = with_high2(lo, fields, 2 * (t / 4));
            hi = with_high2(hi, fields, 2 * (t / 4 + 2));
            return;
        }
        for (int bit = 4; bit < F::kBits; ++bit) {
            lo = add_bits(lo, q + 256 + 64 * (bit - 4) + 4 * t, static_cast<short>(1 << bit));
            hi = add_bits(hi, q + 256 + 64 * (bit - 4) + 4 * (t + 8), static_cast<short>(1 << bit));
        }
    }
}

// Independent integer sums per column and half, added at the sub-block's end (exact in int32, so the
// bits do not change): vpdpwssd accumulates in place, so a tile of one row and one group would
// otherwise run a sub-block's 16 products one after another, each waiting out the last's latency.
// vpmaddwd's sums are separate adds, off that path.
constexpr int sum_chains(int sums_per_tile) {
    return RADIXSERVE_QUANT_ISA == 4 && sums_per_tile < 4 ? 4 / sums_per_tile : 1;
}

// Bytes [first, end) of a packed block, kPrefetchBytes ahead.
inline void prefetch(const uint8_t *block, int64_t first, int64_t end) {
    for (int64_t line = first; line < end; line += 64)
        _mm_prefetch(reinterpret_cast<const char *>(block + kPrefetchBytes + line), _MM_HINT_T0);
}

// Rows [row, row + MR) x groups [g, g + NG) (16 NG columns) into result.
template <class F, int MR, int NG>
inline void tile(const uint8_t *packed, int64_t stride, int64_t g, int64_t row, const Activations &a,
                 float (*result)[NG * kColumns]) {
    const int64_t blocks = a.k / (32 * F::kSubs);
    Floats acc[MR][NG];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NG; ++j) acc[r][j] = zero_f();
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const uint8_t *h[NG];
        for (int j = 0; j < NG; ++j) {
            h[j] = packed + (g + j) * stride + blk * group_block_bytes<F>();
            // The hardware prefetcher alone runs too little ahead of a decode step's stream. One row
            // asks for a sub-block's lines at a time (below): a K-quant's block is 2 KB, and all its
            // lines asked for at once fill the load queue while the sub-blocks wait. A tile of more
            // rows reads from memory only in its first pass over a group, and asks once a block.
            if constexpr (MR > 1) prefetch(h[j], 0, group_block_bytes<F>());
        }
        for (int sub = 0; sub < F::kSubs; ++sub) {
            if constexpr (MR == 1) {
                for (int j = 0; j < NG; ++j)
                    prefetch(h[j], sub == 0 ? 0 : F::kHeader + sub * sub_bytes<F>(), F::kHeader + (sub + 1) * sub_bytes<F>());
            }
            const int64_t ab = blk * F::kSubs + sub;  // the activation block
            SubScales s[NG];
            for (int j = 0; j < NG; ++j) s[j] = sub_scales<F>(h[j], sub);
            const uint8_t *q[NG];
            for (int j = 0; j < NG; ++j) q[j] = h[j] + F::kHeader + sub * sub_bytes<F>();
            // Exact integer sums per column: one over the whole sub-block where its halves share a
            // scale (half the accumulator registers of two, so a tile holds more rows), one per half
            // for Q6_K, whose halves have scales of their own.
            constexpr int kSums = F::kSplit ? 2 : 1;
            constexpr int kChains = sum_chains(MR * NG * kSums);
            Ints sum[MR][NG][kSums][kChains];
            for (int r = 0; r < MR; ++r) {
                const int32_t *sums = a.row_sums(row + r) + 2 * ab;
                for (int j = 0; j < NG; ++j) {
                    if constexpr (F::kSplit) {
                        sum[r][j][0][0] = set_i32(-F::kIntOffset * sums[0]);
                        sum[r][j][1][0] = set_i32(-F::kIntOffset * sums[1]);
                    } else {
                        sum[r][j][0][0] = set_i32(-F::kIntOffset * (sums[0] + sums[1]));
                    }
                    for (int h = 0; h < kSums; ++h)
                        for (int c = 1; c < kChains; ++c) sum[r][j][h][c] = set_i32(0);
                }
            }
            for (int t = 0; t < 8; ++t) {
                const int c = t % kChains;
                Ints wl[NG], wh[NG];
                for (int j = 0; j < NG; ++j) unpack_steps<F>(q[j], t, wl[j], wh[j]);
                for (int r = 0; r < MR; ++r) {
                    const int16_t *x = a.row_values(row + r) + 32 * ab + 2 * t;
                    const Ints pl = pair_at(x), ph = pair_at(x + 16);
                    for (int j = 0; j < NG; ++j) {
                        sum[r][j][0][c] = dot(sum[r][j][0][c], wl[j], pl);
                        sum[r][j][kSums - 1][c] = dot(sum[r][j][kSums - 1][c], wh[j], ph);
                    }
                }
            }
            for (int r = 0; r < MR; ++r)
                for (int j = 0; j < NG; ++j)
                    for (int h = 0; h < kSums; ++h)
                        for (int c = 1; c < kChains; ++c) sum[r][j][h][0] = add_i32(sum[r][j][h][0], sum[r][j][h][c]);
            for (int r = 0; r < MR; ++r) {
                const float scale = a.row_scales(row + r)[ab];
                const Floats dx = set_f(scale);
                const int32_t *sums = a.row_sums(row + r) + 2 * ab;
                // The activations' sum, which a format's minimum multiplies.
                const Floats total = set_f(F::kMinimum ? scale * static_cast<float>(sums[0] + sums[1]) : 0.0f);
                for (int j = 0; j < NG; ++j) {
                    acc[r][j] = fma(to_float(sum[r][j][0][0]), mul(s[j].lo, dx), acc[r][j]);
                    if constexpr (F::kSplit) acc[r][j] = fma(to_float(sum[r][j][1][0]), mul(s[j].hi, dx), acc[r][j]);
                    if constexpr (F::kMinimum) acc[r][j] = fma(s[j].offset, total, acc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NG; ++j) store(result[r] + kColumns * j, acc[r][j]);
}

#else  // no AVX2: no kernel (the weights are dequantized at load; quant_linear_isa() == 0)

template <class F, int MR, int NG>
inline void tile(const uint8_t *, int64_t, int64_t, int64_t, const Activations &, float (*result)[NG * kColumns]) {
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NG * kColumns; ++c) result[r][c] = 0.0f;
}

#endif

// Rows per register tile beyond one row: a format with one integer sum per sub-block holds more (6
// measured faster than 4 and 8 at 256 rows with vpdpwssd, AVX-512 and AVX2 vpmaddwd alike).
template <class F>
constexpr int tile_rows() {
    return F::kSplit ? 4 : 6;
}
// Groups per register tile: as many as the registers hold (32 vectors with AVX-512, 16 with AVX2).
#ifdef RADIXSERVE_QUANT_512
constexpr int kTileGroups = 2;
#else
constexpr int kTileGroups = 1;
#endif
constexpr int64_t kRowBlock = 64;           // rows whose activations stay in L2 while a task's groups pass
constexpr int64_t kParallelWork = 1 << 11;  // m * n * k / 32 below which one thread does it all

struct Output {
    void *out;
    int64_t out_stride;
    bool bf16;
    const void *bias;
    const void *residual;
    int64_t residual_stride;
    int64_t n;

    float load(const void *p, int64_t i) const {
        return bf16 ? radixserve_vec::to_float(static_cast<const uint16_t *>(p)[i]) : static_cast<const float *>(p)[i];
    }
    void store(int64_t row, int64_t col, float value) const {
        if (bias) value += load(bias, col);
        if (residual) value += load(residual, row * residual_stride + col);
        if (bf16)
            static_cast<uint16_t *>(out)[row * out_stride + col] = radixserve_vec::float_to_bf16(value);
        else
            static_cast<float *>(out)[row * out_stride + col] = value;
    }
};

template <class F, int MR, int NG>
inline void run_tile(const uint8_t *packed, int64_t stride, int64_t g, int64_t row, const Activations &a,
                     const Output &o) {
    float result[MR][NG * kColumns];
    tile<F, MR, NG>(packed, stride, g, row, a, result);
    const int64_t first = kColumns * g, columns = std::min<int64_t>(NG * kColumns, o.n - first);
    for (int r = 0; r < MR; ++r)
        for (int64_t c = 0; c < columns; ++c) o.store(row + r, first + c, result[r][c]);
}

// Groups [first, last) for rows [row, row + rows): one row takes one group a tile (one stream of
// weights per thread reads memory faster than two; measured), more rows tile_rows x kTileGroups.
template <class F>
inline void groups(const uint8_t *packed, int64_t stride, int64_t first, int64_t last, int64_t row, int64_t rows,
                   const Activations &a, const Output &o) {
    if (rows == 1) {
        for (int64_t g = first; g < last; ++g) run_tile<F, 1, 1>(packed, stride, g, row, a, o);
        return;
    }
    constexpr int MR = tile_rows<F>();
    const auto pass = [&]<int NG>(int64_t g) {
        int64_t at = row;
        const int64_t end = row + rows;
        for (; at + MR <= end; at += MR) run_tile<F, MR, NG>(packed, stride, g, at, a, o);
        const auto rest = [&]<int R>() {
            if constexpr (R > 0) {
                if (end - at == R) run_tile<F, R, NG>(packed, stride, g, at, a, o);
            }
        };
        [&]<int... R>(std::integer_sequence<int, R...>) {
            (rest.template operator()<R>(), ...);
        }(std::make_integer_sequence<int, MR>{});
    };
    int64_t g = first;
    for (; g + kTileGroups <= last; g += kTileGroups) pass.template operator()<kTileGroups>(g);
    for (; g < last; ++g) pass.template operator()<1>(g);
}

template <template <class> class Op, class... Args>
bool dispatch(int type, Args... args) {
    switch (type) {
        case kQ4_0: Op<Q4_0>::run(args...); return true;
        case kQ4_1: Op<Q4_1>::run(args...); return true;
        case kQ5_0: Op<Q5_0>::run(args...); return true;
        case kQ5_1: Op<Q5_1>::run(args...); return true;
        case kQ8_0: Op<Q8_0>::run(args...); return true;
        case kQ4_K: Op<Q4_K>::run(args...); return true;
        case kQ5_K: Op<Q5_K>::run(args...); return true;
        case kQ6_K: Op<Q6_K>::run(args...); return true;
        default: return false;
    }
}

// Column groups [first, last) of one packed weight for rows [row, row + rows) of `a`.
template <class F>
struct GroupsOp {
    static void run(const uint8_t *packed, int64_t first, int64_t last, int64_t row, int64_t rows,
                    const Activations *a, const Output *o) {
        const int64_t stride = group_bytes<F>(a->k);
        for (int64_t r = row; r < row + rows; r += kRowBlock)
            groups<F>(packed, stride, first, last, r, std::min(kRowBlock, row + rows - r), *a, *o);
    }
};

template <class F>
struct PackedBytesOp {
    static void run(int64_t n, int64_t k, int64_t *bytes) {
        *bytes = (n + kColumns - 1) / kColumns * group_bytes<F>(k);
    }
};

template <class F>
struct PackOp {
    static void run(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t k, uint8_t *out) {
        const int64_t count = (n + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < count; ++g) pack_group<F>(w, n, row_bytes, k, g, out + g * group_bytes<F>(k));
    }
};

template <class F>
struct DequantizeOp {
    static void run(const uint8_t *w, int64_t row_bytes, const int64_t *rows, int64_t count, int64_t k, float *out) {
        const bool parallel = count * k >= (1 << 16);
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t i = 0; i < count; ++i) dequantize_row<F>(w + rows[i] * row_bytes, k, out + i * k);
    }
};

// x [m, k] (rows x_stride apart; bf16 when x_bf16, else fp32) into `buffer` as int16 blocks.
void prepare_activations(const void *x, int64_t x_stride, int x_bf16, int64_t m, int64_t k, uint8_t *buffer) {
    const Activations a = Activations::in(buffer, m, k);
    const bool parallel = m * k >= (1 << 16);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r = 0; r < m; ++r) {
        float block[32];
        for (int64_t blk = 0; blk < k / 32; ++blk) {
            const int64_t at = r * x_stride + 32 * blk;
            for (int i = 0; i < 32; ++i)
                block[i] = x_bf16 ? radixserve_vec::to_float(static_cast<const uint16_t *>(x)[at + i])
                                  : static_cast<const float *>(x)[at + i];
            quantize_block(block, a.values + r * k + 32 * blk, a.scales + r * (k / 32) + blk,
                           a.sums + r * (k / 16) + 2 * blk);
        }
    }
}

}  // namespace

// 4: vpdpwssd on AVX-512 (VNNI); 3: AVX-512 vpmaddwd; 1: AVX2 vpmaddwd; 0: no kernel in this build.
extern "C" int quant_linear_isa() { return RADIXSERVE_QUANT_ISA; }

// The bytes quant_pack writes for W [n, k] of ggml type `type` (0: a type without a kernel).
extern "C" int64_t quant_packed_bytes(int type, int64_t n, int64_t k) {
    int64_t bytes = 0;
    return dispatch<PackedBytesOp>(type, n, k, &bytes) ? bytes : 0;
}

// W [n, k] of ggml type `type` (rows row_bytes apart, as the GGUF file holds them) into the kernel's
// packed layout at `out` (quant_packed_bytes). Returns 0 for a type without a kernel.
extern "C" int quant_pack(int type, const uint8_t *w, int64_t n, int64_t row_bytes, int64_t k, uint8_t *out) {
    return dispatch<PackOp>(type, w, n, row_bytes, k, out) ? 1 : 0;
}

namespace {

// A run of one part's column groups [first, last), and its weight bytes.
struct PartTask {
    int64_t part, first, last;
    double cost;
};

// Runs every item (each with a cost) once, in one parallel region (when `parallel`): each thread
// takes one run of consecutive items of about equal cost, so that it reads one stream of weights,
// as one matmul's static split reads them (items handed out one by one interleave the threads'
// streams, and each restarts the prefetch).
template <class Item, class Run>
void run_in_runs(const std::vector<Item> &items, bool parallel, const Run &run) {
    double total = 0.0;
    for (const Item &item : items) total += item.cost;
#pragma omp parallel if (parallel)
    {
        const double share = total / omp_get_num_threads();
        const int thread = omp_get_thread_num();
        double before = 0.0;
        for (const Item &item : items) {
            const double middle = before + item.cost / 2;
            before += item.cost;
            if (static_cast<int>(middle / share) == thread) run(item);
        }
    }
}

}  // namespace

// out [m, sum of rows] (rows out_stride apart) = x W^T (+ bias) (+ residual, rows residual_stride
// apart) for W the stacked parts: x is prepared once (in a per-thread buffer) for every part. x, out,
// bias and residual are bf16 when bf16, else fp32; bias and residual may be null. Returns 0 for a type
// or part count without a kernel here.
extern "C" int quant_linear_parts(const int64_t *parts_layout, const void *x, int64_t x_stride, int bf16, int64_t m,
                                  int64_t k, void *out, int64_t out_stride, const void *bias, const void *residual,
                                  int64_t residual_stride) {
    QuantParts parts;
    memcpy(&parts, parts_layout, sizeof(parts));
    if (!RADIXSERVE_QUANT_ISA || parts.count < 1 || parts.count > kMaxParts) return 0;
    if (m <= 0) return 1;
    static thread_local std::vector<uint8_t> buffer;
    const size_t needed = static_cast<size_t>(Activations::bytes(m, k));
    if (buffer.size() < needed) buffer.resize(needed);
    prepare_activations(x, x_stride, bf16, m, k, buffer.data());
    const Activations a = Activations::in(buffer.data(), m, k);
    const int64_t size = bf16 ? 2 : 4;
    Output outputs[kMaxParts];
    // Every part's column groups in runs of a few (tasks), all of one parallel region, so that a
    // thread's stream of weights runs on across the parts.
    const int threads = omp_get_max_threads();
    static thread_local std::vector<PartTask> tasks;
    tasks.clear();
    int64_t offset = 0, work = 0;
    for (int64_t p = 0; p < parts.count; ++p) {
        outputs[p] = Output{static_cast<char *>(out) + offset * size,
                            out_stride,
                            bf16 != 0,
                            bias ? static_cast<const char *>(bias) + offset * size : nullptr,
                            residual ? static_cast<const char *>(residual) + offset * size : nullptr,
                            residual_stride,
                            parts.rows[p]};
        int64_t bytes = 0;
        if (!dispatch<PackedBytesOp>(static_cast<int>(parts.type[p]), parts.rows[p], k, &bytes)) return 0;
        const int64_t count = (parts.rows[p] + kColumns - 1) / kColumns;
        const int64_t chunk = std::clamp<int64_t>(count / (4 * threads) / 2 * 2, 2, 16);
        for (int64_t first = 0; first < count; first += chunk) {
            const int64_t last = std::min(count, first + chunk);
            tasks.push_back({p, first, last, static_cast<double>(bytes / count * (last - first))});
        }
        offset += parts.rows[p];
        work += parts.rows[p];
    }
    // The threads read the calling thread's list (a reference to its thread_local).
    run_in_runs(tasks, m * work * (k / 32) >= kParallelWork, [&](const PartTask &task) {
        dispatch<GroupsOp>(static_cast<int>(parts.type[task.part]), parts.data[task.part], task.first, task.last,
                           int64_t{0}, m, &a, &outputs[task.part]);
    });
    return 1;
}

extern "C" {
void silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows, int64_t size);
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t size);
}

namespace {

constexpr int64_t kExpertGroups = 4;  // column groups per work item of an expert pass

struct ExpertItem {
    int64_t expert, part, first, last;
    double cost;  // its weight bytes times (its rows + 2): streaming them, then multiplying
};

// One work item of expert_pass: a run of one expert part's column groups on the expert's rows.
void run_expert_item(const ExpertItem &item, const QuantParts &w, const int64_t *offsets, const Activations &a,
                     bool bf16, void *out, int64_t out_stride) {
    int64_t offset = 0;
    for (int64_t p = 0; p < item.part; ++p) offset += w.rows[p];
    const Output o{static_cast<char *>(out) + offset * (bf16 ? 2 : 4), out_stride, bf16, nullptr, nullptr, 0,
                   w.rows[item.part]};
    const int64_t row = offsets[item.expert], rows = offsets[item.expert + 1] - row;
    dispatch<GroupsOp>(static_cast<int>(w.type[item.part]), w.data[item.part], item.first, item.last, row, rows, &a,
                       &o);
}

// Each expert's weight (layouts: kLayoutWords int64s each) on its rows [offsets[e], offsets[e + 1]) of
// `a`, into out (rows out_stride apart), the parts side by side: every expert's column groups are
// work items of one parallel region. False for a layout without a kernel.
bool expert_pass(const int64_t *layouts, int64_t experts, const int64_t *offsets, const Activations &a, bool bf16,
                 void *out, int64_t out_stride) {
    std::vector<QuantParts> weights(experts);
    std::vector<ExpertItem> items;
    int64_t bytes = 0;
    for (int64_t e = 0; e < experts; ++e) {
        QuantParts &w = weights[e];
        memcpy(&w, layouts + e * kLayoutWords, sizeof(w));
        if (w.count < 1 || w.count > kMaxParts) return false;
        for (int64_t p = 0; p < w.count; ++p) {
            if (!dispatch<PackedBytesOp>(static_cast<int>(w.type[p]), w.rows[p], a.k, &bytes)) return false;
            if (offsets[e + 1] == offsets[e]) continue;
            const int64_t count = (w.rows[p] + kColumns - 1) / kColumns;
            const double group_cost = static_cast<double>(bytes / count) * (offsets[e + 1] - offsets[e] + 2);
            for (int64_t first = 0; first < count; first += kExpertGroups) {
                const int64_t last = std::min(count, first + kExpertGroups);
                items.push_back({e, p, first, last, group_cost * (last - first)});
            }
        }
    }
    run_in_runs(items, true, [&](const ExpertItem &item) {
        run_expert_item(item, weights[item.expert], offsets, a, bf16, out, out_stride);
    });
    return true;
}

}  // namespace

// A Mixture-of-Experts layer's routed experts (moe.cpp's moe_experts): x [rows, k] holds the rows
// routed to each expert, grouped by expert (expert e's from offsets[e] to offsets[e + 1]); gate_up and down
// are the experts' parts layouts (kLayoutWords int64s each; gate_up's rows: inter gate rows, then
// inter up rows). out [rows, hidden] = down_e(silu(gate_e x) * up_e x), in x's dtype (bf16 when
// bf16). Each row's numbers are those quant_linear_parts and silu_and_mul give it alone, as the
// kernel is row-invariant; what this adds is one parallel region per projection for all the experts
// of a step, in place of one per matmul of each expert. Returns 0 for a layout without a kernel.
extern "C" int quant_experts(const int64_t *gate_up, const int64_t *down, int64_t experts, const int64_t *offsets,
                             const void *x, int bf16, int64_t k, int64_t inter, void *out, int64_t hidden) {
    if (!RADIXSERVE_QUANT_ISA || experts < 1) return 0;
    const int64_t m = offsets[experts], size = bf16 ? 2 : 4;
    if (m <= 0) return 1;
    static thread_local std::vector<uint8_t> x_blocks, h_blocks;
    static thread_local std::vector<char> up, hidden_values;
    x_blocks.resize(std::max<size_t>(x_blocks.size(), static_cast<size_t>(Activations::bytes(m, k))));
    h_blocks.resize(std::max<size_t>(h_blocks.size(), static_cast<size_t>(Activations::bytes(m, inter))));
    up.resize(std::max<size_t>(up.size(), static_cast<size_t>(m * 2 * inter * size)));
    hidden_values.resize(std::max<size_t>(hidden_values.size(), static_cast<size_t>(m * inter * size)));
    prepare_activations(x, k, bf16, m, k, x_blocks.data());
    if (!expert_pass(gate_up, experts, offsets, Activations::in(x_blocks.data(), m, k), bf16 != 0, up.data(),
                     2 * inter))
        return 0;
    if (bf16)
        silu_and_mul_bf16(reinterpret_cast<const uint16_t *>(up.data()), 2 * inter,
                          reinterpret_cast<uint16_t *>(hidden_values.data()), m, inter);
    else
        silu_and_mul_f32(reinterpret_cast<const float *>(up.data()), 2 * inter,
                         reinterpret_cast<float *>(hidden_values.data()), m, inter);
    prepare_activations(hidden_values.data(), inter, bf16, m, inter, h_blocks.data());
    return expert_pass(down, experts, offsets, Activations::in(h_blocks.data(), m, inter), bf16 != 0, out, hidden)
               ? 1
               : 0;
}

// out [count, k] fp32 = rows `rows` of W (ggml type `type`, rows row_bytes apart, as the file holds
// them) dequantized: the embedding lookup of a quantized table, and reading a quantized weight back.
// Returns 0 for a type without a kernel.
extern "C" int quant_dequantize_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *rows,
                                     int64_t count, int64_t k, float *out) {
    return dispatch<DequantizeOp>(type, w, row_bytes, rows, count, k, out) ? 1 : 0;
}
