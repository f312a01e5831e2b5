// AMX kernels (Sapphire Rapids and later: AMX-TILE and AMX-INT8 beside AVX-512 VNNI): batches
// of Q4_K and Q5_K weights through tile dot products. A GEMV, a few rows, Q6_K and the legacy
// types run avx512.cpp's kernels. Built with these flags for this file only; dispatch.cpp calls
// it only where the CPU has AMX and Linux has let the process use its tile state.
//
// Tile products take 8-bit operands, but a K-type weight is a 4/5-bit code times a 6-bit
// sub-block scale (up to 31 * 63). So each scale is split, s = 8 h + l with l, h < 8: the
// weights go in twice, as q * l and as q * h (at most 31 * 7: a byte), the tiles add over the
// whole super-block with no per-sub-block extraction, and C_l + 8 C_h = sum_j s_j (q . a)_j is
// the reference's integer sum exactly. The min terms are an int16 dot on AVX-512 (vpdpwssd),
// and the float part is kernels.h's k_block lane by lane, super-blocks in order: every element
// gets the reference's bits, so a row alone equals the same row in any batch.
//
// Operands: the activations are A straight from their Q8_K rows (16 rows x 64 codes, the row
// stride); the weights are B in AMX's order (4 consecutive weights of a row a dword, 16 weight
// rows across a tile row), built per super-block from the GGUF bytes by a 16 x 16 dword
// transpose and shared by every activation tile of the batch.
#include <immintrin.h>

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "x86_common.h"

// GCC 12 warns that the upper half of _mm512_castsi256_si512's result is uninitialized inside
// its own intrinsics: it is undefined by design, and no lane of it is ever read.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace elk {
namespace {

constexpr int kRows = 16;            // rows of a tile: activation rows, and weight rows of B
constexpr int64_t kBlockRows = 64;   // activation rows whose sums stay in one accumulator
constexpr int64_t kMinRows = 8;      // fewer rows than this: avx512.cpp's register tiles

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: the sums (activation tile 0 x low halves, 0 x high, 1 x low, 1 x high);
// 4, 5: activation tiles 0 and 1; 6, 7: the weights times the low and the high halves.
void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Rows i and i + 8 of a 16 x 8 dword matrix are the halves of x[i]; after this, x[k] holds its
// column k (rows 0..15 in order): an 8 x 8 transpose within each 256-bit half.
inline void transpose_halves(__m512i x[8]) {
  __m512i t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
  }
  __m512i u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // u[k] holds columns k (128-bit lanes 0, 2) and k + 4 (lanes 1, 3) of rows 0-3 and 8-11,
  // u[k + 4] the same of rows 4-7 and 12-15.
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm512_permutex2var_epi64(u[k], first, u[k + 4]);
    x[k + 4] = _mm512_permutex2var_epi64(u[k], second, u[k + 4]);
  }
}

// 32 bytes of each of 16 rows (row i at rows[i] + offset) as transpose_halves' input.
inline void load_rows(const uint8_t *const rows[kRows], size_t offset, __m512i x[8]) {
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load256(rows[i] + offset)),
                              load256(rows[i + 8] + offset), 1);
  }
}

// Byte `lo` and byte `hi` of each dword into its two words (0x80: a zero byte).
inline __m512i bytes_to_words(int lo, int hi) {
  const auto l = static_cast<char>(lo), h = static_cast<char>(hi), z = static_cast<char>(0x80);
  return _mm512_broadcast_i32x4(_mm_setr_epi8(l, z, h, z, l + 4, z, h + 4, z, l + 8, z, h + 8, z,
                                              l + 12, z, h + 12, z));
}

// One super-block of 16 weight rows as B tiles, and what the float part needs of it.
struct WeightBlock {
  alignas(64) uint8_t low[4][kRows][64];   // [64-weight step][dword row][4 * weight row + t]
  alignas(64) uint8_t high[4][kRows][64];
  alignas(64) float d[kRows];
  alignas(64) float dmin[kRows];
  alignas(64) int32_t min_pairs[4][kRows];  // the mins of sub-blocks 2p, 2p + 1 as an int16 pair
};

// Super-block b of weight rows w[0..nr) into `out` (rows nr..15 repeat row nr - 1: valid
// memory, and their outputs are never stored).
template <bool kQ5>
void prepare(const uint8_t *w, size_t ws, int nr, int64_t b, WeightBlock &out) {
  using Block = typename std::conditional<kQ5, BlockQ5_K, BlockQ4_K>::type;
  const uint8_t *rows[kRows];
  for (int j = 0; j < kRows; ++j) {
    rows[j] = w + (j < nr ? j : nr - 1) * ws + b * sizeof(Block);
  }
  // d | dmin << 16 of each row, then both as floats (F16C: exact).
  alignas(64) uint32_t dd[kRows];
  for (int j = 0; j < kRows; ++j) std::memcpy(&dd[j], rows[j], sizeof(dd[j]));
  const __m512i both = _mm512_load_si512(dd);
  _mm512_store_ps(out.d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(both)));
  _mm512_store_ps(out.dmin, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(both, 16))));
  // Each row's 8 scales and 8 mins as 4 dwords (scales 0-3, 4-7, mins 0-3, 4-7), four rows a
  // zmm; z[c] then holds dword c of rows 0..15.
  __m512i rows4[4];
  for (int q = 0; q < 4; ++q) {
    const uint8_t *s0 = rows[4 * q] + offsetof(Block, scales);
    const uint8_t *s1 = rows[4 * q + 1] + offsetof(Block, scales);
    const uint8_t *s2 = rows[4 * q + 2] + offsetof(Block, scales);
    const uint8_t *s3 = rows[4 * q + 3] + offsetof(Block, scales);
    rows4[q] = _mm512_inserti64x4(_mm512_castsi256_si512(scales_mins_k4(s0, s1)),
                                  scales_mins_k4(s2, s3), 1);
  }
  __m512i z[4];
  for (int c = 0; c < 4; ++c) {
    const __m512i pick = _mm512_setr_epi32(c, 4 + c, 8 + c, 12 + c, 16 + c, 20 + c, 24 + c,
                                           28 + c, c, 4 + c, 8 + c, 12 + c, 16 + c, 20 + c,
                                           24 + c, 28 + c);
    z[c] = _mm512_mask_blend_epi32(0xff00, _mm512_permutex2var_epi32(rows4[0], pick, rows4[1]),
                                   _mm512_permutex2var_epi32(rows4[2], pick, rows4[3]));
  }
  for (int p = 0; p < 4; ++p) {
    const int first = 2 * (p % 2);
    _mm512_store_si512(out.min_pairs[p],
                       _mm512_shuffle_epi8(z[2 + p / 2], bytes_to_words(first, first + 1)));
  }
  __m512i qh[8];
  if (kQ5) {
    load_rows(rows, offsetof(BlockQ5_K, qh), qh);
    transpose_halves(qh);
  }
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles)
    __m512i x[8];
    load_rows(rows, offsetof(Block, qs) + 32 * p, x);
    transpose_halves(x);
    // Each row's scale of sub-block 2p (and 2p + 1) in both words of its dword, split in its
    // low and high 3 bits. A byte's product is below 256 (31 * 7), so one 16-bit multiply
    // gives both bytes of a word.
    const __m512i s0 = _mm512_shuffle_epi8(z[p / 2], bytes_to_words(2 * (p % 2), 2 * (p % 2)));
    const __m512i s1 =
        _mm512_shuffle_epi8(z[p / 2], bytes_to_words(2 * (p % 2) + 1, 2 * (p % 2) + 1));
    const __m512i seven = _mm512_set1_epi16(7);
    const __m512i l0 = _mm512_and_si512(s0, seven), h0 = _mm512_srli_epi16(s0, 3);
    const __m512i l1 = _mm512_and_si512(s1, seven), h1 = _mm512_srli_epi16(s1, 3);
    for (int k = 0; k < 8; ++k) {
      __m512i q0 = _mm512_and_si512(x[k], low4);
      __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(x[k], 4), low4);
      if (kQ5) {
        // Bit 2p of a qh byte is bit 4 of its low-nibble weight, bit 2p + 1 the high's.
        const __m512i sixteen = _mm512_set1_epi8(0x10);
        q0 = _mm512_mask_add_epi8(q0, _mm512_test_epi8_mask(qh[k], _mm512_set1_epi8(
                                          static_cast<char>(1u << (2 * p)))), q0, sixteen);
        q1 = _mm512_mask_add_epi8(q1, _mm512_test_epi8_mask(qh[k], _mm512_set1_epi8(
                                          static_cast<char>(1u << (2 * p + 1)))), q1, sixteen);
      }
      _mm512_store_si512(out.low[p][k], _mm512_mullo_epi16(q0, l0));
      _mm512_store_si512(out.high[p][k], _mm512_mullo_epi16(q0, h0));
      _mm512_store_si512(out.low[p][8 + k], _mm512_mullo_epi16(q1, l1));
      _mm512_store_si512(out.high[p][8 + k], _mm512_mullo_epi16(q1, h1));
    }
  }
}

// A tile of activation rows: their Q8_K rows, or (a last partial tile) a copy padded with zero
// rows, whose sums are zero and never stored.
struct ActivationTile {
  const uint8_t *rows;
  size_t stride;
  int count;
};

inline const uint8_t *codes(const ActivationTile &t, int64_t b, int p) {
  return t.rows + b * sizeof(BlockQ8_K) + offsetof(BlockQ8_K, qs) + 64 * p;
}

// What the float part takes of an activation row's super-block: its scale, and the sums of its
// 32 activations per sub-block as int16 pairs (2p | 2p + 1), for the min terms' vpdpwssd.
struct RowTerms {
  int32_t pairs[4];
  float dy;
};

// The int32 sums of one super-block of an activation tile, stored from its two tiles (GCC's
// tile intrinsics take literal tile numbers), with what add_terms needs to finish them.
struct Sums {
  alignas(64) int32_t low[kRows][kRows];
  alignas(64) int32_t high[kRows][kRows];
  const RowTerms *terms;  // the tile's rows at this super-block: terms[i * nb]
  int count;
  const WeightBlock *weights;
  float (*acc)[kRows];
};

// Adds a super-block's terms (k_block, lane by lane; -ffp-contract=off: no FMA) to the tile's
// accumulators, 16 floats a row (one per weight row).
void add_terms(const Sums &c, int64_t nb) {
  const WeightBlock &wb = *c.weights;
  const __m512 d = _mm512_load_ps(wb.d), dmin = _mm512_load_ps(wb.dmin);
  const __m512i mp0 = _mm512_load_si512(wb.min_pairs[0]), mp1 = _mm512_load_si512(wb.min_pairs[1]);
  const __m512i mp2 = _mm512_load_si512(wb.min_pairs[2]), mp3 = _mm512_load_si512(wb.min_pairs[3]);
  for (int i = 0; i < c.count; ++i) {
    const RowTerms &r = c.terms[i * nb];
    const __m512i dots = _mm512_add_epi32(_mm512_load_si512(c.low[i]),
                                          _mm512_slli_epi32(_mm512_load_si512(c.high[i]), 3));
    __m512i mins = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mp0, _mm512_set1_epi32(r.pairs[0]));
    mins = _mm512_dpwssd_epi32(mins, mp1, _mm512_set1_epi32(r.pairs[1]));
    mins = _mm512_dpwssd_epi32(mins, mp2, _mm512_set1_epi32(r.pairs[2]));
    mins = _mm512_dpwssd_epi32(mins, mp3, _mm512_set1_epi32(r.pairs[3]));
    const __m512 dy = _mm512_set1_ps(r.dy);
    const __m512 term =
        _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(d, dy), _mm512_cvtepi32_ps(dots)),
                      _mm512_mul_ps(_mm512_mul_ps(dmin, dy), _mm512_cvtepi32_ps(mins)));
    _mm512_store_ps(c.acc[i], _mm512_add_ps(_mm512_load_ps(c.acc[i]), term));
  }
}

// Super-block b of two activation tiles against the prepared weights, into c0 and c1.
void pair_block(const ActivationTile &t0, const ActivationTile &t1, int64_t b,
                const WeightBlock &wb, Sums &c0, Sums &c1) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int p = 0; p < 4; ++p) {
    _tile_loadd(6, wb.low[p], 64);
    _tile_loadd(7, wb.high[p], 64);
    _tile_loadd(4, codes(t0, b, p), t0.stride);
    _tile_loadd(5, codes(t1, b, p), t1.stride);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
  }
  _tile_stored(0, c0.low, 64);
  _tile_stored(1, c0.high, 64);
  _tile_stored(2, c1.low, 64);
  _tile_stored(3, c1.high, 64);
}

void single_block(const ActivationTile &t, int64_t b, const WeightBlock &wb, Sums &c) {
  _tile_zero(0);
  _tile_zero(1);
  for (int p = 0; p < 4; ++p) {
    _tile_loadd(6, wb.low[p], 64);
    _tile_loadd(7, wb.high[p], 64);
    _tile_loadd(4, codes(t, b, p), t.stride);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
  }
  _tile_stored(0, c.low, 64);
  _tile_stored(1, c.high, 64);
}

// This thread's scratch, reused across calls: a last partial tile's rows padded with zeros,
// and the rows' RowTerms.
struct Scratch {
  std::vector<uint8_t> padded;
  std::vector<RowTerms> terms;
};

template <bool kQ5>
void gemm_k45(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
              int64_t nb, float *out, int64_t ldo) {
  const GemmKernels &vnni = *avx512_vnni_gemm_kernels();
  if (m < kMinRows) {
    (kQ5 ? vnni.q5_K : vnni.q4_K)(w, ws, n, a, as, m, nb, out, ldo);
    return;
  }
  const auto *wb8 = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  thread_local Scratch scratch;
  const size_t padded_stride = static_cast<size_t>(nb) * sizeof(BlockQ8_K);
  scratch.terms.resize(static_cast<size_t>(kBlockRows * nb));
  configure_tiles();
  // Two of each, so that the tile products of one step run while the vector units finish the
  // step before (the tile stores' results are read a step later).
  WeightBlock weights[2];
  Sums sums[4];
  alignas(64) float acc[kBlockRows][kRows];
  for (int64_t i0 = 0; i0 < m; i0 += kBlockRows) {
    const int64_t rows = m - i0 < kBlockRows ? m - i0 : kBlockRows;
    ActivationTile tiles[kBlockRows / kRows];
    int count = 0;
    for (int64_t r = 0; r < rows; r += kRows, ++count) {
      const int in_tile = static_cast<int>(rows - r < kRows ? rows - r : kRows);
      const uint8_t *first = ab + (i0 + r) * as;
      if (in_tile == kRows) {
        tiles[count] = ActivationTile{first, as, kRows};
        continue;
      }
      scratch.padded.assign(kRows * padded_stride, 0);
      for (int i = 0; i < in_tile; ++i) {
        std::memcpy(scratch.padded.data() + i * padded_stride, first + i * as, padded_stride);
      }
      tiles[count] = ActivationTile{scratch.padded.data(), padded_stride, in_tile};
    }
    for (int64_t i = 0; i < rows; ++i) {
      const auto *y = reinterpret_cast<const BlockQ8_K *>(ab + (i0 + i) * as);
      for (int64_t b = 0; b < nb; ++b) {
        RowTerms &t = scratch.terms[i * nb + b];
        _mm_storeu_si128(reinterpret_cast<__m128i *>(t.pairs),
                         _mm_hadd_epi16(load128(y[b].bsums), load128(y[b].bsums + 8)));
        t.dy = y[b].d;
      }
    }
    for (int64_t n0 = 0; n0 < n; n0 += kRows) {
      const int nr = static_cast<int>(n - n0 < kRows ? n - n0 : kRows);
      std::memset(acc, 0, sizeof(acc));
      int pending = 0;  // sums stored last step, finished this step
      int step = 0;
      Sums *ready[2] = {nullptr, nullptr};
      for (int64_t b = 0; b < nb; ++b) {
        WeightBlock &wb = weights[b & 1];
        prepare<kQ5>(wb8 + n0 * ws, ws, nr, b, wb);
        for (int t = 0; t < count; t += 2) {
          Sums *now = &sums[2 * (step++ % 2)];
          for (int u = 0; u < 2 && t + u < count; ++u) {
            now[u].terms = &scratch.terms[(t + u) * kRows * nb + b];
            now[u].count = tiles[t + u].count;
            now[u].weights = &wb;
            now[u].acc = acc + (t + u) * kRows;
          }
          if (t + 1 < count) {
            pair_block(tiles[t], tiles[t + 1], b, wb, now[0], now[1]);
          } else {
            single_block(tiles[t], b, wb, now[0]);
          }
          for (int u = 0; u < pending; ++u) add_terms(*ready[u], nb);
          pending = t + 1 < count ? 2 : 1;
          ready[0] = &now[0];
          ready[1] = &now[1];
        }
      }
      for (int u = 0; u < pending; ++u) add_terms(*ready[u], nb);
      const __mmask16 mask = static_cast<__mmask16>((1u << nr) - 1);
      for (int64_t i = 0; i < rows; ++i) {
        _mm512_mask_storeu_ps(out + (i0 + i) * ldo + n0, mask, _mm512_load_ps(acc[i]));
      }
    }
  }
  _tile_release();
}

}  // namespace

const GemmKernels *amx_gemm_kernels() {
  const GemmKernels &vnni = *avx512_vnni_gemm_kernels();
  static const GemmKernels kernels{"amx", gemm_k45<false>, gemm_k45<true>, vnni.q6_K,
                                   vnni.quantize_q8_K, vnni.q4_0, vnni.q4_1, vnni.q5_0,
                                   vnni.q5_1, vnni.q8_0};
  return &kernels;
}

// AMX adds no single-row dot: avx512.cpp's, under this set's name.
const DotKernels *amx_kernels() {
  static const DotKernels kernels = [] {
    DotKernels k = *avx512_vnni_kernels();
    k.isa = "amx";
    return k;
  }();
  return &kernels;
}

}  // namespace elk
