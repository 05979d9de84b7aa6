"""A dataset streamed and decoded by tf.data (`StreamDataset`), and the own-rows rule: each
process reads and decodes only its own rows of every global batch.

Streamed datasets decode only the rows a process keeps (`StreamDataset.train_rows`: a
worker of a cluster decodes its D*B rows of each global batch, not all B*K), so the rule
for an image that cannot be decoded (corrupt, truncated) is one every row applies on its
own: row r of a global batch holds the record at its own position if that decodes, else
the first record of the same global batch after it (r+1, r+2, ... wrapping round) that
does, cropped and flipped by row r's own draws. Only the global batch's undecoded records
(file names, or encoded bytes) and the row's index decide a row, so any K and W give the
same rows, positions have no gaps (a resume starts at steps * B*K) and a row is counted as
skipped when its own record failed (the 4th element, `failed`: how many candidates failed
before the row's image). Why not an index of the unreadable records made before training:
finding them is a full decode of the split (an epoch of decoding for ImageNet) before the
first step, a file that must match the data it was made from, and a JPEG whose crop window
decodes while the whole image does not would be judged by another decode than the one
training runs; the per-row rule needs none of that. Its cost: an unreadable image's row
repeats another example of its batch.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.data import DatasetError
from owt_tf.data.preprocess import (DeviceBatch, TrainDraws, decode_train_crop, eval_pixels,
                                     eval_preprocess, finish_images, train_draw_batches)

STATS_SAMPLE = 1000  # training images behind a dataset's own mean and spread


class StreamDataset:
    """Images streamed and decoded by tf.data, AlexNet-augmented for training.

    Subclasses provide `_train_records(seed, skip)` (endless, shuffled (record, label) pairs,
    the first `skip` dropped), `_ordered_train_records()` (one pass, stored order),
    `_encoded_image(record)` -> the encoded image bytes, `_val_records()` (one pass), plus
    num_classes, num_train and name. Records are file names or encoded bytes: nothing
    skipped is ever decoded."""

    name: str
    num_classes: int
    num_train: int
    image_shape: Tuple[int, int, int]
    # ImageNet's mean pixel and spread: ImageNet's normalisation, and that of runs written
    # before datasets had their own (input_stats.json).
    mean: Tuple[float, ...] = (123.68, 116.78, 103.94)
    std: Tuple[float, ...] = (58.4, 57.1, 57.4)
    # AUGMENTATIONS less 'auto', or 'flip' (face sets); load_dataset resolves it
    augment: str = "alexnet"

    @property
    def trains_with_flips(self) -> bool:
        return self.augment == "alexnet"

    @property
    def has_own_statistics(self) -> bool:
        """Whether it is normalised by its own statistics (all but ImageNet)."""
        return self.name != "tfds:imagenet2012"

    def use_statistics(self, mean: Sequence[float], std: Sequence[float]) -> None:
        """Normalise training, evaluation and export inputs with this mean and spread."""
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)

    def input_statistics(self, sample: int = STATS_SAMPLE) -> Tuple[tuple, tuple, int]:
        """(per-channel mean, std, images used) of the network's input pixels (the eval
        view, 0..255) over up to `sample` training images spread over the split."""
        size = self.image_shape[:2]
        total, total_sq, count, images = 0.0, 0.0, 0, 0
        for image, _ in self._sampled_train_records(sample).map(self._decode).ignore_errors():
            pixels = eval_pixels(image[None], size)[0].numpy().astype(np.float64)
            flat = pixels.reshape(-1, pixels.shape[-1])
            total, total_sq = total + flat.sum(0), total_sq + (flat ** 2).sum(0)
            count, images = count + len(flat), images + 1
        if not images:
            raise DatasetError(f"{self.name}: none of the {min(sample, self.num_train)} sampled "
                               f"training images ({self.num_train} in all) could be decoded")
        mean = total / count
        std = np.sqrt(np.maximum(total_sq / count - mean ** 2, 0.0))
        std = np.where(std > 0, std, 1.0)  # a constant channel stays finite
        return tuple(float(m) for m in mean), tuple(float(s) for s in std), images

    def _sampled_train_records(self, sample: int) -> tf.data.Dataset:
        return self._ordered_train_records().take(sample)

    def label_names(self) -> Tuple[str, ...]:
        """Class names by label: the folder names, TFDS' label names, else the numbers."""
        names = getattr(self, "class_names", None)
        if names is None and getattr(self, "builder", None) is not None:
            names = self.builder.info.features["label"].names
        return tuple(names) if names else tuple(str(i) for i in range(self.num_classes))

    def _channels(self):
        c = self.image_shape[-1]
        self.mean, self.std = tuple(self.mean[:c]), tuple(self.std[:c])

    def train(self, global_batch: int, seed: int, start: int = 0) -> tf.data.Dataset:
        """Endless augmented global batches of (images, labels, positions), from stream
        position `start` on: `train_rows` with every row, the failure counts left out."""
        rows = self.train_rows(global_batch, seed, start, (0, global_batch))
        return rows.map(lambda images, labels, positions, failed: (images, labels, positions))

    def train_rows(self, global_batch: int, seed: int, start: int = 0,
                   rows: Optional[Tuple[int, int]] = None,
                   on_device: bool = False) -> tf.data.Dataset:
        """Rows first ... first+count-1 (`rows`, default all) of each endless augmented
        global batch as (images, labels, positions, failed), from stream position `start`
        on. Only those rows' records are read and decoded (a record that does not decode is
        replaced by the next one of its global batch that does: the module docstring);
        `failed` counts the candidates that failed before each row's image (`global_batch`:
        none of the global batch decoded, the row is zeros). Each example decodes only its
        crop window (JPEG) and is resized to the input size as uint8 (augment 'none': the
        eval view, float32 pixels); flip, lighting and normalisation run once per batch,
        here, or (`on_device`, what the CLI reads) in the step on its device: the images
        are then DeviceBatch(crops, flips, lighting), which preprocess.finish_images turns
        into the same float32 input."""
        if self.num_train < global_batch:
            raise DatasetError(f"{self.name}: {self.num_train} training images is fewer than "
                               f"one global batch of {global_batch}")
        first, count = rows or (0, global_batch)
        if first < 0 or count < 1 or first + count > global_batch:
            raise DatasetError(f"rows {first}..{first + count - 1} are not rows of a global "
                               f"batch of {global_batch}")
        self._check_readable()
        # Whole global batches of undecoded records (a row's substitutes come from its
        # batch), with their positions and augmentation draws (from the seed and the
        # position: repeatable), each made a batch at a time rather than per example.
        positions = tf.data.Dataset.counter().map(
            lambda i: start + i * global_batch + tf.range(global_batch, dtype=tf.int64))
        batches = tf.data.Dataset.zip((positions,
                                       self._train_record_batches(seed, start, global_batch),
                                       train_draw_batches(seed, start, global_batch)))

        def own_rows(positions, records, draws):
            # Every row's own record decoded in one function (no dataset per row), unless
            # one fails to: then the batch is made again row by row, with substitutes.
            batch = tf.data.Dataset.from_tensors((positions, records, draws))
            at_once = batch.map(lambda *batch: self._own_rows_at_once(first, count, *batch))
            # flat_map: the row-by-row pipeline is built only for a batch that needs it
            row_by_row = batch.flat_map(
                lambda *batch: self._own_rows(first, count, *batch, global_batch))
            return at_once.ignore_errors().concatenate(row_by_row).take(1)

        # One element per global batch (its rows assembled), in order, batches in parallel.
        ds = batches.interleave(own_rows, cycle_length=tf.data.AUTOTUNE, block_length=1,
                                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        finish = functools.partial(self._augment_batch, on_device=on_device)
        return ds.map(finish, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(2)

    def _train_record_batches(self, seed: int, skip: int, batch: int) -> tf.data.Dataset:
        """`_train_records(seed, skip)` in whole batches of `batch` records."""
        return self._train_records(seed, skip).batch(batch, drop_remainder=True)

    def _own_rows_at_once(self, first, count, positions, records, draws):
        """Rows first ... first+count-1 of one global batch as (crops, labels, positions,
        flips, lighting, failed), every row from its own record (`_common_train_crop`) in
        one loop; an error if any row's record fails (`_own_rows` then makes the batch)."""
        files, labels = records
        own = slice(first, first + count)
        rows = (positions[own], files[own], labels[own], draws.corner[own], draws.flip[own],
                draws.lighting[own])

        def crop(row):
            position, record, label, corner, flip, lighting = row
            return self._common_train_crop(position, (record, label),
                                           TrainDraws(corner, flip, lighting))

        pixels = tf.float32 if self.augment == "none" else tf.uint8
        signature = (tf.TensorSpec(self.image_shape, pixels), tf.TensorSpec([], tf.int32),
                     tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.bool),
                     tf.TensorSpec([3], tf.float32))
        crops = tf.map_fn(crop, rows, fn_output_signature=signature)
        return (*crops, tf.zeros([count], tf.int64))

    def _common_train_crop(self, position, item, draws):
        """`_train_crop` of a record as most are (a subclass may skip a check here that
        _train_crop makes: an error, not another crop, where that check would matter)."""
        return self._train_crop(position, item, draws)

    def _own_rows(self, first, count, positions, records, draws,
                  global_batch: int) -> tf.data.Dataset:
        """Rows first ... first+count-1 of one global batch, as a dataset of exactly one
        (crops, labels, positions, flips, lighting, failed) with `count` rows, made row by
        row: a batch gets here only when `_own_rows_at_once` failed. Every row's own record
        is decoded in one parallel map; only rows whose own record failed take the per-row
        path of substitutes (`_row_image`). A nested dataset per row costs about a third of
        decoding its crop, so the rows that decode build none."""
        files, labels = records
        rows = tf.range(first, first + count, dtype=tf.int64)
        own = slice(first, first + count)

        def own_record(row, position, record, label, corner, flip, lighting):
            crop, label, position, flip, lighting = self._train_crop(
                position, (record, label), TrainDraws(corner, flip, lighting))
            return row, crop, label, position, flip, lighting, tf.constant(0, tf.int64)

        # Each row's inputs sliced once per batch, not indexed in the per-row function (six
        # gathers a row: an eighth of a 112x112 face's decode).
        decoded = tf.data.Dataset.from_tensor_slices(
            (rows, positions[own], files[own], labels[own], draws.corner[own], draws.flip[own],
             draws.lighting[own])).map(own_record, num_parallel_calls=tf.data.AUTOTUNE,
                                       deterministic=True)
        decoded = decoded.ignore_errors(log_warning=True)
        # Exactly one batch of the rows that decoded (an empty one when none did).
        empty = self._empty_row(-1, positions[0], self._row_draws(draws, 0), 0)
        none = tf.data.Dataset.from_tensors(tuple(tf.expand_dims(t, 0)[:0] for t in empty))
        survivors = decoded.batch(count).concatenate(none).take(1)

        def with_substitutes(*kept):
            present = tf.reduce_any(tf.equal(rows[:, None], kept[0][None, :]), axis=1)
            missing = tf.boolean_mask(rows, tf.logical_not(present))
            substitutes = tf.data.Dataset.from_tensor_slices(missing).flat_map(
                lambda row: self._row_image(row, positions, records, draws, global_batch))
            nothing = tf.data.Dataset.from_tensors(tuple(t[:0] for t in kept))
            extra = substitutes.batch(count).concatenate(nothing).take(1)
            return extra.map(lambda *extra: self._merged_in_row_order(kept, extra))

        return survivors.flat_map(with_substitutes)

    @staticmethod
    def _merged_in_row_order(kept, extra):
        """The rows that decoded their own record and the substituted ones, in row order,
        the row column dropped (no copy when nothing was substituted)."""
        def merge():
            rows = tf.concat([kept[0], extra[0]], 0)
            order = tf.argsort(rows)
            return tuple(tf.gather(tf.concat([k, e], 0), order)
                         for k, e in zip(kept[1:], extra[1:]))

        return tf.cond(tf.size(extra[0]) > 0, merge, lambda: kept[1:])

    @staticmethod
    def _row_draws(draws, row) -> TrainDraws:
        return TrainDraws(draws.corner[row], draws.flip[row], draws.lighting[row])

    def _empty_row(self, row, position, draws: TrainDraws, failed):
        crop = tf.zeros(self.image_shape, tf.float32 if self.augment == "none" else tf.uint8)
        return (tf.cast(row, tf.int64), crop, tf.constant(0, tf.int32), position, draws.flip,
                draws.lighting, tf.cast(failed, tf.int64))

    def _row_image(self, row, positions, records, draws, global_batch: int) -> tf.data.Dataset:
        """A row whose own record did not decode, as a dataset of exactly one (row, crop,
        label, position, flip, lighting, failed): the next record of the batch that decodes
        (tried one at a time, lazily), else zeros with failed = global_batch."""
        files, labels = records
        position = positions[row]
        own = self._row_draws(draws, row)

        def candidate(tried):
            i = (row + tried) % global_batch
            crop, label, _, flip, lighting = self._train_crop(
                position, (files[i], labels[i]), own)
            return row, crop, label, position, flip, lighting, tried

        def nothing_decodes(_):
            return self._empty_row(row, position, own, global_batch)

        tries = tf.data.Dataset.range(1, global_batch).map(candidate).ignore_errors(log_warning=True)
        return tries.concatenate(tf.data.Dataset.range(1).map(nothing_decodes)).take(1)

    def _train_crop(self, position, item, draws):
        """One record -> (uint8 crop of the input size, label, position, flip, lighting);
        with augment 'none', the image's eval view (float32 pixels) instead of a crop."""
        record, label = item
        if self.augment == "none":
            image, label = self._decode(record, label)
            crop = eval_pixels(image[None], self.image_shape[:2])[0]
        else:
            crop = decode_train_crop(self._encoded_image(record), self.image_shape[:2],
                                     self.image_shape[-1], draws.corner)
        crop = tf.ensure_shape(crop, self.image_shape)
        return crop, tf.cast(label, tf.int32), position, draws.flip, draws.lighting

    def _augment_batch(self, crops, labels, positions, flips, lighting, failed, on_device=False):
        if self.augment in ("none", "crop"):  # the same draws, flip and lighting left out
            flips, lighting = tf.zeros_like(flips), tf.zeros_like(lighting)
        elif self.augment == "flip":  # the mirror alone (face sets: arcface_torch's)
            lighting = tf.zeros_like(lighting)
        images = DeviceBatch(crops, flips, lighting)
        if not on_device:
            images = finish_images(images, self.mean, self.std)
        return images, labels, positions, failed

    def _decode(self, record, label):
        """(record, label) -> (whole uint8 image [H, W, C], int32 label)."""
        c = self.image_shape[-1]
        image = tf.io.decode_image(self._encoded_image(record), channels=c,
                                   expand_animations=False)
        image.set_shape([None, None, c])
        return image, tf.cast(label, tf.int32)

    def at_input_size(self, image: tf.Tensor) -> tf.Tensor:
        """uint8 [H, W, C] -> uint8 at the input size: as it is when it already is, else
        the eval view (eval_pixels) rounded (bilinear weights are convex: within 0..255)."""
        h, w = self.image_shape[:2]
        shape = tf.shape(image)
        same = tf.logical_and(tf.equal(shape[0], h), tf.equal(shape[1], w))

        def resized():
            pixels = eval_pixels(image[None], (h, w))[0]
            return tf.cast(tf.round(pixels), tf.uint8)

        return tf.cond(same, lambda: image, resized)

    def stored_rows(self, split: str) -> Tuple[tf.data.Dataset, int]:
        """One pass over `split` ('train' or 'validation') as undecoded (record, label)
        pairs in stored order, and how many there are; `decode_at_input_size` decodes one."""
        if split == "train":
            return self._ordered_train_records(), self.num_train
        records = self._val_records()
        known = int(records.cardinality())
        return records, known if known >= 0 else int(records.reduce(0, lambda n, _: n + 1))

    def decode_at_input_size(self, record, label):
        """(record, label) -> (uint8 image at the input size, int32 label)."""
        image, label = self._decode(record, label)
        return tf.ensure_shape(self.at_input_size(image), self.image_shape), label

    def decoded_train_records(self, seed: int) -> tf.data.Dataset:
        """The training records in training order, each image decoded whole and nothing else
        (the benchmark's baseline for the training pipeline)."""
        return self._train_records(seed, 0).map(self._decode, num_parallel_calls=tf.data.AUTOTUNE,
                                                deterministic=True)

    def _readable(self) -> tf.data.Dataset:
        """One pass over the training records in stored order (no shuffle buffer to fill),
        decoded, unreadable ones dropped."""
        return self._ordered_train_records().map(self._decode).ignore_errors()

    def _check_readable(self) -> None:
        """Fails at once when no training image decodes (the endless stream would spin on)."""
        for _ in self._readable().take(1):
            return
        raise DatasetError(f"{self.name}: none of the {self.num_train} training images could be "
                           "decoded")

    def validation(self, global_batch: int) -> tf.data.Dataset:
        """One pass, center crops, in whole global batches: the last one padded with zeros
        labelled -1, as is the row of an image that cannot be decoded (left out of every
        metric, as if it were not there). `validation_rows` with every row."""
        return self.validation_rows(global_batch)

    def validation_rows(self, global_batch: int,
                        rows: Optional[Tuple[int, int]] = None) -> tf.data.Dataset:
        """Rows first ... first+count-1 (`rows`, default all) of each validation global
        batch as (images, labels): only those rows' records are decoded. A row past the end
        of the split or whose image does not decode is zeros labelled -1, so that a row's
        content depends on its own record alone and every worker's rows agree."""
        first, count = rows or (0, global_batch)
        h, w, c = self.image_shape

        def center(row, image, label):
            return row, eval_preprocess(image[None], (h, w), self.mean, self.std)[0], label

        def own_rows(records, labels):
            end = tf.clip_by_value(tf.shape(labels, tf.int64)[0], first, first + count)
            present = tf.range(tf.constant(first, tf.int64), end)

            def decode_row(row):
                return center(row, *self._decode(records[row], labels[row]))

            decoded = tf.data.Dataset.from_tensor_slices(present).map(
                decode_row, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            decoded = decoded.ignore_errors(log_warning=True).batch(count)
            none = tf.data.Dataset.from_tensors((tf.zeros([0], tf.int64), tf.zeros([0, h, w, c]),
                                                 tf.zeros([0], tf.int32)))
            return decoded.concatenate(none).take(1).map(in_place)

        def in_place(decoded_rows, images, labels):
            at = (decoded_rows - first)[:, None]
            images = tf.scatter_nd(at, images, [count, h, w, c])
            labels = tf.scatter_nd(at, labels + 1, [count]) - 1
            return images, labels

        batches = self._val_records().batch(global_batch)
        return batches.interleave(own_rows, cycle_length=tf.data.AUTOTUNE, block_length=1,
                                  num_parallel_calls=tf.data.AUTOTUNE,
                                  deterministic=True).prefetch(2)

    def sample_images(self, count: int = 8) -> np.ndarray:
        size = self.image_shape[:2]
        return np.stack([tf.cast(tf.image.resize(img, size), tf.uint8).numpy()
                         for img, _ in self._readable().take(count)])
