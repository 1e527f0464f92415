"""The learning-rate schedule and resuming on one schedule: stopped and resumed runs equal straight
ones bit for bit, extended runs keep the peak rate through the former decay start, and added data
join the epoch in progress."""

import json
import os

import pytest
import torch

from dspark.train.data import EpochSampler, GenerateConfig, generate_shards
from dspark.train.schedule import decay_start, lr_factor, resolve_warmup_steps
from dspark.train.trainer import LOG, Trainer
from train_helpers import run_config, tiny_engine, tiny_prompts


def test_wsd_warms_up_holds_then_decays_over_the_last_fraction():
    f = [lr_factor(s, 100, 4, "wsd", 0.2) for s in range(100)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert set(f[4:81]) == {1.0} and decay_start(100, 0.2, 4) == 80
    assert f[90] == 0.5 and f[99] == pytest.approx(0.05)
    assert all(a > b for a, b in zip(f[80:], f[81:]))
    # a longer run is the same schedule until the shorter one's decay would have started
    assert [lr_factor(s, 300, 4) for s in range(100)] == [1.0 if s >= 4 else f[s] for s in range(100)]
    assert lr_factor(0, 10, 1, "wsd", 1.0) == 1.0 and lr_factor(5, 10, 1, "wsd", 1.0) < 1.0


def test_cosine_stays_selectable_and_warmup_is_fixed_once():
    f = [lr_factor(s, 100, 4, "cosine") for s in range(101)]
    assert f[0] == 0.25 and f[3] == 1.0 and f[100] == pytest.approx(0.0, abs=1e-9)
    assert all(a >= b for a, b in zip(f[3:], f[4:]))
    assert resolve_warmup_steps(None, 0.04, 100) == 4 and resolve_warmup_steps(7, 0.04, 100) == 7
    assert resolve_warmup_steps(None, 0.0, 100) == 1
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_factor(50, 100, 4, "step")


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.drafter.state_dict().items()}


def same_params(a: Trainer, b: Trainer) -> bool:
    pa, pb = params(a), params(b)
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def same_optimizer(a: Trainer, b: Trainer) -> bool:
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[i][name], sb[i][name]) for i in sa for name in ("step", "exp_avg", "exp_avg_sq"))


def test_a_run_stopped_and_resumed_equals_a_straight_run(tiny_run):
    """2N steps at once == N steps, stop (checkpoint), a new Trainer resumes for N more: same
    fp32 parameters bit for bit, through a WSD decay."""
    settings = dict(steps=8, warmup_steps=2, decay_fraction=0.5, checkpoint_every=100)
    straight = Trainer(run_config(tiny_run, "wsd_straight", **settings))
    straight.train(use_tqdm=False)
    first = Trainer(run_config(tiny_run, "wsd_stopped", **settings))
    first.train(use_tqdm=False, stop_at=4)          # a checkpoint at the stop, not at every 100
    assert first.step == 4
    resumed = Trainer(run_config(tiny_run, "wsd_stopped", **settings))
    assert resumed.step == 4 and same_params(first, resumed) and same_optimizer(first, resumed)
    resumed.train(use_tqdm=False)
    assert resumed.step == 8 and same_params(straight, resumed) and same_optimizer(straight, resumed)
    logged = [json.loads(x) for x in open(os.path.join(resumed.cfg.out_dir, LOG))]
    assert [r["lr"] for r in logged] == [r["lr"] for r in map(json.loads, open(
        os.path.join(straight.cfg.out_dir, LOG)))]


def test_extending_the_steps_keeps_the_peak_rate_through_the_former_decay(tiny_run, caplog):
    """A 10-step run (decay from step 8) stopped at 6 and resumed with 20 steps holds the peak
    rate through steps 8-16 and ends where a straight 20-step run ends. (No feature cache: the
    straight run's second epoch would reuse features computed in first-epoch batches, which the
    resumed run recomputes in other batches, equal only to fp32 rounding.)"""
    short = dict(warmup_steps=2, decay_fraction=0.2, log_every=1, checkpoint_every=100, feature_cache_gb=0.0)
    first = Trainer(run_config(tiny_run, "extend", steps=10, **short))
    first.train(use_tqdm=False, stop_at=6)
    with caplog.at_level("INFO", logger="dspark.train.schedule"):
        longer = Trainer(run_config(tiny_run, "extend", steps=20, **short))
    assert "10 -> 20 steps, decay from step 16 (was 8)" in caplog.text
    assert "past the old decay start" not in caplog.text
    assert longer.step == 6 and same_optimizer(first, longer)
    longer.train(use_tqdm=False)
    lrs = {r["step"]: r["lr"] for r in map(json.loads, open(os.path.join(longer.cfg.out_dir, LOG)))}
    peak = longer.cfg.lr
    assert all(lrs[s] == peak for s in range(3, 18))       # update s-1 is logged at step s
    assert lrs[18] < peak and lrs[20] < lrs[18]
    straight = Trainer(run_config(tiny_run, "extend_straight", steps=20, **short))
    straight.train(use_tqdm=False)
    assert same_params(straight, longer)


def test_extending_after_the_decay_began_warns(tiny_run, caplog):
    settings = dict(warmup_steps=2, decay_fraction=0.5, checkpoint_every=100)
    Trainer(run_config(tiny_run, "late_extend", steps=8, **settings)).train(use_tqdm=False, stop_at=6)
    with caplog.at_level("WARNING", logger="dspark.train.schedule"):
        Trainer(run_config(tiny_run, "late_extend", steps=16, **settings))
    assert "past the old decay start (4)" in caplog.text


def test_resuming_on_added_data_keeps_the_optimiser_and_the_epoch_in_progress(tiny_run):
    """A folder added on resume: the optimiser state and step carry over, the sequences already
    seen this epoch stay seen, and the rest of the epoch holds the unseen old ones and every
    new one exactly once."""
    first = Trainer(run_config(tiny_run, "grow", steps=8, checkpoint_every=100))
    first.train(use_tqdm=False, stop_at=3)
    seen = first.sampler._order[:first.sampler.pos]
    manifest = json.load(open(os.path.join(tiny_run.data, "manifest.json")))["config"]
    extra = GenerateConfig(**{**manifest, "data_dir": str(tiny_run.root / "grow_data"),
                              "temperature": 1.0})
    generate_shards(tiny_engine(tiny_run.target), tiny_prompts(20), extra)
    grown = Trainer(run_config(tiny_run, "grow", steps=8, extra_data_dirs=[extra.data_dir]))
    old_n, new_n = len(first.train_samples), len(grown.train_samples)
    assert new_n > old_n and grown.step == 3 and same_optimizer(first, grown)
    s = grown.sampler
    assert s.epoch == first.sampler.epoch and s._order[:s.pos] == seen
    rest = s._order[s.pos:]
    assert sorted(rest) == sorted(set(range(new_n)) - set(seen))
    grown.train(use_tqdm=False)
    assert grown.step == 8


def test_sampler_places_new_and_dropped_sequences_in_the_epoch_in_progress():
    s = EpochSampler(10, seed=3)
    seen = s.next_batch(4)
    state = s.state_dict()
    same = EpochSampler(10, seed=3)
    same.load_state_dict(state)
    assert same.next_batch(6) == s.next_batch(6)             # unchanged data: the same order
    grown = EpochSampler(13, seed=3)
    grown.load_state_dict(state, list(range(10)))
    rest = grown.next_batch(9)
    assert sorted(rest + seen) == list(range(13)) and grown.epoch == 0
    assert sorted(grown.next_batch(13)) == list(range(13)) and grown.epoch == 1
    # sequence 0 moved to the end, the others one place up, and sequence 9 is gone
    old_to_new = [8, 0, 1, 2, 3, 4, 5, 6, 7, None]
    shrunk = EpochSampler(9, seed=3)
    shrunk.load_state_dict(state, old_to_new)
    kept = [old_to_new[i] for i in seen if i != 9]
    assert shrunk._order[:shrunk.pos] == kept and sorted(shrunk._order) == list(range(9))
    with pytest.raises(ValueError, match="resume with the same data"):
        EpochSampler(12, seed=3).load_state_dict(state)
    legacy = {k: v for k, v in state.items() if k != "order"}   # checkpoints before the order was kept
    old = EpochSampler(10, seed=3)
    old.load_state_dict(legacy)
    assert old._order == s._order


def test_cli_schedule_flags_and_runs_saved_before_them(tmp_path):
    import argparse
    from dspark.train.cli import add_train_args, generate_config, train_config
    from dspark.train.train_config import CONFIG
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    fresh = train_config(parser.parse_args(["--out", str(tmp_path / "new")]))
    assert (fresh.schedule, fresh.warmup_steps, fresh.decay_fraction) == ("wsd", None, 0.2)
    cfg = train_config(parser.parse_args(["--out", str(tmp_path / "new"), "--schedule", "cosine",
                                          "--decay", "0.3", "--warmup-steps", "5"]))
    assert (cfg.schedule, cfg.warmup_steps, cfg.decay_fraction) == ("cosine", 5, 0.3)
    (tmp_path / CONFIG).write_text(json.dumps({"out_dir": str(tmp_path), "steps": 5}))
    assert train_config(parser.parse_args(["--out", str(tmp_path)])).schedule == "cosine"
    args = parser.parse_args(["--out", str(tmp_path), "--generate-data", "--prompt-source", "self"])
    assert generate_config(args).prompt_source == "self"
