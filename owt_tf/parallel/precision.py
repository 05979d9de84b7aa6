"""Mixed precision: the Keras policy a trunk is built under, and fp16's loss scale.

`--precision bf16|fp16` makes the trunk and the FC shards compute in bfloat16 / float16 with
float32 weights (Keras' `mixed_bfloat16` / `mixed_float16` policies; the shards cast their
float32 variables the same way, owt_tf.parallel.head.layout). Activations and their gradients
travel between replicas in the compute dtype, so the exchanges carry half the bytes; weight
gradients, their all-reduce, the optimizer state and the loss stay float32. fp16 also
needs a loss scale (`DynamicLossScale`); bfloat16 has float32's range and needs none.
The step's numerical checks live here too: gradients of a scaled loss `unscaled`, and
`finite_flags`, what the guard (and fp16's overflow verdict) reads.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence

import keras
import tensorflow as tf

_POLICIES = {"float32": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}


@contextlib.contextmanager
def keras_policy(compute_dtype: str) -> Iterator[None]:
    """Keras layers created inside compute in `compute_dtype` with float32 weights.

    Keras has only a process-wide policy (keras.config.set_dtype_policy); it is set for the
    duration of the block and restored after."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(_POLICIES[compute_dtype])
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


class DynamicLossScale:
    """fp16's dynamic loss scale, by the rule of Keras' LossScaleOptimizer: gradients are
    taken of the loss times `scale` (2^15 at first), so that small activation gradients do
    not underflow float16; a step whose gradients are not all finite is undone by the caller
    and halves the scale; `growth_steps` finite steps in a row double it. One scale serves
    the trunk and every FC shard: they are gradients of one loss."""

    def __init__(self, initial: float = 2.0 ** 15, growth_steps: int = 2000):
        self.growth_steps = growth_steps
        self.scale = tf.Variable(initial, dtype=tf.float32, trainable=False, name="loss_scale")
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name="loss_scale_good_steps")

    @property
    def at_minimum(self) -> bool:
        """Whether the scale is down to 1: a non-finite gradient then is no overflow of it."""
        return float(self.scale.numpy()) <= 1.0

    def update(self, finite: bool) -> None:
        """After a step: halve on a non-finite gradient, double after growth_steps good ones."""
        if not finite:
            self.scale.assign(max(float(self.scale.numpy()) / 2.0, 1.0))
            self.good_steps.assign(0)
            return
        self.good_steps.assign_add(1)
        if int(self.good_steps.numpy()) >= self.growth_steps:
            self.scale.assign(float(self.scale.numpy()) * 2.0)
            self.good_steps.assign(0)


def unscaled(grads: List[tf.Tensor], loss_scale: Optional[tf.Tensor]) -> List[tf.Tensor]:
    """Gradients of (loss x loss_scale) as gradients of the loss."""
    if loss_scale is None:
        return grads
    return [g / tf.cast(loss_scale, g.dtype) for g in grads]


def finite_flags(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """bool [len(tensors)]: is every value of each tensor finite."""
    return tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])
