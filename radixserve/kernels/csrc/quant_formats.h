// The GGUF block formats the quantized kernels read (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
// Q6_K), described once in scalar code: each block's coefficients per 32-element sub-block, its values
// as unsigned bytes (Q8_0: signed), and the fields quant_linear.cpp's packed layout keeps of it.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
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

namespace quant_formats {

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
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

// Packed headers: a field of 16 columns stored column after column.
inline void put_half(uint8_t *h, int c, uint16_t v) { memcpy(h + 2 * c, &v, 2); }

// Q4_1 / Q5_1: d, then m.
inline void scale_min_header(const uint8_t *b, int c, uint8_t *h) {
    put_half(h, c, read_u16(b));
    put_half(h + 32, c, read_u16(b + 2));
}

// Q4_K / Q5_K: d and dmin of each column, then the 8 sub-blocks' 6-bit scales and minimums as bytes,
// [sub][column].
inline void k_header(const uint8_t *b, int c, uint8_t *h) {
    put_half(h, c, read_u16(b));
    put_half(h + 32, c, read_u16(b + 2));
    for (int j = 0; j < 8; ++j) {
        int scale, min;
        k4_scale_min(j, b + 4, &scale, &min);
        h[64 + 16 * j + c] = static_cast<uint8_t>(scale);
        h[192 + 16 * j + c] = static_cast<uint8_t>(min);
    }
}

// Q6_K: d, then the int8 scale of each half of 16 of each sub-block, [2 * sub + half][column].
inline void q6_header(const uint8_t *b, int c, uint8_t *h) {
    put_half(h, c, read_u16(b + 208));
    for (int j = 0; j < 8; ++j) {
        const int base = 8 * (j / 4) + 2 * (j % 4);  // see Q6_K::coefs
        h[32 + 16 * (2 * j) + c] = b[192 + base];
        h[32 + 16 * (2 * j + 1) + c] = b[192 + base + 1];
    }
}


// Q5_0 / Q5_1: 32 fifth bits, then 16 bytes of nibbles (low: values 0-15, high: 16-31).
inline void unpack5(const uint8_t *bits, const uint8_t *nibbles, uint8_t *q) {
    uint32_t high;
    memcpy(&high, bits, 4);
    for (int i = 0; i < 16; ++i) {
        q[i] = (nibbles[i] & 0xf) | (((high >> i) & 1) << 4);
        q[i + 16] = (nibbles[i] >> 4) | (((high >> (i + 16)) & 1) << 4);
    }
}

// Each format: its block's bytes, its 32-element sub-blocks, the coefficients of each sub-block
// (coefs), one sub-block's values (unpack_scalar); and for quant_linear.cpp's packed layout, the bytes
// of 16 columns' header (kHeader, written by pack_header), the zero point folded into the integer
// sums (kIntOffset), and whether a minimum per sub-block is added apart (kMinimum).
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: one sub-block of 32; an fp16 scale d, with a minimum an fp16 m (q * d +
// m; else the zero point 2^(bits - 1), none for Q8_0's signed bytes), a 5-bit format's 32 fifth bits,
// then the values (nibbles: low 0-15, high 16-31).
template <int Bits, bool Minimum>
struct Legacy {
    static constexpr int kHead = Minimum ? 4 : 2, kValues = kHead + (Bits == 5 ? 4 : 0);
    static constexpr int kBytes = kValues + (Bits == 8 ? 32 : 16), kSubs = 1, kBits = Bits;
    static constexpr bool kSigned = Bits == 8, kSplit = false;
    static constexpr int kHeader = Minimum ? 64 : 32, kIntOffset = Minimum || Bits == 8 ? 0 : 1 << (Bits - 1);
    static constexpr bool kMinimum = Minimum;
    static void pack_header(const uint8_t *b, int c, uint8_t *h) {
        if constexpr (Minimum)
            scale_min_header(b, c, h);
        else
            put_half(h, c, read_u16(b));
    }
    static void coefs(const uint8_t *b, SubCoef *c) {
        const float d = half_to_float(read_u16(b));
        const float zero_point = kIntOffset ? -static_cast<float>(kIntOffset) * d : 0.0f;
        const float offset = Minimum ? half_to_float(read_u16(b + 2)) : zero_point;
        c[0] = {d, d, offset, offset};
    }
    static void unpack_scalar(const uint8_t *b, int, uint8_t *q) {
        if constexpr (Bits == 8) {
            memcpy(q, b + kValues, 32);
        } else if constexpr (Bits == 5) {
            unpack5(b + kHead, b + kValues, q);
        } else {
            for (int i = 0; i < 16; ++i) q[i] = b[kValues + i] & 0xf, q[i + 16] = b[kValues + i] >> 4;
        }
    }
};
using Q4_0 = Legacy<4, false>;
using Q4_1 = Legacy<4, true>;
using Q5_0 = Legacy<5, false>;
using Q5_1 = Legacy<5, true>;
using Q8_0 = Legacy<8, false>;
static_assert(Q4_0::kBytes == 18 && Q4_1::kBytes == 20 && Q5_0::kBytes == 22 && Q5_1::kBytes == 24 &&
              Q8_0::kBytes == 34);

struct Q4_K {
    static constexpr int kBytes = 144, kSubs = 8, kBits = 4;
    static constexpr bool kSigned = false, kSplit = false;
    static constexpr int kHeader = 320, kIntOffset = 0;
    static constexpr bool kMinimum = true;
    static void pack_header(const uint8_t *b, int c, uint8_t *h) { k_header(b, c, h); }
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
    static constexpr int kHeader = 320, kIntOffset = 0;
    static constexpr bool kMinimum = true;
    static void pack_header(const uint8_t *b, int c, uint8_t *h) { k_header(b, c, h); }
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
    static constexpr int kHeader = 288, kIntOffset = 32;
    static constexpr bool kMinimum = false;
    static void pack_header(const uint8_t *b, int c, uint8_t *h) { q6_header(b, c, h); }
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

// One row of k weights of format F dequantized to fp32: scale * q + offset, as gguf computes it.
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

// A quantized linear's weight stacked from up to kMaxParts packed parts (the q, k and v of a layer can
// be of different formats), as the caller lays it out in kLayoutWords int64s: part count, then each
// part's type, rows and address (QuantKernels.parts_layout).
constexpr int kMaxParts = 3;
constexpr int64_t kLayoutWords = 1 + 3 * kMaxParts;
struct QuantParts {
    int64_t count;
    int64_t type[kMaxParts];
    int64_t rows[kMaxParts];
    const uint8_t *data[kMaxParts];
};

}  // namespace quant_formats
