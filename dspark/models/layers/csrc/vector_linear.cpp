// The projection of linear_rows on CPUs without AMX: AVX512-BF16 dot products over the same
// tile-by-tile weight copy (amx_pack).
//
// A tile row of that copy holds, for one pair of input columns (2k, 2k+1), the 16 output columns'
// weights side by side: exactly the B operand of VDPBF16PS when the A operand is x's pair
// (x[2k], x[2k+1]) broadcast to every lane. So each 64-byte weight load feeds one dot-product
// instruction per row of x and no horizontal sum is ever needed: at one row the loop streams
// the weight at the machine's read speed (oneDNN reaches about two thirds of it), and up to eight
// rows share each load before the arithmetic, not the memory, sets the pace. More rows go eight
// at a time over a column tile that is then in cache. A row's sum runs over the input columns
// in one fixed order whatever the other rows are, so a row gives the same bits alone or in a
// verify block.
#include "cpu_kernels.h"

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

// Sums [NR, 16] of rows x[0..NR) (as bf16 pairs, `stride` words apart) over kb tiles of one
// column tile, into c (NR x 16 fp32).
template <int NR>
void column_rows(const uint32_t* x, int64_t stride, const uint32_t* tiles, int64_t kb, float* c) {
  __m512 even[NR], odd[NR];              // two sums per row: the chain of one would wait on each add
  for (int r = 0; r < NR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kb; ++k) {
    const uint32_t* t = tiles + k * kTileWords;
    const char* ahead = reinterpret_cast<const char*>(t + 4 * kTileWords);
    for (int64_t line = 0; line < kTileWords * 4; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    for (int64_t p = 0; p < kPairs; p += 2) {
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
  at::parallel_for(0, ob, 4, [&](int64_t o0, int64_t o1) {
    alignas(64) float c[kMaxChunk * kColumns];
    for (int64_t o = o0; o < o1; ++o) {
      const __mmask16 cols = lanes(out - o * kColumns);
      const __m512 b = bias ? load16(bias + o * kColumns, cols) : _mm512_setzero_ps();
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxChunk) {
        const int64_t n = std::min<int64_t>(kMaxChunk, rows - m0);
        kRowsFns[n - 1](xs + m0 * width, width, wp + o * kb * kTileWords, kb, c);
        for (int64_t r = 0; r < n; ++r)
          store16(y + (m0 + r) * out + o * kColumns, _mm512_add_ps(_mm512_load_ps(c + r * kColumns), b), cols);
      }
    }
  });
}

}  // namespace dspark_cpu
