"""What one replica does in a step: trunk forward, the FC rounds, trunk backward, updates.

Both drivers call these functions inside `strategy.run`: the CLI's custom loop (through
StepDriver.train_step, owt_tf.training.driver) and Keras' `Model.fit` (through
ParallelModel.train_step). They
differ only in what they pass in: how the trunk runs (with or without XLA), which
optimizers apply the updates, and which loss the head computes.

    activations = trunk(images)                        data-parallel, this replica's rows
    rounds      = run_fc_rounds(...)                   the scheme's exchanges + FC shards
    trunk grads = d activations^T . activation_grad    back through the trunk
    apply_trunk(trunk grads)                           all-reduced by the trunk's optimizer

BatchNormalization's moving statistics are not averaged in the step: TrunkRunner's
`average_statistics` makes them one set whenever they are read (see its docstring).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from owt_tf.models.layers import moving_statistics
from owt_tf.parallel import collectives as coll

from owt_tf.planner import ledger
from owt_tf.planner.plan import StepRounds
from owt_tf.parallel.head.sampling import SampledColumns
from owt_tf.parallel.precision import unscaled
from owt_tf.parallel.schemes import RoundsResult, run_fc_rounds
from owt_tf.parallel.head.forward import forward
from owt_tf.parallel.head.loss import loss_terms
from owt_tf.parallel.head.layout import ShardedHead

# images -> (last conv activations, extra trunk loss or None). The extra loss (a Keras
# trunk's regularization losses) is added to the trunk's objective once per model.
TrunkForward = Callable[[tf.Tensor], Tuple[tf.Tensor, Optional[tf.Tensor]]]
ApplyTrunk = Callable[[List[tf.Tensor]], None]
# (shard, its FC gradients, the update's class sample or None): see schemes.FcUpdate
ApplyFc = Callable[[int, List[tf.Tensor], Optional[SampledColumns]], None]


class TrunkRunner:
    """The trunk's forward pass as a TrunkForward, in training or inference mode; with
    `jit`, an XLA-compiled function per replica and mode, made once and kept here (with the
    model that owns this runner, not in a cache of the strategy's).

    Only this pure compute block is compiled: jit_compile on the whole step or replica
    function fails ("Trying to access resource ... located in device CPU:1 from device
    CPU:0": MirroredStrategy wraps one XLA cluster around all replicas unless every device
    is a GPU; CollectiveGatherV2 has no XLA kernel, keras-team/keras#18110). One function
    per replica, so that each captures its own replica's variables.
    """

    def __init__(self, trunk: keras.Model, jit: bool = False):
        self.trunk = trunk
        self.jit = jit
        self._compiled: Dict[Tuple[bool, int], Callable] = {}
        self.moving_statistics = moving_statistics(trunk)
        self._average: Optional[Callable[[], None]] = None

    def average_statistics(self, run: Callable) -> None:
        """Makes the trunk's BatchNormalization moving statistics one set: every replica's
        copy becomes their mean over the replicas. `run`: Placement.run. Called wherever
        the statistics are read (evaluation, features, export, a checkpoint, the end of a
        fit), on every worker of a cluster (a collective).

        Under MirroredStrategy each replica's step updates its own copy from its own rows
        (Keras creates them with aggregation NONE, tensorflow/tensorflow#46488), so an
        image's embedding would depend on the replica that embeds it, and an export (one
        copy) would differ from the run. The update is linear (m <- mu m + (1 - mu) b, with
        b the batch's statistic, which does not depend on m), so the replicas' mean after n
        steps is what averaging after every step would hold (PyTorch DDP keeps one set by
        broadcasting rank 0's every step): one set from every replica's rows, with no
        collective in the step."""
        if not self.moving_statistics:
            return
        if self._average is None:
            statistics = self.moving_statistics

            def average_everywhere():
                run(functools.partial(average_moving_statistics, statistics))

            self._average = tf.function(average_everywhere, autograph=False)
        self._average()

    def forward(self, training: bool) -> TrunkForward:
        trunk = self.trunk

        def run(images):
            return trunk(images, training=training)

        compiled = run
        if self.jit:
            key = (training, coll.replica_id())
            if key not in self._compiled:
                self._compiled[key] = tf.function(run, jit_compile=True)
            compiled = self._compiled[key]

        def with_regularization(images):
            activations = compiled(images)
            losses = trunk.losses if training else []
            return activations, (tf.add_n(losses) if losses else None)

        return with_regularization


def average_moving_statistics(statistics: Sequence[tf.Variable]) -> None:
    """Sets every replica's moving statistics to their mean over the replicas (call inside
    strategy.run). One all-reduce of all statistics, packed."""
    if not statistics or coll.num_replicas() == 1:
        return
    values = [tf.identity(v.value if isinstance(v, keras.Variable) else v) for v in statistics]
    packed = tf.concat([tf.reshape(v, [-1]) for v in values], 0)
    mean = coll.sum_of_values(packed, ledger.MOVING_STATS) / coll.num_replicas()
    sizes = [int(v.shape.num_elements()) for v in values]
    for variable, part, value in zip(statistics, tf.split(mean, sizes), values):
        variable.assign(tf.reshape(part, value.shape))


@dataclasses.dataclass
class ReplicaStep:
    """One replica's results of a training step."""

    rounds: RoundsResult
    trunk_grads: List[tf.Tensor]
    trunk_loss: Optional[tf.Tensor]  # the trunk's extra loss (regularization), if any


def step_seed(seed: int, step: tf.Tensor) -> tf.Tensor:
    """The seed of optimizer step `step` of a run seeded by `seed` (int32 [2]): the head's
    dropout masks and Partial FC's class samples follow it, so a resumed run draws what an
    uninterrupted one would. The CLI's driver and Keras' train_step both take it here."""
    return tf.cast(tf.stack([tf.constant(seed, tf.int64), tf.cast(step, tf.int64)]), tf.int32)


def shard_index(rounds: StepRounds) -> int:
    """Which FC shard this replica holds: its replica id (model parallel) or the one copy."""
    return coll.replica_id() if rounds.model_parallel else 0


def replica_train_step(rounds: StepRounds, head: ShardedHead, trunk_forward: TrunkForward,
                       trunk_variables: Sequence[tf.Variable], images: tf.Tensor,
                       labels: tf.Tensor, seed: Optional[tf.Tensor], apply_trunk: ApplyTrunk,
                       apply_fc: ApplyFc, loss_scale: Optional[tf.Tensor] = None,
                       row_weights: Optional[List[tf.Tensor]] = None) -> ReplicaStep:
    """One optimizer step of this replica (call inside strategy.run). With a `loss_scale`
    (fp16), gradients are taken of the loss times it and unscaled before they are applied.
    `row_weights` (per round, schemes.round_weights): each example's loss is multiplied by
    its row's weight."""
    shard = shard_index(rounds)
    with tf.GradientTape() as trunk_tape:
        activations, trunk_loss = trunk_forward(images)
        activations = tf.cast(activations, head.compute_dtype)  # what the exchange sends
    result = run_fc_rounds(rounds, head, activations, labels, shard, True, seed,
                           lambda grads, sample: apply_fc(shard, grads, sample), loss_scale,
                           row_weights)
    targets, output_grads = [activations], [result.activation_grad]
    if trunk_loss is not None:
        # Every replica adds its copy and the trunk optimizer sums the K gradients: each
        # contributes 1/K. The 1/K goes into the output gradient: a target computed after the
        # tape closed (trunk_loss / K) is not on the tape, and its gradient would be silently
        # zero -- the regularization dropped from every update.
        scale = 1.0 if loss_scale is None else tf.cast(loss_scale, trunk_loss.dtype)
        targets.append(trunk_loss)
        output_grads.append(tf.ones_like(trunk_loss) * scale / rounds.num_replicas)
    grads = trunk_tape.gradient(targets, list(trunk_variables), output_gradients=output_grads)
    grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, trunk_variables)]
    grads = unscaled(grads, loss_scale)
    apply_trunk(grads)
    return ReplicaStep(result, grads, trunk_loss)


def replica_logit_shard(model_parallel: bool, head: ShardedHead, trunk_forward: TrunkForward,
                        images: tf.Tensor) -> tf.Tensor:
    """This replica's shard of the inference logits (model parallel: of the whole global
    batch, every replica's rows; [rows, padded classes / K]), or all of its own rows'."""
    shard = coll.replica_id() if model_parallel else 0
    activations, _ = trunk_forward(images)
    activations = tf.cast(activations, head.compute_dtype)
    rows = coll.all_gather(activations, 0, ledger.ACTIVATIONS) if model_parallel else activations
    return forward(head, rows, shard, False, None)


def replica_logits(model_parallel: bool, head: ShardedHead, trunk_forward: TrunkForward,
                   images: tf.Tensor) -> tf.Tensor:
    """Inference logits of the rows this replica reports: the whole global batch (model
    parallel: every replica sees every row) or its own rows (data parallel)."""
    return whole_logits(head, replica_logit_shard(model_parallel, head, trunk_forward, images))


def whole_logits(head: ShardedHead, logit_shard: tf.Tensor) -> tf.Tensor:
    """Every shard's logits of these rows, all-gathered: [rows, classes], float32."""
    logits = coll.all_gather(logit_shard, 1, ledger.LOGITS) if head.num_shards > 1 else logit_shard
    return tf.cast(logits[:, : head.spec.num_classes], tf.float32)


def replica_eval_terms(head: ShardedHead, logit_shard: tf.Tensor, labels: tf.Tensor,
                       valid: tf.Tensor) -> Tuple[tf.Tensor, object]:
    """The evaluation loss of rows every replica holds (the gathered batch): each row's
    loss as the head computes it (gathered or on the shards), zero where `valid` (bool
    [rows]) is False (padding rows of the last batch), and the outputs the metrics read
    (whole rows, or each shard's top candidates). The CLI's evaluation and Keras'
    `evaluate` both call this: one evaluation loss."""
    safe = tf.where(valid, labels, tf.zeros_like(labels)) if labels.shape.rank == 1 else labels
    per_example, _, out = loss_terms(head, logit_shard, safe, coll.replica_id())
    per_example = tf.cast(per_example, tf.float32)
    return tf.where(valid, per_example, 0.0), out
