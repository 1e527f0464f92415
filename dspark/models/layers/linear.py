"""The projection layer every module uses: torch's own nn.Linear.

It is kept as one import point so a special case has one home. A matrix-vector path for
single-row steps used to win on CPUs; with torch 2.13's oneDNN, F.linear at one row is about 1.5x
faster than torch.mv for every projection of a SmolLM2 decode step (576x576 up to the 49152-row
LM head, bf16, 2 threads), so there is none.
"""

from torch.nn import Linear

__all__ = ["Linear"]
