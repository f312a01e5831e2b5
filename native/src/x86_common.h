// x86 helpers shared by the AVX2 and AVX-512 kernel files (avx2.cpp, avx512.cpp). Each file
// includes this header and compiles it with its own flags: everything here sits in an
// anonymous namespace, so no AVX-512 copy of a helper can be linked into the AVX2 path
// (inline functions with external linkage would be merged across the two files).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

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
  return k_block_lanes(d, dmin, dy, _mm_cvtepi32_ps(dots), _mm_cvtepi32_ps(mins));
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
// The same lines kL2Ahead bytes further go to L2 only: a farther lead without holding L1's
// miss buffers (a GEMV step of the llama3-1b shape on Zen 4: 24.7-25.6 -> 22.5 ms; 64 KB
// ahead 23.9; a second L1 stream a tile further, or the next tile in half the blocks, was
// slower: 33-37 ms). A prefetch never faults, past the weights too.
constexpr size_t kL2Ahead = 16384;
inline void prefetch_lines(const uint8_t *p, size_t bytes) {
  for (size_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char *>(p) + line, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char *>(p) + line + kL2Ahead, _MM_HINT_T1);
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

// The K types' register tiles as GEMV and GEMM: an ISA's file gives its Tile<MR, NR> and its
// tile shapes (Shape::kGemvRows weight rows against one activation row; Shape::kBatchRows x
// Shape::kBatchCols for batches; 2 x 4 and 3 x kBatchCols for the rest).
template <int GemvRows, int BatchRows, int BatchCols>
struct TileShape {
  static constexpr int kGemvRows = GemvRows, kBatchRows = BatchRows, kBatchCols = BatchCols;
  template <int MR>
  static constexpr int cols() {
    return MR == 1 ? kGemvRows : MR == 2 ? 4 : kBatchCols;
  }
};

// An MR x nr tile, nr <= cols<MR>() <= 4.
template <template <int, int> class Tile, class Shape, int MR>
void run_tile(int nr, const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
              float *out, int64_t ldo, const uint8_t *prefetch) {
  constexpr int C = Shape::template cols<MR>();
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
template <template <int, int> class Tile, class Shape, int MR>
void tile_rows(const uint8_t *wb, size_t ws, int64_t n, const uint8_t *a, size_t as,
               int64_t nb, float *out, int64_t ldo) {
  constexpr int C = Shape::template cols<MR>();
  for (int64_t j = 0; j < n;) {
    const int nr = n - j < C ? static_cast<int>(n - j) : C;
    // The next tile's rows follow these (past n: the next call's, likely; a prefetch never
    // faults).
    run_tile<Tile, Shape, MR>(nr, wb + j * ws, ws, a, as, nb, out + j, ldo, wb + (j + nr) * ws);
    j += nr;
  }
}

// The Q8_K codes of m activation rows (row stride as, nb blocks) + 128 as unsigned bytes, 256
// a block, row i at i * nb * 256: the Q6_K panels read them against signed codes - 32. The
// buffer is this thread's, reused by its next call.
inline const uint8_t *codes_plus_128(const uint8_t *a, size_t as, int64_t m, int64_t nb) {
  thread_local std::vector<uint8_t> codes;
  const size_t row = static_cast<size_t>(nb) * QK_K;
  codes.resize(static_cast<size_t>(m) * row);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const auto *y = reinterpret_cast<const BlockQ8_K *>(a + i * as) + b;
      uint8_t *dst = codes.data() + i * row + b * QK_K;
      for (int c = 0; c < QK_K / 32; ++c) {
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + 32 * c),
                            _mm256_xor_si256(load256(y->qs + 32 * c), flip));
      }
    }
  }
  return codes.data();
}

// The running sums of a tile's activation rows over the blocks: one vector of a panel's
// columns a row (__m256: 8 columns, __m512: 16).
inline void zero_sums(__m256 &v) { v = _mm256_setzero_ps(); }
inline void load_sums(const float *p, __m256 &v) { v = _mm256_loadu_ps(p); }
inline void store_sums(float *p, const __m256 &v) { _mm256_storeu_ps(p, v); }
#ifdef __AVX512F__
inline void zero_sums(__m512 &v) { v = _mm512_setzero_ps(); }
inline void load_sums(const float *p, __m512 &v) { v = _mm512_loadu_ps(p); }
inline void store_sums(float *p, const __m512 &v) { _mm512_storeu_ps(p, v); }
#endif

// Block b's terms of the MR activation rows from i, added to their sums in out (block 0
// starts them from 0, as the reference's sum does).
template <int MR, typename Acc, typename Panel, typename Terms>
inline void tile_in_memory(const Panel &p, Terms &terms, int64_t i, int64_t b, float *out,
                           int64_t ldo) {
  // The terms first, then the sums from out: loaded before them, each waited on the store
  // of the previous block (0.8x at 64 rows on Zen 4). 0 + term is term, and a running sum
  // is never -0, so before + (0 + term) has the bits of before + term.
  Acc term[MR];
  for (int r = 0; r < MR; ++r) zero_sums(term[r]);
  terms(std::integral_constant<int, MR>{}, p, i, b, term);
  for (int r = 0; r < MR; ++r) {
    Acc before;
    if (b == 0) {
      zero_sums(before);
    } else {
      load_sums(out + (i + r) * ldo, before);
    }
    store_sums(out + (i + r) * ldo, before + term[r]);
  }
}

// A panel times all MR (<= 4) activation rows, block after block with the sums in registers:
// a sum that goes through memory every block waits on the store it loads from each time
// (single-thread on Zen 4, legacy types at 2-4 rows: 1.13-1.28x faster in registers; the K
// types, with 8x the work a block, about the same).
template <int MR, typename Acc, typename Panel, typename Repack, typename Terms>
inline void panel_in_registers(const uint8_t *rows, const uint8_t *next, size_t slice,
                               int64_t nb, float *out, int64_t ldo, Repack &repack,
                               Terms &terms) {
  Panel p;  // a local of its own: the compiler keeps it in registers
  Acc sum[MR];
  for (int r = 0; r < MR; ++r) zero_sums(sum[r]);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_lines(next + b * slice, slice);
    repack(rows, b, p);
    terms(std::integral_constant<int, MR>{}, p, 0, b, sum);
  }
  for (int r = 0; r < MR; ++r) store_sums(out + r * ldo, sum[r]);
}

// The loop of the interleaved batch kernels (avx512.cpp, avx2.cpp): for each panel of Rows
// weight rows and each block b in order, repack(panel's first row, b, panel), then
// terms(mr, panel, i, b, sum) adds block b's terms of the activation rows i .. i + mr - 1 (mr: a
// std::integral_constant, 1..4) to their sums (Acc: one vector of the panel's Rows columns a
// row). Up to 4 activation rows stay in registers over the blocks; more go in tiles of 4 and
// the 0..3 rows left, their sums kept in out between blocks (each block's repack is shared by
// all of them). The columns after the last whole panel go to rest(first column). The next
// panel's rows are prefetched a slice a block (one stream ahead, as the row-major tiles:
// without it the panels lost to them in the model).
template <int Rows, typename Panel, typename Acc, typename Repack, typename Terms, typename Rest>
void run_panels(const uint8_t *w, size_t ws, int64_t n, int64_t m, int64_t nb, float *out,
                int64_t ldo, Repack &&repack, Terms &&terms, Rest &&rest) {
  const int64_t panels = n / Rows * Rows;
  const size_t slice = prefetch_slice(Rows * ws, nb);
  Panel p;
  for (int64_t j = 0; j < panels; j += Rows) {
    const uint8_t *rows = w + j * ws, *next = w + (j + Rows) * ws;
    float *o = out + j;
    if (m <= 4) {
      const auto tile = [&](auto mr) {
        panel_in_registers<decltype(mr)::value, Acc, Panel>(rows, next, slice, nb, o, ldo,
                                                            repack, terms);
      };
      switch (m) {
        case 4: tile(std::integral_constant<int, 4>{}); break;
        case 3: tile(std::integral_constant<int, 3>{}); break;
        case 2: tile(std::integral_constant<int, 2>{}); break;
        default: tile(std::integral_constant<int, 1>{}); break;
      }
      continue;
    }
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_lines(next + b * slice, slice);
      repack(rows, b, p);
      int64_t i = 0;
      for (; i + 4 <= m; i += 4) tile_in_memory<4, Acc>(p, terms, i, b, o, ldo);
      switch (m - i) {
        case 3: tile_in_memory<3, Acc>(p, terms, i, b, o, ldo); break;
        case 2: tile_in_memory<2, Acc>(p, terms, i, b, o, ldo); break;
        case 1: tile_in_memory<1, Acc>(p, terms, i, b, o, ldo); break;
        default: break;
      }
    }
  }
  if (panels < n) rest(panels);
}

// The Q6_K batch kernels' driver (avx2.cpp, avx512.cpp): the activations' codes + 128 once a
// call, then run_panels with the ISA's repack (rows, ws, b, panel) and its panel rows
// (mr, panel, y, u, sum: y[r] the Q8_K block b of activation row i + r, u[r] its 256 codes +
// 128); the columns past the last panel go to row_major (a GemmFn).
template <int Rows, typename Panel, typename Repack, typename PanelRows>
void q6_panels(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
               int64_t nb, float *out, int64_t ldo, Repack &&repack, PanelRows &&panel_rows,
               GemmFn row_major) {
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  const size_t us = static_cast<size_t>(nb) * QK_K;
  const uint8_t *u = codes_plus_128(ab, as, m, nb);
  run_panels<Rows, Panel, __m256>(
      wb, ws, n, m, nb, out, ldo,
      [&](const uint8_t *rows, int64_t b, Panel &p) { repack(rows, ws, b, p); },
      [&](auto mr, const Panel &p, int64_t i, int64_t b, __m256 *sum) {
        constexpr int MR = decltype(mr)::value;
        const BlockQ8_K *y[MR];
        const uint8_t *ub[MR];
        for (int r = 0; r < MR; ++r) {
          y[r] = reinterpret_cast<const BlockQ8_K *>(ab + (i + r) * as) + b;
          ub[r] = u + (i + r) * us + b * QK_K;
        }
        panel_rows(mr, p, y, ub, sum);
      },
      [&](int64_t first) {
        row_major(wb + first * ws, ws, n - first, a, as, m, nb, out + first, ldo);
      });
}

template <template <int, int> class Tile, class Shape>
void tiled_gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
                int64_t nb, float *out, int64_t ldo) {
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  constexpr int R = Shape::kBatchRows;
  int64_t i = 0;
  for (; i + R <= m; i += R) {
    tile_rows<Tile, Shape, R>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
  }
  // 3 rows in one pass (a speculative verify of 2 drafts), not 2 + 1.
  if (R > 3 && m - i == 3) {
    tile_rows<Tile, Shape, 3>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
    i += 3;
  }
  for (; i + 2 <= m; i += 2) {
    tile_rows<Tile, Shape, 2>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
  }
  if (i < m) tile_rows<Tile, Shape, 1>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
}

// The single-row dots are the 1 x 1 tiles: one code path for every shape. They prefetch the
// row after theirs, the next one a caller looping over rows reads.
template <template <int, int> class Tile, typename Block>
float tiled_dot(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *w = static_cast<const uint8_t *>(vx);
  float out;
  Tile<1, 1>::run(w, 0, reinterpret_cast<const uint8_t *>(y), 0, nb, &out, 1,
                  w + nb * sizeof(Block));
  return out;
}


// ---- legacy types (blocks of 32 weights) ----------------------------------------------------
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

// Per weight type: its activation blocks, whether its weights are signed (code - offset) or
// unsigned (Q4_1/Q5_1, whose min is a float term), whether it has a min, and its 32 weights as
// bytes (avx2.cpp's legacy tiles, amx.cpp's B tiles).
template <typename W>
struct Codes;
template <>
struct Codes<BlockQ4_0> {
  using A = BlockQ8_0;
  static constexpr bool kSigned = true, kMin = false;
  static __m256i codes(const BlockQ4_0 &x) {
    return _mm256_sub_epi8(nibbles(x.qs), _mm256_set1_epi8(8));
  }
};
template <>
struct Codes<BlockQ4_1> {
  using A = BlockQ8_1;
  static constexpr bool kSigned = false, kMin = true;
  static __m256i codes(const BlockQ4_1 &x) { return nibbles(x.qs); }
};
template <>
struct Codes<BlockQ5_0> {
  using A = BlockQ8_0;
  static constexpr bool kSigned = true, kMin = false;
  static __m256i codes(const BlockQ5_0 &x) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles(x.qs), high_bits(x.qh)),
                           _mm256_set1_epi8(16));
  }
};
template <>
struct Codes<BlockQ5_1> {
  using A = BlockQ8_1;
  static constexpr bool kSigned = false, kMin = true;
  static __m256i codes(const BlockQ5_1 &x) {
    return _mm256_or_si256(nibbles(x.qs), high_bits(x.qh));
  }
};
template <>
struct Codes<BlockQ8_0> {
  using A = BlockQ8_0;
  static constexpr bool kSigned = true, kMin = false;
  static __m256i codes(const BlockQ8_0 &x) { return load256(x.qs); }
};

// Per weight type, for kernels that read the codes unsigned (vpdpbusd / maddubs against signed
// activations: the interleaved panels, avx512.cpp's tiles): its activation blocks, whether it
// has a min, its codes' offset (the weight is code - offset) and its 32 codes as bytes.
template <typename W>
struct Unsigned;
template <>
struct Unsigned<BlockQ4_0> {
  using A = BlockQ8_0;
  static constexpr bool kMin = false;
  static constexpr uint8_t kOffset = 8;
  static __m256i codes(const BlockQ4_0 &x) { return nibbles(x.qs); }
};
template <>
struct Unsigned<BlockQ4_1> {
  using A = BlockQ8_1;
  static constexpr bool kMin = true;
  static constexpr uint8_t kOffset = 0;
  static __m256i codes(const BlockQ4_1 &x) { return nibbles(x.qs); }
};
template <>
struct Unsigned<BlockQ5_0> {
  using A = BlockQ8_0;
  static constexpr bool kMin = false;
  static constexpr uint8_t kOffset = 16;
  static __m256i codes(const BlockQ5_0 &x) {
    return _mm256_or_si256(nibbles(x.qs), high_bits(x.qh));
  }
};
template <>
struct Unsigned<BlockQ5_1> {
  using A = BlockQ8_1;
  static constexpr bool kMin = true;
  static constexpr uint8_t kOffset = 0;
  static __m256i codes(const BlockQ5_1 &x) {
    return _mm256_or_si256(nibbles(x.qs), high_bits(x.qh));
  }
};
template <>
struct Unsigned<BlockQ8_0> {
  using A = BlockQ8_0;
  static constexpr bool kMin = false;
  static constexpr uint8_t kOffset = 128;  // int8 w as the byte w + 128
  static __m256i codes(const BlockQ8_0 &x) {
    return _mm256_xor_si256(load256(x.qs), _mm256_set1_epi8(static_cast<char>(0x80)));
  }
};

// Per activation row and block of a call, what the panels need besides the codes: its scale,
// (Q8_1) s, and -offset * (sum of its codes), which starts the block's integer sum.
struct ActivationTerms {
  float dy, s;
  int32_t start;
};

// The terms of m activation rows (A: Q8_0 or Q8_1 blocks, row stride as) for codes read with
// `offset`: row i's block b at [i * nb + b]. The buffer is this thread's, reused by its next
// call.
template <typename A>
inline const ActivationTerms *activation_terms(const uint8_t *a, size_t as, int64_t m,
                                               int64_t nb, int offset) {
  constexpr bool kS = std::is_same<A, BlockQ8_1>::value;
  thread_local std::vector<ActivationTerms> terms;
  terms.resize(static_cast<size_t>(m * nb));
  for (int64_t i = 0; i < m; ++i) {
    const A *y = reinterpret_cast<const A *>(a + i * as);
    for (int64_t b = 0; b < nb; ++b) {
      int32_t sum = 0;
      for (int k = 0; k < QK; ++k) sum += y[b].qs[k];
      float s = 0.0f;
      if (kS) {
        uint16_t half;
        std::memcpy(&half, reinterpret_cast<const uint8_t *>(&y[b]) + 2, sizeof(half));
        s = fp16_to_fp32(half);
      }
      terms[i * nb + b] = {fp16_to_fp32(y[b].d), s, -offset * sum};
    }
  }
  return terms.data();
}

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

// The fp16 scales of block b of a tile's MR activation rows and NR weight rows (with the
// mins' terms where kMin), and the float term of a group of 8 elements from their exact
// integer sums: kernels.h's legacy_block(_min) lane by lane, shared by every x86 legacy tile.
template <bool kMin, int MR, int NR>
struct BlockScales {
  uint16_t xd[8], yd[8], xm[8], ys[8];

  template <typename W, typename A>
  BlockScales(const W *const *x, const A *const *y, int64_t b) {
    for (int j = 0; j < NR; ++j) xd[j] = x[j][b].d;
    for (int i = 0; i < MR; ++i) yd[i] = y[i][b].d;
    if constexpr (kMin) {
      for (int j = 0; j < NR; ++j) xm[j] = x[j][b].m;
      for (int i = 0; i < MR; ++i) ys[i] = y[i][b].s;
    }
  }

  // Group g's 8 terms (lanes past the tile compute on zero sums and are never stored).
  __m256 terms(int g, __m256 sums) const {
    using L = Tile8<MR, NR>;
    auto by_j = [&](int l) { return L::j(g, l); };
    auto by_i = [&](int l) { return L::i(g, l); };
    const __m256 dx = spread(halves8(xd, NR), by_j), dy = spread(halves8(yd, MR), by_i);
    if constexpr (kMin) {
      return legacy_block_min(dx, dy, sums, spread(halves8(xm, NR), by_j),
                              spread(halves8(ys, MR), by_i));
    } else {
      return legacy_block(dx, dy, sums);
    }
  }
};

// The totals of 8 vectors of 8 int32, lane j = the sum of v[j]'s lanes.
inline __m256i totals(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),
                                      _mm256_hadd_epi32(v[2], v[3]));  // v0..v3 | v0..v3
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]),
                                      _mm256_hadd_epi32(v[6], v[7]));  // v4..v7 | v4..v7
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// Legacy tile shapes: 1 x GemvCols for a GEMV row, BatchRows x BatchCols for batches, then
// 4 x BatchCols, 2 x 4 and 1 x GemvCols for the rows left; any narrower NR at the right edge.
template <int GemvCols, int BatchRows, int BatchCols>
struct Shape {
  static constexpr int kRows = BatchRows;
  template <int MR>
  static constexpr int cols() {
    return MR == 1 ? GemvCols : MR == 2 ? 4 : BatchCols;
  }
};

// An MR x nr tile of an ISA's Tile<W, MR, NR>::run, nr <= cols<MR>() <= 8.
template <template <typename, int, int> class Tile, class S, typename W, int MR>
void run(int nr, const uint8_t *w, size_t ws, const uint8_t *a, size_t as, int64_t nb,
         float *out, int64_t ldo, const uint8_t *prefetch) {
  constexpr int C = S::template cols<MR>();
  static_assert(C >= 1 && C <= 8, "tiles of 1..8 weight rows");
  switch (nr) {
    case 1: Tile<W, MR, 1>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 2: Tile<W, MR, (C < 2 ? C : 2)>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 3: Tile<W, MR, (C < 3 ? C : 3)>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 4: Tile<W, MR, (C < 4 ? C : 4)>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 5: Tile<W, MR, (C < 5 ? C : 5)>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 6: Tile<W, MR, (C < 6 ? C : 6)>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    case 7: Tile<W, MR, (C < 7 ? C : 7)>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
    default: Tile<W, MR, (C < 8 ? C : 8)>::run(w, ws, a, as, nb, out, ldo, prefetch); break;
  }
}

template <template <typename, int, int> class Tile, class S, typename W, int MR>
void rows(const uint8_t *wb, size_t ws, int64_t n, const uint8_t *a, size_t as, int64_t nb,
          float *out, int64_t ldo) {
  constexpr int C = S::template cols<MR>();
  for (int64_t j = 0; j < n;) {
    const int nr = n - j < C ? static_cast<int>(n - j) : C;
    run<Tile, S, W, MR>(nr, wb + j * ws, ws, a, as, nb, out + j, ldo, wb + (j + nr) * ws);
    j += nr;
  }
}

template <template <typename, int, int> class Tile, class S, typename W>
void tiled_gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
                int64_t nb, float *out, int64_t ldo) {
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  int64_t i = 0;
  for (; i + S::kRows <= m; i += S::kRows) {
    rows<Tile, S, W, S::kRows>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
  }
  // The few rows of a speculative verify pass in one pass over the weights where possible.
  if (S::kRows > 4 && m - i >= 4) {
    rows<Tile, S, W, 4>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
    i += 4;
  }
  for (; i + 2 <= m; i += 2) {
    rows<Tile, S, W, 2>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
  }
  if (i < m) rows<Tile, S, W, 1>(wb, ws, n, ab + i * as, as, nb, out + i * ldo, ldo);
}

}  // namespace legacy

// ---- int8 dots (attention_i8): signed x signed through the unsigned x signed instructions,
// which take |a| and b with a's sign (vpsignb), whose products are a x b; maddubs' pair sums
// stay below 2 x 127 x 127 < 2^15. Four keys a pass share each query load; the tail bytes and
// the last keys take the scalar loop (the same exact sums).
inline void i8_sum4(__m256i s0, __m256i s1, __m256i s2, __m256i s3, int32_t *out) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
  const __m128i r = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i *>(out), r);
}

// Madd(acc, |a|, a, b): acc + the 8 int32 partial sums of a[0..31] x b[0..31].
template <typename Madd>
inline void i8_dots_x86(Madd madd, const int8_t *a, const int8_t *b, int64_t n, int64_t count,
                        int32_t *out) {
  const int64_t body = n & ~int64_t{31};
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const int8_t *k = b + j * n;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < body; i += 32) {
      const __m256i x = load256(a + i), ax = _mm256_sign_epi8(x, x);
      s0 = madd(s0, ax, x, load256(k + i));
      s1 = madd(s1, ax, x, load256(k + n + i));
      s2 = madd(s2, ax, x, load256(k + 2 * n + i));
      s3 = madd(s3, ax, x, load256(k + 3 * n + i));
    }
    i8_sum4(s0, s1, s2, s3, out + j);
    for (int64_t i = body; i < n; ++i) {
      for (int r = 0; r < 4; ++r) out[j + r] += static_cast<int32_t>(a[i]) * k[r * n + i];
    }
  }
  i8_dots_scalar(a, b + j * n, n, count - j, out + j);
}

// LoRA pairs (lora.cpp) widen as they load: F16C or a 16-bit shift, both exact, so the sums
// see the reference's float32 values.
template <int T>
inline __m256 lora_load8(const void *p, int64_t i) {
  if constexpr (T == ELK_LORA_F16) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(p) + i)));
  } else if constexpr (T == ELK_LORA_BF16) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float *>(p) + i);
  }
}

}  // namespace
}  // namespace elk
