"""Self-written prompts on a tiny random target with a word-level tokenizer: seeded and
deterministic, filtered and deduplicated, code from installed packages (never the reserved ones),
and a held-out split that no key crosses."""

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.train.packages import EVAL_DISTRIBUTIONS, normalize, training_distributions
from dspark.train.prompts import is_heldout
from dspark.train.self_prompts import (CHAT_REQUEST_LEADS, CODE_REQUEST_LEADS, SelfPromptConfig,
                                       build_requests, build_self_prompts, dedup_key, prompt_keys, special_strings,
                                       split_groups, topic_key, turn_end_ids, turn_problem,
                                       user_turn_prefix)
from train_helpers import fake_distribution, tiny_chat_target


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    from dspark.llm import LLM
    root = tmp_path_factory.mktemp("chat")
    target = tiny_chat_target(str(root / "target"))
    site = root / "site"
    fake_distribution(site, "parcel-tools", "parcels")
    fake_distribution(site, "networkx", "networkx")          # reserved for evaluation
    torch.set_num_threads(1)
    llm = LLM(target, dtype="float32", max_num_seqs=16, max_model_len=512, graph="eager",
              drafter=None)
    return llm, [str(site)], target


def small(seed: int = 0, **kw) -> SelfPromptConfig:
    fields = dict(num_prompts=16, seed=seed, chat_fraction=0.75, multi_turn_fraction=0.25,
                  batch=16, user_max_tokens=32, answer_max_tokens=12, min_chars=12)
    return SelfPromptConfig(**{**fields, **kw})


def test_the_template_around_a_user_turn(chat_llm):
    tok = chat_llm[0].tokenizer
    assert tok.decode(user_turn_prefix(tok), skip_special_tokens=False) == "system : be kind <|end|> user :"
    history = (("user", "kind user"), ("assistant", "be kind"))
    assert tok.decode(user_turn_prefix(tok, history), skip_special_tokens=False).endswith(
        "user : kind user <|end|> assistant : be kind <|end|> user :")
    assert turn_end_ids(tok) == [tok.token_to_id("</s>"), tok.token_to_id("<|end|>")]


def test_filters_and_dedup():
    cfg = SelfPromptConfig(num_prompts=1)
    specials = ["<s>", "<|end|>"]
    assert turn_problem("How do tides work on the coast?", specials, cfg) is None
    assert turn_problem(None, specials, cfg) == "unfinished"
    assert turn_problem("Hi there", specials, cfg) == "length"
    assert turn_problem("x" * 401, specials, cfg) == "length"
    assert turn_problem("What is <|end|> in a template?", specials, cfg) == "template token"
    assert turn_problem("¿Qué es la fotosíntesis exactamente?", specials, cfg) == "language"
    assert turn_problem("12 + 34 = ?? 56 * 78 / 90 == 1", specials, cfg) == "language"
    assert dedup_key("How do  tides WORK?") == dedup_key("how do tides work") == "how do tides work"
    assert topic_key("Explain how ocean tides work") == topic_key("Tides in the ocean: how?")


def test_prompts_are_seeded_deterministic_filtered_and_unique(chat_llm):
    llm, site, _ = chat_llm
    first = build_self_prompts(llm, small(0), path=site)
    assert first == build_self_prompts(llm, small(0), path=site)
    assert first != build_self_prompts(llm, small(1), path=site)
    chat = [p for p in first if p.kind == "chat"]
    code = [p for p in first if p.kind != "chat"]
    assert chat and any(p.history for p in chat) and any(not p.history for p in chat)
    specials = special_strings(llm.tokenizer)
    turns = [t for p in chat for t in [c for r, c in p.history if r == "user"] + [p.text]]
    assert all(turn_problem(t, specials, small()) is None for t in turns)
    assert len({dedup_key(t) for t in turns}) == len(turns)
    assert all([r for r, _ in p.history] == ["user", "assistant"] for p in chat if p.history)
    # code: both variants of each documented function of the installed, unreserved package
    assert sorted(p.kind for p in code) == ["code_chat", "code_chat", "code_raw", "code_raw"]
    assert {p.uid for p in code} >= {"pkg:parcel-tools:code_raw:parcels.core.weigh"}
    assert not any("networkx" in p.uid or "tests" in p.uid for p in code)
    assert len({p.uid for p in first}) == len(first)


def test_reserved_packages_never_feed_training(chat_llm):
    site = chat_llm[1]
    assert [d.metadata["Name"] for d in training_distributions(site)] == ["parcel-tools"]
    installed = {normalize(d.metadata["Name"]) for d in training_distributions()}
    assert installed and not installed & EVAL_DISTRIBUTIONS and "dspark" not in installed


key_sets = st.lists(st.lists(st.sampled_from([f"k{i}" for i in range(30)]), min_size=1,
                             max_size=3), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(keys=key_sets, fraction=st.sampled_from([0.05, 0.3, 0.5]), seed=st.integers(0, 3))
def test_no_key_is_both_held_out_and_trained_on(keys, fraction, seed):
    groups = split_groups(keys)
    side: dict[str, bool] = {}
    for ks, group in zip(keys, groups):
        held = is_heldout(group, fraction, seed)
        for k in ks:
            assert side.setdefault(k, held) == held
    # prompts that share a key share a group
    assert all(groups[i] == groups[j] for i in range(len(keys)) for j in range(len(keys))
               if set(keys[i]) & set(keys[j]))


def test_generated_prompts_respect_the_split(chat_llm):
    llm, site, _ = chat_llm
    prompts = build_self_prompts(llm, small(2, num_prompts=24), path=site)
    side: dict[str, bool] = {}
    for p in prompts:
        keys = prompt_keys(p) if p.kind == "chat" else [p.group.removeprefix("self:")]
        for k in keys:
            assert side.setdefault(k, is_heldout(p.group, 0.3)) == is_heldout(p.group, 0.3)


@pytest.mark.parametrize("source,leads,kind,tag", [
    ("code-requests", CODE_REQUEST_LEADS, "code_chat", "self:c"),
    ("chat-requests", CHAT_REQUEST_LEADS, "chat", "self:r")])
def test_requests_are_seeded_opened_by_a_lead_and_split_after_it(chat_llm, source, leads, kind, tag):
    llm = chat_llm[0]
    cfg = small(0, num_prompts=12)
    first = build_requests(llm, cfg, source)
    assert first == build_requests(llm, cfg, source)
    assert first != build_requests(llm, small(1, num_prompts=12), source)
    assert len(first) == 12 and all(p.kind == kind and p.uid.startswith(tag) for p in first)
    assert all(any(p.text.startswith(lead + " ") for lead in leads) for p in first)
    assert len({p.text for p in first}) > 1 and len({dedup_key(p.text) for p in first}) == len(first)
    specials = special_strings(llm.tokenizer)
    assert all(turn_problem(p.text, specials, cfg) is None for p in first)
    # the prompt the target continued is the template up to the user turn, then the lead
    lead = next(lead for lead in leads if first[0].text.startswith(lead))
    assert user_turn_prefix(llm.tokenizer, (), lead)[:len(user_turn_prefix(llm.tokenizer))] == \
        user_turn_prefix(llm.tokenizer)
    # the opening is no topic: two requests with one opening and other tasks get other keys,
    # and one task with two openings gets one key
    assert topic_key(f"{leads[0]} parsing dates") != topic_key(f"{leads[0]} merging lists")
    wordy = sorted(leads, key=len)[-2:]     # openings whose own words would make a key
    assert topic_key(f"{wordy[0]} parsing dates") == topic_key(f"{wordy[1]} parsing dates")
    assert [p.group for p in first] == split_groups([prompt_keys(p) for p in first])


def test_an_opening_is_stripped_only_as_whole_words():
    # "Suggest" opens "Suggest gardening ideas", not "Suggestions": the word stays a topic word
    assert "suggestions" in topic_key("Suggestions about gardening")
    assert topic_key("Suggest gardening") == topic_key("Describe gardening")


@pytest.mark.slow
def test_generate_data_with_self_prompts_writes_and_reuses_its_prompt_list(chat_llm, tmp_path):
    """`train-draft --generate-data --prompt-source self` end to end: the prompt list is kept
    beside the shards, and a rerun reads it and has nothing left to generate."""
    from dspark.train.data import GenerateConfig, generate_data, load_samples
    target = chat_llm[2]
    cfg = GenerateConfig(data_dir=str(tmp_path / "d"), num_prompts=8, max_tokens=8,
                         model=target, dtype="float32", prompt_source="self", chunk_size=4,
                         max_num_seqs=64, heldout_fraction=0.3)
    count = generate_data(cfg)
    saved = json.load(open(os.path.join(cfg.data_dir, "self_prompts.json")))
    assert count == len(saved["prompts"]) > 0
    assert any(p["kind"].startswith("code") for p in saved["prompts"])
    assert generate_data(cfg) == 0
    samples = load_samples(cfg.data_dir, False, min_loss_tokens=1) + \
        load_samples(cfg.data_dir, True, min_loss_tokens=1)
    assert len(samples) == count
    with pytest.raises(ValueError, match="prompt_source"):
        GenerateConfig(data_dir="x", prompt_source="hub")
