"""STS: ECE arithmetic, the left-to-right fit, and the file format."""

import pytest
import torch

from dspark.calibrate import calibrate, ece, ece_floor, fit_sts, prefix_labels
from dspark.spec.sts import STSCalibration, survival


def test_ece_hand_computed():
    pred = torch.tensor([0.1, 0.1, 0.9, 0.9])
    label = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # bin 0.1: mean pred 0.1, hit rate 0.5 -> |0.2-1| / 4 ; bin 0.9: |1.8-2| / 4
    assert ece(pred, label) == pytest.approx((0.8 + 0.2) / 4)


def test_ece_floor_is_the_noise_of_a_calibrated_predictor():
    """Labels drawn from the predictions themselves: ECE is nonzero from sampling noise alone,
    at the floor; the floor halves when the rounds quadruple; a predictor off by 0.05 stands
    well above its floor."""
    g = torch.Generator().manual_seed(1)
    pred = torch.rand(4000, generator=g) * 0.8
    floor = ece_floor(pred)
    fresh = [ece(pred, torch.bernoulli(pred, generator=g)) for _ in range(40)]
    assert 0.8 * floor < sum(fresh) / len(fresh) < 1.2 * floor
    assert 0.01 < floor < 0.04
    assert 0.4 < ece_floor(pred.repeat(4)) / floor < 0.6
    biased = ece((pred + 0.05).clamp(max=1), torch.bernoulli(pred, generator=g))
    assert biased > 2 * floor


def test_prefix_labels():
    assert prefix_labels(torch.tensor([0, 2, 3]), 3).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_fit_recovers_overconfidence():
    """Labels drawn from σ(z/2) per position: a head reporting σ(z) is over-confident; STS finds ~2."""
    g = torch.Generator().manual_seed(0)
    n, gamma = 20000, 3
    z = torch.randn(n, gamma, generator=g) * 3 + 1
    accept = torch.rand(n, gamma, generator=g) < torch.sigmoid(z / 2)
    a = accept.int().cumprod(-1).sum(-1)
    labels = prefix_labels(a, gamma)
    temps, offsets = fit_sts(z, labels)
    assert all(1.6 < t < 2.5 for t in temps), temps
    assert all(abs(b) <= 0.3 for b in offsets), offsets
    cal = calibrate(z, labels, sampling_temperature=0.0)
    assert all(after < before for before, after in zip(cal.ece_before, cal.ece_after))
    assert max(cal.ece_after) < 0.02
    # temperatures fitted on three quarters still calibrate the quarter they never saw
    assert len(cal.ece_heldout_after) == gamma and max(cal.ece_heldout_after) < 0.03
    assert all(a < b for b, a in zip(cal.ece_heldout_before, cal.ece_heldout_after))
    # drawn from the model STS fits, the calibrated survival sits at the noise floor
    assert len(cal.ece_floor_heldout) == gamma
    assert all(a < 1.6 * f for a, f in zip(cal.ece_heldout_after, cal.ece_floor_heldout))


def test_fit_removes_a_bias_a_temperature_cannot():
    """Labels drawn from σ(z - 1.5): the head's logits are all shifted up. Temperature alone
    leaves a large error at position 1; the offset the fit finds is about -1.5 and fixes it."""
    g = torch.Generator().manual_seed(1)
    n, gamma = 20000, 2
    z = torch.randn(n, gamma, generator=g) + 1.0
    accept = torch.rand(n, gamma, generator=g) < torch.sigmoid(z - 1.5)
    labels = prefix_labels(accept.int().cumprod(-1).sum(-1), gamma)
    temps_only, zero = fit_sts(z, labels, offsets=torch.zeros(1))
    assert zero == [0.0, 0.0]
    temps, offsets = fit_sts(z, labels)
    assert -1.9 <= offsets[0] <= -1.1 and 0.8 <= temps[0] <= 1.25, (temps, offsets)
    errors = lambda t, b: [ece(a, labels[:, k]) for k, a in  # noqa: E731
                           enumerate(survival(z, torch.tensor(t), torch.tensor(b)).T)]
    assert errors(temps_only, zero)[0] > 0.05
    assert max(errors(temps, offsets)) < 0.015
    cal = calibrate(z, labels, sampling_temperature=0.0)
    assert max(cal.ece_heldout_after) < 0.025


def test_tied_pairs_resolve_to_the_identity():
    """z = 0 everywhere: every temperature gives the same error, so the fit keeps T = 1, b = 0
    where b = 0 is already exact (half the rounds accept position 1)."""
    z = torch.zeros(100, 2)
    labels = torch.tensor([[1.0, 1.0]] * 50 + [[0.0, 0.0]] * 50)
    temps, offsets = fit_sts(z, labels)
    assert (temps[0], offsets[0]) == (1.0, 0.0)


def test_file_roundtrip_and_validation(tmp_path):
    cal = STSCalibration(temperatures=[1.5, 2.0], ece_before=[0.1, 0.2], ece_after=[0.01, 0.02],
                         num_samples=10)
    cal.save(str(tmp_path / "sts.json"))
    back = STSCalibration.load(str(tmp_path / "sts.json"))
    assert back == cal
    back.validate(2)
    with pytest.raises(ValueError, match="γ=3"):
        back.validate(3)
    assert back.offset_list() == [0.0, 0.0]           # a file without offsets (other engines')
    with pytest.raises(ValueError, match="1 offsets"):
        STSCalibration(temperatures=[1.0, 1.0], offsets=[0.5]).validate(2)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid STS"):
        STSCalibration.load(str(tmp_path / "bad.json"))
