"""`dspark prune-vocab`: give a trained full-vocabulary drafter a reduced draft vocabulary.

Most of a small drafter's time goes to the vocabulary: the target's LM head over every draft row
and the Markov head's W2, each as wide as the vocabulary, and the argmax over it. A target's
answers use few of its tokens (SmolLM2 has 49152; a few thousand cover almost all of what it
writes), so the drafter may propose from those alone: its LM head becomes the target rows of the
kept ids and W2 their rows (both are per-token rows, so nothing is retrained), t2d/d2t map the
ids (the speculators format). Verification is unchanged and lossless; a target token outside the
kept set is simply never drafted. Which ids to keep is counted from the target's own greedy
answers to training-style prompts (not the held-out ones), or, given the training data, from
every response token it holds (the text the drafter is trained on, so the vocabulary it can be
trained in), topped up by id order (BPE merge order, roughly frequency) and always including the
end-of-sequence ids. Either way the coverage (the share of response tokens inside the kept set)
is reported on the counted split and on the held-out one, whose text chose nothing.
`full_vocab_state` goes back the other way, for a warm start of training from a pruned drafter.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections import Counter
from dataclasses import dataclass

import torch

from dspark.models.drafter import Drafter

logger = logging.getLogger(__name__)


def choose_vocab(counts: Counter, size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """Sorted ids: `always`, then the most counted, then the lowest ids, `size` in all."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"the draft vocabulary size must be in [1, {vocab_size}], got {size}")
    keep: list[int] = []
    seen: set[int] = set()
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    for t in [*always, *ranked, *range(vocab_size)]:
        if len(keep) == size:
            break
        if 0 <= t < vocab_size and t not in seen:
            seen.add(t)
            keep.append(t)
    return torch.tensor(sorted(keep), dtype=torch.long)


def prune_drafter(drafter: Drafter, keep: torch.Tensor) -> Drafter:
    """A copy of `drafter` that drafts from the target ids `keep` (sorted, unique) only."""
    cfg = drafter.config
    if cfg.uses_draft_vocab:
        raise ValueError("the drafter already has a reduced vocabulary; prune its full-vocabulary "
                         "original instead")
    if keep.numel() == 0 or not torch.all(keep[1:] > keep[:-1]):
        raise ValueError("the kept ids must be sorted and unique")
    small = Drafter(dataclasses.replace(cfg, draft_vocab_size=int(keep.numel())),
                    drafter.embed_tokens, drafter.lm_head).to(drafter.fc.weight.dtype)
    state = {k: v for k, v in drafter.state_dict().items()}
    if cfg.markov_rank > 0:
        w2 = "markov_head.markov_w2.weight"
        state[w2] = state[w2][keep]                                   # [V_draft, r]
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[keep] = True
    state["t2d"] = t2d
    state["d2t"] = keep - torch.arange(keep.numel())
    small.load_state_dict(state)
    small.bind_draft_vocab()
    return small


def full_vocab_state(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The state of a full-vocabulary drafter from one with a reduced draft vocabulary: the
    Markov head's W2 rows go back to their target ids, and the rows of the ids pruning dropped
    start at zero (no bias: the pruned drafter never proposed those tokens, and training learns
    them). Every other weight is per-token along the target vocabulary already, or not at all."""
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("t2d", "d2t")}
    w2 = "markov_head.markov_w2.weight"
    if w2 in state:
        full = state[w2].new_zeros(drafter.config.vocab_size, state[w2].shape[1])    # [V, r]
        full[drafter.draft_to_target_index] = state[w2]
        state[w2] = full
    return state


@dataclass
class TokenCounts:
    """Response-token counts of the split that chooses the vocabulary and of the held-out one,
    with the words the model card uses for each."""
    train: Counter
    heldout: Counter
    train_source: str
    heldout_source: str


def response_token_counts(data_dir: str, heldout: bool) -> tuple[Counter, int]:
    """Counts of every response token of one split of the training data (whole responses: the
    training's length cap and minimum do not apply), and the number of responses."""
    from dspark.train.data import load_samples
    samples = load_samples(data_dir, heldout, max_len=sys.maxsize, min_loss_tokens=0)
    if not samples:
        return Counter(), 0
    counts = torch.bincount(torch.cat([s.tokens[s.loss_mask] for s in samples]))
    ids = counts.nonzero().flatten()
    return Counter(dict(zip(ids.tolist(), counts[ids].tolist()))), len(samples)


def data_counts(data_dir: str, extra_dirs: tuple[str, ...] = ()) -> TokenCounts:
    """The training responses of `data_dir` and of every extra folder a run trains on (a
    vocabulary counted on the first folder alone misses what the others add, e.g. code beside
    chat); the held-out ones of `data_dir`, which rules the split."""
    train, n_train = response_token_counts(data_dir, heldout=False)
    for extra in extra_dirs:
        more, n_more = response_token_counts(extra, heldout=False)
        train, n_train = train + more, n_train + n_more
    held, n_held = response_token_counts(data_dir, heldout=True)
    if not train:
        raise ValueError(f"{data_dir!r} holds no training responses to count")
    folders = ", ".join(f"`{d}`" for d in (data_dir, *extra_dirs))
    return TokenCounts(train, held, f"the {n_train} training responses in {folders}",
                       f"the {n_held} held-out responses")


def count_answer_tokens(llm, prompts: list[list[int]], max_tokens: int) -> Counter:
    """Token counts of the target's greedy answers (plain decoding)."""
    from dspark.sampling_params import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    return Counter(t for o in outs for t in o.token_ids)


def coverage(counts: Counter, keep: torch.Tensor) -> float:
    kept = set(keep.tolist())
    total = sum(counts.values())
    return sum(n for t, n in counts.items() if t in kept) / total if total else 0.0


def answer_counts(llm, args) -> TokenCounts:
    """Counts of the target's greedy answers to training prompts and to held-out ones."""
    from dspark.train.data import GenerateConfig, encode_prompt
    from dspark.train.prompts import build_prompts, is_heldout
    prompts = build_prompts(2 * args.num_prompts, seed=args.seed)
    split = {False: [], True: []}
    fraction = GenerateConfig("").heldout_fraction
    for p in prompts:
        split[is_heldout(p.group, fraction, args.seed)].append(encode_prompt(llm.tokenizer, p))
    train, held = split[False][:args.num_prompts], split[True][:max(8, args.num_prompts // 8)]
    return TokenCounts(count_answer_tokens(llm, train, args.max_tokens),
                       count_answer_tokens(llm, held, args.max_tokens),
                       f"its greedy answers to {len(train)} training prompts",
                       f"its answers to {len(held)} held-out prompts")


def coverage_note(counts: TokenCounts, keep: torch.Tensor, vocab_size: int, command: str) -> str:
    """The model card's paragraph on the reduced vocabulary: where it came from, its coverage."""
    return (f"\n## Reduced draft vocabulary\n\n`{command}`: the drafter proposes from "
            f"{keep.numel()} of the target's {vocab_size} tokens, the ones {counts.train_source} "
            f"used most ({sum(counts.train.values())} tokens), then the lowest ids. They cover "
            f"{coverage(counts.train, keep):.1%} of those tokens and "
            f"{coverage(counts.heldout, keep):.1%} of the {sum(counts.heldout.values())} tokens of "
            f"{counts.heldout_source} (coverage: the share of response tokens inside the draft "
            f"vocabulary).\n")


def run_prune(args) -> None:
    """The `dspark prune-vocab` command: count, prune, save (config, weights, model card)."""
    import os
    import shutil

    from dspark.config import SpecConfig
    from dspark.llm import LLM
    from dspark.models.drafter_loader import load_drafter
    from dspark.train.export import save_speculators
    spec = SpecConfig(drafter=args.drafter)
    spec.resolve_embedded(args.model)
    source = spec.drafter
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, drafter=None,
              max_num_seqs=args.max_num_seqs,
              graph="eager" if args.data_dir else "auto")    # counting a data folder's tokens runs no step
    data_dir = args.data_dir
    counts = data_counts(data_dir) if data_dir else answer_counts(llm, args)
    vocab_size = llm.engine.model_config.vocab_size
    keep = choose_vocab(counts.train, args.size, vocab_size, llm.engine.eos_token_ids)
    logger.info("draft vocabulary of %d tokens: coverage %.2f%% on %s, %.2f%% on %s", args.size,
                100 * coverage(counts.train, keep), counts.train_source,
                100 * coverage(counts.heldout, keep), counts.heldout_source)
    model = llm.engine.worker.model
    drafter = load_drafter(source, llm.engine.model_config, model.embed_tokens, model.lm_head,
                           llm.engine.config.torch_dtype)
    small = prune_drafter(drafter, keep)
    save_speculators(small, args.out, verifier_name_or_path=_verifier(source),
                     verifier_architectures=(llm.engine.model_config.architecture,))
    for name in ("README.md", "training_curves.png"):
        if os.path.isfile(os.path.join(source, name)) and not os.path.samefile(source, args.out):
            shutil.copy(os.path.join(source, name), os.path.join(args.out, name))
    command = (f"dspark prune-vocab --size {args.size} --data-dir {data_dir}" if data_dir else
               f"dspark prune-vocab --size {args.size} --num-prompts {args.num_prompts} "
               f"--max-tokens {args.max_tokens}")
    note = coverage_note(counts, keep, vocab_size, command)
    with open(os.path.join(args.out, "README.md"), "a") as f:
        f.write(note)
    print(note.strip())
    print(f"wrote {args.out}; refit its calibration: dspark calibrate --drafter {args.out} "
          f"--out {os.path.join(args.out, 'sts.json')}")


def _verifier(source: str) -> str | None:
    import json
    import os
    with open(os.path.join(source, "config.json")) as f:
        return json.load(f).get("speculators_config", {}).get("verifier", {}).get("name_or_path")
