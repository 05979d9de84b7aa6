"""SGD with momentum and weight decay as in AlexNet, with separate conv and FC learning rates.

Update rule (Krizhevsky et al. 2012, coupled weight decay):
    v <- momentum * v - lr * (g + weight_decay * w);   w <- w + v

Mirrored variables (the trunk; the FC layers under pure data parallelism) are updated by
a Keras SGD built inside strategy.scope() and applied in replica context, where it
all-reduces (SUM) the gradients itself; Keras' optimizer cannot run in cross-replica
context with MirroredStrategy (its maybe_merge_call needs a replica context). Because the
K replica gradients are summed, each replica adds weight_decay/K * w.

FC shards are never all-reduced: each replica updates its own shard in place with the same
rule (`ShardSGD`). Passing shard gradients through Keras' all-reduce raises no error and
gives silently wrong weights (DESIGN.md), so the two kinds never share an optimizer.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import keras
import tensorflow as tf

from owt_tf.parallel import collectives as coll


class MirroredSGD:
    """Keras SGD over mirrored variables; counts the gradient all-reduce it issues."""

    def __init__(self, strategy: tf.distribute.Strategy, variables: Sequence[tf.Variable],
                 learning_rate: float, momentum: float, weight_decay: float, purpose: str):
        self.variables = list(variables)
        self.weight_decay = weight_decay
        self.purpose = purpose
        with strategy.scope():
            self.optimizer = keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum)
            self.optimizer.build(self.variables)

    @property
    def learning_rate(self) -> tf.Variable:
        return self.optimizer.learning_rate

    def apply(self, grads: Sequence[tf.Tensor]) -> None:
        """Call in replica context with this replica's local gradients."""
        k = coll.num_replicas()
        decayed = [g + (self.weight_decay / k) * v for g, v in zip(grads, self.variables)]
        coll.record(self.purpose, "all_reduce",
                    sum(coll.all_reduce_cost(coll.tensor_bytes(g), k) for g in decayed))
        self.optimizer.apply_gradients(zip(decayed, self.variables))


class ShardSGD(tf.Module):
    """The same rule for FC shards: momentum kept next to each shard, updated locally.

    Holds this process's shards only (all of them in one process; its own devices' in a
    cluster), keyed by shard index.
    """

    def __init__(self, shard_vars: Dict[int, Sequence[tf.Variable]],
                 learning_rate: float, momentum: float, weight_decay: float):
        super().__init__(name="shard_sgd")
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.learning_rate = tf.Variable(learning_rate, trainable=False, name="fc_lr")
        self.slots: Dict[int, List[tf.Variable]] = {}
        for k, variables in shard_vars.items():
            slots = []
            for v in variables:
                with tf.device(v.device):
                    slots.append(tf.Variable(tf.zeros_like(v), trainable=False,
                                             name=v.name.split(":")[0] + "_momentum"))
            self.slots[k] = slots
        self._vars = {k: list(vs) for k, vs in shard_vars.items()}

    def apply(self, shard: int, grads: Sequence[tf.Tensor]) -> None:
        lr = tf.identity(self.learning_rate)
        for v, m, g in zip(self._vars[shard], self.slots[shard], grads):
            m.assign(self.momentum * m - lr * (g + self.weight_decay * v))
            v.assign_add(m)
