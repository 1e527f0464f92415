"""One training forward: target features -> drafter blocks -> loss and diagnostics.

The drafter runs through the modules inference uses (`project_context`, `context_kv`,
`block_forward`, `confidence_logits`; the LM head and the Markov head's W2 are applied as in
`base_logits` / `markov_bias` minus their final fp32 cast, which the fused loss does chunk by
chunk; a test checks the logits against the inference API), so a trained checkpoint cannot be
fed a layout it never saw. All blocks of a batch go through one `block_forward`: each
block gathers its own sequence's context K/V (computed once per token, like the engine's cache)
with ctx_valid[n] = positions < its anchor (reference/dspark_algorithm.md §3.3, §5.2).

Vocabulary-sized tensors are built only for supervised slots, in slot-major order (all slot-0
rows, then slot 1, ...), which is the order the rnn head's left-to-right loop produces them in.

A drafter with a reduced draft vocabulary trains in it, as it will draft: its logits (LM-head rows
and Markov W2 alike) span V_draft only, so the target's full LM head is never multiplied or
back-propagated through by the drafter, and the teacher is the target's distribution renormalised
over the draft ids (the softmax of its logits at those ids), which is what the drafter can match.
A label outside the draft vocabulary cannot be drafted, so it leaves the CE term (its slot still
counts in the L1 and confidence terms) and is counted; a target argmax outside it is a greedy
miss, as it is at inference. The CE label is the response's token, or with
`LossWeights.ce_labels = "argmax"` the target's argmax at the same position (the teacher forcing
of the Markov head's previous token stays the response's).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.models.drafter import Drafter
from dspark.train.features import TargetFeatureExtractor
from dspark.train.fused_loss import fused_dspark_loss
from dspark.train.loss import (BlockBatch, LossOutput, LossWeights, expected_accept_length,
                               per_position_mean, position_weights)


@dataclass
class StepMetrics:
    accept: torch.Tensor          # [γ] mean c* per slot (acceptance estimate at T = 1)
    greedy_match: torch.Tensor    # [γ] argmax(draft) == argmax(target) rate per slot
    confidence: torch.Tensor      # [γ] mean sigmoid(z) per slot (0 without a head)
    slot_counts: torch.Tensor     # [γ] supervised slots per position (to pool batches)
    weight_sum: float             # Σ w over supervised slots (to pool the loss terms)
    supervised_slots: int         # M
    tokens: int                   # T: target tokens processed
    labels_outside: int = 0       # supervised labels outside the draft vocabulary (not in CE)


@dataclass
class DraftVocab:
    """The vocabulary a drafter trains in when it is not the target's: its LM-head rows and the
    id maps both ways."""
    weight: torch.Tensor          # [V_draft, d] the target LM-head rows of the draft ids
    index: torch.Tensor           # [V_draft] target id of each draft id, increasing
    lookup: torch.Tensor          # [V] draft id of each target id, -1 outside

    @classmethod
    def build(cls, weight: torch.Tensor, index: torch.Tensor, vocab_size: int) -> DraftVocab:
        lookup = torch.full((vocab_size,), -1, dtype=torch.long, device=index.device)
        lookup[index] = torch.arange(index.numel(), device=index.device)
        return cls(weight, index, lookup)

    @classmethod
    def of(cls, drafter: Drafter) -> DraftVocab | None:
        """The drafter's reduced draft vocabulary (None at full vocabulary)."""
        if not drafter.config.uses_draft_vocab:
            return None
        return cls.build(drafter.draft_lm_head_weight, drafter.draft_to_target_index,
                         drafter.config.vocab_size)

    def to_draft(self, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids -> (draft ids, 0 where outside; bool inside the draft vocabulary)."""
        ids = self.lookup[target_ids]
        inside = ids >= 0
        return ids.clamp_min(0), inside


@dataclass
class SupervisedSlots:
    """(block, slot) pairs of the supervised slots in slot-major order, M of them."""
    blocks: torch.Tensor          # [M] block index n
    slots: torch.Tensor           # [M] slot index k
    teacher_rows: torch.Tensor    # [U] distinct target rows needing teacher logits (sorted)
    teacher_index: torch.Tensor   # [M] row of each slot in teacher_rows


def supervised_slots(batch: BlockBatch) -> SupervisedSlots:
    slots, blocks = batch.supervised.t().nonzero(as_tuple=True)
    rows, index = torch.unique(batch.teacher_rows[blocks, slots], return_inverse=True)
    return SupervisedSlots(blocks, slots, rows, index)


def block_context(drafter: Drafter, aux_hidden: torch.Tensor,
                  batch: BlockBatch) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """aux [T, m*d] -> per draft layer ctx K/V [N, L, KVH, D] and ctx_valid [N, L].

    L is the furthest anchor: no block may see its anchor's own (not yet computed) features.
    """
    lengths = batch.seq_offsets[1:] - batch.seq_offsets[:-1]
    positions = torch.arange(batch.tokens.shape[0]) - torch.repeat_interleave(batch.seq_offsets[:-1], lengths)
    h_ctx = drafter.project_context(aux_hidden)                                   # [T, d]
    kv = drafter.context_kv(h_ctx, positions.to(h_ctx.device))                    # per layer [T, KVH, D]
    width = max(int(batch.anchor_pos.max()), 1)
    j = torch.arange(width)
    gather = (batch.seq_offsets[batch.seq_index][:, None] + j).clamp(max=batch.tokens.shape[0] - 1)
    valid = j[None, :] < batch.anchor_pos[:, None]                                # [N, L]
    dev = h_ctx.device
    gather = gather.to(dev)
    return [k[gather] for k, _ in kv], [v[gather] for _, v in kv], valid.to(dev)


@dataclass
class DraftRows:
    """The drafter's outputs at the supervised slots (M rows, slot-major)."""
    base: torch.Tensor               # [M, V] U = lm_head(h), in the autocast dtype
    bias: torch.Tensor | None        # [M, V] Markov bias B (None without a Markov head)
    conf_logits: torch.Tensor | None  # [M] confidence logits z

    def corrected(self) -> torch.Tensor:
        """[M, V] fp32 U + B, the draft logits inference samples from."""
        return self.base.float() if self.bias is None else self.base.float() + self.bias.float()


def draft_rows(drafter: Drafter, h_block: torch.Tensor, batch: BlockBatch,
               sel: SupervisedSlots, vocab: DraftVocab | None = None) -> DraftRows:
    """Base logits, Markov bias and confidence logits at the supervised slots, over the draft
    vocabulary (`vocab`, by default the drafter's own).

    U is `drafter.lm_head(h)`, or the draft vocabulary's rows of it, kept in the matmul's dtype:
    `Drafter.base_logits` is the same product cast to fp32, a copy the fused loss makes chunk by
    chunk instead.
    """
    cfg = drafter.config
    vocab = vocab if vocab is not None else DraftVocab.of(drafter)
    h = drafter.draft_hidden(h_block)                                             # [N, γ, d]
    dev = h.device
    blocks, slots = sel.blocks.to(dev), sel.slots.to(dev)
    h_sel = h[blocks, slots]                                                      # [M, d]
    if vocab is None:
        base = drafter.lm_head(h_sel.to(drafter.lm_head.weight.dtype))            # [M, V]
    else:
        base = F.linear(h_sel.to(vocab.weight.dtype), vocab.weight)               # [M, V_draft]
    e = bias = None
    if cfg.markov_rank > 0:
        prev = batch.prev_ids.to(dev)
        e = drafter.markov_embed(prev[blocks, slots])                             # [M, r]
        if cfg.markov_head_type == "rnn":
            bias = _rnn_bias(drafter, h_block, h, prev, batch, sel)
        else:
            bias = _stateless_bias(drafter, e, h_sel)
    conf = drafter.confidence_logits(h_sel, e) if cfg.enable_confidence_head else None
    return DraftRows(base, bias, conf)


def _stateless_bias(drafter: Drafter, e: torch.Tensor, h_k: torch.Tensor) -> torch.Tensor:
    """`Drafter.markov_bias` for the vanilla and gated heads without its final fp32 cast (an
    [M, V] copy each way); the export test checks both give the same logits."""
    head = drafter.markov_head
    if head.head_type == "vanilla":
        return head.markov_w2(e)
    gate = torch.sigmoid(head.gate_proj(torch.cat([h_k.to(e.dtype), e], dim=-1)))
    return head.markov_w2(gate * e)


def _rnn_bias(drafter: Drafter, h_block: torch.Tensor, h: torch.Tensor, prev: torch.Tensor,
              batch: BlockBatch, sel: SupervisedSlots) -> torch.Tensor:
    """The recurrent head needs every earlier slot's state: run it left to right over all blocks
    (teacher-forced), keeping each slot's bias only on its supervised rows."""
    anchors = batch.block_ids[:, 0].to(h.device)
    state = drafter.init_markov_state(h_block, anchors)
    out = []
    for k in range(h.shape[1]):
        bias, state = drafter.markov_bias(drafter.markov_embed(prev[:, k]), h[:, k], state)
        out.append(bias[batch.supervised[:, k].to(h.device)])
    return torch.cat(out)


def _grid(values: torch.Tensor, sel: SupervisedSlots, batch: BlockBatch) -> torch.Tensor:
    """[M] slot-major values -> [N, γ] (zeros where unsupervised)."""
    grid = torch.zeros(batch.supervised.shape, dtype=torch.float32)
    grid[sel.blocks, sel.slots] = values.detach().float().cpu()
    return grid


def training_forward(drafter: Drafter, extractor: TargetFeatureExtractor, batch: BlockBatch,
                     alphas: LossWeights, autocast: bool, keys: Sequence[Hashable] | None = None,
                     vocab: DraftVocab | None = None) -> tuple[LossOutput, StepMetrics]:
    """Run target and drafter over one batch; the loss is ready for backward. `keys` name the
    batch's sequences for the extractor's feature cache; `vocab` is the draft vocabulary to train
    in (by default the drafter's own: its reduced one, or none)."""
    vocab = vocab if vocab is not None else DraftVocab.of(drafter)
    sel = supervised_slots(batch)
    feats = extractor(batch.tokens, batch.seq_offsets, sel.teacher_rows, keys)
    dev = feats.aux_hidden.device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        ctx_k, ctx_v, valid = block_context(drafter, feats.aux_hidden, batch)
        h_block = drafter.block_forward(batch.block_ids.to(dev), batch.positions.to(dev), ctx_k,
                                        ctx_v, valid)
        rows = draft_rows(drafter, h_block, batch, sel, vocab)
    with torch.no_grad():
        target_argmax = feats.teacher_logits.argmax(-1)
        logits = feats.teacher_logits if vocab is None else feats.teacher_logits[:, vocab.index]
        teacher = torch.softmax(logits, dim=-1)                                   # [U, V_draft]
    index = sel.teacher_index.to(dev)
    weights = position_weights(batch.supervised.shape[1], alphas.decay).to(dev)[sel.slots.to(dev)]
    top, label_mask, outside = target_argmax[index], None, 0
    labels = top if alphas.ce_labels == "argmax" else \
        batch.labels.to(dev)[sel.blocks.to(dev), sel.slots.to(dev)]
    if vocab is not None:
        labels, label_mask = vocab.to_draft(labels)
        top, top_inside = vocab.to_draft(top)
        outside = int((~label_mask).sum())
    out, top_match = fused_dspark_loss(rows.base, rows.bias, teacher, index, labels,
                                       rows.conf_logits, weights, top, alphas,
                                       label_mask=label_mask)
    if vocab is not None:
        top_match = top_match & top_inside
    match = top_match.float()
    sup = batch.supervised
    conf = rows.conf_logits
    metrics = StepMetrics(
        accept=per_position_mean(_grid(out.accept, sel, batch), sup),
        greedy_match=per_position_mean(_grid(match, sel, batch), sup),
        confidence=per_position_mean(_grid(torch.sigmoid(conf), sel, batch), sup)
        if conf is not None else torch.zeros(sup.shape[1]),
        slot_counts=sup.sum(0), weight_sum=float(weights.sum()),
        supervised_slots=int(sel.blocks.numel()), tokens=int(batch.tokens.numel()),
        labels_outside=outside)
    return out, metrics


class MetricPool:
    """Pools batches: loss terms weighted by their Σw, per-slot rates by their slot counts, so a
    pooled number is the one a single batch holding all of them would have given."""

    def __init__(self, gamma: int):
        self.terms = torch.zeros(4, dtype=torch.float64)            # total, ce, l1, conf (x Σw)
        self.weight = 0.0
        self.rates = torch.zeros(3, gamma, dtype=torch.float64)     # accept, greedy, confidence
        self.counts = torch.zeros(gamma, dtype=torch.float64)
        self.tokens = self.slots = self.labels_outside = 0

    def add(self, out: LossOutput, m: StepMetrics) -> None:
        w = m.weight_sum
        self.terms += torch.tensor([float(out.total.detach()), float(out.ce), float(out.l1), float(out.conf)],
                                   dtype=torch.float64) * w
        self.weight += w
        counts = m.slot_counts.double()
        self.rates += torch.stack([m.accept, m.greedy_match, m.confidence]).double() * counts
        self.counts += counts
        self.tokens += m.tokens
        self.slots += m.supervised_slots
        self.labels_outside += m.labels_outside

    def summary(self) -> dict:
        terms = (self.terms / max(self.weight, 1e-12)).tolist()
        accept, greedy, conf = (self.rates / self.counts.clamp_min(1.0)).float()
        return {"loss": terms[0], "ce": terms[1], "l1": terms[2], "conf": terms[3],
                "accept": [round(x, 4) for x in accept.tolist()],
                "greedy_match": [round(x, 4) for x in greedy.tolist()],
                "confidence": [round(x, 4) for x in conf.tolist()],
                "tau": float(expected_accept_length(accept)),
                "tau_greedy": float(expected_accept_length(greedy)),
                "tokens": self.tokens, "slots": self.slots, "labels_outside": self.labels_outside}
