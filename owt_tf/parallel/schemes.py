"""How the last conv activations reach the FC shards each step: single, data, owt-a/b/c.

This is where the paper's scheme (b) round loop lives (`run_fc_rounds`). A scheme is a list
of rounds; each round is a set of rows of the global batch that every FC shard processes
together (forward and backward) after one exchange:

    single, owt-a   1 round: all B*K rows, all-gathered (docs/paper.md scheme (a))
    owt-b           K rounds: round r is worker r's B rows, sent to all (scheme (b))
    owt-c           K rounds: round r is rows r*B/K ... of every worker (scheme (c))
    data            1 round of the worker's own B rows, no exchange; FC layers mirrored

Every replica computes the round's loss on the same rows; the exchange's gradient sums
over replicas, so each replica's copy of the loss is divided by K (else every gradient is
K times too large, docs/design.md). With fc_batch='worker' the FC shards are updated after
every round (K FC updates per conv update, the paper's (128K, 128) rows).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.parallel import collectives as coll
from owt_tf.parallel.shards import ShardedHead

@dataclasses.dataclass(frozen=True)
class SchemePlan:
    """The rounds of one step for `scheme` at K replicas of `batch_size` rows each."""

    scheme: str
    num_replicas: int
    batch_size: int
    fc_batch: str = "global"

    @property
    def model_parallel(self) -> bool:
        return self.scheme != "data"

    @property
    def num_rounds(self) -> int:
        return self.num_replicas if self.scheme in ("owt-b", "owt-c") else 1

    @property
    def updates_fc_every_round(self) -> bool:
        return self.fc_batch == "worker"

    def round_rows(self, r: int) -> np.ndarray:
        """Global-batch row indices that round r processes (replica k owns rows kB..kB+B-1)."""
        k, b = self.num_replicas, self.batch_size
        if self.scheme == "owt-b":
            return np.arange(r * b, (r + 1) * b)
        if self.scheme == "owt-c":
            s = b // k
            return np.concatenate([np.arange(j * b + r * s, j * b + (r + 1) * s) for j in range(k)])
        return np.arange(k * b)

    def exchange(self, r: int, a_local: tf.Tensor) -> tf.Tensor:
        """Round r's rows of the last conv activations, the same on every replica (owt-a,
        owt-c, single; owt-b's rounds come from coll.broadcast_rounds, all at once)."""
        if self.scheme == "owt-c":
            s = self.batch_size // self.num_replicas
            return coll.all_gather(a_local[r * s:(r + 1) * s], 0, coll.ACTIVATIONS)
        return coll.all_gather(a_local, 0, coll.ACTIVATIONS)


Backward = Callable[[List[tf.Tensor]], tf.Tensor]


def exchange_rounds(plan: SchemePlan, a_local: tf.Tensor) -> Tuple[List[tf.Tensor], Backward]:
    """Every round's FC input, and the function that turns the rounds' input gradients into
    d loss / d a_local.

    Every round's exchange is issued before any round's FC work, and every backward
    exchange after the last round. The strategy runs a device's collectives in program
    order (one ordering token per device), so this order lets round r's FC compute overlap
    the transfer of rounds r+1... (the paper's point about scheme (b)); issuing exchange
    r+1 after round r would serialize them.
    """
    if not plan.model_parallel:
        return [a_local], lambda grads: grads[0]
    if plan.scheme == "owt-b":
        # One op for all K broadcasts: one backward collective (a reduce-scatter), no order
        # among several to get wrong.
        with tf.GradientTape() as tape:
            tape.watch(a_local)
            inputs = coll.broadcast_rounds(a_local, coll.ACTIVATIONS)
        return inputs, lambda grads: tape.gradient(inputs, a_local, output_gradients=grads)
    # One tape per exchange, differentiated in round order. With one tape over all of them
    # the tape would pick among equally ready backward collectives in an order that differs
    # between replicas (tensor ids interleave across replica threads), pairing round r's
    # gradient with round r' on another replica: wrong numbers, no error.
    tapes, inputs = [], []
    for r in range(plan.num_rounds):
        with tf.GradientTape() as tape, tf.name_scope(f"exchange_round{r}"):
            tape.watch(a_local)
            inputs.append(plan.exchange(r, a_local))
        tapes.append(tape)

    def backward(grads: List[tf.Tensor]) -> tf.Tensor:
        return tf.add_n([tape.gradient(x, a_local, output_gradients=g)
                         for tape, x, g in zip(tapes, inputs, grads)])

    return inputs, backward


@dataclasses.dataclass
class RoundsResult:
    """What the FC rounds of one step leave for the trunk and the metrics."""

    activation_grad: tf.Tensor  # d loss / d a_local, for the trunk's backward
    fc_grads: List[List[tf.Tensor]]  # per applied FC update: grads of this shard's variables
    loss_sum: tf.Tensor  # sum of per-example losses over the rows this replica reports
    correct: tf.Tensor  # number of those rows classified right
    count: int  # number of those rows
    outputs: List[tf.Tensor]  # per round: the model's outputs for its rows (Keras metrics)
    labels: List[tf.Tensor]  # per round: the labels of those rows


FcUpdate = Callable[[List[tf.Tensor]], None]


def run_fc_rounds(plan: SchemePlan, head: ShardedHead, a_local: tf.Tensor, y_local: tf.Tensor,
                  shard: int, training: bool, seed: Optional[tf.Tensor],
                  apply_fc_update: FcUpdate) -> RoundsResult:
    """Runs the FC layers over the step's rounds; returns the activation gradient.

    `apply_fc_update(grads)` is called with this shard's FC gradients once per FC update:
    after every round when fc_batch='worker', else once with the average over rounds.
    """
    labels = coll.gather_labels(y_local) if plan.model_parallel else y_local
    # Model parallel: each of the K replicas holds a copy of the same loss, and the
    # exchange's gradient sums the copies. Data parallel: own rows / (B*K), and the
    # gradient all-reduce sums the K parts. Either way each replica weighs its loss by 1/K.
    loss_weight = 1.0 / plan.num_replicas
    rounds = range(plan.num_rounds)
    inputs, exchange_backward = exchange_rounds(plan, a_local)
    shard_vars = head.shard_variables(shard)
    input_grads: List[tf.Tensor] = []
    summed_fc: Optional[List[tf.Tensor]] = None
    applied: List[List[tf.Tensor]] = []
    loss_sum, correct, count = tf.constant(0.0), tf.constant(0), 0
    round_outputs: List[tf.Tensor] = []
    round_labels_seen: List[tf.Tensor] = []
    for r in rounds:
        round_seed = None if seed is None else tf.random.experimental.stateless_fold_in(seed, r)
        round_labels = labels if plan.num_rounds == 1 else tf.gather(labels, plan.round_rows(r))
        with tf.GradientTape() as tape, tf.name_scope(f"fc_round{r}"):
            tape.watch(inputs[r])
            logits = head.forward(inputs[r], shard, training, round_seed)
            ce, right, outputs = head.loss_terms(logits, round_labels, shard)
            loss = tf.reduce_mean(ce) * loss_weight
        grads = tape.gradient(loss, [inputs[r]] + shard_vars)
        input_grads.append(grads[0] / plan.num_rounds)
        fc_grads = grads[1:]
        if plan.updates_fc_every_round:
            apply_fc_update(fc_grads)
            applied.append(fc_grads)
        else:
            summed_fc = fc_grads if summed_fc is None else [s + g for s, g in zip(summed_fc, fc_grads)]
        loss_sum += tf.reduce_sum(ce)
        correct += tf.reduce_sum(tf.cast(right, tf.int32))
        count += int(ce.shape[0])
        round_outputs.append(outputs)
        round_labels_seen.append(round_labels)
    if not plan.updates_fc_every_round:
        averaged = [g / plan.num_rounds for g in summed_fc]
        apply_fc_update(averaged)
        applied.append(averaged)
    return RoundsResult(exchange_backward(input_grads), applied, loss_sum, correct, count, round_outputs,
                        round_labels_seen)
