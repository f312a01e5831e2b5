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

namespace elk {
namespace {

template <typename T>
inline __m256i load256(const T *p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
}
template <typename T>
inline __m128i load128(const T *p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
}

// An empty asm the value passes through: the compiler keeps it in a register and adds each
// product into it as it comes (else GCC collects all the tile's products before adding,
// which spills them to the stack).
inline void keep_in_register(__m256i &v) { asm("" : "+x"(v)); }

// A 32-bit broadcast from memory: one load, no shuffle (GCC otherwise forwards the scale
// from the register it was stored from, extracting it with shuffles).
inline __m256i broadcast32(const int32_t *p) {
  __m256i v;
  asm("vpbroadcastd %1, %0" : "=x"(v) : "m"(*p));
  return v;
}

// The lane sums of four vectors, exactly (integer adds): {sum a, sum b, sum c, sum d}.
inline __m128i hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}
inline __m128i hsum4(__m128i a, __m128i b, __m128i c, __m128i d) {
  return _mm_hadd_epi32(_mm_hadd_epi32(a, b), _mm_hadd_epi32(c, d));
}

// k_block lane by lane: d * dy * float(dots) - dmin * dy * float(mins), the same IEEE
// operations in the same order (the file is built with -ffp-contract=off: no FMA).
inline __m128 k_block4(__m128 d, __m128 dmin, __m128 dy, __m128i dots, __m128i mins) {
  return _mm_sub_ps(_mm_mul_ps(_mm_mul_ps(d, dy), _mm_cvtepi32_ps(dots)),
                    _mm_mul_ps(_mm_mul_ps(dmin, dy), _mm_cvtepi32_ps(mins)));
}

// The 8 scales (bytes 0..7) and 8 mins (bytes 8..15) of a Q4_K/Q5_K super-block, 6 bits each:
// scale_min_k4 for every sub-block at once, for two blocks (lane 0: packed0, lane 1: packed1).
// Reads 16 bytes each: the 12 packed ones and 4 of the block's next field, which no lane keeps.
inline __m256i scales_mins_k4(const uint8_t *packed0, const uint8_t *packed1) {
  const __m256i q = _mm256_loadu2_m128i(reinterpret_cast<const __m128i *>(packed1),
                                        reinterpret_cast<const __m128i *>(packed0));
  // Lanes 0-3: q[0..3] (scales 0-3); 4-7: q[8..11] (their low nibbles are scales 4-7);
  // 8-11: q[4..7] (mins 0-3); 12-15: q[8..11] (their high nibbles are mins 4-7).
  const __m256i a = _mm256_shuffle_epi8(q, _mm256_broadcastsi128_si256(_mm_setr_epi8(
      0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11)));
  // The top two bits of scales 4-7 are those of q[0..3], of mins 4-7 those of q[4..7].
  const __m256i b = _mm256_shuffle_epi8(q, _mm256_broadcastsi128_si256(_mm_setr_epi8(
      0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7)));
  const __m256i low = _mm256_and_si256(a, _mm256_broadcastsi128_si256(_mm_setr_epi8(
      63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)));
  // 16-bit shifts: the masks keep only bits that came from the lane's own byte.
  const __m256i nibble = _mm256_and_si256(_mm256_srli_epi16(a, 4), _mm256_broadcastsi128_si256(
      _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
  const __m256i top = _mm256_and_si256(_mm256_srli_epi16(b, 2), _mm256_broadcastsi128_si256(
      _mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48)));
  return _mm256_or_si256(_mm256_or_si256(low, nibble), top);
}

// Bit `bit` (0..7) of each byte moved to bit 4, by a 16-bit shift (other bits move too: mask
// with 0x10; bit 4 of each byte then comes from its own byte, as the shift is at most 4).
inline __m256i bit_to_4(__m256i v, int bit) {
  return bit <= 4 ? _mm256_slli_epi16(v, 4 - bit) : _mm256_srli_epi16(v, bit - 4);
}

// The lanes of a tile: element e = 4g + l (lane l of group g) is activation row e / NR times
// weight row e % NR. Lanes past the tile repeat its last element and are never stored.
template <int MR, int NR>
struct Lanes {
  static constexpr int T = MR * NR, G = (T + 3) / 4;
  static constexpr int e(int g, int l) { return 4 * g + l < T ? 4 * g + l : T - 1; }
  static constexpr int i(int g, int l) { return e(g, l) / NR; }
  static constexpr int j(int g, int l) { return e(g, l) % NR; }
};

// Lane by lane: the activation scales of group g (dy of row i(g, l)).
template <int MR, int NR>
inline __m128 lane_dy(const BlockQ8_K *const *y, int g) {
  using L = Lanes<MR, NR>;
  if (NR == 4) return _mm_set1_ps(y[L::i(g, 0)]->d);
  if (NR == 2) {
    return _mm_shuffle_ps(_mm_set1_ps(y[L::i(g, 0)]->d), _mm_set1_ps(y[L::i(g, 2)]->d), 0);
  }
  return _mm_setr_ps(y[L::i(g, 0)]->d, y[L::i(g, 1)]->d, y[L::i(g, 2)]->d, y[L::i(g, 3)]->d);
}

// Lane by lane: the fp16 value at `offset` of each lane's weight block, as floats (F16C:
// exact, like fp16_to_fp32).
template <int MR, int NR>
inline __m128 lane_half(const uint8_t *const *x, int g, size_t offset) {
  using L = Lanes<MR, NR>;
  uint16_t h[4];
  for (int l = 0; l < 4; ++l) std::memcpy(&h[l], x[L::j(g, l)] + offset, sizeof(h[l]));
  return _mm_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], 0, 0, 0, 0));
}

// The same for the two fp16 values at offsets 0 and 2 (d and dmin): in one conversion.
template <int MR, int NR>
inline __m256 lane_half_pair(const uint8_t *const *x, int g) {
  using L = Lanes<MR, NR>;
  uint16_t h[8];
  for (int l = 0; l < 4; ++l) {
    std::memcpy(&h[l], x[L::j(g, l)], sizeof(h[l]));
    std::memcpy(&h[l + 4], x[L::j(g, l)] + 2, sizeof(h[l]));
  }
  return _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
}

// Software prefetch of the weight stream. A tile reads its NR rows side by side, NR streams a
// row apart, which the hardware prefetchers follow poorly; so while it reads block b of its
// rows, it prefetches the b-th of nb equal slices of the next tile's rows (contiguous in
// memory: the same weight bytes, a tile further on), one sequential stream a tile ahead.
inline void prefetch_lines(const uint8_t *p, size_t bytes) {
  for (size_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char *>(p) + line, _MM_HINT_T0);
  }
}

// Bytes of the next tile's rows to prefetch per super-block: all of them over nb blocks
// (whole lines: a line a slice ends inside is the next slice's first).
inline size_t prefetch_slice(size_t tile_bytes, int64_t nb) {
  const size_t blocks = static_cast<size_t>(nb > 0 ? nb : 1);
  return ((tile_bytes + blocks - 1) / blocks + 63) / 64 * 64;
}

// Element e of an MR x NR tile (activation row e / NR times weight row e % NR) has its float
// sum in lane e % 4 of sum[e / 4]; the lanes past the tile (see Lanes) are not stored.
template <int MR, int NR>
inline void store_tile(const __m128 *sum, float *out, int64_t ldo) {
  alignas(16) float lanes[(MR * NR + 3) / 4 * 4];
  for (int g = 0; g < (MR * NR + 3) / 4; ++g) _mm_store_ps(lanes + 4 * g, sum[g]);
  for (int e = 0; e < MR * NR; ++e) out[(e / NR) * ldo + e % NR] = lanes[e];
}

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

// One MR x NR tile of Q6_K weights times Q8_K activations (arguments as tile_k45).
template <int MR, int NR>
void tile_q6(const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
             float *out, int64_t ldo, const uint8_t *prefetch) {
  using L = Lanes<MR, NR>;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i top2 = _mm256_set1_epi8(0x30);
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
        const __m256i l0 = load256(x[j]->ql + 64 * h), l1 = load256(x[j]->ql + 64 * h + 32);
        const __m256i hb = load256(x[j]->qh + 32 * h);
        // Bits 2q, 2q + 1 of qh are bits 4, 5 of quarter q's weights (16-bit shifts, masked).
        const __m256i wq[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, low4),
                            _mm256_and_si256(_mm256_slli_epi16(hb, 4), top2)),
            _mm256_or_si256(_mm256_and_si256(l1, low4),
                            _mm256_and_si256(_mm256_slli_epi16(hb, 2), top2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                            _mm256_and_si256(hb, top2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), top2)),
        };
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

// Tile shapes: a GEMV row against kGemvRows weight rows; batches in tiles of kBatchRows
// activation rows x kBatchCols weight rows (their accumulators and operands fill the 16 ymm
// registers), the remaining rows in tiles of 2 x 4 and 1 x kGemvRows; narrower at the end of
// n. (Measured here: 1 x 8 and 4 x 3, 6 x 2, 3 x 4 tiles were no faster.)
constexpr int kGemvRows = 4;
constexpr int kBatchRows = 4, kBatchCols = 2;

template <int MR>
constexpr int tile_cols() {
  return MR == 1 ? kGemvRows : MR == 2 ? 4 : kBatchCols;
}

// An MR x nr tile, nr <= tile_cols<MR>() <= 4.
template <template <int, int> class Tile, int MR>
void run_tile(int nr, const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
              float *out, int64_t ldo, const uint8_t *prefetch) {
  constexpr int C = tile_cols<MR>();
  static_assert(C >= 1 && C <= 4, "tiles of 1..4 weight rows");
  switch (nr) {
    case 1: Tile<MR, 1>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 2: Tile<MR, (C < 2 ? C : 2)>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 3: Tile<MR, (C < 3 ? C : 3)>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    default: Tile<MR, C>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
  }
}

// Every activation row of a tile against every weight row, tile by tile: the tiles only
// share loads, never a float operation.
template <template <int, int> class Tile, int MR>
void tile_rows(const uint8_t *wb, size_t ws, int64_t n, const uint8_t *a, size_t as,
               int64_t nb, float *out, int64_t ldo) {
  constexpr int C = tile_cols<MR>();
  for (int64_t j = 0; j < n;) {
    const int nr = n - j < C ? static_cast<int>(n - j) : C;
    // The next tile's rows follow these (past n: the next call's, likely; a prefetch never
    // faults).
    run_tile<Tile, MR>(nr, wb + j * ws, ws, a, as, nb, out + j, ldo, wb + (j + nr) * ws);
    j += nr;
  }
}

template <template <int, int> class Tile>
void gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
          int64_t nb, float *out, int64_t ldo) {
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  int64_t i = 0;
  for (; i + kBatchRows <= m; i += kBatchRows) {
    tile_rows<Tile, kBatchRows>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
  }
  // 3 rows in one pass (a speculative verify of 2 drafts), not 2 + 1.
  if (m - i == 3) {
    tile_rows<Tile, 3>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
    i += 3;
  }
  for (; i + 2 <= m; i += 2) {
    tile_rows<Tile, 2>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
  }
  if (i < m) tile_rows<Tile, 1>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
}

// The single-row dots are the 1 x 1 tiles: one code path for every shape. They prefetch the
// row after theirs, the next one a caller looping over rows reads.
template <template <int, int> class Tile, typename Block>
float dot(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *w = static_cast<const uint8_t *>(vx);
  float out;
  Tile<1, 1>::run(w, 0, reinterpret_cast<const uint8_t *>(y), 0, nb, &out, 1,
                  w + nb * sizeof(Block));
  return out;
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

// ---------------------------------------------------------------------------------------------
// Tiled legacy kernels: MR activation rows x NR weight rows a pass (1 x 8 for a GEMV row, 8 x 2
// for batches, remainders 2 x 4 and 1 x 8, any narrower NR at the right edge). Per block, each
// weight row is unpacked once for the MR rows and each activation block loaded once for the NR
// rows. Element e = i * NR + j of the tile owns lane e % 8 of float sum[e / 8]: its block's
// exact integer sum (8 int32 partials reduced by totals), then legacy_block(_min) on __m256
// lane by lane and one add per block, in block order: the scalar expression and order, so the
// reference's bits whatever the tile.
// ---------------------------------------------------------------------------------------------

// Per weight type: its activation blocks, whether its codes are signed (|w| x a sign w) or
// unsigned (w x a), whether it has a min, and its 32 codes as bytes.
template <typename W>
struct Traits;
template <>
struct Traits<BlockQ4_0> {
  using A = BlockQ8_0;
  static constexpr bool kSigned = true, kMin = false;
  static __m256i codes(const BlockQ4_0 &x) {
    return _mm256_sub_epi8(nibbles(x.qs), _mm256_set1_epi8(8));
  }
};
template <>
struct Traits<BlockQ4_1> {
  using A = BlockQ8_1;
  static constexpr bool kSigned = false, kMin = true;
  static __m256i codes(const BlockQ4_1 &x) { return nibbles(x.qs); }
};
template <>
struct Traits<BlockQ5_0> {
  using A = BlockQ8_0;
  static constexpr bool kSigned = true, kMin = false;
  static __m256i codes(const BlockQ5_0 &x) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles(x.qs), high_bits(x.qh)),
                           _mm256_set1_epi8(16));
  }
};
template <>
struct Traits<BlockQ5_1> {
  using A = BlockQ8_1;
  static constexpr bool kSigned = false, kMin = true;
  static __m256i codes(const BlockQ5_1 &x) {
    return _mm256_or_si256(nibbles(x.qs), high_bits(x.qh));
  }
};
template <>
struct Traits<BlockQ8_0> {
  using A = BlockQ8_0;
  static constexpr bool kSigned = true, kMin = false;
  static __m256i codes(const BlockQ8_0 &x) { return load256(x.qs); }
};

template <int MR, int NR>
struct Tile8 {
  static constexpr int T = MR * NR, G = (T + 7) / 8;
  // Lanes past the tile repeat its last element (computed on zero sums, never stored).
  static constexpr int e(int g, int l) { return 8 * g + l < T ? 8 * g + l : T - 1; }
  static constexpr int i(int g, int l) { return e(g, l) / NR; }
  static constexpr int j(int g, int l) { return e(g, l) % NR; }
};

// Up to 8 fp16 values (lanes past `count` zero), as a vector of 8 x 16 bits.
inline __m128i halves8(const uint16_t *h, int count) {
  auto at = [&](int l) { return static_cast<short>(l < count ? h[l] : 0); };
  return _mm_setr_epi16(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
}

// Lane l of group g takes value index(g, l) of v (8 x 16 bits), as floats (F16C: exact, like
// fp16_to_fp32).
template <typename Index>
inline __m256 spread(__m128i v, Index index) {
  auto lo = [&](int l) { return static_cast<char>(2 * index(l)); };
  auto hi = [&](int l) { return static_cast<char>(2 * index(l) + 1); };
  const __m128i pattern = _mm_setr_epi8(lo(0), hi(0), lo(1), hi(1), lo(2), hi(2), lo(3), hi(3),
                                        lo(4), hi(4), lo(5), hi(5), lo(6), hi(6), lo(7), hi(7));
  return _mm256_cvtph_ps(_mm_shuffle_epi8(v, pattern));
}

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
    uint16_t xd[8], yd[8], xm[8], ys[8];
    for (int j = 0; j < NR; ++j) xd[j] = x[j][b].d;
    for (int i = 0; i < MR; ++i) yd[i] = y[i][b].d;
    if constexpr (Tr::kMin) {
      for (int j = 0; j < NR; ++j) xm[j] = x[j][b].m;
      for (int i = 0; i < MR; ++i) ys[i] = y[i][b].s;
    }
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
      const __m256 sums = _mm256_cvtepi32_ps(totals(p));
      auto by_j = [&](int l) { return L::j(g, l); };
      auto by_i = [&](int l) { return L::i(g, l); };
      const __m256 dx = spread(halves8(xd, NR), by_j), dy = spread(halves8(yd, MR), by_i);
      __m256 term;
      if constexpr (Tr::kMin) {
        term = legacy_block_min(dx, dy, sums, spread(halves8(xm, NR), by_j),
                                spread(halves8(ys, MR), by_i));
      } else {
        term = legacy_block(dx, dy, sums);
      }
      sum[g] = _mm256_add_ps(sum[g], term);
    }
  }
  alignas(32) float lanes[L::G * 8];
  for (int g = 0; g < L::G; ++g) _mm256_store_ps(lanes + 8 * g, sum[g]);
  for (int e = 0; e < L::T; ++e) out[(e / NR) * ldo + e % NR] = lanes[e];
}

#ifndef ELK_LEGACY_NR1
#define ELK_LEGACY_NR1 8
#endif
#ifndef ELK_LEGACY_MRB
#define ELK_LEGACY_MRB 8
#endif
#ifndef ELK_LEGACY_NRB
#define ELK_LEGACY_NRB 2
#endif
constexpr int kRows = ELK_LEGACY_MRB;

template <int MR>
constexpr int cols() {
  return MR == 1 ? ELK_LEGACY_NR1 : MR == 2 ? 4 : ELK_LEGACY_NRB;
}

template <typename W, int MR>
void run(int nr, const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
         float *out, int64_t ldo, const uint8_t *prefetch) {
  constexpr int C = cols<MR>();
  switch (nr) {
    case 1: tile<W, MR, 1>(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 2: tile<W, MR, (C < 2 ? C : 2)>(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 3: tile<W, MR, (C < 3 ? C : 3)>(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 4: tile<W, MR, (C < 4 ? C : 4)>(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 5: tile<W, MR, (C < 5 ? C : 5)>(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 6: tile<W, MR, (C < 6 ? C : 6)>(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 7: tile<W, MR, (C < 7 ? C : 7)>(w, ws, a, as, nb, out, ldo, prefetch); break;
    default: tile<W, MR, (C < 8 ? C : 8)>(w, ws, a, as, nb, out, ldo, prefetch); break;
  }
}

template <typename W, int MR>
void rows(const uint8_t *wb, size_t ws, int64_t n, const uint8_t *a, size_t as, int64_t nb,
          float *out, int64_t ldo) {
  constexpr int C = cols<MR>();
  for (int64_t j = 0; j < n;) {
    const int nr = n - j < C ? static_cast<int>(n - j) : C;
    run<W, MR>(nr, wb + j * ws, ws, a, as, nb, out + j, ldo, wb + (j + nr) * ws);
    j += nr;
  }
}

template <typename W>
void gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
          int64_t nb, float *out, int64_t ldo) {
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    rows<W, kRows>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
  }
  // The few rows of a speculative verify pass in one pass over the weights where possible.
  if (m - i >= 4) {
    rows<W, 4>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
    i += 4;
  }
  for (; i + 2 <= m; i += 2) rows<W, 2>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
  if (i < m) rows<W, 1>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
}

}  // namespace legacy
}  // namespace

const GemmKernels *avx2_gemm_kernels() {
  static const GemmKernels kernels{"avx2", gemm<Q4Tile>, gemm<Q5Tile>, gemm<Q6Tile>,
                                   quantize_q8_K,
                                   legacy::gemm<BlockQ4_0>, legacy::gemm<BlockQ4_1>,
                                   legacy::gemm<BlockQ5_0>, legacy::gemm<BlockQ5_1>,
                                   legacy::gemm<BlockQ8_0>};
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

}  // namespace elk
