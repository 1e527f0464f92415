"""The draft stage: one parallel block pass, then the Markov head left to right.

The drafter's context K/V live in the same paged blocks as the target's (same block tables, same
slots): every step appends the K/V of every row the target just processed.  Rows past the
accepted prefix hold stale K/V, but a block only ever attends to positions before its anchor,
all of which were written by committed tokens, so no rollback write is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from dspark.models.drafter import Drafter
from dspark.models.layers.attention import gather_blocks, write_kv
from dspark.spec.sampler import SamplingTensors, global_exponentials, keyed_exponentials, keyed_gumbels
from dspark.spec.types import DraftProposal

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
BlockPass = Callable[..., tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]]   # `block_pass`


class FusedDraft(Protocol):
    """The drafter's layers as one kernel call each, where the runner has them
    (runner/fused_cpu.py); every function here takes it as an argument, None: the modules."""

    def takes(self, num_rows: int) -> bool: ...

    def append_context(self, drafter: Drafter, kv: KVCaches, aux_hidden: torch.Tensor,
                       positions: torch.Tensor, write_rows: torch.Tensor | None,
                       write_slots: torch.Tensor) -> None: ...

    def block_forward(self, drafter: Drafter, block_ids: torch.Tensor, positions: torch.Tensor,
                      kv: KVCaches, block_tables: torch.Tensor, starts: torch.Tensor,
                      block_size: int) -> torch.Tensor: ...

    def markov_greedy(self, drafter: Drafter, h: torch.Tensor, base: torch.Tensor,
                      anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...


def append_context(drafter: Drafter, kv: KVCaches, aux_hidden: torch.Tensor, positions: torch.Tensor,
                   write_rows: torch.Tensor | None, write_slots: torch.Tensor,
                   fused: FusedDraft | None = None) -> None:
    """aux_hidden [T, m*d_t] of the target rows just run -> each draft layer's context K/V
    (one kernel call per layer where `fused` takes the rows)."""
    if fused is not None and fused.takes(aux_hidden.shape[0]):
        fused.append_context(drafter, kv, aux_hidden, positions, write_rows, write_slots)
        return
    h_ctx = drafter.project_context(aux_hidden)                       # [T, d]
    for (k_cache, v_cache), (k, v) in zip(kv, drafter.context_kv(h_ctx, positions)):
        write_kv(k_cache, write_rows, write_slots, k)
        write_kv(v_cache, write_rows, write_slots, v)


def propose(drafter: Drafter, kv: KVCaches, anchors: torch.Tensor, starts: torch.Tensor,
            block_tables: torch.Tensor, block_size: int, st: SamplingTensors,
            kv_len: int | None = None, run_block: BlockPass | None = None,
            fused: FusedDraft | None = None) -> DraftProposal:
    """anchors/starts [R] (x0 and its position), block_tables [R, NB] -> γ drafts per request.

    `kv_len` is how many context keys to gather (default: the longest context, read with one
    device sync); a padded replay passes whole pages instead, known on the host. `run_block` runs
    the block pass (default: `block_pass` as it is; the compile backend passes its compiled form).
    A block pass `fused` takes (runner/fused_cpu.py: a few bf16 rows on an AVX512-BF16 CPU)
    runs there instead, reading the context in place.
    """
    cfg = drafter.config
    r, slots = anchors.shape[0], cfg.num_block_slots
    block_ids = torch.full((r, slots), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
    block_ids[:, 0] = anchors
    positions = starts[:, None] + torch.arange(slots, device=anchors.device)[None, :]   # [R, S]
    if fused is not None and fused.takes(r * slots):
        h_block = fused.block_forward(drafter, block_ids, positions, kv, block_tables, starts, block_size)
        h, base, state = block_outputs(drafter, h_block, anchors)
        return _markov_loop(drafter, h, base, anchors, state, st, fused)
    if kv_len is None:
        kv_len = max(int(starts.max()), 1)
    ctx_k = [gather_blocks(k, block_tables, block_size, kv_len).transpose(1, 2) for k, _ in kv]
    ctx_v = [gather_blocks(v, block_tables, block_size, kv_len).transpose(1, 2) for _, v in kv]
    ctx_valid = torch.arange(kv_len, device=anchors.device)[None, :] < starts[:, None]  # [R, L]
    h, base, state = (run_block or block_pass)(drafter, block_ids, positions, ctx_k, ctx_v, ctx_valid,
                                               anchors)
    return _markov_loop(drafter, h, base, anchors, state, st, fused)


def block_pass(drafter: Drafter, block_ids: torch.Tensor, positions: torch.Tensor,
               ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor], ctx_valid: torch.Tensor,
               anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backbone over every block, then the base logits: the part of a draft step whose shapes
    are fixed by the request count (and the context length L), so the part a graph compiles.

    block_ids/positions [R, S]; ctx_k/ctx_v per layer [R, L, KVH, D]; ctx_valid [R, L]
    -> (h [R, γ, d], base logits fp32 [R, γ, V_draft], Markov state entering draft 1 or None).
    """
    h_block = drafter.block_forward(block_ids, positions, ctx_k, ctx_v, ctx_valid)    # [R, S, d]
    return block_outputs(drafter, h_block, anchors)


def block_outputs(drafter: Drafter, h_block: torch.Tensor, anchors: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """h_block [R, S, d] -> (h [R, γ, d], base logits fp32 [R, γ, V_draft], Markov state or None)."""
    h = drafter.draft_hidden(h_block)                                                  # [R, γ, d]
    return h, drafter.base_logits(h), drafter.init_markov_state(h_block, anchors)


def _markov_loop(drafter: Drafter, h: torch.Tensor, base: torch.Tensor, anchors: torch.Tensor,
                 state: torch.Tensor | None, st: SamplingTensors,
                 fused: FusedDraft | None = None) -> DraftProposal:
    """base [R, γ, V_draft]; sample x_k from softmax((U_k + B_k) / T) given x_{k-1}. A greedy
    step's vanilla head runs as one kernel call where the drafter's fused layers run. So does a
    step whose sampled rows are all seeded: they race on their positions' noise (verify.py needs
    no q for them), which is the greedy loop on logits plus T times Gumbel noise. Other sampled
    steps set up noise and buffers once (`_DraftSampler`), so each position adds only the head's
    step, one softmax and one race."""
    cfg = drafter.config
    raced = not st.all_greedy and all(key is not None or g for key, g in zip(st.keys, st.greedy_host))
    if raced:           # argmax(z / T + G) = argmax(z + T G): the greedy loop on noised logits
        base = base + _draft_gumbels(drafter, st, base.shape[0], base.shape[1], base.device)
    greedy = fused.markov_greedy(drafter, h, base, anchors) if (st.all_greedy or raced) and fused is not None \
        else None
    if greedy is not None:
        return DraftProposal(tokens=greedy[0], probs=None,
                             confidence_logits=greedy[1] if cfg.enable_confidence_head else None)
    sampler = None if st.all_greedy or raced else _DraftSampler.start(drafter, st, anchors.shape[0], h.shape[1],
                                                                      base.device)
    tokens, conf = [], []
    prev = anchors
    for k in range(h.shape[1]):
        e = drafter.markov_embed(prev) if cfg.markov_rank > 0 else None
        logits = base[:, k]
        if e is not None:
            bias, state = drafter.markov_bias(e, h[:, k], state)
            logits = logits + bias.float()
        if cfg.enable_confidence_head:
            conf.append(drafter.confidence_logits(h[:, k], e).float())
        if sampler is None:                     # the argmax over V_draft, no [R, V] scatter
            prev = drafter.to_target_ids(logits.argmax(-1))
        else:
            prev = sampler.draw(k, logits)
        tokens.append(prev)
    return DraftProposal(tokens=torch.stack(tokens, 1),
                         probs=None if sampler is None else sampler.q.transpose(0, 1),
                         confidence_logits=torch.stack(conf, 1) if conf else None)


@dataclass
class _DraftSampler:
    """A sampled block's state, made once before the Markov loop: the noise of every position,
    q's buffers, and whether any row is greedy (only then is a greedy argmax taken). Each row
    samples q = softmax(logits / T) exactly, as the first maximum of q / E over the draft
    vocabulary (q is 0 elsewhere, and the draft ids list their target ids in increasing order,
    so it is the maximum over V, ties included)."""
    drafter: Drafter
    temperature: torch.Tensor             # [R, 1]
    noise: torch.Tensor                   # [R, γ, V_draft] Exp(1)
    q: torch.Tensor                       # [γ, R, V] each position's q, written in place
    scattered: torch.Tensor | None        # [γ, R, V] -inf outside the draft vocabulary; None at full
    columns: torch.Tensor | None          # [R, V_draft] the target id of each draft column
    greedy: torch.Tensor | None           # [R] bool; None when no row is greedy

    @classmethod
    def start(cls, drafter: Drafter, st: SamplingTensors, r: int, gamma: int,
              device: torch.device) -> "_DraftSampler":
        v, draft_vocab = drafter.config.vocab_size, drafter.config.uses_draft_vocab
        scattered = torch.full((gamma, r, v), float("-inf"), dtype=torch.float32, device=device) \
            if draft_vocab else None
        columns = drafter.draft_to_target_index.expand(r, -1) if draft_vocab else None
        return cls(drafter=drafter, temperature=st.temperature[:, None],
                   noise=_draft_noise(drafter, st, r, gamma, device),
                   q=torch.empty(gamma, r, v, dtype=torch.float32, device=device), scattered=scattered,
                   columns=columns,
                   greedy=st.greedy if any(st.greedy_host) else None)

    def draw(self, k: int, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V_draft] of position k -> drafts [R] (target ids); fills q[k] [R, V].
        Dividing before the scatter gives the bits dividing the scattered row gave (-inf / T
        stays -inf), and a softmax into a contiguous row gives the bits of one that allocates."""
        drafter = self.drafter
        z = logits / self.temperature                                                 # [R, V_draft]
        if self.columns is not None:
            z = self.scattered[k].scatter_(1, self.columns, z)                      # [R, V]
        q = torch.softmax(z, dim=-1, out=self.q[k])
        q_draft = q if self.columns is None else q.index_select(1, drafter.draft_to_target_index)
        sampled = drafter.to_target_ids((q_draft / self.noise[:, k]).argmax(-1))
        if self.greedy is None:
            return sampled
        return torch.where(self.greedy, drafter.to_target_ids(logits.argmax(-1)), sampled)


def _draft_noise(drafter: Drafter, st: SamplingTensors, r: int, gamma: int,
                 device: torch.device) -> torch.Tensor:
    """Exp(1) noise [R, γ, V_draft] for the whole block, drawn before the loop. A seeded row's
    draft k reads the noise its target row k reads in verification (the noise of that position,
    sampler.NoiseKey) at the draft vocabulary's columns: drafter and target race on the same
    noise (the target on its Gumbel form), so a draft is accepted when the target draws it too.
    Unseeded rows draw the draft vocabulary's columns alone, together. Greedy rows' noise is
    never read."""
    columns = drafter.draft_to_target_index if drafter.config.uses_draft_vocab else None
    width = drafter.config.draft_vocab_size if columns is not None else drafter.config.vocab_size
    seeded = [(row, key) for row, key in enumerate(st.keys[:r]) if key is not None and not st.greedy_host[row]]
    if not seeded:
        return global_exponentials((r, gamma, width), device)
    noise = torch.empty(r, gamma, width, device=device)
    free = [row for row in range(r) if st.keys[row] is None and not st.greedy_host[row]]
    if free:
        noise[free] = global_exponentials((len(free), gamma, width), device)
    for row, key in seeded:
        noise[row] = keyed_exponentials(key, gamma, drafter.config.vocab_size, device, columns)
    return noise


def _draft_gumbels(drafter: Drafter, st: SamplingTensors, r: int, gamma: int,
                   device: torch.device) -> torch.Tensor:
    """T times the Gumbel noise [R, γ, V_draft] each seeded row's target row k races on in
    verification, at the draft vocabulary's columns; 0 on greedy rows."""
    columns = drafter.draft_to_target_index if drafter.config.uses_draft_vocab else None
    width = drafter.config.draft_vocab_size if columns is not None else drafter.config.vocab_size
    noise = torch.zeros(r, gamma, width, device=device)
    for row, key in enumerate(st.keys[:r]):
        if key is not None and not st.greedy_host[row]:
            noise[row] = keyed_gumbels(key, gamma, drafter.config.vocab_size, device, columns)
    return noise.mul_(st.temperature[:, None, None])
