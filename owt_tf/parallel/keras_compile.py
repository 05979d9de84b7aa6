"""What `ParallelModel.compile` makes of the user's settings: the loss per example (wrapped as
Keras' compile wraps it), the FC shards' Keras optimizers (a head_state.ShardOptimizer:
one clone per shard), and the refusals, each one line (`CompileError`).

Why clones: Keras' `apply_gradients` all-reduces in replica context, and shard gradients
must never pass through it (it raises no error and gives wrong weights); each shard gets
its own copy of the optimizer on its own device, driven with `update_step`.
"""
from __future__ import annotations

from typing import Dict, List

import keras
import tensorflow as tf

from owt_tf.devices import outside_strategy_scope
from owt_tf.parallel.shards import ShardedHead

# Optimizers whose update of each weight depends only on that weight's own gradient and
# state, so that updating a shard equals updating its part of the whole layer.
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta",
                          "Adamax", "Lion", "Ftrl")


class CompileError(ValueError):
    """A compile setting a parallelized model cannot honour (the message says why)."""


class KerasShardOptimizer:
    """A head_state.ShardOptimizer: one clone of a Keras optimizer per local FC shard, built
    on that shard's variables on its device, outside the strategy's scope. A plain object,
    so that Keras' saver does not walk the clones (their number depends on K); the model
    saves their slots whole."""

    def __init__(self, template: keras.optimizers.Optimizer, head: ShardedHead,
                 devices: List[str], trunk_optimizer, lr_ratio: float,
                 own_schedule: bool = False):
        self.kind = name = type(template).__name__
        if name not in ELEMENTWISE_OPTIMIZERS:
            raise CompileError(f"optimizer {name}: its update is not element-wise, so a shard's "
                               f"update would differ from the whole layer's (supported: "
                               f"{', '.join(ELEMENTWISE_OPTIMIZERS)})")
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

    def apply(self, shard: int, grads: List[tf.Tensor]) -> None:
        """Keras' own update on this shard: decoupled weight decay (as Keras applies it,
        before the step, at the current rate), then the optimizer's update_step."""
        clone = self.clones[shard]
        lr = self.learning_rate(shard)
        for g, v in zip(grads, self.head.shard_variables(shard)):
            if self.weight_decay:
                v.assign_sub(v * tf.cast(self.weight_decay * lr, v.dtype))
            clone.update_step(g, v, lr)
        with tf.control_dependencies(grads):  # see ParallelModel._after_data
            clone.iterations.assign_add(1)


def _initial_rate(optimizer: keras.optimizers.Optimizer) -> float:
    lr = optimizer.get_config()["learning_rate"]
    if isinstance(lr, dict):  # a serialized schedule: its rate at step 0
        lr = keras.optimizers.schedules.deserialize(lr)(0)
    return float(lr)


def rate_ratio(optimizer, fc_optimizer) -> float:
    """FC rate / trunk rate, fixed at compile (1 without an fc_optimizer)."""
    if fc_optimizer is None:
        return 1.0
    trunk_rate = _initial_rate(optimizer)
    if trunk_rate <= 0:
        raise CompileError("with fc_optimizer, the trunk optimizer's rate at step 0 must be > 0 "
                           "(the FC rate follows it in the ratio of the two)")
    return _initial_rate(keras.optimizers.get(fc_optimizer)) / trunk_rate


def _same_rank(labels: tf.Tensor, outputs: tf.Tensor):
    """Keras' rank rule for a loss function (`squeeze_or_expand_to_same_rank`, applied by its
    `LossFunctionWrapper`): when the ranks differ by one and the longer has a last axis of 1,
    rank-1 labels gain that axis, else the longer loses it."""
    lr, orank = labels.shape.rank, outputs.shape.rank
    if lr == orank + 1 and labels.shape[-1] == 1:
        return (labels, outputs[:, None]) if orank == 1 else (tf.squeeze(labels, -1), outputs)
    if orank == lr + 1 and outputs.shape[-1] == 1:
        return (labels[:, None], outputs) if lr == 1 else (labels, tf.squeeze(outputs, -1))
    return labels, outputs


class _FunctionLoss(keras.losses.Loss):
    """A string or plain-function loss as Keras' compile wraps it (ranks aligned first)."""

    def __init__(self, fn):
        super().__init__(name=getattr(fn, "__name__", None))
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(*_same_rank(y_true, y_pred))


def per_example_loss(loss):
    """(labels, outputs) -> per-example values of the compiled loss (a mean over each
    round's rows is taken by the engine, as Keras' default reduction does).

    A string or plain function is wrapped in `LossFunctionWrapper` as Keras' compile does, so
    that labels and outputs are brought to the same rank first ([B] labels against a [B, 1]
    head); labels are converted to the loss's dtype as `Loss.__call__` does."""
    if loss is None:
        raise CompileError("loss is required")
    fn = keras.losses.get(loss)
    if not isinstance(fn, keras.losses.Loss):
        fn = _FunctionLoss(fn)
    config = fn.get_config()
    if config.get("reduction") not in ("sum_over_batch_size", "mean"):
        raise CompileError(f"loss reduction {config.get('reduction')!r} is not supported "
                           "(the loss is averaged over each round's rows)")
    if config.get("ignore_class") is not None:
        raise CompileError("ignore_class is not supported (the loss is averaged over "
                           "every row of a round)")
    dtype = tf.as_dtype(fn.dtype or "float32")

    def per_example(labels, outputs):
        values = fn.call(tf.cast(labels, dtype), outputs)
        if values.shape.rank != 1:
            raise CompileError(f"the loss must give one value per example; it gave shape "
                               f"{values.shape}")
        return values

    return per_example


def refuse_settings(steps_per_execution, run_eagerly, jit_compile, loss, kwargs) -> None:
    """CompileError for a compile setting a parallelized model cannot honour."""
    if steps_per_execution != 1:
        raise CompileError(f"steps_per_execution={steps_per_execution!r} is not supported "
                           "(1 only): Keras fails with more under MirroredStrategy "
                           "(keras-team/keras#19246)")
    if kwargs.get("loss_scale_factor") is not None:
        raise CompileError("loss_scale_factor is not supported (the shards' updates would "
                           "not be scaled like the trunk's)")
    if run_eagerly:
        raise CompileError("run_eagerly=True is not supported: the forward gather and the "
                           "backward all-to-all of different replicas deadlock when run op "
                           "by op")
    if jit_compile is True:
        raise CompileError("jit_compile=True on the whole step is not supported: XLA cannot "
                           "hold variables of several devices in one cluster; use "
                           "HybridStrategy(jit=True), which compiles each trunk")
    if isinstance(loss, (dict, list, tuple)) or kwargs.get("loss_weights"):
        raise CompileError("one loss for one output only (the model has one output)")


def refuse_optimizer(opt, current=None) -> None:
    """CompileError for an optimizer the shards cannot follow; `current`: the model's own
    (passed again at a recompile)."""
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        raise CompileError("LossScaleOptimizer is not supported (float32 only)")
    for attr, why in (("clipvalue", "Keras clips each replica's part of a trunk "
                                    "gradient, not the sum"),
                      ("clipnorm", "a norm over a whole FC layer spans its shards"),
                      ("global_clipnorm", "a norm over all weights spans the shards"),
                      ("use_ema", "EMA weights are not kept for shards"),
                      ("gradient_accumulation_steps", "accumulation is not supported")):
        if getattr(opt, attr, None):
            raise CompileError(f"optimizer {attr}: not supported ({why})")
    if opt.built and opt is not current:
        raise CompileError("pass an optimizer that has not been used yet (it is rebuilt "
                           "inside the strategy's scope)")
    # Exclusions are not in the optimizer's config, so its copies would decay every weight.
    if getattr(opt, "_exclude_from_weight_decay", None) or getattr(
            opt, "_exclude_from_weight_decay_pattern", None):
        raise CompileError("exclude_from_weight_decay is not supported")
