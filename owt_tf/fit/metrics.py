"""What a Keras compile can compute on the FC shards, and Keras' metrics fed from them.

Loss: which Keras losses the shards compute, and why others are refused, is the head's loss
module's (owt_tf.parallel.head.loss.sharded_loss); a compile's loss goes on the shards when
its metrics can be served from them too (`loss_on_shards`).

Metrics: each shard sends its top-k logits and their class ids ([rows, 2k] per shard
instead of [rows, classes / K]); the union over shards holds the global top-k. Keras'
accuracy metrics are then fed a small stand-in for the model's outputs with the same
result: the candidates' scores, plus one column of the lowest score, and the labels
remapped to their candidate's position (a label outside the candidates to that last
column, which is never in a top k). `metric_top_k` says which metrics can be served so.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from owt_tf.parallel.head.candidates import LOWEST, TopCandidates
from owt_tf.parallel.head.loss import ShardedLoss, sharded_loss

_ACCURACY_CLASSES = (keras.metrics.SparseCategoricalAccuracy, keras.metrics.CategoricalAccuracy)
_TOP_K_CLASSES = (keras.metrics.SparseTopKCategoricalAccuracy,
                  keras.metrics.TopKCategoricalAccuracy)
_ACCURACY_FUNCTIONS = (keras.metrics.sparse_categorical_accuracy,
                       keras.metrics.categorical_accuracy)
_TOP_K_FUNCTIONS = (keras.metrics.sparse_top_k_categorical_accuracy,
                    keras.metrics.top_k_categorical_accuracy)


def _metric_k(metric) -> Tuple[Optional[int], str]:
    """How many top candidates `metric` reads (1: accuracy), or (None, its name)."""
    if isinstance(metric, str):
        if metric.lower() in ("accuracy", "acc"):
            return 1, ""  # Keras makes it (sparse) categorical accuracy on a multi-class head
        try:
            metric = keras.metrics.get(metric)
        except ValueError:
            return None, metric
    if isinstance(metric, _ACCURACY_CLASSES) or any(metric is f for f in _ACCURACY_FUNCTIONS):
        return 1, ""
    if any(metric is f for f in _TOP_K_FUNCTIONS):
        return 5, ""
    if isinstance(metric, _TOP_K_CLASSES) and not metric._fn_kwargs.get("from_sorted_ids"):
        return int(metric._fn_kwargs["k"]), ""
    return None, getattr(metric, "name", None) or getattr(metric, "__name__", repr(metric))


def metric_top_k(metrics, weighted_metrics=None) -> Tuple[Optional[int], str]:
    """(k, "") when every compiled metric is an accuracy that top-k candidates serve (k: the
    most any reads; 0 without metrics), else (None, the first other metric's name)."""
    k = 0
    for group in (metrics, weighted_metrics):
        if group is None:
            continue
        if not isinstance(group, (list, tuple)):
            return None, "metrics that are not a flat list"
        for metric in group:
            need, name = _metric_k(metric)
            if need is None:
                return None, f"metric {name}"
            k = max(k, need)
    return k, ""


def join_rounds(outputs: Sequence) -> object:
    """Every round's outputs (tensors, TopCandidates or None: no metric reads them) joined
    along the rows."""
    if len(outputs) == 1 or outputs[0] is None:
        return outputs[0]
    return tf.nest.map_structure(lambda *ts: tf.concat(ts, 0), *outputs)


def map_rows(fn: Callable[[tf.Tensor], tf.Tensor], outputs) -> object:
    """`fn` on every tensor of `outputs` (a tensor, TopCandidates or None)."""
    return None if outputs is None else tf.nest.map_structure(fn, outputs)


def metric_inputs(labels: tf.Tensor, outputs) -> Tuple[tf.Tensor, tf.Tensor]:
    """(labels, y_pred) to feed Keras' compiled metrics: `outputs` themselves, or for
    TopCandidates a stand-in [rows, n + 1] that gives every accuracy metric the result the
    whole outputs row would (see the module docstring). None (no metric): passed on."""
    if not isinstance(outputs, TopCandidates):
        return labels, outputs
    n = outputs.scores.shape[1]
    scores = tf.concat([outputs.scores, tf.fill([tf.shape(outputs.scores)[0], 1], LOWEST)], 1)
    sparse = labels.shape.rank == 1 or (labels.shape.rank == 2 and labels.shape[-1] == 1)
    target = (tf.reshape(tf.cast(labels, tf.int32), [-1]) if sparse
              else tf.argmax(labels, axis=-1, output_type=tf.int32))
    match = tf.equal(outputs.ids, target[:, None])
    position = tf.where(tf.reduce_any(match, axis=1),
                        tf.argmax(tf.cast(match, tf.int32), axis=1, output_type=tf.int32), n)
    if sparse:
        return tf.reshape(tf.cast(position, labels.dtype), tf.shape(labels)), scores
    return tf.one_hot(position, n + 1, dtype=labels.dtype), scores


def loss_on_shards(loss, metrics, weighted_metrics, output_activation: Optional[str],
                   num_classes: int, cosine: bool = False) -> Tuple[Optional[ShardedLoss], int, str]:
    """What a compile computes on the shards: (its ShardedLoss, the candidates per shard its
    metrics read, "") when both the loss and every metric allow it, else (None, 0, why not)."""
    on_shards, why = sharded_loss(loss, output_activation, num_classes, cosine)
    if on_shards is None:
        return None, 0, why
    k, other = metric_top_k(metrics, weighted_metrics)
    if k is None:
        return None, 0, f"{other} needs each row's whole outputs"
    return on_shards, k, ""
