"""Writing a prepared set (`python -m owt_tf.prepare`): the rescaling, the shards and
their done marks, resuming, and the manifest (its format and the reader:
owt_tf.data.prepared.reader; what is read: owt_tf.data.prepared.sources).

Every image is decoded, resized (bilinear, antialiased) so that its shorter side is
`side`, center-cropped to side x side unless `keep_aspect`, and stored as JPEG of
`quality`. The work is one tf.data pipeline whose parallel map runs the decode, resize and
encode kernels on every core of this process; only the records' framing is Python.

Item i of a split goes to shard i // shard_size, whatever happens to the other items, so
a shard's bytes depend on the source and the settings alone. A shard is written to a
temporary file, renamed, and then marked done (`progress/<shard>.json`: its records,
bytes, pixel sums, class counts and unreadable items); a prepare that was stopped
rewrites only the shards without a mark, and ends with the same bytes as one that was
not. An item that does not decode (corrupt, truncated, not an image) is left out of its
shard and listed in the manifest; the prepare goes on.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from owt_tf.data import DatasetError
from owt_tf.data.prepared.reader import (FORMAT, FORMAT_VERSION, MANIFEST, SPLITS, STATE_FILE,
                                         read_manifest, shard_name)
from owt_tf.data.prepared.sources import Source, SplitSource, open_source

PROGRESS_DIR = "progress"


@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    """How images are stored: shorter side `side`, the central side x side crop unless
    `keep_aspect`, JPEG `quality`, `shard_size` images per shard."""

    side: int = 256
    keep_aspect: bool = False
    quality: int = 90
    shard_size: int = 1024

    def as_dict(self) -> dict:
        return {"side": self.side, "crop": "keep-aspect" if self.keep_aspect else "center",
                "quality": self.quality, "shard_size": self.shard_size}


@dataclasses.dataclass
class PrepareResult:
    manifest: dict
    already_done: bool  # the directory held this set complete: nothing was written
    resumed_images: int  # items found done by an earlier, stopped prepare


# ------------------------------------------------------------------------------ rescaling


def rescaled_jpeg(encoded: tf.Tensor, settings: PrepareSettings):
    """Encoded image bytes -> (JPEG bytes of the stored image, its per-channel pixel sums
    and sums of squares (int64 [3]), its pixel count). A large JPEG is decoded at 1/2, 1/4
    or 1/8 scale (libjpeg's DCT scaling) when that still leaves a shorter side >= side."""
    side = settings.side
    image = _decoded(encoded, side)
    shape = tf.shape(image)[:2]
    scale = side / tf.cast(tf.reduce_min(shape), tf.float32)
    size = tf.maximum(tf.cast(tf.round(tf.cast(shape, tf.float32) * scale), tf.int32), side)
    # Antialiased bilinear (a triangle filter), not cuda-convnet2's area averaging, which
    # costs 2.5x less here but keeps more pixel noise: its JPEGs were 8 % larger on the
    # benchmark's photos and training decoded them 5 % slower (docs/data.md).
    resized = tf.image.resize(image, size, method="bilinear", antialias=True)
    if not settings.keep_aspect:
        top, left = (size[0] - side) // 2, (size[1] - side) // 2
        resized = resized[top:top + side, left:left + side]
    pixels = tf.cast(tf.round(tf.clip_by_value(resized, 0.0, 255.0)), tf.uint8)
    wide = tf.cast(pixels, tf.int64)
    sums = tf.reduce_sum(wide, axis=[0, 1])
    squares = tf.reduce_sum(wide * wide, axis=[0, 1])
    count = tf.cast(tf.shape(pixels)[0] * tf.shape(pixels)[1], tf.int64)
    # optimize_size: Huffman tables fitted to the image, 6 % fewer bytes to read, once per image
    jpeg = tf.io.encode_jpeg(pixels, quality=settings.quality, optimize_size=True)
    return jpeg, sums, squares, count


def _decoded(encoded: tf.Tensor, side: int) -> tf.Tensor:
    def jpeg():
        short = tf.reduce_min(tf.io.extract_jpeg_shape(encoded)[:2])
        # libjpeg's output at ratio r is ceil(shape / r): the largest r keeping side pixels
        branch = tf.add_n([tf.cast((short + r - 1) // r >= side, tf.int32) for r in (2, 4, 8)])
        # the accurate IDCT: TF's default (libjpeg's fast integer one) reads red and blue
        # about a level low on saturated colours (measured: -1.2, -1.3 on the tests' images)
        return tf.switch_case(branch, [
            lambda r=r: tf.io.decode_jpeg(encoded, channels=3, ratio=r,
                                          dct_method="INTEGER_ACCURATE") for r in (1, 2, 4, 8)])

    def other():
        return tf.io.decode_image(encoded, channels=3, expand_animations=False)

    image = tf.cond(tf.io.is_jpeg(encoded), jpeg, other)
    image.set_shape([None, None, 3])
    return tf.cast(image, tf.float32)


def _rescaled_items(source: SplitSource, start: int, settings: PrepareSettings,
                    batch: int = 64) -> tf.data.Dataset:
    """Batches of (index, label, JPEG, sums, squares, pixels) of items start, start+1, ...
    that decode, in order, rescaled on every core; the others are left out (gaps)."""
    indexed = tf.data.Dataset.zip((tf.data.Dataset.counter(start), source.items(start)))

    def rescale(index, item):
        jpeg, sums, squares, pixels = rescaled_jpeg(source.encoded(item[0]), settings)
        return index, item[1], jpeg, sums, squares, pixels

    done = indexed.map(rescale, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return done.ignore_errors().batch(batch).prefetch(2)


def _unreadable_reason(source: SplitSource, index: int, settings: PrepareSettings) -> str:
    if source.item_at is None:
        return "does not decode as an image"
    try:
        rescaled_jpeg(source.encoded(source.item_at(index)), settings)
    except (tf.errors.OpError, ValueError) as err:
        return (getattr(err, "message", None) or str(err)).splitlines()[0][:200]
    return "did not decode in the pipeline"


# -------------------------------------------------------------------------------- shards


def _example(jpeg: bytes, label: int, name: str) -> bytes:
    feature = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg])),
               "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
               "source": tf.train.Feature(bytes_list=tf.train.BytesList(value=[name.encode()]))}
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    return example.SerializeToString(deterministic=True)


def _write_json(path: str, value) -> None:
    """`value` as JSON at `path`, atomically (a stopped prepare leaves the old file or the
    new one, never half of one)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Shard:
    """One shard being written: items first ... end-1 of its split."""

    def __init__(self, out: str, split: str, index: int, shards: int, source: SplitSource,
                 settings: PrepareSettings, num_classes: int):
        self.out, self.split, self.index, self.source = out, split, index, source
        self.settings = settings
        self.file = shard_name(split, index, shards)
        self.first = index * settings.shard_size
        self.end = min(self.first + settings.shard_size, source.count)
        self.path = os.path.join(out, self.file)
        self.writer = tf.io.TFRecordWriter(self.path + ".tmp")
        self.written: List[int] = []
        self.sums, self.squares, self.pixels = np.zeros(3, np.int64), np.zeros(3, np.int64), 0
        self.class_counts = np.zeros(num_classes, np.int64)

    def add(self, index: int, label: int, jpeg: bytes, sums, squares, pixels) -> None:
        self.writer.write(_example(jpeg, label, self.source.name_of(index)))
        self.written.append(index)
        self.sums += sums
        self.squares += squares
        self.pixels += int(pixels)
        self.class_counts[label] += 1

    def finish(self) -> dict:
        """Closes the shard, puts it in place and marks it done; returns its mark."""
        self.writer.close()
        os.replace(self.path + ".tmp", self.path)
        missing = sorted(set(range(self.first, self.end)) - set(self.written))
        mark = {"file": self.file, "records": len(self.written),
                "bytes": os.path.getsize(self.path), "sum": self.sums.tolist(),
                "sum_sq": self.squares.tolist(), "pixels": self.pixels,
                "class_counts": self.class_counts.tolist(),
                "bad": [{"split": self.split, "file": self.source.name_of(i),
                         "error": _unreadable_reason(self.source, i, self.settings)}
                        for i in missing]}
        _write_json(_mark_path(self.out, self.file), mark)
        return mark


def _mark_path(out: str, file: str) -> str:
    return os.path.join(out, PROGRESS_DIR, file + ".json")


def _done_mark(out: str, file: str) -> Optional[dict]:
    """The mark of a shard written completely, else None (no mark, or the file is not the
    one marked)."""
    try:
        with open(_mark_path(out, file)) as f:
            mark = json.load(f)
        if os.path.getsize(os.path.join(out, file)) == mark["bytes"]:
            return mark
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


# ------------------------------------------------------------------------------- prepare


def prepare(source_name: str, out: str, settings: PrepareSettings = PrepareSettings(),
            data_dir: Optional[str] = None, verbose: int = 1) -> PrepareResult:
    """Writes the prepared set of `source_name` into `out` (module docstring), or finishes
    the one a stopped prepare left there; a directory holding this set complete is left
    as it is. Errors are DatasetErrors of one line. `verbose` 0: no progress bar."""
    source = open_source(source_name, data_dir)
    if not source.splits["train"].count:
        raise DatasetError(f"{source.name}: no training images")
    state = {"format": FORMAT, "format_version": FORMAT_VERSION, "source": source.name,
             "settings": settings.as_dict(), "fingerprint": source.fingerprint()}
    existing = _finished_set(out, state)
    if existing is not None:
        return PrepareResult(existing, True, 0)
    _claim(out, state)
    firsts = {split: _first_undone_shard(out, split, source.splits[split], settings)
              for split in SPLITS}
    starts = {split: min(firsts[split] * settings.shard_size, source.splits[split].count)
              for split in SPLITS}
    resumed = sum(starts.values())
    total = sum(source.splits[s].count for s in SPLITS)
    if resumed and verbose:
        print(f"{out}: resuming, {resumed} of {total} images already done")
    progress = _Progress(total - resumed, verbose)
    marks = {split: _write_split(out, split, source.splits[split], settings,
                                 len(source.class_names), firsts[split], progress)
             for split in SPLITS}
    progress.close()
    manifest = _manifest(source, state, marks)
    _write_json(os.path.join(out, MANIFEST), manifest)
    _remove_progress(out)
    return PrepareResult(manifest, False, resumed)


def _same_set(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("format_version", "source", "settings",
                                               "fingerprint"))


def _finished_set(out: str, state: dict) -> Optional[dict]:
    """The manifest when `out` holds this set complete; None when it holds nothing, or an
    unfinished prepare of this set. Anything else in `out` is a DatasetError."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise DatasetError(f"--out {out} is a file, not a directory")
    if os.path.isfile(os.path.join(out, MANIFEST)):
        manifest = read_manifest(out)
        if _same_set(manifest, state):
            _remove_progress(out)
            return manifest
        raise DatasetError(f"{out} already holds a set prepared from {manifest['source']} "
                           f"{_described(manifest, state)}; prepare into another --out, or "
                           "delete it first")
    state_path = os.path.join(out, STATE_FILE)
    if os.path.isfile(state_path):
        try:
            with open(state_path) as f:
                started = json.load(f)
        except (OSError, ValueError):
            started = {}
        if isinstance(started, dict) and _same_set(started, state):
            return None
        raise DatasetError(f"{out} holds an unfinished prepare of {started.get('source', '?')} "
                           f"{_described(started, state)}; delete it to start again, or use "
                           "another --out")
    if os.path.isdir(out) and os.listdir(out):
        raise DatasetError(f"{out} is not empty and holds no prepared set: give a new or empty "
                           "--out")
    return None


def _described(found: dict, wanted: dict) -> str:
    """How a set found in the directory differs from the one asked for."""
    if found.get("source") != wanted["source"]:
        return f"(not {wanted['source']})"
    if found.get("settings") != wanted["settings"]:
        return f"with settings {found.get('settings')} (not {wanted['settings']})"
    if found.get("format_version") != wanted["format_version"]:
        return f"in format version {found.get('format_version')}"
    return "whose files have changed since (other images or labels)"


def _claim(out: str, state: dict) -> None:
    os.makedirs(os.path.join(out, PROGRESS_DIR), exist_ok=True)
    if not os.path.isfile(os.path.join(out, STATE_FILE)):
        _write_json(os.path.join(out, STATE_FILE), state)


def _remove_progress(out: str) -> None:
    shutil.rmtree(os.path.join(out, PROGRESS_DIR), ignore_errors=True)
    if os.path.exists(os.path.join(out, STATE_FILE)):
        os.remove(os.path.join(out, STATE_FILE))


def _shard_count(source: SplitSource, settings: PrepareSettings) -> int:
    return -(-source.count // settings.shard_size)


def _first_undone_shard(out: str, split: str, source: SplitSource,
                        settings: PrepareSettings) -> int:
    """The first shard without a done mark (shards are written in order: the ones before
    it are done); the shard count when all are."""
    shards = _shard_count(source, settings)
    return next((k for k in range(shards)
                 if _done_mark(out, shard_name(split, k, shards)) is None), shards)


def _write_split(out: str, split: str, source: SplitSource, settings: PrepareSettings,
                 num_classes: int, first: int, progress: "_Progress") -> List[dict]:
    """Writes shards first, first+1, ... of `split`; the marks of all its shards."""
    shards = _shard_count(source, settings)
    marks = [_done_mark(out, shard_name(split, k, shards)) for k in range(first)]
    if first == shards:
        return marks

    def shard(k):
        return _Shard(out, split, k, shards, source, settings, num_classes)

    current = shard(first)
    start = first * settings.shard_size
    for batch in _rescaled_items(source, start, settings):
        rows = [t.numpy() for t in batch]
        for index, label, jpeg, sums, squares, pixels in zip(*rows):
            while index >= current.end:
                marks.append(current.finish())
                current = shard(current.index + 1)
            current.add(int(index), int(label), jpeg, sums, squares, pixels)
        progress.advance(int(rows[0][-1]) + 1 - start, len(rows[0]))
        start = int(rows[0][-1]) + 1
    while True:  # the last shards, whose last items did not decode, or none did
        marks.append(current.finish())
        if current.index + 1 == shards:
            break
        current = shard(current.index + 1)
    progress.advance(source.count - start, 0)
    return marks


class _Progress:
    """Keras' Progbar over the images still to prepare, with images/s and the count of
    unreadable ones; on a terminal it redraws its line, in a log it adds one every 30 s."""

    def __init__(self, target: int, verbose: int):
        self.done, self.unreadable, self.started = 0, 0, time.perf_counter()
        interval = 0.1 if sys.stdout.isatty() else 30.0
        self.bar = keras.utils.Progbar(max(target, 1), verbose=verbose if target else 0,
                                       interval=interval, unit_name="image",
                                       stateful_metrics=["img/s", "unreadable"])

    def advance(self, items: int, decoded: int) -> None:
        self.done += items
        self.unreadable += items - decoded
        self.bar.update(self.done, self._values(), finalize=False)

    def close(self) -> None:
        self.bar.update(self.bar.target, self._values(), finalize=True)

    def _values(self):
        rate = self.done / max(time.perf_counter() - self.started, 1e-9)
        # shown from the first unreadable image on: a column of zeros says nothing
        return [("img/s", rate)] + ([("unreadable", self.unreadable)] if self.unreadable else [])


def _manifest(source: Source, state: dict, marks: Dict[str, List[dict]]) -> dict:
    """The manifest from the shards' marks: counts, shards, statistics, unreadable files."""
    splits = {}
    for split in SPLITS:
        counts = np.zeros(len(source.class_names), np.int64)
        for mark in marks[split]:
            counts += np.asarray(mark["class_counts"], np.int64)
        splits[split] = {"count": int(counts.sum()), "class_counts": counts.tolist(),
                         "shards": [{k: m[k] for k in ("file", "records", "bytes")}
                                    for m in marks[split]]}
    train = marks["train"]
    pixels = sum(m["pixels"] for m in train)
    if not pixels:
        raise DatasetError(f"{source.name}: none of its {source.splits['train'].count} "
                           "training images could be read")
    # Whole-number sums: the same figures whatever order the shards were written in.
    sums = np.sum([m["sum"] for m in train], axis=0, dtype=np.float64)
    squares = np.sum([m["sum_sq"] for m in train], axis=0, dtype=np.float64)
    mean = sums / pixels
    std = np.sqrt(np.maximum(squares / pixels - mean ** 2, 0.0))
    std = np.where(std > 0, std, 1.0)  # a constant channel stays finite
    bad = [entry for split in SPLITS for mark in marks[split] for entry in mark["bad"]]
    return dict(state, classes=list(source.class_names), splits=splits,
                counts={"train": splits["train"]["count"],
                        "validation": splits["validation"]["count"], "unreadable": len(bad)},
                mean=mean.tolist(), std=std.tolist(), statistics_pixels=int(pixels),
                bad_files=bad)
