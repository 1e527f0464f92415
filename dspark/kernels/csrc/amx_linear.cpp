// linear_bf16: y [M, O] = x [M, I] @ w [O, I]^T (+ b) for M <= kMaxRows rows, through AMX tiles, or
// without AMX through AVX512-BF16 dot products over the same weight copy (avx512bf16_linear.cpp).
// The attention kernels are paged_attention.cpp, amx_attention.cpp and avx512bf16_attention.cpp;
// avx512bf16_decoder_layer.cpp chains them.
//
// A decode step at a small batch streams every weight once, so it runs at the speed a kernel
// reads memory. oneDNN reaches about half of it at one row; AVX-512 dot products reach it at
// one row but fall to half at eight, where they run out of arithmetic. One tile multiply
// (TDPBF16PS) takes up to 16 rows of x against 16 output columns over 32 input columns, so the
// arithmetic is free up to 16 rows; up to four blocks of 16 rows share each weight tile load.
// The weight is stored tile by tile by amx_pack (1 KB each, bf16 pairs interleaved as the
// instruction reads them), one contiguous stream per 16 output columns, prefetched a few tiles
// ahead; the outputs are rounded to bf16 16 at a time. An output depends only on its own row of x: a row
// gives bit-identical results alone or beside fifteen others.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace dspark_cpu {
namespace {

constexpr int64_t kTileRows = 16;        // rows of x per tile, and output columns per tile
constexpr int64_t kTileK = 32;           // input columns per tile (16 bf16 pairs)
constexpr int64_t kTileElems = kTileK * kTileRows;
constexpr int64_t kPrefetchTiles = 4;
constexpr int kMaxRowBlocks = 4;         // blocks of 16 rows a call takes: C tiles 0-3
static_assert(kMaxRowBlocks * kTileRows == kMaxRows);

}  // namespace

// Linux hands out the tile registers per process on request (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_init() {
  constexpr long kReqPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
}

// w [O, I] -> [ceil(O/16), ceil(I/32), 16 pairs, 16 columns, 2] bf16, zero padded.
at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack: a bf16 [O, I] weight expected");
  const int64_t out = w.size(0), in = w.size(1);
  const int64_t ob = (out + kTileRows - 1) / kTileRows, kb = (in + kTileK - 1) / kTileK;
  at::Tensor packed = at::zeros({ob, kb, kTileK / 2, kTileRows, 2}, w.options());
  const at::Tensor wc = w.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, out, 256, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o)
      for (int64_t k = 0; k < in; ++k) {
        const int64_t tile = (o / kTileRows) * kb + k / kTileK, kk = k % kTileK;
        dst[tile * kTileElems + (kk / 2) * kTileRows * 2 + (o % kTileRows) * 2 + kk % 2] = src[o * in + k];
      }
  });
  return packed;
}

namespace {

// Output columns [16 o, 16 o + 16) for all rows of x (padded to whole tiles in xp).
// One block of 16 rows: A (tile 4) against the loaded B (tile 5) into C tile RB (the tile
// intrinsics take their register numbers as literals, hence a macro).
#define DSPARK_ROW_BLOCK(RB)                                                                   \
  do {                                                                                         \
    _tile_loadd(4, xp + (RB) * kTileRows * kb * kTileK + k * kTileK, kb * kTileK * 2);          \
    _tile_dpbf16ps(RB, 4, 5);                                                                  \
  } while (0)

// Output columns [16 o, 16 o + 16) for all rows of x (NRB blocks of 16 rows, padded, in xp):
// each weight tile is loaded once and multiplied into every row block's accumulator.
template <int NRB>
inline void column_tile(const uint16_t* xp, const uint16_t* tiles, int64_t kb, float* c) {
  _tile_zero(0);
  if constexpr (NRB > 1) _tile_zero(1);
  if constexpr (NRB > 2) _tile_zero(2);
  if constexpr (NRB > 3) _tile_zero(3);
  for (int64_t k = 0; k < kb; ++k) {
    const char* ahead = reinterpret_cast<const char*>(tiles + (k + kPrefetchTiles) * kTileElems);
    for (int64_t line = 0; line < kTileElems * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(5, tiles + k * kTileElems, 64);
    DSPARK_ROW_BLOCK(0);
    if constexpr (NRB > 1) DSPARK_ROW_BLOCK(1);
    if constexpr (NRB > 2) DSPARK_ROW_BLOCK(2);
    if constexpr (NRB > 3) DSPARK_ROW_BLOCK(3);
  }
  constexpr int64_t stride = kTileRows * 4, block = kTileRows * kTileRows;
  _tile_stored(0, c, stride);
  if constexpr (NRB > 1) _tile_stored(1, c + block, stride);
  if constexpr (NRB > 2) _tile_stored(2, c + 2 * block, stride);
  if constexpr (NRB > 3) _tile_stored(3, c + 3 * block, stride);
}

using ColumnFn = void (*)(const uint16_t*, const uint16_t*, int64_t, float*);
constexpr ColumnFn kColumnFns[kMaxRowBlocks] = {column_tile<1>, column_tile<2>, column_tile<3>, column_tile<4>};

}  // namespace

void linear_rows(const at::BFloat16* x, int64_t rows, int64_t in, const at::Tensor& packed, int64_t out,
                 const at::BFloat16* bias, at::BFloat16* y, bool amx) {
  if (!amx) return linear_rows_vector(x, rows, in, packed, out, bias, y);
  const int64_t ob = packed.size(0), kb = packed.size(1);
  const int64_t blocks = (rows + kTileRows - 1) / kTileRows;
  // The A tiles read x in place when its rows are whole tiles wide and fill every tile they
  // load (one block is configured to `rows` rows); otherwise from a zero-padded copy.
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  std::vector<uint16_t> xpad;
  if (in != kb * kTileK || (blocks > 1 && rows % kTileRows != 0)) {
    xpad.assign(blocks * kTileRows * kb * kTileK, 0);
    for (int64_t m = 0; m < rows; ++m) std::copy(xs + m * in, xs + (m + 1) * in, xpad.data() + m * kb * kTileK);
  }
  const uint16_t* xp = xpad.empty() ? xs : xpad.data();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  TileConfig cfg;                        // tiles 0-3: C (fp32) per row block, 4: A (x), 5: B (weight pairs)
  const auto block_rows = static_cast<uint8_t>(blocks == 1 ? rows : kTileRows);
  for (int t = 0; t < 5; ++t) cfg.rows[t] = block_rows, cfg.colsb[t] = 64;
  cfg.rows[5] = kTileK / 2;
  cfg.colsb[5] = 64;
  const ColumnFn column = kColumnFns[blocks - 1];
  at::parallel_for(0, ob, 4, [&](int64_t o0, int64_t o1) {
    _tile_loadconfig(&cfg);
    alignas(64) float c[kMaxRowBlocks * kTileRows * kTileRows];
    for (int64_t o = o0; o < o1; ++o) {
      column(xp, wp + o * kb * kTileElems, kb, c);
      const __mmask16 cols = lanes(out - o * kTileRows);
      const __m512 b = bias ? load16(bias + o * kTileRows, cols) : _mm512_setzero_ps();
      for (int64_t m = 0; m < rows; ++m)
        store16(y + m * out + o * kTileRows, _mm512_add_ps(_mm512_load_ps(c + m * kTileRows), b), cols);
    }
    _tile_release();
  });
}

void check_linear(const at::Tensor& packed, int64_t rows, int64_t in, int64_t out, const char* what) {
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, what, ": x of 1 to ", kMaxRows, " bf16 rows expected, got ", rows);
  TORCH_CHECK(packed.dim() == 5 && packed.size(1) == (in + kTileK - 1) / kTileK &&
              packed.size(0) == (out + kTileRows - 1) / kTileRows && packed.scalar_type() == at::kBFloat16 &&
              packed.is_contiguous(),
              what, ": the packed weight does not fit x [", rows, ", ", in, "] and ", out, " outputs");
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out,
                       const c10::optional<at::Tensor>& bias, bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "linear_bf16: x of 1 to ", kMaxRows, " bf16 rows expected, got ", x.sizes(), " ", x.scalar_type());
  check_linear(packed, x.size(0), x.size(1), out, "linear_bf16");
  TORCH_CHECK(!bias.has_value() || !bias->defined() || (bias->numel() == out && bias->scalar_type() == at::kBFloat16),
              "linear_bf16: a bf16 bias of ", out, " expected");
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) bc = bias->contiguous();
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  linear_rows(xc.data_ptr<at::BFloat16>(), x.size(0), x.size(1), packed, out,
              bc.defined() ? bc.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), amx);
  return y;
}

}  // namespace dspark_cpu
