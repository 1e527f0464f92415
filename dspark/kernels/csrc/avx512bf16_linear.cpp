// The projection of linear_rows on CPUs without AMX: AVX512-BF16 dot products over the same
// tile-by-tile weight copy (amx_pack).
//
// A tile row of that copy holds, for one pair of input columns (2k, 2k+1), the 16 output columns'
// weights side by side: exactly the B operand of VDPBF16PS when the A operand is x's pair
// (x[2k], x[2k+1]) broadcast to every lane. So each 64-byte weight load feeds one dot-product
// instruction per row of x and no horizontal sum is ever needed: at one row the loop streams
// the weight at the machine's read speed (oneDNN reaches about two thirds of it), and up to eight
// rows share each load before the arithmetic, not the memory, sets the pace. More rows go six at
// a time over two column tiles (each broadcast of x feeds both), which keeps a layer's
// projections level with oneDNN up to 64 rows. A row's sum runs over the input columns in one
// fixed order whatever the other rows are, so a row gives the same bits alone or in a verify
// block.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

namespace dspark_cpu {
namespace {

constexpr int64_t kColumns = 16;         // output columns per tile (one register of fp32 sums)
constexpr int64_t kPairs = 16;           // input pairs per tile
constexpr int64_t kTileWords = kPairs * kColumns;   // 32-bit words (bf16 pairs) per tile
constexpr int kMaxChunk = 8;             // rows whose sums stay in registers
constexpr int64_t kAhead = 8;            // tiles prefetched ahead

// Into L2, the two cache lines of a tile that pair step p (of kPairs / 2) reads, `ahead` being
// that tile's start. Spread over the tile's steps rather than issued at its start: with a burst
// of 16 prefetches into L1 per tile, the weight stream and the dot products of a few rows took
// turns (on a 2-core Zen 4 a 30-layer chain of SmolLM2's projections took 1.4x its one-row
// time at 8 rows; spread into L2, 1.0-1.1x, and the one-row time fell too).
inline void prefetch_pair_lines(const char* ahead, int64_t p) {
  _mm_prefetch(ahead + p * 64, _MM_HINT_T1);
  _mm_prefetch(ahead + p * 64 + 64, _MM_HINT_T1);
}

// Sums [NR, 16] of rows x[0..NR) (as bf16 pairs, `stride` words apart) over kb tiles of one
// column tile, into c (NR x 16 fp32).
template <int NR>
void column_rows(const uint32_t* x, int64_t stride, const uint32_t* tiles, int64_t kb, float* c) {
  __m512 even[NR], odd[NR];              // two sums per row: the chain of one would wait on each add
  for (int r = 0; r < NR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kb; ++k) {
    const uint32_t* t = tiles + k * kTileWords;
    const char* ahead = reinterpret_cast<const char*>(t + kAhead * kTileWords);
    for (int64_t p = 0; p < kPairs; p += 2) {
      prefetch_pair_lines(ahead, p);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(t + p * kColumns);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(t + (p + 1) * kColumns);
      for (int r = 0; r < NR; ++r) {
        const uint32_t* xr = x + r * stride + k * kPairs + p;
        even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(xr[0]), w0);
        odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(xr[1]), w1);
      }
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(c + r * kColumns, _mm512_add_ps(even[r], odd[r]));
}

using RowsFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*);
constexpr RowsFn kRowsFns[kMaxChunk] = {column_rows<1>, column_rows<2>, column_rows<3>, column_rows<4>,
                                        column_rows<5>, column_rows<6>, column_rows<7>, column_rows<8>};

constexpr int kWideChunk = 6;            // rows of column_pair_rows: 4 sums each in registers

// column_rows for two column tiles at once (ta, tb): each broadcast pair of x feeds both, so a
// step of many rows loads a third fewer operands per instruction. Each output sums its pairs in
// the same order as column_rows (even and odd pairs apart), so the bits are the same.
template <int NR>
void column_pair_rows(const uint32_t* x, int64_t stride, const uint32_t* ta, const uint32_t* tb, int64_t kb,
                      float* ca, float* cb) {
  __m512 ea[NR], oa[NR], eb[NR], ob[NR];
  for (int r = 0; r < NR; ++r) ea[r] = oa[r] = eb[r] = ob[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kb; ++k) {
    const uint32_t *a = ta + k * kTileWords, *b = tb + k * kTileWords;
    for (int64_t p = 0; p < kPairs; p += 2) {
      prefetch_pair_lines(reinterpret_cast<const char*>(a + kAhead * kTileWords), p);
      prefetch_pair_lines(reinterpret_cast<const char*>(b + kAhead * kTileWords), p);
      const __m512bh a0 = (__m512bh)_mm512_loadu_si512(a + p * kColumns);
      const __m512bh a1 = (__m512bh)_mm512_loadu_si512(a + (p + 1) * kColumns);
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * kColumns);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + (p + 1) * kColumns);
      for (int r = 0; r < NR; ++r) {
        const uint32_t* xr = x + r * stride + k * kPairs + p;
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(xr[0]), x1 = (__m512bh)_mm512_set1_epi32(xr[1]);
        ea[r] = _mm512_dpbf16_ps(ea[r], x0, a0);
        oa[r] = _mm512_dpbf16_ps(oa[r], x1, a1);
        eb[r] = _mm512_dpbf16_ps(eb[r], x0, b0);
        ob[r] = _mm512_dpbf16_ps(ob[r], x1, b1);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm512_storeu_ps(ca + r * kColumns, _mm512_add_ps(ea[r], oa[r]));
    _mm512_storeu_ps(cb + r * kColumns, _mm512_add_ps(eb[r], ob[r]));
  }
}

using PairRowsFn = void (*)(const uint32_t*, int64_t, const uint32_t*, const uint32_t*, int64_t, float*, float*);
constexpr PairRowsFn kPairRowsFns[kWideChunk] = {column_pair_rows<1>, column_pair_rows<2>, column_pair_rows<3>,
                                                 column_pair_rows<4>, column_pair_rows<5>, column_pair_rows<6>};

// Outputs [o, o + 16 * n) (n = 1 or 2 column tiles) for rows [0, rows) of xs.
void columns(const uint32_t* xs, int64_t rows, int64_t width, const uint32_t* wp, int64_t kb, int64_t o, int n,
             int64_t out, const at::BFloat16* bias, at::BFloat16* y) {
  alignas(64) float c[2][kMaxChunk * kColumns];
  const int64_t chunk = n == 2 ? kWideChunk : kMaxChunk;
  for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
    const int64_t m = std::min<int64_t>(chunk, rows - m0);
    const uint32_t* t = wp + o * kb * kTileWords;
    if (n == 2)
      kPairRowsFns[m - 1](xs + m0 * width, width, t, t + kb * kTileWords, kb, c[0], c[1]);
    else
      kRowsFns[m - 1](xs + m0 * width, width, t, kb, c[0]);
    for (int j = 0; j < n; ++j) {
      const int64_t col = (o + j) * kColumns;
      const __mmask16 cols = lanes(out - col);
      const __m512 b = bias ? load16(bias + col, cols) : _mm512_setzero_ps();
      for (int64_t r = 0; r < m; ++r)
        store16(y + (m0 + r) * out + col, _mm512_add_ps(_mm512_load_ps(c[j] + r * kColumns), b), cols);
    }
  }
}

}  // namespace

void linear_rows_vector(const at::BFloat16* x, int64_t rows, int64_t in, const at::Tensor& packed, int64_t out,
                        const at::BFloat16* bias, at::BFloat16* y) {
  const int64_t ob = packed.size(0), kb = packed.size(1), width = kb * kPairs;   // x row in pairs
  // x is read in place as bf16 pairs when its rows fill whole tiles; else a zero-padded copy
  // (the packed weight is zero past `in`, but 0 x garbage could be NaN).
  std::vector<uint32_t> xpad;
  const auto* xs = reinterpret_cast<const uint32_t*>(x);
  if (in != width * 2) {
    xpad.assign(rows * width, 0);
    for (int64_t m = 0; m < rows; ++m) std::memcpy(xpad.data() + m * width, x + m * in, in * sizeof(at::BFloat16));
    xs = xpad.data();
  }
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  // A few rows stream one column tile at a time; more rows take two at a time (same bits).
  const bool wide = rows > kMaxChunk;
  at::parallel_for(0, ob, 4, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1;) {
      const int n = wide && o + 1 < o1 ? 2 : 1;
      columns(xs, rows, width, wp, kb, o, n, out, bias, y);
      o += n;
    }
  });
}

}  // namespace dspark_cpu
