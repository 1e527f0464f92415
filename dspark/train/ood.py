"""The fixed out-of-distribution evaluation set, dspark/assets/ood_prompts.jsonl.

Held-out prompts of the training data come from the same sources and templates as the training
prompts, so they measure a drafter on familiar ground. This set does not: it is made only from the
installed distributions reserved for evaluation (packages.EVAL_DISTRIBUTIONS), which no training
source reads, and its requests are worded by templates of their own, not the training templates.

* code: documented functions of the reserved packages, as raw completions (signature and
  docstring) and as requests worded by CODE_TEMPLATES;
* chat: the reserved packages' own prose from their metadata (`importlib.metadata`: README
  sentences and summaries) and their modules' docstring summaries, worded by SENTENCE_TEMPLATES and
  SUMMARY_TEMPLATES.

The file is written once and shipped, so every machine evaluates on the same prompts; rebuilding
it (`python -m dspark.train.ood PATH`) is deterministic for a seed and the installed versions.
Each line: {"id", "kind" (chat / code_chat / code_raw), "package", "version", "source", "text"}.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import sys

from dspark.train.packages import (eval_distributions, module_files, normalize, package_functions,
                                   prose_texts, round_robin)
from dspark.train.prompts import keyed_rng

logger = logging.getLogger(__name__)

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "ood_prompts.jsonl")

SENTENCE_TEMPLATES = (
    'I came across this line in a software project\'s README: "{text}" What is it telling me, in '
    'plain words?',
    'A colleague pasted this from some documentation: "{text}" Turn it into a question-and-answer '
    'pair for our team wiki.',
    'Read this sentence from the {package} documentation and list what a newcomer would need to '
    'know to follow it: "{text}"',
    'Rewrite the following documentation sentence so that it is friendlier and clearer, then say '
    'what you changed: "{text}"',
)
SUMMARY_TEMPLATES = (
    'Our team is looking at a piece of Python software described as: "{text}". What questions '
    'should we ask before depending on it?',
    "Pitch, in four sentences to a non-programmer, a tool that does the following: {text}",
    'Imagine a module named `{name}` whose docstring begins "{text}". Sketch three functions you '
    "would expect it to offer and what each would return.",
    'Write a short release note announcing a new version of something described as "{text}".',
)
CODE_TEMPLATES = (
    'The `{package}` library has a function documented as "{summary}". Without using {package}, '
    "write a self-contained Python version with the signature `{signature}`.",
    "Here is a documented stub from a third-party project. Fill in a working body and add two "
    "usage examples as comments:\n\n```python\n{header}\n```",
    "Give me a step-by-step plan, then the code, for a Python function `{name}` that should "
    "{summary}.",
)


# a few READMEs address automated tools or interactive shells rather than their own subject
OFF_SUBJECT = re.compile(r"\bagents?\b|\bsessions?\b", re.I)


def _rng(seed: int, salt: str) -> random.Random:
    return keyed_rng(f"ood:{seed}:{salt}")


def _row(kind: str, dist, source: str, text: str) -> dict:
    return {"kind": kind, "package": normalize(dist.metadata["Name"]),
            "version": dist.version, "source": source, "text": text}


def code_rows(dists, count: int, seed: int) -> list[dict]:
    """Half raw completions, half worded requests, functions taken in turn from the packages."""
    by_name = {normalize(d.metadata["Name"]): d for d in dists}
    rows = []
    for i, (name, src) in enumerate(package_functions(dists, count, seed, per_package=24,
                                                      max_header_chars=900)):
        source = f"{name}:{src.module}.{src.qualname}"
        if i % 2 == 0:
            rows.append(_row("code_raw", by_name[name], source, src.header))
            continue
        template = _rng(seed, source).choice(CODE_TEMPLATES)
        summary_text = src.summary.rstrip(".")
        summary_text = summary_text[:1].lower() + summary_text[1:]
        rows.append(_row("code_chat", by_name[name], source, template.format(
            package=name, summary=summary_text, signature=src.signature,
            name=src.qualname.rsplit(".", 1)[-1], header=src.header.rstrip())))
    return rows


def _chat_candidates(dist, seed: int) -> list[dict]:
    """Every chat prompt one package's metadata and module docstrings give, in a seeded order."""
    name = normalize(dist.metadata["Name"])
    rows = []
    for t in prose_texts(dist, module_files(dist)):
        source = f"{name}:{t.where}:{t.text[:40]}"
        templates = SENTENCE_TEMPLATES if t.what == "sentence" else SUMMARY_TEMPLATES
        template = _rng(seed, source).choice(templates)
        rows.append(_row("chat", dist, f"{name}:{t.where}",
                         template.format(text=t.text, package=name, name=t.label)))
    _rng(seed, name).shuffle(rows)
    return rows


def chat_rows(dists, count: int, seed: int) -> list[dict]:
    """`count` chat prompts taken in turn from the packages, so no one package dominates."""
    pools = [_chat_candidates(d, seed) for d in dists]
    _rng(seed, "packages").shuffle(pools)
    return round_robin(pools, count)


def build_ood_prompts(num_chat: int = 128, num_code: int = 128, seed: int = 0,
                      path: list[str] | None = None) -> list[dict]:
    dists = eval_distributions(path)
    if not dists:
        raise RuntimeError("none of the distributions reserved for evaluation is installed")
    rows = chat_rows(dists, num_chat, seed) + code_rows(dists, num_code, seed)
    seen, unique = set(), []
    for row in rows:
        if row["text"] not in seen and not OFF_SUBJECT.search(row["text"]):
            seen.add(row["text"])
            unique.append(row)
    _rng(seed, "order").shuffle(unique)
    for i, row in enumerate(unique):
        row["id"] = f"ood{i:04d}"
    logger.info("%d out-of-distribution prompts from %d packages", len(unique), len(dists))
    return [{"id": r["id"], **{k: v for k, v in r.items() if k != "id"}} for r in unique]


def write_ood_prompts(out: str = DEFAULT_PATH, **kwargs) -> int:
    """Write the set as JSON lines (a temporary file renamed over `out`); returns the count."""
    rows = build_ood_prompts(**kwargs)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=True) + "\n" for row in rows)
    os.replace(tmp, out)
    return len(rows)


def read_ood_prompts(path: str = DEFAULT_PATH) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(f"wrote {write_ood_prompts(*sys.argv[1:2])} prompts")
