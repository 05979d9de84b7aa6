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

import contextlib
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


Backward = Callable[[List[tf.Tensor]], tf.Tensor]


def exchange_rounds(plan: SchemePlan, a_local: tf.Tensor, y_local: tf.Tensor,
                    num_classes: int) -> Tuple[List[tf.Tensor], List[tf.Tensor], Backward]:
    """Every round's FC input and labels, and the function that turns the rounds' input
    gradients into d loss / d a_local.

    Every round's exchange is issued before any round's FC work, and every backward
    exchange after the last round. The strategy runs a device's collectives in program
    order (one ordering token per device), so this order lets round r's FC compute overlap
    the transfer of rounds r+1... (the paper's point about scheme (b)); issuing exchange
    r+1 after round r would serialize them. The labels ride in the same collectives
    (coll.pack_riders) where that is exact, else they are gathered on their own first.
    """
    if not plan.model_parallel:
        return [a_local], [y_local], lambda grads: grads[0]
    with tf.GradientTape() as tape:
        tape.watch(a_local)
        packed = coll.pack_riders(a_local, y_local, num_classes) if coll.num_replicas() > 1 else None
        if packed is None:
            labels = coll.gather_labels(y_local)
        riders = 0 if packed is None else coll.rider_columns(y_local)
        # One op for all rounds: one backward collective (a reduce-scatter), no order among
        # several to get wrong.
        sent = a_local if packed is None else packed
        if plan.scheme == "owt-b":
            received = coll.broadcast_rounds(sent, coll.ACTIVATIONS, riders)
        else:
            received = coll.gather_rounds(sent, plan.num_rounds, coll.ACTIVATIONS, riders)
        if packed is None:
            inputs = received
            round_labels = [labels if plan.num_rounds == 1 else tf.gather(labels, plan.round_rows(r))
                            for r in range(plan.num_rounds)]
        else:
            inputs, round_labels = map(list, zip(*(coll.unpack_riders(p, y_local) for p in received)))
    return inputs, round_labels, lambda grads: tape.gradient(inputs, a_local, output_gradients=grads)


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


@dataclasses.dataclass
class _Round:
    """One round's FC forward pass, kept for its backward."""

    tape: tf.GradientTape
    inputs: tf.Tensor  # the round's FC input rows (watched)
    loss: tf.Tensor  # this replica's copy of the round's loss, weighted
    ce: tf.Tensor
    right: tf.Tensor
    outputs: Optional[tf.Tensor]
    labels: tf.Tensor
    cuts: List[coll.Cut]  # collectives whose backward is deferred (empty: none deferred)


def _forward_round(plan: SchemePlan, head: ShardedHead, r: int, inputs: tf.Tensor, labels: tf.Tensor,
                   shard: int, training: bool, seed: Optional[tf.Tensor], defer: bool) -> _Round:
    round_seed = None if seed is None else tf.random.experimental.stateless_fold_in(seed, r)
    # Model parallel: each of the K replicas holds a copy of the same loss, and the
    # exchange's gradient sums the copies. Data parallel: own rows / (B*K), and the
    # gradient all-reduce sums the K parts. Either way each replica weighs its loss by 1/K.
    loss_weight = 1.0 / plan.num_replicas
    with tf.GradientTape(persistent=defer) as tape, tf.name_scope(f"fc_round{r}"):
        tape.watch(inputs)
        with coll.deferred_backward(tape) if defer else contextlib.nullcontext([]) as cuts:
            logits = head.forward(inputs, shard, training, round_seed)
            ce, right, outputs = head.loss_terms(logits, labels, shard)
        loss = tf.reduce_mean(ce) * loss_weight
    return _Round(tape, inputs, loss, ce, right, outputs, labels, cuts)


def _round_grads(rnd: _Round, sources: List[tf.Tensor],
                 cut_grads: List[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
    """d loss / d sources, the deferred cuts' gradients fed in at their `local` end."""
    targets, upstream = [rnd.loss], [tf.ones_like(rnd.loss)]
    for cut, g in zip(rnd.cuts, cut_grads):
        if g is not None:
            targets.append(cut.local)
            upstream.append(g)
    return rnd.tape.gradient(targets, sources, output_gradients=upstream)


def _deferred_backward(rounds: List[_Round], shard_vars: List[tf.Variable]) -> List[List[tf.Tensor]]:
    """Per round: [d loss / d inputs] + the shard's variable gradients, with each deferred
    collective's backward issued once for all rounds, last cut first (the same order on
    every replica: the rounds have the same cuts)."""
    cut_grads: List[List[Optional[tf.Tensor]]] = [[None] * len(rnd.cuts) for rnd in rounds]
    with tf.name_scope("fc_backward"):
        for j in reversed(range(len(rounds[0].cuts))):
            received = [_round_grads(rnd, [rnd.cuts[j].received], cut_grads[i])[0]
                        for i, rnd in enumerate(rounds)]
            if received[0] is None:  # the loss does not depend on it: no backward collective
                continue
            sent = coll.backward_of_cuts([rnd.cuts[j] for rnd in rounds], received)
            for i, g in enumerate(sent):
                cut_grads[i][j] = g
    return [_round_grads(rnd, [rnd.inputs] + shard_vars, cut_grads[i]) for i, rnd in enumerate(rounds)]


def run_fc_rounds(plan: SchemePlan, head: ShardedHead, a_local: tf.Tensor, y_local: tf.Tensor,
                  shard: int, training: bool, seed: Optional[tf.Tensor],
                  apply_fc_update: FcUpdate) -> RoundsResult:
    """Runs the FC layers over the step's rounds; returns the activation gradient.

    `apply_fc_update(grads)` is called with this shard's FC gradients once per FC update:
    after every round when fc_batch='worker', else once with the average over rounds.
    With one update per step, every round's forward pass runs first and each collective
    between FC layers sends its gradient once for all rounds (_deferred_backward): K times
    fewer backward launches. With fc_batch='worker', round r+1 needs round r's update.
    """
    inputs, labels, exchange_backward = exchange_rounds(plan, a_local, y_local, head.spec.num_classes)
    shard_vars = head.shard_variables(shard)
    defer = not plan.updates_fc_every_round
    rounds: List[_Round] = []
    applied: List[List[tf.Tensor]] = []
    round_grads: List[List[tf.Tensor]] = []
    for r in range(plan.num_rounds):
        rounds.append(_forward_round(plan, head, r, inputs[r], labels[r], shard, training, seed, defer))
        if not defer:
            grads = rounds[-1].tape.gradient(rounds[-1].loss, [inputs[r]] + shard_vars)
            apply_fc_update(grads[1:])
            applied.append(grads[1:])
            round_grads.append(grads)
    if defer:
        round_grads = _deferred_backward(rounds, shard_vars)
        summed_fc = round_grads[0][1:]
        for grads in round_grads[1:]:
            summed_fc = [s + g for s, g in zip(summed_fc, grads[1:])]
        averaged = [g / plan.num_rounds for g in summed_fc]
        apply_fc_update(averaged)
        applied.append(averaged)
    input_grads = [grads[0] / plan.num_rounds for grads in round_grads]
    loss_sum, correct = tf.constant(0.0), tf.constant(0)
    for rnd in rounds:
        loss_sum += tf.reduce_sum(rnd.ce)
        correct += tf.reduce_sum(tf.cast(rnd.right, tf.int32))
    count = sum(int(rnd.ce.shape[0]) for rnd in rounds)
    return RoundsResult(exchange_backward(input_grads), applied, loss_sum, correct, count,
                        [rnd.outputs for rnd in rounds], [rnd.labels for rnd in rounds])
