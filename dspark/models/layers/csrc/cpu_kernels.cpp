// dspark's CPU kernels: the two parts of a bf16 decode or verify step that torch's own kernels
// leave far from the machine's speed at small batches.
//
// amx_linear: y [M, O] = x [M, I] @ w [O, I]^T (+ b) for M <= 64 rows, through AMX tiles.
//
// A decode step at a small batch streams every weight once, so it runs at the speed a kernel
// reads memory. oneDNN reaches about half of it at one row; AVX-512 dot products reach it at
// one row but fall to half at eight, where they run out of arithmetic. One tile multiply
// (TDPBF16PS) takes up to 16 rows of x against 16 output columns over 32 input columns, so the
// arithmetic is free up to 16 rows; up to four blocks of 16 rows share each weight tile load. The weight is stored tile by tile by amx_pack (1 KB each,
// bf16 pairs interleaved as the instruction reads them), one contiguous stream per 16 output
// columns, prefetched a few tiles ahead. An output depends only on its own row of x: a row
// gives bit-identical results alone or beside fifteen others.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
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

struct TileConfig {                      // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

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
                 const at::BFloat16* bias, at::BFloat16* y) {
  const int64_t ob = packed.size(0), kb = packed.size(1);
  const int64_t blocks = (rows + kTileRows - 1) / kTileRows;
  std::vector<uint16_t> xpad(blocks * kTileRows * kb * kTileK, 0);   // whole tiles, zero padded
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  for (int64_t m = 0; m < rows; ++m) std::copy(xs + m * in, xs + (m + 1) * in, xpad.data() + m * kb * kTileK);
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
      column(xpad.data(), wp + o * kb * kTileElems, kb, c);
      const int64_t cols = std::min(kTileRows, out - o * kTileRows);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < cols; ++j)
          y[m * out + o * kTileRows + j] =
              at::BFloat16(c[m * kTileRows + j] + (bias ? static_cast<float>(bias[o * kTileRows + j]) : 0.0f));
    }
    _tile_release();
  });
}

void check_linear(const at::Tensor& packed, int64_t rows, int64_t in, int64_t out, const char* what) {
  TORCH_CHECK(rows >= 1 && rows <= kMaxRowBlocks * kTileRows, what, ": x of 1 to 64 bf16 rows expected, got ", rows);
  TORCH_CHECK(packed.dim() == 5 && packed.size(1) == (in + kTileK - 1) / kTileK &&
              packed.size(0) == (out + kTileRows - 1) / kTileRows && packed.scalar_type() == at::kBFloat16 &&
              packed.is_contiguous(),
              what, ": the packed weight does not fit x [", rows, ", ", in, "] and ", out, " outputs");
}

namespace {

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "amx_linear: x of 1 to 64 bf16 rows expected, got ", x.sizes(), " ", x.scalar_type());
  check_linear(packed, x.size(0), x.size(1), out, "amx_linear");
  TORCH_CHECK(!bias.has_value() || !bias->defined() || (bias->numel() == out && bias->scalar_type() == at::kBFloat16),
              "amx_linear: a bf16 bias of ", out, " expected");
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) bc = bias->contiguous();
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  linear_rows(xc.data_ptr<at::BFloat16>(), x.size(0), x.size(1), packed, out,
              bc.defined() ? bc.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>());
  return y;
}

// paged_attention_bf16: short queries (decode and verify rows) straight from the paged cache.
//
// torch's path gathers each request's pages into a padded copy, makes the keys contiguous and
// runs small batched matmuls or the SDPA kernel; for a handful of query rows those copies and
// calls cost several times the arithmetic. Here each (token, K/V head) reads its request's keys
// and values in place through the block table: scores by VDPBF16PS, an fp32 softmax, and the
// weighted values summed in fp32.

inline __mmask16 tail16(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }
inline __mmask32 tail32(int64_t left) { return left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1; }


// Calls fn(i, row) for keys [begin, end) of one K/V head: i counts from 0, row is the key's
// [D] vector in the cache. Walks block by block, so no division per key.
// Then the `extra.count` keys of its own block, if any, numbered after them.
template <typename Fn>
inline void for_each_key(const uint16_t* cache, const uint16_t* extra_rows, const int64_t* table, int64_t begin,
                         int64_t end, const AttentionShape& s, const ExtraKeys& extra, int64_t kvh, Fn fn) {
  const int64_t stride = s.kv_heads * s.dim;
  for (int64_t l = begin; l < end;) {
    const int64_t off = l % s.block_size, n = std::min(s.block_size - off, end - l);
    const uint16_t* row = cache + (table[l / s.block_size] * s.block_size + off) * stride + kvh * s.dim;
    for (int64_t j = 0; j < n; ++j) fn(l - begin + j, row + j * stride);
    l += n;
  }
  for (int64_t j = 0; j < extra.count; ++j) fn(end - begin + j, extra_rows + j * extra.stride + kvh * s.dim);
}

// The G query heads of token `t` that share K/V head `kvh`, over keys [begin, end) of the
// request whose block table is `table` (and the extra keys). The weighted values are summed 16 dimensions at a time
// with the G sums in registers.
template <int G>
void attend_group(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                  int64_t begin, int64_t end, const AttentionShape& s, const ExtraKeys& extra, int64_t t,
                  int64_t kvh, float scale, std::vector<float>& scores, at::BFloat16* out) {
  const int64_t d = s.dim, len = end - begin + extra.count;
  const auto* extra_k = reinterpret_cast<const uint16_t*>(extra.k);
  const auto* extra_v = reinterpret_cast<const uint16_t*>(extra.v);
  const uint16_t* qt = q + (t * s.heads + kvh * G) * d;
  scores.resize(G * len);
  float top[G], total[G];
  for (int g = 0; g < G; ++g) top[g] = -INFINITY;
  for_each_key(kc, extra_k, table, begin, end, s, extra, kvh, [&](int64_t l, const uint16_t* k) {
    for (int g = 0; g < G; ++g) {
      __m512 dot = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 32) {
        const __mmask32 m = tail32(d - i);
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_maskz_loadu_epi16(m, k + i),
                               (__m512bh)_mm512_maskz_loadu_epi16(m, qt + g * d + i));
      }
      const float sc = _mm512_reduce_add_ps(dot) * scale;
      scores[g * len + l] = sc;
      top[g] = std::max(top[g], sc);
    }
  });
  for (int g = 0; g < G; ++g) {
    float* row = scores.data() + g * len;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l = 0; l < len; l += 16) {
      const __mmask16 m = tail16(len - l);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + l),
                                                                            _mm512_set1_ps(top[g]))));
      _mm512_mask_storeu_ps(row + l, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);                  // the softmax denominator
  }
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = tail16(d - i);
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for_each_key(vc, extra_v, table, begin, end, s, extra, kvh, [&](int64_t l, const uint16_t* v) {
      const __m512 vv = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, v + i));
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + l]), vv, acc[g]);
    });
    for (int g = 0; g < G; ++g) {
      const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
      alignas(64) float o[16];
      _mm512_store_ps(o, _mm512_mul_ps(acc[g], _mm512_set1_ps(inv)));
      at::BFloat16* dst = out + (t * s.heads + kvh * G + g) * d + i;
      for (int64_t j = 0; j < std::min<int64_t>(16, d - i); ++j) dst[j] = at::BFloat16(o[j]);
    }
  }
}

using GroupFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t,
                         const AttentionShape&, const ExtraKeys&, int64_t, int64_t, float, std::vector<float>&,
                         at::BFloat16*);
constexpr GroupFn kGroupFns[kMaxGroup] = {attend_group<1>, attend_group<2>, attend_group<3>, attend_group<4>,
                                          attend_group<5>, attend_group<6>, attend_group<7>, attend_group<8>};

}  // namespace

void check_token_keys(const int64_t* keys, int64_t tokens, int64_t requests, int64_t max_keys) {
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(keys[3 * t] >= 0 && keys[3 * t] < requests && 0 <= keys[3 * t + 1] &&
                keys[3 * t + 1] <= keys[3 * t + 2] && keys[3 * t + 2] <= max_keys,
                "paged attention: token ", t, " names keys outside its request's block table");
}

void attend_tokens(const at::BFloat16* q, int64_t tokens, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const int64_t* tables, const int64_t* keys, const AttentionShape& s, float scale,
                   at::BFloat16* out, const BlockKeys& block) {
  const auto* qp = reinterpret_cast<const uint16_t*>(q);
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  at::parallel_for(0, tokens * s.kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    const GroupFn attend = kGroupFns[s.heads / s.kv_heads - 1];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / s.kv_heads, kvh = i % s.kv_heads;
      ExtraKeys extra;
      if (block.rows > 0) {
        const int64_t first = (t / block.rows) * block.rows * block.stride;
        extra = ExtraKeys{block.k + first, block.v + first, block.rows, block.stride};
      }
      attend(qp, kp, vp, tables + keys[3 * t] * s.blocks_per_req, keys[3 * t + 1], keys[3 * t + 2], s, extra, t,
             kvh, scale, scores, out);
    }
  });
}

void check_attention(const at::Tensor& k_cache, const at::Tensor& v_cache, const AttentionShape& s) {
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged attention: contiguous bf16 caches [S, KVH, D] expected");
  TORCH_CHECK(k_cache.size(1) == s.kv_heads && k_cache.size(2) == s.dim && s.heads % s.kv_heads == 0 &&
              s.heads / s.kv_heads <= kMaxGroup,
              "paged attention: head shapes disagree (or more than 8 query heads per K/V head)");
}

namespace {

at::Tensor paged_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& token_keys,
                                int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && k_cache.dim() == 3,
              "paged_attention_bf16: bf16 q [T, H, D] and caches [S, KVH, D] expected");
  const AttentionShape s{q.size(1), k_cache.size(1), q.size(2), block_size, block_tables.size(1)};
  check_attention(k_cache, v_cache, s);
  TORCH_CHECK(block_tables.dim() == 2 && token_keys.dim() == 2 && token_keys.size(0) == q.size(0) &&
              token_keys.size(1) == 3, "paged_attention_bf16: block tables [R, NB] and token keys [T, 3] expected");
  const at::Tensor qc = q.contiguous(), tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor keys = token_keys.to(at::kLong).contiguous();
  check_token_keys(keys.data_ptr<int64_t>(), q.size(0), tables.size(0), s.blocks_per_req * block_size);
  at::Tensor out = at::empty_like(qc);
  attend_tokens(qc.data_ptr<at::BFloat16>(), q.size(0), k_cache, v_cache, tables.data_ptr<int64_t>(),
                keys.data_ptr<int64_t>(), s, static_cast<float>(scale), out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace
}  // namespace dspark_cpu

TORCH_LIBRARY(dspark_cpu, m) {
  m.def("amx_init() -> bool", &dspark_cpu::amx_init);                      // no tensor argument: one kernel
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, int out, Tensor? bias) -> Tensor");
  m.def("paged_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor token_keys, "
        "int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspark_cpu, CPU, m) {
  m.impl("amx_pack", &dspark_cpu::amx_pack);
  m.impl("amx_linear", &dspark_cpu::amx_linear);
  m.impl("paged_attention_bf16", &dspark_cpu::paged_attention_bf16);
}
