"""Chat prompts about installed packages' own prose: `--prompt-source docs`.

Users of a small assistant ask about software they meet: what a README sentence means, what a
package or module described some way is for. The handwritten topics and the target's own user
turns rarely ask that, and more prompts from those sources stopped lifting a drafter on such
requests (the model card's τ against data). This source words the prose of the installed
training packages (packages.prose_texts: README sentences, summaries, public modules' docstring
summaries) with templates of its own.

The packages reserved for evaluation are never read, and ood.py words its set with other
templates, so the out-of-distribution set shares neither a package nor a template with these
prompts. Each package is one split group (its prompts are all held out or all trained on), and
at most `per_package` texts come from one package, taken in turn across packages.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from typing import Iterator

from dspark.train.packages import (ProseText, module_files, normalize, prose_texts, round_robin,
                                   shuffled, training_distributions)
from dspark.train.prompts import Prompt, keyed_rng

logger = logging.getLogger(__name__)

DOC_SENTENCE_TEMPLATES: tuple[str, ...] = (
    'Explain this sentence from the {package} docs to someone who has just started programming: '
    '"{text}"',
    'Judging by this line from its description, what problem does {package} solve? "{text}"',
    'Write two follow-up questions a reader might have after reading "{text}", and answer them.',
    'Summarize the following in one sentence, then give a concrete example of it: "{text}"',
    'I am writing a blog post about {package}. Expand this sentence into a short paragraph: '
    '"{text}"',
)
DOC_SUMMARY_TEMPLATES: tuple[str, ...] = (
    'What is {name} and when would I use it? Its description says: "{text}".',
    'Write the opening paragraph of a tutorial for {name}, which is described as "{text}".',
    'List the main features you would expect from software described as "{text}".',
    'Explain to a project manager why a team might pick {name} ("{text}").',
    'Show a short, plausible usage example for a Python module described as "{text}".',
)


MIN_WORDS = 4     # a "summary" that only names its module says nothing to ask about


def doc_prompts(num_prompts: int, seed: int = 0, per_package: int = 120,
                path: list[str] | None = None) -> list[Prompt]:
    """`num_prompts` chat prompts (fewer if the packages run out). A package's modules are read
    in a seeded order and only until it has given `per_package` texts, so a package with
    thousands of modules costs about as much as a small one."""
    pools, seen = [], set()
    for dist in shuffled(training_distributions(path), f"docs:{seed}:packages"):
        name = normalize(dist.metadata["Name"])
        modules = shuffled(module_files(dist), f"docs:{seed}:{name}")
        texts = itertools.islice(_fresh(prose_texts(dist, modules), seen), per_package)
        prompts = [p for t in texts for p in _prompts(name, t, seed)]
        pools.append(shuffled(prompts, f"docs:{seed}:{name}:order"))
    prompts = round_robin(pools, num_prompts)
    logger.info("%d documentation prompts from %d packages", len(prompts),
                len({p.group for p in prompts}))
    return prompts


def _fresh(texts: Iterator[ProseText], seen: set[str]) -> Iterator[ProseText]:
    """Texts long enough to ask about, each once over all packages (related packages repeat
    README sentences)."""
    for t in texts:
        if len(t.text.split()) >= MIN_WORDS and t.text not in seen:
            seen.add(t.text)
            yield t


def _prompts(package: str, t: ProseText, seed: int) -> list[Prompt]:
    """A README sentence, the rarer and more prose-like text, is worded by two templates; a
    summary by one."""
    digest = hashlib.sha256(f"{t.where}:{t.text}".encode()).hexdigest()[:12]
    templates = DOC_SENTENCE_TEMPLATES if t.what == "sentence" else DOC_SUMMARY_TEMPLATES
    chosen = keyed_rng(f"{seed}:docs:{package}:{digest}").sample(templates, 2 if t.what == "sentence" else 1)
    return [Prompt(f"docs:{package}:{digest}:{j}", f"docs:{package}", "chat",
                   template.format(text=t.text, package=package, name=t.label))
            for j, template in enumerate(chosen)]

