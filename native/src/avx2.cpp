// AVX2 kernels (x86-64 with AVX2, FMA and F16C): the reference's integer sums, 32 weights a step.
// Built with -mavx2 -mfma -mf16c for this file only; dispatch.cpp calls it only on a CPU that has
// both, so the library still loads on any x86-64.
//
// The K types run as register tiles of MR activation rows x NR weight rows (gemm below picks
// 1 x 4 for a GEMV, 4 x 2 for batches): a weight super-block is unpacked once for MR rows, an
// activation block's loads and block sums serve NR rows. Each element keeps its own exact
// integer sums per super-block, then the reference's float expression (k_block, lane by lane:
// the same IEEE operations, no FMA) is added to its sum in super-block order, so every tile
// shape gives every element the reference's bits.
#include <immintrin.h>

#include <cstddef>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "x86_common.h"

namespace elk {
namespace {
// One MR x NR tile of Q4_K (kQ5 false) or Q5_K (kQ5 true) weights times Q8_K activations:
// weight row j at w + j * ws, activation row i at a + i * as, nb super-blocks; the result
// of element (i, j) goes to out[i * ldo + j].
template <bool kQ5, int MR, int NR>
void tile_k45(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
              float *out, int64_t ldo, const uint8_t *prefetch) {
  using Block = typename std::conditional<kQ5, BlockQ5_K, BlockQ4_K>::type;
  using L = Lanes<MR, NR>;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  // Each lane's scale twice as int16 (s | s << 16), 8 dwords; and the mins as int16.
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
    alignas(32) int32_t scale[NR][8];  // sub-block scales as int16 pairs (s | s << 16)
    __m128i mins[NR];                  // the 8 mins, int16
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      x[j] = reinterpret_cast<const Block *>(w + j * ws) + b;
    }
#pragma GCC unroll 8
    for (int j = 0; j < NR; j += 2) {  // two rows' scales per unpack
      const __m256i sm = scales_mins_k4(x[j]->scales, x[j + 1 < NR ? j + 1 : j]->scales);
      for (int r = 0; r < 2 && j + r < NR; ++r) {
        const __m256i row = _mm256_permute4x64_epi64(sm, r ? 0xee : 0x44);  // in both lanes
        _mm256_store_si256(reinterpret_cast<__m256i *>(scale[j + r]),
                           _mm256_shuffle_epi8(row, dup_scales));
        mins[j + r] = _mm_shuffle_epi8(_mm256_castsi256_si128(row), widen_mins);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) y[i] = reinterpret_cast<const BlockQ8_K *>(a + i * as) + b;
    __m256i acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const __m256i bits = load256(x[j]->qs + 32 * p);
        __m256i lo = _mm256_and_si256(bits, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
        if (kQ5) {
          // Bit 2p of each qh byte is bit 4 of the low nibble's weight, bit 2p + 1 that of
          // the high nibble's.
          const __m256i qh = load256(reinterpret_cast<const BlockQ5_K *>(x[j])->qh);
          lo = _mm256_or_si256(lo, _mm256_and_si256(bit_to_4(qh, 2 * p), bit4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(bit_to_4(qh, 2 * p + 1), bit4));
        }
        const __m256i s_lo = broadcast32(&scale[j][2 * p]);
        const __m256i s_hi = broadcast32(&scale[j][2 * p + 1]);
        // maddubs adds pairs into int16 (at most 2 * 31 * 127: no saturation); madd scales.
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m256i dlo = _mm256_madd_epi16(
              _mm256_maddubs_epi16(lo, load256(y[i]->qs + 64 * p)), s_lo);
          const __m256i dhi = _mm256_madd_epi16(
              _mm256_maddubs_epi16(hi, load256(y[i]->qs + 64 * p + 32)), s_hi);
          acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_add_epi32(dlo, dhi));
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
      // d and dmin of each lane's weight row (the same for every group when NR divides 4).
      const __m256 dd = lane_half_pair<MR, NR>(xb, 4 % NR == 0 ? 0 : g);
      const __m128i dots = hsum4(acc[L::i(g, 0)][L::j(g, 0)], acc[L::i(g, 1)][L::j(g, 1)],
                                 acc[L::i(g, 2)][L::j(g, 2)], acc[L::i(g, 3)][L::j(g, 3)]);
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

// Half h of a Q6_K block as 4 ymm of codes 0..63, 32 weights each (weights 128h + 32q + l, l
// < 32, ggml's order): bits 2q, 2q + 1 of qh are bits 4, 5 of quarter q (16-bit shifts,
// masked).
inline void q6_quarters(const BlockQ6_K &x, int h, __m256i *out) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i top2 = _mm256_set1_epi8(0x30);
  const __m256i l0 = load256(x.ql + 64 * h), l1 = load256(x.ql + 64 * h + 32);
  const __m256i hb = load256(x.qh + 32 * h);
  out[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                           _mm256_and_si256(_mm256_slli_epi16(hb, 4), top2));
  out[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                           _mm256_and_si256(_mm256_slli_epi16(hb, 2), top2));
  out[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                           _mm256_and_si256(hb, top2));
  out[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), top2));
}

// One MR x NR tile of Q6_K weights times Q8_K activations (arguments as tile_k45).
template <int MR, int NR>
void tile_q6(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
             float *out, int64_t ldo, const uint8_t *prefetch) {
  using L = Lanes<MR, NR>;
  __m128 sum[L::G];
#pragma GCC unroll 8
  for (int g = 0; g < L::G; ++g) sum[g] = _mm_setzero_ps();
  const size_t slice = prefetch_slice(NR * (ws ? ws : nb * sizeof(BlockQ6_K)), nb);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_lines(prefetch + b * slice, slice);
    const BlockQ6_K *x[NR];
    const BlockQ8_K *y[MR];
    __m256i scales[NR];  // int16: lane 0 the even 16-weight groups' scales, lane 1 the odd
    __m256i acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) y[i] = reinterpret_cast<const BlockQ8_K *>(a + i * as) + b;
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      x[j] = reinterpret_cast<const BlockQ6_K *>(w + j * ws) + b;
      const __m128i raw = load128(x[j]->scales);
      scales[j] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
          raw, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
      // Weights are read unsigned (0..63): the -32 of each is -32 * scale * (sum of its 16
      // activations), which starts the sum (int32 arithmetic wraps, the total is exact).
      const __m256i s16 = _mm256_cvtepi8_epi16(raw);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        acc[i][j] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(
            _mm256_madd_epi16(s16, load256(y[i]->bsums)), 5));
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // 128 weights: four quarters of 32
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        __m256i wq[4];
        q6_quarters(*x[j], h, wq);
#pragma GCC unroll 8
        for (int q = 0; q < 4; ++q) {
          // Weights 0..15 of the quarter have scale 8h + 2q, weights 16..31 scale 8h + 2q + 1:
          // word 4h + q of each lane of scales[j].
          const int word = 4 * h + q;
          const __m256i scale = _mm256_shuffle_epi8(
              scales[j], _mm256_set1_epi16(static_cast<int16_t>((2 * word + 1) << 8 | 2 * word)));
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(
                wq[q], load256(y[i]->qs + 128 * h + 32 * q)), scale));
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
      const __m128i dots = hsum4(acc[L::i(g, 0)][L::j(g, 0)], acc[L::i(g, 1)][L::j(g, 1)],
                                 acc[L::i(g, 2)][L::j(g, 2)], acc[L::i(g, 3)][L::j(g, 3)]);
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

// Tile shapes: a GEMV row against 4 weight rows; batches in tiles of 4 activation rows x 2
// weight rows (their accumulators and operands fill the 16 ymm registers), the remaining rows
// in tiles of 2 x 4 and 1 x 4; narrower at the end of n. (Measured here: 1 x 8 and 4 x 3,
// 6 x 2, 3 x 4 tiles were no faster.)
using Shape = TileShape<4, 4, 2>;

template <template <int, int> class Tile>
void gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
          int64_t nb, float *out, int64_t ldo) {
  tiled_gemm<Tile, Shape>(w, ws, n, a, as, m, nb, out, ldo);
}

// ---- Q4_K / Q5_K batches through 8 weight rows interleaved on the fly ---------------------
// avx512.cpp's interleave at half the width: a ymm holds 4 consecutive codes of one sub-block
// from each of 8 rows against the 4 matching activations broadcast. A row's maddubs pair sums
// add in int16 over the sub-block's 8 steps (Q4_K: at most 8 * 2 * 15 * 128 = 30720) or 4
// steps (Q5_K: 4 * 2 * 31 * 128 = 31744) before one madd with the rows' scales, and each row's
// sum ends in one int32 lane: 9 (Q5_K 10) multiplies per 8 rows x 32 products where the
// row-major tiles take 16, and no reduction. Same integer sums, same float expression per
// block in block order: the reference's bits.
namespace interleaved {

constexpr int kRows = 8;  // weight rows a panel (4 activation rows a tile: run_panels)
// Fewer activation rows: the row-major tiles. Single-thread elk_gemm on Zen 4 pinned to this
// path (K 2048, N 4096): Q4_K 0.73x at 4 rows, 0.98x at 6, 1.09x at 8, 1.22x at 12, 1.27x at
// 64 (Q5_K 1.02x at 8, 1.51x at 64); Q6_K 0.85x at 12, 1.0x at 16.
constexpr int64_t kMinBatch = 8, kMinBatch6 = 16;

struct Panel {
  __m256i q[8][8];   // sub-block s, step t: dword r = row r's codes 4t .. 4t + 3 of s
  __m256i scale[8];  // sub-block s: int16 lanes 2r, 2r + 1 = row r's scale
  __m256i mins[4];   // k: int16 lanes 2r, 2r + 1 = row r's mins of sub-blocks 2k, 2k + 1
  __m256 d, dmin;
};

// An 8 x 8 dword transpose: out[t] dword r = r[r] dword t.
inline void transpose8(const __m256i *r, __m256i *out) {
  __m256i t[8], u[8];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);      // dwords 0 1 | 4 5
    t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);  // dwords 2 3 | 6 7
  }
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {  // rows 4k .. 4k + 3
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      u[4 * k + 2 * h] = _mm256_unpacklo_epi64(t[4 * k + h], t[4 * k + 2 + h]);
      u[4 * k + 2 * h + 1] = _mm256_unpackhi_epi64(t[4 * k + h], t[4 * k + 2 + h]);
    }
  }
  // u[j] (rows 0-3) and u[4 + j] (rows 4-7): dword j in lane 0, dword 4 + j in lane 1.
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    out[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// 32 bytes at p of each of 8 rows (stride ws) as 8 ymm: out[t] dword r = row r's dword t.
inline void transpose32(const uint8_t *p, size_t ws, __m256i *out) {
  __m256i r[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) r[k] = load256(p + k * ws);
  transpose8(r, out);
}

template <typename Block>
inline void repack(const uint8_t *w, size_t ws, int64_t b, Panel &p) {
  constexpr bool kQ5 = std::is_same<Block, BlockQ5_K>::value;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  const uint8_t *block = w + b * sizeof(Block);
  __m256i high[8];  // Q5_K: qh byte l's bit k is bit 4 of weight l of sub-block k
  if (kQ5) transpose32(block + offsetof(BlockQ5_K, qh), ws, high);
#pragma GCC unroll 1
  for (int pair = 0; pair < 4; ++pair) {  // sub-blocks 2 pair (low nibbles), 2 pair + 1 (high)
    __m256i codes[8];
    transpose32(block + offsetof(Block, qs) + 32 * pair, ws, codes);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      p.q[2 * pair][t] = _mm256_and_si256(codes[t], low4);
      p.q[2 * pair + 1][t] = _mm256_and_si256(_mm256_srli_epi16(codes[t], 4), low4);
      if (kQ5) {
        p.q[2 * pair][t] = _mm256_or_si256(
            p.q[2 * pair][t], _mm256_and_si256(bit_to_4(high[t], 2 * pair), bit4));
        p.q[2 * pair + 1][t] = _mm256_or_si256(
            p.q[2 * pair + 1][t], _mm256_and_si256(bit_to_4(high[t], 2 * pair + 1), bit4));
      }
    }
  }
  // Scales (bytes 0-7) and mins (8-15) of each row, then spread as the tiles read them.
  alignas(32) uint8_t sm[8][16];
  alignas(32) int16_t scale[8][16], mins[4][16];
  uint16_t d[8], dmin[8];
#pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) {
    const auto *a = reinterpret_cast<const Block *>(w + 2 * l * ws) + b;
    const auto *c = reinterpret_cast<const Block *>(w + (2 * l + 1) * ws) + b;
    _mm256_store_si256(reinterpret_cast<__m256i *>(sm[2 * l]),
                       scales_mins_k4(a->scales, c->scales));
    d[2 * l] = a->d, d[2 * l + 1] = c->d;
    dmin[2 * l] = a->dmin, dmin[2 * l + 1] = c->dmin;
  }
  for (int r = 0; r < 8; ++r) {
    for (int k = 0; k < 8; ++k) scale[k][2 * r] = scale[k][2 * r + 1] = sm[r][k];
    for (int k = 0; k < 4; ++k) {
      mins[k][2 * r] = sm[r][8 + 2 * k];
      mins[k][2 * r + 1] = sm[r][9 + 2 * k];
    }
  }
  for (int k = 0; k < 8; ++k) p.scale[k] = load256(scale[k]);
  for (int k = 0; k < 4; ++k) p.mins[k] = load256(mins[k]);
  p.d = _mm256_cvtph_ps(load128(d));
  p.dmin = _mm256_cvtph_ps(load128(dmin));
}

template <bool kQ5, int MR>
inline void panel_rows(const Panel &p, const BlockQ8_K *const *y, __m256 *sum) {
  constexpr int kSteps = kQ5 ? 4 : 8;  // steps whose pair sums add in int16
  __m256i acc[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 2
    for (int h = 0; h < 8 / kSteps; ++h) {
      __m256i part[MR];
#pragma GCC unroll 8
      for (int t = 0; t < kSteps; ++t) {
        const __m256i q = p.q[s][h * kSteps + t];
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          const __m256i prod = _mm256_maddubs_epi16(
              q, broadcast32(reinterpret_cast<const int32_t *>(
                     y[i]->qs + 32 * s + 4 * (h * kSteps + t))));
          part[i] = t == 0 ? prod : _mm256_add_epi16(part[i], prod);
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(part[i], p.scale[s]));
        keep_in_register(acc[i]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    // Sub-block sums of the activations (int16), pairs k as dwords: one madd per pair.
    const __m128i sub = _mm_hadd_epi16(load128(y[i]->bsums), load128(y[i]->bsums + 8));
    __m256i mins = _mm256_madd_epi16(p.mins[0], _mm256_set1_epi32(_mm_extract_epi32(sub, 0)));
    mins = _mm256_add_epi32(mins, _mm256_madd_epi16(p.mins[1], _mm256_set1_epi32(
                                                        _mm_extract_epi32(sub, 1))));
    mins = _mm256_add_epi32(mins, _mm256_madd_epi16(p.mins[2], _mm256_set1_epi32(
                                                        _mm_extract_epi32(sub, 2))));
    mins = _mm256_add_epi32(mins, _mm256_madd_epi16(p.mins[3], _mm256_set1_epi32(
                                                        _mm_extract_epi32(sub, 3))));
    const __m256 dy = _mm256_set1_ps(y[i]->d);
    sum[i] += k_block_lanes(p.d, p.dmin, dy, _mm256_cvtepi32_ps(acc[i]),
                            _mm256_cvtepi32_ps(mins));
  }
}

template <bool kQ5, int MR>
void rows_of_panel(const Panel &p, const uint8_t *a, size_t as, int64_t b, __m256 *sum) {
  const BlockQ8_K *y[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) y[i] = reinterpret_cast<const BlockQ8_K *>(a + i * as) + b;
  panel_rows<kQ5, MR>(p, y, sum);
}

template <typename Block, template <int, int> class Tile>
void gemm_k45(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
              int64_t nb, float *out, int64_t ldo) {
  constexpr bool kQ5 = std::is_same<Block, BlockQ5_K>::value;
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
        rows_of_panel<kQ5, decltype(mr)::value>(p, ab + i * as, as, b, sum);
      },
      [&](int64_t first) {
        gemm<Tile>(wb + first * ws, ws, n - first, a, as, m, nb, out + first, ldo);
      });
}


// ---- Q6_K: avx512.cpp's scheme (codes - 32 against activations + 128, the panel's correction
// once a block) at half width. A step's pair sums are at most 2 * 255 * 32 = 16320, so two
// steps add in int16 (32640) before each madd: 4 multiplies per 8 rows x 16 products.
struct Panel6 {
  __m256i q[64];     // step t (weights 4t .. 4t + 3): dword r = row r's codes - 32, int8
  __m256i scale[16];  // sub-block s: int16 lanes 2r, 2r + 1 = row r's scale
  __m256i corr;      // per row: 128 * sum over sub-blocks of scale * sum(c - 32)
  __m256 d;
};

inline void repack6(const uint8_t *w, size_t ws, int64_t b, Panel6 &p) {
  const __m256i bias = _mm256_set1_epi8(32);
  __m256i chunk[8][8];  // chunk c (weights 32c ..) of row r
  alignas(32) int16_t scale[16][16];
  uint16_t d[8];
#pragma GCC unroll 1
  for (int r = 0; r < 8; ++r) {
    const auto *x = reinterpret_cast<const BlockQ6_K *>(w + r * ws) + b;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // ggml's order: weights 128h + 32q + l, q = 0..3
      __m256i codes[4];
      q6_quarters(*x, h, codes);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) chunk[4 * h + q][r] = _mm256_sub_epi8(codes[q], bias);
    }
    for (int k = 0; k < 16; ++k) scale[k][2 * r] = scale[k][2 * r + 1] = x->scales[k];
    d[r] = x->d;
  }
#pragma GCC unroll 1
  for (int c = 0; c < 8; ++c) transpose8(chunk[c], p.q + 8 * c);
  __m256i corr = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi8(1);
#pragma GCC unroll 1
  for (int k = 0; k < 16; ++k) {
    p.scale[k] = load256(scale[k]);
    __m256i sums = _mm256_maddubs_epi16(ones, p.q[4 * k]);
#pragma GCC unroll 3
    for (int t = 1; t < 4; ++t) {
      sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(ones, p.q[4 * k + t]));
    }
    corr = _mm256_add_epi32(corr, _mm256_madd_epi16(sums, p.scale[k]));
  }
  p.corr = _mm256_slli_epi32(corr, 7);
  p.d = _mm256_cvtph_ps(load128(d));
}

// MR activation rows (y[i]: their block b; u[i]: its 256 codes + 128) times the panel's block.
template <int MR>
inline void panel6_rows(const Panel6 &p, const BlockQ8_K *const *y, const uint8_t *const *u,
                        __m256 *sum) {
  __m256i acc[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (int k = 0; k < 16; ++k) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int t = 4 * k + 2 * h;
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const __m256i part = _mm256_add_epi16(
            _mm256_maddubs_epi16(broadcast32(reinterpret_cast<const int32_t *>(u[i] + 4 * t)),
                                 p.q[t]),
            _mm256_maddubs_epi16(
                broadcast32(reinterpret_cast<const int32_t *>(u[i] + 4 * t + 4)), p.q[t + 1]));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(part, p.scale[k]));
        keep_in_register(acc[i]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    const __m256 zero = _mm256_setzero_ps();
    // k_block(d, 0, dy, dots, 0), as the reference writes it.
    sum[i] += k_block_lanes(p.d, zero, _mm256_set1_ps(y[i]->d),
                            _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i], p.corr)), zero);
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

template <template <int, int> class Tile, typename Block>
float dot(const void *vx, const BlockQ8_K *y, int64_t nb) {
  return tiled_dot<Tile, Block>(vx, y, nb);
}

float dot_q4_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  return dot<Q4Tile, BlockQ4_K>(vx, y, nb);
}
float dot_q5_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  return dot<Q5Tile, BlockQ5_K>(vx, y, nb);
}
float dot_q6_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  return dot<Q6Tile, BlockQ6_K>(vx, y, nb);
}

// elk_quantize_row_q8_K_ref, 8 floats a step and byte for byte: the same largest magnitude
// (NaN never wins, the first of equal ones does), the same IEEE division and product, the
// same rounding (nearbyint: the current mode), truncating to int8 as the casts do.
void quantize_q8_K(const float *x, void *out, int64_t k) {
  auto *y = static_cast<BlockQ8_K *>(out);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < k / QK_K; ++i, x += QK_K) {
    __m256 m = _mm256_setzero_ps();
    // max(|x|, m) keeps m where |x| is NaN, as `ax > amax` does.
    for (int j = 0; j < QK_K; j += 8) {
      m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), m);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    std::memset(&y[i], 0, sizeof(y[i]));
    if (amax == 0.0f) continue;
    float max = 0.0f;  // the first element of that magnitude, with its sign
    for (int j = 0; j < QK_K; j += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(
          _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
      if (hit != 0) { max = x[j + __builtin_ctz(hit)]; break; }
    }
    const float iscale = -127.0f / max;
    const __m256 vs = _mm256_set1_ps(iscale);
    const __m256i cap = _mm256_set1_epi32(127), byte = _mm256_set1_epi32(0xff);
    __m256i sums[8];
    for (int j = 0; j < QK_K; j += 32) {
      __m256i v[4];
      for (int u = 0; u < 4; ++u) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(x + j + 8 * u)),
                                         _MM_FROUND_CUR_DIRECTION);
        // (int8_t)min(int(r), 127): the low byte, as the cast keeps it.
        v[u] = _mm256_and_si256(_mm256_min_epi32(_mm256_cvttps_epi32(r), cap), byte);
      }
      // Unsigned packs of values 0..255 saturate nothing; then undo their lane interleave.
      const __m256i q = _mm256_permutevar8x32_epi32(
          _mm256_packus_epi16(_mm256_packus_epi32(v[0], v[1]), _mm256_packus_epi32(v[2], v[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(y[i].qs + j), q);
      // Sums of 4 as int32: lanes 0-3 the first 16 weights, 4-7 the next 16.
      sums[j / 32] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
                                       _mm256_set1_epi16(1));
    }
    // Groups of 16: [g0 g2 g4 g6 | g1 g3 g5 g7] and [g8 .. g14 | g9 .. g15], as int32.
    const __m256i lo = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]),
                                         _mm256_hadd_epi32(sums[2], sums[3]));
    const __m256i hi = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[4], sums[5]),
                                         _mm256_hadd_epi32(sums[6], sums[7]));
    const __m256i packed = _mm256_packs_epi32(lo, hi);  // |sum| <= 16 * 127: exact
    const __m128i even = _mm256_castsi256_si128(packed), odd = _mm256_extracti128_si256(packed, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(y[i].bsums), _mm_unpacklo_epi16(even, odd));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(y[i].bsums + 8), _mm_unpackhi_epi16(even, odd));
    y[i].d = 1.0f / iscale;
  }
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

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
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

// ---------------------------------------------------------------------------------------------
// Tiled legacy kernels: MR activation rows x NR weight rows a pass (1 x 8 for a GEMV row, 8 x 2
// for batches, remainders 2 x 4 and 1 x 8, any narrower NR at the right edge). Per block, each
// weight row is unpacked once for the MR rows and each activation block loaded once for the NR
// rows. Element e = i * NR + j of the tile owns lane e % 8 of float sum[e / 8]: its block's
// exact integer sum (8 int32 partials reduced by totals), then legacy_block(_min) on __m256
// lane by lane and one add per block, in block order: the scalar expression and order, so the
// reference's bits whatever the tile.
// ---------------------------------------------------------------------------------------------

template <typename W, int MR, int NR>
void tile(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb, float *out,
          int64_t ldo, const uint8_t *prefetch) {
  using Tr = Codes<W>;
  using A = typename Tr::A;
  using L = Tile8<MR, NR>;
  const W *x[NR];
  const A *y[MR];
  for (int j = 0; j < NR; ++j) x[j] = reinterpret_cast<const W *>(w + j * ws);
  for (int i = 0; i < MR; ++i) y[i] = reinterpret_cast<const A *>(a + i * as);
  __m256 sum[L::G];
  for (int g = 0; g < L::G; ++g) sum[g] = _mm256_setzero_ps();
  const size_t slice = prefetch_slice(NR * ws, nb);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_lines(prefetch + b * slice, slice);
    __m256i code[NR], magnitude[NR], act[MR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      code[j] = Tr::codes(x[j][b]);
      magnitude[j] = Tr::kSigned ? _mm256_sign_epi8(code[j], code[j]) : code[j];
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) act[i] = load256(y[i][b].qs);
    const BlockScales<Tr::kMin, MR, NR> scales(x, y, b);
#pragma GCC unroll 2
    for (int g = 0; g < L::G; ++g) {
      __m256i p[8];
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        if (8 * g + l >= L::T) {
          p[l] = _mm256_setzero_si256();
          continue;
        }
        const int i = L::i(g, l), j = L::j(g, l);
        const __m256i pairs = Tr::kSigned
            ? _mm256_maddubs_epi16(magnitude[j], _mm256_sign_epi8(act[i], code[j]))
            : _mm256_maddubs_epi16(code[j], act[i]);
        p[l] = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
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

// ---- Batches through 8 weight rows interleaved on the fly, one block at a time --------------
// A ymm holds 4 consecutive codes of a block from each of 8 rows and meets the 4 matching
// activations broadcast, so a row's block sum ends in one int32 lane: the float expression per
// block runs 8 rows at a time, where the row-major tiles reduce 8 lanes per element and block.
// The codes (at most 31) are read unsigned: maddubs pairs are at most 2 * 31 * 128, four steps
// add in int16 before one madd, and the offset term (-offset * sum of the activations) starts
// the sum. Same exact integer sums, then legacy_block(_min) lane by lane and block by block in
// order: the reference's bits. Not Q8_0: its signed codes need |w| against the activations
// with w's signs and a madd every step, which ran 0.85-1.04x the row-major tiles (Zen 4).

constexpr int kPanel = 8;        // weight rows a panel
// Fewer activation rows: the row-major tiles. Single-thread elk_gemm pinned to avx2 on Zen 4
// (K 2048, N 4096), 2 / 3 / 4 / 64 rows: Q4_0 1.18x / 1.19-1.26x / 1.68x / 1.38x, Q5_0 1.28x /
// 1.87x / 1.61x / 1.43x, Q5_1 1.18x / 1.64x / 1.17x, Q4_1 0.79x / 1.13x / 1.45x / 1.34x (its
// two-row tiles stay).
template <typename W>
constexpr int64_t kMinRows = std::is_same<W, BlockQ4_1>::value ? 3 : 2;

struct Panel8 {
  __m256i q[8];  // step t: dword r = row r's codes 4t .. 4t + 3 (unsigned)
  __m256 dx, m;  // the rows' scales and (Q4_1/Q5_1) mins
};

template <typename W>
inline void repack8(const uint8_t *w, size_t ws, int64_t b, Panel8 &p) {
  using U = Unsigned<W>;
  __m256i rows[8];
  uint16_t d[8], m[8];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    const W &x = reinterpret_cast<const W *>(w + r * ws)[b];
    rows[r] = U::codes(x);
    d[r] = x.d;
    if (U::kMin) std::memcpy(&m[r], reinterpret_cast<const uint8_t *>(&x) + 2, sizeof(m[r]));
  }
  interleaved::transpose8(rows, p.q);
  p.dx = _mm256_cvtph_ps(load128(d));
  if (U::kMin) p.m = _mm256_cvtph_ps(load128(m));
}

template <typename W, int MR>
inline void panel8_rows(const Panel8 &p, const uint8_t *a, size_t as,
                        const ActivationTerms *terms, int64_t nb, int64_t b, __m256 *sum) {
  using U = Unsigned<W>;
  using A = typename U::A;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_set1_epi32(terms[i * nb + b].start);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256i part[MR];
#pragma GCC unroll 4
    for (int t = 4 * h; t < 4 * h + 4; ++t) {
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const A &y = reinterpret_cast<const A *>(a + i * as)[b];
        int32_t codes;
        std::memcpy(&codes, y.qs + 4 * t, sizeof(codes));
        const __m256i prod = _mm256_maddubs_epi16(p.q[t], _mm256_set1_epi32(codes));
        part[i] = t == 4 * h ? prod : _mm256_add_epi16(part[i], prod);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(part[i], ones));
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    const ActivationTerms &at = terms[i * nb + b];
    const __m256 dots = _mm256_cvtepi32_ps(acc[i]), dy = _mm256_set1_ps(at.dy);
    // legacy_block(_min) lane by lane (the file is built with -ffp-contract=off).
    sum[i] += U::kMin ? legacy_block_min(p.dx, dy, dots, p.m, _mm256_set1_ps(at.s))
                      : legacy_block(p.dx, dy, dots);
  }
}

template <typename W>
void gemm8(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
           int64_t nb, float *out, int64_t ldo) {
  using U = Unsigned<W>;
  static_assert(!std::is_same<W, BlockQ8_0>::value, "Q8_0 stays on the row-major tiles");
  if (m < kMinRows<W> || n < kPanel) {
    gemm<W>(w, ws, n, a, as, m, nb, out, ldo);
    return;
  }
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  const ActivationTerms *terms = activation_terms<typename U::A>(ab, as, m, nb, U::kOffset);
  run_panels<kPanel, Panel8, __m256>(
      wb, ws, n, m, nb, out, ldo,
      [&](const uint8_t *rows, int64_t b, Panel8 &p) { repack8<W>(rows, ws, b, p); },
      [&](auto mr, const Panel8 &p, int64_t i, int64_t b, __m256 *sum) {
        panel8_rows<W, decltype(mr)::value>(p, ab + i * as, as, terms + i * nb, nb, b, sum);
      },
      [&](int64_t first) {
        gemm<W>(wb + first * ws, ws, n - first, a, as, m, nb, out + first, ldo);
      });
}

}  // namespace legacy
}  // namespace

namespace {
// ref.cpp's quantize_q8_32, 8 floats a step and byte for byte: the same largest magnitude
// (max(|x|, m) keeps m where |x| is NaN, as std::fmax(amax, |x|) does), the same scale and
// product, std::round's half away from zero (trunc, then +-1 where the exact remainder is at
// least a half), and the cast's truncation to int8 (a NaN's 0x80000000 is 0 in its low
// byte; every other value is within int8, so the saturating packs keep it).
template <bool kSum>
void quantize_q8_32(const float *x, void *out, int64_t k) {
  const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256i nan_code = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u));
  auto *bytes = static_cast<uint8_t *>(out);
  const size_t block = kSum ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0);
  for (int64_t i = 0; i < k / QK; ++i, x += QK, bytes += block) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 8 * j);
      m = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), m);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 p = _mm256_mul_ps(v[j], vid);
      const __m256 t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 rest = _mm256_andnot_ps(sign, _mm256_sub_ps(p, t));
      const __m256 step = _mm256_or_ps(_mm256_and_ps(sign, p), one);   // +-1, p's sign
      const __m256 r = _mm256_add_ps(
          t, _mm256_and_ps(_mm256_cmp_ps(rest, half, _CMP_GE_OQ), step));
      const __m256i c = _mm256_cvttps_epi32(r);
      q[j] = _mm256_andnot_si256(_mm256_cmpeq_epi32(c, nan_code), c);
    }
    // packs interleave 128-bit lanes: dwords 0-3 of q0, q1, then 4-7 ...; the permute
    // puts the 32 bytes back in order.
    const __m256i w16a = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i w8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const uint16_t dh = fp32_to_fp16(d);
    std::memcpy(bytes, &dh, sizeof(dh));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(bytes + block - QK), w8);
    if (kSum) {
      __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      const uint16_t sh = fp32_to_fp16(static_cast<float>(_mm_cvtsi128_si32(s4)) * d);
      std::memcpy(bytes + sizeof(uint16_t), &sh, sizeof(sh));
    }
  }
}
}  // namespace

const GemmKernels *avx2_gemm_kernels() {
  static const GemmKernels kernels{"avx2", interleaved::gemm_k45<BlockQ4_K, Q4Tile>,
                                   interleaved::gemm_k45<BlockQ5_K, Q5Tile>,
                                   interleaved::gemm_q6_K,
                                   quantize_q8_K,
                                   legacy::gemm8<BlockQ4_0>, legacy::gemm8<BlockQ4_1>,
                                   legacy::gemm8<BlockQ5_0>, legacy::gemm8<BlockQ5_1>,
                                   legacy::gemm<BlockQ8_0>,
                                   quantize_q8_32<false>, quantize_q8_32<true>};
  return &kernels;
}

const DotKernels *avx2_kernels() {
  static const DotKernels kernels{
      "avx2", dot_q4_K, dot_q5_K, dot_q6_K,
      legacy::dot<BlockQ4_0, BlockQ8_0>, legacy::dot<BlockQ4_1, BlockQ8_1>,
      legacy::dot<BlockQ5_0, BlockQ8_0>, legacy::dot<BlockQ5_1, BlockQ8_1>,
      legacy::dot<BlockQ8_0, BlockQ8_0>};
  return &kernels;
}

// ---- LoRA (lora.cpp): the reference's sums, 8 lanes across q (shrink) or j (expand) ------
// At / Bt widen as they load (F16C, a 16-bit shift: exact). Several vectors of lanes a pass
// (one read of At, and independent sums in flight); each lane's sum is the reference's.
namespace {

template <int T>
void lora_shrink_avx2_t(const float *x, const void *a_t, int64_t k, int64_t r, float *u) {
  int64_t q = 0;
  for (; q + 16 <= r; q += 16) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
      const __m256 xi = _mm256_set1_ps(x[i]);
      acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(xi, lora_load8<T>(a_t, i * r + q)));
      acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(xi, lora_load8<T>(a_t, i * r + q + 8)));
    }
    _mm256_storeu_ps(u + q, acc0);
    _mm256_storeu_ps(u + q + 8, acc1);
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
void lora_expand_avx2_t(const float *u, const void *b_t, int64_t r, int64_t n, int64_t ldb,
                        float *t) {
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    for (int64_t q = 0; q < r; ++q) {
      const __m256 uq = _mm256_set1_ps(u[q]);
      const int64_t at = q * ldb + j;
      acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(uq, lora_load8<T>(b_t, at)));
      acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(uq, lora_load8<T>(b_t, at + 8)));
      acc2 = _mm256_add_ps(acc2, _mm256_mul_ps(uq, lora_load8<T>(b_t, at + 16)));
      acc3 = _mm256_add_ps(acc3, _mm256_mul_ps(uq, lora_load8<T>(b_t, at + 24)));
    }
    _mm256_storeu_ps(t + j, acc0);
    _mm256_storeu_ps(t + j + 8, acc1);
    _mm256_storeu_ps(t + j + 16, acc2);
    _mm256_storeu_ps(t + j + 24, acc3);
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

void lora_shrink_avx2(const float *x, const void *a_t, int type, int64_t k, int64_t r,
                      float *u) {
  if (type == ELK_LORA_F16) return lora_shrink_avx2_t<ELK_LORA_F16>(x, a_t, k, r, u);
  if (type == ELK_LORA_BF16) return lora_shrink_avx2_t<ELK_LORA_BF16>(x, a_t, k, r, u);
  lora_shrink_avx2_t<ELK_LORA_F32>(x, a_t, k, r, u);
}

void lora_expand_avx2(const float *u, const void *b_t, int type, int64_t r, int64_t n,
                      int64_t ldb, float *t) {
  if (type == ELK_LORA_F16) return lora_expand_avx2_t<ELK_LORA_F16>(u, b_t, r, n, ldb, t);
  if (type == ELK_LORA_BF16) return lora_expand_avx2_t<ELK_LORA_BF16>(u, b_t, r, n, ldb, t);
  lora_expand_avx2_t<ELK_LORA_F32>(u, b_t, r, n, ldb, t);
}
}  // namespace

const LoraKernels *avx2_lora_kernels() {
  static const LoraKernels kernels{"avx2", lora_shrink_avx2, lora_expand_avx2};
  return &kernels;
}

// ---- int8 dots (attention_i8): maddubs + madd ---------------------------------------------
namespace {
void i8_dots_avx2(const int8_t *a, const int8_t *b, int64_t n, int64_t count, int32_t *out) {
  i8_dots_x86([](__m256i acc, __m256i ax, __m256i x, __m256i k) {
    const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(k, x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }, a, b, n, count, out);
}
}  // namespace

elk_i8_dots_fn avx2_i8_dots() { return i8_dots_avx2; }

}  // namespace elk
