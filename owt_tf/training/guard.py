"""What stops a run early, and how it stops without losing work.

* `NonFiniteGuard`: every step reports whether its loss and each gradient were finite
  (the engine's train_step "finite" flags; owt_tf.training.step_policy applies this). The first non-finite step stops the run
  (`NonFiniteError`, naming the step and the first non-finite tensor) before anything is
  saved, so the last checkpoint stays the last good one; with --skip-nonfinite N up to N
  such steps are undone instead, from an on-device copy of every variable taken before
  each step (the FC layers may have been updated mid-step, round by round, so there is no
  single update to withhold).
* `SignalStop`: SIGINT / SIGTERM set a flag that the loop checks between steps; the loop
  then saves a checkpoint and ends with `Interrupted`. In a cluster the workers agree on
  the flag after every step (any worker's signal stops all of them at the same step, since
  saving needs every worker).
* `WorkerLost`: in a cluster, a collective failed because another task died or became
  unreachable; TensorFlow aborts every pending collective then (gRPC reports the peer), so
  the survivors stop at once instead of hanging, naming the task.
"""
from __future__ import annotations

import re
import signal
import threading
from typing import List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf


class NonFiniteError(RuntimeError):
    """A step produced a non-finite loss or gradient, and no skips were left."""

    def __init__(self, step: int, what: str, checkpoint: Optional[str]):
        kept = f"the last checkpoint ({checkpoint}) is kept" if checkpoint else "no checkpoint was written"
        super().__init__(f"step {step}: non-finite {what}; stopped, {kept}")
        self.step = step
        self.what = what


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM arrived (here, or at another worker of the cluster: signum None);
    a checkpoint was saved at `step`. `signum` is what the exit code reports (SIGTERM's
    when the signal came to another worker)."""

    def __init__(self, signum: Optional[int], step: int, checkpoint: str, logdir: str):
        name = signal.Signals(signum).name if signum else "another worker's stop signal"
        super().__init__(f"{name} at step {step}: saved {checkpoint}; run the same command with "
                         f"--logdir {logdir} to resume")
        self.signum = signum or signal.SIGTERM


class WorkerLost(RuntimeError):
    """A collective failed because another task of the cluster is gone."""

    def __init__(self, step: int, err: Exception, checkpoint: Optional[str]):
        self.peer = failed_task(err)
        who = f"task {self.peer}" if self.peer else "another task of the cluster"
        kept = (f"the last checkpoint is {checkpoint}" if checkpoint
                else "no checkpoint was written yet")
        lines = (getattr(err, "message", None) or str(err)).splitlines()
        # TF's message starts with "Graph execution error:"; the reason is further down.
        reason = next((line.strip() for line in lines if re.search(
            r"abort|unhealthy|connect|heartbeat|preempt", line, re.IGNORECASE)), "")
        super().__init__(f"step {step}: {who} is unreachable or gone ({type(err).__name__}"
                         f"{': ' + reason[:160] if reason else ''}); stopped, {kept}; start "
                         "every worker again with the same command to resume")
        self.step = step


def is_peer_failure(err: Exception) -> bool:
    """Whether an op error means another task is gone: TF reports an aborted collective as
    UnavailableError, and its gRPC errors name the remote task. Any other error is a bug
    or bad input here, and is not dressed up as a lost worker."""
    return isinstance(err, tf.errors.UnavailableError) or failed_task(err) is not None


def failed_task(err: Exception) -> Optional[str]:
    """The task a collective error names ("/job:worker/task:1"), if it names one."""
    text = getattr(err, "message", None) or str(err)
    found = re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", text)
    return f"/job:{found[-1][0]}/task:{found[-1][1]}" if found else None


def first_nonfinite(flags: np.ndarray, names: Sequence[str]) -> Optional[str]:
    """The first entry whose flag is False, described; None when all are finite."""
    bad = np.flatnonzero(~np.asarray(flags, bool))
    if not len(bad):
        return None
    if bad[0] == 0:  # the loss: say where the gradients first went wrong too
        grads = [names[i] for i in bad[1:]]
        return "loss" + (f" (first non-finite {grads[0]}, {len(grads)} of {len(names) - 1} "
                         "gradients non-finite)" if grads else "")
    return names[bad[0]]


def is_mirrored(variable) -> bool:
    """Whether `variable` (a tf.Variable, or a Keras variable wrapping one) has a copy per replica."""
    backing = variable.value if isinstance(variable, keras.Variable) else variable
    return isinstance(backing, tf.distribute.DistributedValues)


class StepSnapshot:
    """An on-device copy of variables, taken before a step and put back to undo it."""

    def __init__(self, variables: Sequence[tf.Variable], strategy: tf.distribute.Strategy):
        self._variables: List[tf.Variable] = list(variables)
        self._copies: List[tf.Variable] = []
        for v in self._variables:
            if is_mirrored(v):
                with strategy.scope():
                    copy = tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
            else:
                with tf.device(v.device):
                    copy = tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
            self._copies.append(copy)
        self.take = tf.function(lambda: self._copy(self._variables, self._copies))
        self.restore = tf.function(lambda: self._copy(self._copies, self._variables))

    @staticmethod
    def _copy(sources, targets):
        for s, t in zip(sources, targets):
            t.assign(s)


class SignalStop:
    """Turns SIGINT / SIGTERM into a flag while active (main thread only; a no-op elsewhere)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous = {}

    def __enter__(self) -> "SignalStop":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        # A second signal: the user insists. Stop at once, as without this handler.
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
