"""How a Keras step's gradients reach the optimizers of a parallelized model: Keras'
`apply_gradients` for the trunk (which all-reduces), each FC shard's own optimizer clone
(KerasShardOptimizer: why clones, below),
and, where one device's meaning needs the whole step first, gradient clipping
(keras_compile.GradientClip) and Keras' LossScaleOptimizer (an overflow on any device skips
the step on every device)."""
from __future__ import annotations

from typing import Dict, List, Optional

import keras
import tensorflow as tf

from owt_tf.parallel import collectives as coll

from owt_tf.planner import ledger
from owt_tf.runtime.devices import outside_strategy_scope
from owt_tf.parallel.head.layout import ShardedHead
from owt_tf.parallel.head.sampling import SampledColumns
from owt_tf.parallel.head.update import SPARSE_OPTIMIZERS, SGDRule, update_shard
from owt_tf.parallel.precision import finite_flags
from owt_tf.fit.compiling import CompileError, GradientClip, apply_summed

# Optimizers whose update of each weight depends only on that weight's own gradient and
# state, so that updating a shard equals updating its part of the whole layer.
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta",
                          "Adamax", "Lion", "Ftrl")


class KerasShardOptimizer:
    """A head_state.ShardOptimizer: one clone of a Keras optimizer per local FC shard, built
    on that shard's variables on its device, outside the strategy's scope. A plain object,
    so that Keras' saver does not walk the clones (their number depends on K); the model
    saves their slots whole.

    Why clones: Keras' `apply_gradients` all-reduces in replica context, and shard gradients
    must never pass through it (it raises no error and gives wrong weights); each shard's
    copy holds that shard's state, and the update is owt_tf.parallel.head.update's."""

    def __init__(self, template: keras.optimizers.Optimizer, head: ShardedHead,
                 devices: List[str], trunk_optimizer, lr_ratio: float,
                 own_schedule: bool = False):
        self.kind = name = type(template).__name__
        if name not in ELEMENTWISE_OPTIMIZERS:
            raise CompileError(f"optimizer {name}: its update is not element-wise, so a shard's "
                               f"update would differ from the whole layer's (supported: "
                               f"{', '.join(ELEMENTWISE_OPTIMIZERS)})")
        if head.sample_rate < 1.0 and name not in SPARSE_OPTIMIZERS:
            raise CompileError(
                f"optimizer {name}: sample_rate={head.sample_rate:g} updates only the sampled "
                f"classes, which {name}'s state cannot do as the dense update would; use "
                "keras.optimizers.SGD (momentum and weight_decay allowed) for the head "
                "(fc_optimizer=) or sample_rate=1")
        config = template.get_config()
        self.head = head
        self.trunk_optimizer = trunk_optimizer
        self.lr_ratio = lr_ratio
        self.weight_decay = template.weight_decay
        # An fc_optimizer with a rate schedule follows it, on its own step count (one per FC
        # update: K a step with fc_batch='worker', as K plain Keras updates would advance it).
        self.own_schedule = own_schedule and isinstance(
            template.get_config()["learning_rate"], dict)

        def build():
            clones = {}
            for k in head.local_shards:
                with tf.device(devices[k]):
                    clone = type(template).from_config(config)
                    clone.build(head.shard_variables(k))
                clones[k] = clone
            return clones

        self.clones: Dict[int, keras.optimizers.Optimizer] = outside_strategy_scope(build)
        self.num_slots = self._check_slots()

    def _state(self, k: int) -> List:
        """The clone's per-variable state (iteration and rate left out), variable by variable:
        Keras builds each variable's slots together ([m0, v0, m1, v1, ...] for Adam)."""
        return [v for v in self.clones[k].variables if v.name not in ("iteration", "learning_rate")]

    def _check_slots(self) -> int:
        k = self.head.local_shards[0]
        variables, state = self.head.shard_variables(k), self._state(k)
        n = len(variables)
        per_variable = len(state) // n
        if len(state) % n or any(tuple(s.shape) != tuple(variables[i // per_variable].shape)
                                 for i, s in enumerate(state)):
            raise CompileError(f"optimizer {type(self.clones[k]).__name__} with these settings: "
                               "its state is not a fixed number of tensors shaped like each "
                               "weight, so it cannot be split with the weights")
        return len(state) // n

    def slots(self, k: int) -> List:
        """Shard k's slots, slot by slot, each in head.shard_variables order (Keras keeps
        them variable by variable: [m0, v0, m1, v1, ...] for Adam)."""
        state, n = self._state(k), len(self.head.shard_variables(k))
        state = [v.value if hasattr(v, "value") else v for v in state]
        return [state[i * self.num_slots + s] for s in range(self.num_slots) for i in range(n)]

    @property
    def iterations(self) -> tf.Variable:
        """The first local shard's update count (every clone counts alike)."""
        return self.clones[self.head.local_shards[0]].iterations

    def sync_iterations(self) -> None:
        """Every clone's count set to the first's (after a restore)."""
        for clone in self.clones.values():
            clone.iterations.assign(self.iterations)

    def learning_rate(self, shard: int) -> tf.Tensor:
        """Shard `shard`'s current rate: the fc_optimizer's own schedule, if it has one; else
        the trunk optimizer's current rate (its schedule, LearningRateScheduler) times the
        ratio set at compile."""
        if self.own_schedule:
            return tf.cast(self.clones[shard].learning_rate, tf.float32)
        return tf.cast(self.trunk_optimizer.learning_rate, tf.float32) * self.lr_ratio

    def apply(self, shard: int, grads: List[tf.Tensor],
              sample: Optional[SampledColumns] = None) -> None:
        """Keras' own update on this shard (owt_tf.parallel.head.update.update_shard):
        decoupled weight decay (as Keras applies it, before the step, at the current rate),
        then SGD's momentum rule by TF's fused kernel, or another optimizer's update_step.
        Under a class `sample` the class layer's sampled rows only."""
        clone = self.clones[shard]
        lr = self.learning_rate(shard)
        sgd = type(clone) is keras.optimizers.SGD
        momentum = float(clone.momentum) if sgd else 0.0
        rule = SGDRule(momentum, bool(clone.nesterov) if sgd else False,
                       float(self.weight_decay or 0.0))
        # Keras variables: their tf.Variables, which the fused kernels and scatters take
        slots = [m.value for m in clone.momentums] if momentum else None
        dense_step = None if sgd else (lambda i, v, g: clone.update_step(g, v, lr))
        update_shard(self.head.shard_variables(shard), slots, grads, sample, lr, rule,
                     dense_step)
        clone.iterations.assign_add(1)



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
        coll.record_gradient_all_reduce(ledger.CONV_GRAD, grads)
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
