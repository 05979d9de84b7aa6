"""The data a ParallelModel's fit / evaluate / predict hand to Keras: global batches of a
static size, so that every replica's rows have one static shape (the FC exchange and the
scheme's rounds are planned for it).

- training: whole global batches only (a last partial batch is dropped, as
  `drop_remainder=True` would; a hybrid step needs the same rows on every replica);
- evaluation and prediction: every row counts, so the last batch is padded to the global
  batch with rows of weight 0 (evaluation) or masked out of the result (prediction).

Arrays (numpy or tensors) become `tf.data` datasets here; a dataset keeps its elements and
order, re-batched to its own batch size.
"""
from __future__ import annotations

from typing import Optional, Tuple

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


def _as_dataset(x, y, batch_size: Optional[int]) -> Tuple[tf.data.Dataset, int]:
    """A dataset of (x, y) / (x,) rows, unbatched, and the global batch size to use."""
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise DataError("y must not be given with a tf.data.Dataset (it yields (x, y))")
        size = _first_dim(x)
        if batch_size is not None and batch_size != size:
            raise DataError(f"batch_size={batch_size} given for a dataset batched by {size}")
        return x.unbatch(), size
    if x is None:
        raise DataError("no input data")
    rows = (x,) if y is None else (x, y)
    for t in rows:
        if not hasattr(t, "shape"):
            raise DataError(f"expected numpy arrays, tensors or a tf.data.Dataset; got "
                            f"{type(t).__name__} (generators and PyDatasets are not supported)")
    if y is not None and len(x) != len(y):
        raise DataError(f"x has {len(x)} rows, y has {len(y)}")
    return tf.data.Dataset.from_tensor_slices(rows), batch_size or DEFAULT_BATCH_SIZE


def _elements(dataset: tf.data.Dataset, with_labels: bool) -> tf.data.Dataset:
    """(x, y) or (x,) of each row; a sample weight in the data is refused."""
    spec = dataset.element_spec
    if not isinstance(spec, tuple):
        if with_labels:
            raise DataError("the data has no labels (expected (x, y) elements)")
        return dataset.map(lambda x: (x,))
    if len(spec) == 3:
        raise DataError("sample weights are not supported by a parallelized model")
    if with_labels and len(spec) < 2:
        raise DataError("the data has no labels (expected (x, y) elements)")
    if with_labels:
        return dataset.map(lambda *t: (t[0], _class_ids(t[1])))
    return dataset.map(lambda *t: (t[0],))


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


def training_batches(x, y, batch_size: Optional[int], shuffle: bool,
                     num_replicas: int) -> Tuple[tf.data.Dataset, int]:
    """Whole global batches of (x, y), and the per-replica batch size."""
    rows, size = _as_dataset(x, y, batch_size)
    per_replica = check_global_batch(size, num_replicas)
    if shuffle and not isinstance(x, tf.data.Dataset):
        batches = _shuffled_batches(x, y, size)
    else:
        batches = _elements(rows, with_labels=True).batch(size, drop_remainder=True)
    return batches.prefetch(tf.data.AUTOTUNE), per_replica


def _shuffled_batches(x, y, size: int) -> tf.data.Dataset:
    """Whole batches of every row in a new order each epoch, as Keras shuffles arrays: a
    permutation of the row indices (8 bytes a row in the shuffle buffer), not a window."""
    x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
    order = tf.data.Dataset.range(len(x)).shuffle(len(x), reshuffle_each_iteration=True)
    return order.batch(size, drop_remainder=True).map(
        lambda i: (tf.gather(x, i), _class_ids(tf.gather(y, i), batched=True)))


def _pad_rows(t: tf.Tensor, pad: tf.Tensor, size: int) -> tf.Tensor:
    paddings = [[0, pad]] + [[0, 0]] * (t.shape.rank - 1)
    padded = tf.pad(t, paddings)
    return tf.ensure_shape(padded, [size] + t.shape.as_list()[1:])


def padded_batches(x, y, batch_size: Optional[int], num_replicas: int,
                   with_labels: bool) -> tf.data.Dataset:
    """Global batches padded to a static size: (x, y, weight) for evaluation (weight 0 on
    padding), (x, valid) for prediction (valid 0 on padding)."""
    rows, size = _as_dataset(x, y, batch_size)
    size = -(-size // num_replicas) * num_replicas  # evaluation pads up to a multiple of K
    rows = _elements(rows, with_labels)

    def pad(*batch):
        n = tf.shape(batch[0])[0]
        extra = size - n
        weight = _pad_rows(tf.ones([n], tf.float32), extra, size)
        return tuple(_pad_rows(t, extra, size) for t in batch) + (weight,)

    # Re-batched with drop_remainder (every batch is whole now): tf.distribute splits a
    # dataset by its last batch op, and one without drop_remainder gives replicas batches of
    # unknown size.
    padded = rows.batch(size).map(pad).unbatch().batch(size, drop_remainder=True)
    return padded.prefetch(tf.data.AUTOTUNE)


