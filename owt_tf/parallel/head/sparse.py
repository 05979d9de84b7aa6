"""The shards' SGD kernels: the sampled update of a class layer (Partial FC: what moves when
an FC update keeps only a sample of each shard's classes), and the dense momentum step.

Only the sampled classes move. Their rows of the kernel (the layer is class-major, so a
class is a row), their biases, their momentum and their weight decay are updated as SGD
would update them; every other class -- its weights, its momentum, its decay -- waits
untouched until it is sampled again. That is the original Partial FC's rule (InsightFace's
v1: the sampled rows of the weight and of the momentum are gathered, updated and written
back). Its cost is the sample's, never the head's: one fused in-place row update per
variable. Padding entries of a sample (ids past its real size, `valid` False) do not
move.

A rate of 1 never comes here: the dense update stays exactly the one-device update.
Optimizers other than SGD are refused with a sample (owt_tf.fit.compiling): Adam's moments
and bias correction have no sparse form that equals the dense one, and TensorFlow's lazy
Adam left with TF Addons.
"""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from owt_tf.parallel.head.sampling import SampledColumns

SPARSE_OPTIMIZERS = ("SGD",)


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
