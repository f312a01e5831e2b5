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

// Per weight type: its activation blocks, whether it has a min, its codes' offset (the
// weight is code - offset) and its 32 codes as unsigned bytes.
template <typename W>
struct Traits;
template <>
struct Traits<BlockQ4_0> {
  using A = BlockQ8_0;
  static constexpr bool kMin = false;
  static constexpr uint8_t kOffset = 8;
  static __m256i codes(const BlockQ4_0 &x) { return nibbles(x.qs); }
};
template <>
struct Traits<BlockQ4_1> {
  using A = BlockQ8_1;
  static constexpr bool kMin = true;
  static constexpr uint8_t kOffset = 0;
  static __m256i codes(const BlockQ4_1 &x) { return nibbles(x.qs); }
};
template <>
struct Traits<BlockQ5_0> {
  using A = BlockQ8_0;
  static constexpr bool kMin = false;
  static constexpr uint8_t kOffset = 16;
  static __m256i codes(const BlockQ5_0 &x) {
    return _mm256_or_si256(nibbles(x.qs), high_bits(x.qh));
  }
};
template <>
struct Traits<BlockQ5_1> {
  using A = BlockQ8_1;
  static constexpr bool kMin = true;
  static constexpr uint8_t kOffset = 0;
  static __m256i codes(const BlockQ5_1 &x) {
    return _mm256_or_si256(nibbles(x.qs), high_bits(x.qh));
  }
};
template <>
struct Traits<BlockQ8_0> {
  using A = BlockQ8_0;
  static constexpr bool kMin = false;
  static constexpr uint8_t kOffset = 128;  // int8 w as the byte w + 128
  static __m256i codes(const BlockQ8_0 &x) {
    return _mm256_xor_si256(load256(x.qs), _mm256_set1_epi8(static_cast<char>(0x80)));
  }
};

template <typename W, int MR, int NR>
void tile(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb, float *out,
          int64_t ldo, const uint8_t *prefetch) {
  using Tr = Traits<W>;
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
  static const GemmKernels kernels{"avx512_vnni", gemm<Q4Tile>, gemm<Q5Tile>, gemm<Q6Tile>,
                                   avx2_gemm_kernels()->quantize_q8_K,
                                   legacy::gemm<BlockQ4_0>, legacy::gemm<BlockQ4_1>,
                                   legacy::gemm<BlockQ5_0>, legacy::gemm<BlockQ5_1>,
                                   legacy::gemm<BlockQ8_0>};
  return &kernels;
}

const DotKernels *avx512_vnni_kernels() {
  static const DotKernels kernels{
      "avx512_vnni", dot_q4_K, dot_q5_K, dot_q6_K,
      legacy::dot<BlockQ4_0>, legacy::dot<BlockQ4_1>, legacy::dot<BlockQ5_0>,
      legacy::dot<BlockQ5_1>, legacy::dot<BlockQ8_0>};
  return &kernels;
}

}  // namespace elk
