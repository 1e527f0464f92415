"""Installed third-party packages as prompt sources, and the ones reserved for evaluation.

The code prompts of `--prompt-source self` come from the documented functions of whatever
distributions are installed (their RECORD lists the files; nothing is imported), a source the
standard-library prompts of prompts.py do not touch. A fixed set of distributions is reserved:
training never reads them, and the out-of-distribution evaluation set (ood.py) is made from them
alone, so its prompts share no package, module or function with any training prompt.
"""

from __future__ import annotations

import importlib.metadata as metadata
import itertools
import logging
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from dspark.train.prompts import CodeSource, code_sources, keyed_rng, module_summary

logger = logging.getLogger(__name__)

# evaluation only (normalised names); ood.py reads these, training skips them wherever installed
EVAL_DISTRIBUTIONS = frozenset({
    "networkx", "mpmath", "sortedcontainers", "tomlkit", "pyparsing", "python-dateutil",
    "markdown-it-py", "mdurl", "pluggy", "charset-normalizer", "pytz", "regex", "xxhash",
    "psutil", "shellingham", "iniconfig", "cycler",
})
# the project itself, and installers whose trees hold vendored copies of other packages
EXCLUDED = frozenset({"dspark", "pip", "setuptools", "wheel"})
SKIP_PARTS = {"test", "tests", "testing", "_vendor", "vendor", "vendored", "_vendored", "externals",
              "third_party", "benchmarks", "examples", "__pycache__"}


def normalize(name: str) -> str:
    """PEP 503 name: `Markdown_It.py` and `markdown-it-py` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions(path: list[str] | None = None) -> list[metadata.Distribution]:
    """Installed distributions with a file list, one per name, sorted by name."""
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(**({"path": path} if path is not None else {})):
        name = dist.metadata["Name"]
        if name and dist.files is not None:
            found.setdefault(normalize(name), dist)
    return [found[name] for name in sorted(found)]


def training_distributions(path: list[str] | None = None) -> list[metadata.Distribution]:
    return [d for d in distributions(path)
            if normalize(d.metadata["Name"]) not in EVAL_DISTRIBUTIONS | EXCLUDED]


def eval_distributions(path: list[str] | None = None) -> list[metadata.Distribution]:
    return [d for d in distributions(path) if normalize(d.metadata["Name"]) in EVAL_DISTRIBUTIONS]


def module_files(dist: metadata.Distribution) -> list[tuple[str, str]]:
    """(dotted module, path) of the distribution's importable .py files, tests and vendored
    copies left out, sorted by module."""
    out = []
    for f in dist.files or ():
        parts = f.with_suffix("").parts
        if f.suffix != ".py" or not parts or any(
                p in SKIP_PARTS or not p.isidentifier() for p in parts):
            continue
        module = ".".join(parts).removesuffix(".__init__")
        out.append((module, str(dist.locate_file(f))))
    return sorted(out)


def shuffled(items, key: str) -> list:
    """A copy of `items` in the order a string key draws (the same on every machine)."""
    items = list(items)
    keyed_rng(key).shuffle(items)
    return items


def iter_code_sources(dist: metadata.Distribution, seed: int,
                      max_header_chars: int = 1500) -> Iterator[CodeSource]:
    """Documented functions of one distribution, files in a seeded order, read lazily: a caller
    that needs a few functions of a large package parses a few of its files."""
    for module, path in shuffled(module_files(dist), f"{seed}:{normalize(dist.metadata['Name'])}"):
        yield from code_sources(path, module, max_header_chars=max_header_chars)


def package_functions(dists: list[metadata.Distribution], count: int, seed: int,
                      per_package: int = 150,
                      max_header_chars: int = 1500) -> list[tuple[str, CodeSource]]:
    """`count` (distribution name, function) pairs taken in turn from the distributions, each at
    most `per_package` times, so no single large package fills the set."""
    order = shuffled(dists, f"{seed}:distributions")
    streams = [(normalize(d.metadata["Name"]),
                itertools.islice(iter_code_sources(d, seed, max_header_chars), per_package))
               for d in order]
    out: list[tuple[str, CodeSource]] = []
    while streams and len(out) < count:
        alive = []
        for name, stream in streams:
            src = next(stream, None)
            if src is not None and len(out) < count:
                out.append((name, src))
                alive.append((name, stream))
        streams = alive
    logger.info("%d functions from %d packages", len(out), len({name for name, _ in out}))
    return out


# ---- metadata text (chat prompts about a package's own prose) -----------------------------------

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_ROLE = re.compile(r":[a-z]+:`([^`]*)`")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_BOILERPLATE = re.compile(r"licen[cs]|warrant|copyright|permission notice|sponsor|donat", re.I)


def description_sentences(dist: metadata.Distribution, min_chars: int = 50,
                          max_chars: int = 220) -> list[str]:
    """Prose sentences of a distribution's long description (its README): code blocks, tables,
    headings, badges and links left out; plain ASCII sentences only."""
    text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
    paragraphs, current, in_code = [], [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            in_code = not in_code
            continue
        skip = (in_code or line.startswith(("    ", "\t", "#", "|", "+", "..", ">", "*", "-", "="))
                or line.strip().endswith("::") or set(line.strip()) <= set("=-~^*#`+ "))
        if skip or not line.strip():
            paragraphs.append(" ".join(current))
            current = []
        else:
            current.append(line.strip())
    paragraphs.append(" ".join(current))
    out = []
    for paragraph in paragraphs:
        paragraph = _ROLE.sub(r"\1", _LINK.sub(r"\1", paragraph))
        for sentence in _SENTENCE_END.split(paragraph):
            sentence = sentence.strip()
            if (min_chars <= len(sentence) <= max_chars and sentence[0].isupper()
                    and sentence.endswith(".") and sentence.isascii()
                    and not re.search(r"https?:|www\.|[<>|{}\\\"]|`|\.\.\.|\be\.g\.$", sentence)
                    and not _BOILERPLATE.search(sentence)
                    and sum(c.isalpha() for c in sentence) >= 0.75 * len(sentence.replace(" ", ""))):
                out.append(sentence)
    return list(dict.fromkeys(out))


def summary(dist: metadata.Distribution) -> str:
    return (dist.metadata.get("Summary") or "").strip()


DANGLING = frozenset("a an and as at between by for from in of on or the to that which with "
                     "using".split())


@dataclass(frozen=True)
class ProseText:
    what: str     # "sentence" (of the README) or "summary" (the package's, or a module's)
    where: str    # "metadata" or the dotted module it summarises
    label: str    # the package or module the text describes
    text: str


def prose_texts(dist: metadata.Distribution, modules: Iterable[tuple[str, str]]) -> Iterator[ProseText]:
    """A distribution's own prose: its README sentences, its summary, then the docstring summaries
    of `modules` (module_files pairs, read lazily) that are public and read as whole sentences."""
    name = normalize(dist.metadata["Name"])
    for sentence in description_sentences(dist):
        yield ProseText("sentence", "metadata", name, sentence)
    if summary(dist):
        yield ProseText("summary", "metadata", name, summary(dist).rstrip("."))
    for module, path in modules:
        line = None if any(p.startswith("_") for p in module.split(".")) else module_summary(path)
        if line and _complete(line):
            yield ProseText("summary", module, module, line.rstrip("."))


def _complete(line: str) -> bool:
    """A docstring's first line that is not cut mid-sentence (it often wraps onto the next)."""
    last = line.rstrip(".").rsplit(" ", 1)[-1].lower()
    return not line.endswith((",", ":", ";", "-")) and last not in DANGLING


def round_robin(pools: list[list], count: int) -> list:
    """`count` items taken in turn from the pools (one from each, then the next from each ...),
    so no one pool dominates."""
    out, depth = [], 0
    while len(out) < count and any(depth < len(p) for p in pools):
        out += [p[depth] for p in pools if depth < len(p)][:count - len(out)]
        depth += 1
    return out
