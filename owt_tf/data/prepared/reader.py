"""A prepared set (`prepared:DIR`): what `python -m owt_tf.prepare` writes, read for training.

The paper's step, done once: every image rescaled so that its shorter side is 256 and its
central 256x256 cut out (or the whole rescaled image kept, `--keep-aspect`), stored as JPEG
in TFRecord shards of `tf.train.Example`s {"image": JPEG bytes, "label": int64, "source":
the original's name (its path below the folder, its record key)}, with a manifest
(`manifest.json`): format and version, the source and the settings, the classes in label
order, per-split counts and shards (records and bytes of each), the per-channel mean and
spread of the stored training pixels, and the files that could not be read.
Training then decodes a 224x224 window of a 256x256 JPEG instead of most of a photo.

This module owns the manifest's format (`read_manifest`: a missing, damaged or older one
is one DatasetError line naming the fix) and the reader, `PreparedDataset`: a StreamDataset
whose records are the stored JPEG bytes, so own rows, positions, resumes and skipped images
work as for every streamed set. Training reads the shards as TFDS sets are read (shards in
an order drawn from (seed, epoch), consecutive blocks of records shuffled, a resume computed
rather than read up to); the records were shuffled once when written. The writer is
owt_tf.data.prepared.writer.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from owt_tf.data import DatasetError
from owt_tf.data.preprocess import normalize
from owt_tf.data.stream import StreamDataset

MANIFEST = "manifest.json"
FORMAT = "owt_tf.prepared"
FORMAT_VERSION = 1
SPLITS = ("train", "validation")
STATE_FILE = "prepare_state.json"  # an unfinished prepare's plan (the writer's)
PREPARE = "python -m owt_tf.prepare"
FEATURES = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}


def shard_name(split: str, index: int, shards: int) -> str:
    return f"{split}-{index:05d}-of-{shards:05d}.tfrecord"


def read_manifest(directory: str) -> dict:
    """The checked manifest of the prepared set in `directory`: every shard it lists is
    there with the bytes it lists. Anything else is a DatasetError of one line naming the
    fix (prepare again, or which file is wrong)."""
    name = f"prepared:{directory}"
    if not os.path.isdir(directory):
        raise DatasetError(f"{name}: no such directory")
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise DatasetError(f"{name}: {_missing_manifest(directory)}")
    again = _prepare_again(directory)
    try:
        with open(path) as f:
            text = f.read()
        manifest = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        source = re.search(r'"source": "([^"]+)"', text if "text" in locals() else "")
        again = _prepare_again(directory, source.group(1) if source else None)
        raise DatasetError(f"{path} is damaged ({str(err).splitlines()[0]}): {again}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetError(f"{path} is not the manifest of an owt_tf prepared set: {again}")
    if isinstance(manifest.get("source"), str):
        again = _prepare_again(directory, manifest["source"])
    _check_version(path, manifest.get("format_version"), again)
    problem = _structure_problem(manifest)
    if problem:
        raise DatasetError(f"{path} is damaged ({problem}): {again}")
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            _check_shard(directory, shard, again)
    return manifest


def _prepare_again(directory: str, source: Optional[str] = None) -> str:
    source = source or "SOURCE"
    return (f"prepare it again (delete {directory} first, or use another --out): "
            f"{PREPARE} {source} --out {directory}")


def _missing_manifest(directory: str) -> str:
    state = os.path.join(directory, STATE_FILE)
    if os.path.isfile(state):
        try:
            with open(state) as f:
                source = json.load(f)["source"]
        except (OSError, ValueError, KeyError, TypeError):
            source = "SOURCE"
        return (f"not finished preparing (no {MANIFEST} yet); run the same prepare again to "
                f"complete it: {PREPARE} {source} --out {directory}")
    return (f"no {MANIFEST}: not a prepared set; make one with {PREPARE} "
            f"folder:PATH|tfds:NAME|insightface:PATH --out {directory}")


def _check_version(path: str, version, again: str) -> None:
    if not isinstance(version, int) or version < FORMAT_VERSION:
        raise DatasetError(f"{path} is of an older format (version {version}; this owt_tf "
                           f"reads version {FORMAT_VERSION}): {again}")
    if version > FORMAT_VERSION:
        raise DatasetError(f"{path} was written by a newer owt_tf (format version {version}; "
                           f"this one reads {FORMAT_VERSION}): update owt_tf, or {again}")


def _structure_problem(manifest: dict) -> Optional[str]:
    """What is missing or malformed in a manifest of the current version, or None."""
    for key, kind in (("source", str), ("settings", dict), ("classes", list),
                      ("splits", dict), ("mean", list), ("std", list), ("bad_files", list)):
        if not isinstance(manifest.get(key), kind):
            return f"no {key!r} {kind.__name__}"
    if not manifest["classes"]:
        return "no classes"
    if len(manifest["mean"]) != 3 or len(manifest["std"]) != 3:
        return "'mean' and 'std' need three channels each"
    for split in SPLITS:
        entry = manifest["splits"].get(split)
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
            return f"no shard list for {split!r}"
        shards = entry["shards"]
        if not all(isinstance(s, dict) and isinstance(s.get("file"), str)
                   and isinstance(s.get("records"), int) and isinstance(s.get("bytes"), int)
                   for s in shards):
            return f"a {split} shard without file, records and bytes"
        if entry.get("count") != sum(s["records"] for s in shards):
            return f"{split} count {entry.get('count')} is not the sum of its shards' records"
    if not manifest["splits"]["train"]["count"]:
        return "no training images"
    return None


def _check_shard(directory: str, shard: dict, again: str) -> None:
    path = os.path.join(directory, shard["file"])
    if not os.path.isfile(path):
        raise DatasetError(f"{path} is missing (listed in {MANIFEST}): {again}")
    size = os.path.getsize(path)
    if size != shard["bytes"]:
        raise DatasetError(f"{path} has {size} bytes, {MANIFEST} says {shard['bytes']}: the "
                           f"file is damaged; {again}")


def parse_records(serialized: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Serialized examples (a scalar or a vector) -> (JPEG bytes, int32 label)."""
    parse = tf.io.parse_example if serialized.shape.rank else tf.io.parse_single_example
    example = parse(serialized, FEATURES)
    return example["image"], tf.cast(example["label"], tf.int32)


class PreparedDataset(StreamDataset):
    """`prepared:DIR`: a set written by `python -m owt_tf.prepare` (module docstring),
    normalised by the manifest's mean and spread of its stored training pixels."""

    shuffle_block = 10_000  # records shuffled together, as TfdsDataset's blocks

    def __init__(self, directory: str, image_shape: Tuple[int, int, int]):
        self.name = f"prepared:{directory}"
        self.directory = directory
        self.image_shape = tuple(image_shape)
        self.manifest = read_manifest(directory)
        self.class_names = list(self.manifest["classes"])
        self.num_classes = len(self.class_names)
        splits = self.manifest["splits"]
        self.shards: Dict[str, List[Tuple[str, int]]] = {
            split: [(os.path.join(directory, s["file"]), s["records"])
                    for s in splits[split]["shards"] if s["records"]] for split in SPLITS}
        self.num_train = splits["train"]["count"]
        self.num_validation = splits["validation"]["count"]
        self.mean, self.std = tuple(self.manifest["mean"]), tuple(self.manifest["std"])
        self._channels()

    def input_statistics(self, sample: int = 0) -> Tuple[tuple, tuple, int]:
        """The manifest's mean and spread (of every stored training pixel): nothing to
        sample."""
        c = self.image_shape[-1]
        return (tuple(self.manifest["mean"][:c]), tuple(self.manifest["std"][:c]),
                self.num_train)

    def _encoded_image(self, encoded):
        return encoded

    def _records(self, split: str) -> tf.data.Dataset:
        files = [path for path, _ in self.shards[split]]
        if not files:  # a split whose images all failed, or an empty one
            return tf.data.Dataset.from_tensor_slices((tf.zeros([0], tf.string),
                                                       tf.zeros([0], tf.int32)))
        return tf.data.TFRecordDataset(files).map(parse_records,
                                                  num_parallel_calls=tf.data.AUTOTUNE)

    def _ordered_train_records(self) -> tf.data.Dataset:
        return self._records("train")

    def _val_records(self) -> tf.data.Dataset:
        return self._records("validation")

    def _train_records(self, seed: int, skip: int) -> tf.data.Dataset:
        """Epoch after epoch: the train shards in an order drawn from (seed, epoch), read in
        turn, shuffled in consecutive blocks of `shuffle_block` records (each block's order
        drawn from (seed, its number)), parsed a block at a time. A resume opens the shard
        its block starts in and skips inside it, as TfdsDataset._train_records does."""
        files = tf.constant([path for path, _ in self.shards["train"]])
        lengths = tf.constant([count for _, count in self.shards["train"]], tf.int64)
        block = min(self.num_train, self.shuffle_block)
        blocks_per_epoch = -(-self.num_train // block)
        first_epoch, offset = divmod(skip, self.num_train)

        def epoch_blocks(epoch):
            order = tf.random.experimental.stateless_shuffle(
                tf.range(tf.size(files)), seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
            start = tf.constant(offset // block * block, tf.int64) * tf.cast(
                tf.equal(epoch, first_epoch), tf.int64)  # the first epoch resumes at its block
            counts = tf.gather(lengths, order)
            begins = tf.cumsum(counts, exclusive=True)
            skipped = tf.clip_by_value(start - begins, 0, counts)
            shards = tf.data.Dataset.from_tensor_slices(
                (tf.gather(files, order), skipped, counts - skipped))
            records = shards.filter(lambda f, first, count: count > 0).flat_map(
                lambda f, first, count: tf.data.TFRecordDataset(f).skip(first).take(count))
            numbers = tf.data.Dataset.counter(epoch * blocks_per_epoch + start // block)
            return tf.data.Dataset.zip((records.batch(block), numbers)).map(shuffled_block)

        def shuffled_block(serialized, number):
            order = tf.random.experimental.stateless_shuffle(
                tf.range(tf.shape(serialized)[0]),
                seed=tf.stack([tf.constant(seed, tf.int64), number]))
            images, labels = parse_records(tf.gather(serialized, order))
            return images, labels

        # prefetch: the next block is read while this one is used, not when it runs out.
        blocks = tf.data.Dataset.counter(first_epoch).flat_map(epoch_blocks).prefetch(1)
        return blocks.unbatch().skip(offset % block)

    def _train_crop(self, position, item, draws):
        """When the stored images are at the input's scale (shorter side 256 for a 224
        input: `crop_window`'s windows are then the input's size, at whole-pixel offsets),
        the window is computed in a few ops and decoded, and nothing else: no resize (of a
        224x224 crop to 224x224: half as much again as decoding it), no tf.cond (a function
        call per image). Other inputs: StreamDataset's way."""
        if self.augment == "none" or not self._at_input_scale():
            return super()._train_crop(position, item, draws)
        encoded, label = item
        size = tf.constant(self.image_shape[:2], tf.int32)
        side = self.manifest["settings"]["side"]
        if self.manifest["settings"]["crop"] == "center":
            shape = tf.constant([side, side], tf.int32)
        else:
            shape = tf.io.extract_jpeg_shape(encoded)[:2]
        room = shape - size + 1  # crop_window's offsets, per_pixel being 1
        offset = tf.minimum(tf.cast(draws.corner * tf.cast(room, tf.float32), tf.int32), room - 1)
        # libjpeg's fast integer IDCT: 5-10 % more crops/s (decoding is most of the
        # pipeline's work); its error, a level or two on some pixels, is well below the
        # lighting noise added next. Evaluation views decode accurately.
        crop = tf.image.decode_and_crop_jpeg(encoded, tf.concat([offset, size], 0),
                                             channels=self.image_shape[-1],
                                             dct_method="INTEGER_FAST")
        crop = tf.ensure_shape(crop, self.image_shape)
        return crop, tf.cast(label, tf.int32), position, draws.flip, draws.lighting

    def _at_input_scale(self) -> bool:
        """Whether crop_window maps the stored images 1:1 (shorter side h*256/224)."""
        h, w = self.image_shape[:2]
        side = self.manifest["settings"].get("side")
        return isinstance(side, int) and side * 224 == h * 256 and w <= side

    def validation_ten_crops(self, batch: int, normalized: bool = True) -> tf.data.Dataset:
        """One pass over the validation split as (views [N, 10, h, w, C] normalised float32,
        labels [N]): AlexNet's ten crops (`ten_crop_views`), batches of `batch`; an image
        that does not decode is left out (logged). `normalized` False: the views' float32
        pixels (0..255), for a predictor that normalises itself."""
        size = self.image_shape[:2]

        def views(encoded, label):
            image, label = self._decode(encoded, label)
            pixels = ten_crop_views(image, size)
            return (normalize(pixels, self.mean, self.std) if normalized else pixels), label

        decoded = self._val_records().map(views, num_parallel_calls=tf.data.AUTOTUNE,
                                          deterministic=True)
        return decoded.ignore_errors(log_warning=True).batch(batch).prefetch(2)


def ten_crop_views(image: tf.Tensor, size: Tuple[int, int]) -> tf.Tensor:
    """AlexNet 2012's ten views of one image [H, W, C] as float32 pixels [10, h, w, C]: its
    four corner crops of `size`, the center crop, then their mirror images, in the order of
    owt_tf.training.evaluation.ten_crops, from the image resized to shorter side
    size*256/224 (left as it is when it already is: a 256-pixel prepared image and a 224
    input)."""
    h, w = size
    short = int(round(h * 256 / 224))
    shape = tf.shape(image)[:2]
    scale = short / tf.cast(tf.reduce_min(shape), tf.float32)
    target = tf.maximum(tf.cast(tf.round(tf.cast(shape, tf.float32) * scale), tf.int32), [h, w])
    pixels = tf.cast(image, tf.float32)
    pixels = tf.cond(tf.reduce_all(tf.equal(target, shape)), lambda: pixels,
                     lambda: tf.image.resize(pixels, target, method="bilinear"))
    big_h, big_w = target[0], target[1]
    corners = [(0, 0), (0, big_w - w), (big_h - h, 0), (big_h - h, big_w - w),
               ((big_h - h) // 2, (big_w - w) // 2)]
    crops = tf.stack([pixels[t:t + h, l:l + w] for t, l in corners])
    return tf.concat([crops, tf.reverse(crops, axis=[2])], 0)

