// AVX2 kernels (x86-64 with AVX2, FMA and F16C): the reference's integer sums, 32 weights a step.
// Built with -mavx2 -mfma -mf16c for this file only; dispatch.cpp calls it only on a CPU that has
// both, so the library still loads on any x86-64.
#include <immintrin.h>

#include <cstring>

#include "kernels.h"

namespace elk {
namespace {

// F16C's conversion: exact, like fp16_to_fp32, without its branches.
inline float half(uint16_t h) { return _cvtsh_ss(h); }

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// sum over 32 lanes of scale * w * a, as 8 int32: unsigned weights w <= 63, int8 a.
// maddubs adds pairs into int16 (at most 2 * 63 * 127, no saturation); madd scales them.
inline __m256i scaled_dot(__m256i w, __m256i a, __m256i scale16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), scale16);
}

// The 8 six-bit scales and mins of a Q4_K/Q5_K super-block, unpacked once.
inline void unpack_scales(const uint8_t *packed, uint8_t scales[8], uint8_t mins[8]) {
  for (int sub = 0; sub < 8; ++sub) scale_min_k4(sub, packed, &scales[sub], &mins[sub]);
}

// sum over sub-blocks of min * (sum of its 32 activations), from the 16 block sums.
inline int32_t mins_dot(const uint8_t mins[8], const int16_t *bsums) {
  const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(bsums));
  // Adjacent pairs of 16-activation sums: the 8 sub-block sums, as int32.
  const __m256i pairs = _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
  const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(mins)));
  return hsum_epi32(_mm256_mullo_epi32(pairs, m));
}

float dot_q4_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *x = static_cast<const BlockQ4_K *>(vx);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t sc[8], m[8];
    unpack_scales(x[i].scales, sc, m);
    __m256i acc = _mm256_setzero_si256();
    const uint8_t *q = x[i].qs;
    const int8_t *a = y[i].qs;
    for (int sub = 0; sub < 8; sub += 2, q += 32, a += 64) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q));
      const __m256i lo = _mm256_and_si256(bytes, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      acc = _mm256_add_epi32(acc, scaled_dot(lo, _mm256_loadu_si256(
          reinterpret_cast<const __m256i *>(a)), _mm256_set1_epi16(sc[sub])));
      acc = _mm256_add_epi32(acc, scaled_dot(hi, _mm256_loadu_si256(
          reinterpret_cast<const __m256i *>(a + 32)), _mm256_set1_epi16(sc[sub + 1])));
    }
    sum += k_block(half(x[i].d), half(x[i].dmin), y[i].d, hsum_epi32(acc),
                   mins_dot(m, y[i].bsums));
  }
  return sum;
}

float dot_q5_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *x = static_cast<const BlockQ5_K *>(vx);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    __m256i acc = _mm256_setzero_si256();
    const uint8_t *q = x[i].qs;
    const int8_t *a = y[i].qs;
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[i].qh));
    _mm_prefetch(reinterpret_cast<const char *>(x + i + 1), _MM_HINT_T0);
    for (int sub = 0; sub < 8; sub += 2, q += 32, a += 64) {
      uint8_t sc1, m1, sc2, m2;
      scale_min_k4(sub, x[i].scales, &sc1, &m1);
      scale_min_k4(sub + 1, x[i].scales, &sc2, &m2);
      // Bit `sub` of each qh byte is bit 4 of the low nibble's weight, bit sub+1 the high's.
      const __m256i u1 = _mm256_set1_epi8(static_cast<char>(1 << sub));
      const __m256i u2 = _mm256_set1_epi8(static_cast<char>(2 << sub));
      const __m256i h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, u1), u1), bit4);
      const __m256i h2 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, u2), u2), bit4);
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q));
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(bytes, low4), h1);
      const __m256i hi = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4), h2);
      acc = _mm256_add_epi32(acc, scaled_dot(lo, _mm256_loadu_si256(
          reinterpret_cast<const __m256i *>(a)), _mm256_set1_epi16(sc1)));
      acc = _mm256_add_epi32(acc, scaled_dot(hi, _mm256_loadu_si256(
          reinterpret_cast<const __m256i *>(a + 32)), _mm256_set1_epi16(sc2)));
    }
    sum += k_block(half(x[i].d), half(x[i].dmin), y[i].d, hsum_epi32(acc),
                   k_mins(x[i].scales, y[i].bsums));
  }
  return sum;
}

float dot_q6_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *x = static_cast<const BlockQ6_K *>(vx);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i two = _mm256_set1_epi8(0x03);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    __m256i acc = _mm256_setzero_si256();
    const uint8_t *ql = x[i].ql, *qh = x[i].qh;
    const int8_t *sc = x[i].scales, *a = y[i].qs;
    _mm_prefetch(reinterpret_cast<const char *>(x + i + 1), _MM_HINT_T0);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, a += 128) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ql + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qh));
      // The four 32-weight quarters, unsigned 0..63 (the -32 comes from the block sums).
      const __m256i w[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low4),
                          _mm256_slli_epi16(_mm256_and_si256(h, two), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4)),
      };
      for (int quarter = 0; quarter < 4; ++quarter) {
        // Weights 0..15 of a quarter have scale sc[2q], weights 16..31 sc[2q+1].
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * quarter + 1]),
                                               _mm_set1_epi16(sc[2 * quarter]));
        acc = _mm256_add_epi32(acc, scaled_dot(w[quarter], _mm256_loadu_si256(
            reinterpret_cast<const __m256i *>(a + 32 * quarter)), scale));
      }
    }
    // The -32 offset of every weight: 32 * scale * (sum of its 16 activations).
    int32_t offset = 0;
    for (int g = 0; g < 16; ++g) offset += x[i].scales[g] * y[i].bsums[g];
    sum += k_block(half(x[i].d), 0.0f, y[i].d, hsum_epi32(acc) - 32 * offset, 0);
  }
  return sum;
}

}  // namespace

namespace {

// =============================================================================================
// Legacy types: Q4_0/Q5_0/Q8_0 x Q8_0 and Q4_1/Q5_1 x Q8_1, blocks of 32 weights.
// (A section of its own: the K-type kernels above are tuned separately.) Each block's exact
// integer sum lands in one int32 lane, 8 blocks a step; kernels.h's legacy_block /
// legacy_block_min then run on __m256 (the scalar expression lane by lane), and the 8 terms
// are added in block order as ref.cpp adds them; a tail of < 8 blocks takes legacy_term.
// =============================================================================================
namespace legacy {

// The 32 weights of a block's 16 nibble bytes: weight j (< 16) is the low nibble of byte j,
// weight j + 16 its high nibble.
inline __m256i nibbles(const uint8_t *qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
  const __m128i low4 = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                          _mm_and_si128(bytes, low4));
}

// Bit j of a Q5 block's 32 high bits as 0x10 in byte j.
inline __m256i high_bits(const uint8_t qh[4]) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  // Byte j takes byte j / 8 of the word (the word sits in both 128-bit lanes).
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                         0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(0x10));
}

// 8 int32 partial sums of w * a over 32 lanes. Signed: any int8 w, a never -128 (neither our
// nor ggml's Q8_0 quantizer makes it): |w| * (a * sign w), pairs <= 2 * 128 * 127 in int16.
inline __m256i dot_signed(__m256i w, __m256i a) {
  return _mm256_madd_epi16(
      _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)),
      _mm256_set1_epi16(1));
}

// Unsigned w <= 31, any int8 a.
inline __m256i dot_unsigned(__m256i w, __m256i a) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
}

inline __m256i activations(const int8_t *qs) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs));
}

inline __m256i block_dot(const BlockQ4_0 &x, const BlockQ8_0 &y) {
  return dot_signed(_mm256_sub_epi8(nibbles(x.qs), _mm256_set1_epi8(8)), activations(y.qs));
}
inline __m256i block_dot(const BlockQ4_1 &x, const BlockQ8_1 &y) {
  return dot_unsigned(nibbles(x.qs), activations(y.qs));
}
inline __m256i block_dot(const BlockQ5_0 &x, const BlockQ8_0 &y) {
  const __m256i w = _mm256_or_si256(nibbles(x.qs), high_bits(x.qh));
  return dot_signed(_mm256_sub_epi8(w, _mm256_set1_epi8(16)), activations(y.qs));
}
inline __m256i block_dot(const BlockQ5_1 &x, const BlockQ8_1 &y) {
  return dot_unsigned(_mm256_or_si256(nibbles(x.qs), high_bits(x.qh)), activations(y.qs));
}
inline __m256i block_dot(const BlockQ8_0 &x, const BlockQ8_0 &y) {
  return dot_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(x.qs)),
                    activations(y.qs));
}

// The totals of 8 vectors of 8 int32, lane j = the sum of v[j]'s lanes.
inline __m256i totals(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),
                                      _mm256_hadd_epi32(v[2], v[3]));  // v0..v3 | v0..v3
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]),
                                      _mm256_hadd_epi32(v[6], v[7]));  // v4..v7 | v4..v7
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// 8 fp16 fields, one per block, as floats (F16C: exact, like fp16_to_fp32).
template <typename Block, typename Field>
inline __m256 halves(const Block *b, Field field) {
  return _mm256_cvtph_ps(_mm_setr_epi16(
      static_cast<short>(field(b[0])), static_cast<short>(field(b[1])),
      static_cast<short>(field(b[2])), static_cast<short>(field(b[3])),
      static_cast<short>(field(b[4])), static_cast<short>(field(b[5])),
      static_cast<short>(field(b[6])), static_cast<short>(field(b[7]))));
}

template <typename W>
inline __m256 terms(const W *x, const BlockQ8_0 *y, __m256 sums) {
  return legacy_block(halves(x, [](const W &b) { return b.d; }),
                      halves(y, [](const BlockQ8_0 &b) { return b.d; }), sums);
}

template <typename W>
inline __m256 terms(const W *x, const BlockQ8_1 *y, __m256 sums) {
  return legacy_block_min(halves(x, [](const W &b) { return b.d; }),
                          halves(y, [](const BlockQ8_1 &b) { return b.d; }), sums,
                          halves(x, [](const W &b) { return b.m; }),
                          halves(y, [](const BlockQ8_1 &b) { return b.s; }));
}

template <typename W, typename A>
float dot(const void *vx, const void *vy, int64_t nb) {
  const auto *x = static_cast<const W *>(vx);
  const auto *y = static_cast<const A *>(vy);
  float sum = 0.0f;
  int64_t i = 0;
  for (; i + 8 <= nb; i += 8) {
    __m256i sums[8];
    for (int j = 0; j < 8; ++j) sums[j] = block_dot(x[i + j], y[i + j]);
    alignas(32) float t[8];
    _mm256_store_ps(t, terms(x + i, y + i, _mm256_cvtepi32_ps(totals(sums))));
    for (int j = 0; j < 8; ++j) sum += t[j];
  }
  for (; i < nb; ++i) sum += legacy_term(x[i], y[i], hsum_epi32(block_dot(x[i], y[i])));
  return sum;
}

}  // namespace legacy
}  // namespace

const DotKernels *avx2_kernels() {
  static const DotKernels kernels{
      "avx2", dot_q4_K, dot_q5_K, dot_q6_K,
      legacy::dot<BlockQ4_0, BlockQ8_0>, legacy::dot<BlockQ4_1, BlockQ8_1>,
      legacy::dot<BlockQ5_0, BlockQ8_0>, legacy::dot<BlockQ5_1, BlockQ8_1>,
      legacy::dot<BlockQ8_0, BlockQ8_0>};
  return &kernels;
}

}  // namespace elk
