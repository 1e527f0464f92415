// paged_attention_bf16: short queries (decode, verify and draft-block rows) straight from the
// paged cache.
//
// torch's path gathers each request's pages into a padded copy, makes the keys contiguous and
// runs small batched matmuls or the SDPA kernel; for a handful of query rows those copies and
// calls cost several times the arithmetic. Here the keys and values are read in place through
// the block table, the query rows of a request's consecutive tokens sharing each key read:
// scores through AMX tiles where the CPU has them (amx_attention.cpp), else by VDPBF16PS against
// keys transposed 16 at a time (avx512bf16_attention.cpp); then an fp32 softmax and the weighted
// values summed in fp32 (from bf16 weights on the vector path).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace dspark_cpu {
namespace {

// Consecutive tokens of one request with the same first key (and, in a draft block pass, the
// same block), at most `cap` of them: their query rows share every key read.
struct TokenGroup {
  int64_t first, count;
};

// A run of such tokens longer than `cap` splits into groups of near-equal size (a verify block of
// 8 tokens with 3 heads per K/V head: 4 + 4, not 5 + 3), so the threads get even shares.
std::vector<TokenGroup> token_groups(const int64_t* keys, int64_t tokens, int64_t cap, int64_t block_rows) {
  std::vector<TokenGroup> groups;
  for (int64_t t = 0; t < tokens;) {
    int64_t n = 1;
    while (t + n < tokens && keys[3 * (t + n)] == keys[3 * t] && keys[3 * (t + n) + 1] == keys[3 * t + 1] &&
           (block_rows == 0 || (t + n) / block_rows == t / block_rows))
      ++n;
    const int64_t parts = (n + cap - 1) / cap;
    for (int64_t i = 0; i < parts; ++i) {
      const int64_t begin = n * i / parts, end = n * (i + 1) / parts;
      groups.push_back({t + begin, end - begin});
    }
    t += n;
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
  const std::vector<TokenGroup> groups = token_groups(keys, tokens, kTileQueryRows / G, block.rows);
  const int64_t n = static_cast<int64_t>(groups.size());
  at::parallel_for(0, n * s.kv_heads, 1, [&](int64_t i0, int64_t i1) {
    RowScratch scratch;
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
        attend_rows_tiles(qp, kp, vp, table, keys, t, g.count, s, extra, kvh, scale, scratch.scores, out);
      else
        attend_rows_vector(qp, kp, vp, table, keys, t, g.count, s, extra, kvh, scale, scratch, out);
    }
  });
}

void check_attention(const at::Tensor& k_cache, const at::Tensor& v_cache, const AttentionShape& s) {
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged attention: contiguous bf16 caches [S, KVH, D] expected");
  TORCH_CHECK(k_cache.size(1) == s.kv_heads && k_cache.size(2) == s.dim && s.heads % s.kv_heads == 0 &&
              s.heads / s.kv_heads <= kMaxGroup,
              "paged attention: head shapes disagree (or more than ", kMaxGroup, " query heads per K/V head)");
}

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

}  // namespace dspark_cpu
