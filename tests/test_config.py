"""Which drafter a configuration ends up with: the embedded pair by default, plain on request."""

import os

import pytest

from dspark.config import EMBEDDED_DRAFTER_DIR, EngineConfig, SpecConfig


def test_default_is_the_embedded_pair_with_its_calibration():
    cfg = EngineConfig()
    assert cfg.spec.drafter == EMBEDDED_DRAFTER_DIR
    assert cfg.spec.sts == os.path.join(EMBEDDED_DRAFTER_DIR, "sts.json")
    assert os.path.isfile(os.path.join(EMBEDDED_DRAFTER_DIR, "config.json"))
    assert os.path.isfile(cfg.spec.sts)


def test_another_model_decodes_plainly_unless_given_a_drafter(tmp_path):
    assert EngineConfig(model=str(tmp_path)).spec.drafter is None
    assert EngineConfig(spec=SpecConfig(drafter=None)).spec.drafter is None


def test_embedded_drafter_refuses_another_target(tmp_path):
    with pytest.raises(ValueError, match="embedded drafter belongs to the embedded target"):
        EngineConfig(model=str(tmp_path), spec=SpecConfig(drafter="embedded"))
