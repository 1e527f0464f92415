"""Prompt sources, the held-out split, shard generation with resume, and reading data back."""

import dataclasses
import os
import textwrap

import pytest

from dspark.train.data import (EpochSampler, GenerateConfig, done_uids,
                               generate_shards, load_samples, load_train_samples, read_shard,
                               shard_paths)
from dspark.train.prompts import build_prompts, code_sources, is_heldout, module_summaries
from train_helpers import generate_tiny_data, tiny_engine, tiny_prompts, tiny_target

MODULE = textwrap.dedent('''
    """Tools for counting sheep in a small field."""

    def count_sheep(field, start=0):
        """Return the number of sheep standing in the field."""
        total = start
        for spot in field:
            total += spot
        return total

    def _hidden(x):
        """A private helper that should never become a prompt."""
        return x
        return x
        return x

    class Barn:
        def open_doors(self, wide: bool = True) -> None:
            """Open every door of the barn at once."""
            self.doors = wide
            self.opened = True
            self.count += 1
    ''')


@pytest.fixture
def fake_stdlib(tmp_path):
    root = tmp_path / "lib"
    (root / "test").mkdir(parents=True)
    (root / "sheep.py").write_text(MODULE)
    (root / "test" / "test_sheep.py").write_text(MODULE)        # test folders are skipped
    return str(root)


def test_code_sources_take_public_documented_functions(fake_stdlib):
    sources = code_sources(os.path.join(fake_stdlib, "sheep.py"), "sheep")
    assert [s.qualname for s in sources] == ["count_sheep", "Barn.open_doors"]
    assert sources[0].signature == "def count_sheep(field, start=0)"
    assert sources[0].header.startswith("def count_sheep(field, start=0):\n    \"\"\"Return")
    assert sources[1].header.startswith("class Barn:\n    def open_doors(self, wide: bool=True)") or \
        sources[1].header.startswith("class Barn:\n    def open_doors(self, wide: bool = True)")
    assert module_summaries(fake_stdlib) == [("sheep", "Tools for counting sheep in a small field.")]


def test_build_prompts_is_deterministic_mixed_and_unique(fake_stdlib):
    a = build_prompts(40, seed=1, root=fake_stdlib)
    assert a == build_prompts(40, seed=1, root=fake_stdlib)
    assert len({p.uid for p in a}) == len(a) == 40
    kinds = [p.kind for p in a]
    assert kinds.count("code_raw") == kinds.count("code_chat") == 2      # both variants per function
    assert kinds.count("chat") == 36
    # both variants of one function share a split group
    groups = {p.group for p in a if p.kind.startswith("code")}
    assert len(groups) == 2


def test_heldout_split_is_stable_and_near_the_fraction():
    groups = [f"g{i}" for i in range(4000)]
    held = [is_heldout(g, 0.05) for g in groups]
    assert 0.035 < sum(held) / len(held) < 0.065
    assert held == [is_heldout(g, 0.05) for g in groups]
    assert is_heldout("g1", 0.05, seed=0) == is_heldout("g1", 0.05, seed=0)


def by_uid(shard: dict) -> dict[str, list[int]]:
    offsets = shard["offsets"].tolist()
    return {uid: shard["tokens"][offsets[i]:offsets[i + 1]].tolist() for i, uid in enumerate(shard["uids"])}


def folder_by_uid(data_dir: str) -> dict[str, list[int]]:
    return {uid: toks for path in shard_paths(data_dir) for uid, toks in by_uid(read_shard(path)).items()}


def test_generation_writes_shards_and_resumes_identically(tmp_path):
    target = tiny_target(str(tmp_path / "t"))
    cfg = generate_tiny_data(target, str(tmp_path / "d"), num=20, max_tokens=12, chunk_size=8)
    paths = shard_paths(cfg.data_dir)
    assert len(paths) == 3 and len(done_uids(cfg.data_dir)) == 20
    shard = read_shard(paths[0])
    prompts = {p.uid: p for p in tiny_prompts(20)}
    for i, uid in enumerate(shard["uids"]):
        lo, hi = shard["offsets"][i], shard["offsets"][i + 1]
        n_prompt = len(prompts[uid].ids)
        assert shard["tokens"][lo:lo + n_prompt].tolist() == prompts[uid].ids
        assert not shard["loss_mask"][lo:lo + n_prompt].any() and shard["loss_mask"][lo + n_prompt:hi].all()
    middle = by_uid(read_shard(paths[1]))
    os.remove(paths[1])                                    # a lost shard
    # regenerated in other batches (chunks of 5): per-request seeds give the same responses
    generate_tiny_data(target, cfg.data_dir, num=20, max_tokens=12, chunk_size=5)
    after = shard_paths(cfg.data_dir)
    assert [os.path.basename(p) for p in after] == [
        "shard_00000.pt", "shard_00002.pt", "shard_00003.pt", "shard_00004.pt"]  # no name reused
    again = {**by_uid(read_shard(after[2])), **by_uid(read_shard(after[3]))}
    assert again == middle and len(done_uids(cfg.data_dir)) == 20
    with pytest.raises(ValueError, match="other settings"):
        generate_shards(None, tiny_prompts(20), GenerateConfig(**{**cfg.__dict__, "max_tokens": 5}))


def test_load_samples_split_and_truncation(tmp_path):
    target = tiny_target(str(tmp_path / "t"))
    cfg = generate_tiny_data(target, str(tmp_path / "d"), num=20, max_tokens=12, chunk_size=8)
    train = load_samples(cfg.data_dir, heldout=False, max_len=14, min_loss_tokens=1)
    held = load_samples(cfg.data_dir, heldout=True, max_len=14, min_loss_tokens=1)
    assert len(train) + len(held) == 20 and len(held) == 4                # every 5th prompt
    assert all(s.tokens.shape[0] <= 14 and s.tokens.shape == s.loss_mask.shape for s in train)


def test_extra_folders_leave_out_what_the_first_folder_holds_out(tmp_path):
    """Folders made with other seeds split their prompts differently (the self-written source
    must change its seed to write new prompts, and its ids repeat across seeds): an extra
    folder's sequence whose split group or prompt the first folder holds out is left out of
    training; a prompt that only shares an id joins."""
    target = tiny_target(str(tmp_path / "t"))
    first = generate_tiny_data(target, str(tmp_path / "a"), num=12, max_tokens=6, chunk_size=5)
    same = tiny_prompts(10, heldout_every=3)      # first: p0, p5, p10 held out; here p0, p3, p6, p9
    new = [dataclasses.replace(p, uid=f"p{10 + i}" if i < 2 else f"n{i}", group=f"n{i}",
                               heldout=False) for i, p in enumerate(tiny_prompts(4, seed=1))]
    new[2].group = "p5"                                # a new prompt in a topic the first holds out
    new[3].ids = list(same[0].ids)                     # a held-out prompt under another name
    extra = GenerateConfig(**{**first.__dict__, "data_dir": str(tmp_path / "b")})
    generate_shards(tiny_engine(target), same + new, extra)
    train = load_train_samples([first.data_dir, extra.data_dir], max_len=64, min_loss_tokens=1)
    uids = [sorted(s.uid for s in samples) for samples in train]
    assert uids[0] == ["p1", "p11", "p2", "p3", "p4", "p6", "p7", "p8", "p9"]
    # p5 is held out in the first folder; n2 and n3 cross its split by topic and by prompt; the
    # new p10 and p11 share only their ids with the first folder's prompts
    assert uids[1] == ["p1", "p10", "p11", "p2", "p4", "p7", "p8"]
    assert [s.uid for s in load_train_samples([first.data_dir], 64, 1)[0]] == \
        [s.uid for s in train[0]]
    with pytest.raises(FileNotFoundError, match="holds no data shards"):
        load_train_samples([first.data_dir, str(tmp_path / "empty")], 64, 1)


def test_epoch_sampler_covers_each_epoch_and_restores_its_cursor():
    s = EpochSampler(10, seed=3)
    first = s.next_batch(4) + s.next_batch(4) + s.next_batch(2)
    assert sorted(first) == list(range(10))
    state = s.state_dict()
    expected = s.next_batch(7)
    t = EpochSampler(10, seed=3)
    t.load_state_dict(state)
    assert t.next_batch(7) == expected


def test_heldout_only_writes_what_a_full_run_would_and_a_full_run_completes_it(tmp_path):
    """A held-out-only folder (evaluation on a machine without the run's data) holds the very
    responses a full run writes for those prompts, and a later full run adds just the rest."""
    target = tiny_target(str(tmp_path / "t"))
    full = generate_tiny_data(target, str(tmp_path / "full"), num=20, max_tokens=8, chunk_size=8)
    held = GenerateConfig(**{**full.__dict__, "data_dir": str(tmp_path / "held"), "heldout_only": True})
    prompts = tiny_prompts(20)
    assert generate_shards(tiny_engine(target), prompts, held) == 4           # every 5th prompt
    expected, written = folder_by_uid(full.data_dir), folder_by_uid(held.data_dir)
    assert set(written) == {p.uid for p in prompts if p.heldout}
    assert all(written[uid] == expected[uid] for uid in written)
    rest = GenerateConfig(**{**held.__dict__, "heldout_only": False})
    assert generate_shards(tiny_engine(target), prompts, rest) == 16
    assert done_uids(held.data_dir) == done_uids(full.data_dir)
    assert len(load_samples(held.data_dir, heldout=True, min_loss_tokens=1)) == 4
