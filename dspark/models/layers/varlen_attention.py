"""Attention on CUDA through torch's variable-length FlashAttention (`torch.nn.attention.varlen`).

SDPA's padding mask keeps it off its flash kernel; this kernel takes the ragged queries as they
come, its causal mask aligned bottom right (decode, verify and prefill rows alike). Keys are read
from the paged cache where FlashAttention takes our page size, else from one packed gather per
layer (index built on the host, worker/inputs.py). Anything else runs SDPA, warned once per
reason and counted in STATS, so a slow step is never silent.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:                    # a torch older than its variable-length attention
    varlen_attn = None

logger = logging.getLogger(__name__)

PAGE_MULTIPLE = 256      # FlashAttention reads paged K/V only from pages of a multiple of this
MAX_HEAD_DIM = 256
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class VarlenMetadata:
    """A step as the variable-length kernel reads it; built on the host once per step."""
    cu_seq_q: torch.Tensor                 # [R+1] int32 query offsets (the ragged layout's qo_indptr)
    cu_seq_k: torch.Tensor                 # [R+1] int32 offsets of each request's keys, packed
    max_q: int                             # longest query of the step
    max_k: int                             # longest context of the step
    page_size: int                         # the cache's block size
    kv_index: torch.Tensor | None          # [K] int32 cache slot of every packed key (None: paged)
    block_table: torch.Tensor | None       # [R, NB] int32 each request's pages (paged only)
    seqused_k: torch.Tensor | None         # [R] int32 each request's context length (paged only)
    window: int | None = None              # sliding window in keys, the query's own included


@dataclass
class VarlenStats:
    """Attention calls through the kernel, and by reason those asked for it that ran SDPA."""
    calls: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)


STATS = VarlenStats()


@functools.cache
def _parameters(fn: Callable[..., torch.Tensor]) -> frozenset[str]:
    """The keywords this torch's varlen_attn takes: its signature changed between releases."""
    return frozenset(inspect.signature(fn).parameters)


def paged_layout(block_size: int) -> bool:
    """Whether the kernel can read this cache's pages in place (else keys are gathered)."""
    return (block_size % PAGE_MULTIPLE == 0 and varlen_attn is not None
            and {"block_table", "seqused_k"} <= _parameters(varlen_attn))


@functools.cache
def _device_refusal(device: torch.device) -> str | None:
    """Asked once per device: the answers cannot change while the process runs."""
    if not torch.backends.cuda.is_flash_attention_available():     # every torch with varlen_attn has it
        return "this torch was built without FlashAttention"
    major, minor = torch.cuda.get_device_capability(device)
    return None if major >= 8 else f"FlashAttention needs compute capability 8.0, the GPU has {major}.{minor}"


def refusal(q: torch.Tensor, k_cache: torch.Tensor, meta: VarlenMetadata) -> str | None:
    """Why this call cannot take the kernel (None: it can)."""
    if varlen_attn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if meta.window is not None and "window_size" not in _parameters(varlen_attn):
        return f"torch {torch.__version__}'s varlen_attn has no sliding window"
    if q.device.type != "cuda":
        return f"queries on {q.device.type}"
    if q.dtype not in HALF_DTYPES or k_cache.dtype != q.dtype:
        return f"{q.dtype} attention (the kernel takes bf16 and fp16)"
    d = q.shape[-1]
    if d % 8 or d > MAX_HEAD_DIM:
        return f"head dimension {d} (the kernel takes multiples of 8 up to {MAX_HEAD_DIM})"
    return _device_refusal(q.device)


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("attention runs through SDPA over padded contexts, not FlashAttention's "
                   "variable-length kernel: %s (counted in varlen_attention.STATS)", reason)


def note_fallback(reason: str) -> None:
    _warn_once(reason)
    STATS.fallbacks[reason] = STATS.fallbacks.get(reason, 0) + 1


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: VarlenMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D] -> [T, H*D]: every request's rows over its own context (the new K/V must
    already be in the cache)."""
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    if meta.block_table is not None:
        pages = k_cache.shape[0] // meta.page_size
        keys = k_cache.view(pages, meta.page_size, kvh, d)
        values = v_cache.view(pages, meta.page_size, kvh, d)
        paged = dict(block_table=meta.block_table, seqused_k=meta.seqused_k)
    else:
        keys, values = k_cache.index_select(0, meta.kv_index), v_cache.index_select(0, meta.kv_index)
        paged = {}
    STATS.calls += 1
    out = varlen_attn(q, keys, values, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k,
                      scale=scale, **_masking(meta, h != kvh), **paged)
    return out.reshape(t, h * d)


def _masking(meta: VarlenMetadata, gqa: bool) -> dict:
    """Causal, bottom-right aligned: a request's query row j of q attends its keys up to
    ctx - q + j. A step of one-row queries is left unmasked (each row's keys all precede it),
    which lets the kernel fold grouped query heads into one pass."""
    params = _parameters(varlen_attn)
    kwargs = {"enable_gqa": True} if gqa and "enable_gqa" in params else {}
    if "window_size" not in params:                       # the first releases: is_causal alone
        return {**kwargs, "is_causal": meta.max_q > 1}
    if meta.window is not None:
        return {**kwargs, "window_size": (meta.window - 1, 0)}
    return {**kwargs, "window_size": (-1, 0) if meta.max_q > 1 else (-1, -1)}

