"""The shipped out-of-distribution prompt set: its size and uniqueness, a source no training prompt
uses, deterministic rebuilding, and `dspark bench --data ood` reading it."""

import importlib.metadata as metadata
import json
import re
import sys

import pytest

from dspark.bench.prompts import file_prompts
from dspark.train.ood import DEFAULT_PATH, build_ood_prompts, read_ood_prompts, write_ood_prompts
from dspark.train.packages import EVAL_DISTRIBUTIONS, module_files, training_distributions
from dspark.train.topics import CHAT_TEMPLATES, CODE_CHAT_TEMPLATES, MODULE_TEMPLATES
from train_helpers import fake_distribution, tiny_chat_target

ROWS = read_ood_prompts()


def test_the_shipped_set_is_large_unique_and_mixed():
    assert len(ROWS) >= 200
    assert len({r["id"] for r in ROWS}) == len({r["text"] for r in ROWS}) == len(ROWS)
    kinds = [r["kind"] for r in ROWS]
    assert set(kinds) == {"chat", "code_chat", "code_raw"}
    assert kinds.count("chat") >= 100 and len(kinds) - kinds.count("chat") >= 100
    assert all(r["text"].strip() and r["text"].isascii() for r in ROWS)
    assert len({r["package"] for r in ROWS}) >= 10              # no single package dominates


def top_module(row: dict) -> str:
    return row["source"].split(":")[1].split(".")[0]


def test_no_training_source_feeds_the_set():
    """Packages reserved for evaluation only; none of their modules is a training package's or
    the standard library's; no text follows a training template."""
    assert {r["package"] for r in ROWS} <= EVAL_DISTRIBUTIONS
    ood_modules = {top_module(r) for r in ROWS if r["source"].split(":")[1] != "metadata"}
    assert ood_modules and not ood_modules & set(sys.stdlib_module_names)
    training_modules = {m.split(".")[0] for d in training_distributions() for m, _ in module_files(d)}
    assert training_modules and not ood_modules & training_modules
    templates = [re.compile(re.sub(r"\\\{\w+\\\}", ".*", re.escape(t)), re.S)
                 for t in CHAT_TEMPLATES + CODE_CHAT_TEMPLATES + MODULE_TEMPLATES]
    assert not [r["id"] for r in ROWS if any(t.fullmatch(r["text"]) for t in templates)]


def test_rebuilding_is_deterministic_and_reads_only_reserved_packages(tmp_path):
    site = tmp_path / "site"
    fake_distribution(site, "networkx", "networkx")
    fake_distribution(site, "pytz", "pytz")
    fake_distribution(site, "parcel-tools", "parcels")           # a training package
    rows = build_ood_prompts(num_chat=4, num_code=4, path=[str(site)])
    assert rows == build_ood_prompts(num_chat=4, num_code=4, path=[str(site)])
    assert {r["package"] for r in rows} == {"networkx", "pytz"}
    assert {r["kind"] for r in rows} == {"chat", "code_raw", "code_chat"}
    out = tmp_path / "ood.jsonl"
    assert write_ood_prompts(str(out), num_chat=4, num_code=4, path=[str(site)]) == len(rows)
    assert read_ood_prompts(str(out)) == rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ood.jsonl", "site"]


def test_the_shipped_file_is_what_this_machine_builds():
    """Where the reserved packages are installed at the versions the file records, rebuilding
    gives the shipped file byte for byte."""
    versions = {r["package"]: r["version"] for r in ROWS}
    try:
        installed = {p: metadata.version(p) for p in versions}
    except metadata.PackageNotFoundError:
        pytest.skip("a reserved package is not installed")
    if installed != versions:
        pytest.skip("the reserved packages are installed at other versions")
    assert build_ood_prompts() == ROWS


def test_bench_reads_the_set(tmp_path):
    from dspark.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(tiny_chat_target(str(tmp_path / "t")))
    kinds = file_prompts("ood", tok, 5)
    assert [len(kinds["chat"]), len(kinds["code"])] == [5, 5]
    first_chat = next(r for r in ROWS if r["kind"] == "chat")
    rendered = tok.apply_chat_template([{"role": "user", "content": first_chat["text"]}])
    assert kinds["chat"][0] == tok.encode(rendered, add_special_tokens=False)
    assert file_prompts(DEFAULT_PATH, tok, 300)["chat"] == file_prompts("ood", tok, 300)["chat"]
    assert file_prompts(str(tmp_path), tok, 5) is None and file_prompts(None, tok, 5) is None
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"kind": "code_raw", "text": "def f(x):\n"}) + "\n")
    assert file_prompts(str(mine), tok, 5) == {"chat": [], "code": [tok.encode("def f(x):\n")]}
