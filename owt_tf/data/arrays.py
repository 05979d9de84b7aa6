"""Images held in memory (digits, synthetic, the synthetic faces): ArrayDataset, its seeded
global batches and its validation batches."""
from __future__ import annotations

import dataclasses
from typing import Tuple

import numpy as np
import tensorflow as tf

from owt_tf.data import DatasetError

from owt_tf.data.preprocess import normalize


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

    # Array datasets train on the images as they are: no crops, no mirror images.
    trains_with_flips = False

    def label_names(self) -> Tuple[str, ...]:
        """Class names by label (digits: '0'...'9')."""
        return tuple(str(i) for i in range(self.num_classes))

    def train(self, global_batch: int, seed: int, start: int = 0) -> tf.data.Dataset:
        """Endless shuffled global batches (a new order each epoch, fixed by `seed`) of
        (images, labels, positions), from stream position `start` on (a resumed run
        continues where it stopped)."""
        if len(self.train_labels) < global_batch:
            raise DatasetError(f"{self.name}: {len(self.train_labels)} training examples is "
                               f"fewer than one global batch of {global_batch}")
        ds = tf.data.Dataset.from_tensor_slices((self.train_images, self.train_labels))
        ds = ds.shuffle(len(self.train_labels), seed=seed, reshuffle_each_iteration=True)
        ds = tf.data.Dataset.zip((ds.repeat().skip(start), tf.data.Dataset.counter(start)))
        ds = ds.map(lambda item, position: (*item, position))
        ds = ds.batch(global_batch, drop_remainder=True)
        return ds.map(self._prepare_train, num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)

    def _prepare_train(self, images, labels, positions):
        return normalize(images, self.mean, self.std), labels, positions

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

    def stored_rows(self, split: str) -> Tuple[tf.data.Dataset, int]:
        """One pass over `split` ('train' or 'validation') as (uint8 image, int32 label)
        pairs in stored order, and how many there are (already decoded: see
        `decode_at_input_size`)."""
        images, labels = ((self.train_images, self.train_labels) if split == "train"
                          else (self.val_images, self.val_labels))
        return (tf.data.Dataset.from_tensor_slices((images, labels.astype(np.int32))),
                len(labels))

    @staticmethod
    def decode_at_input_size(image, label):
        """The stored images are at the input size already."""
        return image, label

    @property
    def num_train(self) -> int:
        return len(self.train_labels)

    def sample_images(self, count: int = 8) -> np.ndarray:
        return self.train_images[:count]
