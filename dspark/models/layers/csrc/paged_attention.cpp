// paged_attention_bf16: short queries (decode, verify and draft-block rows) straight from the
// paged cache.
//
// torch's path gathers each request's pages into a padded copy, makes the keys contiguous and
// runs small batched matmuls or the SDPA kernel; for a handful of query rows those copies and
// calls cost several times the arithmetic. Here the keys and values are read in place through
// the block table. On a CPU with AMX the scores go through tiles (tile_attention.cpp), the query
// rows of a request's consecutive tokens sharing each key read; elsewhere each (token, K/V head)
// scores its keys by VDPBF16PS dot products, then an fp32 softmax and the weighted values
// summed in fp32.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace dspark_cpu {
namespace {

inline __mmask32 tail32(int64_t left) { return left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1; }

// The G query heads of token `t` that share K/V head `kvh`, over keys [begin, end) of the
// request whose block table is `table` (and the extra keys). The weighted values are summed 16
// dimensions at a time with the G sums in registers.
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
      const __mmask16 m = lanes(len - l);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + l),
                                                                            _mm512_set1_ps(top[g]))));
      _mm512_mask_storeu_ps(row + l, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);                  // the softmax denominator
  }
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = lanes(d - i);
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for_each_key(vc, extra_v, table, begin, end, s, extra, kvh, [&](int64_t l, const uint16_t* v) {
      const __m512 vv = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, v + i));
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + l]), vv, acc[g]);
    });
    for (int g = 0; g < G; ++g) {
      const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
      store16(out + (t * s.heads + kvh * G + g) * d + i, _mm512_mul_ps(acc[g], _mm512_set1_ps(inv)), m);
    }
  }
}

using GroupFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t,
                         const AttentionShape&, const ExtraKeys&, int64_t, int64_t, float, std::vector<float>&,
                         at::BFloat16*);
constexpr GroupFn kGroupFns[kMaxGroup] = {attend_group<1>, attend_group<2>, attend_group<3>, attend_group<4>,
                                          attend_group<5>, attend_group<6>, attend_group<7>, attend_group<8>};

// Consecutive tokens of one request with the same first key (and, in a draft block pass, the
// same block), at most `cap` of them: on the tile path their query rows share every key read.
struct TokenGroup {
  int64_t first, count;
};

std::vector<TokenGroup> token_groups(const int64_t* keys, int64_t tokens, int64_t cap, int64_t block_rows) {
  std::vector<TokenGroup> groups;
  for (int64_t t = 0; t < tokens; ++t) {
    if (!groups.empty()) {
      TokenGroup& g = groups.back();
      const int64_t f = g.first;
      if (g.count < cap && keys[3 * t] == keys[3 * f] && keys[3 * t + 1] == keys[3 * f + 1] &&
          (block_rows == 0 || t / block_rows == f / block_rows)) {
        ++g.count;
        continue;
      }
    }
    groups.push_back({t, 1});
  }
  return groups;
}

}  // namespace

void check_token_keys(const int64_t* keys, int64_t tokens, int64_t requests, int64_t max_keys) {
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(keys[3 * t] >= 0 && keys[3 * t] < requests && 0 <= keys[3 * t + 1] &&
                keys[3 * t + 1] <= keys[3 * t + 2] && keys[3 * t + 2] <= max_keys,
                "paged attention: token ", t, " names keys outside its request's block table");
}

void attend_tokens(const at::BFloat16* q, int64_t tokens, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const int64_t* tables, const int64_t* keys, const AttentionShape& s, float scale,
                   at::BFloat16* out, const BlockKeys& block, bool tiles) {
  const auto* qp = reinterpret_cast<const uint16_t*>(q);
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t G = s.heads / s.kv_heads;
  const std::vector<TokenGroup> groups = token_groups(keys, tokens, tiles ? kTileQueryRows / G : 1, block.rows);
  const int64_t n = static_cast<int64_t>(groups.size());
  at::parallel_for(0, n * s.kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const TokenGroup& g = groups[i / s.kv_heads];
      const int64_t kvh = i % s.kv_heads, t = g.first;
      ExtraKeys extra;
      if (block.rows > 0) {
        const int64_t first = (t / block.rows) * block.rows * block.stride;
        extra = ExtraKeys{block.k + first, block.v + first, block.rows, block.stride};
      }
      const int64_t* table = tables + keys[3 * t] * s.blocks_per_req;
      if (tiles)
        attend_rows_tiles(qp, kp, vp, table, keys, t, g.count, s, extra, kvh, scale, scores, out);
      else
        kGroupFns[G - 1](qp, kp, vp, table, keys[3 * t + 1], keys[3 * t + 2], s, extra, t, kvh, scale, scores, out);
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
                                int64_t block_size, double scale, bool tiles) {
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
                keys.data_ptr<int64_t>(), s, static_cast<float>(scale), out.data_ptr<at::BFloat16>(), {}, tiles);
  return out;
}

}  // namespace
}  // namespace dspark_cpu

TORCH_LIBRARY_FRAGMENT(dspark_cpu, m) {
  m.def("paged_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor token_keys, "
        "int block_size, float scale, bool tiles=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspark_cpu, CPU, m) { m.impl("paged_attention_bf16", &dspark_cpu::paged_attention_bf16); }
