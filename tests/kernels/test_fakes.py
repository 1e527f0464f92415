"""Every tensor operator has a fake implementation that answers what its kernel allocates, so
torch.compile can trace a graph through any of them."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from dspark.kernels import fake
from kernel_paths import PATH_MARKS
from kernel_inputs import BF16, Layer, attention_args, context_kv_args, decoder_layer_args, linear_args, markov_args

pytestmark = PATH_MARKS[False]

OPS = ["amx_pack", "linear_bf16", "paged_attention_bf16", "argmax_rows_f32", "markov_greedy_bf16",
       "decoder_layer_bf16", "context_kv_bf16"]


def _samples() -> dict[str, tuple]:
    layer = Layer(seed=1)
    return {
        "amx_pack": (torch.randn(40, 100).to(BF16),),
        "linear_bf16": linear_args(),
        "paged_attention_bf16": attention_args(),
        "argmax_rows_f32": (torch.randn(3, 1000),),
        "markov_greedy_bf16": markov_args()[0],
        "decoder_layer_bf16": decoder_layer_args(layer),
        "context_kv_bf16": context_kv_args(layer),
    }


def _meta(x):
    return (x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else x


def _copy(args):
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, args)


def test_every_tensor_operator_has_a_fake_and_a_sample():
    assert {f"dspark_cpu::{name}" for name in OPS} == set(fake.FAKES) == {f"dspark_cpu::{n}" for n in _samples()}


@pytest.mark.parametrize("name", OPS)
def test_the_fake_answers_the_shapes_and_dtypes_of_the_real_operator(name):
    args = _samples()[name]
    op = getattr(torch.ops.dspark_cpu, name)
    real = op(*_copy(args))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, args)
        traced = op(*fake_args)
    assert tree_map(_meta, traced) == tree_map(_meta, real)


def test_the_operators_without_tensors_run_as_they_are_under_fake_tensors():
    limits, amx = torch.ops.dspark_cpu.limits(), torch.ops.dspark_cpu.amx_init()
    with FakeTensorMode():
        assert torch.ops.dspark_cpu.limits() == limits and torch.ops.dspark_cpu.amx_init() == amx


@pytest.mark.parametrize("name", OPS)
def test_torch_compile_traces_each_operator_in_one_graph(name):
    args = _samples()[name]
    op = getattr(torch.ops.dspark_cpu, name)
    compiled = torch.compile(lambda *a: op(*a), backend="aot_eager", fullgraph=True, dynamic=False)
    got, want = compiled(*_copy(args)), op(*_copy(args))
    assert tree_map(_meta, got) == tree_map(_meta, want)
