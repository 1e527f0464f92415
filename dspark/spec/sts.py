"""Sequential temperature scaling (STS) of the confidence head, as the runtime applies it.

The scheduler needs absolute survival probabilities a_k = Π_{i<=k} c_i, and the raw head is
over-confident, so each position's logit is scaled: c_k = σ(z_k / T_k + b_k), which keeps each
position's ranking. With `offsets` left out (the format other engines read), b = 0. The fit
itself is offline tooling (dspark/calibrate.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np
import torch


@dataclass
class STSCalibration:
    temperatures: list[float]                       # one per draft position (length γ)
    offsets: list[float] = field(default_factory=list)      # b_k per position (empty: all 0)
    ece_before: list[float] = field(default_factory=list)   # per position, cumulative survival
    ece_after: list[float] = field(default_factory=list)
    # the same, for temperatures fitted on 3/4 of the rounds and scored on the other quarter
    ece_heldout_before: list[float] = field(default_factory=list)
    ece_heldout_after: list[float] = field(default_factory=list)
    # the ECE a perfectly calibrated predictor would show on as many rounds (`ece_floor`): what
    # `ece_after` and `ece_heldout_after` can be told apart from at all
    ece_floor_after: list[float] = field(default_factory=list)
    ece_floor_heldout: list[float] = field(default_factory=list)
    num_samples: int = 0
    sampling_temperature: float = 0.0               # the temperature the records were taken at
    dataset: str = ""

    def validate(self, gamma: int) -> None:
        if len(self.temperatures) != gamma:
            raise ValueError(f"the STS file has {len(self.temperatures)} temperatures but the drafter "
                             f"drafts γ={gamma} tokens")
        if any(not t > 0 for t in self.temperatures):
            raise ValueError("STS temperatures must be positive")
        if self.offsets and len(self.offsets) != gamma:
            raise ValueError(f"the STS file has {len(self.offsets)} offsets but the drafter "
                             f"drafts γ={gamma} tokens")

    def offset_list(self) -> list[float]:
        return list(self.offsets) if self.offsets else [0.0] * len(self.temperatures)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "STSCalibration":
        try:
            with open(path) as f:
                raw = json.load(f)
            return cls(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path!r} is not a valid STS calibration file: {e}") from e


def survival(logits: torch.Tensor, temps: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """z [N, γ], T [γ], b [γ] -> a [N, γ] = cumulative product of σ(z_k / T_k + b_k)."""
    scaled = logits / temps if offsets is None else logits / temps + offsets
    return torch.sigmoid(scaled).cumprod(dim=-1)


def host_survival(logits: np.ndarray, temps: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`survival` in numpy, for the planner on the host between steps (a handful of numbers,
    where torch's per-operator dispatch would cost more than the arithmetic)."""
    return np.cumprod(1.0 / (1.0 + np.exp(-(logits / temps + offsets))), axis=-1)
