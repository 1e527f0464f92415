// decoder_layer_bf16: one whole Llama-family decoder layer for a step of at most kMaxRows rows.
//
// At such steps the projections stream their weights at the machine's read speed (AMX tiles),
// and what is left of a step is the glue between them: two RMSNorms, the rotary embedding, the
// K/V write, two residual adds and the SiLU gate, about forty small torch operators per layer,
// each a few microseconds of dispatch for a few thousand multiply-adds. Here they run as plain
// loops between the projection and attention kernels, one call per layer. Every intermediate
// is rounded to bf16 where the torch modules round it (RMSNorm normalises in fp32, rounds, then
// scales by the bf16 weight; rotary and the gate round each product and sum), so the layer
// agrees with the modules to the rounding of an fp32 sum.
//
// A drafter's layer is the same layer over its blocks (block_rows > 0): each row also attends,
// without a mask, to the K/V of every row of its own block, which stay local; the context keys
// come from the drafter's paged cache, and nothing is written to it (no slots).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace dspark_cpu {
namespace {

using bf16 = at::BFloat16;

// Runs fn(m) for rows [0, rows) of `width` values each, on the thread pool only when there is
// enough work to pay for waking it: a parallel region costs microseconds of fork and join, more
// than normalising or gating a verify block's eight rows takes on one core.
constexpr int64_t kParallelValues = 1 << 16;

template <typename Fn>
void for_rows(int64_t rows, int64_t width, Fn fn) {
  if (rows < 2 || rows * width < kParallelValues) {
    for (int64_t m = 0; m < rows; ++m) fn(m);
    return;
  }
  at::parallel_for(0, rows, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) fn(m);
  });
}

// One row of `dim` values normalised in fp32, rounded, then scaled by the bf16 weight; in place
// allowed (x == out).
void rms_norm_row(const bf16* x, int64_t dim, const bf16* w, float eps, bf16* o) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 v = load16(x + i, lanes(dim - i));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = lanes(dim - i);
    store16(o + i, _mm512_mul_ps(load16(w + i, m), round16(_mm512_mul_ps(load16(x + i, m), r))), m);
  }
}

void rms_norm(const bf16* x, int64_t rows, int64_t dim, const bf16* w, float eps, bf16* out) {
  for_rows(rows, dim, [&](int64_t m) { rms_norm_row(x + m * dim, dim, w, eps, out + m * dim); });
}

// Rotate-half rotary embedding of `heads` [D] vectors in place: x * cos + rotate(x) * sin, each
// product and the sum rounded to bf16.
void rotate(bf16* x, int64_t heads, int64_t dim, const bf16* cos, const bf16* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    bf16* v = x + h * dim;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = lanes(half - i);
      const __m512 a = load16(v + i, m), b = load16(v + i + half, m);
      const __m512 minus_b = _mm512_sub_ps(_mm512_setzero_ps(), b);
      const __m512 lo = _mm512_add_ps(round16(_mm512_mul_ps(a, load16(cos + i, m))),
                                      round16(_mm512_mul_ps(minus_b, load16(sin + i, m))));
      const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(b, load16(cos + i + half, m))),
                                      round16(_mm512_mul_ps(a, load16(sin + i + half, m))));
      store16(v + i, lo, m);
      store16(v + i + half, hi, m);
    }
  }
}

void add_into(bf16* acc, const bf16* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    store16(acc + i, _mm512_add_ps(load16(acc + i, m), load16(y + i, m)), m);
  }
}

// act [I] = silu(gate) * up, the SiLU rounded to bf16 before the product (as torch computes it).
void silu_gate_row(const bf16* gate, const bf16* up, int64_t n, bf16* act) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 g = load16(gate + i, m);
    const __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    store16(act + i, _mm512_mul_ps(silu, load16(up + i, m)), m);
  }
}

const bf16* optional_ptr(const c10::optional<at::Tensor>& t, int64_t numel, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->numel() == numel && t->scalar_type() == at::kBFloat16 && t->is_contiguous(),
              "decoder_layer_bf16: ", what, " must be a contiguous bf16 tensor of ", numel);
  return t->data_ptr<bf16>();
}

const bf16* weight_ptr(const at::Tensor& t, int64_t numel, const char* what) {
  return optional_ptr(c10::optional<at::Tensor>(t), numel, what);
}

// A layer's intermediates, kept per thread from call to call: a step runs the same layer shape
// thirty times, and fresh zeroed buffers each time cost more than a verify block's norms.
// Buffers only grow; what a call reads it has written first.
struct LayerScratch {
  std::vector<bf16> h, qkv, q, attn, gate_up, act;

  static bf16* take(std::vector<bf16>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }
};

LayerScratch& layer_scratch() {
  thread_local LayerScratch scratch;
  return scratch;
}

struct LayerShape {
  int64_t rows, hidden, heads, kv_heads, dim, intermediate;
  int64_t q_size() const { return heads * dim; }
  int64_t kv_size() const { return kv_heads * dim; }
  int64_t qkv_size() const { return q_size() + 2 * kv_size(); }
};

// q, k, v of every row: input norm, fused projection, optional q/k norm, rotary on q and k.
void attention_inputs(const bf16* x, const LayerShape& s, const bf16* norm, float eps, const at::Tensor& qkv_tiles,
                      const bf16* qkv_bias, const bf16* q_norm, const bf16* k_norm, const bf16* cos,
                      const bf16* sin, bf16* h, bf16* qkv, bool amx) {
  rms_norm(x, s.rows, s.hidden, norm, eps, h);
  linear_rows(h, s.rows, s.hidden, qkv_tiles, s.qkv_size(), qkv_bias, qkv, amx);
  for_rows(s.rows, s.qkv_size(), [&](int64_t m) {
    bf16* q = qkv + m * s.qkv_size();
    bf16* k = q + s.q_size();
    for (int64_t h = 0; q_norm && h < s.heads; ++h) rms_norm_row(q + h * s.dim, s.dim, q_norm, eps, q + h * s.dim);
    for (int64_t h = 0; k_norm && h < s.kv_heads; ++h) rms_norm_row(k + h * s.dim, s.dim, k_norm, eps, k + h * s.dim);
    rotate(q, s.heads, s.dim, cos + m * s.dim, sin + m * s.dim);
    rotate(k, s.kv_heads, s.dim, cos + m * s.dim, sin + m * s.dim);
  });
}

// One row's k and v (kv_size values each, k then v in `kv`) into cache slot `slot`.
void store_kv(const bf16* kv, int64_t kv_size, int64_t slot, at::Tensor& k_cache, at::Tensor& v_cache,
              const char* what) {
  TORCH_CHECK(slot < k_cache.size(0), what, ": slot ", slot, " is outside the cache");
  std::copy(kv, kv + kv_size, k_cache.data_ptr<bf16>() + slot * kv_size);
  std::copy(kv + kv_size, kv + 2 * kv_size, v_cache.data_ptr<bf16>() + slot * kv_size);
}

// The live rows' K/V go to their cache slots (slot -1: not stored).
void write_kv(const bf16* qkv, const LayerShape& s, const int64_t* slots, int64_t live,
              at::Tensor& k_cache, at::Tensor& v_cache) {
  for (int64_t m = 0; m < live; ++m)
    if (slots[m] >= 0)
      store_kv(qkv + m * s.qkv_size() + s.q_size(), s.kv_size(), slots[m], k_cache, v_cache,
               "decoder_layer_bf16");
}

// x [rows, hidden] += down(silu(gate) * up) of the post-attention norm of x.
void mlp(bf16* x, const LayerShape& s, const bf16* norm, float eps, const at::Tensor& gate_up_tiles,
         const at::Tensor& down_tiles, bf16* h, LayerScratch& scratch, bool amx) {
  const int64_t inter = s.intermediate;
  bf16* gate_up = scratch.take(scratch.gate_up, s.rows * 2 * inter);
  bf16* act = scratch.take(scratch.act, s.rows * inter);
  rms_norm(x, s.rows, s.hidden, norm, eps, h);
  linear_rows(h, s.rows, s.hidden, gate_up_tiles, 2 * inter, nullptr, gate_up, amx);
  for_rows(s.rows, 2 * inter, [&](int64_t m) {
    const bf16* row = gate_up + m * 2 * inter;
    silu_gate_row(row, row + inter, inter, act + m * inter);
  });
  linear_rows(act, s.rows, inter, down_tiles, s.hidden, nullptr, h, amx);
  add_into(x, h, s.rows * s.hidden);
}

}  // namespace

at::Tensor decoder_layer_bf16(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& input_norm, const at::Tensor& qkv_tiles,
                              const c10::optional<at::Tensor>& qkv_bias, const c10::optional<at::Tensor>& q_norm,
                              const c10::optional<at::Tensor>& k_norm, const at::Tensor& o_tiles,
                              const at::Tensor& post_norm, const at::Tensor& gate_up_tiles,
                              const at::Tensor& down_tiles, at::Tensor k_cache, at::Tensor v_cache,
                              const at::Tensor& row_slots, const at::Tensor& block_tables,
                              const at::Tensor& token_keys, int64_t block_size, int64_t live, int64_t heads,
                              int64_t intermediate, double eps, double scale, int64_t block_rows, bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "decoder_layer_bf16: x [T, hidden] bf16 expected");
  const LayerShape s{x.size(0), x.size(1), heads, k_cache.size(1), k_cache.size(2), intermediate};
  const AttentionShape as{heads, s.kv_heads, s.dim, block_size, block_tables.size(1)};
  check_attention(k_cache, v_cache, as);
  check_linear(qkv_tiles, s.rows, s.hidden, s.qkv_size(), "decoder_layer_bf16 (qkv)");
  check_linear(o_tiles, s.rows, s.q_size(), s.hidden, "decoder_layer_bf16 (o)");
  check_linear(gate_up_tiles, s.rows, s.hidden, 2 * intermediate, "decoder_layer_bf16 (gate/up)");
  check_linear(down_tiles, s.rows, intermediate, s.hidden, "decoder_layer_bf16 (down)");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == s.rows * s.dim && cos.scalar_type() == at::kBFloat16 &&
              sin.scalar_type() == at::kBFloat16, "decoder_layer_bf16: bf16 rotary tables of [T, D] expected");
  TORCH_CHECK(block_rows >= 0 && (block_rows == 0 || s.rows % block_rows == 0),
              "decoder_layer_bf16: ", s.rows, " rows do not split into blocks of ", block_rows);
  TORCH_CHECK(0 <= live && live <= s.rows && (row_slots.numel() == live || row_slots.numel() == 0) &&
              row_slots.scalar_type() == at::kLong &&
              token_keys.dim() == 2 && token_keys.size(0) >= live && token_keys.size(1) == 3 &&
              token_keys.scalar_type() == at::kLong && block_tables.dim() == 2 &&
              block_tables.scalar_type() == at::kLong,
              "decoder_layer_bf16: int64 slots [live] or [0], token keys [>= live, 3] and block tables [R, NB] expected");
  const at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor slots = row_slots.contiguous(), keys = token_keys.contiguous(), tables = block_tables.contiguous();
  check_token_keys(keys.data_ptr<int64_t>(), live, tables.size(0), as.blocks_per_req * block_size);
  const float e = static_cast<float>(eps);

  LayerScratch& scratch = layer_scratch();
  bf16* h = scratch.take(scratch.h, s.rows * std::max(s.hidden, s.q_size()));
  bf16* qkv = scratch.take(scratch.qkv, s.rows * s.qkv_size());
  attention_inputs(xc.data_ptr<bf16>(), s, weight_ptr(input_norm, s.hidden, "input norm"), e, qkv_tiles,
                   optional_ptr(qkv_bias, s.qkv_size(), "qkv bias"), optional_ptr(q_norm, s.dim, "q norm"),
                   optional_ptr(k_norm, s.dim, "k norm"), cc.data_ptr<bf16>(), sc.data_ptr<bf16>(), h, qkv, amx);
  if (slots.numel() > 0) write_kv(qkv, s, slots.data_ptr<int64_t>(), live, k_cache, v_cache);

  bf16* q = scratch.take(scratch.q, s.rows * s.q_size());
  bf16* attn = scratch.take(scratch.attn, s.rows * s.q_size());
  for (int64_t m = 0; m < s.rows; ++m)
    std::copy(qkv + m * s.qkv_size(), qkv + m * s.qkv_size() + s.q_size(), q + m * s.q_size());
  std::fill(attn + live * s.q_size(), attn + s.rows * s.q_size(), bf16(0.0f));   // padding rows: zero
  const BlockKeys block{qkv + s.q_size(), qkv + s.q_size() + s.kv_size(), block_rows, s.qkv_size()};
  attend_tokens(q, live, k_cache, v_cache, tables.data_ptr<int64_t>(), keys.data_ptr<int64_t>(), as,
                static_cast<float>(scale), attn, block, amx);

  at::Tensor out = xc.clone();
  bf16* y = out.data_ptr<bf16>();
  linear_rows(attn, s.rows, s.q_size(), o_tiles, s.hidden, nullptr, h, amx);
  add_into(y, h, s.rows * s.hidden);
  mlp(y, s, weight_ptr(post_norm, s.hidden, "post-attention norm"), e, gate_up_tiles, down_tiles, h, scratch, amx);
  return out;
}

// A drafter layer's context K/V for rows the target just ran: h [T, d] (the projected, normed
// target features) -> k, v through the layer's joined k/v projection, k normed and rotated, each
// stored in its row's slot (slot -1: not stored).
void context_kv_bf16(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_tiles,
                     const c10::optional<at::Tensor>& k_norm, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& row_slots, double eps, bool amx) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kBFloat16, "context_kv_bf16: h [T, d] bf16 expected");
  const int64_t rows = h.size(0), kv_heads = k_cache.size(1), dim = k_cache.size(2), kv_size = kv_heads * dim;
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "context_kv_bf16: contiguous bf16 caches [S, KVH, D] expected");
  check_linear(kv_tiles, rows, h.size(1), 2 * kv_size, "context_kv_bf16");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == rows * dim && cos.scalar_type() == at::kBFloat16 &&
              sin.scalar_type() == at::kBFloat16 && row_slots.numel() == rows && row_slots.scalar_type() == at::kLong,
              "context_kv_bf16: bf16 rotary tables [T, D] and int64 slots [T] expected");
  const bf16* norm = optional_ptr(k_norm, dim, "k norm");
  const at::Tensor hc = h.contiguous(), cc = cos.contiguous(), sc = sin.contiguous(), slots = row_slots.contiguous();
  std::vector<bf16> kv(rows * 2 * kv_size);
  linear_rows(hc.data_ptr<bf16>(), rows, h.size(1), kv_tiles, 2 * kv_size, nullptr, kv.data(), amx);
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t slot = slots.data_ptr<int64_t>()[m];
    if (slot < 0) continue;
    bf16* k = kv.data() + m * 2 * kv_size;
    for (int64_t hd = 0; norm && hd < kv_heads; ++hd) rms_norm_row(k + hd * dim, dim, norm, static_cast<float>(eps), k + hd * dim);
    rotate(k, kv_heads, dim, cc.data_ptr<bf16>() + m * dim, sc.data_ptr<bf16>() + m * dim);
    store_kv(k, kv_size, slot, k_cache, v_cache, "context_kv_bf16");
  }
}

}  // namespace dspark_cpu
