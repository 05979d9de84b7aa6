"""Each shard's top candidates (its best classes of each row and their scores), packed for
one gather, and the best of them: what the head's metrics and `predict(top_k=)` read
instead of [rows, classes] outputs. How Keras' metrics are fed from them: owt_tf.fit.metrics.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import tensorflow as tf

# Class ids travel as float32 next to the scores (one gather): exact below 2**24.
MAX_CLASSES = 2 ** 24
LOWEST = tf.float32.min  # finite: tf.math.in_top_k says False for a row with an inf


class TopCandidates(NamedTuple):
    """Per row, candidate classes: their scores (the model's outputs for them) and global
    class ids, [rows, n] each. Candidates that are padding have score LOWEST."""

    scores: tf.Tensor
    ids: tf.Tensor


def shard_top_candidates(logits: tf.Tensor, first_class: int, num_classes: int,
                         k: int) -> tf.Tensor:
    """This shard's k highest logits of each row and their global class ids (padding
    columns never chosen before a class), packed [rows, 2k]: values, then ids as float32.
    No gradient: candidates serve metrics and predictions only."""
    width = logits.shape[1]
    valid = tf.range(first_class, first_class + width) < num_classes
    masked = tf.stop_gradient(tf.where(valid[None, :], tf.cast(logits, tf.float32), LOWEST))
    values, index = tf.math.top_k(masked, k)
    return tf.concat([values, tf.cast(index + first_class, tf.float32)], axis=1)


def unpack_gathered(gathered: tf.Tensor, num_shards: int, k: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """Values and int32 class ids [rows, K*k] from the gather of every shard's
    `shard_top_candidates` along axis 1 (shard-major, each shard's candidates best first)."""
    blocks = tf.reshape(gathered, [-1, num_shards, 2, k])
    values = tf.reshape(blocks[:, :, 0], [-1, num_shards * k])
    ids = tf.cast(tf.reshape(blocks[:, :, 1], [-1, num_shards * k]), tf.int32)
    return values, ids


def best_of(candidates: TopCandidates, k: int) -> TopCandidates:
    """The k best of the candidates, best first. tf.math.top_k keeps the earlier of equal
    scores, and candidates run by class id among equals: ties go to the lower class id, as
    a stable sort of the whole row would."""
    scores, position = tf.math.top_k(candidates.scores, k)
    return TopCandidates(scores, tf.gather(candidates.ids, position, batch_dims=1))


