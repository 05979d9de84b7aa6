"""SGD with momentum and weight decay as in AlexNet, with separate conv and FC learning rates.

Update rule (Krizhevsky et al. 2012, coupled weight decay):
    v <- momentum * v - lr * (g + weight_decay * w);   w <- w + v

Mirrored variables (the trunk; the FC layers under pure data parallelism) are updated by
a Keras SGD built inside strategy.scope() and applied in replica context, where it
all-reduces (SUM) the gradients itself; Keras' optimizer cannot run in cross-replica
context with MirroredStrategy (its maybe_merge_call needs a replica context). Because the
K replica gradients are summed, each replica adds weight_decay/K * w.

FC shards are never all-reduced: each replica updates its own shard in place with the same
rule (`ShardSGD`, an owt_tf.parallel.head.state.ShardOptimizer, so the head's state is saved
as the Keras path saves it; the update itself, and under Partial FC sampling the class
layer's sampled rows only, is owt_tf.parallel.head.update's, which Keras' path runs too). Passing shard gradients through Keras' all-reduce raises no error and
gives silently wrong weights (docs/design.md), so the two kinds never share an optimizer.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import keras
import tensorflow as tf

from owt_tf.parallel import collectives as coll

from owt_tf.parallel.head.sampling import SampledColumns
from owt_tf.parallel.head.update import SGDRule, update_shard
from owt_tf.planner import ledger


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
        coll.record_gradient_all_reduce(self.purpose, decayed)
        self.optimizer.apply_gradients(zip(decayed, self.variables))

    def state_variables(self) -> List[tf.Variable]:
        return list(self.optimizer.variables)


class MirroredFcSGD(MirroredSGD):
    """The FC layers under pure data parallelism: one mirrored copy ("shard" 0)."""

    kind, num_slots, iterations = "SGD", 1, None  # a ShardOptimizer; the run's step counts

    def apply(self, shard: int, grads: Sequence[tf.Tensor],  # type: ignore[override]
              sample: Optional[SampledColumns] = None) -> None:
        super().apply(grads)  # never sampled: data parallelism cannot sample

    def slots(self, shard: int) -> List[tf.Variable]:
        """Momentum of each variable, in the order the variables were given."""
        return list(self.optimizer.momentums)


class ShardSGD(tf.Module):
    """The same rule for FC shards: momentum kept next to each shard, updated locally.

    Holds this process's shards only (all of them in one process; its own devices' in a
    cluster), keyed by shard index.
    """

    kind, num_slots, iterations = "SGD", 1, None  # a ShardOptimizer; the run's step counts

    def __init__(self, shard_vars: Dict[int, Sequence[tf.Variable]],
                 learning_rate: float, momentum: float, weight_decay: float):
        super().__init__(name="shard_sgd")
        self.rule = SGDRule(momentum, weight_decay=weight_decay, decoupled_decay=False)
        self.learning_rate = tf.Variable(learning_rate, trainable=False, name="fc_lr")
        self.slots_by_shard: Dict[int, List[tf.Variable]] = {}
        for k, variables in shard_vars.items():
            slots = []
            for v in variables:
                with tf.device(v.device):
                    slots.append(tf.Variable(tf.zeros_like(v), trainable=False,
                                             name=v.name.split(":")[0] + "_momentum"))
            self.slots_by_shard[k] = slots
        self._vars = {k: list(vs) for k, vs in shard_vars.items()}

    def slots(self, shard: int) -> List[tf.Variable]:
        return self.slots_by_shard[shard]

    def state_variables(self) -> List[tf.Variable]:
        return [m for slots in self.slots_by_shard.values() for m in slots]

    def apply(self, shard: int, grads: Sequence[tf.Tensor],
              sample: Optional[SampledColumns] = None) -> None:
        update_shard(self._vars[shard], self.slots_by_shard[shard], grads, sample,
                     tf.identity(self.learning_rate), self.rule)


@dataclasses.dataclass
class HybridOptimizer:
    """The run's two optimizers: the trunk's (mirrored, all-reduced) and the FC layers'
    (`apply(shard, grads)`, `slots(shard)`: one interface for shards and the mirrored copy)."""

    trunk: MirroredSGD
    fc: "MirroredFcSGD | ShardSGD"

    @property
    def fc_learning_rate(self) -> tf.Variable:
        return self.fc.learning_rate

    def set_learning_rates(self, conv_lr: float, fc_lr: float) -> None:
        self.trunk.learning_rate.assign(conv_lr)
        self.fc_learning_rate.assign(fc_lr)

    def state_variables(self) -> List[tf.Variable]:
        return self.trunk.state_variables() + self.fc.state_variables()


def build_optimizer(hybrid, model, conv_lr: float, fc_lr: float, momentum: float,
                    weight_decay: float) -> HybridOptimizer:
    """The optimizers of a HybridStrategy's DistributedModel."""
    trunk = MirroredSGD(hybrid.strategy, model.trunk.trainable_variables, conv_lr, momentum,
                        weight_decay, ledger.CONV_GRAD)
    if hybrid.model_parallel:
        shards = {k: model.head.shard_variables(k) for k in model.head.local_shards}
        return HybridOptimizer(trunk, ShardSGD(shards, fc_lr, momentum, weight_decay))
    fc = MirroredFcSGD(hybrid.strategy, model.head.shard_variables(0), fc_lr, momentum,
                       weight_decay, ledger.FC_GRAD)
    return HybridOptimizer(trunk, fc)
