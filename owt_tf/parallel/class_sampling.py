"""Class sampling for large heads (InsightFace's Partial FC): each FC update, each shard keeps
the classes of its slice that are labels in the update's rows (positives) plus a uniform
random sample of its other classes, ceil(sample_rate x the shard's classes) in all (every
positive when they are more). The class-sharded cross-entropy (ShardedHead) then masks the
other classes out of the softmax: their logits count as -inf, so their kernel columns and
biases get an exact zero gradient. Shapes stay static (no column gather): a correctness
option, not a speed-up.

The sample is a pure function of the update's seed and the shard (stateless random ops):
the same step seed gives the same classes, another step or shard other ones.
"""
from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from owt_tf.parallel.plan import sample_rate_problem

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


def sampled_classes(positives: tf.Tensor, num_valid: int, rate: float, seed: tf.Tensor) -> tf.Tensor:
    """bool [width]: the columns one shard keeps in an update. `positives` (bool [width]):
    the update's labels among its columns; `num_valid`: its real classes (columns
    0 ... num_valid-1; the rest is padding, never kept); `seed`: shard_seed's.

    Every positive, plus the highest-scoring others under uniform random scores up to
    sample_count(rate, num_valid) columns in all (Partial FC's rule: positives score above
    every random score)."""
    width = int(positives.shape[0])
    count = sample_count(rate, num_valid)
    if count == 0:
        return tf.zeros([width], tf.bool)
    scores = tf.random.stateless_uniform([width], seed=seed)
    scores = tf.where(positives, 2.0, scores)
    scores = tf.where(tf.range(width) < num_valid, scores, -1.0)
    _, kept = tf.math.top_k(scores, count, sorted=False)
    chosen = tf.scatter_nd(kept[:, None], tf.ones([count], tf.int32), [width]) > 0
    return chosen | positives
