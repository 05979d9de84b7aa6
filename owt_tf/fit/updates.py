"""How a Keras step's gradients reach the optimizers of a parallelized model: Keras'
`apply_gradients` for the trunk (which all-reduces), each FC shard's own optimizer clone,
and, where one device's meaning needs the whole step first, gradient clipping
(keras_compile.GradientClip) and Keras' LossScaleOptimizer (an overflow on any device skips
the step on every device)."""
from __future__ import annotations

from typing import List, Optional

import tensorflow as tf

from owt_tf.parallel import collectives as coll

from owt_tf.planner import ledger
from owt_tf.parallel.head.sampling import SampledColumns
from owt_tf.parallel.schemes import finite_flags
from owt_tf.fit.compiling import GradientClip, KerasShardOptimizer, apply_summed


class StepUpdates:
    """How a step's gradients reach the optimizers.

    Plain: the trunk's through Keras' `apply_gradients` (which all-reduces them), each
    shard's through its own clone, as the step produces them. Clipped or loss-scaled: the
    trunk's gradients are summed here, then clipped whole, as one device clips
    (GradientClip). Under global_clipnorm or a LossScaleOptimizer every update waits for the
    whole step (`finish`): the one norm over trunk and shards, or the one verdict on whether
    every gradient of every device is finite; an overflow skips the step on every device and
    halves the scale, as Keras' LossScaleOptimizer does on one device."""

    def __init__(self, optimizer, trunk_vars, fc_optimizer: KerasShardOptimizer,
                 clip: GradientClip, loss_scaler=None):
        self.optimizer, self.trunk_vars = optimizer, trunk_vars
        self.fc_optimizer, self.clip, self.loss_scaler = fc_optimizer, clip, loss_scaler
        self.summed = clip.active or loss_scaler is not None
        self.waiting = clip.global_norm is not None or loss_scaler is not None
        self.trunk_grads: List[tf.Tensor] = []
        self.fc_grads: List[tf.Tensor] = []
        self.fc_sample: Optional[SampledColumns] = None

    def trunk(self, grads: List[tf.Tensor]) -> None:
        if grads:
            k = coll.num_replicas()
            coll.record(ledger.CONV_GRAD, "all_reduce",
                        sum(ledger.all_reduce_cost(coll.tensor_bytes(g), k) for g in grads))
        if not self.summed:
            return self._apply_trunk(grads, summed=False)
        if grads:  # the collective Keras' apply_gradients would issue
            grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
        if self.waiting:
            self.trunk_grads = grads
        else:
            self._apply_trunk(self.clip.trunk(grads), summed=True)

    def fc(self, shard: int, grads: List[tf.Tensor],
           sample: Optional[SampledColumns] = None) -> None:
        """Shard `shard`'s FC update (under a class `sample`: the class layer's gradients
        are of its sampled rows; their norms are the whole layer's, zero elsewhere)."""
        if self.waiting:
            self.fc_grads, self.fc_sample = grads, sample
        else:
            self.fc_optimizer.apply(shard, self.clip.fc(grads) if self.clip.active else grads,
                                    sample)

    def finish(self, shard: int) -> None:
        """The waiting updates: clipped by the one norm; skipped everywhere on an overflow."""
        if not self.waiting:
            return
        if self.clip.global_norm is not None:
            trunk, fc = self.clip.whole(self.trunk_grads, self.fc_grads)
        else:
            trunk, fc = self.clip.trunk(self.trunk_grads), self.clip.fc(self.fc_grads)
        sample = self.fc_sample
        if self.loss_scaler is None:
            return self._apply(shard, trunk, fc, sample)
        finite = _finite_everywhere(self.trunk_grads + self.fc_grads)
        # As Keras' LossScaleOptimizer does: the cond in cross-replica context, since its
        # branch calls the trunk optimizer, which calls merge_call. The sample crosses as
        # its tensors (a per-replica value each).
        rows = () if sample is None else (sample.ids, sample.valid)
        tf.distribute.get_replica_context().merge_call(self._apply_if_finite,
                                                       args=(finite, trunk, fc, rows))

    def _apply_if_finite(self, distribution, finite, trunk, fc, rows) -> None:
        finite = distribution.experimental_local_results(finite)[0]  # the same everywhere

        def apply_everywhere():
            distribution.extended.call_for_each_replica(self._apply_scaled_step,
                                                        args=(trunk, fc, rows))

        tf.cond(finite, apply_everywhere, self.loss_scaler._stateful_handle_non_finite_grads)

    def _apply_scaled_step(self, trunk: List[tf.Tensor], fc: List[tf.Tensor], rows=()) -> None:
        sample = None
        if rows:
            width = self.fc_sample.width
            sample = SampledColumns(rows[0], rows[1], width)
        self._apply(coll.replica_id(), trunk, fc, sample)
        scaler = self.loss_scaler  # Keras' rule: the scale doubles after N finite steps

        def upscale():
            scaler.step_counter.assign(0)
            scaler.dynamic_scale.assign(scaler.dynamic_scale * 2.0)

        def count():
            scaler.step_counter.assign_add(1)

        tf.cond(tf.equal(scaler.step_counter, scaler.dynamic_growth_steps - 1), upscale, count)

    def _apply(self, shard: int, trunk: List[tf.Tensor], fc: List[tf.Tensor],
               sample: Optional[SampledColumns] = None) -> None:
        self.fc_optimizer.apply(shard, fc, sample)
        self._apply_trunk(trunk, summed=True)

    def _apply_trunk(self, grads: List[tf.Tensor], summed: bool) -> None:
        if not grads:  # a frozen trunk: the step still counts (schedules, dropout seeds)
            self.optimizer.iterations.assign_add(1)
        elif summed:
            apply_summed(self.optimizer, grads, self.trunk_vars)
        else:
            self.optimizer.apply_gradients(zip(grads, self.trunk_vars))


def _finite_everywhere(grads: List[tf.Tensor]) -> tf.Tensor:
    """True on every replica iff every replica's `grads` are finite (the shards' differ)."""
    finite = tf.reduce_all(finite_flags(grads))
    bad = coll.all_reduce_sum(tf.cast(tf.logical_not(finite), tf.float32), ledger.FC_GRAD)
    return tf.equal(bad, 0.0)
