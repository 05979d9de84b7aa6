"""What becomes of a training step once it ran: the step policy.

Every worker of a cluster must take the same branch (undo, stop, save) and count the same,
so first the workers agree, in one small all-reduce, on the step's finite flags, the end
of its input, a stop request and its unreadable images. Then, in this order:

* fp16: a step whose scaled gradients overflowed (a finite loss, some gradient not, the
  scale above 1) is undone and the loss scale lowered; it is a scale step, not a fault,
  and nothing is counted. A finite step counts towards the scale's growth.
* a non-finite step stops the run (`NonFiniteError`, before anything is saved, so the
  last checkpoint stays the last good one), or with --skip-nonfinite N is undone, up to N
  times, from the on-device copy of every variable taken before the step
  (`StepSnapshot`: the FC layers may have been updated mid-step, round by round, so there
  is no single update to withhold).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from owt_tf.parallel.placement import Placement
from owt_tf.parallel.precision import DynamicLossScale
from owt_tf.training.guard import NonFiniteError, SignalStop, StepSnapshot, first_nonfinite


@dataclasses.dataclass
class StepOutcome:
    """What the policy made of a step (agreed by every worker)."""

    end: int  # the input stream's position after the step's global batch
    unreadable: int  # training images of the global batch that did not decode
    stop: bool  # a worker was asked to stop (SIGINT / SIGTERM)
    overflowed: bool  # fp16: undone as a loss-scale step
    nonfinite: Optional[str]  # what was not finite, for a step undone by --skip-nonfinite


class StepPolicy:
    """Applies the rules above after each step of a Trainer."""

    def __init__(self, placement: Placement, snapshot: Optional[StepSnapshot],
                 loss_scale: Optional[DynamicLossScale], skipped_steps: tf.Variable,
                 skip_limit: int, finite_names: Sequence[str],
                 latest_checkpoint: Callable[[], Optional[str]]):
        self.placement = placement
        self.snapshot = snapshot
        self.loss_scale = loss_scale
        self.skipped_steps = skipped_steps
        self.skip_limit = skip_limit
        self.finite_names = list(finite_names)
        self.latest_checkpoint = latest_checkpoint
        self.signals: Optional[SignalStop] = None  # set while a fit runs

    def before_step(self) -> None:
        if self.snapshot is not None:
            self.snapshot.take()

    def after_step(self, step: int, finite: np.ndarray, end: int, unreadable: int) -> StepOutcome:
        """`step`: the step's number (for the error); `finite`, `end`, `unreadable`: this
        process's view of the step."""
        finite, end, stop, unreadable = self._agree(finite, end, unreadable)
        overflowed = self._overflowed_loss_scale(finite)
        nonfinite = None if overflowed else first_nonfinite(finite, self.finite_names)
        if overflowed:
            self.snapshot.restore()
            self.loss_scale.update(False)
        elif nonfinite is not None:
            if int(self.skipped_steps) >= self.skip_limit:
                raise NonFiniteError(step, nonfinite, self.latest_checkpoint())
            self.snapshot.restore()
            self.skipped_steps.assign_add(1)
        return StepOutcome(end, unreadable, stop, overflowed, nonfinite)

    def _overflowed_loss_scale(self, finite: np.ndarray) -> bool:
        if self.loss_scale is None:
            return False
        if bool(np.all(finite)):
            self.loss_scale.update(True)
            return False
        return bool(finite[0]) and not self.loss_scale.at_minimum

    def _agree(self, finite: np.ndarray, end: int, unreadable: int) -> tuple:
        """The step's finite flags, end of the input stream, stop request and unreadable
        images, summed over the workers of a cluster; this process's own in one process."""
        stop = self.signals is not None and self.signals.signum is not None
        placement = self.placement
        if placement.num_workers == 1:
            return finite, end, stop, unreadable
        # Positions go in this worker's own slot, so the sum carries every worker's.
        mine = np.zeros(placement.num_workers, np.int64)
        mine[placement.worker_id] = end
        local = np.concatenate([1 - np.asarray(finite, np.int64), [int(stop), unreadable], mine])
        agreed = placement.sum_over_workers(local)
        n = len(finite)
        return agreed[:n] == 0, int(np.max(agreed[n + 2:])), bool(agreed[n]), int(agreed[n + 1])
