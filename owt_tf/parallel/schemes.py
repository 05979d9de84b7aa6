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
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from owt_tf.parallel import collectives as coll
from owt_tf.parallel.precision import finite_flags, unscaled

from owt_tf.planner import ledger
from owt_tf.parallel.head.layout import SampledRows
from owt_tf.parallel.head.sampling import SampledColumns
from owt_tf.planner.plan import StepRounds
from owt_tf.parallel.head.forward import forward_rounds
from owt_tf.parallel.head.layout import ShardedHead
from owt_tf.parallel.head.loss import loss_terms, sample_columns
from owt_tf.parallel.head.rounds import joined_rows

Backward = Callable[[List[tf.Tensor]], tf.Tensor]


def exchange_rounds(rounds: StepRounds, a_local: tf.Tensor, y_local: tf.Tensor,
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
    if not rounds.model_parallel:
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
        if rounds.scheme.round_from_one_worker:
            received = coll.broadcast_rounds(sent, ledger.ACTIVATIONS, riders)
        else:
            received = coll.gather_rounds(sent, rounds.num_rounds, ledger.ACTIVATIONS, riders)
        if packed is None:
            inputs = received
            round_labels = [labels if rounds.num_rounds == 1 else tf.gather(labels, rounds.round_rows(r))
                            for r in range(rounds.num_rounds)]
        else:
            inputs, round_labels = map(list, zip(*(coll.unpack_riders(p, y_local) for p in received)))
    return inputs, round_labels, lambda grads: tape.gradient(inputs, a_local, output_gradients=grads)


def round_weights(rounds: StepRounds, weights_local: tf.Tensor) -> List[tf.Tensor]:
    """Every round's row weights from this replica's own ([B]): all replicas' weights
    gathered, then each round's rows picked as its labels are (tiny next to the
    activations, so a collective of their own)."""
    weights = coll.gather_labels(weights_local) if rounds.model_parallel else weights_local
    if rounds.num_rounds == 1:
        return [weights]
    return [tf.gather(weights, rounds.round_rows(r)) for r in range(rounds.num_rounds)]


@dataclasses.dataclass
class RoundsResult:
    """What the FC rounds of one step leave for the trunk and the metrics."""

    activation_grad: tf.Tensor  # d (loss x loss_scale) / d a_local, for the trunk's backward
    fc_grads: List[List[tf.Tensor]]  # per applied FC update: grads of this shard's variables
    loss_sum: tf.Tensor  # sum of per-example losses over the rows this replica reports
    correct: tf.Tensor  # number of those rows classified right
    count: int  # number of those rows
    outputs: List[tf.Tensor]  # per round: the model's outputs for its rows (Keras metrics)
    labels: List[tf.Tensor]  # per round: the labels of those rows
    # per applied FC update: its class sample (fc_grads' class layer: of its rows), or None
    fc_samples: List[Optional[SampledColumns]] = dataclasses.field(default_factory=list)
    # per applied FC update: bool [its gradients]: is each finite (finite_flags)
    fc_finite: List[tf.Tensor] = dataclasses.field(default_factory=list)


# Applies one FC update of this shard: its gradients (head.shard_variables order; under a
# class sample the class layer's are of its sampled rows, [S, in] and [S]) and the sample.
FcUpdate = Callable[[List[tf.Tensor], Optional[SampledColumns]], None]


@dataclasses.dataclass
class _Forward:
    """The FC forward pass of one FC update (one or more rounds' rows), kept for its
    backward."""

    tape: tf.GradientTape
    inputs: List[tf.Tensor]  # per round: its FC input rows (watched)
    loss: tf.Tensor  # this replica's copy of the update's loss, weighted
    ce: tf.Tensor  # per row of every round, in order: its loss (times its weight, if any)
    right: tf.Tensor  # per row: classified right
    outputs: object  # the model's outputs for the rows (Keras metrics)
    labels: tf.Tensor  # the rows' labels
    cuts: List[coll.Cut]  # collectives whose backward is deferred (empty: none deferred)
    sampled: Optional[SampledRows]  # the update's class sample and its rows (Partial FC)

    def sources(self, shard_vars: List[tf.Variable]) -> List:
        """What the FC update differentiates: the shard's variables, the class layer's
        replaced by its sampled rows under a sample (a gradient of [S, in], not the shard's
        whole width: the update's cost follows the sample)."""
        if self.sampled is None:
            return list(shard_vars)
        return list(shard_vars[:-2]) + [self.sampled.kernel, self.sampled.bias]

    @property
    def sample(self) -> Optional[SampledColumns]:
        return None if self.sampled is None else self.sampled.sample


def _forward(rounds: StepRounds, head: ShardedHead, round_ids: Optional[Sequence[int]],
             inputs: List[tf.Tensor], labels: List[tf.Tensor], shard: int, training: bool,
             seed: Optional[tf.Tensor], defer: bool, loss_scale: Optional[tf.Tensor],
             weights: Optional[Sequence[tf.Tensor]] = None) -> _Forward:
    """The FC forward pass of one FC update: rounds `round_ids`' rows (named by them, None:
    one round's), dropout masks and class sample drawn from `seed`. One loss of all rows:
    the mean of the rounds' means (they have as many rows each)."""
    # Model parallel: each of the K replicas holds a copy of the same loss, and the
    # exchange's gradient sums the copies. Data parallel: own rows / (B*K), and the
    # gradient all-reduce sums the K parts. Either way each replica weighs its loss by 1/K.
    loss_weight = 1.0 / rounds.num_replicas
    if loss_scale is not None:  # fp16: gradients scaled up out of float16's underflow
        loss_weight = loss_weight * loss_scale
    y = joined_rows(labels)
    with tf.GradientTape(persistent=defer) as tape:
        for x in inputs:
            tape.watch(x)
        with coll.deferred_backward(tape) if defer else contextlib.nullcontext([]) as cuts:
            sample = _class_sample(head, labels, shard, training, seed)
            sampled = None if sample is None else head.layers[-1].sampled_rows(shard, sample)
            logits = forward_rounds(head, inputs, shard, training, seed, round_ids, sampled)
            ce, right, outputs = loss_terms(head, logits, y, shard, sample)
        if weights is not None:  # Keras' weighted reduction: sum(loss x weight) / rows
            ce = ce * joined_rows(weights)
        loss = tf.reduce_mean(ce) * loss_weight
    return _Forward(tape, inputs, loss, ce, right, outputs, y, cuts, sampled)


def _class_sample(head: ShardedHead, labels: Sequence[tf.Tensor], shard: int, training: bool,
                  seed: Optional[tf.Tensor]) -> Optional[SampledColumns]:
    """This FC update's class sample (Partial FC), drawn from the labels of all its rounds
    before the forward pass: an update of several rounds (fc_batch='global') samples once
    for all of them, and each round of fc_batch='worker' (an update of its own) samples
    anew. None: no sampling."""
    if not training or head.sample_rate >= 1.0:
        return None
    if seed is None:
        raise ValueError("sample_rate < 1 needs the step's seed (train_step(seed=...))")
    return sample_columns(head, labels, shard, seed)


def _gradients(fwd: _Forward, sources: List[tf.Tensor],
               cut_grads: List[Optional[tf.Tensor]],
               unconnected=tf.UnconnectedGradients.NONE) -> List[Optional[tf.Tensor]]:
    """d loss / d sources, the deferred cuts' gradients fed in at their `local` end; a
    source the loss does not read gets None (or zeros: `unconnected`)."""
    targets, upstream = [fwd.loss], [tf.ones_like(fwd.loss)]
    for cut, g in zip(fwd.cuts, cut_grads):
        if g is not None:
            targets.append(cut.local)
            upstream.append(g)
    return fwd.tape.gradient(targets, sources, output_gradients=upstream,
                             unconnected_gradients=unconnected)


def _deferred_backward(fwd: _Forward, sources: List) -> List[tf.Tensor]:
    """[d loss / d inputs of each round] + the shard's variable gradients, each deferred
    collective's backward issued once, last cut first: the same order on every replica."""
    cut_grads: List[Optional[tf.Tensor]] = [None] * len(fwd.cuts)
    with tf.name_scope("fc_backward"):
        for j in reversed(range(len(fwd.cuts))):
            (grad,) = _gradients(fwd, [fwd.cuts[j].received], cut_grads)
            if grad is not None:  # else the loss does not depend on it: nothing to send
                cut_grads[j] = coll.backward_of_cut(fwd.cuts[j], grad)
    # A cosine class layer never reads its (zero) bias: its gradient is zero, not None.
    return _gradients(fwd, fwd.inputs + sources, cut_grads, tf.UnconnectedGradients.ZERO)


def _round_function(rounds: StepRounds, head: ShardedHead, shard: int, training: bool,
                    loss_scale: Optional[tf.Tensor], apply_fc_update: FcUpdate):
    """One round of fc_batch='worker' (forward, loss, backward, this shard's FC update) as
    a function this replica traces once and calls once per round: its step graph then holds
    one round's FC work, not K rounds' (the first step's trace and graph optimisation grew
    with K x rounds: 7 s at K=4, 22 s at K=8). A function per replica (each captures its
    own shard's variables). Returns the round's _RoundOut.

    Kept a call (`_noinline`): inlined, grappler optimises the K x K round bodies of a step
    as one graph (20 s of the first step at K=16). Every call site passes tensors only
    (the round's seed, not its number): a call with a constant argument is specialised per
    call site, K x K function bodies optimised again one by one (6 s at K=16). What every
    round reports is reduced here, inside, for the same reason."""
    shard_vars = head.shard_variables(shard)

    @tf.function(autograph=False, experimental_attributes={"_noinline": True})
    def one_round(x, y, round_seed, w):
        fwd = _forward(rounds, head, None, [x], [y], shard, training, round_seed, False,
                       loss_scale, None if w is None else [w])
        grads = fwd.tape.gradient(fwd.loss, [x] + fwd.sources(shard_vars),
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        update = unscaled(grads[1:], loss_scale)
        apply_fc_update(update, fwd.sample)
        rows = () if fwd.sample is None else (fwd.sample.ids, fwd.sample.valid)
        return _RoundOut(grads[0] / rounds.num_rounds, update, finite_flags(update),
                         tf.reduce_sum(fwd.ce), _count_true(fwd.right), fwd.outputs, rows)

    return one_round


class _RoundOut(NamedTuple):
    """What a round function returns (a namedtuple: tf.function returns no dataclass)."""

    input_grad: tf.Tensor  # d loss / d the round's rows, over the number of rounds
    update: List[tf.Tensor]  # the FC gradients it applied
    finite: tf.Tensor  # bool [len(update)]: is each of them finite
    loss_sum: tf.Tensor
    correct: tf.Tensor
    outputs: object
    rows: tuple  # the class sample's (ids, valid), or ()


def _count_true(flags: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.cast(flags, tf.int32))


def _round_seeds(seed: Optional[tf.Tensor], num_rounds: int) -> List[Optional[tf.Tensor]]:
    return [None if seed is None else tf.random.experimental.stateless_fold_in(seed, r)
            for r in range(num_rounds)]


def run_fc_rounds(rounds: StepRounds, head: ShardedHead, a_local: tf.Tensor, y_local: tf.Tensor,
                  shard: int, training: bool, seed: Optional[tf.Tensor],
                  apply_fc_update: FcUpdate,
                  loss_scale: Optional[tf.Tensor] = None,
                  weights: Optional[List[tf.Tensor]] = None) -> RoundsResult:
    """Runs the FC layers over the step's rounds; returns the activation gradient.

    With a `loss_scale` (fp16) every gradient is taken of the loss times it: the activation
    gradient comes back scaled (the trunk's are unscaled after its backward), the FC
    gradients are unscaled before they are applied.

    `apply_fc_update(grads)` is called with this shard's FC gradients once per FC update:
    after every round when fc_batch='worker', else once with the average over rounds.
    With one update per step each round's first FC product runs on its own rows as they
    arrive, then all rounds' rows go through the rest together (forward_rounds), one
    collective per layer forward and backward (_deferred_backward): K times fewer launches
    and ops than round after round, the same bytes. With fc_batch='worker', round r+1
    needs round r's update, so the rounds run one after the other.

    `weights`: per round, a weight for each of its rows (round_weights); each per-example
    loss is multiplied by its row's weight before the mean (and in `loss_sum`).
    """
    inputs, labels, exchange_backward = exchange_rounds(rounds, a_local, y_local, head.spec.num_classes)
    shard_vars = head.shard_variables(shard)
    if rounds.updates_fc_every_round:
        # round r+1 runs on the FC weights round r updated
        one_round = _round_function(rounds, head, shard, training, loss_scale, apply_fc_update)
        outs = []
        for r, round_seed in enumerate(_round_seeds(seed, rounds.num_rounds)):
            # The first call traces the round: what it sends, it sends once per round.
            with tf.name_scope(f"fc_round{r}"), (
                    ledger.repeated(rounds.num_rounds) if r == 0 else contextlib.nullcontext()):
                outs.append(one_round(inputs[r], labels[r], round_seed,
                                      None if weights is None else weights[r]))
        input_grads = [o.input_grad for o in outs]
        applied, finite = [o.update for o in outs], [o.finite for o in outs]
        samples = [SampledColumns(*o.rows, head.shard_width()) if o.rows else None for o in outs]
        loss_sum, correct = tf.add_n([o.loss_sum for o in outs]), tf.add_n([o.correct for o in outs])
        outputs = [o.outputs for o in outs]
        count = int(inputs[0].shape[0]) * rounds.num_rounds
    else:
        # one update of every round's rows, seeded as round 0 (the loss: their mean)
        fwd = _forward(rounds, head, range(rounds.num_rounds), inputs, labels, shard, training,
                       _round_seeds(seed, 1)[0], True, loss_scale, weights)
        grads = _deferred_backward(fwd, fwd.sources(shard_vars))
        input_grads = grads[:rounds.num_rounds]
        averaged = unscaled(grads[rounds.num_rounds:], loss_scale)
        apply_fc_update(averaged, fwd.sample)
        applied, samples, finite = [averaged], [fwd.sample], [finite_flags(averaged)]
        loss_sum, correct = tf.reduce_sum(fwd.ce), _count_true(fwd.right)
        outputs, labels, count = [fwd.outputs], [fwd.labels], int(fwd.ce.shape[0])
    return RoundsResult(exchange_backward(input_grads), applied, loss_sum, correct, count,
                        outputs, labels, samples, finite)
