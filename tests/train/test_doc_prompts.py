"""`--prompt-source docs`: chat prompts about installed training packages' prose, seeded, one split
group per package, never reading the packages reserved for evaluation, and worded by templates
the out-of-distribution set does not use."""

import re

from dspark.train.data import PROMPT_SOURCES, GenerateConfig
from dspark.train.doc_prompts import DOC_SENTENCE_TEMPLATES, DOC_SUMMARY_TEMPLATES, doc_prompts
from dspark.train.ood import SENTENCE_TEMPLATES, SUMMARY_TEMPLATES, read_ood_prompts
from train_helpers import fake_distribution

README = ("Parcel tools weighs and sorts the parcels of a small delivery business quickly. "
          "It keeps every parcel's weight in kilograms and converts it on request. "
          "Short.\n\n    code = 'never a sentence'\n")


def _site(tmp_path):
    site = tmp_path / "site"
    fake_distribution(site, "parcel-tools", "parcels")
    fake_distribution(site, "crate-tools", "crates")             # the same prose again
    fake_distribution(site, "networkx", "networkx")             # reserved for evaluation
    for name in ("parcel-tools", "crate-tools", "networkx"):
        with open(site / f"{name}-1.0.dist-info" / "METADATA", "a") as f:
            f.write("\n" + README)
    return site


def test_prompts_word_a_training_package_prose_and_never_a_reserved_one(tmp_path):
    site = [str(_site(tmp_path))]
    prompts = doc_prompts(100, seed=1, path=site)
    assert prompts == doc_prompts(100, seed=1, path=site)
    assert prompts != doc_prompts(100, seed=2, path=site)        # the seed picks the templates
    assert {p.group for p in prompts} <= {"docs:parcel-tools", "docs:crate-tools"}
    assert len({p.group for p in prompts if p.text.count("Parcel tools weighs")}) == 1  # a package's group
    assert {p.kind for p in prompts} == {"chat"}
    assert len({p.uid for p in prompts}) == len({p.text for p in prompts}) == len(prompts)
    quoted = [t for p in prompts for t in re.findall(r'"([^"]*)"', p.text)]
    # each README sentence twice (two templates), the package summary and the module's once, in
    # one package only; "Short." (too short for a sentence) and the indented code never
    assert sorted(quoted) == sorted(
        ["Parcel tools weighs and sorts the parcels of a small delivery business quickly."] * 2
        + ["It keeps every parcel's weight in kilograms and converts it on request."] * 2
        + ["Parcels and more parcels", "Helpers for weighing parcels"])
    # at most one text a package, not one already taken: a sentence each, two wordings each
    capped = doc_prompts(100, seed=1, path=site, per_package=1)
    assert len(capped) == 4 and len({re.findall(r'"([^"]*)"', p.text)[0] for p in capped}) == 2


def test_templates_are_not_the_evaluation_set_s():
    """No shipped out-of-distribution prompt follows a docs template, and the two sets of
    templates share none."""
    docs = DOC_SENTENCE_TEMPLATES + DOC_SUMMARY_TEMPLATES
    assert not set(docs) & set(SENTENCE_TEMPLATES + SUMMARY_TEMPLATES)
    patterns = [re.compile(re.sub(r"\\\{\w+\\\}", ".*", re.escape(t)), re.S) for t in docs]
    assert not [r["id"] for r in read_ood_prompts() if any(p.fullmatch(r["text"]) for p in patterns)]


def test_the_data_config_takes_the_source():
    assert "docs" in PROMPT_SOURCES
    assert GenerateConfig(data_dir="x", prompt_source="docs").prompt_source == "docs"
