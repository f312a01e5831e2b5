// AMX kernels (Sapphire Rapids and later: AMX-TILE and AMX-INT8, beside AVX-512 VNNI and
// VBMI): batches of the K types through tile dot products. A GEMV, a few rows and the legacy
// types run avx512.cpp's kernels. Built with these flags for this file only; dispatch.cpp calls
// it only where the CPU has them and Linux has let the process use its tile state.
//
// Tile products take 8-bit operands, but a K-type weight is a code times a sub-block scale,
// which does not fit a byte. So the scale is split into digits and the weights go in once per
// digit, each product a byte; the tiles then add over the whole super-block with no
// per-sub-block extraction, and the digits' sums recombine to the reference's integer exactly:
// - Q4_K/Q5_K: s = 8 h + l (l, h < 8; the codes q < 32): B = q * l and q * h, at most 31 * 7,
//   unsigned; C_l + 8 C_h = sum_j s_j (q . a)_j. The min terms are an int16 dot (vpdpwssd).
// - Q6_K: the signed scale in balanced base 7, s = e0 + 7 e1 + 49 e2 (e in -3..3), and the
//   weight w = q - 32 in -32..31: B = w * e, signed, |w e| <= 96; C_0 + 7 (C_1 + 49 C_2).
// The float part is kernels.h's k_block lane by lane, super-blocks in order: every element gets
// the reference's bits, so a row alone equals the same row in any batch.
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
constexpr int kSteps = 4;            // 64-weight steps of a super-block

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Eight tiles of 16 rows x 64 bytes (Q45 and Q6 say what each holds).
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

// r[i] (16 dwords each) becomes column i of the 16 x 16 dword matrix the rows were.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
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

// One super-block of an activation tile's codes, packed [step][row][64 codes] (1 KB a tile
// load, from L1: tile loads that miss L1 stall the products that wait on them), rows past the
// batch zero (their sums are zero and never stored).
struct PackedTile {
  alignas(64) int8_t codes[kSteps][kRows][64];
};

// What the float part takes of an activation row's super-block: its scale, and the sums of its
// 32 activations per sub-block as int16 pairs (2p | 2p + 1), for the min terms' vpdpwssd.
struct RowTerms {
  int32_t pairs[4];
  float dy;
};

// Where a tile's stored sums go: its rows' RowTerms at this super-block (terms[i]) and
// accumulators (16 floats a row, one per weight row).
struct Finish {
  const RowTerms *terms;
  int count;
  float (*acc)[kRows];
};

// ---- Q4_K / Q5_K ---------------------------------------------------------------------------
// Tiles 0-3: the sums (activation tile 0 x low digits, 0 x high, 1 x low, 1 x high); 4, 5:
// activation tiles 0 and 1; 6, 7: the weights times the low and the high digits.
template <bool kQ5>
struct Q45 {
  using Block = typename std::conditional<kQ5, BlockQ5_K, BlockQ4_K>::type;
  static constexpr int kTiles = 2;  // activation tiles a step
  static constexpr int64_t kMinRows = 8;  // fewer rows: avx512.cpp's register tiles are faster
  static constexpr size_t kBlockBytes = sizeof(Block);

  // One super-block of 16 weight rows as B tiles, and what the float part needs of it.
  struct Weights {
    alignas(64) uint8_t low[kSteps][kRows][64];  // [step][dword row][4 * weight row + t]
    alignas(64) uint8_t high[kSteps][kRows][64];
    alignas(64) float d[kRows];
    alignas(64) float dmin[kRows];
    alignas(64) int32_t min_pairs[4][kRows];  // mins of sub-blocks 2p, 2p + 1, an int16 pair
  };

  // One super-block of an activation tile, stored from its two tiles (GCC's tile intrinsics
  // take literal tile numbers).
  struct Sums : Finish {
    alignas(64) int32_t low[kRows][kRows];
    alignas(64) int32_t high[kRows][kRows];
    const Weights *weights;
  };

  // Super-block b of weight rows w[0..nr) into `out` (rows nr..15 repeat row nr - 1: valid
  // memory, and their outputs are never stored).
  static void prepare(const uint8_t *w, size_t ws, int nr, int64_t b, Weights &out) {
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

  // Super-block b of `count` (1 or 2) activation tiles against the prepared weights.
  static void step(const PackedTile *t, int count, const Weights &wb) {
    _tile_zero(0);
    _tile_zero(1);
    if (count == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int p = 0; p < kSteps; ++p) {
      _tile_loadd(6, wb.low[p], 64);
      _tile_loadd(7, wb.high[p], 64);
      _tile_loadd(4, t[0].codes[p], 64);
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 4, 7);
      if (count == 2) {
        _tile_loadd(5, t[1].codes[p], 64);
        _tile_dpbsud(2, 5, 6);
        _tile_dpbsud(3, 5, 7);
      }
    }
  }

  static void store(int count, Sums *c) {
    _tile_stored(0, c[0].low, 64);
    _tile_stored(1, c[0].high, 64);
    if (count == 2) {
      _tile_stored(2, c[1].low, 64);
      _tile_stored(3, c[1].high, 64);
    }
  }

  // Adds a super-block's terms (k_block, lane by lane; -ffp-contract=off: no FMA) to the
  // tile's accumulators.
  static void finish(const Sums &c) {
    const Weights &wb = *c.weights;
    const __m512 d = _mm512_load_ps(wb.d), dmin = _mm512_load_ps(wb.dmin);
    const __m512i mp0 = _mm512_load_si512(wb.min_pairs[0]);
    const __m512i mp1 = _mm512_load_si512(wb.min_pairs[1]);
    const __m512i mp2 = _mm512_load_si512(wb.min_pairs[2]);
    const __m512i mp3 = _mm512_load_si512(wb.min_pairs[3]);
    for (int i = 0; i < c.count; ++i) {
      const RowTerms &r = c.terms[i];
      const __m512i dots = _mm512_add_epi32(_mm512_load_si512(c.low[i]),
                                            _mm512_slli_epi32(_mm512_load_si512(c.high[i]), 3));
      __m512i mins =
          _mm512_dpwssd_epi32(_mm512_setzero_si512(), mp0, _mm512_set1_epi32(r.pairs[0]));
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

  static GemmFn few_rows() {
    return kQ5 ? avx512_vnni_gemm_kernels()->q5_K : avx512_vnni_gemm_kernels()->q4_K;
  }
};

// ---- Q6_K ----------------------------------------------------------------------------------
// Balanced base-7 digits of every int8 scale (indexed by its byte): s = e0 + 7 e1 + 49 e2.
struct Digits {
  alignas(64) int8_t e[3][256];
};

constexpr Digits make_digits() {
  Digits t{};
  for (int v = 0; v < 256; ++v) {
    int s = v < 128 ? v : v - 256;
    for (int k = 0; k < 3; ++k) {
      int e = ((s % 7) + 7) % 7;
      if (e > 3) e -= 7;
      t.e[k][v] = static_cast<int8_t>(e);
      s = (s - e) / 7;
    }
  }
  return t;
}

constexpr Digits kDigits = make_digits();

// Each byte of v looked up in a 256-byte table (VBMI: two 128-byte halves, by the sign bit).
inline __m512i lookup256(__m512i v, const int8_t *table) {
  const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(table), v,
                                               _mm512_load_si512(table + 64));
  const __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512(table + 128), v,
                                                _mm512_load_si512(table + 192));
  return _mm512_mask_blend_epi8(_mm512_movepi8_mask(v), low, high);
}

// Byte b of each dword in all four of its bytes.
inline __m512i replicate_byte(int b) {
  auto at = [b](int dword) { return static_cast<char>(4 * dword + b); };
  return _mm512_broadcast_i32x4(_mm_setr_epi8(at(0), at(0), at(0), at(0), at(1), at(1), at(1),
                                              at(1), at(2), at(2), at(2), at(2), at(3), at(3),
                                              at(3), at(3)));
}

// Tiles 0-2: the sums per digit; 4: the activation tile; 5-7: the weights times each digit.
struct Q6 {
  static constexpr int kTiles = 1;
  // Preparing a Q6_K block (three digit planes, 400 ns) pays off from two activation tiles on.
  static constexpr int64_t kMinRows = 32;
  static constexpr size_t kBlockBytes = sizeof(BlockQ6_K);

  struct Weights {
    alignas(64) int8_t b[3][kSteps][kRows][64];  // [digit][step][dword row][4 * weight row + t]
    alignas(64) float d[kRows];
  };

  struct Sums : Finish {
    alignas(64) int32_t c[3][kRows][kRows];
    const Weights *weights;
  };

  static void prepare(const uint8_t *w, size_t ws, int nr, int64_t b, Weights &out) {
    const uint8_t *rows[kRows];
    for (int j = 0; j < kRows; ++j) {
      rows[j] = w + (j < nr ? j : nr - 1) * ws + b * sizeof(BlockQ6_K);
    }
    alignas(32) uint16_t d[kRows];
    for (int j = 0; j < kRows; ++j) std::memcpy(&d[j], rows[j] + offsetof(BlockQ6_K, d), 2);
    _mm512_store_ps(out.d, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<__m256i *>(d))));
    // The 16 scales of each row as 4 dwords, four rows a zmm; then z[c]: dword c of every row
    // (scales 4c..4c+3), and its digits.
    __m512i rows4[4];
    for (int q = 0; q < 4; ++q) {
      __m512i v = _mm512_castsi128_si512(load128(rows[4 * q] + offsetof(BlockQ6_K, scales)));
      v = _mm512_inserti32x4(v, load128(rows[4 * q + 1] + offsetof(BlockQ6_K, scales)), 1);
      v = _mm512_inserti32x4(v, load128(rows[4 * q + 2] + offsetof(BlockQ6_K, scales)), 2);
      rows4[q] = _mm512_inserti32x4(v, load128(rows[4 * q + 3] + offsetof(BlockQ6_K, scales)),
                                    3);
    }
    // Per sub-block and digit: which bytes take w (bit 0 of |e|), 2 w (bit 1), and a minus.
    __mmask64 one[3][16], two[3][16], minus[3][16];
    const __m512i bit0 = _mm512_set1_epi8(1), bit1 = _mm512_set1_epi8(2);
    for (int c = 0; c < 4; ++c) {
      const __m512i pick = _mm512_setr_epi32(c, 4 + c, 8 + c, 12 + c, 16 + c, 20 + c, 24 + c,
                                             28 + c, c, 4 + c, 8 + c, 12 + c, 16 + c, 20 + c,
                                             24 + c, 28 + c);
      const __m512i z = _mm512_mask_blend_epi32(
          0xff00, _mm512_permutex2var_epi32(rows4[0], pick, rows4[1]),
          _mm512_permutex2var_epi32(rows4[2], pick, rows4[3]));
      for (int k = 0; k < 3; ++k) {
        const __m512i e = lookup256(z, kDigits.e[k]);
        for (int t = 0; t < 4; ++t) {
          const __m512i digit = _mm512_shuffle_epi8(e, replicate_byte(t));
          const __m512i size = _mm512_abs_epi8(digit);
          one[k][4 * c + t] = _mm512_test_epi8_mask(size, bit0);
          two[k][4 * c + t] = _mm512_test_epi8_mask(size, bit1);
          minus[k][4 * c + t] = _mm512_movepi8_mask(digit);
        }
      }
    }
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    const __m512i offset = _mm512_set1_epi8(32), zero = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {  // 128 weights: ql[64h..], qh[32h..]
      __m512i ql[16], qh[8];
      for (int j = 0; j < kRows; ++j) {
        ql[j] = _mm512_loadu_si512(rows[j] + offsetof(BlockQ6_K, ql) + 64 * h);
      }
      transpose16(ql);
      load_rows(rows, offsetof(BlockQ6_K, qh) + 32 * h, qh);
      transpose_halves(qh);
      for (int nib = 0; nib < 2; ++nib) {  // steps 2h (low nibbles) and 2h + 1 (high)
        const int p = 2 * h + nib;
        for (int kk = 0; kk < kRows; ++kk) {
          // Quarter r of the half: bits 2r, 2r + 1 of its qh byte are bits 4, 5 of the code.
          const int r = 2 * nib + kk / 8;
          const __m512i nibble =
              _mm512_and_si512(nib ? _mm512_srli_epi16(ql[kk], 4) : ql[kk], low4);
          const __m512i bits = r <= 2 ? _mm512_slli_epi16(qh[kk % 8], 4 - 2 * r)
                                      : _mm512_srli_epi16(qh[kk % 8], 2 * r - 4);
          const __m512i wq =
              _mm512_sub_epi8(_mm512_or_si512(nibble, _mm512_and_si512(bits, top2)), offset);
          const __m512i wq2 = _mm512_add_epi8(wq, wq);
          const int sub = 4 * p + kk / 4;
          for (int k = 0; k < 3; ++k) {
            __m512i v = _mm512_maskz_mov_epi8(one[k][sub], wq);
            v = _mm512_mask_add_epi8(v, two[k][sub], v, wq2);
            v = _mm512_mask_sub_epi8(v, minus[k][sub], zero, v);
            _mm512_store_si512(out.b[k][p][kk], v);
          }
        }
      }
    }
  }

  static void step(const PackedTile *t, int, const Weights &wb) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int p = 0; p < kSteps; ++p) {
      _tile_loadd(4, t[0].codes[p], 64);
      _tile_loadd(5, wb.b[0][p], 64);
      _tile_loadd(6, wb.b[1][p], 64);
      _tile_loadd(7, wb.b[2][p], 64);
      _tile_dpbssd(0, 4, 5);
      _tile_dpbssd(1, 4, 6);
      _tile_dpbssd(2, 4, 7);
    }
  }

  static void store(int, Sums *c) {
    _tile_stored(0, c[0].c[0], 64);
    _tile_stored(1, c[0].c[1], 64);
    _tile_stored(2, c[0].c[2], 64);
  }

  // k_block(d, 0, dy, dots, 0), as the reference writes it, lane by lane.
  static void finish(const Sums &c) {
    const __m512 d = _mm512_load_ps(c.weights->d), zero = _mm512_setzero_ps();
    for (int i = 0; i < c.count; ++i) {
      const __m512i c2 = _mm512_load_si512(c.c[2][i]);
      const __m512i upper = _mm512_add_epi32(
          _mm512_load_si512(c.c[1][i]), _mm512_sub_epi32(_mm512_slli_epi32(c2, 3), c2));
      const __m512i dots = _mm512_add_epi32(
          _mm512_load_si512(c.c[0][i]), _mm512_sub_epi32(_mm512_slli_epi32(upper, 3), upper));
      const __m512 dy = _mm512_set1_ps(c.terms[i].dy);
      const __m512 term =
          _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(d, dy), _mm512_cvtepi32_ps(dots)),
                        _mm512_mul_ps(_mm512_mul_ps(zero, dy), zero));
      _mm512_store_ps(c.acc[i], _mm512_add_ps(_mm512_load_ps(c.acc[i]), term));
    }
  }

  static GemmFn few_rows() { return avx512_vnni_gemm_kernels()->q6_K; }
};

// ---- the driver ----------------------------------------------------------------------------
// Prefetches `bytes` at `offset` of each of rows w[0..nr).
inline void prefetch_block(const uint8_t *w, size_t ws, int nr, size_t offset, size_t bytes) {
  for (int j = 0; j < nr; ++j) {
    const uint8_t *p = w + j * ws + offset;
    for (size_t line = 0; line < bytes + 63; line += 64) {
      _mm_prefetch(reinterpret_cast<const char *>(p + line), _MM_HINT_T0);
    }
  }
}

constexpr int kChunk = 2;  // B tiles (of 16 weight rows) a pass over the super-blocks

// The float sums of `chunk` B tiles (columns n0.., the last one possibly partial) for `rows`
// activation rows into out (row stride ldo).
inline void store_sums(const float (*acc)[kBlockRows][kRows], int chunk, int64_t rows,
                       int64_t n0, int64_t n, float *out, int64_t ldo) {
  for (int j = 0; j < chunk; ++j) {
    const int64_t first = n0 + j * kRows;
    const int nr = static_cast<int>(n - first < kRows ? n - first : kRows);
    const __mmask16 mask = static_cast<__mmask16>((1u << nr) - 1);
    for (int64_t i = 0; i < rows; ++i) {
      _mm512_mask_storeu_ps(out + i * ldo + first, mask, _mm512_load_ps(acc[j][i]));
    }
  }
}

// Super-block b's codes of activation rows a[0..rows) (stride as) into tiles[0..].
inline void pack(const uint8_t *a, size_t as, int64_t rows, int64_t b, PackedTile *tiles) {
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;
  for (int64_t i = 0; i < padded; ++i) {
    PackedTile &t = tiles[i / kRows];
    const int r = static_cast<int>(i % kRows);
    if (i >= rows) {
      for (int p = 0; p < kSteps; ++p) _mm512_store_si512(t.codes[p][r], _mm512_setzero_si512());
      continue;
    }
    const int8_t *q = reinterpret_cast<const BlockQ8_K *>(a + i * as)[b].qs;
    for (int p = 0; p < kSteps; ++p) {
      _mm512_store_si512(t.codes[p][r], _mm512_loadu_si512(q + 64 * p));
    }
  }
}

// This thread's RowTerms ([super-block][row of the block]), reused across calls.
thread_local std::vector<RowTerms> row_terms;

// Blocks of up to 64 activation rows; per 32 weight rows (two B tiles), super-block by
// super-block: the activations packed once for both, the weights of each prepared once for all
// the activation tiles, then a step per K::kTiles of them. A step's sums are finished one step
// later, so the tile products of one step run while the vector units finish the step before
// (two of each buffer).
template <class K>
void gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
          int64_t nb, float *out, int64_t ldo) {
  if (m < K::kMinRows) {
    K::few_rows()(w, ws, n, a, as, m, nb, out, ldo);
    return;
  }
  const auto *wb8 = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  row_terms.resize(static_cast<size_t>(kBlockRows * nb));
  configure_tiles();
  typename K::Weights weights[2];
  typename K::Sums sums[2 * K::kTiles];
  PackedTile packed[kBlockRows / kRows];
  alignas(64) float acc[kChunk][kBlockRows][kRows];
  for (int64_t i0 = 0; i0 < m; i0 += kBlockRows) {
    const int64_t rows = m - i0 < kBlockRows ? m - i0 : kBlockRows;
    const int count = static_cast<int>((rows + kRows - 1) / kRows);
    const uint8_t *block = ab + i0 * as;
    for (int64_t i = 0; i < rows; ++i) {
      const auto *y = reinterpret_cast<const BlockQ8_K *>(block + i * as);
      for (int64_t b = 0; b < nb; ++b) {
        RowTerms &t = row_terms[b * kBlockRows + i];
        _mm_storeu_si128(reinterpret_cast<__m128i *>(t.pairs),
                         _mm_hadd_epi16(load128(y[b].bsums), load128(y[b].bsums + 8)));
        t.dy = y[b].d;
      }
    }
    for (int64_t n0 = 0; n0 < n; n0 += kChunk * kRows) {
      const int64_t left = n - n0;
      const int chunk = left > kRows ? kChunk : 1;
      std::memset(acc, 0, sizeof(acc));
      typename K::Sums *ready = nullptr;  // the last step's sums, finished after the next
      int pending = 0, step = 0, parity = 0;
      for (int64_t b = 0; b < nb; ++b) {
        pack(block, as, rows, b, packed);
        for (int j = 0; j < chunk; ++j) {
          const int64_t first = n0 + j * kRows;
          const int nr = static_cast<int>(n - first < kRows ? n - first : kRows);
          // The next weight block's rows while this one computes: 16 rows a row apart are 16
          // streams the hardware prefetchers follow poorly.
          if (j + 1 < chunk) {
            const int next = static_cast<int>(n - first - kRows < kRows ? n - first - kRows
                                                                         : kRows);
            prefetch_block(wb8 + (first + kRows) * ws, ws, next, b * K::kBlockBytes,
                           K::kBlockBytes);
          } else if (b + 1 < nb) {
            prefetch_block(wb8 + n0 * ws, ws, nr, (b + 1) * K::kBlockBytes, K::kBlockBytes);
          }
          typename K::Weights &wb = weights[parity];
          parity ^= 1;
          K::prepare(wb8 + first * ws, ws, nr, b, wb);
          for (int t = 0; t < count; t += K::kTiles) {
            const int here = count - t < K::kTiles ? count - t : K::kTiles;
            typename K::Sums *now = &sums[K::kTiles * (step++ % 2)];
            for (int u = 0; u < here; ++u) {
              const int64_t r0 = (t + u) * kRows;
              now[u].terms = &row_terms[b * kBlockRows + r0];
              now[u].count = static_cast<int>(rows - r0 < kRows ? rows - r0 : kRows);
              now[u].acc = acc[j] + r0;
              now[u].weights = &wb;
            }
            K::step(packed + t, here, wb);
            for (int u = 0; u < pending; ++u) K::finish(ready[u]);
            K::store(here, now);
            ready = now;
            pending = here;
          }
        }
      }
      for (int u = 0; u < pending; ++u) K::finish(ready[u]);
      store_sums(acc, chunk, rows, n0, n, out + i0 * ldo, ldo);
    }
  }
  _tile_release();
}

// ---- legacy types (blocks of 32 weights) ---------------------------------------------------
// Each block has its own scales, so each block's integer sums leave the tiles before its float
// term: a step takes kGroup blocks of one activation tile into tiles 0-3 (tile 4 the block's
// activation codes, 16 rows x 32; tile 5 its weights, 8 dword rows x 16 weight rows). The
// weights go in as the AVX2 tiles read them (x86_common.h's Codes: signed code - offset, or
// Q4_1/Q5_1's unsigned codes with the min a float term), and each block's term is kernels.h's
// legacy_block(_min) lane by lane, blocks in order.
namespace legacy32 {

using legacy::Codes;

constexpr int kGroup = 4;
constexpr int64_t kMinRows = 8;

void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < kGroup; ++t) {
    cfg.rows[t] = kRows;
    cfg.colsb[t] = 64;
  }
  cfg.rows[4] = kRows;  // activations: 16 rows x 32 codes
  cfg.colsb[4] = 32;
  cfg.rows[5] = 8;  // weights: 8 rows of 4-code dwords x 16 weight rows
  cfg.colsb[5] = 64;
  _tile_loadconfig(&cfg);
}

// kGroup blocks of 16 weight rows as B tiles, with their scales (and mins) as floats.
struct Weights {
  alignas(64) int8_t b[kGroup][8][64];
  alignas(64) float dx[kGroup][kRows];
  alignas(64) float m[kGroup][kRows];
};

// kGroup blocks of an activation tile: codes [block][row][32], and each row's d (and s).
struct PackedTile {
  alignas(64) int8_t codes[kGroup][kRows][32];
  alignas(64) float dy[kGroup][kRows];
  alignas(64) float s[kGroup][kRows];
};

struct Sums {
  alignas(64) int32_t c[kGroup][kRows][kRows];
  const PackedTile *tile;
  const Weights *weights;
  int count, blocks;
  float (*acc)[kRows];
};

inline float half(uint16_t h) { return _cvtsh_ss(h); }  // F16C: exact, as fp16_to_fp32

// Blocks first..first + blocks of weight rows w[0..nr) (rows nr..15 repeat row nr - 1).
template <typename W>
void prepare(const uint8_t *w, size_t ws, int nr, int64_t first, int blocks, Weights &out) {
  const W *rows[kRows];
  for (int j = 0; j < kRows; ++j) {
    rows[j] = reinterpret_cast<const W *>(w + (j < nr ? j : nr - 1) * ws) + first;
  }
  for (int u = 0; u < blocks; ++u) {
    __m512i x[8];
    for (int i = 0; i < 8; ++i) {
      x[i] = _mm512_inserti64x4(_mm512_castsi256_si512(Codes<W>::codes(rows[i][u])),
                                Codes<W>::codes(rows[i + 8][u]), 1);
    }
    transpose_halves(x);
    for (int k = 0; k < 8; ++k) _mm512_store_si512(out.b[u][k], x[k]);
    for (int j = 0; j < kRows; ++j) {
      out.dx[u][j] = half(rows[j][u].d);
      if constexpr (Codes<W>::kMin) out.m[u][j] = half(rows[j][u].m);
    }
  }
}

// Blocks first..first + blocks of activation rows a[0..rows) into tiles (rows past them zero).
template <typename A>
void pack(const uint8_t *a, size_t as, int64_t rows, int64_t first, int blocks,
          PackedTile *tiles) {
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;
  for (int64_t i = 0; i < padded; ++i) {
    PackedTile &t = tiles[i / kRows];
    const int r = static_cast<int>(i % kRows);
    for (int u = 0; u < blocks; ++u) {
      if (i >= rows) {
        _mm256_store_si256(reinterpret_cast<__m256i *>(t.codes[u][r]), _mm256_setzero_si256());
        continue;
      }
      const A &y = reinterpret_cast<const A *>(a + i * as)[first + u];
      _mm256_store_si256(reinterpret_cast<__m256i *>(t.codes[u][r]), load256(y.qs));
      t.dy[u][r] = half(y.d);
      if constexpr (std::is_same<A, BlockQ8_1>::value) t.s[u][r] = half(y.s);
    }
  }
}

// The blocks' products of one activation tile (GCC's tile intrinsics take literal numbers).
template <bool kSigned>
void step(const PackedTile &t, int blocks, const Weights &wb) {
#define ELK_AMX_BLOCK(u)                              \
  _tile_zero(u);                                      \
  _tile_loadd(4, t.codes[u], 32);                     \
  _tile_loadd(5, wb.b[u], 64);                        \
  if (kSigned) {                                      \
    _tile_dpbssd(u, 4, 5);                            \
  } else {                                            \
    _tile_dpbsud(u, 4, 5);                            \
  }
  ELK_AMX_BLOCK(0)
  if (blocks > 1) { ELK_AMX_BLOCK(1) }
  if (blocks > 2) { ELK_AMX_BLOCK(2) }
  if (blocks > 3) { ELK_AMX_BLOCK(3) }
#undef ELK_AMX_BLOCK
}

void store(Sums &c) {
  _tile_stored(0, c.c[0], 64);
  if (c.blocks > 1) _tile_stored(1, c.c[1], 64);
  if (c.blocks > 2) _tile_stored(2, c.c[2], 64);
  if (c.blocks > 3) _tile_stored(3, c.c[3], 64);
}

// legacy_block(dx, dy, sum) (+ m * s with the min) per block, added in block order.
template <bool kMin>
void finish(const Sums &c) {
  for (int u = 0; u < c.blocks; ++u) {
    const __m512 dx = _mm512_load_ps(c.weights->dx[u]), m = _mm512_load_ps(c.weights->m[u]);
    for (int i = 0; i < c.count; ++i) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(c.c[u][i]));
      __m512 term = _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(c.tile->dy[u][i])), sum);
      if (kMin) term = _mm512_add_ps(term, _mm512_mul_ps(m, _mm512_set1_ps(c.tile->s[u][i])));
      _mm512_store_ps(c.acc[i], _mm512_add_ps(_mm512_load_ps(c.acc[i]), term));
    }
  }
}

// As the K types' driver, in groups of kGroup blocks (both the packed activations and the
// weights double-buffered: a step's sums are finished after the next step's products).
template <typename W>
void gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
          int64_t nb, float *out, int64_t ldo) {
  using C = Codes<W>;
  using A = typename C::A;
  if (m < kMinRows) {
    const GemmKernels &vnni = *avx512_vnni_gemm_kernels();
    const GemmFn few = std::is_same<W, BlockQ4_0>::value   ? vnni.q4_0
                       : std::is_same<W, BlockQ4_1>::value ? vnni.q4_1
                       : std::is_same<W, BlockQ5_0>::value ? vnni.q5_0
                       : std::is_same<W, BlockQ5_1>::value ? vnni.q5_1
                                                           : vnni.q8_0;
    few(w, ws, n, a, as, m, nb, out, ldo);
    return;
  }
  const auto *wb8 = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  configure_tiles();
  Weights weights[2];
  Sums sums[2];
  PackedTile packed[2][kBlockRows / kRows];
  alignas(64) float acc[kChunk][kBlockRows][kRows];
  for (int64_t i0 = 0; i0 < m; i0 += kBlockRows) {
    const int64_t rows = m - i0 < kBlockRows ? m - i0 : kBlockRows;
    const int count = static_cast<int>((rows + kRows - 1) / kRows);
    const uint8_t *block = ab + i0 * as;
    for (int64_t n0 = 0; n0 < n; n0 += kChunk * kRows) {
      const int chunk = n - n0 > kRows ? kChunk : 1;
      std::memset(acc, 0, sizeof(acc));
      Sums *ready = nullptr;
      int step_count = 0, parity = 0, group = 0;
      for (int64_t g = 0; g < nb; g += kGroup, ++group) {
        const int blocks = static_cast<int>(nb - g < kGroup ? nb - g : kGroup);
        PackedTile *tiles = packed[group & 1];
        pack<A>(block, as, rows, g, blocks, tiles);
        for (int j = 0; j < chunk; ++j) {
          const int64_t first = n0 + j * kRows;
          const int nr = static_cast<int>(n - first < kRows ? n - first : kRows);
          if (g + kGroup < nb) {
            prefetch_block(wb8 + first * ws, ws, nr, (g + kGroup) * sizeof(W), kGroup * sizeof(W));
          }
          Weights &wb = weights[parity];
          parity ^= 1;
          prepare<W>(wb8 + first * ws, ws, nr, g, blocks, wb);
          for (int t = 0; t < count; ++t) {
            Sums &now = sums[step_count++ % 2];
            now.tile = &tiles[t];
            now.weights = &wb;
            now.count = static_cast<int>(rows - t * kRows < kRows ? rows - t * kRows : kRows);
            now.blocks = blocks;
            now.acc = acc[j] + t * kRows;
            step<!C::kMin>(tiles[t], blocks, wb);
            if (ready != nullptr) finish<C::kMin>(*ready);
            store(now);
            ready = &now;
          }
        }
      }
      if (ready != nullptr) finish<C::kMin>(*ready);
      store_sums(acc, chunk, rows, n0, n, out + i0 * ldo, ldo);
    }
  }
  _tile_release();
}

}  // namespace legacy32

}  // namespace

const GemmKernels *amx_gemm_kernels() {
  const GemmKernels &vnni = *avx512_vnni_gemm_kernels();
  static const GemmKernels kernels{
      "amx", gemm<Q45<false>>, gemm<Q45<true>>, gemm<Q6>, vnni.quantize_q8_K,
      legacy32::gemm<BlockQ4_0>, legacy32::gemm<BlockQ4_1>, legacy32::gemm<BlockQ5_0>,
      legacy32::gemm<BlockQ5_1>, legacy32::gemm<BlockQ8_0>, vnni.quantize_q8_0,
      vnni.quantize_q8_1};
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
