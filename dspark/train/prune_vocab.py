"""`dspark prune-vocab`: give a trained full-vocabulary drafter a reduced draft vocabulary.

Most of a small drafter's time goes to the vocabulary: the target's LM head over every draft row
and the Markov head's W2, each as wide as the vocabulary, and the argmax over it. A target's
answers use few of its tokens (SmolLM2 has 49152; a few thousand cover almost all of what it
writes), so the drafter may propose from those alone: its LM head becomes the target rows of the
kept ids and W2 their rows (both are per-token rows, so nothing is retrained), t2d/d2t map the
ids (the speculators format). Verification is unchanged and lossless; a target token outside the
kept set is simply never drafted. Which ids to keep is counted from the target's own greedy
answers to training-style prompts (not the held-out ones), topped up by id order (BPE merge
order, roughly frequency) and always including the end-of-sequence ids.
`full_vocab_state` goes back the other way, for a warm start of training from a pruned drafter.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

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


def count_answer_tokens(llm, prompts: list[list[int]], max_tokens: int) -> Counter:
    """Token counts of the target's greedy answers (plain decoding)."""
    from dspark.sampling_params import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    return Counter(t for o in outs for t in o.token_ids)


def coverage(counts: Counter, keep: torch.Tensor) -> float:
    kept = set(keep.tolist())
    total = sum(counts.values())
    return sum(n for t, n in counts.items() if t in kept) / total if total else 0.0


def run_prune(args) -> None:
    """The `dspark prune-vocab` command: count, prune, save (config, weights, model card)."""
    import os
    import shutil

    from dspark.config import SpecConfig
    from dspark.llm import LLM
    from dspark.models.drafter_loader import load_drafter, save_speculators
    from dspark.train.data import GenerateConfig, encode_prompt
    from dspark.train.prompts import build_prompts, is_heldout
    spec = SpecConfig(drafter=args.drafter)
    spec.resolve_embedded(args.model)
    source = spec.drafter
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, drafter=None,
              max_num_seqs=args.max_num_seqs)
    prompts = build_prompts(2 * args.num_prompts, seed=args.seed)
    split = {False: [], True: []}
    for p in prompts:
        split[is_heldout(p.group, GenerateConfig("").heldout_fraction, args.seed)].append(encode_prompt(llm.tokenizer, p))
    train, held = split[False][:args.num_prompts], split[True][:max(8, args.num_prompts // 8)]
    counts = count_answer_tokens(llm, train, args.max_tokens)
    heldout = count_answer_tokens(llm, held, args.max_tokens)
    keep = choose_vocab(counts, args.size, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids)
    model = llm.engine.worker.model
    drafter = load_drafter(source, llm.engine.model_config, model.embed_tokens, model.lm_head,
                           llm.engine.config.torch_dtype)
    small = prune_drafter(drafter, keep)
    save_speculators(small, args.out, verifier_name_or_path=_verifier(source),
                     verifier_architectures=(llm.engine.model_config.architecture,))
    for name in ("README.md", "training_curves.png"):
        if os.path.isfile(os.path.join(source, name)) and not os.path.samefile(source, args.out):
            shutil.copy(os.path.join(source, name), os.path.join(args.out, name))
    note = (f"\n## Reduced draft vocabulary\n\n`dspark prune-vocab --size {args.size} --num-prompts "
            f"{args.num_prompts} --max-tokens {args.max_tokens}`: the drafter proposes from "
            f"{args.size} of the target's {drafter.config.vocab_size} tokens, the ones its greedy answers "
            f"to {len(train)} training prompts used most ({sum(counts.values())} tokens; coverage "
            f"{coverage(counts, keep):.1%}), then the lowest ids. They cover {coverage(heldout, keep):.1%} "
            f"of its answers to {len(held)} held-out prompts.\n")
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
