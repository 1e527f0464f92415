"""How each graph backend turns a bucket into something runnable (see graphs.py).

`compile` compiles the stack's two kinds of piece (embedding + first q/k/v, and the transition
between two attention calls, layers passed as arguments) per bucket shape; attention runs
eagerly between them. `cuda` captures the same stack piecewise: it is cut at its attention calls into
`CausalLM.first_piece` and one `CausalLM.layer_piece` per layer, and each piece becomes one
`torch.cuda.CUDAGraph` over static tensors. The bucket's persistent `input_ids`/`positions` feed
piece 0, piece j's outputs are piece j+1's inputs in place, and one static [B, H*D] buffer carries
each attention output in. A replay runs attention eagerly between pieces, on the live rows only,
because its shapes follow each request's context rather than the bucket (vLLM's piecewise
mode; TensorRT-LLM captures the whole step, attention included, and sends the padding's K/V to a
scratch row).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Protocol

import torch
import torch._dynamo

from dspark.models.layers.attention import AttentionMetadata, attend
from dspark.models.layers.linear import lower_packed_linear
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
    if graphs.mode == "cuda":
        return _cuda_graphs(graphs, bucket, kv_caches, meta)
    raise ValueError(f"graph mode {graphs.mode!r} has no backend on this build")


def _compiled(graphs, bucket: int, kv_caches: KVCaches, meta: AttentionMetadata) -> Runner:
    """The stack's two kinds of piece compiled once each (`embed_and_enter`, `layer_transition`,
    whose layers are arguments: one graph serves all layers), specialised per bucket shape, with
    eager attention between them. `fullgraph` and a recompile limit of the bucket count make a
    guard failing at replay an error, not a silent recompile or eager run; isolated, so other
    engines in the process neither share nor use up these entries."""
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
    """One bucket's decoder stack as captured pieces with eager attention between them.

    The pieces read only static tensors: the bucket's input buffers (refreshed in place by
    StepGraphs.run), the previous piece's outputs and `attn_in`. Attention therefore writes into
    `attn_in` before the next piece runs. The returned hidden state is a copy, because the static
    outputs are overwritten by the next replay of any bucket sharing the pool.
    """

    def __init__(self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                 pieces: list[Piece], attn_in: torch.Tensor, aux_layer_ids: tuple[int, ...]):
        if len(pieces) != len(model.layers) + 1:
            raise ValueError(f"{len(model.layers)} layers need {len(model.layers) + 1} pieces, "
                             f"got {len(pieces)}")
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


def _cuda_graphs(graphs, bucket: int, kv_caches: KVCaches, meta: AttentionMetadata) -> PiecewiseRunner:
    """Warm the bucket up on a side stream, as PyTorch's CUDA-graph recipe asks (lazy kernel and
    cuBLAS initialisation must not happen inside a capture), then capture its pieces into the
    pool every bucket shares. Buckets come largest first (StepGraphs.capture), so the smaller
    ones reuse the larger ones' memory. `meta` has no live row: the warm-up writes no K/V."""
    device = graphs.device
    if graphs.graph_pool is None:
        graphs.graph_pool = torch.cuda.graph_pool_handle()
    pool = graphs.graph_pool
    ids, pos = graphs.input_ids[bucket], graphs.positions[bucket]
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(CUDA_WARMUP_RUNS):
                graphs.model.forward_hidden(ids, pos, meta, kv_caches, graphs.aux_layer_ids)
        torch.cuda.current_stream(device).wait_stream(side)
        runner = capture_pieces(graphs.model, ids, pos, graphs.aux_layer_ids,
                                lambda fn: CudaGraphPiece(fn, pool))
    logger.debug("captured the %d-token bucket as %d CUDA graphs", bucket, len(runner.pieces))
    return runner
