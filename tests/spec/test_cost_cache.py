"""The default schedule needs no table from the user: the cost model is measured once per setup
and cached; a changed setup is measured again, a corrupt or foreign cache file is never trusted.
Seeded sampling keeps its text under any plan."""

import logging

import pytest

from dspark import SamplingParams
from dspark.engine.engine import Engine
from dspark.engine.spec_setup import cached_cost_table
from dspark.spec.planner import CostTable
from test_lossless import drafter, make_llm, target_dir  # noqa: F401


def table(fingerprint: dict, ms: float = 1.0) -> CostTable:
    return CostTable(fingerprint=fingerprint, verify_ms=[0.0, ms, 2 * ms], draft_ms=[0.0, ms])


def test_measured_once_then_read_back(tmp_path, caplog):
    calls = []
    fp = {"model": "m", "gamma": 4}

    def measure():
        calls.append(1)
        return table(fp, 1.0 + len(calls))

    first = cached_cost_table(fp, {**fp, "machine": "a"}, measure, tmp_path)
    again = cached_cost_table(fp, {**fp, "machine": "a"}, measure, tmp_path)
    assert len(calls) == 1 and again.verify_ms == first.verify_ms
    cached_cost_table(fp, {**fp, "machine": "b"}, measure, tmp_path)        # another machine
    assert len(calls) == 2 and len(list(tmp_path.glob("cost-*.json"))) == 2
    for path in tmp_path.glob("cost-*.json"):
        path.write_text("{ not json")
    with caplog.at_level(logging.WARNING):
        cached_cost_table(fp, {**fp, "machine": "a"}, measure, tmp_path)
    assert len(calls) == 3 and "not usable" in caplog.text
    path = next(p for p in tmp_path.glob("cost-*.json") if p.read_text().startswith("{\n"))
    table({"model": "other", "gamma": 4}).save(str(path))                  # a foreign table
    cached_cost_table(fp, {**fp, "machine": "a"}, measure, tmp_path)
    assert len(calls) == 4


def test_engine_measures_its_cost_model_once(tmp_path_factory, target_dir, monkeypatch):
    from dspark.engine import spec_setup
    folder = tmp_path_factory.mktemp("cache")
    monkeypatch.setattr(spec_setup, "cache_root", lambda: folder)
    profiled = []
    real = Engine.profile
    monkeypatch.setattr(Engine, "profile", lambda self, cfg: profiled.append(cfg) or real(self, cfg))
    d4 = drafter(tmp_path_factory, target_dir, gamma=4)
    assert make_llm(target_dir, d4).engine.policy is not None
    assert len(profiled) == 1
    make_llm(target_dir, d4)
    assert len(profiled) == 1                                    # read back
    make_llm(target_dir, drafter(tmp_path_factory, target_dir, gamma=3))
    assert len(profiled) == 2                                    # another drafter: measured
    make_llm(target_dir, d4, max_num_seqs=8)
    assert len(profiled) == 3                                    # another shape to measure
    make_llm(target_dir, d4, cost_table="auto")
    assert len(profiled) == 4                                    # `auto`: measured now
    assert len(list((folder / "cost_tables").glob("cost-*.json"))) == 3


def test_seeded_sampling_says_what_plain_decoding_says_under_any_plan(tmp_path_factory, target_dir):
    """A seeded request's noise is a function of its seed and position, and draft and target race
    on it: its text is plain decoding's with that seed, drafted or not, verified in full or not."""
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    prompts = [[3 + i, 7, 11] for i in range(6)]
    extra = [{}, {"top_k": 5}, {"top_p": 0.9}, {}, {"min_p": 0.05}, {"temperature": 0.3}]
    params = [SamplingParams(**{"temperature": 0.8, **kw}, seed=10 + i, max_tokens=24, ignore_eos=True)
              for i, kw in enumerate(extra)]
    expected = [o.token_ids for o in make_llm(target_dir, None, max_num_seqs=16).generate(prompts, params)]
    verify_all = make_llm(target_dir, d, spec_schedule="verify-all", max_num_seqs=16)
    assert [o.token_ids for o in verify_all.generate(prompts, params)] == expected
    assert verify_all.engine.spec_stats.accepted_tokens > 0
    fp = verify_all.engine.cost_fingerprint()
    for draft_ms, verify_ms in ((1000.0, 10.0), (1e-6, 0.0)):    # drafting never pays / always pays
        path = str(tmp_path_factory.mktemp("cost") / "cost.json")
        CostTable(fingerprint=fp, verify_ms=[0.0] + [1.0 + verify_ms * t for t in range(1, 65)],
                  draft_ms=[0.0] + [draft_ms] * 16).save(path)
        llm = make_llm(target_dir, d, cost_table=path, max_num_seqs=16)
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        stats = llm.engine.spec_stats
        assert (stats.draft_rounds == 0) == (draft_ms > 1)     # the plan was free to differ


@pytest.mark.parametrize("draft_ms,drafts", [(1000.0, False), (1e-6, True)])
def test_a_steep_table_never_calls_the_drafter_and_a_flat_one_verifies_all(
        tmp_path_factory, target_dir, draft_ms, drafts):
    d = drafter(tmp_path_factory, target_dir, gamma=4, copy_prev=9.0)
    probe = make_llm(target_dir, d, spec_schedule="verify-all", max_num_seqs=16)
    path = str(tmp_path_factory.mktemp("cost") / "cost.json")
    CostTable(fingerprint=probe.engine.cost_fingerprint(), verify_ms=[0.0] + [10.0] * 64,
              draft_ms=[0.0] + [draft_ms * r for r in range(1, 17)]).save(path)
    llm = make_llm(target_dir, d, cost_table=path, max_num_seqs=16)
    worker, calls = llm.engine.worker, []
    real = worker._draft
    worker._draft = lambda *a, **k: calls.append(1) or real(*a, **k)
    prompts = [[3 + i, 7, 11] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in probe.generate(prompts, params)]
    stats, full = llm.engine.spec_stats, probe.engine.spec_stats         # every draft not past a cap
    if drafts:
        assert calls and stats.undrafted_steps == 0 and stats.verified_tokens == full.verified_tokens
    else:
        assert not calls and stats.draft_rounds == 0 and stats.undrafted_steps > 0
        assert llm.engine.policy.kept_plans > 0        # most of those steps were not priced at all
        assert llm.engine.policy.overhead.plain_steps > 0      # the engine reports its decode steps
