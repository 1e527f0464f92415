// What the kernel sources share: the limits, the lane helpers, the row-level entry points of the
// projection and of the paged attention (which the fused decoder layer chains), and the operators
// that register.cpp registers. A source named after an instruction set needs it (amx_: AMX tiles,
// avx512bf16_: AVX512-BF16 dot products and conversions, avx512_: AVX-512F alone); the others
// only dispatch to them.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace dspark_cpu {

// The limits, defined here only: Python reads them through the `limits` operator (register.cpp).
constexpr int64_t kMaxRows = 64;         // rows of x a projection takes (four blocks of 16 tile rows)
constexpr int64_t kMaxVectorRows = 16;   // rows a lone projection takes without AMX; past them oneDNN wins
                                         // on the wide LM heads (a fused layer's keep up to kMaxRows)
constexpr int64_t kMaxQuery = 16;        // a step's longest query the paged attention serves; longer go to SDPA
constexpr int kMaxGroup = 8;             // query heads per K/V head the attention takes
constexpr int64_t kMaxHeadDim = 256;     // head dimension the attention takes (even)
constexpr int kTileQueryRows = 16;       // query rows (tokens x their heads of one K/V head) a tile group holds

// e^x, 16 lanes, to a few fp32 ulps (arguments clamped to [-87, 88]).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));            // x / ln 2
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // |f| <= ln2/2
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Lanes [0, left) of 16; bf16 <-> fp32 for 16 lanes. The conversion to bf16 rounds to nearest even,
// as at::BFloat16 does (only denormal inputs differ: VCVTNEPS2BF16 takes them as zero).
inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, p));
}
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 round16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }   // to bf16 and back

struct TileConfig {                      // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct AttentionShape {
  int64_t heads, kv_heads, dim, block_size, blocks_per_req;
};

// The index of the first maximum of x[0..n), or of its first NaN (torch.argmax's answer).
int64_t argmax_row(const float* x, int64_t n);

// y [rows, out] = x [rows, in] @ w^T (+ bias), rows <= kMaxRows, from amx_pack(w); check_linear first.
// amx: through AMX tiles (needs amx_init); otherwise AVX512-BF16 dot products (linear_rows_vector).
void linear_rows(const at::BFloat16* x, int64_t rows, int64_t in, const at::Tensor& packed, int64_t out,
                 const at::BFloat16* bias, at::BFloat16* y, bool amx);
void linear_rows_vector(const at::BFloat16* x, int64_t rows, int64_t in, const at::Tensor& packed, int64_t out,
                        const at::BFloat16* bias, at::BFloat16* y);
void check_linear(const at::Tensor& packed, int64_t rows, int64_t in, int64_t out, const char* what);

// Keys beyond the paged cache: a token also attends to `count` rows (`stride` elements apart, the
// K/V heads side by side in each) starting at `k` / `v`.
struct ExtraKeys {
  const at::BFloat16* k = nullptr;
  const at::BFloat16* v = nullptr;
  int64_t count = 0, stride = 0;
};

// A drafter's block: tokens are grouped `rows` at a time (token t in group t / rows), and each
// token attends to every row of its group, whose K/V are rows of k / v `stride` elements apart.
// rows = 0: no block keys.
struct BlockKeys {
  const at::BFloat16* k = nullptr;
  const at::BFloat16* v = nullptr;
  int64_t rows = 0, stride = 0;
};

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

// A thread's working memory for the attention of a group, reused from group to group.
struct RowScratch {
  std::vector<float> scores;
  std::vector<uint16_t> weights;           // the vector path's bf16 softmax weights
  std::vector<const uint16_t*> keys, values;
};

// attend_tokens for tokens [first, first + count) of one request with the same first key (and
// draft block), at most kTileQueryRows query rows (count x G), over K/V head kvh: the vector path.
void attend_rows_vector(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                        const int64_t* keys, int64_t first, int64_t count, const AttentionShape& s,
                        const ExtraKeys& extra, int64_t kvh, float scale, RowScratch& scratch, at::BFloat16* out);

// The same through AMX tiles (needs amx_init).
void attend_rows_tiles(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                       const int64_t* keys, int64_t first, int64_t count, const AttentionShape& s,
                       const ExtraKeys& extra, int64_t kvh, float scale, std::vector<float>& scores,
                       at::BFloat16* out);

// out [T, H, D] = each token's query heads over its request's keys, read in place through the
// block tables [R, NB]; keys [T, 3] = (request, first key, end key), checked by check_token_keys;
// then over its block's keys (a drafter's block pass). tiles: scores through AMX (attend_rows_tiles),
// which needs amx_init; otherwise AVX512-BF16 dot products (attend_rows_vector).
void attend_tokens(const at::BFloat16* q, int64_t tokens, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const int64_t* tables, const int64_t* keys, const AttentionShape& s, float scale,
                   at::BFloat16* out, const BlockKeys& block = {}, bool tiles = false);
void check_token_keys(const int64_t* keys, int64_t tokens, int64_t requests, int64_t max_keys);
void check_attention(const at::Tensor& k_cache, const at::Tensor& v_cache, const AttentionShape& s);

// ---- The operators: schemas and registration in register.cpp ----

bool amx_init();                                             // amx_linear.cpp
at::Tensor amx_pack(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out,
                       const c10::optional<at::Tensor>& bias, bool amx);
at::Tensor paged_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& token_keys,
                                int64_t block_size, double scale, bool tiles);   // paged_attention.cpp
at::Tensor argmax_rows_f32(const at::Tensor& x);             // avx512_argmax.cpp
std::tuple<at::Tensor, at::Tensor> markov_greedy_bf16(const at::Tensor& base, const at::Tensor& h,
                                                      const at::Tensor& anchors, const at::Tensor& w1,
                                                      const at::Tensor& w2_tiles,
                                                      const c10::optional<at::Tensor>& conf_tiles,
                                                      const c10::optional<at::Tensor>& conf_bias,
                                                      const c10::optional<at::Tensor>& draft_to_target,
                                                      bool amx);   // avx512bf16_markov_head.cpp
at::Tensor decoder_layer_bf16(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& input_norm, const at::Tensor& qkv_tiles,
                              const c10::optional<at::Tensor>& qkv_bias, const c10::optional<at::Tensor>& q_norm,
                              const c10::optional<at::Tensor>& k_norm, const at::Tensor& o_tiles,
                              const at::Tensor& post_norm, const at::Tensor& gate_up_tiles,
                              const at::Tensor& down_tiles, at::Tensor k_cache, at::Tensor v_cache,
                              const at::Tensor& row_slots, const at::Tensor& block_tables,
                              const at::Tensor& token_keys, int64_t block_size, int64_t live, int64_t heads,
                              int64_t intermediate, double eps, double scale, int64_t block_rows,
                              bool amx);   // avx512bf16_decoder_layer.cpp
void context_kv_bf16(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_tiles,
                     const c10::optional<at::Tensor>& k_norm, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& row_slots, double eps, bool amx);

}  // namespace dspark_cpu
