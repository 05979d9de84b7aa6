"""Class sampling for large heads (InsightFace's Partial FC): each FC update, each shard keeps
the classes of its slice that are labels in the update's rows (positives) plus a uniform
random sample of its other classes, ceil(sample_rate x the shard's classes) in all (every
positive when they are more).

The kept columns are chosen before the forward pass (the labels are known then), as a
static-size vector of column ids (`SampledColumns`): the class layer (kept class-major,
owt_tf.parallel.head.layout) gathers those classes' rows of its kernel only
(`ShardedDense.sampled_rows`), so its logits are [rows, S] instead of [rows, shard
classes], and its matmuls, forward and backward, shrink by about the rate. S = the
sample's count plus the update's label rows (every positive always fits); entries past the
real sample are padding, flagged invalid and left out of the softmax, as the unsampled
classes are. The update differentiates the gathered rows, never the whole shard: its
gradient is [S, in], and the optimizer moves the sampled classes only
(owt_tf.parallel.head.update: weights, momentum and weight decay of a class wait while it is
not sampled, as the original Partial FC does). Labels given as rows of class weights
(one-hot) may name any number of classes a row, so there S is the shard's width: exact,
but no smaller.

The sample is a pure function of the update's seed and the shard (stateless random ops):
the same step seed gives the same classes, another step or shard other ones.

How it is drawn without a pass over the shard (its cost follows the sample, not the head):
the update's positives are the distinct label ids of the shard (from the rows, not from a
[width] mask); the other classes are ids drawn uniformly at random with replacement, a few
more than needed, kept in the order each first appears (tf.unique) with the positives taken
out: the first j of them are a uniform random j-subset of the non-positive classes (every
order of distinct draws is equally likely). In the rare case the draws hold too few distinct
ids (a probability far below 1e-9 at the draw counts chosen), or when the sample is over
half the shard, the sample is chosen by uniform scores over the whole shard instead (as
Partial FC does: positives scored above every random score, top-k), which is uniform too.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import tensorflow as tf

from owt_tf.planner.plan import sample_rate_problem
from owt_tf.parallel.head.candidates import LOWEST, shard_top_candidates

# Folded into the update's seed with the shard index; above the dropout seeds' range
# (layer_index * 1024 + salt, ShardedHead._dropout), so the two never share a stream.
CLASS_SAMPLING_SALT = 2 ** 30


def check_sample_rate(rate) -> float:
    """The rate as a float, or ValueError (one line) for anything but a number in (0, 1]."""
    problem = sample_rate_problem(rate)
    if problem:
        raise ValueError(f"sample_rate {problem}")
    return float(rate)


def sample_count(rate: float, classes: int) -> int:
    """How many of a shard's `classes` an update samples: ceil(rate x classes), at least one
    class of a shard that has any (the 1e-9 keeps 0.7 x 10 at 7, not 8)."""
    if classes <= 0:
        return 0
    return min(classes, max(1, math.ceil(rate * classes - 1e-9)))


def shard_positives(labels: Sequence[tf.Tensor], first: int, width: int, sparse: bool) -> tf.Tensor:
    """bool [width]: which of the shard's columns (global classes first ... first+width-1)
    are a label of some row of `labels` (every round of the update): class ids ([n] or
    [n, 1], any number type) when `sparse`, else [n, classes] rows of class weights, where
    a class is a label of a row that gives it a nonzero weight."""
    if sparse:
        ids = tf.concat([tf.reshape(tf.cast(y, tf.int32), [-1]) for y in labels], 0) - first
        mine = (ids >= 0) & (ids < width)
        hits = tf.scatter_nd(tf.clip_by_value(ids, 0, width - 1)[:, None],
                             tf.cast(mine, tf.int32), [width])
        return hits > 0
    present = tf.reduce_any(tf.not_equal(tf.concat(list(labels), 0), 0), axis=0)
    present = tf.pad(present, [[0, max(0, first + width - int(present.shape[0]))]])
    return present[first:first + width]


def shard_seed(update_seed: tf.Tensor, shard: int) -> tf.Tensor:
    """The stateless seed of shard `shard`'s sample in the update seeded `update_seed`."""
    return tf.random.experimental.stateless_fold_in(update_seed, CLASS_SAMPLING_SALT + shard)


class SampledColumns(NamedTuple):
    """One shard's columns in one FC update: `ids` int32 [S], distinct shard-local column
    ids in ascending order; `valid` bool [S], which entries are sampled (the others:
    padding, out of the softmax); `width`: the shard's columns."""

    ids: tf.Tensor
    valid: tf.Tensor
    width: int


def shard_sample(labels: Sequence[tf.Tensor], k: int, width: int, num_classes: int, rate: float,
                 sparse: bool, update_seed: tf.Tensor) -> SampledColumns:
    """Shard k's sampled columns (of `width`, global classes k*width ...) in an FC update
    with these rows' `labels` (every round of the update, `sparse` as in shard_positives),
    seeded by `update_seed` (int32 [2])."""
    first = k * width
    num_valid = min(width, max(0, num_classes - first))
    rows = sum(int(y.shape[0]) for y in labels) if sparse else None
    size = sample_size(rate, num_valid, width, rows)
    seed = shard_seed(update_seed, k)
    if sparse and direct_draws(size, num_valid):
        ids = tf.concat([tf.reshape(tf.cast(y, tf.int32), [-1]) for y in labels], 0) - first
        return draw_columns(ids, num_valid, width, rate, seed, size)
    positives = shard_positives(labels, first, width, sparse)
    return sample_columns(positives, num_valid, rate, seed, size)


def direct_draws(size: int, num_valid: int) -> Optional[int]:
    """How many ids `draw_columns` draws to find `size` distinct ones among `num_valid`
    classes, or None when the sample is too large a share of the shard to draw directly.
    Enough that the expected distinct count exceeds `size` by 8 standard deviations (and
    16): falling short is then far rarer than 1e-9."""
    target = size + 8 * math.sqrt(size) + 16
    if num_valid <= 0 or target > 0.5 * num_valid:
        return None
    return int(math.ceil(-num_valid * math.log1p(-target / num_valid))) + 16


def draw_columns(label_ids: tf.Tensor, num_valid: int, width: int, rate: float,
                 seed: tf.Tensor, size: int) -> SampledColumns:
    """The columns one shard keeps, drawn without a pass over the shard (module docstring):
    `label_ids` int32 [n], the update's labels less the shard's first class (those outside
    0 ... num_valid-1 are another shard's). The same rule as sample_columns: every positive,
    then uniform others up to sample_count(rate, num_valid) in all; `size` ids, the rest
    padding (flagged invalid)."""
    count = sample_count(rate, num_valid)
    mine = (label_ids >= 0) & (label_ids < num_valid)
    positives = tf.sort(tf.unique(tf.boolean_mask(label_ids, mine))[0])
    num_positives = tf.size(positives)
    draws = tf.random.stateless_uniform([direct_draws(size, num_valid)], seed=seed, minval=0,
                                        maxval=num_valid, dtype=tf.int64)
    distinct = tf.cast(tf.unique(draws)[0], tf.int32)  # in the order each first appears
    slot = tf.clip_by_value(tf.searchsorted(positives, distinct), 0,
                            tf.maximum(num_positives - 1, 0))
    is_positive = (tf.gather(tf.pad(positives, [[0, 1]]), slot) == distinct) & (
        num_positives > 0)
    others = tf.boolean_mask(distinct, ~is_positive)

    def drawn():
        ids = tf.concat([positives, others[:size - num_positives]], 0)
        kept = tf.maximum(count, num_positives)
        return ids, tf.range(size) < kept

    def by_scores():  # too few distinct draws: far rarer than 1e-9 (direct_draws)
        hits = tf.scatter_nd(positives[:, None], tf.ones_like(positives), [width]) > 0
        fallback = sample_columns(hits, num_valid, rate, seed, size)
        return fallback.ids, fallback.valid

    ids, valid = tf.cond(tf.size(others) >= size - num_positives, drawn, by_scores)
    ids = tf.ensure_shape(ids, [size])
    order = tf.argsort(ids)
    return SampledColumns(tf.gather(ids, order), tf.gather(tf.ensure_shape(valid, [size]),
                                                           order), width)


def sample_size(rate: float, num_valid: int, width: int, label_rows: Optional[int]) -> int:
    """S, the static length of a shard's sampled ids: room for the sample and every positive
    of `label_rows` rows of class ids (None: labels that may name any number of classes)."""
    if label_rows is None:
        return width
    return min(width, sample_count(rate, num_valid) + label_rows)


def sample_columns(positives: tf.Tensor, num_valid: int, rate: float, seed: tf.Tensor,
                   size: int) -> SampledColumns:
    """The columns one shard keeps in an update, as `size` ids (sample_size's S).
    `positives` (bool [width]): the update's labels among its columns; `num_valid`: its
    real classes (columns 0 ... num_valid-1; the rest is padding, never kept); `seed`:
    shard_seed's.

    Every positive, plus the highest-scoring others under uniform random scores up to
    sample_count(rate, num_valid) columns in all (Partial FC's rule: positives score above
    every random score, padding below)."""
    width = int(positives.shape[0])
    count = sample_count(rate, num_valid)
    scores = tf.random.stateless_uniform([width], seed=seed)
    scores = tf.where(positives, 2.0, scores)
    scores = tf.where(tf.range(width) < num_valid, scores, -1.0)
    # Best first: positives, then the others by score; the first max(count, positives) are
    # the sample (its top `count`, plus the positives beyond them), the rest padding.
    _, best = tf.math.top_k(scores, size, sorted=True)
    kept = tf.maximum(count, tf.reduce_sum(tf.cast(positives, tf.int32)))
    mask = tf.scatter_nd(best[:, None], tf.cast(tf.range(size) < kept, tf.int32), [width]) > 0
    # Ascending ids: gathering a [in, width] kernel's columns in order reads each row
    # forward; in random order it is ~5x slower, as slow as the full matmul.
    ids = tf.sort(best)
    return SampledColumns(ids, tf.gather(mask, ids), width)


def column_mask(sample: SampledColumns) -> tf.Tensor:
    """bool [width]: which of the shard's columns the sample keeps."""
    kept = tf.cast(sample.valid, tf.int32)
    return tf.scatter_nd(sample.ids[:, None], kept, [sample.width]) > 0


def label_positions(local_labels: tf.Tensor, sample: Optional[SampledColumns],
                    width: int) -> tf.Tensor:
    """int32 [n]: which logit column holds each shard-local label (column id; outside
    0 ... width-1: not this shard's, any column): its position in `sample.ids` (every label
    of the shard is a positive, so it is there), or the label itself without a sample."""
    if sample is None:
        return tf.clip_by_value(local_labels, 0, width - 1)
    size = int(sample.ids.shape[0])
    # ids are ascending and a label's id is there once: a search, not a [width] table
    found = tf.searchsorted(sample.ids, tf.cast(local_labels, sample.ids.dtype))
    return tf.clip_by_value(tf.cast(found, tf.int32), 0, size - 1)


def sampled_label_columns(label_columns: tf.Tensor, sample: Optional[SampledColumns]) -> tf.Tensor:
    """Rows of class weights over the shard's columns ([n, width]) at the logits' columns:
    [n, S] at the sampled ids, or all of them without a sample."""
    return label_columns if sample is None else tf.gather(label_columns, sample.ids, axis=1)


def top_candidates(logits: tf.Tensor, sample: Optional[SampledColumns], first_class: int,
                   num_classes: int, k: int) -> tf.Tensor:
    """shard_top_candidates of a shard's logits: of all its columns without a sample, else
    of the sampled ones ([n, S]): each row's k best sampled classes and their GLOBAL class
    ids (first_class + the column id), packed [n, 2k] (padding entries are LOWEST). No
    gradient."""
    if sample is None:
        return shard_top_candidates(logits, first_class, num_classes, k)
    masked = tf.stop_gradient(tf.where(sample.valid[None, :], tf.cast(logits, tf.float32), LOWEST))
    values, position = tf.math.top_k(masked, k)
    ids = tf.gather(sample.ids, position) + first_class
    return tf.concat([values, tf.cast(ids, tf.float32)], axis=1)
