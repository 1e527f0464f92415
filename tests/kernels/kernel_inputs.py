"""Small random arguments for each operator of dspark's CPU kernels, shared by the per-op tests
and the fake-implementation test; the sizes are off the tile and lane widths on purpose."""

from __future__ import annotations

import torch

from dspark.kernels import cpu as kernels

BF16 = torch.bfloat16


def paged(r, kv_heads, d, block_size, kv_len, seed):
    """Random caches and shuffled block tables for r requests of kv_len keys."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-kv_len // block_size)
    slots = (r * nb + 3) * block_size
    k_cache = torch.randn(slots, kv_heads, d, generator=g).to(BF16)
    v_cache = torch.randn(slots, kv_heads, d, generator=g).to(BF16)
    tables = torch.randperm(r * nb + 3, generator=g)[:r * nb].view(r, nb)
    return k_cache, v_cache, tables, g


def slot(tables, block_size, r, pos):
    return int(tables[r, pos // block_size]) * block_size + pos % block_size


def rotary(positions, dim, base=10000.0):
    """bf16 cos, sin [T, dim] of the rotate-half embedding."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[:, None] * inv[None]
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(BF16), angles.sin().to(BF16)


class Layer:
    """A decoder layer's weights (dense and packed) and its shapes."""

    def __init__(self, seed, hidden=96, heads=3, kv_heads=1, dim=32, intermediate=80, qk_norm=True, bias=True):
        g = torch.Generator().manual_seed(seed)
        self.hidden, self.heads, self.kv_heads, self.dim, self.intermediate = hidden, heads, kv_heads, dim, intermediate
        self.q_size, self.kv_size = heads * dim, kv_heads * dim

        def w(*shape, scale=0.1):
            return (torch.randn(*shape, generator=g) * scale).to(BF16)

        self.input_norm, self.post_norm = 1 + w(hidden, scale=0.3), 1 + w(hidden, scale=0.3)
        self.qkv = w(self.q_size + 2 * self.kv_size, hidden)
        self.qkv_bias = w(self.q_size + 2 * self.kv_size) if bias else None
        self.q_norm = 1 + w(dim, scale=0.3) if qk_norm else None
        self.k_norm = 1 + w(dim, scale=0.3) if qk_norm else None
        self.o, self.gate_up, self.down = w(hidden, self.q_size), w(2 * intermediate, hidden), w(hidden, intermediate)
        self.tiles = {name: kernels.pack_tiles(getattr(self, name)) for name in ("qkv", "o", "gate_up", "down")}
        self.kv_tiles = kernels.pack_tiles(self.qkv[self.q_size:])
        self.eps, self.scale = 1e-6, dim ** -0.5


def linear_args(amx=False):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 100, generator=g).to(BF16)
    return (torch.randn(3, 100, generator=g).to(BF16), kernels.pack_tiles(w), 40,
            torch.randn(40, generator=g).to(BF16), amx)


def attention_args(tiles=False):
    k_cache, v_cache, tables, g = paged(2, 3, 64, 16, 40, seed=1)
    token_keys = torch.tensor([[0, 0, 40], [1, 0, 37], [1, 0, 38]])
    return (torch.randn(3, 9, 64, generator=g).to(BF16), k_cache, v_cache, tables, token_keys, 16, 0.125, tiles)


def markov_args(amx=False, conf=True, mapped=True, rows=3, gamma=4, vocab=100, target_vocab=150, d=48, rank=8):
    g = torch.Generator().manual_seed(rows * gamma)
    base = torch.randn(rows, gamma, vocab, generator=g) * 8          # clear winners: no near ties
    h = torch.randn(rows, gamma, d, generator=g).to(BF16)
    w1 = torch.randn(target_vocab if mapped else vocab, rank, generator=g).to(BF16)
    w2 = (torch.randn(vocab, rank, generator=g) * 0.1).to(BF16)
    conf_w = (torch.randn(1, d + rank, generator=g) * 0.1).to(BF16)
    conf_b = torch.randn(1, generator=g).to(BF16)
    to_target = torch.randperm(target_vocab, generator=g)[:vocab] if mapped else None
    anchors = torch.randint(0, w1.shape[0], (rows,), generator=g)
    args = (base, h, anchors, w1, kernels.pack_tiles(w2), kernels.pack_tiles(conf_w) if conf else None,
            conf_b if conf else None, to_target, amx)
    return args, (w2, conf_w)


def decoder_layer_args(layer: Layer, amx=False, block_rows=0):
    """A verify step of two requests plus a padding row (block_rows 0), or a drafter's block pass
    of two requests of block_rows rows over their context (block_rows > 0)."""
    block_size = 4
    k_cache, v_cache, tables, g = paged(2, layer.kv_heads, layer.dim, block_size, 12, seed=5)
    if block_rows:
        starts = [7, 10]
        keys = torch.tensor([[r, 0, starts[r]] for r in range(2) for _ in range(block_rows)])
        positions = torch.tensor([starts[r] + j for r in range(2) for j in range(block_rows)])
        slots, live = torch.zeros(0, dtype=torch.long), 2 * block_rows
    else:
        rows = [(0, 6), (0, 7), (0, 8), (1, 2)]                        # (request, position)
        keys = torch.tensor([[r, 0, p + 1] for r, p in rows])
        positions = torch.tensor([p for _, p in rows] + [0])
        slots = torch.tensor([slot(tables, block_size, r, p) for r, p in rows])
        live = len(rows)
    x = torch.randn(positions.shape[0], layer.hidden, generator=g).to(BF16)
    cos, sin = rotary(positions, layer.dim)
    t = layer.tiles
    return (x, cos, sin, layer.input_norm, t["qkv"], layer.qkv_bias, layer.q_norm, layer.k_norm, t["o"],
            layer.post_norm, t["gate_up"], t["down"], k_cache, v_cache, slots, tables, keys, block_size, live,
            layer.heads, layer.intermediate, layer.eps, layer.scale, block_rows, amx)


def context_kv_args(layer: Layer, amx=False):
    g = torch.Generator().manual_seed(9)
    k_cache = torch.randn(24, layer.kv_heads, layer.dim, generator=g).to(BF16)
    v_cache = torch.randn(24, layer.kv_heads, layer.dim, generator=g).to(BF16)
    h = torch.randn(5, layer.hidden, generator=g).to(BF16)
    cos, sin = rotary(torch.tensor([3, 4, 5, 9, 0]), layer.dim)
    slots = torch.tensor([7, 8, -1, 20, 0])
    return (h, cos, sin, layer.kv_tiles, layer.k_norm, k_cache, v_cache, slots, layer.eps, amx)
