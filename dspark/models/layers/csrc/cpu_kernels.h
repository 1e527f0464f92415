// What cpu_kernels.cpp shares with the other kernel sources: the row-level entry points of the
// AMX projection and of the paged attention, which the fused decoder layer chains.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace dspark_cpu {

constexpr int kMaxGroup = 8;             // query heads per K/V head the attention takes

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

struct AttentionShape {
  int64_t heads, kv_heads, dim, block_size, blocks_per_req;
};

// y [rows, out] = x [rows, in] @ w^T (+ bias), rows <= 64, from amx_pack(w); check_linear first.
void linear_rows(const at::BFloat16* x, int64_t rows, int64_t in, const at::Tensor& packed, int64_t out,
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

// out [T, H, D] = each token's query heads over its request's keys, read in place through the
// block tables [R, NB]; keys [T, 3] = (request, first key, end key), checked by check_token_keys;
// then over its block's keys (a drafter's block pass).
void attend_tokens(const at::BFloat16* q, int64_t tokens, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const int64_t* tables, const int64_t* keys, const AttentionShape& s, float scale,
                   at::BFloat16* out, const BlockKeys& block = {});
void check_token_keys(const int64_t* keys, int64_t tokens, int64_t requests, int64_t max_keys);
void check_attention(const at::Tensor& k_cache, const at::Tensor& v_cache, const AttentionShape& s);

}  // namespace dspark_cpu
