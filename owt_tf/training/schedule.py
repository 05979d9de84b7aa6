"""The learning-rate schedule over a run: warm-up, then constant, step decay or cosine; or
arcface_torch's polynomial decay with its own warm-up ("poly")."""
from __future__ import annotations

import math

from owt_tf.config import RunConfig


def lr_factor(config: RunConfig, step: int, steps_per_epoch: float, total_steps: int) -> float:
    """Multiplier of both learning rates before `step` (1-based): warm-up, then the schedule."""
    o = config.optimizer
    if o.lr_schedule == "poly":
        return poly_factor(step - 1, int(steps_per_epoch * o.warmup_epochs), total_steps)
    epoch = (step - 1) / steps_per_epoch
    warmup = o.warmup_epochs
    factor = min(1.0, (epoch + 1.0 / steps_per_epoch) / warmup) if warmup > 0 else 1.0
    if o.lr_schedule == "step":
        factor *= 0.1 ** sum(epoch >= e for e in o.lr_decay_epochs)
    elif o.lr_schedule == "cosine":
        factor *= 0.5 * (1.0 + math.cos(math.pi * (step - 1) / max(total_steps, 1)))
    return factor


def poly_factor(done: int, warmup: int, total: int, power: float = 2.0) -> float:
    """arcface_torch's PolynomialLRWarmup after `done` steps: done / warmup during the
    warm-up (0 at the first step), then (1 - (done - warmup) / (total - warmup)) ** power."""
    if done < warmup:
        return done / warmup
    if total <= warmup:
        return 1.0
    return max(0.0, 1.0 - (done - warmup) / (total - warmup)) ** power
