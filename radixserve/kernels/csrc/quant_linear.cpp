// Matmul on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), loaded with
// cpu_kernels.cpp.
//
// Why native: a decode step reads every weight once, so it runs at the speed the weights stream from
// memory; kept in the file's own blocks (4.5 to 8.5 bits a weight) they stream 2-3.5x faster than bf16.
//
// Weight layout: the GGUF tensor's bytes as the file holds them, one row (output column) after
// another, each row a run of ggml blocks. Nothing is repacked, so a layer narrows, concatenates or
// dequantizes its rows as plain byte slices.
//
// Method (the one llama.cpp uses, written anew here): the activations are quantized once per call to
// 8-bit blocks of 32 (an fp32 scale, the int8 values, and their sums per 16), and every weight block
// is unpacked in registers to unsigned bytes (Q8_0: signed) and multiplied with them in integers
// (vpmaddubsw + vpmaddwd, or one vpdpbusd with AVX-512 VNNI / AVX-VNNI). Every 32-weight sub-block
// then adds its integer sum times (activation scale x weight scale) to an fp32 accumulator, and its
// offset (a format's minimum or -8, -16, -32 zero point) times the activation block's sum to a
// scalar. The accuracy this costs: docs/architecture.md, "Quantized weights".
//
// Numerics: every output element is summed in one fixed order, the same for every row count, tile,
// thread count and call (FMA intrinsics, never a contraction the compiler chooses), so the kernel is
// row-invariant: a request's numbers never depend on its batch.
//
// Needs AVX2 + FMA + F16C (any x86-64-v3 CPU); quant_linear_isa() says 0 on a build without them and
// the weights are dequantized at load instead.

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "vec16.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RADIXSERVE_QUANT_ISA 2
#elif defined(__AVXVNNI__)
#define RADIXSERVE_QUANT_ISA 2
#else
#define RADIXSERVE_QUANT_ISA 1
#endif
#else
#define RADIXSERVE_QUANT_ISA 0
#endif
// The kFloat kernel on 16-lane vectors (else on 8-lane ones).
#if RADIXSERVE_QUANT_ISA && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_QUANT_FLOAT512 1
#endif

// ggml's type ids, as GGUF stores them.
enum QuantType : int {
    kQ4_0 = 2,
    kQ4_1 = 3,
    kQ5_0 = 6,
    kQ5_1 = 7,
    kQ8_0 = 8,
    kQ4_K = 12,
    kQ5_K = 13,
    kQ6_K = 14,
};

namespace {

inline float half_to_float(uint16_t h) {
#if RADIXSERVE_QUANT_ISA
    return _cvtsh_ss(h);
#else
    // A build without F16C: exact for every fp16 value (normal, subnormal, inf, nan), as F16C is.
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f;
    uint32_t mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

// A sub-block's weights are scale * q + offset, where q is its unsigned byte; Q6_K's two halves of 16 (kSplit)
// have their own scale and offset (lo: bytes 0-15, hi: bytes 16-31).
struct SubCoef {
    float scale_lo, scale_hi, offset_lo, offset_hi;
};

// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j from the 12 packed bytes.
inline void k4_scale_min(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Each format: its block's bytes and elements, its 32-element sub-blocks, the coefficients of each
// sub-block (coefs), and one sub-block's values (scalar: unpack_scalar; AVX2: unpack).
struct Q4_0 {
    static constexpr int kBytes = 18, kSubs = 1, kBits = 4;
    static constexpr bool kSigned = false, kSplit = false;
    static void coefs(const uint8_t *b, SubCoef *c) {
        const float d = half_to_float(read_u16(b));
        c[0] = {d, d, -8.0f * d, -8.0f * d};
    }
    static void unpack_scalar(const uint8_t *b, int, uint8_t *q) {
        for (int i = 0; i < 16; ++i) q[i] = b[2 + i] & 0xf, q[i + 16] = b[2 + i] >> 4;
    }
};
struct Q4_1 {
    static constexpr int kBytes = 20, kSubs = 1, kBits = 4;
    static constexpr bool kSigned = false, kSplit = false;
    static void coefs(const uint8_t *b, SubCoef *c) {
        const float d = half_to_float(read_u16(b)), m = half_to_float(read_u16(b + 2));
        c[0] = {d, d, m, m};
    }
    static void unpack_scalar(const uint8_t *b, int, uint8_t *q) {
        for (int i = 0; i < 16; ++i) q[i] = b[4 + i] & 0xf, q[i + 16] = b[4 + i] >> 4;
    }
};
struct Q5_0 {
    static constexpr int kBytes = 22, kSubs = 1, kBits = 5;
    static constexpr bool kSigned = false, kSplit = false;
    static void coefs(const uint8_t *b, SubCoef *c) {
        const float d = half_to_float(read_u16(b));
        c[0] = {d, d, -16.0f * d, -16.0f * d};
    }
    static void unpack_scalar(const uint8_t *b, int, uint8_t *q) {
        uint32_t high;
        memcpy(&high, b + 2, 4);
        for (int i = 0; i < 16; ++i) {
            q[i] = (b[6 + i] & 0xf) | (((high >> i) & 1) << 4);
            q[i + 16] = (b[6 + i] >> 4) | (((high >> (i + 16)) & 1) << 4);
        }
    }
};
struct Q5_1 {
    static constexpr int kBytes = 24, kSubs = 1, kBits = 5;
    static constexpr bool kSigned = false, kSplit = false;
    static void coefs(const uint8_t *b, SubCoef *c) {
        const float d = half_to_float(read_u16(b)), m = half_to_float(read_u16(b + 2));
        c[0] = {d, d, m, m};
    }
    static void unpack_scalar(const uint8_t *b, int, uint8_t *q) {
        uint32_t high;
        memcpy(&high, b + 4, 4);
        for (int i = 0; i < 16; ++i) {
            q[i] = (b[8 + i] & 0xf) | (((high >> i) & 1) << 4);
            q[i + 16] = (b[8 + i] >> 4) | (((high >> (i + 16)) & 1) << 4);
        }
    }
};
struct Q8_0 {
    static constexpr int kBytes = 34, kSubs = 1, kBits = 8;
    static constexpr bool kSigned = true, kSplit = false;
    static void coefs(const uint8_t *b, SubCoef *c) {
        const float d = half_to_float(read_u16(b));
        c[0] = {d, d, 0.0f, 0.0f};
    }
    static void unpack_scalar(const uint8_t *b, int, uint8_t *q) { memcpy(q, b + 2, 32); }
};
struct Q4_K {
    static constexpr int kBytes = 144, kSubs = 8, kBits = 4;
    static constexpr bool kSigned = false, kSplit = false;
    static void coefs(const uint8_t *b, SubCoef *c) {
        const float d = half_to_float(read_u16(b)), dmin = half_to_float(read_u16(b + 2));
        for (int j = 0; j < 8; ++j) {
            int scale, min;
            k4_scale_min(j, b + 4, &scale, &min);
            const float s = d * static_cast<float>(scale), o = -(dmin * static_cast<float>(min));
            c[j] = {s, s, o, o};
        }
    }
    static void unpack_scalar(const uint8_t *b, int sub, uint8_t *q) {
        const uint8_t *qs = b + 16 + 32 * (sub / 2);
        const int shift = 4 * (sub & 1);
        for (int i = 0; i < 32; ++i) q[i] = (qs[i] >> shift) & 0xf;
    }
};
struct Q5_K {
    static constexpr int kBytes = 176, kSubs = 8, kBits = 5;
    static constexpr bool kSigned = false, kSplit = false;
    static void coefs(const uint8_t *b, SubCoef *c) { Q4_K::coefs(b, c); }
    static void unpack_scalar(const uint8_t *b, int sub, uint8_t *q) {
        const uint8_t *high = b + 16, *qs = b + 48 + 32 * (sub / 2);
        const int shift = 4 * (sub & 1);
        for (int i = 0; i < 32; ++i) q[i] = ((qs[i] >> shift) & 0xf) | (((high[i] >> sub) & 1) << 4);
    }
};
struct Q6_K {
    static constexpr int kBytes = 210, kSubs = 8, kBits = 6;
    static constexpr bool kSigned = false, kSplit = true;
    static void coefs(const uint8_t *b, SubCoef *c) {
        const float d = half_to_float(read_u16(b + 208));
        const int8_t *scales = reinterpret_cast<const int8_t *>(b + 192);
        for (int j = 0; j < 8; ++j) {
            // Sub-block j: 128-element half j / 4, quarter g = j % 4, whose scales are 2g and 2g + 1.
            const int base = 8 * (j / 4) + 2 * (j % 4);
            const float lo = d * static_cast<float>(scales[base]), hi = d * static_cast<float>(scales[base + 1]);
            c[j] = {lo, hi, -32.0f * lo, -32.0f * hi};
        }
    }
    static void unpack_scalar(const uint8_t *b, int sub, uint8_t *q) {
        const int half = sub / 4, quarter = sub % 4;
        const uint8_t *low = b + 64 * half + 32 * (quarter & 1), *high = b + 128 + 32 * half;
        const int shift = 4 * (quarter >> 1);
        for (int i = 0; i < 32; ++i) q[i] = ((low[i] >> shift) & 0xf) | (((high[i] >> (2 * quarter)) & 3) << 4);
    }
};

// The activations of one call, in one of two forms (Mode): kInt8, per row K int8 values, K / 32
// scales and K / 16 sums of the values (as floats: exact), which the formats' offsets multiply;
// kFloat, per row K fp32 values.
enum Mode : int { kInt8 = 0, kFloat = 1 };

struct Activations {
    const int8_t *values;
    const float *floats;
    const float *scales;
    const float *sums;
    int64_t k;
    const int8_t *row_values(int64_t r) const { return values + r * k; }
    const float *row_floats(int64_t r) const { return floats + r * k; }
    const float *row_scales(int64_t r) const { return scales + r * (k / 32); }
    const float *row_sums(int64_t r) const { return sums + r * (k / 16); }

    static int64_t bytes(int mode, int64_t m, int64_t k) {
        return mode == kFloat ? m * 4 * k : m * (k + k / 32 * 4 + k / 16 * 4);
    }
    static Activations in(int mode, uint8_t *buffer, int64_t m, int64_t k) {
        if (mode == kFloat) return {nullptr, reinterpret_cast<float *>(buffer), nullptr, nullptr, k};
        float *scales = reinterpret_cast<float *>(buffer + m * k);
        return {reinterpret_cast<int8_t *>(buffer), nullptr, scales, scales + m * (k / 32), k};
    }
};

inline uint16_t float_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One 32-element block of a row: scale = max |x| / 127, values = round-half-even(x / scale).
inline void quantize_block(const float *x, int8_t *values, float *scale, float *sums) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, x[i] < 0 ? -x[i] : x[i]);
    const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int lo = 0, hi = 0;
    for (int i = 0; i < 32; ++i) {
        const int v = static_cast<int>(__builtin_nearbyintf(x[i] * inverse));
        values[i] = static_cast<int8_t>(v);
        (i < 16 ? lo : hi) += v;
    }
    *scale = d;
    sums[0] = static_cast<float>(lo);
    sums[1] = static_cast<float>(hi);
}

#if RADIXSERVE_QUANT_ISA

// One sub-block's 32 unsigned (Q8_0: signed) bytes in a register, from the format's scalar layout
// description (the vector forms below are what the hot loop runs).
template <class F>
inline __m256i unpack(const uint8_t *b, int sub);

inline __m256i low_high_nibbles(const uint8_t *p) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// 32 bits to 32 bytes, 0x10 where the bit is set.
inline __m256i bits_to_0x10(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

template <>
inline __m256i unpack<Q4_0>(const uint8_t *b, int) {
    return low_high_nibbles(b + 2);
}
template <>
inline __m256i unpack<Q4_1>(const uint8_t *b, int) {
    return low_high_nibbles(b + 4);
}
template <>
inline __m256i unpack<Q5_0>(const uint8_t *b, int) {
    uint32_t high;
    memcpy(&high, b + 2, 4);
    return _mm256_or_si256(low_high_nibbles(b + 6), bits_to_0x10(high));
}
template <>
inline __m256i unpack<Q5_1>(const uint8_t *b, int) {
    uint32_t high;
    memcpy(&high, b + 4, 4);
    return _mm256_or_si256(low_high_nibbles(b + 8), bits_to_0x10(high));
}
template <>
inline __m256i unpack<Q8_0>(const uint8_t *b, int) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 2));
}
inline __m256i nibbles(const uint8_t *p, int odd) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    return _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(4 * odd)), _mm256_set1_epi8(0x0f));
}
template <>
inline __m256i unpack<Q4_K>(const uint8_t *b, int sub) {
    return nibbles(b + 16 + 32 * (sub / 2), sub & 1);
}
template <>
inline __m256i unpack<Q5_K>(const uint8_t *b, int sub) {
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16));
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(sub)), _mm256_set1_epi8(1));
    return _mm256_or_si256(nibbles(b + 48 + 32 * (sub / 2), sub & 1), _mm256_slli_epi16(bit, 4));
}
template <>
inline __m256i unpack<Q6_K>(const uint8_t *b, int sub) {
    const int half = sub / 4, quarter = sub % 4;
    const __m256i low = nibbles(b + 64 * half + 32 * (quarter & 1), quarter >> 1);
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 128 + 32 * half));
    const __m256i two = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * quarter)), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(two, 4));
}

// 8 int32 lanes: lane i the sum of q[4i..4i+3] * a[4i..4i+3] (q unsigned, a signed).
inline __m256i dot_u8_s8(__m256i q, __m256i a) {
#if RADIXSERVE_QUANT_ISA == 2
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, a);
#else
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, a);
#endif
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1));
#endif
}

template <class F>
inline __m256i dot_sub(__m256i q, __m256i a) {
    if constexpr (F::kSigned) return dot_u8_s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
    return dot_u8_s8(q, a);
}

template <class F>
inline void prefetch_block(const uint8_t *p) {
    for (int line = 0; line < F::kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char *>(p + line), _MM_HINT_T0);
}

inline float hsum8(__m256 v) {
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// Output columns [col, col + NC) for rows [row, row + MR): each weight sub-block is unpacked once for
// the MR rows, each activation block loaded once for the NC columns.
template <class F, int MR, int NC>
inline void tile(const uint8_t *w, int64_t row_bytes, int64_t col, int64_t row, const Activations &a,
                 float (*result)[NC]) {
    const int64_t blocks = a.k / (32 * F::kSubs);
    __m256 acc[MR][NC];
    float offsets[MR][NC];  // kInt8
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps(), offsets[r][c] = 0.0f;
    for (int64_t blk = 0; blk < blocks; ++blk) {
        SubCoef coefs[NC][F::kSubs];
        const uint8_t *block[NC];
        for (int c = 0; c < NC; ++c) {
            block[c] = w + (col + c) * row_bytes + blk * F::kBytes;
            // The same block of the next tile's columns: a tile reads NC rows of W at once, too many
            // streams for the hardware prefetcher to run ahead of (decode is bound by memory).
            prefetch_block<F>(block[c] + NC * row_bytes);
            F::coefs(block[c], coefs[c]);
        }
        for (int sub = 0; sub < F::kSubs; ++sub) {
            const int64_t ab = blk * F::kSubs + sub;  // the activation block
            __m256i q[NC];
            for (int c = 0; c < NC; ++c) q[c] = unpack<F>(block[c], sub);
            for (int r = 0; r < MR; ++r) {
                const int64_t rr = row + r;
                const __m256i values =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.row_values(rr) + 32 * ab));
                const float scale = a.row_scales(rr)[ab];
                const float sum_lo = a.row_sums(rr)[2 * ab], sum_hi = a.row_sums(rr)[2 * ab + 1];
                for (int c = 0; c < NC; ++c) {
                    const SubCoef &k = coefs[c][sub];
                    // Lanes 0-3 hold the products of bytes 0-15, lanes 4-7 those of bytes 16-31.
                    const __m256 factor =
                        F::kSplit ? _mm256_mul_ps(_mm256_set1_ps(scale),
                                                  _mm256_setr_ps(k.scale_lo, k.scale_lo, k.scale_lo, k.scale_lo,
                                                                 k.scale_hi, k.scale_hi, k.scale_hi, k.scale_hi))
                                  : _mm256_set1_ps(scale * k.scale_lo);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_sub<F>(q[c], values)), factor, acc[r][c]);
                    if constexpr (!F::kSigned) {
                        const float offset = __builtin_fmaf(k.offset_lo, sum_lo, k.offset_hi * sum_hi);
                        offsets[r][c] = __builtin_fmaf(scale, offset, offsets[r][c]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) result[r][c] = hsum8(acc[r][c]) + offsets[r][c];
}

// ---- kFloat: the weights dequantized in registers, against fp32 activations ----------------------
//
// One arithmetic for every row count, so the kernel stays row-invariant: each weight is dequantized
// to fp32 as fma(q, scale, offset), and each output is an fp32 vector accumulator of w * x over k in
// order (lane i takes k = i mod the vector width), reduced once at the end. A few rows (decode) use
// the dequantized weights straight from registers; more rows dequantize a tile's columns once into a
// scratch buffer and read them for every row: the same values, added in the same order.

#ifdef RADIXSERVE_QUANT_FLOAT512
using FloatVec = __m512;
constexpr int kLanes = 16, kFloatColumns = 4, kDirectRows = 4;
inline FloatVec fv_zero() { return _mm512_setzero_ps(); }
inline FloatVec fv_load(const float *p) { return _mm512_loadu_ps(p); }
inline void fv_store(float *p, FloatVec v) { _mm512_storeu_ps(p, v); }
inline FloatVec fv_fma(FloatVec a, FloatVec b, FloatVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FloatVec fv_set1(float x) { return _mm512_set1_ps(x); }
inline float fv_sum(FloatVec v) { return _mm512_reduce_add_ps(v); }
// 16 bytes of a sub-block as one vector.
template <class F>
inline void bytes_to_floats(__m128i bytes, FloatVec *out) {
    out[0] = _mm512_cvtepi32_ps(F::kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
}
#else
using FloatVec = __m256;
constexpr int kLanes = 8, kFloatColumns = 2, kDirectRows = 2;
inline FloatVec fv_zero() { return _mm256_setzero_ps(); }
inline FloatVec fv_load(const float *p) { return _mm256_loadu_ps(p); }
inline void fv_store(float *p, FloatVec v) { _mm256_storeu_ps(p, v); }
inline FloatVec fv_fma(FloatVec a, FloatVec b, FloatVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FloatVec fv_set1(float x) { return _mm256_set1_ps(x); }
inline float fv_sum(FloatVec v) { return hsum8(v); }
// 16 bytes of a sub-block as two vectors.
template <class F>
inline void bytes_to_floats(__m128i bytes, FloatVec *out) {
    const __m128i upper = _mm_srli_si128(bytes, 8);
    out[0] = _mm256_cvtepi32_ps(F::kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
    out[1] = _mm256_cvtepi32_ps(F::kSigned ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper));
}
#endif
constexpr int kSubVectors = 32 / kLanes;

// One sub-block of one column, dequantized: fma(q, scale, offset) per weight, 32 floats in vectors.
template <class F>
inline void dequantize_sub(const uint8_t *block, const SubCoef &k, int sub, FloatVec *w) {
    const __m256i bytes = unpack<F>(block, sub);
#ifdef RADIXSERVE_QUANT_FLOAT512
    if constexpr (!F::kSplit && F::kBits <= 5) {
        // The sub-block's 16 (or 32) possible values, fma(q, scale, offset) as below, looked up by q:
        // the same numbers for one permute instead of a conversion and an fma.
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 scale = _mm512_set1_ps(k.scale_lo), offset = _mm512_set1_ps(k.offset_lo);
        const __m512 table = _mm512_fmadd_ps(iota, scale, offset);
        const __m512i lo = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes));
        const __m512i hi = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1));
        if constexpr (F::kBits == 4) {
            w[0] = _mm512_permutexvar_ps(lo, table);
            w[1] = _mm512_permutexvar_ps(hi, table);
        } else {
            const __m512 upper = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), scale, offset);
            w[0] = _mm512_permutex2var_ps(table, lo, upper);
            w[1] = _mm512_permutex2var_ps(table, hi, upper);
        }
        return;
    }
#endif
    bytes_to_floats<F>(_mm256_castsi256_si128(bytes), w);
    bytes_to_floats<F>(_mm256_extracti128_si256(bytes, 1), w + kSubVectors / 2);
    const FloatVec scale_lo = fv_set1(k.scale_lo), offset_lo = fv_set1(k.offset_lo);
    const FloatVec scale_hi = F::kSplit ? fv_set1(k.scale_hi) : scale_lo;
    const FloatVec offset_hi = F::kSplit ? fv_set1(k.offset_hi) : offset_lo;
    for (int v = 0; v < kSubVectors; ++v) {
        const bool high = v >= kSubVectors / 2;
        w[v] = fv_fma(w[v], high ? scale_hi : scale_lo, high ? offset_hi : offset_lo);
    }
}

// A block's coefficients for the kFloat path, decoded once per block and column, and one sub-block's
// weights from them (float_sub). Generic: the scalar SubCoefs and dequantize_sub. On AVX-512 the
// common formats decode their scales with vector instructions and look 4-bit values up by permute;
// each format has one way, shared by the register and scratch paths, so they agree bit for bit.
template <class F>
struct FloatCoefs {
    SubCoef sub[F::kSubs];
};
template <class F>
inline void float_coefs(const uint8_t *b, FloatCoefs<F> &c) {
    F::coefs(b, c.sub);
}
template <class F>
inline void float_sub(const uint8_t *b, const FloatCoefs<F> &c, int sub, FloatVec *w) {
    dequantize_sub<F>(b, c.sub[sub], sub, w);
}

#ifdef RADIXSERVE_QUANT_FLOAT512
inline __m512 broadcast_half(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(read_u16(p)))); }
const __m512 kIota16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

// 16 unsigned 4-bit values (one per byte) through a 16-entry table.
inline __m512 lookup16(__m128i values, __m512 table) { return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(values), table); }

// The 16 bytes at p, byte i in the low byte of dword i: broadcast to every 128-bit lane (a load),
// then an in-lane byte shuffle, cheaper than a cross-lane widening. vpermps reads only the low 4
// bits of each index, so the low nibbles need no mask and the high ones one shift. (Q4_0 / Q4_1:
// faster than lookup16; Q4_K's two 16-byte halves per sub-block were not.)
inline __m512i spread_bytes(const uint8_t *p) {
    const __m512i control = _mm512_set_epi32(
        -2139062257, -2139062258, -2139062259, -2139062260, -2139062261, -2139062262, -2139062263, -2139062264,
        -2139062265, -2139062266, -2139062267, -2139062268, -2139062269, -2139062270, -2139062271, -2139062272);
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))), control);
}
inline __m512 lookup_low(__m512i spread, __m512 table) { return _mm512_permutexvar_ps(spread, table); }
inline __m512 lookup_high(__m512i spread, __m512 table) { return _mm512_permutexvar_ps(_mm512_srli_epi32(spread, 4), table); }
inline __m128i low_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0f)); }
inline __m128i high_nibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)); }
inline __m128i load16(const uint8_t *p) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p)); }

// Q4_0 / Q4_1: the block's 16 values, scale * q + offset, as a table.
struct LegacyQ4Coefs {
    __m512 table;
};
template <>
struct FloatCoefs<Q4_0> : LegacyQ4Coefs {};
template <>
struct FloatCoefs<Q4_1> : LegacyQ4Coefs {};
template <>
inline void float_coefs<Q4_0>(const uint8_t *b, FloatCoefs<Q4_0> &c) {
    const __m512 d = broadcast_half(b);
    c.table = _mm512_fmadd_ps(kIota16, d, _mm512_mul_ps(_mm512_set1_ps(-8.0f), d));
}
template <>
inline void float_coefs<Q4_1>(const uint8_t *b, FloatCoefs<Q4_1> &c) {
    c.table = _mm512_fmadd_ps(kIota16, broadcast_half(b), broadcast_half(b + 2));
}
template <>
inline void float_sub<Q4_0>(const uint8_t *b, const FloatCoefs<Q4_0> &c, int, FloatVec *w) {
    const __m512i v = spread_bytes(b + 2);
    w[0] = lookup_low(v, c.table);
    w[1] = lookup_high(v, c.table);
}
template <>
inline void float_sub<Q4_1>(const uint8_t *b, const FloatCoefs<Q4_1> &c, int, FloatVec *w) {
    const __m512i v = spread_bytes(b + 4);
    w[0] = lookup_low(v, c.table);
    w[1] = lookup_high(v, c.table);
}

// Q8_0: d * q.
template <>
struct FloatCoefs<Q8_0> {
    __m512 d;
};
template <>
inline void float_coefs<Q8_0>(const uint8_t *b, FloatCoefs<Q8_0> &c) {
    c.d = broadcast_half(b);
}
template <>
inline void float_sub<Q8_0>(const uint8_t *b, const FloatCoefs<Q8_0> &c, int, FloatVec *w) {
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(b + 2))), c.d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(b + 18))), c.d);
}

// Q4_K: the 8 sub-blocks' scales and offsets decoded together (the 6-bit fields by 32-bit masks).
template <>
struct FloatCoefs<Q4_K> {
    alignas(32) float scale[8];
    alignas(32) float offset[8];
};
template <>
inline void float_coefs<Q4_K>(const uint8_t *b, FloatCoefs<Q4_K> &c) {
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint32_t scales_high = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    const uint32_t mins_high = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint64_t scales = (u[0] & 0x3f3f3f3fu) | (static_cast<uint64_t>(scales_high) << 32);
    const uint64_t mins = (u[1] & 0x3f3f3f3fu) | (static_cast<uint64_t>(mins_high) << 32);
    const __m256 d = _mm256_set1_ps(half_to_float(read_u16(b))), dmin = _mm256_set1_ps(half_to_float(read_u16(b + 2)));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(scales))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mins))));
    _mm256_store_ps(c.scale, _mm256_mul_ps(d, sc));
    _mm256_store_ps(c.offset, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, mn)));
}
template <>
inline void float_sub<Q4_K>(const uint8_t *b, const FloatCoefs<Q4_K> &c, int sub, FloatVec *w) {
    const __m512 table = _mm512_fmadd_ps(kIota16, _mm512_set1_ps(c.scale[sub]), _mm512_set1_ps(c.offset[sub]));
    const uint8_t *qs = b + 16 + 32 * (sub / 2);
    if (sub & 1) {
        w[0] = lookup16(high_nibbles(load16(qs)), table);
        w[1] = lookup16(high_nibbles(load16(qs + 16)), table);
    } else {
        w[0] = lookup16(low_nibbles(load16(qs)), table);
        w[1] = lookup16(low_nibbles(load16(qs + 16)), table);
    }
}

// Q6_K: the 16 scales of a super-block at once; each sub-block's halves of 16 have their own.
template <>
struct FloatCoefs<Q6_K> {
    alignas(64) float scale[16];
    alignas(64) float offset[16];
};
template <>
inline void float_coefs<Q6_K>(const uint8_t *b, FloatCoefs<Q6_K> &c) {
    const __m512 d = _mm512_set1_ps(half_to_float(read_u16(b + 208)));
    const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(b + 192))));
    _mm512_store_ps(c.scale, scale);
    _mm512_store_ps(c.offset, _mm512_mul_ps(_mm512_set1_ps(-32.0f), scale));
}
template <>
inline void float_sub<Q6_K>(const uint8_t *b, const FloatCoefs<Q6_K> &c, int sub, FloatVec *w) {
    const int half = sub / 4, quarter = sub % 4, base = 8 * half + 2 * quarter;
    const uint8_t *low = b + 64 * half + 32 * (quarter & 1), *high = b + 128 + 32 * half;
    const __m128i shift_low = _mm_cvtsi32_si128(4 * (quarter >> 1)), shift_high = _mm_cvtsi32_si128(2 * quarter);
    for (int h = 0; h < 2; ++h) {
        const __m128i lo4 = _mm_and_si128(_mm_srl_epi16(load16(low + 16 * h), shift_low), _mm_set1_epi8(0x0f));
        const __m128i hi2 = _mm_and_si128(_mm_srl_epi16(load16(high + 16 * h), shift_high), _mm_set1_epi8(3));
        const __m128i q = _mm_or_si128(lo4, _mm_slli_epi16(hi2, 4));
        w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(c.scale[base + h]),
                               _mm512_set1_ps(c.offset[base + h]));
    }
}
#endif

// Rows [row, row + MR) x columns [col, col + NC), the weights from registers.
template <class F, int MR, int NC>
inline void tile_float_direct(const uint8_t *w, int64_t row_bytes, int64_t col, int64_t row, const Activations &a,
                              float (*result)[NC]) {
    const int64_t blocks = a.k / (32 * F::kSubs);
    FloatVec acc[MR][NC];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = fv_zero();
    for (int64_t blk = 0; blk < blocks; ++blk) {
        FloatCoefs<F> coefs[NC];
        const uint8_t *block[NC];
        for (int c = 0; c < NC; ++c) {
            block[c] = w + (col + c) * row_bytes + blk * F::kBytes;
            // The same block of the next tile's columns: a tile reads NC rows of W at once, too many
            // streams for the hardware prefetcher to run ahead of (decode is bound by memory).
            prefetch_block<F>(block[c] + NC * row_bytes);
            float_coefs<F>(block[c], coefs[c]);
        }
        for (int sub = 0; sub < F::kSubs; ++sub) {
            const int64_t at = 32 * (blk * F::kSubs + sub);
            FloatVec weights[NC][kSubVectors];
            for (int c = 0; c < NC; ++c) float_sub<F>(block[c], coefs[c], sub, weights[c]);
            for (int r = 0; r < MR; ++r) {
                const float *x = a.row_floats(row + r) + at;
                for (int v = 0; v < kSubVectors; ++v) {
                    const FloatVec xv = fv_load(x + kLanes * v);
                    for (int c = 0; c < NC; ++c) acc[r][c] = fv_fma(weights[c][v], xv, acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) result[r][c] = fv_sum(acc[r][c]);
}

// Columns [col, col + NC) dequantized into scratch [NC][k].
template <class F, int NC>
inline void dequantize_columns(const uint8_t *w, int64_t row_bytes, int64_t col, int64_t k, float *scratch) {
    const int64_t blocks = k / (32 * F::kSubs);
    for (int c = 0; c < NC; ++c) {
        for (int64_t blk = 0; blk < blocks; ++blk) {
            const uint8_t *block = w + (col + c) * row_bytes + blk * F::kBytes;
            FloatCoefs<F> coefs;
            float_coefs<F>(block, coefs);
            for (int sub = 0; sub < F::kSubs; ++sub) {
                FloatVec weights[kSubVectors];
                float_sub<F>(block, coefs, sub, weights);
                float *out = scratch + c * k + 32 * (blk * F::kSubs + sub);
                for (int v = 0; v < kSubVectors; ++v) fv_store(out + kLanes * v, weights[v]);
            }
        }
    }
}

// Rows [row, row + MR) x the NC columns in scratch.
template <int MR, int NC>
inline void tile_float_scratch(const float *scratch, int64_t row, const Activations &a, float (*result)[NC]) {
    FloatVec acc[MR][NC];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = fv_zero();
    for (int64_t i = 0; i < a.k; i += kLanes) {
        FloatVec weights[NC];
        for (int c = 0; c < NC; ++c) weights[c] = fv_load(scratch + c * a.k + i);
        for (int r = 0; r < MR; ++r) {
            FloatVec xv = fv_load(a.row_floats(row + r) + i);
            // In a register: GCC would fold the load into each of the NC FMAs, and the loads (not
            // the FMAs) would bound the loop.
            asm("" : "+v"(xv));
            for (int c = 0; c < NC; ++c) acc[r][c] = fv_fma(weights[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) result[r][c] = fv_sum(acc[r][c]);
}

#else  // no AVX2: no kernel (the weights are dequantized at load; quant_linear_isa() == 0)

template <class F, int MR, int NC>
inline void tile(const uint8_t *, int64_t, int64_t, int64_t, const Activations &, float (*result)[NC]) {
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) result[r][c] = 0.0f;
}
constexpr int kFloatColumns = 1, kDirectRows = 1;
template <class F, int MR, int NC>
inline void tile_float_direct(const uint8_t *w, int64_t row_bytes, int64_t col, int64_t row, const Activations &a,
                              float (*result)[NC]) {
    tile<F, MR, NC>(w, row_bytes, col, row, a, result);
}
template <class F, int NC>
inline void dequantize_columns(const uint8_t *, int64_t, int64_t, int64_t, float *) {}
template <int MR, int NC>
inline void tile_float_scratch(const float *, int64_t, const Activations &, float (*result)[NC]) {
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) result[r][c] = 0.0f;
}

#endif

// Rows per register tile (kInt8, and kFloat from scratch).
constexpr int kTileRows = 4;
constexpr int64_t kParallelWork = 1 << 11;  // m * n * k / 32 below which one thread does it all

struct Output {
    void *out;
    int64_t out_stride;
    bool bf16;
    const void *bias;
    const void *residual;
    int64_t residual_stride;

    float load(const void *p, int64_t i) const {
        return bf16 ? radixserve_vec::to_float(static_cast<const uint16_t *>(p)[i]) : static_cast<const float *>(p)[i];
    }
    void store(int64_t row, int64_t col, float value) const {
        if (bias) value += load(bias, col);
        if (residual) value += load(residual, row * residual_stride + col);
        if (bf16)
            static_cast<uint16_t *>(out)[row * out_stride + col] = float_to_bf16(value);
        else
            static_cast<float *>(out)[row * out_stride + col] = value;
    }
};

template <int MR, int NC>
inline void store_tile(const float (*result)[NC], int64_t row, int64_t col, const Output &o) {
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) o.store(row + r, col + c, result[r][c]);
}

// kInt8: columns [col, col + NC) for every row, in row tiles.
template <class F, int NC>
inline void int8_columns(const uint8_t *w, int64_t row_bytes, int64_t col, int64_t m, const Activations &a,
                         const Output &o) {
    const auto run = [&]<int MR>(int64_t row) {
        float result[MR][NC];
        tile<F, MR, NC>(w, row_bytes, col, row, a, result);
        store_tile<MR, NC>(result, row, col, o);
    };
    int64_t row = 0;
    for (; row + kTileRows <= m; row += kTileRows) run.template operator()<kTileRows>(row);
    switch (m - row) {
        case 3: run.template operator()<3>(row); break;
        case 2: run.template operator()<2>(row); break;
        case 1: run.template operator()<1>(row); break;
        default: break;
    }
}

// kFloat: columns [col, col + NC) for rows [row, row + rows): up to kDirectRows rows from registers,
// more through `scratch` (NC * k floats). Both give the same values, so the choice is free.
template <class F, int NC>
inline void float_columns(const uint8_t *w, int64_t row_bytes, int64_t col, int64_t row, int64_t rows,
                          const Activations &a, const Output &o, float *scratch) {
    const auto direct = [&]<int MR>() {
        float result[MR][NC];
        tile_float_direct<F, MR, NC>(w, row_bytes, col, row, a, result);
        store_tile<MR, NC>(result, row, col, o);
    };
    if (rows <= kDirectRows) {
        switch (rows) {
            case 1: direct.template operator()<1>(); return;
            case 2: if constexpr (kDirectRows >= 2) direct.template operator()<2>(); return;
            case 3: if constexpr (kDirectRows >= 3) direct.template operator()<3>(); return;
            case 4: if constexpr (kDirectRows >= 4) direct.template operator()<4>(); return;
            default: return;
        }
    }
    dequantize_columns<F, NC>(w, row_bytes, col, a.k, scratch);
    const auto run = [&]<int MR>(int64_t at) {
        float result[MR][NC];
        tile_float_scratch<MR, NC>(scratch, at, a, result);
        store_tile<MR, NC>(result, at, col, o);
    };
    const int64_t end = row + rows;
    int64_t at = row;
    for (; at + kTileRows <= end; at += kTileRows) run.template operator()<kTileRows>(at);
    switch (end - at) {
        case 3: run.template operator()<3>(at); break;
        case 2: run.template operator()<2>(at); break;
        case 1: run.template operator()<1>(at); break;
        default: break;
    }
}

// Rows per pass over a task's columns with kFloat: their activations stay in L2 while every column
// tile is multiplied with them.
constexpr int64_t kFloatRowBlock = 64;

template <class F>
void matmul(const uint8_t *w, int64_t n, const Activations &a, int64_t m, const Output &o) {
    const int64_t row_bytes = a.k / (32 * F::kSubs) * F::kBytes;
    // Columns per task: each thread walks its columns' weights once per row tile, from L2; a few
    // tasks per thread balance uneven column counts.
    const int threads = omp_get_max_threads();
    const int64_t chunk = std::clamp<int64_t>((n / (4 * threads)) / 4 * 4, 4, 64);
    const int64_t tasks = (n + chunk - 1) / chunk;
    const bool parallel = m * n * (a.k / 32) >= kParallelWork;
#pragma omp parallel if (parallel)
    {
        std::vector<float> scratch(a.floats && m > kDirectRows ? kFloatColumns * a.k : 0);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t first = task * chunk, last = std::min(n, first + chunk);
            int64_t col = first;
            if (a.floats) {
                for (int64_t row = 0; row < m; row += kFloatRowBlock) {
                    const int64_t rows = std::min(kFloatRowBlock, m - row);
                    for (col = first; col + kFloatColumns <= last; col += kFloatColumns)
                        float_columns<F, kFloatColumns>(w, row_bytes, col, row, rows, a, o, scratch.data());
                    for (; col < last; ++col) float_columns<F, 1>(w, row_bytes, col, row, rows, a, o, scratch.data());
                }
            } else {
                const int64_t width = m == 1 ? 4 : 2;  // decode: one row, four columns
                if (width == 4)
                    for (; col + 4 <= last; col += 4) int8_columns<F, 4>(w, row_bytes, col, m, a, o);
                for (; col + 2 <= last; col += 2) int8_columns<F, 2>(w, row_bytes, col, m, a, o);
                for (; col < last; ++col) int8_columns<F, 1>(w, row_bytes, col, m, a, o);
            }
        }
    }
}

template <class F>
void dequantize_row(const uint8_t *row, int64_t k, float *out) {
    for (int64_t blk = 0; blk < k / (32 * F::kSubs); ++blk) {
        const uint8_t *b = row + blk * F::kBytes;
        SubCoef coefs[F::kSubs];
        F::coefs(b, coefs);
        for (int sub = 0; sub < F::kSubs; ++sub) {
            uint8_t q[32];
            F::unpack_scalar(b, sub, q);
            float *y = out + 32 * (blk * F::kSubs + sub);
            const SubCoef &c = coefs[sub];
            for (int i = 0; i < 32; ++i) {
                const float v = F::kSigned ? static_cast<float>(static_cast<int8_t>(q[i])) : static_cast<float>(q[i]);
                y[i] = i < 16 ? c.scale_lo * v + c.offset_lo : c.scale_hi * v + c.offset_hi;
            }
        }
    }
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

template <class F>
struct MatmulOp {
    static void run(const uint8_t *w, int64_t n, const Activations *a, int64_t m, const Output *o) {
        matmul<F>(w, n, *a, m, *o);
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

}  // namespace

// 2: vpdpbusd (AVX-512 VNNI or AVX-VNNI); 1: AVX2 vpmaddubsw; 0: no kernel in this build.
extern "C" int quant_linear_isa() { return RADIXSERVE_QUANT_ISA; }

// The bytes prepare_activations writes for m rows of k inputs (k a multiple of 32) in `mode`.
extern "C" int64_t quant_activation_bytes(int mode, int64_t m, int64_t k) { return Activations::bytes(mode, m, k); }

// x [m, k] (rows x_stride apart; bf16 when x_bf16, else fp32) into `buffer` in `mode`: kInt8, 8-bit
// blocks of 32 (scale = max |x| / 127, values rounded half to even); kFloat, fp32 as they are. Both
// with their sums per 16.
extern "C" void prepare_activations(int mode, const void *x, int64_t x_stride, int x_bf16, int64_t m, int64_t k,
                                    uint8_t *buffer) {
    const Activations a = Activations::in(mode, buffer, m, k);
    const bool parallel = m * k >= (1 << 16);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r = 0; r < m; ++r) {
        float row[32];
        for (int64_t blk = 0; blk < k / 32; ++blk) {
            const int64_t at = r * x_stride + 32 * blk;
            for (int i = 0; i < 32; ++i)
                row[i] = x_bf16 ? radixserve_vec::to_float(static_cast<const uint16_t *>(x)[at + i])
                                : static_cast<const float *>(x)[at + i];
            if (mode == kFloat) {
                memcpy(const_cast<float *>(a.row_floats(r)) + 32 * blk, row, sizeof(row));
            } else {
                quantize_block(row, const_cast<int8_t *>(a.row_values(r)) + 32 * blk,
                               const_cast<float *>(a.row_scales(r)) + blk, const_cast<float *>(a.row_sums(r)) + 2 * blk);
            }
        }
    }
}

// out [m, n] (rows out_stride apart) = x W^T (+ bias [n]) (+ residual [m, n], rows residual_stride
// apart) for W [n, k] of ggml type `type` and x prepared into `activations` by prepare_activations;
// out, bias and residual are bf16 when out_bf16, else fp32 (bias and residual may be null). Returns 0
// when the type has no kernel here.
extern "C" int quant_linear(int type, int mode, uint8_t *activations, int64_t m, int64_t k, const uint8_t *w,
                            int64_t n, void *out, int64_t out_stride, int out_bf16, const void *bias,
                            const void *residual, int64_t residual_stride) {
    if (!RADIXSERVE_QUANT_ISA) return 0;
    if (m <= 0 || n <= 0) return 1;
    const Activations a = Activations::in(mode, activations, m, k);
    const Output o{out, out_stride, out_bf16 != 0, bias, residual, residual_stride};
    return dispatch<MatmulOp>(type, w, n, &a, m, &o) ? 1 : 0;
}

// A quantized linear's weight stacked from up to kMaxParts parts (the q, k and v of a layer can be
// of different formats), as the caller lays it out in int64s: part count, then each part's type,
// rows and address.
constexpr int kMaxParts = 3;
struct QuantParts {
    int64_t count;
    int64_t type[kMaxParts];
    int64_t rows[kMaxParts];
    const uint8_t *data[kMaxParts];
};

// out [m, sum of rows] = x W^T (+ bias) (+ residual) for W the stacked parts: x is prepared once (in
// a per-thread buffer) for every part. x, out, bias and residual are bf16 when bf16, else fp32.
// Returns 0 for a type or part count without a kernel here.
extern "C" int quant_linear_parts(const int64_t *parts_layout, int mode, const void *x, int64_t x_stride, int bf16,
                                  int64_t m, int64_t k, void *out, int64_t out_stride, const void *bias,
                                  const void *residual, int64_t residual_stride) {
    QuantParts parts;
    memcpy(&parts, parts_layout, sizeof(parts));
    if (parts.count < 1 || parts.count > kMaxParts) return 0;
    static thread_local std::vector<uint8_t> buffer;
    const size_t needed = static_cast<size_t>(Activations::bytes(mode, m, k));
    if (buffer.size() < needed) buffer.resize(needed);
    prepare_activations(mode, x, x_stride, bf16, m, k, buffer.data());
    const int64_t size = bf16 ? 2 : 4;
    int64_t offset = 0;
    for (int64_t p = 0; p < parts.count; ++p) {
        char *part_out = static_cast<char *>(out) + offset * size;
        const void *part_bias = bias ? static_cast<const char *>(bias) + offset * size : nullptr;
        const void *part_residual = residual ? static_cast<const char *>(residual) + offset * size : nullptr;
        if (!quant_linear(static_cast<int>(parts.type[p]), mode, buffer.data(), m, k, parts.data[p], parts.rows[p],
                          part_out, out_stride, bf16, part_bias, part_residual, residual_stride))
            return 0;
        offset += parts.rows[p];
    }
    return 1;
}

// out [count, k] fp32 = rows `rows` of W (ggml type `type`, rows row_bytes apart) dequantized: the
// embedding lookup of a quantized table, and reading a quantized weight back. Returns 0 for a type
// without a kernel.
extern "C" int quant_dequantize_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *rows,
                                     int64_t count, int64_t k, float *out) {
    return dispatch<DequantizeOp>(type, w, row_bytes, rows, count, k, out) ? 1 : 0;
}
