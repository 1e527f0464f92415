// Every operator of torch.ops.dspark_cpu: its schema and its kernel, in one place. The other
// sources define the functions kernels.h declares; dspark/kernels/fake.py gives each tensor
// operator its shape-only twin for torch.compile.
#include "kernels.h"

#include <ATen/core/Dict.h>
#include <torch/library.h>

namespace dspark_cpu {
namespace {

// The limits of kernels.h by name, so Python never restates them.
c10::Dict<std::string, int64_t> limits() {
  c10::Dict<std::string, int64_t> named;
  named.insert("MAX_ROWS", kMaxRows);
  named.insert("MAX_VECTOR_ROWS", kMaxVectorRows);
  named.insert("MAX_QUERY", kMaxQuery);
  named.insert("MAX_GROUP", kMaxGroup);
  named.insert("MAX_HEAD_DIM", kMaxHeadDim);
  return named;
}

}  // namespace
}  // namespace dspark_cpu

TORCH_LIBRARY(dspark_cpu, m) {
  // No tensor argument: one kernel for every backend (and no fake: they run as they are).
  m.def("limits() -> Dict(str, int)", &dspark_cpu::limits);
  m.def("amx_init() -> bool", &dspark_cpu::amx_init);

  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int out, Tensor? bias, bool amx) -> Tensor");
  m.def("paged_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor token_keys, "
        "int block_size, float scale, bool tiles=False) -> Tensor");
  m.def("argmax_rows_f32(Tensor x) -> Tensor");
  m.def("markov_greedy_bf16(Tensor base, Tensor h, Tensor anchors, Tensor w1, Tensor w2, Tensor? conf, "
        "Tensor? conf_bias, Tensor? draft_to_target, bool amx) -> (Tensor, Tensor)");
  m.def("decoder_layer_bf16(Tensor x, Tensor cos, Tensor sin, Tensor input_norm, Tensor qkv, Tensor? qkv_bias, "
        "Tensor? q_norm, Tensor? k_norm, Tensor o, Tensor post_norm, Tensor gate_up, Tensor down, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor row_slots, Tensor block_tables, Tensor token_keys, "
        "int block_size, int live, int heads, int intermediate, float eps, float scale, int block_rows, bool amx) -> Tensor");
  m.def("context_kv_bf16(Tensor h, Tensor cos, Tensor sin, Tensor kv, Tensor? k_norm, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor row_slots, float eps, bool amx) -> ()");
}

TORCH_LIBRARY_IMPL(dspark_cpu, CPU, m) {
  m.impl("amx_pack", &dspark_cpu::amx_pack);
  m.impl("linear_bf16", &dspark_cpu::linear_bf16);
  m.impl("paged_attention_bf16", &dspark_cpu::paged_attention_bf16);
  m.impl("argmax_rows_f32", &dspark_cpu::argmax_rows_f32);
  m.impl("markov_greedy_bf16", &dspark_cpu::markov_greedy_bf16);
  m.impl("decoder_layer_bf16", &dspark_cpu::decoder_layer_bf16);
  m.impl("context_kv_bf16", &dspark_cpu::context_kv_bf16);
}
