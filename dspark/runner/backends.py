"""How each graph backend turns a bucket into something runnable (see graphs.py).

`compile` compiles the stack's pieces per bucket shape; `cuda` captures them as one
`torch.cuda.CUDAGraph` each (`CausalLM.first_piece`, then one `CausalLM.layer_piece` per layer),
piece j's outputs being piece j+1's inputs in place. Under both, attention runs eagerly between
the pieces, on the live rows only, because its shapes follow each request's context rather than
the bucket (vLLM's piecewise mode; docs/graphs.md, "Backends").
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Protocol, TypeVar

import torch
import torch._dynamo

from dspark.models.layers.attention import AttentionMetadata, attend
from dspark.models.llama import CausalLM, StackState, layer_transition

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
Runner = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, KVCaches],
                  tuple[torch.Tensor, torch.Tensor | None]]
CUDA_WARMUP_RUNS = 2        # eager runs on a side stream before a bucket is captured


def build_runner(graphs, bucket: int, kv_caches: KVCaches, meta: AttentionMetadata) -> Runner | None:
    """-> callable(ids [B], positions [B], meta, kv_caches) -> (hidden, aux), or None (eager)."""
    if graphs.mode == "eager":
        return None
    if graphs.mode == "compile":
        return _compiled(graphs, bucket, kv_caches, meta)
    return _cuda_graphs(graphs, bucket, kv_caches, meta)          # the mode is checked: cuda


@functools.cache
def lower_packed_linear() -> None:
    """Have inductor call oneDNN's operator directly where a compiled graph uses `packed_linear`,
    not through the custom op's Python wrapper, paid once per projection. (Inductor's own lowering
    of `_linear_pointwise` wants a frozen constant weight.) Once per process, before compiling."""
    from torch._inductor.lowering import fallback_handler, register_lowering

    call = fallback_handler(torch.ops.mkldnn._linear_pointwise.default, add_to_fallback_set=False)

    @register_lowering(torch.ops.dspark.packed_linear.default, type_promotion_kind=None)
    def _lowered(x, packed, bias):
        return call(x, packed, bias, "none", [], "")


def _compiled(graphs, bucket: int, kv_caches: KVCaches, meta: AttentionMetadata) -> Runner:
    """The stack's two kinds of piece (`embed_and_enter`, `layer_transition`, whose layers are
    arguments) compiled once each per bucket shape. `fullgraph` and a recompile limit of the
    bucket count make a guard failing at replay an error, not a silent recompile; isolated, so
    other engines in the process neither share nor use up these entries."""
    if graphs.compiled is None:
        lower_packed_linear()
        n = len(graphs.buckets)
        compile_ = functools.partial(torch.compile, dynamic=False, fullgraph=True, isolate_recompiles=True)
        graphs.compiled = (compile_(graphs.model.embed_and_enter, recompile_limit=n),
                           compile_(layer_transition, recompile_limit=2 * n))   # last layer: no next
    entry, transition = graphs.compiled
    model, aux = graphs.model, graphs.aux_layer_ids

    def run(ids, positions, step_meta, caches):
        return model.run_stack(ids, positions, step_meta, caches, aux, entry, transition)

    with torch.inference_mode():
        run(graphs.input_ids[bucket], graphs.positions[bucket], meta, kv_caches)    # compiles
    return run


# ---- piecewise CUDA graphs ---------------------------------------------------------------------

class Piece(Protocol):
    """A captured piece: `out` holds its static outputs; calling it recomputes them in place
    from the static inputs it was captured over, and returns `out`."""
    out: StackState

    def __call__(self) -> StackState: ...


PieceCapture = Callable[[Callable[[], StackState]], Piece]


class CudaGraphPiece:
    """One piece of the stack as a CUDA graph in the pool every bucket shares."""

    def __init__(self, fn: Callable[[], StackState], pool):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()

    def __call__(self) -> StackState:
        self.graph.replay()
        return self.out


class PiecewiseRunner:
    """One bucket's decoder stack as captured pieces with eager attention between them. The
    pieces read only static tensors (the bucket's input buffers, the previous piece's outputs,
    `attn_in`); the hidden state returned is a copy: the next replay in the pool overwrites it."""

    def __init__(self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                 pieces: list[Piece], attn_in: torch.Tensor, aux_layer_ids: tuple[int, ...]):
        self.model, self.input_ids, self.positions = model, input_ids, positions
        self.pieces, self.attn_in, self.aux_layer_ids = pieces, attn_in, aux_layer_ids

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: KVCaches) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids/positions [B]: must be the buffers the pieces were captured over."""
        if ids.data_ptr() != self.input_ids.data_ptr() or positions.data_ptr() != self.positions.data_ptr():
            raise ValueError("a captured bucket replays from its own input buffers (StepGraphs.run)")
        s = self.pieces[0]()
        for i, layer in enumerate(self.model.layers):
            attn = attend(s.q, s.k, s.v, kv_caches[i], meta, layer.self_attn.scale)   # [B, H*D]
            self.attn_in.copy_(attn)
            s = self.pieces[i + 1]()
        return s.x.clone(), self.model.aux_hidden(s, self.aux_layer_ids)


def capture_pieces(model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                   aux_layer_ids: tuple[int, ...], capture: PieceCapture) -> PiecewiseRunner:
    """Capture pieces 0..L in order over input_ids/positions [B]; piece i+1 is captured over
    piece i's static outputs and the shared attention buffer."""
    cfg = model.config
    attn_in = torch.zeros(input_ids.shape[0], cfg.num_heads * cfg.head_dim,
                          dtype=model.embed_tokens.weight.dtype, device=input_ids.device)   # [B, H*D]
    pieces = [capture(functools.partial(model.first_piece, input_ids, positions, aux_layer_ids))]
    for i in range(len(model.layers)):
        prev = pieces[-1].out
        pieces.append(capture(functools.partial(model.layer_piece, i, prev, attn_in, aux_layer_ids)))
    return PiecewiseRunner(model, input_ids, positions, pieces, attn_in, aux_layer_ids)


T = TypeVar("T")


def warm_up_and_capture(device: torch.device, warm_up: Callable[[], object], capture: Callable[[], T]) -> T:
    """Run `warm_up` on a side stream, as PyTorch's CUDA-graph recipe asks (lazy kernel and
    cuBLAS initialisation must not happen inside a capture), then `capture()`."""
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(CUDA_WARMUP_RUNS):
                warm_up()
        torch.cuda.current_stream(device).wait_stream(side)
        return capture()


def _cuda_graphs(graphs, bucket: int, kv_caches: KVCaches, meta: AttentionMetadata) -> PiecewiseRunner:
    """The bucket's pieces captured into the pool every bucket shares; buckets come largest first
    (StepGraphs.capture), so the smaller ones reuse the larger ones' memory. `meta` has no live
    row: the warm-up writes no K/V."""
    if graphs.graph_pool is None:
        graphs.graph_pool = torch.cuda.graph_pool_handle()
    pool, model, aux = graphs.graph_pool, graphs.model, graphs.aux_layer_ids
    ids, pos = graphs.input_ids[bucket], graphs.positions[bucket]
    runner = warm_up_and_capture(
        graphs.device, lambda: model.run_stack(ids, pos, meta, kv_caches, aux),
        lambda: capture_pieces(model, ids, pos, aux, lambda fn: CudaGraphPiece(fn, pool)))
    logger.debug("captured the %d-token bucket as %d CUDA graphs", bucket, len(runner.pieces))
    return runner
