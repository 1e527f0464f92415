// markov_greedy_bf16: a drafter's vanilla Markov head at temperature 0, all γ drafts in one call.
//
// Each draft k takes the argmax of U_k + W2 W1[x_{k-1}] over the draft vocabulary and feeds its
// token to the next, so the head is a loop of γ tiny steps (an embedding row, a rank-r
// projection to the draft vocabulary, an add, an argmax, the confidence projection): some
// eighty torch operators a round whose arithmetic is a few hundred microseconds. The projection
// and the confidence projection are the projection kernel the module path uses (AMX or AVX512-BF16,
// as `amx` says), so they have the same bits; the argmax keeps the first maximum, as torch's does,
// 16 lanes at a time (argmax_row): element by element it was over a third of the head's time.
#include "kernels.h"

#include <vector>

namespace dspark_cpu {

using bf16 = at::BFloat16;

std::tuple<at::Tensor, at::Tensor> markov_greedy_bf16(const at::Tensor& base, const at::Tensor& h,
                                                      const at::Tensor& anchors, const at::Tensor& w1,
                                                      const at::Tensor& w2_tiles,
                                                      const c10::optional<at::Tensor>& conf_tiles,
                                                      const c10::optional<at::Tensor>& conf_bias,
                                                      const c10::optional<at::Tensor>& draft_to_target,
                                                      bool amx) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == at::kFloat && h.dim() == 3 && h.scalar_type() == at::kBFloat16 &&
              h.size(0) == base.size(0) && h.size(1) == base.size(1),
              "markov_greedy_bf16: fp32 base logits [R, γ, V] and bf16 hidden [R, γ, d] expected");
  TORCH_CHECK(w1.dim() == 2 && w1.scalar_type() == at::kBFloat16 && anchors.scalar_type() == at::kLong &&
              anchors.numel() == base.size(0), "markov_greedy_bf16: bf16 W1 [V, r] and int64 anchors [R] expected");
  const int64_t rows = base.size(0), gamma = base.size(1), vocab = base.size(2), d = h.size(2), rank = w1.size(1);
  check_linear(w2_tiles, rows, rank, vocab, "markov_greedy_bf16 (W2)");
  const bool conf = conf_tiles.has_value() && conf_tiles->defined();
  if (conf) check_linear(*conf_tiles, rows, d + rank, 1, "markov_greedy_bf16 (confidence)");
  TORCH_CHECK(!conf || (conf_bias.has_value() && conf_bias->numel() == 1 && conf_bias->scalar_type() == at::kBFloat16),
              "markov_greedy_bf16: a bf16 confidence bias [1] expected");
  const bool mapped = draft_to_target.has_value() && draft_to_target->defined();
  TORCH_CHECK(!mapped || (draft_to_target->numel() == vocab && draft_to_target->scalar_type() == at::kLong),
              "markov_greedy_bf16: an int64 draft-to-target map [V] expected");
  const at::Tensor bc = base.contiguous(), hc = h.contiguous(), w1c = w1.contiguous(), ac = anchors.contiguous();
  at::Tensor map;
  if (mapped) map = draft_to_target->contiguous();
  at::Tensor tokens = at::empty({rows, gamma}, anchors.options());
  at::Tensor conf_logits = at::zeros({rows, gamma}, base.options());
  auto* tok = tokens.data_ptr<int64_t>();
  std::vector<int64_t> prev(ac.data_ptr<int64_t>(), ac.data_ptr<int64_t>() + rows);
  std::vector<bf16> e(rows * rank), bias(rows * vocab), feats(rows * (d + rank)), z(rows);
  std::vector<float> logits(vocab);
  for (int64_t k = 0; k < gamma; ++k) {
    for (int64_t m = 0; m < rows; ++m) {
      TORCH_CHECK(prev[m] >= 0 && prev[m] < w1c.size(0), "markov_greedy_bf16: token ", prev[m], " is outside W1");
      std::copy(w1c.data_ptr<bf16>() + prev[m] * rank, w1c.data_ptr<bf16>() + (prev[m] + 1) * rank, e.data() + m * rank);
    }
    linear_rows(e.data(), rows, rank, w2_tiles, vocab, nullptr, bias.data(), amx);
    for (int64_t m = 0; m < rows; ++m) {
      const float* u = bc.data_ptr<float>() + (m * gamma + k) * vocab;
      const bf16* b = bias.data() + m * vocab;
      for (int64_t v = 0; v < vocab; v += 16) {
        const __mmask16 l = lanes(vocab - v);
        _mm512_mask_storeu_ps(logits.data() + v, l, _mm512_add_ps(_mm512_maskz_loadu_ps(l, u + v), load16(b + v, l)));
      }
      const int64_t best = argmax_row(logits.data(), vocab);
      if (conf) {                            // [h_k ; e] through the head's own projection
        std::copy(hc.data_ptr<bf16>() + (m * gamma + k) * d, hc.data_ptr<bf16>() + (m * gamma + k + 1) * d,
                  feats.data() + m * (d + rank));
        std::copy(e.data() + m * rank, e.data() + (m + 1) * rank, feats.data() + m * (d + rank) + d);
      }
      prev[m] = mapped ? map.data_ptr<int64_t>()[best] : best;
      tok[m * gamma + k] = prev[m];
    }
    if (conf) {
      linear_rows(feats.data(), rows, d + rank, *conf_tiles, 1, conf_bias->data_ptr<bf16>(), z.data(), amx);
      for (int64_t m = 0; m < rows; ++m) conf_logits.data_ptr<float>()[m * gamma + k] = static_cast<float>(z[m]);
    }
  }
  return {tokens, conf_logits};
}

}  // namespace dspark_cpu
