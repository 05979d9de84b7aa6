"""`insightface:DIR` as a streamed dataset (`InsightFaceDataset`): train.rec's images read
in blocks from a memory map and decoded by tf.data, as the CLI trains on them. The formats
(RecordIO, the header record, the checks made when a set is opened, the validation split,
the verification `.bin` files) are owt_tf.data.insightface.

Reading: a Python call per image (a tf.numpy_function each, under the GIL) held the
pipeline to 0.15x the rate of bare decode_jpeg of the same bytes; one call now reads a
block of images (READ_BLOCK, or a whole global batch in training) from the .rec's memory
map, and tf.data decodes them in parallel. Training ('flip', the default) decodes the
whole image and hands it on as uint8 with its flip draw: resized (as the eval view) only
when it is not at the input size, mirrored and normalised by the step on its device
(preprocess.DeviceBatch).
"""
from __future__ import annotations

import os
from typing import List, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.data import DatasetError
from owt_tf.data.insightface import held_out_for_validation, open_record_set, verification_sets
from owt_tf.data.stream import StreamDataset
from owt_tf.data.verification import VerificationPairs

READ_BLOCK = 256  # images whose bytes one Python call reads (validation, one pass of a split)


class InsightFaceDataset(StreamDataset):
    """`insightface:DIR`: train.rec + train.idx streamed like a prepared set: its records
    are the images' JPEG bytes, read from the .rec's memory map a global batch (training)
    or READ_BLOCK images per call (`_read`), in the order the image indices are drawn.

    Normalised as arcface_torch does, (pixel - 127.5) / 127.5, not by its own statistics;
    --augment auto is 'flip' (arcface_torch's only training augmentation: each image
    mirrored with probability 1/2, nothing else): the whole image decoded, resized only
    when it is not at the input size, handed on as uint8 with its flip draw (the mirror and
    the normalisation run once per batch: on the step's device for the CLI)."""

    mean = (127.5, 127.5, 127.5)
    std = (127.5, 127.5, 127.5)
    auto_augment = "flip"

    def __init__(self, directory: str, image_shape: Tuple[int, int, int]):
        self.name = f"insightface:{directory}"
        self.directory = directory
        self.image_shape = tuple(image_shape)
        self._channels()
        if not os.path.isdir(directory):
            raise DatasetError(f"{self.name}: no such directory")
        self.records = open_record_set(directory)
        self.num_classes = self.records.num_identities
        held = held_out_for_validation(self.records.labels)
        train = np.setdiff1d(np.arange(len(self.records.keys)), held)
        self.train_indices, self.val_indices = train.astype(np.int64), held.astype(np.int64)
        self.num_train = len(self.train_indices)
        if not self.num_train:
            raise DatasetError(f"{self.name}: train.rec holds no images")

    @property
    def has_own_statistics(self) -> bool:
        return False

    @property
    def trains_with_flips(self) -> bool:
        return self.augment in ("alexnet", "flip")

    def verification_sets(self) -> List[VerificationPairs]:
        """The directory's `*.bin` pairs at the model's input size."""
        return verification_sets(self.directory, self.image_shape[:2])

    def encoded_record(self, index: tf.Tensor) -> tf.Tensor:
        """Image `index`'s encoded bytes, read alone (a Python call per image: for a
        prepare's listing, not for training, which reads blocks)."""
        def read(i):
            return np.array(self.records.image_bytes(int(i)), dtype=object)

        encoded = tf.numpy_function(read, [index], tf.string, stateful=False)
        encoded.set_shape([])
        return encoded

    def _read(self, blocks: tf.data.Dataset) -> tf.data.Dataset:
        """Blocks of image indices -> blocks of (JPEG bytes, int32 identities), one read of
        the memory map per block."""
        def read(block):
            encoded, labels = tf.numpy_function(self.records.block, [block],
                                                (tf.string, tf.int32), stateful=False)
            encoded.set_shape(block.shape)
            labels.set_shape(block.shape)
            return encoded, labels

        return blocks.map(read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _records(self, indices: np.ndarray) -> tf.data.Dataset:
        blocks = tf.data.Dataset.from_tensor_slices(indices).batch(READ_BLOCK)
        return self._read(blocks).unbatch()

    def _encoded_image(self, encoded):
        return encoded  # the records are the bytes (`_read`)

    def _train_order(self, seed: int, skip: int) -> tf.data.Dataset:
        """The training images' indices, endlessly, shuffled by tf.data's seeded shuffle (a
        new order each epoch), from stream position `skip` on."""
        order = tf.data.Dataset.from_tensor_slices(self.train_indices)
        order = order.shuffle(self.num_train, seed=seed, reshuffle_each_iteration=True)
        return order.repeat().skip(skip)

    def _train_records(self, seed: int, skip: int) -> tf.data.Dataset:
        return self._read(self._train_order(seed, skip).batch(READ_BLOCK)).unbatch()

    def _train_record_batches(self, seed: int, skip: int, batch: int) -> tf.data.Dataset:
        return self._read(self._train_order(seed, skip).batch(batch, drop_remainder=True))

    def _ordered_train_records(self) -> tf.data.Dataset:
        return self._records(self.train_indices)

    def _sampled_train_records(self, sample: int) -> tf.data.Dataset:
        picks = np.unique(np.linspace(0, self.num_train - 1, min(sample, self.num_train))
                          .round().astype(int))
        return self._records(self.train_indices[picks])

    def _val_records(self) -> tf.data.Dataset:
        return self._records(self.val_indices)

    def _train_crop(self, position, item, draws):
        """'flip': the whole image, uint8 at the input size (resized as the eval view is
        only when it is not: face sets are stored at it); the mirror is applied per batch
        (StreamDataset._augment_batch)."""
        if self.augment != "flip":
            return super()._train_crop(position, item, draws)
        encoded, label = item
        image = tf.io.decode_image(encoded, channels=self.image_shape[-1],
                                   expand_animations=False)
        crop = tf.ensure_shape(self.at_input_size(image), self.image_shape)
        return crop, tf.cast(label, tf.int32), position, draws.flip, draws.lighting

    def _common_train_crop(self, position, item, draws):
        """'flip', an image stored at the input size (as face sets are): decoded, nothing
        else (no tf.cond, a function call per image); another size is an error here, and
        its batch is made row by row (`_train_crop`: resized)."""
        if self.augment != "flip":
            return super()._common_train_crop(position, item, draws)
        encoded, label = item
        crop = tf.io.decode_image(encoded, channels=self.image_shape[-1], expand_animations=False)
        crop = tf.ensure_shape(crop, self.image_shape)
        return crop, tf.cast(label, tf.int32), position, draws.flip, draws.lighting

