"""The learning-rate schedule over a run: warm-up, then constant, step decay or cosine."""
from __future__ import annotations

import math

from owt_tf.config import RunConfig


def lr_factor(config: RunConfig, step: int, steps_per_epoch: float, total_steps: int) -> float:
    """Multiplier of both learning rates before `step` (1-based): warm-up, then the schedule."""
    o = config.optimizer
    epoch = (step - 1) / steps_per_epoch
    warmup = o.warmup_epochs
    factor = min(1.0, (epoch + 1.0 / steps_per_epoch) / warmup) if warmup > 0 else 1.0
    if o.lr_schedule == "step":
        factor *= 0.1 ** sum(epoch >= e for e in o.lr_decay_epochs)
    elif o.lr_schedule == "cosine":
        factor *= 0.5 * (1.0 + math.cos(math.pi * (step - 1) / max(total_steps, 1)))
    return factor
