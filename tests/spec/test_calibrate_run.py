"""The calibration run records real rounds and the engine applies the file it writes."""

import pytest

from dspark import LLM, SamplingParams
from dspark.calibrate import run_calibration
from dspark.spec.sts import STSCalibration
from tiny import save_random_drafter, save_tiny


def test_calibration_run_writes_a_file_the_engine_accepts(tmp_path):
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=4)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0, seed=2)
    llm = LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"), max_model_len=128,
              graph="eager")
    prompts = [[3 + i, 9, 4 + i % 5] for i in range(12)]
    cal = run_calibration(llm, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                          use_tqdm=False)
    assert len(cal.temperatures) == 3 and cal.num_samples > 20
    stats = llm.engine.spec_stats                  # every request drafted every step: verify-all
    assert stats.undrafted_steps == 0 and stats.draft_rounds > 0
    assert cal.ece_after[0] <= cal.ece_before[0]
    assert llm.engine.confidence_records is None
    assert llm.engine.scheduler.policy is llm.engine.policy is not None    # verify-all only while fitting
    cal.save(str(tmp_path / "sts.json"))
    ok = LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"),
             sts=str(tmp_path / "sts.json"), graph="eager")
    assert ok.engine.sts.temperatures == cal.temperatures
    STSCalibration(temperatures=[1.0, 1.0]).save(str(tmp_path / "short.json"))
    with pytest.raises(ValueError, match="γ=3"):
        LLM(str(tmp_path / "t"), dtype="float32", drafter=str(tmp_path / "d"),
            sts=str(tmp_path / "short.json"), graph="eager")
