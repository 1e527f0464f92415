"""Prompts without a hub: user turns the target writes itself, and code from installed packages.

A chat model has read many user turns in its own training, so sampling from its chat template right
after a user-role header, at a high temperature, gives requests from its own idea of what users
ask, in any domain, with no dataset to download; the drafter then learns the target's answers to
them (data.py). Some become conversations: a generated user turn, the target's answer, then
another generated user turn, which the data's response answers. Coding requests
(`--prompt-source code-requests`) and everyday requests (`--prompt-source chat-requests`) are
user turns opened with a fixed phrase ("Write a Python function that", "Give me some tips for")
that the target completes. Code prompts come from the
documented functions of installed third-party packages (packages.py; the standard library stays
with prompts.py, and the packages reserved for evaluation are never read).

Every draw is seeded by the seed and the candidate's id, and candidates are taken in id order,
so one target and seed give one prompt list. A candidate is kept if it ended its turn, has a
plausible length, is written in ASCII letters (a language check the target's English data
passes), holds no template token, and is not a duplicate (case and punctuation ignored).

The split: each prompt has keys (a topic key per user turn, its module for code); prompts linked
by a shared key, directly or through others, form one group, and the held-out split is drawn per
group, so no key is both held out and trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from typing import Sequence

from tqdm import tqdm

from dspark.sampling_params import SamplingParams
from dspark.train.packages import package_functions, training_distributions
from dspark.train.prompts import Prompt, code_prompts, interleave

logger = logging.getLogger(__name__)

CACHE = "self_prompts.json"
SENTINEL = "DSPARKUSERTURNCONTENT"     # stands for a user turn's text while a template renders
STOPWORDS = frozenset(
    "about after also because been before being could does each explain from give have help into "
    "just know like make many more most much need only other over please should some such tell "
    "than that their them then there these they this those very want were what when where which "
    "while will with would write your".split())
# how a coding request opens (`--prompt-source code-requests`); the target writes the rest
CODE_REQUEST_LEADS: tuple[str, ...] = (
    "Write a Python function that", "Write a Python program that", "Write a Python class that",
    "In Python, how do I", "Can you show me Python code that", "Implement a Python function to",
    "Write a short Python script to", "What is the best way in Python to")
# how an everyday request opens (`--prompt-source chat-requests`): the common openings of requests
# to an assistant, so the turns read as a user's rather than as the target's free association
CHAT_REQUEST_LEADS: tuple[str, ...] = (
    "Explain", "Can you explain", "Why do", "How does", "What are some", "Give me some tips for",
    "Write a short story about", "Write a poem about", "Describe", "Summarize", "What should I",
    "How can I", "Help me write", "What is the difference between", "Suggest", "Tell me about")
# a request source: its uid tag, the prompts' kind, what the progress bar calls them, its openings
REQUEST_SOURCES = {"code-requests": ("c", "code_chat", "coding requests", CODE_REQUEST_LEADS),
                   "chat-requests": ("r", "chat", "everyday requests", CHAT_REQUEST_LEADS)}
SELF_TURNS = ("u", "chat", "user turns", ())
_LEADS_LONGEST_FIRST = sorted(CODE_REQUEST_LEADS + CHAT_REQUEST_LEADS, key=len, reverse=True)


@dataclass
class SelfPromptConfig:
    num_prompts: int
    seed: int = 0
    chat_fraction: float = 0.5           # the rest: code prompts from installed packages
    multi_turn_fraction: float = 0.25    # of the chat prompts
    user_temperature: float = 1.0        # high: varied requests
    user_top_p: float = 0.95
    user_max_tokens: int = 64
    answer_temperature: float = 0.2      # the middle answer of a conversation: the target's own
    answer_top_p: float = 0.9            # recommended sampling, as for the training responses
    answer_max_tokens: int = 192
    min_chars: int = 16
    max_chars: int = 400
    min_ascii_letters: float = 0.6       # ASCII letters / non-space characters
    batch: int = 64                      # candidates per engine call
    max_candidates: int = 8              # per wanted prompt, before giving up on the rest
    per_package: int = 150               # functions taken from one package at most

    @classmethod
    def from_generate(cls, cfg) -> "SelfPromptConfig":
        """The settings of a data-generation run (data.GenerateConfig)."""
        return cls(num_prompts=cfg.num_prompts, seed=cfg.seed, chat_fraction=cfg.chat_fraction,
                   answer_temperature=cfg.temperature, answer_top_p=cfg.top_p,
                   answer_max_tokens=cfg.max_tokens)


# ---- the chat template around a user turn ------------------------------------------------------

def _render(tokenizer, history: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """The template's text before and after a user turn that follows `history`."""
    messages = [{"role": r, "content": c} for r, c in history] + [{"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    head, found, tail = text.partition(SENTINEL)
    if not found:
        raise ValueError("the chat template does not show a user turn's text")
    return head, tail


def user_turn_prefix(tokenizer, history: Sequence[tuple[str, str]] = (), lead: str = "") -> list[int]:
    """Token ids up to the start of a user turn's text: the template's system turn (its default
    when there is none), the earlier turns, then the user-role header (and the turn's `lead`)."""
    return tokenizer.encode(_render(tokenizer, history)[0] + lead, add_special_tokens=False)


def special_strings(tokenizer) -> list[str]:
    added = tokenizer.backend.get_added_tokens_decoder()
    return sorted({t.content for t in added.values() if t.special and t.content})


def turn_end_ids(tokenizer) -> list[int]:
    """What ends a user turn: the template's end-of-turn token (when it is a special token) and
    the end-of-sequence tokens."""
    tail = tokenizer.encode(_render(tokenizer, ())[1], add_special_tokens=False)[:1]
    specials = set(special_strings(tokenizer))
    ends = [i for i in tail if tokenizer.id_to_token(i) in specials]
    return sorted(set(ends) | set(tokenizer.eos_token_ids))


# ---- filters, dedup, keys ----------------------------------------------------------------------

def dedup_key(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def turn_problem(text: str | None, specials: Sequence[str], cfg: SelfPromptConfig) -> str | None:
    """Why a generated user turn is not kept (None: it is)."""
    if text is None:
        return "unfinished"
    if not cfg.min_chars <= len(text) <= cfg.max_chars:
        return "length"
    if any(s in text for s in specials) or SENTINEL in text:
        return "template token"
    letters = [c for c in text if c.isalpha()]
    if not all(c.isascii() for c in letters) or \
            len(letters) < cfg.min_ascii_letters * len("".join(text.split())):
        return "language"
    return None


def topic_key(text: str) -> str:
    """The turn's two longest content words: paraphrases of one request share it (a coding
    request's are read after its opening, which many requests share)."""
    text = next((text[len(lead):] for lead in _LEADS_LONGEST_FIRST
                 if text.startswith(lead) and not text[len(lead):len(lead) + 1].isalnum()), text)
    words = {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4 and w not in STOPWORDS}
    picked = sorted(sorted(words), key=len, reverse=True)[:2]
    return "topic:" + ("+".join(sorted(picked)) if picked else dedup_key(text)[:40])


def split_groups(keys: Sequence[Sequence[str]]) -> list[str]:
    """One split group per connected set of prompts (linked by any shared key); a group is
    named by its smallest key."""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for ks in keys:
        for k in ks[1:]:
            a, b = find(ks[0]), find(k)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return [f"self:{find(ks[0])}" for ks in keys]


# ---- sampling ----------------------------------------------------------------------------------

def _seed(seed: int, uid: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{uid}".encode()).digest()[:4], "big")


class _Writer:
    """Samples user turns and answers for one run, and keeps what it accepted (the dedup set)."""

    def __init__(self, llm, cfg: SelfPromptConfig):
        if llm.tokenizer is None or not llm.tokenizer.chat_template:
            raise ValueError("self-written prompts need a target with a tokenizer and chat template")
        self.llm, self.cfg, self.tok = llm, cfg, llm.tokenizer
        self.ends, self.specials = turn_end_ids(self.tok), special_strings(self.tok)
        self.seen: set[str] = set()
        self.rejected: dict[str, int] = {}

    def user_turns(self, histories: Sequence[tuple], uids: Sequence[str],
                   leads: Sequence[str] | None = None) -> list[str | None]:
        cfg = self.cfg
        leads = leads or [""] * len(uids)
        params = [SamplingParams(temperature=cfg.user_temperature, top_p=cfg.user_top_p,
                                 max_tokens=cfg.user_max_tokens, seed=_seed(cfg.seed, uid),
                                 stop_token_ids=self.ends) for uid in uids]
        outs = self.llm.generate([user_turn_prefix(self.tok, h, lead) for h, lead in zip(histories, leads)],
                                 params)
        texts = []
        for out, lead in zip(outs, leads):
            ids = list(out.token_ids)
            done = out.finish_reason == "stop" and bool(ids) and ids[-1] in self.ends
            rest = self.tok.decode(ids[:-1], skip_special_tokens=False) if done else None
            texts.append(None if rest is None else _joined(lead, rest).strip())
        return texts

    def answers(self, turns: Sequence[str], uids: Sequence[str]) -> list[str]:
        cfg = self.cfg
        prompts = [self.tok.encode(self.tok.apply_chat_template([{"role": "user", "content": t}]),
                                   add_special_tokens=False) for t in turns]
        params = [SamplingParams(temperature=cfg.answer_temperature, top_p=cfg.answer_top_p,
                                 max_tokens=cfg.answer_max_tokens, seed=_seed(cfg.seed, uid))
                  for uid in uids]
        return [out.text.strip() for out in self.llm.generate(prompts, params)]

    def accept(self, text: str | None) -> bool:
        problem = turn_problem(text, self.specials, self.cfg)
        if problem is None and dedup_key(text) in self.seen:
            problem = "duplicate"
        if problem is not None:
            self.rejected[problem] = self.rejected.get(problem, 0) + 1
            return False
        self.seen.add(dedup_key(text))
        return True

    def single_turns(self, want: int, source: str = "self") -> list[Prompt]:
        """User turns; for a request source, each opened by the lead its seed picks."""
        kept: list[Prompt] = []
        tag, kind, what, leads = REQUEST_SOURCES.get(source, SELF_TURNS)
        with tqdm(total=want, desc=f"the target writing {what}") as bar:
            for lo in range(0, want * self.cfg.max_candidates, self.cfg.batch):
                if len(kept) >= want:
                    break
                uids = [f"self:{tag}{i}" for i in range(lo, lo + self.cfg.batch)]
                opened = [leads[_seed(self.cfg.seed, u) % len(leads)] for u in uids] if leads else None
                for uid, text in zip(uids, self.user_turns([()] * len(uids), uids, opened)):
                    if len(kept) < want and self.accept(text):
                        kept.append(Prompt(uid, "", kind, text))
                bar.update(len(kept) - bar.n)
        return kept

    def conversations(self, want: int) -> list[Prompt]:
        """First turn, the target's answer, second turn: the prompt is the second turn."""
        kept: list[Prompt] = []
        bar = tqdm(total=want, desc="the target writing conversations")
        for lo in range(0, want * self.cfg.max_candidates, self.cfg.batch):
            bar.update(len(kept) - bar.n)
            if len(kept) >= want:
                break
            uids = [f"self:m{i}" for i in range(lo, lo + self.cfg.batch)]
            firsts = []
            for uid, text in zip(uids, self.user_turns([()] * len(uids), uids)):
                if self.accept(text):        # a first turn is never another prompt's text
                    firsts.append((uid, text))
            if not firsts:
                continue
            answers = self.answers([t for _, t in firsts], [f"{u}:answer" for u, _ in firsts])
            histories = [(("user", t), ("assistant", a)) for (_, t), a in zip(firsts, answers)]
            seconds = self.user_turns(histories, [f"{u}:2" for u, _ in firsts])
            for (uid, _), history, text, answer in zip(firsts, histories, seconds, answers):
                if len(kept) < want and answer and self.accept(text):
                    kept.append(Prompt(uid, "", "chat", text, history))
        bar.close()
        return kept


# ---- the prompt list ---------------------------------------------------------------------------

def prompt_keys(prompt: Prompt, package_key: str | None = None) -> list[str]:
    if package_key is not None:
        return [package_key]
    turns = [c for r, c in prompt.history if r == "user"] + [prompt.text]
    return [topic_key(t) for t in turns]


def package_prompts(count: int, seed: int, per_package: int,
                    path: list[str] | None = None) -> list[tuple[Prompt, str]]:
    """(prompt, module key) pairs: a raw completion and a chat request per function, as for the
    standard library (prompts.code_prompts), from installed packages outside the reserved set."""
    out = []
    for dist, src in package_functions(training_distributions(path), (count + 1) // 2, seed,
                                       per_package):
        for p in code_prompts(src, seed):
            out.append((dataclasses.replace(p, uid=f"pkg:{dist}:{p.uid}"),
                        f"pkg:{dist}:{src.module}"))
    return out[:count]


def build_self_prompts(llm, cfg: SelfPromptConfig, path: list[str] | None = None) -> list[Prompt]:
    """`cfg.num_prompts` prompts (fewer when the filters reject too many), chat and code
    interleaved, each with its split group."""
    n_code = cfg.num_prompts - round(cfg.num_prompts * cfg.chat_fraction)
    n_chat = cfg.num_prompts - n_code
    n_multi = round(n_chat * cfg.multi_turn_fraction)
    writer = _Writer(llm, cfg)
    chat = writer.single_turns(n_chat - n_multi) + writer.conversations(n_multi)
    code = package_prompts(n_code, cfg.seed, cfg.per_package, path)
    logger.info("self-written prompts: %d single-turn, %d conversations (rejected: %s); %d code",
                sum(not p.history for p in chat), sum(bool(p.history) for p in chat),
                writer.rejected, len(code))
    keys = [prompt_keys(p) for p in chat] + [prompt_keys(p, key) for p, key in code]
    groups = split_groups(keys)
    prompts = [dataclasses.replace(p, group=g) for p, g in zip(chat + [p for p, _ in code], groups)]
    return interleave(prompts[:len(chat)], prompts[len(chat):])


def build_requests(llm, cfg: SelfPromptConfig, source: str) -> list[Prompt]:
    """`cfg.num_prompts` requests the target writes after one of the source's openings (REQUEST_SOURCES):
    coding tasks in a user's words, which the documented functions of packages (a signature and
    docstring to fill in) do not ask, or everyday requests, which unopened self-written turns
    rarely phrase as users do. Split by the topic after the opening."""
    writer = _Writer(llm, cfg)
    prompts = writer.single_turns(cfg.num_prompts, source)
    logger.info("%s: %d (rejected: %s)", source, len(prompts), writer.rejected)
    groups = split_groups([prompt_keys(p) for p in prompts])
    return [dataclasses.replace(p, group=g) for p, g in zip(prompts, groups)]


def _joined(lead: str, rest: str) -> str:
    """A lead and the target's continuation (which a tokenizer may decode without the space)."""
    return lead + rest if not lead or not rest or rest[0].isspace() or rest[0] in ",.?:;" else f"{lead} {rest}"


def self_prompts(llm, cfg: SelfPromptConfig, cache_dir: str, build=build_self_prompts) -> list[Prompt]:
    """`build` (self-written prompts or coding requests), kept in `<cache_dir>/self_prompts.json`:
    a resumed data run reads the list instead of sampling it again."""
    path = os.path.join(cache_dir, CACHE)
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        if saved["config"] == asdict(cfg):
            return [Prompt(p["uid"], p["group"], p["kind"], p["text"],
                           tuple(tuple(turn) for turn in p["history"])) for p in saved["prompts"]]
        logger.info("%s was made with other settings; sampling the prompts again", path)
    prompts = build(llm, cfg)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"config": asdict(cfg), "prompts": [asdict(p) for p in prompts]}, f)
    os.replace(tmp, path)
    return prompts
