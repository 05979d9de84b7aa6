"""Datasets by name, as tf.data pipelines of global batches.

    digits      scikit-learn's bundled 8x8 handwritten digits (real data, no download),
                resized to the model's input; a fixed 80/20 train/validation split
    synthetic   random images and labels of the model's size, for benchmarks only

A training batch is the *global* batch of B*K examples; MirroredStrategy's
experimental_distribute_dataset gives replica k rows k*B ... (k+1)*B-1 of it, so step t
sees the same examples whatever K is (DESIGN.md's run contract).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.data import DATASET_NAMES
from owt_tf.data.preprocess import normalize
_SPLIT_SEED = 20140421  # fixed: the validation split never changes with --seed


class DatasetError(ValueError):
    """The dataset cannot be loaded as asked."""


@dataclasses.dataclass
class ArrayDataset:
    """Images held in memory as uint8 [N, H, W, C] with int32 labels."""

    name: str
    num_classes: int
    train_images: np.ndarray
    train_labels: np.ndarray
    val_images: np.ndarray
    val_labels: np.ndarray
    mean: Tuple[float, ...]
    std: Tuple[float, ...]

    def train(self, global_batch: int, seed: int) -> tf.data.Dataset:
        """Endless shuffled global batches (a new order each epoch, fixed by `seed`)."""
        if len(self.train_labels) < global_batch:
            raise DatasetError(f"{self.name}: {len(self.train_labels)} training examples is "
                               f"fewer than one global batch of {global_batch}")
        ds = tf.data.Dataset.from_tensor_slices((self.train_images, self.train_labels))
        ds = ds.shuffle(len(self.train_labels), seed=seed, reshuffle_each_iteration=True)
        ds = ds.repeat().batch(global_batch, drop_remainder=True)
        return ds.map(self._prepare, num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)

    def validation(self, global_batch: int) -> tf.data.Dataset:
        """One pass over the validation split; the last batch is padded with label -1."""
        n = len(self.val_labels)
        pad = (-n) % global_batch
        images = np.concatenate([self.val_images, np.zeros((pad,) + self.val_images.shape[1:],
                                                           self.val_images.dtype)])
        labels = np.concatenate([self.val_labels, -np.ones((pad,), np.int32)])
        ds = tf.data.Dataset.from_tensor_slices((images, labels)).batch(global_batch)
        return ds.map(self._prepare).prefetch(2)

    def _prepare(self, images, labels):
        return normalize(images, self.mean, self.std), labels


def load_dataset(name: str, image_shape: Tuple[int, int, int], num_classes: Optional[int] = None,
                 seed: int = 0) -> ArrayDataset:
    """The dataset called `name`, with images of `image_shape` (H, W, C)."""
    if name == "digits":
        return _digits(image_shape)
    if name == "synthetic":
        return _synthetic(image_shape, num_classes or 10, seed)
    raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(DATASET_NAMES)}")


def _digits(image_shape) -> ArrayDataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0 * 255.0).astype(np.float32)[..., None]  # 0..16 -> 0..255
    h, w, c = image_shape
    resized = tf.image.resize(images, (h, w), method="bilinear").numpy()
    resized = np.repeat(np.clip(np.rint(resized), 0, 255).astype(np.uint8), c, axis=-1)
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(labels))
    n_val = len(labels) // 5
    val, train = order[:n_val], order[n_val:]
    pixels = resized[train].astype(np.float64)
    mean = tuple(float(m) for m in pixels.mean(axis=(0, 1, 2)))
    std = tuple(float(s) for s in pixels.std(axis=(0, 1, 2)))
    return ArrayDataset("digits", 10, resized[train], labels[train], resized[val], labels[val],
                        mean, std)


def _synthetic(image_shape, num_classes, seed) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    n_train, n_val = 1024, 256
    images = rng.integers(0, 256, size=(n_train + n_val,) + tuple(image_shape), dtype=np.uint8)
    labels = rng.integers(0, num_classes, size=(n_train + n_val,)).astype(np.int32)
    c = image_shape[-1]
    return ArrayDataset("synthetic", num_classes, images[:n_train], labels[:n_train],
                        images[n_train:], labels[n_train:], (127.5,) * c, (73.9,) * c)
