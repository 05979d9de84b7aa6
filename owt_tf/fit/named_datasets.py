"""Any owt_tf dataset name as a `tf.data.Dataset` of (images, labels) for Keras `fit`.

`owt_tf.fit_dataset("insightface:DIR", (112, 112, 3), batch_size=128)` gives what
`parallelize(model).fit` (and a plain Keras model's `fit`) reads: batches of uint8 images
at the model's input size and int32 labels, one pass over the split per iteration, with
the number of batches (`steps_per_epoch`) known to Keras (its progress bar shows it).

Why uint8: decoding is the input's cost; normalising on the host costs as much again in
float work per pixel and four times the bytes to the device. The normalisation is a Keras
layer (`FitData.normalization`, the set's own per-channel mean and spread) that the model
applies on its device, as the CLI finishes its uint8 crops in the step.

Each iteration of the dataset is one epoch: one pass over the split in a new order
(seeded); in training, whole batches only (the few images of a last partial batch wait for
another epoch's order). Keras iterates a dataset afresh each epoch, and
`keras.callbacks.BackupAndRestore` resumes at an epoch boundary (Keras 3 restores the
epoch, not a position inside it), so a resumed fit reads no image twice in an epoch.
Training sees the images as stored (resized as the evaluation view when they are not at
the input size): augmentation, e.g. `keras.layers.RandomFlip`, is the model's to add.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from owt_tf.data import DatasetError
from owt_tf.data.arrays import ArrayDataset
from owt_tf.data.datasets import load_dataset


class FitData(NamedTuple):
    """What `fit_dataset` returns."""

    dataset: tf.data.Dataset  # (uint8 images [B, H, W, C], int32 labels [B])
    steps_per_epoch: int  # batches in one pass over the split
    num_classes: int
    normalization: keras.layers.Layer  # uint8 pixels -> the set's normalised float input


def fit_dataset(name: str, image_shape: Tuple[int, int, int], batch_size: int, *,
                split: str = "train", shuffle: bool = True, seed: int = 0,
                data_dir: Optional[str] = None) -> FitData:
    """The dataset called `name` (`digits`, `faces`, `folder:PATH`, `prepared:DIR`,
    `insightface:DIR`, `tfds:NAME`, `imagenet2012`) for Keras `fit`: batches of
    `batch_size` (uint8 images of `image_shape`, int32 labels) from `split` ('train' or
    'validation'), shuffled afresh each epoch from `seed` (`shuffle=False`: stored order).
    Training drops a last partial batch (every batch one static shape, as a hybrid step
    needs); the validation split keeps it (evaluate counts every image)."""
    if split not in ("train", "validation"):
        raise DatasetError(f"split must be 'train' or 'validation', not {split!r}")
    if batch_size < 1:
        raise DatasetError(f"batch_size must be positive, not {batch_size}")
    source = load_dataset(name, tuple(image_shape), seed=seed, data_dir=data_dir,
                          augment="none")
    rows, count = source.stored_rows(split)
    whole = split == "train"  # fit's batches all one shape; evaluation keeps every image
    steps = count // batch_size if whole else -(-count // batch_size)
    if steps == 0:
        raise DatasetError(f"{name}: {count} {split} images is fewer than one batch of "
                           f"{batch_size}")
    if shuffle:  # records are shuffled before they are decoded (file names, bytes, indices)
        rows = rows.shuffle(count, seed=seed, reshuffle_each_iteration=True)
    decoded = rows.map(source.decode_at_input_size, num_parallel_calls=tf.data.AUTOTUNE)
    dataset = decoded.batch(batch_size, drop_remainder=whole)  # fit prefetches what it feeds
    mean, std = _statistics(source)
    normalization = keras.layers.Normalization(mean=list(mean), variance=list(std ** 2),
                                               name="owt_tf_input_normalization")
    return FitData(dataset.apply(tf.data.experimental.assert_cardinality(steps)), steps,
                   int(source.num_classes), normalization)


def _statistics(source) -> Tuple[np.ndarray, np.ndarray]:
    """The per-channel mean and spread the CLI normalises this set with: its own (sampled
    from the training images) for a streamed set that has them, else the set's fixed ones
    (ImageNet's; InsightFace's mean and spread of 127.5)."""
    mean, std = source.mean, source.std
    if not isinstance(source, ArrayDataset) and source.has_own_statistics:
        mean, std, _ = source.input_statistics()
    return np.asarray(mean, np.float32), np.asarray(std, np.float32)
