"""What `ParallelModel.compile` makes of the user's settings: the loss per example (wrapped as
Keras' compile wraps it) and its reduction, gradient clipping as one device clips, and the
refusals, each one line (`CompileError`). The FC shards' optimizers: owt_tf.fit.updates.
"""
from __future__ import annotations

from typing import Dict, List

import keras
import tensorflow as tf

from owt_tf.parallel import collectives as coll
from owt_tf.planner import ledger


class CompileError(ValueError):
    """A compile setting a parallelized model cannot honour (the message says why)."""


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


# Keras' loss reductions a parallelized model honours: what a batch's weighted loss sum is
# divided by (Keras' `reduce_values`).
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
REDUCTIONS = MEAN_REDUCTIONS + ("sum", "mean_with_sample_weight")


def _loss_object(loss) -> keras.losses.Loss:
    if loss is None:
        raise CompileError("loss is required")
    fn = keras.losses.get(loss)
    return fn if isinstance(fn, keras.losses.Loss) else _FunctionLoss(fn)


def loss_reduction(loss) -> str:
    """The compiled loss's reduction over a batch (CompileError for one not honoured)."""
    reduction = _loss_object(loss).get_config().get("reduction")
    if reduction not in REDUCTIONS:
        raise CompileError(f"loss reduction {reduction!r} is not supported (supported: "
                           f"{', '.join(REDUCTIONS)})")
    return reduction


def loss_divisor(reduction: str, rows: tf.Tensor, weight_sum: tf.Tensor) -> tf.Tensor:
    """What Keras divides a batch's sum of (loss x sample weight) by: its rows, 1 ("sum") or
    the sum of its weights ("mean_with_sample_weight")."""
    if reduction == "sum":
        return tf.constant(1.0)
    if reduction == "mean_with_sample_weight":
        return weight_sum
    return tf.cast(rows, tf.float32)


def per_example_loss(loss):
    """(labels, outputs) -> per-example values of the compiled loss (the engine takes their
    weighted mean over each round's rows; `loss_divisor` turns that into Keras' reduction).

    A string or plain function is wrapped in `LossFunctionWrapper` as Keras' compile does, so
    that labels and outputs are brought to the same rank first ([B] labels against a [B, 1]
    head); labels are converted to the loss's dtype as `Loss.__call__` does."""
    fn = _loss_object(loss)
    loss_reduction(loss)
    if fn.get_config().get("ignore_class") is not None:
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


CLIP_SETTINGS = ("clipnorm", "global_clipnorm", "clipvalue")


def _clip_settings(opt) -> Dict[str, float]:
    return {a: float(getattr(opt, a)) for a in CLIP_SETTINGS if getattr(opt, a, None)}


def _by_norm(grads: List[tf.Tensor], norm: tf.Tensor, limit: float) -> List[tf.Tensor]:
    """grads x limit / max(norm, limit): Keras' clip_by_norm and clip_by_global_norm."""
    scale = limit / tf.maximum(norm, limit)
    return [g * tf.cast(scale, g.dtype) for g in grads]


def _norm(squares: tf.Tensor) -> tf.Tensor:
    return tf.sqrt(tf.maximum(squares, 0.0))


class GradientClip:
    """The optimizers' clipnorm / global_clipnorm / clipvalue applied as a one-device Keras
    run applies them: to whole gradients. Keras under a tf.distribute strategy clips each
    replica's part of a trunk gradient before the all-reduce; here the trunk's gradients are
    clipped after it, and an FC weight's norm is taken over all its shards (an all-reduce of
    squared norms, a few floats)."""

    def __init__(self, trunk_optimizer, fc_template):
        self.trunk_settings = _clip_settings(trunk_optimizer)
        self.fc_settings = _clip_settings(fc_template)
        self.global_norm = self.trunk_settings.get("global_clipnorm")
        if ("global_clipnorm" in self.fc_settings) != (self.global_norm is not None) or (
                self.global_norm is not None
                and self.fc_settings["global_clipnorm"] != self.global_norm):
            raise CompileError("global_clipnorm spans every weight: set it alike on optimizer "
                               "and fc_optimizer")

    @property
    def active(self) -> bool:
        return bool(self.trunk_settings or self.fc_settings)

    def trunk(self, grads: List[tf.Tensor]) -> List[tf.Tensor]:
        """Per-weight clipping of the trunk's summed gradients (global_clipnorm: `whole`)."""
        return _per_weight(grads, self.trunk_settings, lambda squares: squares)

    def fc(self, grads: List[tf.Tensor]) -> List[tf.Tensor]:
        """Per-weight clipping of this replica's shard gradients, norms over every shard."""
        return _per_weight(grads, self.fc_settings,
                           lambda squares: coll.all_reduce_sum(squares, ledger.FC_GRAD))

    def whole(self, trunk_grads: List[tf.Tensor], fc_grads: List[tf.Tensor]):
        """global_clipnorm: one norm over the trunk's summed gradients and every shard's."""
        squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in trunk_grads]
                           or [tf.constant(0.0)])
        shard = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in fc_grads])
        norm = _norm(squares + coll.all_reduce_sum(shard, ledger.FC_GRAD))
        return (_by_norm(trunk_grads, norm, self.global_norm),
                _by_norm(fc_grads, norm, self.global_norm))


def apply_summed(optimizer: keras.optimizers.Optimizer, grads: List[tf.Tensor],
                 variables: List) -> None:
    """Keras' `apply_gradients` on gradients already summed over replicas (and clipped):
    its own all-reduce and clipping are skipped. Keras 3 has no public switch for this (TF's
    `experimental_aggregate_gradients` is gone), so its two hooks are bypassed while the step
    is traced (keras/src/backend/tensorflow/optimizer.py `_all_reduce_sum_gradients`,
    keras/src/optimizers/base_optimizer.py `_clip_gradients`)."""
    hooks = {"_all_reduce_sum_gradients": list, "_clip_gradients": list}
    for name, bypass in hooks.items():
        if not hasattr(optimizer, name):
            raise RuntimeError(f"this Keras version's optimizer has no {name}: owt_tf's "
                               "clipping needs it")
        # In the instance's __dict__ directly: Keras' tracking __setattr__ would take them
        # for state.
        optimizer.__dict__[name] = bypass
    try:
        optimizer.apply_gradients(zip(grads, variables))
    finally:
        for name in hooks:
            optimizer.__dict__.pop(name, None)


def inner_optimizer(optimizer):
    """The optimizer a LossScaleOptimizer wraps (any other: itself)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def refuse_for_fc_batch(fc_batch: str, reduction: str, clip: GradientClip,
                        loss_scaled: bool) -> None:
    """With fc_batch='worker' the FC layers take K updates a step, each on one round's rows:
    a reduction or a norm over the whole batch has no one-device counterpart, and a step
    cannot be skipped whole once its first rounds have updated the FC layers."""
    if fc_batch != "worker":
        return
    if loss_scaled:
        raise CompileError("a LossScaleOptimizer (mixed_float16) with fc_batch='worker': an "
                           "overflow must skip the whole step, and the rounds before it have "
                           "updated the FC layers already (use fc_batch='global')")
    if reduction not in MEAN_REDUCTIONS:
        raise CompileError(f"loss reduction {reduction!r} with fc_batch='worker': each FC "
                           "update is a mean over its round's rows (use fc_batch='global')")
    if clip.global_norm is not None:
        raise CompileError("global_clipnorm with fc_batch='worker': the FC layers are "
                           "updated K times a step, the trunk once (use clipnorm or "
                           "fc_batch='global')")


def _per_weight(grads: List[tf.Tensor], settings: Dict[str, float], total) -> List[tf.Tensor]:
    if "clipvalue" in settings:
        v = settings["clipvalue"]
        return [tf.clip_by_value(g, -v, v) for g in grads]
    if "clipnorm" in settings:
        squares = total(tf.stack([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads]))
        return [_by_norm([g], _norm(squares[i]), settings["clipnorm"])[0]
                for i, g in enumerate(grads)]
    return grads


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
        raise CompileError("fc_optimizer: pass the optimizer itself; the loss scale is the "
                           "trunk optimizer's, one for trunk and shards")
    for attr, why in (("use_ema", "EMA weights are not kept for shards"),
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
