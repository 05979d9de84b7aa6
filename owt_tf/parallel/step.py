"""What one replica does in a step: trunk forward, the FC rounds, trunk backward, updates.

Both drivers call these functions inside `strategy.run`: the CLI's custom loop (through
Engine.train_step) and Keras' `Model.fit` (through ParallelModel.train_step). They
differ only in what they pass in: how the trunk runs (with or without XLA), which
optimizers apply the updates, and which loss the head computes.

    activations = trunk(images)                        data-parallel, this replica's rows
    rounds      = run_fc_rounds(...)                   the scheme's exchanges + FC shards
    trunk grads = d activations^T . activation_grad    back through the trunk
    apply_trunk(trunk grads)                           all-reduced by the trunk's optimizer
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from owt_tf.parallel import collectives as coll
from owt_tf.planner.plan import StepRounds
from owt_tf.parallel.schemes import RoundsResult, run_fc_rounds, unscaled
from owt_tf.parallel.head.shards import ShardedHead

# images -> (last conv activations, extra trunk loss or None). The extra loss (a Keras
# trunk's regularization losses) is added to the trunk's objective once per model.
TrunkForward = Callable[[tf.Tensor], Tuple[tf.Tensor, Optional[tf.Tensor]]]
ApplyTrunk = Callable[[List[tf.Tensor]], None]
ApplyFc = Callable[[int, List[tf.Tensor]], None]


@dataclasses.dataclass
class ReplicaStep:
    """One replica's results of a training step."""

    rounds: RoundsResult
    trunk_grads: List[tf.Tensor]
    trunk_loss: Optional[tf.Tensor]  # the trunk's extra loss (regularization), if any


def shard_index(plan: StepRounds) -> int:
    """Which FC shard this replica holds: its replica id (model parallel) or the one copy."""
    return coll.replica_id() if plan.model_parallel else 0


def replica_train_step(plan: StepRounds, head: ShardedHead, trunk_forward: TrunkForward,
                       trunk_variables: Sequence[tf.Variable], images: tf.Tensor,
                       labels: tf.Tensor, seed: Optional[tf.Tensor], apply_trunk: ApplyTrunk,
                       apply_fc: ApplyFc, loss_scale: Optional[tf.Tensor] = None,
                       row_weights: Optional[List[tf.Tensor]] = None) -> ReplicaStep:
    """One optimizer step of this replica (call inside strategy.run). With a `loss_scale`
    (fp16), gradients are taken of the loss times it and unscaled before they are applied.
    `row_weights` (per round, schemes.round_weights): each example's loss is multiplied by
    its row's weight."""
    shard = shard_index(plan)
    with tf.GradientTape() as trunk_tape:
        activations, trunk_loss = trunk_forward(images)
        activations = tf.cast(activations, head.compute_dtype)  # what the exchange sends
    rounds = run_fc_rounds(plan, head, activations, labels, shard, True, seed,
                           lambda grads: apply_fc(shard, grads), loss_scale, row_weights)
    targets, output_grads = [activations], [rounds.activation_grad]
    if trunk_loss is not None:
        # Every replica adds its copy and the trunk optimizer sums the K gradients: each
        # contributes 1/K. The 1/K goes into the output gradient: a target computed after the
        # tape closed (trunk_loss / K) is not on the tape, and its gradient would be silently
        # zero -- the regularization dropped from every update.
        scale = 1.0 if loss_scale is None else tf.cast(loss_scale, trunk_loss.dtype)
        targets.append(trunk_loss)
        output_grads.append(tf.ones_like(trunk_loss) * scale / plan.num_replicas)
    grads = trunk_tape.gradient(targets, list(trunk_variables), output_gradients=output_grads)
    grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, trunk_variables)]
    grads = unscaled(grads, loss_scale)
    apply_trunk(grads)
    return ReplicaStep(rounds, grads, trunk_loss)


def replica_logit_shard(model_parallel: bool, head: ShardedHead, trunk_forward: TrunkForward,
                        images: tf.Tensor) -> tf.Tensor:
    """This replica's shard of the inference logits (model parallel: of the whole global
    batch, every replica's rows; [rows, padded classes / K]), or all of its own rows'."""
    shard = coll.replica_id() if model_parallel else 0
    activations, _ = trunk_forward(images)
    activations = tf.cast(activations, head.compute_dtype)
    rows = coll.all_gather(activations, 0, coll.ACTIVATIONS) if model_parallel else activations
    return head.forward(rows, shard, False, None)


def replica_logits(model_parallel: bool, head: ShardedHead, trunk_forward: TrunkForward,
                   images: tf.Tensor) -> tf.Tensor:
    """Inference logits of the rows this replica reports: the whole global batch (model
    parallel: every replica sees every row) or its own rows (data parallel)."""
    return whole_logits(head, replica_logit_shard(model_parallel, head, trunk_forward, images))


def whole_logits(head: ShardedHead, logit_shard: tf.Tensor) -> tf.Tensor:
    """Every shard's logits of these rows, all-gathered: [rows, classes], float32."""
    logits = coll.all_gather(logit_shard, 1, coll.LOGITS) if head.num_shards > 1 else logit_shard
    return tf.cast(logits[:, : head.spec.num_classes], tf.float32)
