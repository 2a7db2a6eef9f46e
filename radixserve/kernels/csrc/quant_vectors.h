// The quantized matmul's vectors (quant_linear.cpp): which instructions this build multiplies with
// (RADIXSERVE_QUANT_ISA), and 16 output columns held in one 512-bit register or two 256-bit ones.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_QUANT_512 1
#if defined(__AVX512VNNI__)
#define RADIXSERVE_QUANT_ISA 4
#else
#define RADIXSERVE_QUANT_ISA 3
#endif
#else
#define RADIXSERVE_QUANT_ISA 1
#endif
#else
#define RADIXSERVE_QUANT_ISA 0
#endif

#if RADIXSERVE_QUANT_ISA
namespace quant_vectors {

// Ints holds 32 int16 (words 2c, 2c + 1: column c's two inputs of a step) or 16 int32 (column c).

#ifdef RADIXSERVE_QUANT_512
struct Ints {
    __m512i v;
};
struct Floats {
    __m512 v;
};
inline Ints widen_u8(const uint8_t *p) {
    return {_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)))};
}
inline Ints widen_s8(const uint8_t *p) {
    return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)))};
}
inline Ints low4(Ints a) { return {_mm512_and_si512(a.v, _mm512_set1_epi16(0x0f))}; }
inline Ints high4(Ints a) { return {_mm512_srli_epi16(a.v, 4)}; }
// value added to the words whose bit is set in the plane.
inline Ints add_bits(Ints a, const uint8_t *plane, short value) {
    uint32_t bits;
    memcpy(&bits, plane, 4);
    return {_mm512_mask_add_epi16(a.v, bits, a.v, _mm512_set1_epi16(value))};
}
// Bits 4-5 of each word from the 2-bit field at `shift` of the fields' word.
inline Ints with_high2(Ints a, Ints fields, int shift) {
    const __m512i moved = shift <= 4 ? _mm512_slli_epi16(fields.v, 4 - shift) : _mm512_srli_epi16(fields.v, shift - 4);
    return {_mm512_ternarylogic_epi32(a.v, moved, _mm512_set1_epi16(0x30), 0xf8)};  // a | (moved & 0x30)
}
inline Ints set_i32(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline Ints add_i32(Ints a, Ints b) { return {_mm512_add_epi32(a.v, b.v)}; }
// The input pair at p (two int16) in every column's two words: one load that broadcasts.
inline Ints pair_at(const int16_t *p) { return {_mm512_broadcastd_epi32(_mm_loadu_si32(p))}; }
// acc + each column's two products with the input pair.
inline Ints dot(Ints acc, Ints w, Ints pair) {
#if RADIXSERVE_QUANT_ISA == 4
    return {_mm512_dpwssd_epi32(acc.v, w.v, pair.v)};
#else
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(w.v, pair.v))};
#endif
}
inline Floats to_float(Ints a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline Floats set_f(float x) { return {_mm512_set1_ps(x)}; }
inline Floats zero_f() { return {_mm512_setzero_ps()}; }
inline Floats mul(Floats a, Floats b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Floats neg(Floats a) { return {_mm512_sub_ps(_mm512_setzero_ps(), a.v)}; }
inline Floats fma(Floats a, Floats b, Floats c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Floats halves(const uint8_t *p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)))};
}
inline Floats bytes_u8(const uint8_t *p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))))};
}
inline Floats bytes_s8(const uint8_t *p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))))};
}
inline void store(float *p, Floats a) { _mm512_storeu_ps(p, a.v); }
#else
struct Ints {
    __m256i lo, hi;
};
struct Floats {
    __m256 lo, hi;
};
inline __m128i load16(const uint8_t *p) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p)); }
inline Ints widen_u8(const uint8_t *p) { return {_mm256_cvtepu8_epi16(load16(p)), _mm256_cvtepu8_epi16(load16(p + 16))}; }
inline Ints widen_s8(const uint8_t *p) { return {_mm256_cvtepi8_epi16(load16(p)), _mm256_cvtepi8_epi16(load16(p + 16))}; }
inline Ints low4(Ints a) {
    const __m256i mask = _mm256_set1_epi16(0x0f);
    return {_mm256_and_si256(a.lo, mask), _mm256_and_si256(a.hi, mask)};
}
inline Ints high4(Ints a) { return {_mm256_srli_epi16(a.lo, 4), _mm256_srli_epi16(a.hi, 4)}; }
// 16 bits to 16 words: value where the bit is set.
inline __m256i bits_to_words(uint32_t bits, short value) {
    const __m256i select = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                             static_cast<short>(-32768));
    const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<short>(bits)), select), select);
    return _mm256_and_si256(set, _mm256_set1_epi16(value));
}
inline Ints add_bits(Ints a, const uint8_t *plane, short value) {
    uint32_t bits;
    memcpy(&bits, plane, 4);
    return {_mm256_add_epi16(a.lo, bits_to_words(bits & 0xffff, value)),
            _mm256_add_epi16(a.hi, bits_to_words(bits >> 16, value))};
}
inline __m256i with_high2(__m256i a, __m256i fields, int shift) {
    const __m256i moved = shift <= 4 ? _mm256_slli_epi16(fields, 4 - shift) : _mm256_srli_epi16(fields, shift - 4);
    return _mm256_or_si256(a, _mm256_and_si256(moved, _mm256_set1_epi16(0x30)));
}
inline Ints with_high2(Ints a, Ints fields, int shift) {
    return {with_high2(a.lo, fields.lo, shift), with_high2(a.hi, fields.hi, shift)};
}
inline Ints set_i32(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline Ints add_i32(Ints a, Ints b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline Ints pair_at(const int16_t *p) {
    const __m256i x = _mm256_broadcastd_epi32(_mm_loadu_si32(p));
    return {x, x};
}
inline Ints dot(Ints acc, Ints w, Ints pair) {
    return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(w.lo, pair.lo)),
            _mm256_add_epi32(acc.hi, _mm256_madd_epi16(w.hi, pair.hi))};
}
inline Floats to_float(Ints a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline Floats set_f(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Floats zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Floats mul(Floats a, Floats b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Floats neg(Floats a) {
    return {_mm256_sub_ps(_mm256_setzero_ps(), a.lo), _mm256_sub_ps(_mm256_setzero_ps(), a.hi)};
}
inline Floats fma(Floats a, Floats b, Floats c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Floats halves(const uint8_t *p) { return {_mm256_cvtph_ps(load16(p)), _mm256_cvtph_ps(load16(p + 16))}; }
inline Floats bytes_u8(const uint8_t *p) {
    const __m128i v = load16(p);
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))};
}
inline Floats bytes_s8(const uint8_t *p) {
    const __m128i v = load16(p);
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
inline void store(float *p, Floats a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
#endif

}  // namespace quant_vectors
#endif
