"""The head's loss, whole: what it is (HeadLoss: where it is computed, which cross-entropy
or margin softmax, Partial FC's sample rate), which Keras losses map to it and why others
are refused, and its computation on an FC update's logits: gathered (the logits
all-gathered, the loss computed whole) or on the shards (the softmax normalizer and the
target logit summed across shards, never a [rows, classes] tensor; a margin on the shard
that holds the label); the Partial FC sample of an update, and the top candidates the
metrics and `predict(top_k=)` read.

The CLI maps --objective to a HeadLoss with `margin_head_loss`; Keras' compile with
`sharded_loss` (owt_tf.fit.metrics adds what its metrics need). `head` below is a
ShardedHead (owt_tf.parallel.head.layout, which holds its HeadLoss and so imports this
module).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from owt_tf.losses import MarginSoftmax
from owt_tf.parallel import collectives as coll
from owt_tf.parallel.head import sampling
from owt_tf.parallel.head.candidates import (LOWEST, MAX_CLASSES, TopCandidates, best_of,
                                             shard_top_candidates, unpack_gathered)
from owt_tf.parallel.head.exchange import exchange, gather
from owt_tf.planner import ledger
from owt_tf.planner.plan import LOSS_MODES, sampling_problem


@dataclasses.dataclass(frozen=True)
class ShardedLoss:
    """A cross-entropy the head computes on its shards: on class ids (`sparse`) or on rows
    of class weights (one-hot or soft labels), with Keras' label smoothing; or a margin
    softmax over a cosine class layer (`margin`: an object with `scale` and
    `logits(cosines, labels)`, such as owt_tf.losses.MarginSoftmax, applied on each shard to
    its own columns, the margin on the shard that holds the label)."""

    sparse: bool = True
    label_smoothing: float = 0.0
    margin: Optional[Any] = None


@dataclasses.dataclass(frozen=True)
class HeadLoss:
    """What the head's loss is and where it is computed.

    `mode` 'gathered' all-gathers the logits and computes the loss whole; 'sharded' never
    does: the softmax normalizer and the target logit are summed across shards. `sharded`:
    which cross-entropy the shards compute (None: sparse, the CLI's); `candidates_k`: how
    many top candidates per shard the metrics read (0: none); `per_example`: (labels,
    outputs) -> per-example loss for the gathered mode (None: cross-entropy on the logits);
    `sample_rate`: Partial FC, the share of each shard's classes a training update's softmax
    keeps (owt_tf.parallel.head.sampling; 1: every class, the exact loss)."""

    mode: str = "gathered"
    sharded: Optional[ShardedLoss] = None
    candidates_k: int = 0
    per_example: Optional[Callable[[tf.Tensor, tf.Tensor], tf.Tensor]] = None
    sample_rate: float = 1.0

    def __post_init__(self):
        if self.mode not in LOSS_MODES:
            raise ValueError(f"loss mode must be one of {', '.join(LOSS_MODES)}, got {self.mode!r}")
        object.__setattr__(self, "sample_rate", sampling.check_sample_rate(self.sample_rate))
        problem = sampling_problem(self.sample_rate, self.mode == "sharded")
        if problem:
            raise ValueError(f"sample_rate={self.sample_rate:g}: {problem}")


def margin_on_shards(margin: MarginSoftmax) -> ShardedLoss:
    """A margin softmax computed on a cosine class layer's shards: each shard scales its own
    cosines, the margin on the shard that holds the label."""
    return ShardedLoss(sparse=True, margin=margin)


def margin_head_loss(margin: MarginSoftmax, mode: str, sample_rate: float) -> HeadLoss:
    """The CLI's head loss under a margin objective (--objective arcface / cosface), computed
    `mode` ('sharded', or 'gathered': the same loss per example on the whole logits)."""
    return HeadLoss(mode, margin_on_shards(margin), per_example=margin.call,
                    sample_rate=sample_rate)


def _cross_entropy(loss) -> Tuple[Optional[bool], dict]:
    """(sparse?, config) of a Keras cross-entropy given as a string, function or object;
    (None, {}) for another loss."""
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            return None, {}
    if loss is keras.losses.sparse_categorical_crossentropy:
        return True, {}
    if loss is keras.losses.categorical_crossentropy:
        return False, {}
    if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return True, loss.get_config()
    if isinstance(loss, keras.losses.CategoricalCrossentropy):
        return False, loss.get_config()
    return None, {}


def sharded_loss(loss, output_activation: Optional[str], num_classes: int,
                 cosine: bool = False) -> Tuple[Optional[ShardedLoss], str]:
    """(the ShardedLoss that equals a compiled Keras `loss` on this head, "") or (None, why
    not: the loss is then computed whole, on gathered logits). Keras' sparse and categorical
    cross-entropies are exact on the shards when they read logits (`from_logits=True` on a
    linear head, or `from_logits=False` after a softmax output, whose logits Keras reads);
    a margin loss (owt_tf.losses.MarginSoftmax) needs a cosine class layer."""
    if num_classes < 2 or num_classes >= MAX_CLASSES:
        return None, f"a head of {num_classes} classes"
    if isinstance(loss, MarginSoftmax):
        if not cosine:
            return None, "a margin loss needs a cosine class layer"
        return margin_on_shards(loss), ""
    sparse, config = _cross_entropy(loss)
    if sparse is None:
        name = loss if isinstance(loss, str) else getattr(loss, "name", None) or getattr(
            loss, "__name__", type(loss).__name__)
        return None, f"loss {name!r} is not a categorical cross-entropy"
    from_logits = bool(config.get("from_logits", False))
    activation = output_activation or "linear"
    if from_logits != (activation == "linear") or activation not in ("linear", "softmax"):
        return None, (f"a cross-entropy with from_logits={from_logits} on a {activation} "
                      "output does not read the logits")
    if config.get("ignore_class") is not None:
        return None, "ignore_class is set"
    if config.get("axis", -1) != -1:
        return None, f"the loss's axis is {config['axis']}"
    return ShardedLoss(sparse, float(config.get("label_smoothing", 0.0))), ""


def outputs(head, logits: tf.Tensor) -> tf.Tensor:
    """What the model outputs for these (unpadded) logits: themselves, their softmax or
    their sigmoid. Keras' softmax and sigmoid keep the logits on their result, so Keras'
    cross-entropies on it are computed from the logits, as for the user's own model. Float32, whatever the
    compute dtype (Keras' mixed-precision rule for a model's outputs)."""
    logits = tf.cast(logits, tf.float32)
    if head.spec.output_activation == "softmax":
        return keras.activations.softmax(logits, axis=-1)
    if head.spec.output_activation == "sigmoid":
        return keras.activations.sigmoid(logits)
    return logits


def loss_terms(head, logits_shard: tf.Tensor, labels: tf.Tensor, k: int,
               sample: Optional[sampling.SampledColumns] = None
               ) -> Tuple[tf.Tensor, tf.Tensor, Optional[tf.Tensor]]:
    """Per-example loss, top-1 correctness and the model's outputs for rows whose labels
    are `labels`; under the sharded loss, instead of the outputs, the top
    `candidates_k` classes of every shard (TopCandidates), or None.

    The loss is `head.loss.per_example(labels, outputs)` when set (a Keras model's
    compiled loss), else sparse softmax cross-entropy on the logits. 'gathered'
    all-gathers the logits; 'sharded' never does: the softmax normalizer and the target
    logit are summed across shards, the max (which only stabilizes) is gathered without
    gradient, since ReduceOp has no MAX. `sample`: the update's sampled columns
    (sample_columns), which the logits were computed for: the softmax covers its classes.
    Without it, every class.
    """
    if head.loss.mode == "sharded" and (head.num_shards > 1 or sample is not None):
        return _sharded_cross_entropy(head, logits_shard, labels, k, sample)
    return _whole_loss_terms(head, gather(head, logits_shard, ledger.LOGITS), labels)


def _whole_loss_terms(head, logits: tf.Tensor, labels: tf.Tensor):
    logits = tf.cast(logits[:, : head.spec.num_classes], tf.float32)
    out = outputs(head, logits)
    if head.loss.per_example is not None:
        ce = head.loss.per_example(labels, out)
    else:
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    # Top-1 correctness (the CLI's error rate): class ids, or the argmax of one-hot rows.
    sparse = labels.shape.rank == 1
    target = (tf.cast(labels, tf.int64) if sparse
              else tf.argmax(labels, axis=-1, output_type=tf.int64))
    correct = tf.equal(tf.argmax(logits, axis=1, output_type=tf.int64), target)
    return ce, correct, out


def sample_columns(head, labels: Sequence[tf.Tensor], k: int,
                   update_seed: tf.Tensor) -> sampling.SampledColumns:
    """The columns of shard k an FC update with these rows' `labels` (every round of the
    update) keeps under Partial FC, seeded by `update_seed` (int32 [2])."""
    sparse = head.loss.sharded is None or head.loss.sharded.sparse
    return sampling.shard_sample(labels, k, head.shard_width(), head.spec.num_classes,
                                 head.sample_rate, sparse, update_seed)


def _top_gathered(head, logits_shard, k: int, top: int, sample=None):
    """Every shard's `top` best logits of the rows (ids too when candidates are wanted),
    all-gathered: (values [n, K*top], ids [n, K*top] or None). The best value is the max
    that stabilizes the softmax (ReduceOp has no MAX)."""
    first, _ = head.class_range(k)
    with_ids = head.loss.candidates_k > 0
    packed = sampling.top_candidates(logits_shard, sample, first, head.spec.num_classes, top)
    gathered = gather(head, packed if with_ids else packed[:, :top], ledger.LOGITS)
    if with_ids:
        return unpack_gathered(gathered, head.num_shards, top)
    return gathered, None


def _sharded_cross_entropy(head, logits, labels, k, sample=None):
    # float32 from here: sums of exponentials need its precision; what travels is
    # [n, 2 or 3], and [n, 2 * candidates] for the metrics, not [n, classes].
    # Under a sample the logits are its columns; its padding entries are out of the
    # softmax as padding classes are.
    logits = tf.cast(logits, tf.float32)
    width = head.shard_width()
    first, valid = head.class_range(k)
    if sample is not None:
        valid = sample.valid
    loss = head.loss.sharded or ShardedLoss()
    margin = loss.margin
    cosines = logits
    if margin is not None:
        # A cosine class layer's shards: s * cos (clamped as the margin loss clamps) is what
        # the candidates are ranked by and the softmax is shifted by; the margin goes on the
        # label's column, on the one shard that holds it (below).
        logits = margin.scale * tf.clip_by_value(cosines, -1.0, 1.0)
    top = min(max(head.loss.candidates_k, 1), logits.shape[1])
    tops = _top_gathered(head, logits, k, top, sample)
    global_max = tf.reduce_max(tops[0], axis=1)

    if loss.sparse:
        # Keras takes class ids as [n] or [n, 1], of any number type
        local_label = tf.reshape(tf.cast(labels, tf.int32), [-1]) - first
        mine = (local_label >= 0) & (local_label < width)
        column = sampling.label_positions(local_label, sample, width)
    if margin is not None:
        sums = margin_sums(margin, cosines, tf.where(mine, column, -1), valid, global_max)
    else:
        shifted = tf.where(valid[None, :], logits - global_max[:, None], -np.inf)
        sums = [tf.reduce_sum(tf.exp(shifted), axis=1)]
    if margin is None and loss.sparse:
        picked = tf.gather(logits, column, batch_dims=1)
        sums.append(tf.where(mine, picked, tf.zeros_like(picked)))
    elif not loss.sparse:
        present = tf.where(valid[None, :], logits, 0.0)
        columns = sampling.sampled_label_columns(_label_columns(head, labels, first, width), sample)
        sums.append(tf.reduce_sum(columns * present, 1))
        if loss.label_smoothing:
            sums.append(tf.reduce_sum(present, axis=1))

    # Normalizer and label terms in one all-reduce: separate ones would all be ready at
    # once in the backward pass, in an order that can differ between replicas.
    t = exchange(head, coll.all_reduce_sum, tf.stack(sums, axis=1), ledger.LOGITS)
    log_norm = tf.math.log(t[:, 0]) + global_max
    candidates = _candidates(head, tops, t, global_max)
    if loss.sparse:
        score = t[:, 2] if margin is not None else t[:, 1]
        return log_norm - t[:, 1], score >= global_max, candidates
    # -sum_c y_c log softmax_c = log_norm * sum(y) - sum(y * logits), y smoothed as
    # Keras smooths it: y (1 - s) + s / classes.
    y = tf.cast(labels, tf.float32)
    s = loss.label_smoothing
    label_sum = tf.reduce_sum(y, axis=1) * (1 - s) + s
    label_logits = t[:, 1] * (1 - s) + (t[:, 2] * s / head.spec.num_classes if s else 0.0)
    return log_norm * label_sum - label_logits, t[:, 1] >= global_max, candidates


def _label_columns(head, labels: tf.Tensor, first: int, width: int) -> tf.Tensor:
    """This shard's columns of [n, classes] labels (zero on padding columns)."""
    labels = tf.cast(labels, tf.float32)
    pad = head.num_shards * width - head.spec.num_classes
    return tf.pad(labels, [[0, 0], [0, pad]])[:, first:first + width]


def _candidates(head, top, terms, global_max) -> Optional[TopCandidates]:
    """The rows' candidates, scored as the model's outputs: a softmax's from the
    normalizer already summed for the loss."""
    values, ids = top
    if ids is None:
        return None
    return TopCandidates(_scores(head, values, global_max, terms[:, 0]), ids)


def _scores(head, values: tf.Tensor, global_max: tf.Tensor, sum_exp: tf.Tensor) -> tf.Tensor:
    """The model's outputs for logits `values` of rows whose max logit and sum of
    exp(logit - max) are given; padding (LOWEST) stays LOWEST."""
    if head.spec.output_activation == "softmax":
        scores = tf.exp(values - global_max[:, None]) / sum_exp[:, None]
    elif head.spec.output_activation == "sigmoid":
        scores = tf.sigmoid(values)
    else:
        return values
    return tf.where(values > LOWEST, scores, LOWEST)


def top_k_outputs(head, logits_shard: tf.Tensor, k: int, top_k: int) -> TopCandidates:
    """The `top_k` best classes of every row and the model's outputs for them, from shard
    k's logits of the rows (every replica's rows; inference): each shard's candidates
    gathered ([rows, 2 K top_k]), and a softmax's normalizer all-reduced ([rows])."""
    logits = tf.cast(logits_shard, tf.float32)
    top = min(top_k, logits.shape[1])
    first, valid = head.class_range(k)
    packed = shard_top_candidates(logits, first, head.spec.num_classes, top)
    values, ids = unpack_gathered(gather(head, packed, ledger.LOGITS), head.num_shards, top)
    global_max = tf.reduce_max(values, axis=1)
    sum_exp = None
    if head.spec.output_activation == "softmax":
        shifted = tf.where(valid[None, :], logits - global_max[:, None], -np.inf)
        sum_exp = exchange(head, coll.all_reduce_sum, tf.reduce_sum(tf.exp(shifted), 1),
                           ledger.LOGITS)
    best = best_of(TopCandidates(values, ids), top_k)
    return TopCandidates(_scores(head, best.scores, global_max, sum_exp), best.ids)


def margin_sums(margin, cosines: tf.Tensor, target_column: tf.Tensor, valid: tf.Tensor,
                shift: tf.Tensor) -> list:
    """A shard's terms of a margin softmax over its `cosines` [n, columns]: [sum_j exp(z_j -
    shift), z at the label, s * cos at the label (for top-1 correctness; no gradient)],
    z = margin.logits(cosines) (its margin at `target_column`, -1 where the row's label is
    another shard's: both label terms 0 there), columns not `valid` left out.

    Its own gradient: autodiff of the same holds the clamped cosines, the margin logits,
    their shifted exponentials and masks, each [n, columns], on every shard at once at the
    all-reduce that follows (a 1M-class head: 0.5 GB each). Here the forward pass keeps
    nothing of that size (one XLA reduction), and the backward makes one such tensor: each
    logit's derivative (s inside the clamp, 0 for a filtered class; at the label, the
    margin's own, by autodiff of margin.target_logit on [n]) times its weight in the
    softmax and the label term. `margin` is a MarginSoftmax (its `logits` rule)."""
    scale = float(margin.scale)
    threshold = float(getattr(margin, "interclass_filtering_threshold", 0.0))
    mine = target_column >= 0
    at_label = tf.gather(cosines, tf.maximum(target_column, 0), batch_dims=1)
    unmargined = tf.where(mine, scale * tf.clip_by_value(at_label, -1.0, 1.0), 0.0)

    @tf.custom_gradient
    def terms(cos):
        cos_y = tf.gather(cos, tf.maximum(target_column, 0), batch_dims=1)
        with tf.GradientTape() as tape:  # the label's logit and its slope: [n] only
            tape.watch(cos_y)
            target = tf.cast(margin.target_logit(cos_y), tf.float32)
        slope = tape.gradient(target, cos_y)
        exp_sum = _margin_exp_sum(margin, cos, target_column, shift, valid, threshold)

        def grad(d_exp_sum, d_label):
            d_exp_sum = tf.zeros_like(exp_sum) if d_exp_sum is None else d_exp_sum
            d_label = tf.zeros_like(exp_sum) if d_label is None else d_label
            return _margin_cosine_gradient(margin, cos, target_column, slope, shift, valid,
                                           d_exp_sum, d_label, scale, threshold)

        return (exp_sum, tf.where(mine, target, 0.0)), grad

    exp_sum, label = terms(cosines)
    return [exp_sum, label, tf.stop_gradient(unmargined)]


def _margin_logits(margin, cos, target_column, threshold: float):
    """(z, the label's column, where z's derivative in cos is s): z is margin.logits
    itself (the loss's one rule for its value); the derivative's masks are clip_by_value's
    (s inside [-1, 1]) and InsightFace's inter-class filter (0 for a filtered class)."""
    is_target = tf.range(tf.shape(cos)[1])[None, :] == target_column[:, None]
    passes = (cos >= -1.0) & (cos <= 1.0)
    if threshold > 0:
        passes = passes & ~((tf.clip_by_value(cos, -1.0, 1.0) > threshold) & ~is_target)
    return tf.cast(margin.logits(cos, target_column), tf.float32), is_target, passes


@tf.function(jit_compile=True, autograph=False)
def _margin_exp_sum(margin, cos, target_column, shift, valid, threshold: float):
    # XLA: one fused reduction; no [n, columns] tensor is kept for the backward
    z, _, _ = _margin_logits(margin, cos, target_column, threshold)
    return tf.reduce_sum(tf.where(valid[None, :], tf.exp(z - shift[:, None]), 0.0), axis=1)


@tf.function(jit_compile=True, autograph=False)
def _margin_cosine_gradient(margin, cos, target_column, slope, shift, valid, d_exp_sum,
                            d_label, scale: float, threshold: float):
    # XLA: the exponentials recomputed and the gradient written in one fused pass
    z, is_target, passes = _margin_logits(margin, cos, target_column, threshold)
    weight = tf.where(valid[None, :], tf.exp(z - shift[:, None]), 0.0) * d_exp_sum[:, None]
    weight = weight + tf.where(is_target, d_label[:, None], 0.0)
    derivative = tf.where(is_target, slope[:, None], tf.where(passes, scale, 0.0))
    return weight * derivative
