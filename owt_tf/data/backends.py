"""The streamed datasets' sources: a folder of images (`folder:PATH`) and a prepared TFDS
dataset (`tfds:NAME`, `imagenet2012`). Each gives StreamDataset its records (file names or
encoded bytes) in a seeded, endless training order and one pass of validation records.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.data import DatasetError
from owt_tf.data.stream import StreamDataset

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif")


class FolderDataset(StreamDataset):
    """`folder:PATH`: a labelled image tree (labels: the sorted folder names)."""

    def __init__(self, root: str, image_shape: Tuple[int, int, int]):
        self.name = f"folder:{root}"
        self.image_shape = tuple(image_shape)
        self._channels()
        split_dirs = {s: os.path.join(root, s) for s in ("train", "validation", "test")}
        if not os.path.isdir(split_dirs["train"]):
            raise DatasetError(f"{self.name}: no train/ folder in {root}")
        val = split_dirs["validation"] if os.path.isdir(split_dirs["validation"]) else split_dirs["test"]
        if not os.path.isdir(val):
            raise DatasetError(f"{self.name}: no validation/ or test/ folder in {root}")
        self.class_names = sorted(d for d in os.listdir(split_dirs["train"])
                                  if os.path.isdir(os.path.join(split_dirs["train"], d)))
        if not self.class_names:
            raise DatasetError(f"{self.name}: train/ has no label folders")
        self.num_classes = len(self.class_names)
        self.train_files, self.train_file_labels = self._list(split_dirs["train"])
        self.val_files, self.val_file_labels = self._list(val)
        self.num_train = len(self.train_files)

    def _list(self, split_dir: str):
        files, labels = [], []
        for label, name in enumerate(self.class_names):
            folder = os.path.join(split_dir, name)
            found = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_SUFFIXES)) \
                if os.path.isdir(folder) else []
            if not found and split_dir.endswith("train"):
                raise DatasetError(f"{self.name}: label folder {folder} has no images")
            files += [os.path.join(folder, f) for f in found]
            labels += [label] * len(found)
        return np.array(files), np.array(labels, np.int32)

    def _encoded_image(self, path):
        return tf.io.read_file(path)

    def _train_records(self, seed: int, skip: int) -> tf.data.Dataset:
        files = tf.data.Dataset.from_tensor_slices((self.train_files, self.train_file_labels))
        files = files.shuffle(self.num_train, seed=seed, reshuffle_each_iteration=True)
        return files.repeat().skip(skip)

    def _ordered_train_records(self) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices((self.train_files, self.train_file_labels))

    def _sampled_train_records(self, sample: int) -> tf.data.Dataset:
        """Evenly spaced over the split: the files are in class order."""
        picks = np.unique(np.linspace(0, self.num_train - 1, min(sample, self.num_train))
                          .round().astype(int))
        return tf.data.Dataset.from_tensor_slices((self.train_files[picks],
                                                   self.train_file_labels[picks]))

    def _val_records(self) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices((self.val_files, self.val_file_labels))


class TfdsDataset(StreamDataset):
    """`tfds:NAME`: a TFDS image-classification dataset already prepared in `data_dir`.

    Nothing is downloaded unless `download=True`: an unprepared dataset is an error at once,
    not after TFDS's network retries."""

    # Training records shuffled together; a block is held in memory and the next read ahead.
    shuffle_block = 10_000

    def __init__(self, tfds_name: str, image_shape: Tuple[int, int, int],
                 data_dir: Optional[str] = None, download: bool = False,
                 manual_dir: Optional[str] = None, required_files: Sequence[str] = ()):
        import tensorflow_datasets as tfds

        self.name = f"tfds:{tfds_name}"
        self.image_shape = tuple(image_shape)
        self._channels()
        try:
            self.builder = tfds.builder(tfds_name, data_dir=data_dir)
        except Exception as err:  # tfds raises its own DatasetNotFoundError and others
            raise DatasetError(f"{self.name}: {err}".splitlines()[0]) from None
        if not tf.io.gfile.exists(os.path.join(self.builder.data_dir, "dataset_info.json")):
            if manual_dir:
                for required in required_files:
                    if not os.path.exists(os.path.join(manual_dir, required)):
                        raise DatasetError(f"{self.name}: {required} is missing from "
                                           f"--manual-dir {manual_dir}")
                config = tfds.download.DownloadConfig(manual_dir=manual_dir)
                self.builder.download_and_prepare(download_config=config)
            elif download:
                self.builder.download_and_prepare()
            else:
                hint = ("pass --manual-dir with the archives" if required_files
                        else "prepare it with tfds or pass --download")
                raise DatasetError(f"{self.name} is not prepared in {self.builder.data_dir}; "
                                   f"{hint}")
        info = self.builder.info
        if "train" not in info.splits:
            raise DatasetError(f"{self.name} has no train split")
        self.val_split = next((s for s in ("validation", "test") if s in info.splits), None)
        if self.val_split is None:
            raise DatasetError(f"{self.name} has no validation or test split")
        self.num_classes = info.features["label"].num_classes
        self.num_train = info.splits["train"].num_examples

    def _encoded(self, split: str) -> tf.data.Dataset:
        """(encoded image bytes, label) in stored order: decoding waits until after any skip."""
        import tensorflow_datasets as tfds

        return self.builder.as_dataset(split=split, as_supervised=True, shuffle_files=False,
                                       decoders={"image": tfds.decode.SkipDecoding()})

    def _encoded_image(self, encoded):
        return encoded

    def _train_records(self, seed: int, skip: int) -> tf.data.Dataset:
        """Epoch after epoch: the train shards in an order drawn from (seed, epoch), read in
        turn, and shuffled in consecutive blocks of `shuffle_block` records (each block's
        order drawn from (seed, its number)). A position's record is computed, not read up
        to: a resumed stream opens the shard its block starts in, skips inside that shard
        and the block, and goes on exactly as the uninterrupted stream."""
        import tensorflow_datasets as tfds

        if self.builder.info.file_format != tfds.core.FileFormat.TFRECORD:
            raise DatasetError(f"{self.name}: training reads TFRecord shards; this dataset is "
                               f"stored as {self.builder.info.file_format.value}")
        shards = self.builder.info.splits["train"].file_instructions
        files = tf.constant([s.filename for s in shards])
        first_record = tf.constant([s.skip for s in shards], tf.int64)
        lengths = tf.constant([s.take for s in shards], tf.int64)
        block = min(self.num_train, self.shuffle_block)
        blocks_per_epoch = -(-self.num_train // block)
        first_epoch, offset = divmod(skip, self.num_train)

        def epoch_blocks(epoch):
            order = tf.random.experimental.stateless_shuffle(
                tf.range(len(shards)), seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
            start = tf.constant(offset // block * block, tf.int64) * tf.cast(
                tf.equal(epoch, first_epoch), tf.int64)  # the first epoch resumes at its block
            ends = tf.cumsum(tf.gather(lengths, order))
            begins = ends - tf.gather(lengths, order)
            skipped = tf.clip_by_value(start - begins, 0, tf.gather(lengths, order))
            records = tf.data.Dataset.from_tensor_slices(
                (tf.gather(files, order), tf.gather(first_record, order) + skipped,
                 tf.gather(lengths, order) - skipped))
            records = records.filter(lambda f, first, count: count > 0).flat_map(
                lambda f, first, count: tf.data.TFRecordDataset(f).skip(first).take(count))
            numbers = tf.data.Dataset.counter(epoch * blocks_per_epoch + start // block)
            return tf.data.Dataset.zip((records.batch(block), numbers)).map(shuffled_block)

        def shuffled_block(serialized, number):
            order = tf.random.experimental.stateless_shuffle(
                tf.range(tf.shape(serialized)[0]), seed=tf.stack([tf.constant(seed, tf.int64), number]))
            return tf.gather(serialized, order)

        # prefetch: the next block is read while this one is used, not when it runs out.
        blocks = tf.data.Dataset.counter(first_epoch).flat_map(epoch_blocks).prefetch(1)
        serialized = blocks.unbatch().skip(offset % block)
        return serialized.map(self._parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _parse(self, serialized):
        import tensorflow_datasets as tfds

        example = self.builder.info.features.deserialize_example(
            serialized, decoders={"image": tfds.decode.SkipDecoding()})
        return example["image"], example["label"]

    def _ordered_train_records(self) -> tf.data.Dataset:
        return self._encoded("train")

    def _val_records(self) -> tf.data.Dataset:
        return self._encoded(self.val_split)
