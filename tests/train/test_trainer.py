"""The trainer on a tiny random target: learning, resume, export, CLI, and the target features."""

import json
import os
import types

import pytest
import torch

from dspark.models.drafter_loader import load_drafter
from dspark.models.loader import load_target
from dspark.train.cli import add_train_args, run_train
from dspark.train.features import TargetFeatureExtractor
from dspark.train.forward import block_context, draft_rows, supervised_slots
from dspark.train.loss import build_block_batch
from dspark.train.train_config import CONFIG, default_target_layer_ids, pick_mask_token_id
from dspark.train.trainer import LOG, Trainer
from train_helpers import run_config as config


def test_default_target_layer_ids():
    assert default_target_layer_ids(30) == (1, 8, 14, 20, 27)      # DFlash spread, not layer 29
    assert default_target_layer_ids(36) == (1, 9, 17, 25, 33)      # DeepSpec's Qwen3-4B ids
    assert default_target_layer_ids(4) == (0, 1, 2)
    assert default_target_layer_ids(2) == (0,)
    assert default_target_layer_ids(1) == (-1,)


def test_mask_token_is_the_last_unreserved_special_token():
    special = lambda: types.SimpleNamespace(special=True)      # noqa: E731
    added = {0: special(), 1: special(), 2: special(), 15: special(), 16: special(),
             500: types.SimpleNamespace(special=False)}
    tok = types.SimpleNamespace(bos_token_id=1, pad_token_id=2, eos_token_ids=[2],
                                backend=types.SimpleNamespace(get_added_tokens_decoder=lambda: added))
    assert pick_mask_token_id(tok, 49152) == 16
    assert pick_mask_token_id(None, 128) == 127


def test_target_features_match_whole_sequence_runs(tiny_run):
    """Batched extraction equals one-sequence runs, and teacher row r predicts token r+1."""
    target = load_target(tiny_run.target, torch.float32)
    ext = TargetFeatureExtractor(target.model, target.config, (0, 2))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 90, (n,), generator=g) for n in (9, 21, 14)]
    offsets = torch.tensor([0, 9, 30, 44])
    rows = torch.tensor([3, 8, 12, 29, 40])
    both = ext(torch.cat(seqs), offsets, rows)
    for b, seq in enumerate(seqs):
        alone = ext(seq, torch.tensor([0, len(seq)]), torch.arange(len(seq)))
        lo, hi = offsets[b], offsets[b + 1]
        assert torch.allclose(both.aux_hidden[lo:hi], alone.aux_hidden, atol=1e-5)
        for i, r in enumerate(rows.tolist()):
            if lo <= r < hi:
                assert torch.allclose(both.teacher_logits[i], alone.teacher_logits[r - lo], atol=1e-4)
    # causal: the logits at row r do not depend on tokens after r
    cut = ext(seqs[1][:4], torch.tensor([0, 4]), torch.tensor([3]))
    full = ext(seqs[1], torch.tensor([0, 21]), torch.tensor([3]))
    assert torch.allclose(cut.teacher_logits, full.teacher_logits, atol=1e-4)


def test_feature_cache_reuses_exact_features_within_its_budget(tiny_run):
    """Cached sequences give the features a fresh target run gives (teacher logits equal the
    model's own LM-head rows); a sequence over the byte budget is recomputed, never stored."""
    from dspark.worker.inputs import RequestChunk, build_inputs
    target = load_target(tiny_run.target, torch.float32)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 90, (n,), generator=g) for n in (11, 17)]
    tokens, offsets, rows = torch.cat(seqs), torch.tensor([0, 11, 28]), torch.tensor([2, 10, 15, 27])
    width = 3 * target.config.hidden_size           # (0, 2) + the last layer, fp32
    ext = TargetFeatureExtractor(target.model, target.config, (0, 2), cache_bytes=11 * width * 4)
    first = ext(tokens, offsets, rows, keys=["a", "b"])
    assert list(ext.cache) == ["a"] and ext.misses == 2          # "b" (17 rows) is over budget
    again = ext(tokens, offsets, rows, keys=["a", "b"])
    assert ext.hits == 1 and ext.misses == 3
    assert torch.equal(first.aux_hidden, again.aux_hidden)
    assert torch.equal(first.teacher_logits, again.teacher_logits)
    # the teacher logits are the model's own output rows
    inp = build_inputs([RequestChunk(seqs[0].tolist(), 0, [0], 0)], 16, torch.device("cpu"), None)
    out = target.model(inp.input_ids, inp.positions, inp.attn, ext.kv, torch.tensor([2, 10]),
                       aux_layer_ids=(0, 2))
    assert torch.allclose(first.teacher_logits[:2], out.logits, atol=1e-5)
    assert torch.allclose(first.aux_hidden[:11], out.aux_hidden, atol=1e-5)


def test_training_lowers_the_heldout_loss(tiny_run):
    trainer = Trainer(config(tiny_run, "learn", steps=60, eval_every=0))
    before = trainer.evaluate()
    trainer.train(use_tqdm=False)
    after = trainer.evaluate()
    assert after["loss"] < before["loss"] - 0.15, (before["loss"], after["loss"])
    assert after["tau"] > before["tau"]
    records = [json.loads(x) for x in open(os.path.join(trainer.cfg.out_dir, LOG))]
    assert [r["step"] for r in records][-1] == 60 and len(records[0]["accept"]) == 4


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.drafter.state_dict().items()}


def test_checkpoint_resume_continues_with_identical_state(tiny_run):
    straight = Trainer(config(tiny_run, "straight"))
    straight.train(use_tqdm=False)

    first = Trainer(config(tiny_run, "resumed"))
    for _ in range(4):
        first.train_step()
    first.log({"type": "train", "step": 4})
    first.save_checkpoint()
    first.log({"type": "train", "step": 6})                # a record after the checkpoint
    mid_state = params_of(first)

    second = Trainer(config(tiny_run, "resumed"))
    assert second.step == 4
    assert all(torch.equal(mid_state[k], v) for k, v in params_of(second).items())
    assert second.sampler._order == first.sampler._order
    assert (second.sampler.epoch, second.sampler.pos) == (first.sampler.epoch, first.sampler.pos)
    assert torch.equal(second.anchor_gen.get_state(), first.anchor_gen.get_state())
    assert second.lr_at(second.step) == first.lr_at(first.step)
    steps = [json.loads(x)["step"] for x in open(os.path.join(second.cfg.out_dir, LOG))]
    assert max(steps) == 4                                  # records past the checkpoint dropped
    second.train(use_tqdm=False)
    assert second.step == 8
    final, reference = params_of(second), params_of(straight)
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_resume_refuses_a_different_architecture(tiny_run):
    Trainer(config(tiny_run, "arch", steps=1)).train(use_tqdm=False)
    with pytest.raises(ValueError, match="markov_rank"):
        Trainer(config(tiny_run, "arch", steps=1, markov_rank=4))


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_export_loads_back_with_identical_logits(tiny_run, head):
    trainer = Trainer(config(tiny_run, f"export_{head}", steps=3, markov_head_type=head))
    trainer.train(use_tqdm=False)
    path = trainer.export(str(tiny_run.root / f"exported_{head}"), torch.float32)
    raw = json.load(open(os.path.join(path, "config.json")))
    assert raw["speculators_model_type"] == "dspark" and raw["mask_token_id"] == 1
    assert raw["aux_hidden_state_layer_ids"] == [i + 1 for i in trainer.cfg.target_layer_ids]
    target = trainer.target
    loaded = load_drafter(path, target.config, target.model.embed_tokens, target.model.lm_head,
                          torch.float32)
    batch = build_block_batch([s.tokens for s in trainer.eval_samples],
                              [s.loss_mask for s in trainer.eval_samples], 4, 1, 8,
                              torch.Generator().manual_seed(0))
    sel = supervised_slots(batch)
    aux = trainer.extractor(batch.tokens, batch.seq_offsets, sel.teacher_rows).aux_hidden
    with torch.no_grad():
        d = trainer.drafter.eval()
        rows = draft_rows(d, d.block_forward(batch.block_ids, batch.positions,
                                             *block_context(d, aux, batch)), batch, sel)
        # the loaded drafter through the inference API (Drafter.base_logits / markov_bias)
        h = loaded.draft_hidden(loaded.block_forward(batch.block_ids, batch.positions,
                                                     *block_context(loaded, aux, batch)))
        h_sel = h[sel.blocks, sel.slots]
        e = loaded.markov_embed(batch.prev_ids[sel.blocks, sel.slots])
        logits = loaded.base_logits(h_sel) + loaded.markov_bias(e, h_sel, None)[0]
        conf = loaded.confidence_logits(h_sel, e)
    assert torch.equal(rows.corrected(), logits) and torch.equal(rows.conf_logits, conf)


def test_init_from_starts_a_new_run_from_an_exported_drafter(tiny_run):
    source = Trainer(config(tiny_run, "init_source", steps=3, num_draft_layers=2, markov_rank=4))
    source.train(use_tqdm=False)
    path = source.export(str(tiny_run.root / "init_exported"), torch.float32)
    # the defaults (1 layer, rank 8 in `config`) give way to the drafter's architecture
    warm = Trainer(config(tiny_run, "init_warm", init_from=path))
    assert (warm.cfg.num_draft_layers, warm.cfg.markov_rank) == (2, 4) and warm.step == 0
    theirs, ours = params_of(source), params_of(warm)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    cold = Trainer(config(tiny_run, "init_cold", num_draft_layers=2, markov_rank=4, seed=1))
    assert not torch.equal(params_of(cold)["fc.weight"], ours["fc.weight"])
    warm.cfg.eval_every = 4
    warm.train(use_tqdm=False)                # a checkpoint now exists: resuming loads it, not path
    evals = [r for r in map(json.loads, open(os.path.join(warm.cfg.out_dir, LOG)))
             if r["type"] == "eval"]
    # step 0 is the warm start's baseline: the source drafter's own held-out figures
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert evals[0]["loss"] == pytest.approx(source.evaluate()["loss"], rel=1e-5)
    assert evals[2]["loss"] < evals[0]["loss"]
    exported = warm.export(str(tiny_run.root / "init_warm_export"), torch.float32)
    card = open(warm.write_card(exported)).read()
    assert "(`init_exported`, `--init-from`)" in card and "8 steps of 4 sequences" in card
    assert f"before any step: loss {evals[0]['loss']:.3f}, τ {evals[0]['tau']:.2f}" in card
    resumed = Trainer(config(tiny_run, "init_warm", init_from=path))
    assert resumed.step == warm.step
    assert all(torch.equal(v, params_of(warm)[k]) for k, v in params_of(resumed).items())


def test_grown_layers_start_as_identities_then_learn(tiny_run):
    """`--grow-layers`: the added layers copy the last one with zero output projections, so the
    grown drafter scores exactly as its source before a step; training then moves them."""
    from dspark.train.train_config import TrainConfig
    with pytest.raises(ValueError, match="grow_layers adds layers to an --init-from drafter"):
        TrainConfig(out_dir="x", grow_layers=1)
    source = Trainer(config(tiny_run, "grow_source", steps=2, markov_rank=4))
    source.train(use_tqdm=False)
    path = source.export(str(tiny_run.root / "grow_exported"), torch.float32)
    grown = Trainer(config(tiny_run, "grow_warm", init_from=path, grow_layers=2, steps=4))
    assert grown.cfg.num_draft_layers == 3 and len(grown.drafter.layers) == 3
    before = params_of(grown)
    assert not before["layers.2.self_attn.o_proj.weight"].any()
    assert not before["layers.1.mlp.down_proj.weight"].any()
    assert torch.equal(before["layers.2.self_attn.q_proj.weight"], before["layers.0.self_attn.q_proj.weight"])
    assert grown.evaluate()["loss"] == pytest.approx(source.evaluate()["loss"], rel=1e-6)
    grown.train(use_tqdm=False)
    after = params_of(grown)
    assert after["layers.2.self_attn.o_proj.weight"].any() and after["layers.1.mlp.down_proj.weight"].any()


def test_init_from_a_reduced_draft_vocabulary_restores_the_kept_rows(tiny_run, tmp_path, caplog):
    """A pruned drafter seeds a full-vocabulary run: its Markov W2 rows return to their target
    ids, the dropped ids' rows start at zero (with a warning), and every other weight is the
    original's."""
    from dspark.train.export import save_speculators
    from dspark.train.prune_vocab import prune_drafter
    trainer = Trainer(config(tiny_run, "init_reduced", steps=1))
    trainer.train(use_tqdm=False)
    keep = torch.arange(0, 96, 3)
    save_speculators(prune_drafter(trainer.drafter, keep), str(tmp_path / "reduced"))
    with caplog.at_level("WARNING"):
        warm = Trainer(config(tiny_run, "init_reduced_2", init_from=str(tmp_path / "reduced")))
    assert "reduced draft vocabulary (32 of" in caplog.text
    original, seeded = params_of(trainer), params_of(warm)
    assert original.keys() == seeded.keys()
    w2 = "markov_head.markov_w2.weight"
    assert all(torch.equal(original[k], seeded[k]) for k in original if k != w2)
    dropped = torch.ones(original[w2].shape[0], dtype=torch.bool)
    dropped[keep] = False
    assert torch.equal(seeded[w2][keep], original[w2][keep])
    assert not seeded[w2][dropped].any() and original[w2][dropped].any()


def test_a_warm_start_can_train_in_a_reduced_draft_vocabulary(tiny_run, tmp_path):
    """`--init-from` with `--draft-vocab`: the drafter's weights seed the run, which then trains
    in the data's most frequent tokens (the cheaper steps), every other weight as exported.
    Other architecture flags are still refused beside --init-from; the card reports the
    vocabulary's coverage."""
    import argparse
    from dspark.train.cli import train_config
    source = Trainer(config(tiny_run, "vocab_source", steps=1))
    source.train(use_tqdm=False)
    path = source.export(str(tmp_path / "exported"), torch.float32)
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    out = str(tiny_run.root / "vocab_warm")
    args = parser.parse_args(["--out", out, "--init-from", path, "--draft-vocab", "32"])
    assert train_config(args).draft_vocab_size == 32
    with pytest.raises(ValueError, match=r"drop the flags for \['markov_rank'\]"):
        train_config(parser.parse_args(["--out", out, "--init-from", path, "--markov-rank", "4"]))
    warm = Trainer(config(tiny_run, "vocab_warm", init_from=path, draft_vocab_size=32, steps=2))
    assert warm.drafter.config.draft_vocab_size == 32 and warm.drafter.config.uses_draft_vocab
    theirs, ours = params_of(source), params_of(warm)
    assert torch.equal(theirs["fc.weight"], ours["fc.weight"])
    out_, _, grad_norm = warm.train_step()
    assert torch.isfinite(out_.total) and grad_norm > 0
    from dspark.train.prune_vocab import coverage, data_counts
    warm.train(use_tqdm=False)
    card = open(warm.write_card(warm.export(str(tmp_path / "warm_exported"), torch.float32))).read()
    share = coverage(data_counts(tiny_run.data).train, torch.nonzero(warm.drafter.t2d).flatten())
    assert "--draft-vocab 32`: the drafter proposes from 32 of" in card and f"{share:.1%}" in card


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_every_markov_head_trains(tiny_run, head):
    trainer = Trainer(config(tiny_run, f"head_{head}", steps=2, markov_head_type=head))
    out, metrics, grad_norm = trainer.train_step()
    assert torch.isfinite(out.total) and grad_norm > 0
    assert trainer.drafter.markov_head.markov_w2.weight.grad is not None


def test_extra_data_folders_join_training_but_not_the_heldout_eval(tiny_run):
    """Training reads every folder's train split; evals keep reading the first folder's held-out
    split, so a run that adds data stays comparable with one that did not."""
    from dspark.train.data import GenerateConfig, generate_shards, load_samples
    from train_helpers import tiny_engine, tiny_prompts
    first = json.load(open(os.path.join(tiny_run.data, "manifest.json")))["config"]
    extra = GenerateConfig(**{**first, "data_dir": str(tiny_run.root / "extra_data"),
                              "temperature": 1.0})
    generate_shards(tiny_engine(tiny_run.target), tiny_prompts(30), extra)
    one = Trainer(config(tiny_run, "one_folder", eval_sequences=64))
    two = Trainer(config(tiny_run, "two_folders", eval_sequences=64,
                         extra_data_dirs=[extra.data_dir]))
    extra_train = load_samples(extra.data_dir, False, two.cfg.max_seq_len, two.cfg.min_loss_tokens)
    assert len(extra_train) > 0
    assert len(two.train_samples) == len(one.train_samples) + len(extra_train)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in
               zip(two.train_samples[len(one.train_samples):], extra_train))
    held = [[s.tokens.tolist() for s in t.eval_samples] for t in (one, two)]
    assert held[0] == held[1] and len(held[0]) > 0
    two.train(use_tqdm=False)
    exported = two.export(str(tiny_run.root / "two_folders_export"), torch.float32)
    card = open(two.write_card(exported)).read()
    assert f"| B | train | {len(extra_train)} |" in card
    assert "B: responses sampled from the target at temperature 1.0" in card


def test_cli_trains_resumes_exports_and_plots(tiny_run, capsys):
    import argparse
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    out = str(tiny_run.root / "cli")
    base = ["--out", out, "--data-dir", tiny_run.data, "--model", tiny_run.target,
            "--block-size", "4", "--markov-rank", "8", "--mask-token-id", "1", "--batch-size", "4",
            "--anchors", "8", "--eval-every", "2", "--eval-sequences", "4", "--log-every", "1",
            "--checkpoint-every", "2"]
    run_train(parser.parse_args(base + ["--steps", "2"]))
    # a bare rerun keeps the saved settings; more steps continue from the checkpoint
    run_train(parser.parse_args(["--out", out, "--steps", "4", "--train", "--export", out + "/drafter",
                                 "--export-dtype", "float32", "--plot"]))
    text = capsys.readouterr().out
    assert "step 4" in text and os.path.isfile(os.path.join(out, "drafter", "model.safetensors"))
    assert os.path.getsize(os.path.join(out, "training_curves.png")) > 10_000
    steps = [json.loads(x)["step"] for x in open(os.path.join(out, LOG)) if '"train"' in x]
    assert steps == [1, 2, 3, 4]
    # the model card describes this run: its steps, its last held-out eval and the curves
    card = open(os.path.join(out, "drafter", "README.md")).read()
    last_eval = [json.loads(x) for x in open(os.path.join(out, LOG)) if '"eval"' in x][-1]
    assert "4 steps of 4 sequences" in card and f"{last_eval['tau']:.2f} |" in card
    assert os.path.isfile(os.path.join(out, "drafter", "training_curves.png"))
    # τ against what the run had trained on, one row per eval: tokens summed from the log
    train_tokens = sum(json.loads(x)["tokens"] for x in open(os.path.join(out, LOG)) if '"train"' in x)
    assert f"| 4 | {train_tokens} | 16 (" in card and f"| {last_eval['tau_greedy']:.3f} |" in card
    # exporting alone leaves the run's settings as they were: a later resume still evaluates
    run_train(parser.parse_args(["--out", out, "--export", out + "/again"]))
    assert json.load(open(os.path.join(out, CONFIG)))["eval_sequences"] == 4


def test_rerun_warns_only_about_settings_that_changed(tmp_path, caplog):
    """A saved config holds lists where flags give tuples: equal values must not read as
    overrides, different ones must."""
    import argparse
    from dspark.train.cli import train_config
    (tmp_path / CONFIG).write_text(json.dumps({"out_dir": str(tmp_path), "steps": 5,
                                               "target_layer_ids": [1, 2],
                                               "extra_data_dirs": ["x"]}))
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    base = ["--out", str(tmp_path), "--target-layer-ids", "1,2"]
    with caplog.at_level("WARNING"):
        cfg = train_config(parser.parse_args(base + ["--extra-data-dir", "x"]))
    assert cfg.extra_data_dirs == ("x",) and "overriding" not in caplog.text
    with caplog.at_level("WARNING"):
        cfg = train_config(parser.parse_args(base + ["--extra-data-dir", "y", "--steps", "6"]))
    assert cfg.extra_data_dirs == ("y",) and cfg.steps == 6
    assert "'extra_data_dirs': (['x'], ('y',))" in caplog.text and "'steps': (5, 6)" in caplog.text
    assert cfg.loss.ce_labels == "sampled"
    (tmp_path / CONFIG).write_text(json.dumps({"out_dir": str(tmp_path), "loss": {"ce": 0.2}}))
    cfg = train_config(parser.parse_args(["--out", str(tmp_path), "--ce-labels", "argmax"]))
    assert cfg.loss.ce_labels == "argmax" and cfg.loss.ce == 0.2     # the saved weights are kept


def test_a_reduced_draft_vocabulary_trains_resumes_and_serves(tiny_run):
    """`--draft-vocab`: the run drafts from the data's most frequent tokens, a resumed run keeps
    that vocabulary and continues bit for bit, and the export decodes losslessly in the engine."""
    from dspark import LLM, SamplingParams
    from tiny import speculating
    straight = Trainer(config(tiny_run, "dv_straight", draft_vocab_size=40))
    straight.train(use_tqdm=False)
    assert straight.drafter.config.draft_vocab_size == 40 and straight.drafter.config.uses_draft_vocab
    first = Trainer(config(tiny_run, "dv_resumed", draft_vocab_size=40))
    assert torch.equal(first.drafter.draft_to_target_index, straight.drafter.draft_to_target_index)
    for _ in range(4):
        first.train_step()
    first.save_checkpoint()
    second = Trainer(config(tiny_run, "dv_resumed", draft_vocab_size=40))
    assert torch.equal(second.drafter.draft_to_target_index, first.drafter.draft_to_target_index)
    second.train(use_tqdm=False)
    final, reference = params_of(second), params_of(straight)
    assert all(torch.equal(final[k], reference[k]) for k in reference)
    path = straight.export(str(tiny_run.root / "dv_exported"), torch.float32)
    prompts = [s.tokens[:6].tolist() for s in straight.eval_samples[:3]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, max_model_len=128, graph="eager")
    plain = [o.token_ids for o in LLM(tiny_run.target, drafter=None, **kw).generate(prompts, params)]
    spec = speculating(LLM(tiny_run.target, drafter=path, **kw))
    assert spec.engine.drafter.config.draft_vocab_size == 40
    assert [o.token_ids for o in spec.generate(prompts, params)] == plain
    assert spec.engine.spec_stats.draft_rounds > 0
