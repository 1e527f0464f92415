"""Anchor sampling, block construction and the DSpark training objective.

Follows reference/dspark_algorithm.md §5.2-5.3 (DeepSpec's code where paper and code differ):

* An anchor is a position a with loss_mask[a] and loss_mask[a+1]: the anchor and its first label
  are response tokens. At inference the anchor is always a token the target produced.
* Block slot k (0-based, k = 0..γ-1) has input [y_a, MASK, ...], position a+k, label y_{a+k+1},
  Markov previous token y_{a+k} (teacher forcing) and teacher distribution
  softmax(lm_head(final hidden at position a+k)) -- the target's prediction of that same label.
* Slot k is supervised only while the labels y_{a+1..a+k+1} all exist and are response tokens
  (the contiguous prefix a draft must survive to be accepted).
* Weights w_k = exp(-k / 4) with k the 0-based slot (DeepSpec `loss_decay_gamma = 4.0`; the
  paper's exp(-(k-1)/γ) with 1-based k is not what the released models used), each term
  normalised by the sum of weights over the whole batch:
  L = 0.1 CE(corrected logits, y) + 0.9 ||p_d - p_t||_1 + 1.0 BCE(z, clamp(1 - ½||p_d - p_t||_1)),
  the full L1 (= 2 TV) as DeepSpec computes it, p_d = softmax(U + B) Markov-corrected, and the
  confidence target detached.
* In a reduced draft vocabulary (forward.py) every distribution is over the draft ids, the
  teacher renormalised over them, and a label outside them drops out of the CE mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


CE_LABELS = ("sampled", "argmax")


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1        # α_ce
    l1: float = 0.9        # α_tv (applied to the full L1 distance)
    conf: float = 1.0      # α_conf
    decay: float = 4.0     # w_k = exp(-k / decay), k the 0-based slot
    ce_labels: str = "sampled"   # CE on the response's token y_{a+k+1}, or on the target's argmax
                                 # at a+k ("argmax": what greedy verification accepts)

    def __post_init__(self) -> None:
        if self.ce_labels not in CE_LABELS:
            raise ValueError(f"ce_labels must be one of {CE_LABELS}, not {self.ce_labels!r}")


@dataclass
class BlockBatch:
    """All blocks of a batch of sequences, flattened (T tokens, N blocks, γ slots)."""
    tokens: torch.Tensor        # [T] the batch's sequences concatenated
    seq_offsets: torch.Tensor   # [B+1] start of each sequence in `tokens`
    seq_index: torch.Tensor     # [N] sequence of each block
    anchor_pos: torch.Tensor    # [N] anchor position inside its sequence
    block_ids: torch.Tensor     # [N, γ] [anchor, MASK, ..., MASK]
    positions: torch.Tensor     # [N, γ] anchor_pos + k
    labels: torch.Tensor        # [N, γ] y_{a+k+1} (clamped where unsupervised)
    prev_ids: torch.Tensor      # [N, γ] y_{a+k}: the Markov head's teacher-forced previous token
    supervised: torch.Tensor    # [N, γ] bool
    teacher_rows: torch.Tensor  # [N, γ] row of position a+k in `tokens` (teacher hidden)

    @property
    def num_blocks(self) -> int:
        return self.anchor_pos.shape[0]


@dataclass
class LossOutput:
    total: torch.Tensor     # scalar
    ce: torch.Tensor        # scalar, weighted mean
    l1: torch.Tensor        # scalar, weighted mean of the full L1 distance
    conf: torch.Tensor      # scalar, weighted mean BCE (0 without a confidence head)
    accept: torch.Tensor    # [M] c* = clamp(1 - ½ L1, 0, 1), detached


# ---- anchors and blocks --------------------------------------------------------------------------

def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[S] bool -> positions a in [0, S-2] with loss_mask[a] and loss_mask[a+1]."""
    m = loss_mask.bool()
    return (m[:-1] & m[1:]).nonzero().flatten()


def sample_anchor_positions(loss_mask: torch.Tensor, num_anchors: int,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to `num_anchors` distinct valid anchors drawn uniformly, sorted ([A] int64).

    Fewer valid anchors than asked means all of them (DeepSpec pads with masked dummies to keep
    a static shape; the padding would only cost time here).
    """
    valid = valid_anchor_positions(loss_mask)
    if valid.numel() <= num_anchors:
        return valid
    pick = torch.randperm(valid.numel(), generator=generator)[:num_anchors]
    return valid[pick].sort().values


def supervision_mask(anchor_pos: torch.Tensor, loss_mask: torch.Tensor, gamma: int) -> torch.Tensor:
    """[A] anchors, [S] mask -> [A, γ] bool: slot k supervised iff labels 1..k+1 are all in range
    and in the response (a cumulative product, as DeepSpec's `build_eval_mask`)."""
    s = loss_mask.shape[0]
    label_pos = anchor_pos[:, None] + 1 + torch.arange(gamma, device=anchor_pos.device)  # [A, γ]
    ok = (label_pos < s) & loss_mask.bool()[label_pos.clamp(max=s - 1)]
    return ok.long().cumprod(dim=1).bool()


def position_weights(gamma: int, decay: float = 4.0) -> torch.Tensor:
    """[γ] exp(-k / decay) for 0-based slot k: [1, .779, .607, ...] at decay 4."""
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / decay)


def block_inputs(tokens: torch.Tensor, anchor_pos: torch.Tensor, gamma: int,
                 mask_token_id: int) -> tuple[torch.Tensor, ...]:
    """One sequence [S] and its anchors [A] -> block_ids, positions, labels, prev_ids, each [A, γ].

    Indices past the sequence end are clamped; `supervision_mask` masks those slots out.
    """
    s = tokens.shape[0]
    k = torch.arange(gamma, device=anchor_pos.device)
    positions = anchor_pos[:, None] + k                                         # a + k
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = tokens[anchor_pos]
    labels = tokens[(positions + 1).clamp(max=s - 1)]                           # y_{a+k+1}
    prev_ids = tokens[positions.clamp(max=s - 1)]                               # y_{a+k}
    return block_ids, positions, labels, prev_ids


def build_block_batch(sequences: list[torch.Tensor], loss_masks: list[torch.Tensor], gamma: int,
                      mask_token_id: int, anchors_per_seq: int,
                      generator: torch.Generator | None = None) -> BlockBatch:
    """Sample anchors in every sequence and lay the blocks out flat."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "seq", "anchor", "ids", "pos", "labels", "prev", "sup", "rows")}
    offset = 0
    for b, (tokens, mask) in enumerate(zip(sequences, loss_masks)):
        anchors = sample_anchor_positions(mask, anchors_per_seq, generator)
        ids, pos, labels, prev = block_inputs(tokens, anchors, gamma, mask_token_id)
        parts["seq"].append(torch.full_like(anchors, b))
        parts["anchor"].append(anchors)
        parts["ids"].append(ids)
        parts["pos"].append(pos)
        parts["labels"].append(labels)
        parts["prev"].append(prev)
        parts["sup"].append(supervision_mask(anchors, mask, gamma))
        parts["rows"].append(offset + pos.clamp(max=tokens.shape[0] - 1))
        offset += tokens.shape[0]
    lengths = torch.tensor([0] + [t.shape[0] for t in sequences])
    cat = {k: torch.cat(v) for k, v in parts.items()}
    return BlockBatch(tokens=torch.cat(sequences), seq_offsets=lengths.cumsum(0),
                      seq_index=cat["seq"], anchor_pos=cat["anchor"], block_ids=cat["ids"],
                      positions=cat["pos"], labels=cat["labels"], prev_ids=cat["prev"],
                      supervised=cat["sup"], teacher_rows=cat["rows"])


# ---- loss terms ----------------------------------------------------------------------------------

def l1_distance(p_draft: torch.Tensor, p_target: torch.Tensor) -> torch.Tensor:
    """[M, V] x2 -> [M] ||p_d - p_t||_1 (= 2 TV)."""
    return (p_draft - p_target).abs().sum(dim=-1)


def acceptance_target(l1: torch.Tensor) -> torch.Tensor:
    """c* = clamp(1 - ½ L1, 0, 1) = Σ_v min(p_d, p_t), the analytical acceptance rate; detached."""
    return (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1e-12)


def dspark_loss(logits: torch.Tensor, teacher_probs: torch.Tensor, labels: torch.Tensor,
                conf_logits: torch.Tensor | None, weights: torch.Tensor,
                alphas: LossWeights = LossWeights(),
                label_mask: torch.Tensor | None = None) -> LossOutput:
    """Supervised slots only: logits/teacher [M, V] fp32, labels [M], conf [M], weights [M].

    `label_mask` [M] bool keeps a row in the CE term (a label outside a reduced draft vocabulary
    has no logit to raise); the CE mean is then over the kept rows. Unset, every row is kept."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    ce = -log_p.gather(1, labels[:, None]).squeeze(1)                            # [M]
    l1 = l1_distance(log_p.exp(), teacher_probs)                                  # [M]
    accept = acceptance_target(l1)
    ce_weights = weights if label_mask is None else weights * label_mask
    ce_mean, l1_mean = weighted_mean(ce, ce_weights), weighted_mean(l1, weights)
    total = alphas.ce * ce_mean + alphas.l1 * l1_mean
    conf_mean = torch.zeros((), device=logits.device)
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
        conf_mean = weighted_mean(bce, weights)
        total = total + alphas.conf * conf_mean
    return LossOutput(total=total, ce=ce_mean.detach(), l1=l1_mean.detach(),
                      conf=conf_mean.detach(), accept=accept)


# ---- diagnostics (§5.5) --------------------------------------------------------------------------

def per_position_mean(values: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
    """values/supervised [N, γ] -> [γ] mean over the supervised slots of each position (0 if none)."""
    mask = supervised.float()
    return (values.float() * mask).sum(0) / mask.sum(0).clamp_min(1.0)


def expected_accept_length(acc: torch.Tensor) -> torch.Tensor:
    """τ = 1 + Σ_k Π_{j<=k} acc_j: accepted drafts per round plus the bonus token."""
    return 1.0 + torch.cumprod(acc.float(), dim=0).sum()
