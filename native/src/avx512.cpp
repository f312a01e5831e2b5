// AVX-512 kernels (x86-64 with AVX-512 F, BW, VL, DQ and VNNI): the reference's integer sums,
// 64 weights a step. Built with those flags for this file only; dispatch.cpp calls it only on a
// CPU that has them all, so the library still loads on any x86-64.
//
// The same register tiles as avx2.cpp, at twice the width and with VNNI's fused adds:
// - K types: a zmm holds two sub-blocks (64 weights, whose 64 activations lie side by side in
//   the Q8_K block); maddubs makes int16 pairs and vpdpwssd multiplies them by the sub-block
//   scales and adds them to the int32 sums in one instruction. 32 registers hold 4 x 4 tiles.
// - Legacy types: a zmm holds two blocks; the weights' codes are read unsigned, so vpdpbusd
//   gives each block's exact integer dot from an accumulator that starts at -offset * (sum of
//   the activations) (Q4_0: 8, Q5_0: 16, Q8_0: 128, as code + 128; Q4_1/Q5_1: 0).
// Integer sums are exact in any order, and the float expression per (super-)block is
// kernels.h's, lane by lane and in block order: every element gets the reference's bits.
#include <immintrin.h>

#include <cstddef>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "x86_common.h"

// GCC 12 warns that the upper half of _mm512_castsi256_si512's result is uninitialized inside
// its own intrinsics: it is undefined by design, and no lane of it is ever read.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace elk {
namespace {

inline void keep_in_register(__m512i &v) { asm("" : "+v"(v)); }

template <typename T>
inline __m512i load512(const T *p) {
  return _mm512_loadu_si512(reinterpret_cast<const void *>(p));
}

// 32 bytes in both halves of a zmm.
template <typename T>
inline __m512i broadcast256(const T *p) {
  return _mm512_broadcast_i64x4(load256(p));
}

// A zmm's int32 lanes folded to 8 (lane l + lane l + 8), exactly.
inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// 32 int16: the low 16 `lo`, the high 16 `hi` (per-half shift counts for srlv/sllv).
inline __m512i halves16(int16_t lo, int16_t hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(lo)),
                            _mm256_set1_epi16(hi), 1);
}

// 64 bytes: the low 32 `lo`, the high 32 `hi`.
inline __m512i bytes_by_half(uint8_t lo, uint8_t hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8(static_cast<char>(lo))),
                            _mm256_set1_epi8(static_cast<char>(hi)), 1);
}

// One MR x NR tile of Q4_K (kQ5 false) or Q5_K (kQ5 true) weights times Q8_K activations
// (arguments as avx2.cpp's tile_k45).
template <bool kQ5, int MR, int NR>
void tile_k45(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
              float *out, int64_t ldo, const uint8_t *prefetch) {
  using Block = typename std::conditional<kQ5, BlockQ5_K, BlockQ4_K>::type;
  using L = Lanes<MR, NR>;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i high_nibble = halves16(0, 4);  // the high half takes the high nibbles
  const __m256i dup_scales = _mm256_setr_epi8(
      0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,
      4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
  const __m128i widen_mins = _mm_setr_epi8(8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14,
                                           -1, 15, -1);
  __m128 sum[L::G];
#pragma GCC unroll 8
  for (int g = 0; g < L::G; ++g) sum[g] = _mm_setzero_ps();
  const size_t slice = prefetch_slice(NR * (ws ? ws : nb * sizeof(Block)), nb);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_lines(prefetch + b * slice, slice);
    const Block *x[NR];
    const BlockQ8_K *y[MR];
    __m512i scale8[NR];  // the 8 sub-block scales as int16 pairs (s | s << 16), dwords 0..7
    __m128i mins[NR];    // the 8 mins, int16
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) x[j] = reinterpret_cast<const Block *>(w + j * ws) + b;
#pragma GCC unroll 8
    for (int j = 0; j < NR; j += 2) {  // two rows' scales per unpack
      const __m256i sm = scales_mins_k4(x[j]->scales, x[j + 1 < NR ? j + 1 : j]->scales);
      for (int r = 0; r < 2 && j + r < NR; ++r) {
        const __m256i row = _mm256_permute4x64_epi64(sm, r ? 0xee : 0x44);  // in both lanes
        scale8[j + r] = _mm512_castsi256_si512(_mm256_shuffle_epi8(row, dup_scales));
        mins[j + r] = _mm_shuffle_epi8(_mm256_castsi256_si128(row), widen_mins);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) y[i] = reinterpret_cast<const BlockQ8_K *>(a + i * as) + b;
    __m512i acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles)
      // Dwords 0-7 take scale 2p, dwords 8-15 scale 2p + 1.
      const __m512i pick = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_set1_epi32(2 * p)), _mm256_set1_epi32(2 * p + 1), 1);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        __m512i q = _mm512_and_si512(
            _mm512_srlv_epi16(broadcast256(x[j]->qs + 32 * p), high_nibble), low4);
        if (kQ5) {
          // Bit 2p of each qh byte is bit 4 of the low half's weight, bit 2p + 1 the high's.
          const __m512i qh = broadcast256(reinterpret_cast<const BlockQ5_K *>(x[j])->qh);
          const __mmask64 set = _mm512_test_epi8_mask(
              qh, bytes_by_half(static_cast<uint8_t>(1u << (2 * p)),
                          static_cast<uint8_t>(1u << (2 * p + 1))));
          q = _mm512_mask_add_epi8(q, set, q, _mm512_set1_epi8(0x10));
        }
        const __m512i scale = _mm512_permutexvar_epi32(pick, scale8[j]);
        // maddubs adds pairs into int16 (at most 2 * 31 * 127: no saturation); vpdpwssd
        // multiplies them by the scales and adds them to the int32 sums.
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          acc[i][j] = _mm512_dpwssd_epi32(
              acc[i][j], _mm512_maddubs_epi16(q, load512(y[i]->qs + 64 * p)), scale);
          keep_in_register(acc[i][j]);
        }
      }
    }
    // Sums of 32 activations per sub-block (int16: at most 32 * 127), for the min terms.
    __m128i pairs[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      pairs[i] = _mm_hadd_epi16(load128(y[i]->bsums), load128(y[i]->bsums + 8));
    const uint8_t *xb[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) xb[j] = reinterpret_cast<const uint8_t *>(x[j]);
#pragma GCC unroll 8
    for (int g = 0; g < L::G; ++g) {
      const __m256 dd = lane_half_pair<MR, NR>(xb, 4 % NR == 0 ? 0 : g);
      const __m128i dots =
          hsum4(fold(acc[L::i(g, 0)][L::j(g, 0)]), fold(acc[L::i(g, 1)][L::j(g, 1)]),
                fold(acc[L::i(g, 2)][L::j(g, 2)]), fold(acc[L::i(g, 3)][L::j(g, 3)]));
      const __m128i min = hsum4(_mm_madd_epi16(mins[L::j(g, 0)], pairs[L::i(g, 0)]),
                                _mm_madd_epi16(mins[L::j(g, 1)], pairs[L::i(g, 1)]),
                                _mm_madd_epi16(mins[L::j(g, 2)], pairs[L::i(g, 2)]),
                                _mm_madd_epi16(mins[L::j(g, 3)], pairs[L::i(g, 3)]));
      sum[g] = _mm_add_ps(sum[g], k_block4(_mm256_castps256_ps128(dd),
                                           _mm256_extractf128_ps(dd, 1),
                                           lane_dy<MR, NR>(y, g), dots, min));
    }
  }
  store_tile<MR, NR>(sum, out, ldo);
}

// The GEMV of Q4_K / Q5_K: one activation row against 4 weight rows at a time, the integer
// sums of tile_k45<kQ5, 1, 4> in fewer instructions:
// - a zmm load takes 64 code bytes (128 weights): its low nibbles are sub-blocks 2h and
//   2h + 2, its high nibbles 2h + 1 and 2h + 3 (h = 0 for bytes 0-63, 4 for 64-127), so the
//   activations are reordered to match, once a call (gemv_order);
// - each row's first 16 bytes (d, dmin and the 12 packed scale bytes) go to a 128-bit lane of
//   one zmm: one unpack gives the 4 rows' scales and mins, one conversion their d and dmin,
//   one multiply their min terms, and each scale vector is one in-lane byte shuffle.
// Same integer sums, the same k_block4 per block in order: the reference's bits.
constexpr int kGemvRows = 4;

// Q8_K codes of nb blocks in the order gemv_k45_4 reads them: per block, 32-byte runs
// 0, 2, 1, 3, 4, 6, 5, 7 (weights 0-31, 64-95, 32-63, 96-127, ...).
inline const int8_t *gemv_order(const BlockQ8_K *y, int64_t nb) {
  thread_local std::vector<int8_t> codes;
  codes.resize(static_cast<size_t>(nb) * QK_K);
  for (int64_t b = 0; b < nb; ++b) {
    int8_t *dst = codes.data() + b * QK_K;
    for (int r = 0; r < 8; ++r) {
      const int from = (r & ~3) | ((r & 1) << 1) | ((r >> 1) & 1);
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + 32 * r),
                          load256(y[b].qs + 32 * from));
    }
  }
  return codes.data();
}

template <bool kQ5>
void gemv_k45_4(const uint8_t *w, size_t ws, const BlockQ8_K *y, const int8_t *codes,
                int64_t nb, float *out, const uint8_t *prefetch) {
  using Block = typename std::conditional<kQ5, BlockQ5_K, BlockQ4_K>::type;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  // scales_mins_k4's shuffles and masks, shifted by the 4 bytes of d and dmin.
  const __m512i take_a = _mm512_broadcast_i32x4(
      _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i take_b = _mm512_broadcast_i32x4(
      _mm_setr_epi8(4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11));
  const __m512i mask_low = _mm512_broadcast_i32x4(
      _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m512i mask_nibble = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
  const __m512i mask_top = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48));
  // Qwords: the 4 rows' scales (each lane's qword 0), then their mins (qword 1).
  const __m512i split = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  // Words: d of rows 0-3, then dmin of rows 0-3 (words 0 and 1 of each 128-bit lane).
  const __m512i halves = _mm512_setr_epi32(0x00080000, 0x00180010, 0x00090001, 0x00190011,
                                           0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i row_sums = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  // Scale vectors: a row's 8 scales as int16 in every 128-bit lane; lanes 0-1 take word s,
  // lanes 2-3 word s + 2 (the sub-blocks of a zmm's low or high nibbles).
  __m512i pick[4];
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) {
    const int lo = s < 2 ? s : s + 2;  // s: 0, 1, 4, 5
    const __m128i a = _mm_set1_epi16(static_cast<int16_t>((2 * lo + 1) << 8 | 2 * lo));
    const __m128i c =
        _mm_set1_epi16(static_cast<int16_t>((2 * lo + 5) << 8 | (2 * lo + 4)));
    pick[s] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(a, a)),
                                 _mm256_set_m128i(c, c), 1);
  }
  __m128 sum = _mm_setzero_ps();
  const size_t slice = prefetch_slice(kGemvRows * ws, nb);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_lines(prefetch + b * slice, slice);
    const uint8_t *x[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) x[j] = w + j * ws + b * sizeof(Block);
    const __m512i head = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu2_m128i(reinterpret_cast<const __m128i *>(x[1]),
                                                   reinterpret_cast<const __m128i *>(x[0]))),
        _mm256_loadu2_m128i(reinterpret_cast<const __m128i *>(x[3]),
                            reinterpret_cast<const __m128i *>(x[2])), 1);
    const __m512i sa = _mm512_shuffle_epi8(head, take_a), sb = _mm512_shuffle_epi8(head, take_b);
    const __m512i sm = _mm512_permutexvar_epi64(split, _mm512_or_si512(
        _mm512_or_si512(_mm512_and_si512(sa, mask_low),
                        _mm512_and_si512(_mm512_srli_epi16(sa, 4), mask_nibble)),
        _mm512_and_si512(_mm512_srli_epi16(sb, 2), mask_top)));
    const __m512i sc16 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(sm));  // row j: 8j..8j+7
    const __m512i mn16 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(sm, 1));
    const int8_t *act = codes + b * QK_K;
    __m512i acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      // Row j's scales (sc16's lane j) in every lane.
      const __m512i scales = _mm512_permutexvar_epi64(
          _mm512_setr_epi64(2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j,
                            2 * j + 1), sc16);
      __m512i hb = _mm512_setzero_si512();
      if (kQ5) hb = broadcast256(x[j] + offsetof(BlockQ5_K, qh));
      acc[j] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // code bytes 64h ..: sub-blocks 4h .. 4h + 3
        const __m512i bytes = load512(x[j] + offsetof(Block, qs) + 64 * h);
        __m512i q[2] = {_mm512_and_si512(bytes, low4),
                        _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4)};
#pragma GCC unroll 2
        for (int r = 0; r < 2; ++r) {
          if (kQ5) {
            // qh bit k of byte l: bit 4 of weight l of sub-block k. Sub-blocks 4h + r (low
            // 256 bits) and 4h + r + 2 (high): the same qh bytes, bits 4h + r and 4h + r + 2.
            const __mmask64 set = _mm512_test_epi8_mask(
                hb, bytes_by_half(static_cast<uint8_t>(1u << (4 * h + r)),
                                  static_cast<uint8_t>(1u << (4 * h + r + 2))));
            q[r] = _mm512_mask_add_epi8(q[r], set, q[r], _mm512_set1_epi8(0x10));
          }
          acc[j] = _mm512_dpwssd_epi32(
              acc[j], _mm512_maddubs_epi16(q[r], load512(act + 128 * h + 64 * r)),
              _mm512_shuffle_epi8(scales, pick[2 * h + r]));
          keep_in_register(acc[j]);
        }
      }
    }
    // The 4 rows' dots: {sum acc[0], .., sum acc[3]}, exactly.
    const __m512i a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[0], acc[1]),
                                         _mm512_unpackhi_epi32(acc[0], acc[1]));
    const __m512i a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2], acc[3]),
                                         _mm512_unpackhi_epi32(acc[2], acc[3]));
    const __m512i a0123 = _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23),
                                           _mm512_unpackhi_epi64(a01, a23));
    const __m256i a8 = fold(a0123);
    const __m128i dots =
        _mm_add_epi32(_mm256_castsi256_si128(a8), _mm256_extracti128_si256(a8, 1));
    // Min terms: the 8 sub-block sums of the activations against each row's 8 mins.
    const __m512i pairs = _mm512_broadcast_i32x4(
        _mm_hadd_epi16(load128(y[b].bsums), load128(y[b].bsums + 8)));
    __m512i mins = _mm512_madd_epi16(mn16, pairs);  // lane j: row j's 4 partial sums
    mins = _mm512_add_epi32(mins, _mm512_shuffle_epi32(mins, _MM_PERM_CDAB));
    mins = _mm512_add_epi32(mins, _mm512_shuffle_epi32(mins, _MM_PERM_BADC));
    const __m128i min = _mm512_castsi512_si128(_mm512_permutexvar_epi32(row_sums, mins));
    const __m256 dd = _mm256_cvtph_ps(
        _mm512_castsi512_si128(_mm512_permutexvar_epi16(halves, head)));
    sum = _mm_add_ps(sum, k_block4(_mm256_castps256_ps128(dd), _mm256_extractf128_ps(dd, 1),
                                   _mm_set1_ps(y[b].d), dots, min));
  }
  _mm_storeu_ps(out, sum);
}

// One activation row: gemv_k45_4 over rows 4 at a time, the row-major tiles for the rest.
template <bool kQ5, template <int, int> class Tile>
void gemv_k45(const void *w, size_t ws, int64_t n, const void *a, int64_t nb, float *out) {
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *y = static_cast<const BlockQ8_K *>(a);
  const int8_t *codes = gemv_order(y, nb);
  int64_t j = 0;
  for (; j + kGemvRows <= n; j += kGemvRows) {
    gemv_k45_4<kQ5>(wb + j * ws, ws, y, codes, nb, out + j, wb + (j + kGemvRows) * ws);
  }
  if (j < n) {
    tiled_gemm<Tile, TileShape<4, 4, 4>>(wb + j * ws, ws, n - j, a, 0, 1, nb, out + j, n - j);
  }
}

// One MR x NR tile of Q6_K weights times Q8_K activations (arguments as tile_k45).
template <int MR, int NR>
void tile_q6(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
             float *out, int64_t ldo, const uint8_t *prefetch) {
  using L = Lanes<MR, NR>;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i top2 = _mm512_set1_epi8(0x30);
  // qh's bits 2q, 2q + 1 to bits 4, 5 of quarter q: quarters 0 | 1 shift left 4 | 2,
  // quarters 2 | 3 right 0 | 2 (16-bit shifts, then masked).
  const __m512i left01 = halves16(4, 2), right23 = halves16(0, 2);
  __m128 sum[L::G];
#pragma GCC unroll 8
  for (int g = 0; g < L::G; ++g) sum[g] = _mm_setzero_ps();
  const size_t slice = prefetch_slice(NR * (ws ? ws : nb * sizeof(BlockQ6_K)), nb);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_lines(prefetch + b * slice, slice);
    const BlockQ6_K *x[NR];
    const BlockQ8_K *y[MR];
    __m512i scales[NR];  // the 16 scales as int16 (words 0..15)
    __m512i acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) y[i] = reinterpret_cast<const BlockQ8_K *>(a + i * as) + b;
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      x[j] = reinterpret_cast<const BlockQ6_K *>(w + j * ws) + b;
      const __m256i s16 = _mm256_cvtepi8_epi16(load128(x[j]->scales));
      scales[j] = _mm512_castsi256_si512(s16);
      // Weights are read unsigned (0..63): the -32 of each is -32 * scale * (sum of its 16
      // activations), which starts the sum (int32 arithmetic wraps, the total is exact).
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        acc[i][j] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(),
            _mm256_slli_epi32(_mm256_madd_epi16(s16, load256(y[i]->bsums)), 5)));
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // 128 weights: quarters 0 | 1, then 2 | 3, 64 a zmm
      // int16 lane t of quarters 2r | 2r + 1 has scale 8h + 4r + t / 8.
      const __m512i pick0 = _mm512_set_epi16(
          8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3, 8 * h + 3,
          8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2, 8 * h + 2,
          8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1, 8 * h + 1,
          8 * h, 8 * h, 8 * h, 8 * h, 8 * h, 8 * h, 8 * h, 8 * h);
      const __m512i pick1 = _mm512_add_epi16(pick0, _mm512_set1_epi16(4));
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const __m512i ql = load512(x[j]->ql + 64 * h);
        const __m512i qh = broadcast256(x[j]->qh + 32 * h);
        const __m512i wq[2] = {
            _mm512_or_si512(_mm512_and_si512(ql, low4),
                            _mm512_and_si512(_mm512_sllv_epi16(qh, left01), top2)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                            _mm512_and_si512(_mm512_srlv_epi16(qh, right23), top2)),
        };
        const __m512i scale[2] = {_mm512_permutexvar_epi16(pick0, scales[j]),
                                  _mm512_permutexvar_epi16(pick1, scales[j])};
#pragma GCC unroll 2
        for (int r = 0; r < 2; ++r) {
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            // maddubs pairs at most 2 * 63 * 127: no saturation.
            acc[i][j] = _mm512_dpwssd_epi32(
                acc[i][j], _mm512_maddubs_epi16(wq[r], load512(y[i]->qs + 128 * h + 64 * r)),
                scale[r]);
            keep_in_register(acc[i][j]);
          }
        }
      }
    }
    const uint8_t *xb[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) xb[j] = reinterpret_cast<const uint8_t *>(x[j]);
#pragma GCC unroll 8
    for (int g = 0; g < L::G; ++g) {
      const __m128 d = lane_half<MR, NR>(xb, 4 % NR == 0 ? 0 : g, offsetof(BlockQ6_K, d));
      const __m128i dots =
          hsum4(fold(acc[L::i(g, 0)][L::j(g, 0)]), fold(acc[L::i(g, 1)][L::j(g, 1)]),
                fold(acc[L::i(g, 2)][L::j(g, 2)]), fold(acc[L::i(g, 3)][L::j(g, 3)]));
      // k_block(d, 0, dy, dots, 0), as the reference writes it.
      sum[g] = _mm_add_ps(sum[g], k_block4(d, _mm_setzero_ps(), lane_dy<MR, NR>(y, g), dots,
                                           _mm_setzero_si128()));
    }
  }
  store_tile<MR, NR>(sum, out, ldo);
}

template <int MR, int NR>
struct Q4Tile {
  static void run(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
                  float *out, int64_t ldo, const uint8_t *prefetch) {
    tile_k45<false, MR, NR>(w, ws, a, as, nb, out, ldo, prefetch);
  }
};
template <int MR, int NR>
struct Q5Tile {
  static void run(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
                  float *out, int64_t ldo, const uint8_t *prefetch) {
    tile_k45<true, MR, NR>(w, ws, a, as, nb, out, ldo, prefetch);
  }
};
template <int MR, int NR>
struct Q6Tile {
  static void run(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
                  float *out, int64_t ldo, const uint8_t *prefetch) {
    tile_q6<MR, NR>(w, ws, a, as, nb, out, ldo, prefetch);
  }
};

// A GEMV row against 4 weight rows; batches in 4 x 4 tiles (16 zmm accumulators).
using Shape = TileShape<4, 4, 4>;

template <template <int, int> class Tile>
void gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
          int64_t nb, float *out, int64_t ldo) {
  tiled_gemm<Tile, Shape>(w, ws, n, a, as, m, nb, out, ldo);
}

// =============================================================================================
// K-type batches through 8 weight rows interleaved on the fly, one super-block at a time.
// =============================================================================================
// In the row-major tiles a zmm holds one row's 64 weights, so each maddubs needs its own
// vpdpwssd (2 multiplies per 64 products) and each row's block sum ends spread over 16 lanes.
// Here a zmm holds 8 consecutive weights of one sub-block from each of 8 rows, and meets the 8
// matching activations broadcast: the 4 maddubs of a Q4_K/Q5_K sub-block (32 weights) add in
// int16 (at most 4 * 2 * 31 * 128 = 31744: no overflow) before one vpdpwssd applies the 8 rows'
// scales (5 multiplies per 8 rows x 32 products), and each row's sum lies in 2 int32 lanes. The
// repack is a few instructions per weight byte, shared by every activation row of the task.
// Integer sums are exact in any order, and each element's float sum is k_block's, block by
// block in order as the reference adds them: the same bits as the row-major tiles.
namespace interleaved {

constexpr int kRows = 8;       // weight rows a panel
// Activation rows a register tile (run_panels, x86_common.h): 4 ran fastest (8 fit the
// registers, but its unrolled code outgrew the op cache). With fewer activation rows than
// kMinBatch (Q4_K, Q5_K) or kMinBatch6 (Q6_K, whose repack does more) the repack costs more
// than it saves. Measured on Zen 4: single-thread elk_gemm Q4_K 1.06x / 1.11x / 1.20x at 2 / 3 /
// 4 rows (Q5_K 1.03x / 1.19x at 2 / 4), and decode steps of 2..4 sequences of a llama3-1b
// shape (weights from DRAM, 2 threads) no slower; Q6_K 0.55x / 0.82x at 2 / 4 rows, and 8 the
// first size that ran faster in the model.
constexpr int64_t kMinBatch = 2, kMinBatch6 = 8;

// One super-block of a panel of 8 weight rows, ready for the tiles.
struct Panel {
  __m512i q[8][4];  // sub-block s, step t: qword r = codes 32 s + 8 t .. + 7 of row r
  __m512i scale[8];  // sub-block s: int16 lanes 4 r .. 4 r + 3 = row r's scale
  __m512i mins[2];  // int16, rows 0-3 | 4-7: lanes 8 (r % 4) + s = row r's min of sub-block s
  __m256 d, dmin;
};

// 32 bytes at p of each of 8 rows (row stride ws) as 4 zmm: out[t] qword r = row r's qword t.
inline void transpose32(const uint8_t *p, size_t ws, __m512i *out) {
  __m512i two[4];
#pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) {  // rows 2l | 2l + 1, 4 qwords each
    two[l] = _mm512_inserti64x4(_mm512_castsi256_si512(load256(p + 2 * l * ws)),
                                load256(p + (2 * l + 1) * ws), 1);
  }
  // Rows 0-3 (lo) and 4-7 (hi), qwords 0 | 1 (01) and 2 | 3 (23), rows in order in each half.
  const __m512i step01 = _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13);
  const __m512i step23 = _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i lo01 = _mm512_permutex2var_epi64(two[0], step01, two[1]);
  const __m512i lo23 = _mm512_permutex2var_epi64(two[0], step23, two[1]);
  const __m512i hi01 = _mm512_permutex2var_epi64(two[2], step01, two[3]);
  const __m512i hi23 = _mm512_permutex2var_epi64(two[2], step23, two[3]);
  const __m512i first4 = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11);
  const __m512i last4 = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  out[0] = _mm512_permutex2var_epi64(lo01, first4, hi01);
  out[1] = _mm512_permutex2var_epi64(lo01, last4, hi01);
  out[2] = _mm512_permutex2var_epi64(lo23, first4, hi23);
  out[3] = _mm512_permutex2var_epi64(lo23, last4, hi23);
}

// Bit `bit` (0..7) of each byte as 0x10 (16-bit shifts of at most 4 left or 3 right: bit 4 of
// each byte comes from its own byte).
inline __m512i bit_as_16(__m512i v, int bit) {
  const __m512i moved = bit <= 4 ? _mm512_slli_epi16(v, 4 - bit) : _mm512_srli_epi16(v, bit - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
}

// Block b of the 8 Q4_K or Q5_K rows at w (row stride ws) into p.
template <typename Block>
inline void repack(const uint8_t *w, size_t ws, int64_t b, Panel &p) {
  constexpr bool kQ5 = std::is_same<Block, BlockQ5_K>::value;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const uint8_t *block = w + b * sizeof(Block);
  __m512i high[4];  // Q5_K: qh byte l's bit k is bit 4 of weight l of sub-block k
  if (kQ5) transpose32(block + offsetof(BlockQ5_K, qh), ws, high);
#pragma GCC unroll 4
  for (int pair = 0; pair < 4; ++pair) {  // qs bytes 32 pair ..: sub-blocks 2 pair (low
    __m512i codes[4];                      // nibbles) and 2 pair + 1 (high nibbles)
    transpose32(block + offsetof(Block, qs) + 32 * pair, ws, codes);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      p.q[2 * pair][t] = _mm512_and_si512(codes[t], low4);
      p.q[2 * pair + 1][t] = _mm512_and_si512(_mm512_srli_epi16(codes[t], 4), low4);
      if (kQ5) {
        p.q[2 * pair][t] = _mm512_or_si512(p.q[2 * pair][t], bit_as_16(high[t], 2 * pair));
        p.q[2 * pair + 1][t] =
            _mm512_or_si512(p.q[2 * pair + 1][t], bit_as_16(high[t], 2 * pair + 1));
      }
    }
  }
  // Scales and mins of rows 2l, 2l + 1 in 128-bit lane l: bytes 0-7 row 2l's, 8-15 row 2l + 1's.
  __m128i scales[4], mins[4];
  uint16_t d[8], dmin[8];
#pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) {
    const auto *a = reinterpret_cast<const Block *>(w + 2 * l * ws) + b;
    const auto *c = reinterpret_cast<const Block *>(w + (2 * l + 1) * ws) + b;
    // scales_mins_k4: lane 0 row a (scales | mins), lane 1 row c; qwords to a.s c.s a.m c.m.
    const __m256i sm = _mm256_permute4x64_epi64(scales_mins_k4(a->scales, c->scales), 0xd8);
    scales[l] = _mm256_castsi256_si128(sm);
    mins[l] = _mm256_extracti128_si256(sm, 1);
    d[2 * l] = a->d, d[2 * l + 1] = c->d;
    dmin[2 * l] = a->dmin, dmin[2 * l + 1] = c->dmin;
  }
  const __m512i sc = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_set_m128i(scales[1], scales[0])),
      _mm256_set_m128i(scales[3], scales[2]), 1);
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {  // row 2l's scale s to int16 lanes 0-3 of lane l, 2l + 1's to 4-7
    const char lo = static_cast<char>(s), hi = static_cast<char>(8 + s);
    p.scale[s] = _mm512_shuffle_epi8(sc, _mm512_broadcast_i32x4(_mm_setr_epi8(
        lo, -1, lo, -1, lo, -1, lo, -1, hi, -1, hi, -1, hi, -1, hi, -1)));
  }
  p.mins[0] = _mm512_cvtepu8_epi16(_mm256_set_m128i(mins[1], mins[0]));
  p.mins[1] = _mm512_cvtepu8_epi16(_mm256_set_m128i(mins[3], mins[2]));
  p.d = _mm256_cvtph_ps(load128(d));
  p.dmin = _mm256_cvtph_ps(load128(dmin));
}

inline __m512i broadcast64(const void *p) {
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi64(v);
}

// MR activation rows (y[i]: their block b) times the panel's block: each element's term added
// to its running sum in out (the first block starts it from 0, as the reference's sum does).
template <int MR>
inline void panel_rows(const Panel &p, const BlockQ8_K *const *y, __m256 *sum) {
  __m512i acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 1  // (unrolled, the code outgrows the op cache)
  for (int s = 0; s < 8; ++s) {
    __m512i part[MR];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512i q = p.q[s][t];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512i prod = _mm512_maddubs_epi16(q, broadcast64(y[i]->qs + 32 * s + 8 * t));
        part[i] = t == 0 ? prod : _mm512_add_epi16(part[i], prod);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      acc[i] = _mm512_dpwssd_epi32(acc[i], part[i], p.scale[s]);
      keep_in_register(acc[i]);
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i lane_firsts =
      _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    // Row r's dot: dwords 2r + 2r + 1; its mins: the 4 dwords of a lane of madd(mins, bsums).
    const __m512i pair_sums = _mm512_add_epi32(acc[i], _mm512_shuffle_epi32(acc[i], _MM_PERM_CDAB));
    const __m256i dots = _mm512_castsi512_si256(_mm512_permutexvar_epi32(even, pair_sums));
    const __m512i sub_sums = _mm512_broadcast_i32x4(
        _mm_hadd_epi16(load128(y[i]->bsums), load128(y[i]->bsums + 8)));
    __m512i m0 = _mm512_madd_epi16(p.mins[0], sub_sums);
    __m512i m1 = _mm512_madd_epi16(p.mins[1], sub_sums);
    m0 = _mm512_add_epi32(m0, _mm512_shuffle_epi32(m0, _MM_PERM_CDAB));
    m1 = _mm512_add_epi32(m1, _mm512_shuffle_epi32(m1, _MM_PERM_CDAB));
    m0 = _mm512_add_epi32(m0, _mm512_shuffle_epi32(m0, _MM_PERM_BADC));
    m1 = _mm512_add_epi32(m1, _mm512_shuffle_epi32(m1, _MM_PERM_BADC));
    const __m256i mins = _mm512_castsi512_si256(_mm512_permutex2var_epi32(m0, lane_firsts, m1));
    sum[i] += k_block_lanes(p.d, p.dmin, _mm256_set1_ps(y[i]->d), _mm256_cvtepi32_ps(dots),
                            _mm256_cvtepi32_ps(mins));
  }
}

template <int MR>
void rows_of_panel(const Panel &p, const uint8_t *a, size_t as, int64_t b, __m256 *sum) {
  const BlockQ8_K *y[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) y[i] = reinterpret_cast<const BlockQ8_K *>(a + i * as) + b;
  panel_rows<MR>(p, y, sum);
}

template <typename Block, template <int, int> class Tile>
void gemm_k45(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
              int64_t nb, float *out, int64_t ldo) {
  if (m == 1) {
    gemv_k45<std::is_same<Block, BlockQ5_K>::value, Tile>(w, ws, n, a, nb, out);
    return;
  }
  if (m < kMinBatch || n < kRows) {
    gemm<Tile>(w, ws, n, a, as, m, nb, out, ldo);
    return;
  }
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  run_panels<kRows, Panel, __m256>(
      wb, ws, n, m, nb, out, ldo,
      [&](const uint8_t *rows, int64_t b, Panel &p) { repack<Block>(rows, ws, b, p); },
      [&](auto mr, const Panel &p, int64_t i, int64_t b, __m256 *sum) {
        rows_of_panel<decltype(mr)::value>(p, ab + i * as, as, b, sum);
      },
      [&](int64_t first) {
        gemm<Tile>(wb + first * ws, ws, n - first, a, as, m, nb, out + first, ldo);
      });
}


// ---- Q6_K -------------------------------------------------------------------------------------
// The same interleave, 16 weights a sub-block (2 steps), with signed codes c - 32 (-32..31) and
// activations read unsigned (a + 128, a copy made once a call): maddubs(a + 128, c - 32) needs
// no bias term per activation row, and the 128 * sum(c - 32) it adds is the panel's own,
// taken off once a block (corr). A step's pair sums are at most 2 * 255 * 32 = 16320, a
// sub-block's 32640: no int16 overflow.
struct Panel6 {
  __m512i q[32];  // step t (weights 8t .. 8t + 7): qword r = row r's codes - 32, as int8
  __m512i scale[16];  // sub-block s (16 weights): int16 lanes 4 r .. 4 r + 3 = row r's scale
  __m256i corr;  // per row: 128 * sum over sub-blocks of scale * sum(c - 32)
  __m256 d;
};

// An 8 x 8 transpose of qwords: out[t] qword r = in[r] qword t.
inline void transpose8(const __m512i *in, __m512i *out) {
  __m512i t[8], u[8];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm512_unpacklo_epi64(in[2 * k], in[2 * k + 1]);      // qwords 0 2 4 6
    t[2 * k + 1] = _mm512_unpackhi_epi64(in[2 * k], in[2 * k + 1]);  // qwords 1 3 5 7
  }
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {  // rows 4k .. 4k + 3
#pragma GCC unroll 2
    for (int odd = 0; odd < 2; ++odd) {
      const __m512i a = t[4 * k + odd], b = t[4 * k + 2 + odd];
      u[4 * k + odd] = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0));      // qwords 0 4
      u[4 * k + 2 + odd] = _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1));  // qwords 2 6
    }
  }
  // u[j] (j < 4) holds qwords j and j + 4 of rows 0-3 in lanes [j r0r1, j + 4 r0r1, j r2r3,
  // j + 4 r2r3], u[4 + j] the same of rows 4-7.
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm512_shuffle_i64x2(u[j], u[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
    out[j + 4] = _mm512_shuffle_i64x2(u[j], u[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// Block b of the 8 Q6_K rows at w (row stride ws) into p.
inline void repack6(const uint8_t *w, size_t ws, int64_t b, Panel6 &p) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i top2 = _mm512_set1_epi8(0x30);
  const __m512i left01 = halves16(4, 2), right23 = halves16(0, 2);
  const __m512i bias = _mm512_set1_epi8(32);
  __m512i rows[4][8];  // chunk c (weights 64c ..) of row r, codes - 32
  __m128i sc[8];
  uint16_t d[8];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    const auto *x = reinterpret_cast<const BlockQ6_K *>(w + r * ws) + b;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // as tile_q6: weights 128h + 0..63, then 128h + 64..127
      const __m512i ql = load512(x->ql + 64 * h);
      const __m512i qh = broadcast256(x->qh + 32 * h);
      rows[2 * h][r] = _mm512_sub_epi8(
          _mm512_or_si512(_mm512_and_si512(ql, low4),
                          _mm512_and_si512(_mm512_sllv_epi16(qh, left01), top2)), bias);
      rows[2 * h + 1][r] = _mm512_sub_epi8(
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                          _mm512_and_si512(_mm512_srlv_epi16(qh, right23), top2)), bias);
    }
    sc[r] = load128(x->scales);
    d[r] = x->d;
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) transpose8(rows[c], p.q + 8 * c);
  // Lane l: rows 2l | 2l + 1, scales 0-7 (low) or 8-15 (high).
  __m512i half[2];
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    __m128i lane[4];
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      lane[l] = k ? _mm_unpackhi_epi64(sc[2 * l], sc[2 * l + 1])
                  : _mm_unpacklo_epi64(sc[2 * l], sc[2 * l + 1]);
    }
    half[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(lane[1], lane[0])),
                                 _mm256_set_m128i(lane[3], lane[2]), 1);
  }
#pragma GCC unroll 16
  for (int s = 0; s < 16; ++s) {  // the scale byte to each int16's high byte, then sign-extended
    const char lo = static_cast<char>(s % 8), hi = static_cast<char>(8 + s % 8);
    p.scale[s] = _mm512_srai_epi16(
        _mm512_shuffle_epi8(half[s / 8], _mm512_broadcast_i32x4(_mm_setr_epi8(
            -1, lo, -1, lo, -1, lo, -1, lo, -1, hi, -1, hi, -1, hi, -1, hi))), 8);
  }
  __m512i corr = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
#pragma GCC unroll 16
  for (int s = 0; s < 16; ++s) {
    const __m512i sums = _mm512_add_epi16(_mm512_maddubs_epi16(ones, p.q[2 * s]),
                                          _mm512_maddubs_epi16(ones, p.q[2 * s + 1]));
    corr = _mm512_dpwssd_epi32(corr, sums, p.scale[s]);
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  corr = _mm512_add_epi32(corr, _mm512_shuffle_epi32(corr, _MM_PERM_CDAB));
  p.corr = _mm256_slli_epi32(_mm512_castsi512_si256(_mm512_permutexvar_epi32(even, corr)), 7);
  p.d = _mm256_cvtph_ps(load128(d));
}

// MR activation rows (y[i]: their block b; u[i]: its 256 codes + 128) times the panel's block,
// each element's term added to its running sum in out (as panel_rows).
template <int MR>
inline void panel6_rows(const Panel6 &p, const BlockQ8_K *const *y, const uint8_t *const *u,
                        __m256 *sum) {
  __m512i acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 2  // (unrolled, the code outgrows the op cache)
  for (int s = 0; s < 16; ++s) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i part = _mm512_add_epi16(
          _mm512_maddubs_epi16(broadcast64(u[i] + 16 * s), p.q[2 * s]),
          _mm512_maddubs_epi16(broadcast64(u[i] + 16 * s + 8), p.q[2 * s + 1]));
      acc[i] = _mm512_dpwssd_epi32(acc[i], part, p.scale[s]);
      keep_in_register(acc[i]);
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512i pair_sums =
        _mm512_add_epi32(acc[i], _mm512_shuffle_epi32(acc[i], _MM_PERM_CDAB));
    const __m256i dots = _mm256_sub_epi32(
        _mm512_castsi512_si256(_mm512_permutexvar_epi32(even, pair_sums)), p.corr);
    const __m256 zero = _mm256_setzero_ps();
    // k_block(d, 0, dy, dots, 0), as the reference writes it.
    sum[i] += k_block_lanes(p.d, zero, _mm256_set1_ps(y[i]->d), _mm256_cvtepi32_ps(dots), zero);
  }
}

void gemm_q6_K(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
               int64_t nb, float *out, int64_t ldo) {
  if (m < kMinBatch6 || n < kRows) {
    gemm<Q6Tile>(w, ws, n, a, as, m, nb, out, ldo);
    return;
  }
  q6_panels<kRows, Panel6>(
      w, ws, n, a, as, m, nb, out, ldo,
      [](const uint8_t *rows, size_t stride, int64_t b, Panel6 &p) { repack6(rows, stride, b, p); },
      [](auto mr, const Panel6 &p, const BlockQ8_K *const *y, const uint8_t *const *u,
         __m256 *sum) { panel6_rows<decltype(mr)::value>(p, y, u, sum); },
      gemm<Q6Tile>);
}

}  // namespace interleaved

float dot_q4_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  return tiled_dot<Q4Tile, BlockQ4_K>(vx, y, nb);
}
float dot_q5_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  return tiled_dot<Q5Tile, BlockQ5_K>(vx, y, nb);
}
float dot_q6_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  return tiled_dot<Q6Tile, BlockQ6_K>(vx, y, nb);
}

// =============================================================================================
// Legacy types, two blocks a zmm (blocks b and b + 1 of every row; a last odd block is paired
// with itself and its copy's term is dropped).
// =============================================================================================
namespace legacy {

template <typename W, int MR, int NR>
void tile(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb, float *out,
          int64_t ldo, const uint8_t *prefetch) {
  using Tr = Unsigned<W>;
  using A = typename Tr::A;
  using L = Tile8<MR, NR>;
  const W *x[NR];
  const A *y[MR];
  for (int j = 0; j < NR; ++j) x[j] = reinterpret_cast<const W *>(w + j * ws);
  for (int i = 0; i < MR; ++i) y[i] = reinterpret_cast<const A *>(a + i * as);
  __m256 sum[L::G];
  for (int g = 0; g < L::G; ++g) sum[g] = _mm256_setzero_ps();
  const size_t slice = prefetch_slice(NR * ws, nb);
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(Tr::kOffset));
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_lines(prefetch + b * slice, slice);
    __m256i code[NR], act[MR], start[MR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) code[j] = Tr::codes(x[j][b]);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      act[i] = load256(y[i][b].qs);
      start[i] = Tr::kOffset == 0 ? _mm256_setzero_si256()
                                  : _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(
                                        _mm256_setzero_si256(), offset, act[i]));
    }
    const BlockScales<Tr::kMin, MR, NR> scales(x, y, b);
#pragma GCC unroll 2
    for (int g = 0; g < L::G; ++g) {
      __m256i p[8];
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        p[l] = 8 * g + l >= L::T ? _mm256_setzero_si256()
                                 : _mm256_dpbusd_epi32(start[L::i(g, l)], code[L::j(g, l)],
                                                       act[L::i(g, l)]);
      }
      sum[g] = _mm256_add_ps(sum[g], scales.terms(g, _mm256_cvtepi32_ps(totals(p))));
    }
  }
  alignas(32) float lanes[L::G * 8];
  for (int g = 0; g < L::G; ++g) _mm256_store_ps(lanes + 8 * g, sum[g]);
  for (int e = 0; e < L::T; ++e) out[(e / NR) * ldo + e % NR] = lanes[e];
}

template <typename W, int MR, int NR>
struct Tile {
  static void run(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
                  float *out, int64_t ldo, const uint8_t *prefetch) {
    tile<W, MR, NR>(w, ws, a, as, nb, out, ldo, prefetch);
  }
};

// 1 x 8 for a GEMV row, 8 x 2 for batches.
using LegacyShape = Shape<8, 8, 2>;

template <typename W>
void gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
          int64_t nb, float *out, int64_t ldo) {
  tiled_gemm<Tile, LegacyShape, W>(w, ws, n, a, as, m, nb, out, ldo);
}

// ---- Batches through 16 weight rows interleaved on the fly, one block at a time -------------
// A zmm holds 4 consecutive codes of a block from each of 16 rows and meets the 4 matching
// activations broadcast: 8 vpdpbusd leave each row's exact block sum in one int32 lane, so the
// float expression per block runs 16 rows at a time with no reduction, where the row-major
// tiles reduce 8 lanes per element and block. The offset term (-offset * sum of the block's
// activations) and the activations' scales are computed once a call; each element's float sum
// is legacy_block(_min)'s, block by block in order: the same bits.
constexpr int kPanel = 16;      // weight rows a panel
// One row: the row-major tiles (this at 0.68-0.93x). From 2 rows this (single-thread elk_gemm
// on Zen 4: Q4_1 1.07x / 1.49x / 1.61x at 2 / 3 / 4 rows, Q8_0 1.18x / 1.68x / 1.71x, Q4_0 and
// Q5_0 1.5x at 4); decode steps of 4 sequences of SmolLM2 (Q4_1 / Q8_0) 12.5-14.1 -> 11.2-11.9 ms.
constexpr int64_t kMinRows = 2;

struct Panel16 {
  __m512i q[8];   // step t: dword r = row r's codes 4t .. 4t + 3 (unsigned, + offset)
  __m512 dx, m;   // the rows' scales and (Q4_1/Q5_1) mins
};


template <typename W>
inline void repack16(const uint8_t *w, size_t ws, int64_t b, Panel16 &p) {
  using Tr = Unsigned<W>;
  __m512i rows[8];  // [row l | row l + 8]
  uint16_t d[16], m[16];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) {
    const W &lo = reinterpret_cast<const W *>(w + l * ws)[b];
    const W &hi = reinterpret_cast<const W *>(w + (l + 8) * ws)[b];
    rows[l] = _mm512_inserti64x4(_mm512_castsi256_si512(Tr::codes(lo)), Tr::codes(hi), 1);
    d[l] = lo.d, d[l + 8] = hi.d;
    if (Tr::kMin) {
      std::memcpy(&m[l], reinterpret_cast<const uint8_t *>(&lo) + 2, sizeof(uint16_t));
      std::memcpy(&m[l + 8], reinterpret_cast<const uint8_t *>(&hi) + 2, sizeof(uint16_t));
    }
  }
  // An 8 x 8 dword transpose in each 256-bit half: half 0 rows 0-7, half 1 rows 8-15.
  __m512i t[8], u[8];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(rows[2 * k], rows[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(rows[2 * k], rows[2 * k + 1]);
  }
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {  // rows 4k .. 4k + 3 (and + 8): dwords j of each 128-bit lane
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      u[4 * k + 2 * h] = _mm512_unpacklo_epi64(t[4 * k + h], t[4 * k + 2 + h]);
      u[4 * k + 2 * h + 1] = _mm512_unpackhi_epi64(t[4 * k + h], t[4 * k + 2 + h]);
    }
  }
  // u[j] (rows 0-3) and u[4 + j] (rows 4-7): lane 0 dword j, lane 1 dword 4 + j, lanes 2-3
  // the same of rows + 8.
  const __m512i low_lanes = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i high_lanes = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    p.q[j] = _mm512_permutex2var_epi64(u[j], low_lanes, u[4 + j]);
    p.q[4 + j] = _mm512_permutex2var_epi64(u[j], high_lanes, u[4 + j]);
  }
  p.dx = _mm512_cvtph_ps(load256(d));
  if (Tr::kMin) p.m = _mm512_cvtph_ps(load256(m));
}

template <typename W, int MR>
inline void panel16_rows(const Panel16 &p, const uint8_t *a, size_t as,
                         const ActivationTerms *terms, int64_t nb, int64_t b, __m512 *sum) {
  using Tr = Unsigned<W>;
  using A = typename Tr::A;
  __m512i acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_set1_epi32(terms[i * nb + b].start);
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const A &y = reinterpret_cast<const A *>(a + i * as)[b];
      int32_t codes;
      std::memcpy(&codes, y.qs + 4 * t, sizeof(codes));
      acc[i] = _mm512_dpbusd_epi32(acc[i], p.q[t], _mm512_set1_epi32(codes));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const ActivationTerms &at = terms[i * nb + b];
    const __m512 dots = _mm512_cvtepi32_ps(acc[i]), dy = _mm512_set1_ps(at.dy);
    // legacy_block(_min) lane by lane (the file is built with -ffp-contract=off).
    sum[i] += Tr::kMin ? legacy_block_min(p.dx, dy, dots, p.m, _mm512_set1_ps(at.s))
                       : legacy_block(p.dx, dy, dots);
  }
}

template <typename W>
void gemm16(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
            int64_t nb, float *out, int64_t ldo) {
  using Tr = Unsigned<W>;
  using A = typename Tr::A;
  if (m < kMinRows || n < kPanel) {
    gemm<W>(w, ws, n, a, as, m, nb, out, ldo);
    return;
  }
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  const ActivationTerms *terms = activation_terms<A>(ab, as, m, nb, Tr::kOffset);
  run_panels<kPanel, Panel16, __m512>(
      wb, ws, n, m, nb, out, ldo,
      [&](const uint8_t *rows, int64_t b, Panel16 &p) { repack16<W>(rows, ws, b, p); },
      [&](auto mr, const Panel16 &p, int64_t i, int64_t b, __m512 *sum) {
        panel16_rows<W, decltype(mr)::value>(p, ab + i * as, as, terms + i * nb, nb, b, sum);
      },
      [&](int64_t first) {
        gemm<W>(wb + first * ws, ws, n - first, a, as, m, nb, out + first, ldo);
      });
}

// One row: the 1 x 1 tile (prefetching the row after it, as the K types' dots do).
template <typename W>
float dot(const void *vx, const void *vy, int64_t nb) {
  const auto *w = static_cast<const uint8_t *>(vx);
  float out;
  tile<W, 1, 1>(w, nb * sizeof(W), static_cast<const uint8_t *>(vy), 0, nb, &out, 1,
                w + nb * sizeof(W));
  return out;
}

}  // namespace legacy
}  // namespace

const GemmKernels *avx512_vnni_gemm_kernels() {
  // Activations are quantized as on AVX2 (every AVX-512 CPU has it): the same bytes anyway.
  static const GemmKernels kernels{"avx512_vnni", interleaved::gemm_k45<BlockQ4_K, Q4Tile>,
                                   interleaved::gemm_k45<BlockQ5_K, Q5Tile>,
                                   interleaved::gemm_q6_K,
                                   avx2_gemm_kernels()->quantize_q8_K,
                                   legacy::gemm16<BlockQ4_0>, legacy::gemm16<BlockQ4_1>,
                                   legacy::gemm16<BlockQ5_0>, legacy::gemm16<BlockQ5_1>,
                                   legacy::gemm16<BlockQ8_0>,
                                   avx2_gemm_kernels()->quantize_q8_0,
                                   avx2_gemm_kernels()->quantize_q8_1};
  return &kernels;
}

const DotKernels *avx512_vnni_kernels() {
  static const DotKernels kernels{
      "avx512_vnni", dot_q4_K, dot_q5_K, dot_q6_K,
      legacy::dot<BlockQ4_0>, legacy::dot<BlockQ4_1>, legacy::dot<BlockQ5_0>,
      legacy::dot<BlockQ5_1>, legacy::dot<BlockQ8_0>};
  return &kernels;
}

// ---- LoRA (lora.cpp): the reference's sums, 16 lanes across q (shrink) or j (expand) ------
// At / Bt widen as they load (F16C, a 16-bit shift: exact); 8 lanes for a rank's or a block's
// rest of 8. Several vectors a pass: independent sums in flight; each lane's is the reference's.
namespace {
template <int T>
inline __m512 lora_load16(const void *p, int64_t i) {
  if constexpr (T == ELK_LORA_F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i *>(static_cast<const uint16_t *>(p) + i)));
  } else if constexpr (T == ELK_LORA_BF16) {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i *>(static_cast<const uint16_t *>(p) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float *>(p) + i);
  }
}


template <int T>
void lora_shrink_avx512_t(const float *x, const void *a_t, int64_t k, int64_t r, float *u) {
  int64_t q = 0;
  for (; q + 32 <= r; q += 32) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
      const __m512 xi = _mm512_set1_ps(x[i]);
      acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(xi, lora_load16<T>(a_t, i * r + q)));
      acc1 = _mm512_add_ps(acc1, _mm512_mul_ps(xi, lora_load16<T>(a_t, i * r + q + 16)));
    }
    _mm512_storeu_ps(u + q, acc0);
    _mm512_storeu_ps(u + q + 16, acc1);
  }
  for (; q + 16 <= r; q += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(x[i]), lora_load16<T>(a_t, i * r + q)));
    }
    _mm512_storeu_ps(u + q, acc);
  }
  for (; q + 8 <= r; q += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(x[i]), lora_load8<T>(a_t, i * r + q)));
    }
    _mm256_storeu_ps(u + q, acc);
  }
  for (; q < r; ++q) {
    float acc = 0.0f;
    for (int64_t i = 0; i < k; ++i) acc = acc + x[i] * lora_value(a_t, T, i * r + q);
    u[q] = acc;
  }
}

template <int T>
void lora_expand_avx512_t(const float *u, const void *b_t, int64_t r, int64_t n, int64_t ldb,
                          float *t) {
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m512 acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
    for (int64_t q = 0; q < r; ++q) {
      const __m512 uq = _mm512_set1_ps(u[q]);
      const int64_t at = q * ldb + j;
      acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(uq, lora_load16<T>(b_t, at)));
      acc1 = _mm512_add_ps(acc1, _mm512_mul_ps(uq, lora_load16<T>(b_t, at + 16)));
      acc2 = _mm512_add_ps(acc2, _mm512_mul_ps(uq, lora_load16<T>(b_t, at + 32)));
      acc3 = _mm512_add_ps(acc3, _mm512_mul_ps(uq, lora_load16<T>(b_t, at + 48)));
    }
    _mm512_storeu_ps(t + j, acc0);
    _mm512_storeu_ps(t + j + 16, acc1);
    _mm512_storeu_ps(t + j + 32, acc2);
    _mm512_storeu_ps(t + j + 48, acc3);
  }
  for (; j + 16 <= n; j += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t q = 0; q < r; ++q) {
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(u[q]), lora_load16<T>(b_t, q * ldb + j)));
    }
    _mm512_storeu_ps(t + j, acc);
  }
  for (; j + 8 <= n; j += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t q = 0; q < r; ++q) {
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(u[q]), lora_load8<T>(b_t, q * ldb + j)));
    }
    _mm256_storeu_ps(t + j, acc);
  }
  for (; j < n; ++j) {
    float acc = 0.0f;
    for (int64_t q = 0; q < r; ++q) acc = acc + u[q] * lora_value(b_t, T, q * ldb + j);
    t[j] = acc;
  }
}

void lora_shrink_avx512(const float *x, const void *a_t, int type, int64_t k, int64_t r,
                        float *u) {
  if (type == ELK_LORA_F16) return lora_shrink_avx512_t<ELK_LORA_F16>(x, a_t, k, r, u);
  if (type == ELK_LORA_BF16) return lora_shrink_avx512_t<ELK_LORA_BF16>(x, a_t, k, r, u);
  lora_shrink_avx512_t<ELK_LORA_F32>(x, a_t, k, r, u);
}

void lora_expand_avx512(const float *u, const void *b_t, int type, int64_t r, int64_t n,
                        int64_t ldb, float *t) {
  if (type == ELK_LORA_F16) return lora_expand_avx512_t<ELK_LORA_F16>(u, b_t, r, n, ldb, t);
  if (type == ELK_LORA_BF16) return lora_expand_avx512_t<ELK_LORA_BF16>(u, b_t, r, n, ldb, t);
  lora_expand_avx512_t<ELK_LORA_F32>(u, b_t, r, n, ldb, t);
}
}  // namespace

const LoraKernels *avx512_lora_kernels() {
  static const LoraKernels kernels{"avx512", lora_shrink_avx512, lora_expand_avx512};
  return &kernels;
}

// ---- int8 dots (attention_i8): VNNI's vpdpbusd on 256-bit lanes -----------------------------
namespace {
void i8_dots_vnni(const int8_t *a, const int8_t *b, int64_t n, int64_t count, int32_t *out) {
  i8_dots_x86([](__m256i acc, __m256i ax, __m256i x, __m256i k) {
    return _mm256_dpbusd_epi32(acc, ax, _mm256_sign_epi8(k, x));
  }, a, b, n, count, out);
}
}  // namespace

elk_i8_dots_fn avx512_vnni_i8_dots() { return i8_dots_vnni; }

}  // namespace elk
