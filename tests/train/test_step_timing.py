"""The training-step timing runs both vocabularies on the same batches at tiny size."""

import os

import torch

from dspark.train.data import EncodedPrompt, write_shard
from dspark.train.step_timing import main
from train_helpers import VOCAB, tiny_target


def test_step_timing_reports_both_vocabularies(tmp_path, capsys):
    target = tiny_target(str(tmp_path / "target"))
    data = tmp_path / "data"
    os.makedirs(data)
    g = torch.Generator().manual_seed(0)
    prompts = [EncodedPrompt(f"p{i}", f"p{i}", "chat", i % 5 == 0,
                             torch.randint(3, VOCAB - 1, (5,), generator=g).tolist()) for i in range(10)]
    responses = [torch.randint(3, VOCAB - 1, (24,), generator=g).tolist() for _ in prompts]
    write_shard(str(data / "shard_00000.pt"), prompts, responses, ["length"] * len(prompts))
    result = main(["--data-dir", str(data), "--model", target, "--steps", "2", "--draft-vocab",
                   "40", "--batch-size", "2", "--anchors", "4", "--batches", "3",
                   "--target-dtype", "float32", "--no-bf16"])
    assert result["batches"] == 3 and 0 < result["coverage"] < 1
    for name in ("full", "draft_40"):
        assert result[name]["steps"] == 2 and result[name]["s_per_step"] > 0
        assert result[name]["slots_per_s"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"command"')
