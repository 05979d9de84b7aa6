"""The data a ParallelModel's fit / evaluate / predict hand to Keras: global batches of a
static size, so that every replica's rows have one static shape (the FC exchange and the
scheme's rounds are planned for it).

- training: whole global batches only (a last partial batch is dropped, as
  `drop_remainder=True` would; a hybrid step needs the same rows on every replica);
- evaluation and prediction: every row counts, so the last batch is padded to the global
  batch with rows marked invalid (evaluation) or masked out of the result (prediction).

Arrays (numpy or tensors) become `tf.data` datasets here; a dataset keeps its elements and
order, re-batched to its own batch size. Sample weights (an argument, or a third element of
the dataset) and class weights become a float32 weight per row, as Keras' data adapters
make them; `validation_split` takes the last rows of arrays, as Keras does.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

DEFAULT_BATCH_SIZE = 32  # Keras' own default for arrays


class DataError(ValueError):
    """Data a ParallelModel cannot take (the message says why)."""


def _first_dim(dataset: tf.data.Dataset) -> int:
    """The batch size of a batched dataset: static, else read off its first element."""
    first = tf.nest.flatten(dataset.element_spec)[0]
    if first.shape.rank is None or first.shape.rank == 0:
        raise DataError("expected a batched dataset (elements of shape [batch, ...])")
    if first.shape[0] is not None:
        return int(first.shape[0])
    for element in dataset.take(1):
        return int(tf.nest.flatten(element)[0].shape[0])
    raise DataError("the dataset is empty")


def _as_dataset(x, y, batch_size: Optional[int],
                sample_weight=None) -> Tuple[tf.data.Dataset, int]:
    """A dataset of (x, y[, sample weight]) / (x,) rows, unbatched, and the global batch
    size to use."""
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise DataError("y and sample_weight must not be given with a tf.data.Dataset "
                            "(it yields (x, y) or (x, y, sample_weight))")
        size = _first_dim(x)
        if batch_size is not None and batch_size != size:
            raise DataError(f"batch_size={batch_size} given for a dataset batched by {size}")
        return x.unbatch(), size
    if x is None:
        raise DataError("no input data")
    rows = (x,) if y is None else (x, y)
    if sample_weight is not None:
        if y is None:
            raise DataError("sample_weight needs labels y")
        if len(sample_weight) != len(x):
            raise DataError(f"sample_weight has {len(sample_weight)} rows, x has {len(x)}")
        rows += (sample_weight,)
    for t in rows:
        if not hasattr(t, "shape"):
            raise DataError(f"expected numpy arrays, tensors or a tf.data.Dataset; got "
                            f"{type(t).__name__} (generators and PyDatasets are not supported)")
    if y is not None and len(x) != len(y):
        raise DataError(f"x has {len(x)} rows, y has {len(y)}")
    return tf.data.Dataset.from_tensor_slices(rows), batch_size or DEFAULT_BATCH_SIZE


def _elements(dataset: tf.data.Dataset, with_labels: bool,
              class_weight: Optional[Dict[int, float]] = None) -> tf.data.Dataset:
    """(x, y), (x, y, weight) or (x,) of each row: the weight is the row's sample weight or
    its class weight (no weight when the data gives neither: every weight 1)."""
    spec = dataset.element_spec
    if not isinstance(spec, tuple):
        if with_labels:
            raise DataError("the data has no labels (expected (x, y) elements)")
        return dataset.map(lambda x: (x,))
    if with_labels and len(spec) < 2:
        raise DataError("the data has no labels (expected (x, y) elements)")
    if not with_labels:
        return dataset.map(lambda *t: (t[0],))
    if class_weight is not None and len(spec) == 3:
        raise DataError("class_weight and sample_weight cannot be given together (as in Keras)")
    if len(spec) == 2 and class_weight is None:
        return dataset.map(lambda x, y: (x, _class_ids(y)))
    weigh = None if class_weight is None else _class_weigher(class_weight)

    def row(*t):
        weight = _row_weight(t[2]) if len(t) == 3 else weigh(t[1])
        return t[0], _class_ids(t[1]), weight

    return dataset.map(row)


def _row_weight(weight: tf.Tensor) -> tf.Tensor:
    return tf.reshape(tf.cast(weight, tf.float32), [])


def _class_weigher(class_weight: Optional[Dict[int, float]]):
    """One row's labels -> its class weight (1 for a class not in the dict, as Keras' array
    adapter gives); one-hot rows by their argmax."""
    if not class_weight or any(int(c) < 0 for c in class_weight):
        raise DataError("class_weight must map class ids >= 0 to weights")
    table = np.ones(max(int(c) for c in class_weight) + 1, np.float32)
    for c, w in class_weight.items():
        table[int(c)] = w
    table = tf.constant(table)

    def weigh(labels):
        labels = tf.reshape(labels, [-1])
        cls = (tf.argmax(labels, output_type=tf.int32) if labels.shape[0] != 1
               else tf.cast(tf.round(tf.cast(labels[0], tf.float32)), tf.int32))
        inside = (cls >= 0) & (cls < table.shape[0])
        return tf.where(inside, tf.gather(table, tf.clip_by_value(cls, 0, table.shape[0] - 1)), 1.0)

    return weigh


def validation_split_of(x, y, sample_weight, fraction: float):
    """(train arrays, validation arrays) of (x, y, sample_weight): the last `fraction` of the
    rows held out, before any shuffling (Keras' rule: split at floor(n x (1 - fraction)))."""
    if isinstance(x, tf.data.Dataset) or not hasattr(x, "shape"):
        raise DataError("validation_split is only supported for arrays (as in Keras); "
                        "pass validation_data")
    n = len(x)
    split = int(math.floor(n * (1.0 - fraction)))
    if split in (0, n):
        raise DataError(f"{n} rows cannot be split by validation_split={fraction}")

    def part(t, rows):
        return None if t is None else t[rows]

    head, tail = slice(0, split), slice(split, n)
    return ((x[head], part(y, head), part(sample_weight, head)),
            (x[tail], part(y, tail), part(sample_weight, tail)))


def _class_ids(labels: tf.Tensor, batched: bool = False) -> tf.Tensor:
    """Integer labels as int32 class ids of rank 0 per row ([N, 1] squeezed, uint8 widened:
    TF's collective gather takes float, int32 and int64 only); other labels unchanged.
    `labels`: one row's, or a batch's when `batched`."""
    if not labels.dtype.is_integer:
        return labels
    axis = 1 if batched else 0
    if labels.shape.rank == axis + 1 and labels.shape[axis] == 1:
        labels = tf.squeeze(labels, axis=axis)
    return tf.cast(labels, tf.int32) if labels.dtype not in (tf.int32, tf.int64) else labels


def check_global_batch(size: int, num_replicas: int) -> int:
    if size % num_replicas:
        raise DataError(f"the global batch ({size}) is not divisible by the {num_replicas} "
                        "devices: every device takes an equal share")
    return size // num_replicas


def training_batches(x, y, batch_size: Optional[int], shuffle: bool, num_replicas: int,
                     sample_weight=None, class_weight: Optional[Dict[int, float]] = None,
                     seed: Optional[int] = None) -> Tuple[tf.data.Dataset, int]:
    """Whole global batches of (x, y, weight), and the per-replica batch size. `seed`: the
    shuffle's (the same on every worker of a cluster), else a fresh order every run."""
    if class_weight is not None and sample_weight is not None:
        raise DataError("class_weight and sample_weight cannot be given together (as in Keras)")
    rows, size = _as_dataset(x, y, batch_size, sample_weight)
    per_replica = check_global_batch(size, num_replicas)
    rows = _elements(rows, with_labels=True, class_weight=class_weight)
    if shuffle and not isinstance(x, tf.data.Dataset):
        batches = _shuffled_batches(rows, len(x), size, seed)
    else:
        batches = rows.batch(size, drop_remainder=True)
    return batches.prefetch(tf.data.AUTOTUNE), per_replica


def _shuffled_batches(rows: tf.data.Dataset, n: int, size: int,
                      seed: Optional[int] = None) -> tf.data.Dataset:
    """Whole batches of every row in a new order each epoch, as Keras shuffles arrays: a
    permutation of the row indices (8 bytes a row in the shuffle buffer), not a window."""
    table = next(iter(rows.batch(n)))  # every row, labels and weights prepared once
    order = tf.data.Dataset.range(n).shuffle(n, seed=seed, reshuffle_each_iteration=True)
    return order.batch(size, drop_remainder=True).map(
        lambda i: tuple(tf.gather(t, i) for t in table))


def _pad_rows(t: tf.Tensor, pad: tf.Tensor, size: int) -> tf.Tensor:
    paddings = [[0, pad]] + [[0, 0]] * (t.shape.rank - 1)
    padded = tf.pad(t, paddings)
    return tf.ensure_shape(padded, [size] + t.shape.as_list()[1:])


def padded_batches(x, y, batch_size: Optional[int], num_replicas: int,
                   with_labels: bool, sample_weight=None) -> tf.data.Dataset:
    """Global batches padded to a static size: (x, y, valid) or, with sample weights,
    (x, y, (weight, valid)) for evaluation; (x, valid) for prediction. valid is 0 on padding
    rows, 1 on real ones."""
    rows, size = _as_dataset(x, y, batch_size, sample_weight)
    size = -(-size // num_replicas) * num_replicas  # evaluation pads up to a multiple of K
    rows = _elements(rows, with_labels)

    def pad(*batch):
        n = tf.shape(batch[0])[0]
        extra = size - n
        valid = _pad_rows(tf.ones([n], tf.float32), extra, size)
        padded = tuple(_pad_rows(t, extra, size) for t in batch)
        if len(padded) == 3:
            return padded[:2] + ((padded[2], valid),)
        return padded + (valid,)

    # Re-batched with drop_remainder (every batch is whole now): tf.distribute splits a
    # dataset by its last batch op, and one without drop_remainder gives replicas batches of
    # unknown size.
    padded = rows.batch(size).map(pad).unbatch().batch(size, drop_remainder=True)
    return padded.prefetch(tf.data.AUTOTUNE)


