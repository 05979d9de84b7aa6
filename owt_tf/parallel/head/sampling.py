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
(owt_tf.parallel.head.sparse: weights, momentum and weight decay of a class wait while it is
not sampled, as the original Partial FC does). Labels given as rows of class weights
(one-hot) may name any number of classes a row, so there S is the shard's width: exact,
but no smaller.

The sample is a pure function of the update's seed and the shard (stateless random ops):
the same step seed gives the same classes, another step or shard other ones.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import tensorflow as tf

from owt_tf.planner.plan import sample_rate_problem
from owt_tf.parallel.head.metrics import LOWEST, shard_top_candidates

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
    positives = shard_positives(labels, first, width, sparse)
    num_valid = min(width, max(0, num_classes - first))
    rows = sum(int(y.shape[0]) for y in labels) if sparse else None
    return sample_columns(positives, num_valid, rate, shard_seed(update_seed, k),
                          sample_size(rate, num_valid, width, rows))


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
    where = tf.scatter_nd(sample.ids[:, None], tf.range(size), [sample.width])
    return tf.gather(where, tf.clip_by_value(local_labels, 0, sample.width - 1))


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
