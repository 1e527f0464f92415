"""Training data: the target's own responses to local prompts, stored as token shards.

DSpark trains the drafter on text the target itself wrote (reference/dspark_algorithm.md §5.1):
the drafter must predict the target, not a human corpus. So the prompts (dspark/train/prompts.py,
or the target's own user turns, dspark/train/self_prompts.py) go through our engine, and each
finished request becomes one sequence `prompt + response` with a loss mask over the response
tokens only (the end-of-turn token included: the drafter has to predict it too).

Generation is chunked: every `chunk_size` prompts become one shard file written atomically, and a
rerun skips every prompt whose uid is already in a shard, so an interrupted run resumes where it
stopped. A manifest pins the settings; resuming with different ones is an error, not a mix.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from dspark.sampling_params import SamplingParams
from dspark.train.prompts import Prompt, build_prompts, is_heldout

logger = logging.getLogger(__name__)

SHARD_VERSION = 1
MANIFEST = "manifest.json"
# settings that change what a shard holds; resuming with other values is refused
PINNED = ("seed", "heldout_fraction", "chat_fraction", "max_tokens", "temperature", "top_p",
          "max_prompt_tokens", "model", "dtype", "prompt_source")
PROMPT_SOURCES = ("local", "self", "docs", "code-requests", "chat-requests")


@dataclass
class GenerateConfig:
    data_dir: str
    num_prompts: int = 4000
    seed: int = 0
    heldout_fraction: float = 0.05    # by prompt source, see prompts.is_heldout
    chat_fraction: float = 0.5        # the rest is code, half raw completion, half chat
    max_tokens: int = 192             # response length cap
    temperature: float = 0.2          # the target's recommended sampling (§5.1): SmolLM2's card
    top_p: float = 0.9                # samples at 0.2 / top-p 0.9 (DeepSpec's Qwen3: 0.7 / 0.8)
    max_prompt_tokens: int = 384      # longer prompts are skipped (keeps sequences <= 576)
    chunk_size: int = 256             # prompts per shard (the resume granularity)
    max_num_seqs: int = 64            # engine batch
    model: str | None = None          # None = the embedded SmolLM2-135M-Instruct
    dtype: str = "bfloat16"
    threads: int | None = None        # torch CPU threads (None: leave as is)
    heldout_only: bool = False        # only the held-out split (a later full run adds the rest)
    prompt_source: str = "local"      # "local": prompts.py; "self": the target's own user turns
                                      # and installed packages' code (self_prompts.py); "docs":
                                      # installed packages' prose (doc_prompts.py);
                                      # "code-requests" / "chat-requests": coding / everyday
                                      # requests the target writes after a fixed opening

    def __post_init__(self) -> None:
        if self.prompt_source not in PROMPT_SOURCES:
            raise ValueError(f"prompt_source must be one of {PROMPT_SOURCES}, "
                             f"not {self.prompt_source!r}")


@dataclass
class EncodedPrompt:
    uid: str
    group: str
    kind: str
    heldout: bool
    ids: list[int]          # prompt token ids, chat template applied where the kind needs it


@dataclass
class Sample:
    tokens: torch.Tensor       # [S] int64: prompt + response
    loss_mask: torch.Tensor    # [S] bool: True on response tokens
    kind: str
    uid: str = ""              # the prompt's id in its shard (resume keeps a sampler's place by it)


# ---- prompts -> token ids -----------------------------------------------------------------------

def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Chat kinds get the target's chat template (default system message), after the earlier
    turns of a multi-turn prompt; raw code does not."""
    if prompt.kind == "code_raw":
        return tokenizer.encode(prompt.text, add_special_tokens=True)
    messages = [{"role": role, "content": content} for role, content in prompt.history]
    text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt.text}],
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompts(tokenizer, prompts: Sequence[Prompt], cfg: GenerateConfig) -> list[EncodedPrompt]:
    out, skipped = [], 0
    for p in prompts:
        ids = encode_prompt(tokenizer, p)
        if len(ids) > cfg.max_prompt_tokens:
            skipped += 1
            continue
        out.append(EncodedPrompt(p.uid, p.group, p.kind,
                                 is_heldout(p.group, cfg.heldout_fraction, cfg.seed), ids))
    if skipped:
        logger.info("skipped %d prompts longer than %d tokens", skipped, cfg.max_prompt_tokens)
    return out


# ---- shards ------------------------------------------------------------------------------------

def shard_paths(data_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(data_dir, "shard_*.pt")))


def atomic_save(obj, path: str) -> None:
    """torch.save to a temporary name, then rename: a crash never leaves a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_shard(path: str, prompts: Sequence[EncodedPrompt], responses: Sequence[list[int]],
                finish_reasons: Sequence[str | None]) -> None:
    tokens, masks, offsets = [], [], [0]
    for p, resp in zip(prompts, responses):
        tokens.extend(p.ids + list(resp))
        masks.extend([False] * len(p.ids) + [True] * len(resp))
        offsets.append(len(tokens))
    atomic_save({
        "version": SHARD_VERSION,
        "uids": [p.uid for p in prompts], "groups": [p.group for p in prompts],
        "kinds": [p.kind for p in prompts],
        "heldout": torch.tensor([p.heldout for p in prompts], dtype=torch.bool),
        "tokens": torch.tensor(tokens, dtype=torch.int32),          # [sum S]
        "loss_mask": torch.tensor(masks, dtype=torch.bool),          # [sum S]
        "offsets": torch.tensor(offsets, dtype=torch.long),          # [N+1]
        "finish_reasons": list(finish_reasons),
    }, path)


def read_shard(path: str) -> dict:
    shard = torch.load(path, weights_only=True)
    if shard.get("version") != SHARD_VERSION:
        raise ValueError(f"{path}: shard version {shard.get('version')} != {SHARD_VERSION}")
    return shard


def _next_shard_index(data_dir: str) -> int:
    """One past the highest existing shard number (never reuse the name of a kept shard)."""
    names = [os.path.basename(p)[len("shard_"):-len(".pt")] for p in shard_paths(data_dir)]
    return max((int(n) for n in names if n.isdigit()), default=-1) + 1


def done_uids(data_dir: str) -> set[str]:
    return {uid for path in shard_paths(data_dir) for uid in read_shard(path)["uids"]}


def _check_manifest(cfg: GenerateConfig) -> None:
    """Write the manifest on the first run; refuse to resume with different settings."""
    path = os.path.join(cfg.data_dir, MANIFEST)
    pinned = {k: getattr(cfg, k) for k in PINNED}
    if os.path.isfile(path):
        with open(path) as f:
            old = {"prompt_source": "local", **json.load(f).get("pinned", {})}   # older manifests
        diff = {k: (old.get(k), v) for k, v in pinned.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"{cfg.data_dir} was generated with other settings "
                             f"(field: (existing, requested)) {diff}; use another --data-dir")
        return
    os.makedirs(cfg.data_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"pinned": pinned, "config": asdict(cfg)}, f, indent=2)


# ---- generation --------------------------------------------------------------------------------

def sampling_params(cfg: GenerateConfig) -> SamplingParams:
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens)


def generate_shards(llm, prompts: Sequence[EncodedPrompt], cfg: GenerateConfig) -> int:
    """Generate the responses of every prompt not yet in a shard; returns prompts generated.

    Each request carries a seed derived from its uid, so its random draws do not depend on which
    other prompts share its batch: a resumed run writes what an uninterrupted one would have
    (up to the last bits of batched bf16 matmuls, which can differ with the batch shape). So
    `heldout_only` (evaluating or calibrating on a machine without a run's data) writes the
    held-out responses a full run would, and a full run later adds the train split beside them.
    """
    _check_manifest(cfg)
    done = done_uids(cfg.data_dir)
    todo = [p for p in prompts if p.uid not in done and (p.heldout or not cfg.heldout_only)]
    base = sampling_params(cfg)
    next_index = _next_shard_index(cfg.data_dir)
    logger.info("%d prompts, %d already generated, %d to go%s", len(prompts),
                sum(p.uid in done for p in prompts), len(todo),
                " (held-out split only)" if cfg.heldout_only else "")
    start, new_tokens = time.perf_counter(), 0
    bar = tqdm(total=len(todo), desc="generate", unit="prompt")
    for lo in range(0, len(todo), cfg.chunk_size):
        chunk = todo[lo:lo + cfg.chunk_size]
        params = [_seeded(base, p.uid, cfg.seed) for p in chunk]
        outs = llm.generate([p.ids for p in chunk], params)
        write_shard(os.path.join(cfg.data_dir, f"shard_{next_index:05d}.pt"), chunk,
                    [o.token_ids for o in outs], [o.finish_reason for o in outs])
        next_index += 1
        new_tokens += sum(len(o.token_ids) for o in outs)
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    return len(todo)


def _seeded(base: SamplingParams, uid: str, seed: int) -> SamplingParams:
    request_seed = int.from_bytes(hashlib.sha256(f"{seed}:{uid}".encode()).digest()[:4], "big")
    return dataclasses.replace(base, seed=request_seed)


def generate_data(cfg: GenerateConfig) -> int:
    """Build the prompt list, run the target over the missing ones, write shards."""
    _check_manifest(cfg)          # before the prompts: self-written ones cost target time
    from dspark.llm import LLM
    llm = LLM(cfg.model, dtype=cfg.dtype, drafter=None, max_num_seqs=cfg.max_num_seqs,
              max_model_len=cfg.max_prompt_tokens + cfg.max_tokens + 1, num_threads=cfg.threads)
    if llm.tokenizer is None:
        raise ValueError("data generation needs a target with a tokenizer (and chat template)")
    if cfg.prompt_source in ("self", "code-requests", "chat-requests"):
        from dspark.train.self_prompts import (SelfPromptConfig, build_requests,
                                               build_self_prompts, self_prompts)
        build = build_self_prompts if cfg.prompt_source == "self" else \
            functools.partial(build_requests, source=cfg.prompt_source)
        prompts = self_prompts(llm, SelfPromptConfig.from_generate(cfg), cfg.data_dir, build)
    elif cfg.prompt_source == "docs":
        from dspark.train.doc_prompts import doc_prompts
        prompts = doc_prompts(cfg.num_prompts, cfg.seed)
    else:
        prompts = build_prompts(cfg.num_prompts, cfg.seed, cfg.chat_fraction)
    return generate_shards(llm, encode_prompts(llm.tokenizer, prompts, cfg), cfg)


# ---- reading back ------------------------------------------------------------------------------

@dataclass
class HeldOut:
    """What a folder holds out: its split groups and its prompts (token ids as bytes)."""
    groups: set[str]
    prompts: set[bytes]


def held_out(data_dir: str) -> HeldOut:
    out = HeldOut(set(), set())
    for shard in map(read_shard, shard_paths(data_dir)):
        for i in shard["heldout"].nonzero().flatten().tolist():
            out.groups.add(shard["groups"][i])
            out.prompts.add(_prompt_key(shard, i))
    return out


def _prompt_key(shard: dict, i: int) -> bytes:
    lo, hi = shard["offsets"][i].item(), shard["offsets"][i + 1].item()
    return shard["tokens"][lo:hi][~shard["loss_mask"][lo:hi]].numpy().tobytes()


def load_samples(data_dir: str, heldout: bool, max_len: int = 1024, min_loss_tokens: int = 4,
                 leave_out: HeldOut | None = None) -> list[Sample]:
    """The train (heldout=False) or held-out sequences, truncated to `max_len` tokens.

    Sequences with fewer than `min_loss_tokens` response tokens left are dropped: they hold
    almost no anchors (DeepSpec drops samples under 14 loss tokens for the same reason). With
    `leave_out` (another folder's held-out split), so is every sequence whose split group or
    prompt that folder holds out: folders generated with other seeds split their prompts
    differently, and a prompt or topic held out there must not be trained on from here.
    """
    out, left_out = [], 0
    for shard in map(read_shard, shard_paths(data_dir)):
        offsets = shard["offsets"].tolist()
        for i, kind in enumerate(shard["kinds"]):
            if bool(shard["heldout"][i]) != heldout:
                continue
            if leave_out is not None and (shard["groups"][i] in leave_out.groups
                                          or _prompt_key(shard, i) in leave_out.prompts):
                left_out += 1
                continue
            lo, hi = offsets[i], min(offsets[i + 1], offsets[i] + max_len)
            mask = shard["loss_mask"][lo:hi].clone()
            if int(mask.sum()) >= min_loss_tokens:
                out.append(Sample(shard["tokens"][lo:hi].long(), mask, kind, shard["uids"][i]))
    if left_out:
        logger.warning("%s: left out %d sequences whose split group or prompt the first data "
                       "folder holds out", data_dir, left_out)
    return out


def load_train_samples(data_dirs: Sequence[str], max_len: int, min_loss_tokens: int
                       ) -> list[list[Sample]]:
    """Each folder's train sequences; the first folder's held-out split rules the others."""
    for data_dir in data_dirs:
        if not shard_paths(data_dir):
            raise FileNotFoundError(f"{data_dir!r} holds no data shards")
    first = held_out(data_dirs[0]) if len(data_dirs) > 1 else None
    return [load_samples(d, False, max_len, min_loss_tokens, None if i == 0 else first)
            for i, d in enumerate(data_dirs)]


class EpochSampler:
    """Sequence indices in a fresh seeded permutation per epoch. Its state (epoch, the epoch's
    order, the cursor) is checkpointed, and a run resumed on grown data keeps its place: the
    sequences the epoch has not reached yet and the new ones share the rest of the epoch."""

    def __init__(self, num_items: int, seed: int):
        if num_items < 1:
            raise ValueError("no training sequences: generate data first (--generate-data)")
        self.num_items, self.seed = num_items, seed
        self.epoch, self.pos = 0, 0
        self._order = self._permutation(num_items, 0)

    def _permutation(self, num_items: int, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(num_items, generator=g).tolist()

    def next_batch(self, size: int) -> list[int]:
        out = []
        while len(out) < size:
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation(self.num_items, self.epoch)
            take = min(size - len(out), len(self._order) - self.pos)
            out.extend(self._order[self.pos:self.pos + take])
            self.pos += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "num_items": self.num_items,
                "order": torch.tensor(self._order, dtype=torch.long)}

    def load_state_dict(self, state: dict, old_to_new: Sequence[int | None] | None = None) -> None:
        """`old_to_new[i]`: where the checkpoint's sequence i is now (None: gone); without it the
        data must be the checkpoint's. Sequences not in the checkpoint join the epoch's rest."""
        saved_n, pos = state["num_items"], state["pos"]
        order = (state["order"].tolist() if "order" in state
                 else self._permutation(saved_n, state["epoch"]))
        if old_to_new is None:
            if saved_n != self.num_items:
                raise ValueError(f"the checkpoint was trained on {saved_n} sequences but the data "
                                 f"now holds {self.num_items}; resume with the same data")
            old_to_new = range(saved_n)
        seen = [old_to_new[i] for i in order[:pos] if old_to_new[i] is not None]
        rest = [old_to_new[i] for i in order[pos:] if old_to_new[i] is not None]
        placed = set(seen) | set(rest)
        new = [i for i in range(self.num_items) if i not in placed]
        if new or len(seen) != pos or len(rest) != len(order) - pos:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + state["epoch"] + 7919 * saved_n)
            pool = rest + new
            rest = [pool[j] for j in torch.randperm(len(pool), generator=g).tolist()]
            logger.info("data changed since the checkpoint (%d -> %d sequences, %d new): epoch %d "
                        "goes on with %d sequences", saved_n, self.num_items, len(new),
                        state["epoch"], len(rest))
        self.epoch, self.pos, self._order = state["epoch"], len(seen), seen + rest
