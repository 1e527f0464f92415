"""Sequential temperature scaling (STS) of the confidence head.

The scheduler needs absolute survival probabilities a_k = Π_{i<=k} c_i, and the raw head is
over-confident.  One temperature per position is fitted left to right on the cumulative product
(earlier temperatures frozen), minimising the expected calibration error of a_k against the
prefix-accept labels.  Scaling keeps each position's ranking.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

GRID = torch.logspace(-3, 3, 121, base=2.0)        # temperatures 0.125 .. 8


@dataclass
class STSCalibration:
    temperatures: list[float]                       # one per draft position (length γ)
    ece_before: list[float] = field(default_factory=list)   # per position, cumulative survival
    ece_after: list[float] = field(default_factory=list)
    # the same, for temperatures fitted on 3/4 of the rounds and scored on the other quarter
    ece_heldout_before: list[float] = field(default_factory=list)
    ece_heldout_after: list[float] = field(default_factory=list)
    num_samples: int = 0
    sampling_temperature: float = 0.0               # the temperature the records were taken at
    dataset: str = ""

    def validate(self, gamma: int) -> None:
        if len(self.temperatures) != gamma:
            raise ValueError(f"the STS file has {len(self.temperatures)} temperatures but the drafter "
                             f"drafts γ={gamma} tokens")
        if any(not t > 0 for t in self.temperatures):
            raise ValueError("STS temperatures must be positive")

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "STSCalibration":
        try:
            with open(path) as f:
                raw = json.load(f)
            return cls(**raw)
        except FileNotFoundError:
            raise
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path!r} is not a valid STS calibration file: {e}") from e

    def confidences(self, logits: torch.Tensor) -> torch.Tensor:
        """z [.., γ] -> calibrated c_k = σ(z_k / T_k)."""
        temps = torch.tensor(self.temperatures, dtype=logits.dtype, device=logits.device)
        return torch.sigmoid(logits / temps)


def ece(pred: torch.Tensor, label: torch.Tensor, bins: int = 20) -> float:
    """Expected calibration error over equal-width probability bins."""
    index = (pred.clamp(0, 1) * bins).long().clamp(max=bins - 1)
    conf = torch.zeros(bins).index_add_(0, index, pred.float())
    hits = torch.zeros(bins).index_add_(0, index, label.float())
    return float((conf - hits).abs().sum() / max(len(pred), 1))


def survival(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """z [N, γ], T [γ] -> a [N, γ] = cumulative product of σ(z_k / T_k)."""
    return torch.sigmoid(logits / temps).cumprod(dim=-1)


def fit_sts(logits: torch.Tensor, labels: torch.Tensor, grid: torch.Tensor = GRID) -> list[float]:
    """logits [N, γ] raw confidence logits; labels [N, γ] prefix-accept indicators (1 if accepted
    prefix >= k+1).  Returns T_1..T_γ fitted left to right on the cumulative product."""
    logits, labels = logits.float(), labels.float()
    temps = torch.ones(logits.shape[1])
    prefix = torch.ones(logits.shape[0])
    for k in range(logits.shape[1]):
        errors = [ece(prefix * torch.sigmoid(logits[:, k] / t), labels[:, k]) for t in grid]
        temps[k] = grid[int(torch.tensor(errors).argmin())]
        prefix = prefix * torch.sigmoid(logits[:, k] / temps[k])
    return temps.tolist()


def _per_position_ece(survivals: torch.Tensor, labels: torch.Tensor) -> list[float]:
    return [ece(survivals[:, k], labels[:, k]) for k in range(survivals.shape[1])]


def calibrate(logits: torch.Tensor, labels: torch.Tensor, sampling_temperature: float,
              dataset: str = "", seed: int = 0) -> STSCalibration:
    """Fit on every round (the shipped temperatures); also fit on a random 3/4 and score the
    remaining quarter, so the reported calibration is not only in-sample."""
    logits, labels = logits.float(), labels.float()
    ones = torch.ones(logits.shape[1])
    temps = fit_sts(logits, labels)
    perm = torch.randperm(logits.shape[0], generator=torch.Generator().manual_seed(seed))
    fit, test = perm[:logits.shape[0] * 3 // 4], perm[logits.shape[0] * 3 // 4:]
    split_temps = torch.tensor(fit_sts(logits[fit], labels[fit]))
    return STSCalibration(
        temperatures=temps,
        ece_before=_per_position_ece(survival(logits, ones), labels),
        ece_after=_per_position_ece(survival(logits, torch.tensor(temps)), labels),
        ece_heldout_before=_per_position_ece(survival(logits[test], ones), labels[test]),
        ece_heldout_after=_per_position_ece(survival(logits[test], split_temps), labels[test]),
        num_samples=int(logits.shape[0]), sampling_temperature=sampling_temperature,
        dataset=dataset)


def prefix_labels(num_accepted: torch.Tensor, gamma: int) -> torch.Tensor:
    """a [N] -> y [N, γ] with y[n, k] = 1 iff the accepted prefix covers position k."""
    return (torch.arange(gamma)[None, :] < num_accepted[:, None]).float()
