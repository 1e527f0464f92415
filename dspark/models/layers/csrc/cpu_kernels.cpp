// dspark's CPU kernels for AVX512-BF16: the two parts of a bf16 decode step that torch's own
// kernels leave far from the memory bandwidth at small batches.
//
// gemv_bf16: a matrix times a few rows, y [M, O] = x [M, I] @ w [O, I]^T (+ b).
//
// A batch-1 decode step streams every weight once, so it runs at the speed a kernel reads memory.
// Each weight row is read once for all M (<= 8) input rows; VDPBF16PS multiplies bf16 pairs into
// fp32 accumulators, and the rows a few blocks ahead are prefetched (that alone moved a chain of
// SmolLM2's projections from ~70% to ~95% of the machine's streaming-read bandwidth).  An output
// depends only on its own input row: the accumulation order never changes with M, so a row gives
// bit-identical results alone or beside seven others.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kLanes = 32;           // bf16 values in one 512-bit register
constexpr int64_t kPrefetchRows = 8;     // how far ahead of the current rows the prefetch reads

// Rows [o0, o0 + R) of the output for all M input rows.
template <int M, int R>
inline void block(const uint16_t* x, const uint16_t* w, const at::BFloat16* bias, at::BFloat16* y,
                  int64_t o0, int64_t in, int64_t out) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint16_t* rows = w + o0 * in;
  for (int64_t k = 0; k < in; k += kLanes) {
    const __mmask32 mask = in - k >= kLanes ? ~__mmask32(0) : (__mmask32(1) << (in - k)) - 1;
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + (kPrefetchRows + r) * in + k), _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows + r * in + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * in + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = _mm512_reduce_add_ps(acc[m][r]);
      if (bias != nullptr) s += static_cast<float>(bias[o0 + r]);
      y[m * out + o0 + r] = at::BFloat16(s);
    }
}

template <int M>
void rows_times_weight(const uint16_t* x, const uint16_t* w, const at::BFloat16* bias, at::BFloat16* y,
                       int64_t in, int64_t out) {
  constexpr int R = M <= 4 ? 4 : 2;      // M * R accumulators stay within the 32 registers
  const int64_t blocks = out / R;
  at::parallel_for(0, blocks, std::max<int64_t>(1, 64 / R), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<M, R>(x, w, bias, y, b * R, in, out);
  });
  for (int64_t o = blocks * R; o < out; ++o) block<M, 1>(x, w, bias, y, o, in, out);
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "gemv_bf16: x [M, I] and w [O, I] expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "gemv_bf16: bf16 tensors expected");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "gemv_bf16: 1 to 8 rows, got ", x.size(0));
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t in = w.size(1), out = w.size(0);
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out && bias->scalar_type() == at::kBFloat16, "gemv_bf16: bad bias");
    bc = bias->contiguous();
  }
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  const auto* bp = bc.defined() ? bc.data_ptr<at::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  switch (x.size(0)) {
    case 1: rows_times_weight<1>(xp, wp, bp, yp, in, out); break;
    case 2: rows_times_weight<2>(xp, wp, bp, yp, in, out); break;
    case 3: rows_times_weight<3>(xp, wp, bp, yp, in, out); break;
    case 4: rows_times_weight<4>(xp, wp, bp, yp, in, out); break;
    case 5: rows_times_weight<5>(xp, wp, bp, yp, in, out); break;
    case 6: rows_times_weight<6>(xp, wp, bp, yp, in, out); break;
    case 7: rows_times_weight<7>(xp, wp, bp, yp, in, out); break;
    default: rows_times_weight<8>(xp, wp, bp, yp, in, out); break;
  }
  return y;
}

// decode_attention_bf16: one query row per request straight from the paged cache.
//
// torch's path gathers each request's pages into a padded copy, makes the keys contiguous and
// runs two small batched matmuls; at batch 1 those copies and calls cost several times the
// arithmetic. Here each (request, K/V head) reads its keys and values in place through the block
// table: scores by VDPBF16PS, an fp32 softmax, and the weighted values summed in fp32.

// e^x for x <= 0 (softmax arguments after the max is subtracted), to a few fp32 ulps.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));            // x / ln 2
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // |f| <= ln2/2
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail16(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }
inline __mmask32 tail32(int64_t left) { return left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1; }

struct DecodeShape {
  int64_t heads, kv_heads, dim, kv_len, block_size, blocks_per_req;
};

// Output rows of the `group` query heads that share K/V head `kvh` of request `r`.
void attend_group(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                  const bool* mask, const DecodeShape& s, int64_t r, int64_t kvh, float scale,
                  std::vector<float>& scores, std::vector<float>& acc, at::BFloat16* out) {
  const int64_t group = s.heads / s.kv_heads, d = s.dim, len = s.kv_len;
  const uint16_t* qr = q + (r * s.heads + kvh * group) * d;
  scores.assign(group * len, -INFINITY);
  std::vector<float> top(group, -INFINITY);
  auto slot_of = [&](int64_t l) { return table[l / s.block_size] * s.block_size + l % s.block_size; };
  for (int64_t l = 0; l < len; ++l) {
    if (mask != nullptr && !mask[l]) continue;
    const uint16_t* k = kc + (slot_of(l) * s.kv_heads + kvh) * d;
    for (int64_t g = 0; g < group; ++g) {
      __m512 dot = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 32) {
        const __mmask32 m = tail32(d - i);
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_maskz_loadu_epi16(m, k + i),
                               (__m512bh)_mm512_maskz_loadu_epi16(m, qr + g * d + i));
      }
      const float sc = _mm512_reduce_add_ps(dot) * scale;
      scores[g * len + l] = sc;
      top[g] = std::max(top[g], sc);
    }
  }
  acc.assign(group * d, 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * len;
    __m512 total = _mm512_setzero_ps();
    for (int64_t l = 0; l < len; l += 16) {
      const __mmask16 m = tail16(len - l);
      const __m512 x = _mm512_maskz_loadu_ps(m, row + l);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_mask_cmp_ps_mask(m, x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                           exp_nonpositive(_mm512_sub_ps(x, _mm512_set1_ps(top[g]))));
      _mm512_mask_storeu_ps(row + l, m, e);
      total = _mm512_add_ps(total, e);
    }
    top[g] = _mm512_reduce_add_ps(total);                  // now the softmax denominator
  }
  for (int64_t l = 0; l < len; ++l) {
    if (mask != nullptr && !mask[l]) continue;
    const uint16_t* v = vc + (slot_of(l) * s.kv_heads + kvh) * d;
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = tail16(d - i);
      const __m512 vv = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, v + i));
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc.data() + g * d + i;
        _mm512_mask_storeu_ps(a, m, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + l]), vv,
                                                     _mm512_maskz_loadu_ps(m, a)));
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = top[g] > 0.0f ? 1.0f / top[g] : 0.0f;
    at::BFloat16* o = out + (r * s.heads + kvh * group + g) * d;
    for (int64_t i = 0; i < d; ++i) o[i] = at::BFloat16(acc[g * d + i] * inv);
  }
}

at::Tensor decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const c10::optional<at::Tensor>& mask,
                                 int64_t block_size, int64_t kv_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention_bf16: q [R, H, D] and caches [S, KVH, D] expected");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16, "decode_attention_bf16: bf16 tensors expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention_bf16: contiguous caches expected");
  const DecodeShape s{q.size(1), k_cache.size(1), q.size(2), kv_len, block_size, block_tables.size(1)};
  TORCH_CHECK(k_cache.size(2) == s.dim && s.heads % s.kv_heads == 0, "decode_attention_bf16: head shapes disagree");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && s.blocks_per_req * block_size >= kv_len,
              "decode_attention_bf16: block tables [R, NB] covering kv_len expected");
  const at::Tensor qc = q.contiguous(), tables = block_tables.to(at::kLong).contiguous();
  at::Tensor mc;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->numel() == q.size(0) * kv_len && mask->scalar_type() == at::kBool,
                "decode_attention_bf16: a bool mask [R, kv_len] expected");
    mc = mask->contiguous();
  }
  at::Tensor out = at::empty_like(qc);
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const bool* mp = mc.defined() ? mc.data_ptr<bool>() : nullptr;
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, q.size(0) * s.kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, acc;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / s.kv_heads, kvh = i % s.kv_heads;
      attend_group(qp, kp, vp, tp + r * s.blocks_per_req, mp == nullptr ? nullptr : mp + r * kv_len, s,
                   r, kvh, static_cast<float>(scale), scores, acc, op);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(dspark_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("decode_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor? mask, "
        "int block_size, int kv_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspark_cpu, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("decode_attention_bf16", &decode_attention_bf16);
}
