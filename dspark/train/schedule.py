"""The learning-rate schedule: a pure function of the step and the run's settings.

Nothing but the step count has to be restored for a resumed run to be back on its schedule, and a
run whose settings change on resume (more steps, more data) follows the new schedule from the step
it stopped at, with the optimiser state it had.

WSD (warm-up, stable, decay; the default) warms up linearly over `warmup_steps`, holds the peak
rate, and decays linearly to zero over the last `decay_fraction` of the *final* step count. Raising
`--steps` before the decay has begun moves only the decay: a run extended with more data keeps
training at the peak rate instead of paying for a new warm-up and a second decay, which chaining
runs with `--init-from` does. The cosine schedule (warm-up, then cosine to zero over all steps)
stays selectable for comparison with runs made with it.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)

SCHEDULES = ("wsd", "cosine")


def resolve_warmup_steps(warmup_steps: int | None, warmup_fraction: float, steps: int) -> int:
    """A run fixes its warm-up length once, at its start: a later change of `steps` must not
    move a warm-up that is already over."""
    if warmup_steps is not None:
        return max(1, int(warmup_steps))
    return max(1, round(warmup_fraction * steps))


def decay_start(total: int, decay_fraction: float, warmup: int = 0) -> int:
    """The first step of the WSD decay; never inside the warm-up."""
    return max(warmup, total - round(decay_fraction * total))


def lr_factor(step: int, total: int, warmup: int, schedule: str = "wsd",
              decay_fraction: float = 0.2) -> float:
    """The multiplier of the peak rate for the update made at `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if schedule != "wsd":
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    start = decay_start(total, decay_fraction, warmup)
    if step < start:
        return 1.0
    return max(0.0, (total - step) / max(1, total - start))


def describe_schedule(cfg) -> str:
    """A TrainConfig's schedule in words, for the model card."""
    warmup = resolve_warmup_steps(cfg.warmup_steps, cfg.warmup_fraction, cfg.steps)
    if cfg.schedule == "cosine":
        return f"{warmup} warm-up steps, then cosine to zero"
    return (f"{warmup} warm-up steps, constant, then linear decay to zero over the last "
            f"{cfg.decay_fraction:.0%} of the steps")


def check_resume(step: int, old: dict, new: dict) -> None:
    """Say what a change of schedule settings on resume does to the rate from `step` on; a run
    already past its decay start that is extended jumps back up, which is worth a warning."""
    keys = ("schedule", "steps", "warmup_steps", "decay_fraction")
    if all(old.get(k) == new.get(k) for k in keys):
        return
    if old.get("schedule") == new["schedule"] == "wsd":
        old_start = decay_start(old["steps"], old["decay_fraction"], old["warmup_steps"])
        new_start = decay_start(new["steps"], new["decay_fraction"], new["warmup_steps"])
        if step > old_start and new_start > old_start:
            logger.warning("step %d is past the old decay start (%d): the extended run returns to "
                           "a higher rate; extend a run before its decay begins", step, old_start)
        else:
            logger.info("schedule: %d -> %d steps, decay from step %d (was %d), resuming at %d",
                        old["steps"], new["steps"], new_start, old_start, step)
        return
    logger.warning("resuming at step %d with other schedule settings (%s -> %s): the rate "
                   "follows the new schedule from here", step,
                   {k: old.get(k) for k in keys}, {k: new.get(k) for k in keys})
