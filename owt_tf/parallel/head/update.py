"""An FC shard's update, for both front doors (the CLI's ShardSGD, owt_tf.training.optim,
and Keras' KerasShardOptimizer, owt_tf.fit.updates): `update_shard` runs the rule over a
shard's variables, whole (`momentum_step`, or another Keras optimizer's own step) or, for
the class layer under Partial FC, on its sampled rows only (`sampled_sgd`).

The sampled update: only the sampled classes move. Their rows of the kernel (the layer is class-major, so a
class is a row), their biases, their momentum and their weight decay are updated as SGD
would update them; every other class -- its weights, its momentum, its decay -- waits
untouched until it is sampled again. That is the original Partial FC's rule (InsightFace's
v1: the sampled rows of the weight and of the momentum are gathered, updated and written
back). Its cost is the sample's, never the head's: one fused in-place row update per
variable. Padding entries of a sample (ids past its real size, `valid` False) do not
move.

A rate of 1 never comes here: the dense update stays exactly the one-device update.
Optimizers other than SGD are refused with a sample (owt_tf.fit.updates.KerasShardOptimizer):
Adam's moments and bias correction have no sparse form that equals the dense one, and TensorFlow's lazy
Adam left with TF Addons.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import tensorflow as tf

from owt_tf.parallel.head.sampling import SampledColumns

SPARSE_OPTIMIZERS = ("SGD",)
# (variable index, variable, gradient): another optimizer's own update of a whole variable
DenseStep = Callable[[int, tf.Variable, tf.Tensor], None]


@dataclasses.dataclass(frozen=True)
class SGDRule:
    """SGD's settings: Keras' momentum rule (Nesterov or not) and weight decay, decoupled as
    Keras applies it (w -= w x decay x lr before the step) or, `decoupled_decay` False,
    added to the gradient (the CLI's AlexNet rule: g + decay x w)."""

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    decoupled_decay: bool = True


def update_shard(variables: Sequence[tf.Variable], slots: Optional[Sequence[tf.Variable]],
                 grads: Sequence[tf.Tensor], sample: Optional[SampledColumns],
                 learning_rate: tf.Tensor, rule: SGDRule,
                 dense_step: Optional[DenseStep] = None) -> None:
    """One FC update of a shard's `variables` (head.shard_variables order) by `grads`, their
    momentum in `slots` (None without momentum). Each variable moves whole, by SGD's rule
    or by `dense_step` (another element-wise optimizer's own update, after the decoupled
    decay); under a class `sample` the class layer (the last two variables) moves on its
    sampled rows only."""
    dense = len(variables) - (2 if sample is not None else 0)
    for i, (variable, grad) in enumerate(zip(variables[:dense], grads[:dense])):
        if rule.weight_decay and rule.decoupled_decay:
            variable.assign_sub(variable * tf.cast(rule.weight_decay * learning_rate,
                                                   variable.dtype))
        elif rule.weight_decay:
            grad = grad + rule.weight_decay * variable
        if dense_step is not None:
            dense_step(i, variable, grad)
        elif slots is not None:
            momentum_step(variable, slots[i], grad, learning_rate, rule.momentum, rule.nesterov)
        else:
            variable.assign_sub(tf.cast(learning_rate, variable.dtype)
                                * tf.cast(grad, variable.dtype))
    if sample is not None:
        sampled_sgd(variables[dense:], None if slots is None else slots[dense:], grads[dense:],
                    sample, learning_rate, rule.momentum, rule.nesterov, rule.weight_decay,
                    rule.decoupled_decay)


def sampled_sgd(variables: Sequence[tf.Variable], slots: Optional[Sequence[tf.Variable]],
                grads: Sequence[tf.Tensor], sample: SampledColumns, learning_rate: tf.Tensor,
                momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                decoupled_decay: bool = True) -> None:
    """SGD on the sampled rows of a class-major layer's `variables` (kernel [width, in],
    bias [width]) given their gradients `grads` ([S, in], [S]) and, with momentum, their
    `slots`. Keras' SGD rule (velocity = momentum x velocity - lr x g; w += velocity, or
    w += momentum x velocity - lr x g with Nesterov); `weight_decay` decoupled as Keras
    applies it (w -= w x decay x lr first) or, with `decoupled_decay` False, added to the
    gradient (the CLI's SGD: g + decay x w).

    In place: TensorFlow's fused sparse momentum kernel (ResourceSparseApplyKerasMomentum,
    Keras' formula) updates the rows where they are, so a step holds no gathered copy of
    the weights or the velocity (at 10M classes each is 134 MB a replica)."""
    ids = tf.boolean_mask(sample.ids, sample.valid)  # the sample's padding does not move
    for i, (variable, grad) in enumerate(zip(variables, grads)):
        lr = tf.cast(learning_rate, variable.dtype)
        grad = tf.boolean_mask(tf.cast(grad, variable.dtype), sample.valid)
        if weight_decay:
            decay = tf.cast(weight_decay, variable.dtype)
            rows = tf.gather(variable, ids)
            if decoupled_decay:
                variable.scatter_sub(tf.IndexedSlices(rows * (decay * lr), ids))
            else:
                grad = grad + decay * rows
            del rows
        if momentum and slots is not None:
            tf.raw_ops.ResourceSparseApplyKerasMomentum(
                var=variable.handle, accum=slots[i].handle, lr=lr, grad=grad, indices=ids,
                momentum=tf.cast(momentum, variable.dtype), use_nesterov=bool(nesterov))
        else:
            variable.scatter_sub(tf.IndexedSlices(lr * grad, ids))


def momentum_step(variable, slot, grad: tf.Tensor, learning_rate: tf.Tensor, momentum: float,
                  nesterov: bool = False) -> None:
    """Keras SGD's momentum rule on a whole shard variable (slot <- momentum x slot - lr x g;
    w <- w + slot, or w + momentum x slot - lr x g with Nesterov) by TensorFlow's fused
    kernel: one pass over the shard where assign ops take four (the update is
    memory-bound: 58.6M weights in AlexNet's head)."""
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=variable.handle, accum=slot.handle, lr=tf.cast(learning_rate, variable.dtype),
        grad=tf.cast(grad, variable.dtype), momentum=tf.cast(momentum, variable.dtype),
        use_nesterov=bool(nesterov))


def whole_shard_gradients(head, shard: int, grads: Sequence[tf.Tensor],
                          sample: Optional[SampledColumns]) -> list:
    """One FC update's gradients of shard `shard` shaped like its variables: under a sample
    the class layer's sampled rows scattered into zeros. For reports and tests that compare
    whole gradients; a training step never builds them."""
    if sample is None:
        return list(grads)
    class_layer = head.layers[-1].shard_variables(shard)
    return list(grads[:-2]) + [
        tf.scatter_nd(sample.ids[:, None], g, tf.shape(v, out_type=sample.ids.dtype))
        for v, g in zip(class_layer, grads[-2:])]
