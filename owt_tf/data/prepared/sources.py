"""What a prepare reads (`folder:PATH`, `tfds:NAME`, `insightface:PATH`): each split as
items in the order they are written, their labels, how an item becomes encoded image bytes
(in graph, so that tf.data reads them on every core), and a listing the fingerprint of the
source is computed from (a resumed prepare must find the source as it was).

Training images are written in an order shuffled once from a fixed seed (a TFDS set keeps
the order TFDS shuffled it into when it wrote it), so that shards, and blocks of
consecutive records, mix the classes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

from owt_tf.data import DATASET_PREFIXES, PREPARE_SOURCES, DatasetError, dataset_prefix

ORDER_SEED = 20140421  # fixed: the order training images are written in never changes


@dataclasses.dataclass
class SplitSource:
    """One split of a source: `count` items; `items(start)`: (item, label) from item
    `start` on, in the order written; `encoded(item)`: its encoded image bytes (in graph);
    `name_of(i)`: item i's name in the source (a file's path below the folder, a record's
    key, a TFDS split index), stored with its image and listed if it cannot be read;
    `item_at(i)`: item i alone (None: no random access, unreadable items get no reason)."""

    count: int
    items: Callable[[int], tf.data.Dataset]
    encoded: Callable[[tf.Tensor], tf.Tensor]
    name_of: Callable[[int], str]
    listing: object  # what the fingerprint of the source is computed from
    item_at: Optional[Callable[[int], tf.Tensor]] = None


@dataclasses.dataclass
class Source:
    name: str  # as the manifest records it, paths absolute
    class_names: List[str]
    splits: Dict[str, SplitSource]

    def fingerprint(self) -> str:
        listing = {split: s.listing for split, s in self.splits.items()}
        text = json.dumps([self.name, self.class_names, listing], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def open_source(source: str, data_dir: Optional[str] = None) -> Source:
    """The source called `source`: folder:PATH, tfds:NAME or insightface:PATH."""
    kind, where = dataset_prefix(source)
    if not where or kind not in PREPARE_SOURCES:
        raise DatasetError(f"{source!r} is no source; give " + " or ".join(
            f"{k}:{DATASET_PREFIXES[k]}" for k in PREPARE_SOURCES))
    if kind == "tfds":
        return _tfds_source(where, data_dir)
    if not os.path.isdir(where):
        raise DatasetError(f"{source}: no such directory")
    return _folder_source(where) if kind == "folder" else _insightface_source(where)


def _shuffled(count: int) -> np.ndarray:
    return np.random.default_rng(ORDER_SEED).permutation(count)


def _folder_source(root: str) -> Source:
    """root/train/<class>/*, root/validation/<class>/* (or test/): every file but hidden
    ones is an item, so that a file that is no image is listed, not passed over."""
    root = os.path.abspath(root)
    train_dir = os.path.join(root, "train")
    val_dir = next((os.path.join(root, s) for s in ("validation", "test")
                    if os.path.isdir(os.path.join(root, s))), None)
    if not os.path.isdir(train_dir) or val_dir is None:
        raise DatasetError(f"folder:{root}: needs train/<class>/ and validation/<class>/ (or "
                           "test/) folders")
    classes = sorted(d for d in os.listdir(train_dir) if os.path.isdir(os.path.join(train_dir, d)))
    if not classes:
        raise DatasetError(f"folder:{root}: train/ has no class folders")
    splits = {}
    for split, split_dir in (("train", train_dir), ("validation", val_dir)):
        files, labels = [], []
        for label, name in enumerate(classes):
            found = _files_in(os.path.join(split_dir, name))
            files += found
            labels += [label] * len(found)
        order = _shuffled(len(files)) if split == "train" else np.arange(len(files))
        splits[split] = _file_split(np.array(files, dtype=str).reshape(-1)[order],
                                    np.array(labels, np.int64)[order], root)
    return Source(f"folder:{root}", classes, splits)


def _files_in(folder: str) -> List[str]:
    """Every file of `folder` but hidden ones, sorted; none if there is no such folder."""
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder))
            if not f.startswith(".") and os.path.isfile(os.path.join(folder, f))]


def _file_split(files: np.ndarray, labels: np.ndarray, root: str) -> SplitSource:
    def items(start):
        return tf.data.Dataset.from_tensor_slices((files[start:], labels[start:]))

    names = [os.path.relpath(f, root) for f in files]
    listing = [[name, int(label)] for name, label in zip(names, labels)]
    return SplitSource(len(files), items, tf.io.read_file, lambda i: names[i], listing,
                       lambda i: tf.constant(files[i]))


def _insightface_source(directory: str) -> Source:
    """train.rec's images as InsightFaceDataset splits them (one image of each of up to
    10,000 identities held out for validation); labels: the identities."""
    from owt_tf.data.insightface_stream import InsightFaceDataset

    data = InsightFaceDataset(directory, (112, 112, 3))
    records = data.records
    train = data.train_indices[_shuffled(len(data.train_indices))]
    splits = {}
    for split, indices in (("train", train), ("validation", data.val_indices)):
        def items(start, indices=indices):
            return tf.data.Dataset.from_tensor_slices(
                (indices[start:], records.labels[indices[start:]].astype(np.int64)))

        def name_of(i, indices=indices):
            return f"train.rec key {int(records.keys[indices[i]])}"

        listing = [[int(records.keys[i]), int(records.labels[i])] for i in indices]
        splits[split] = SplitSource(len(indices), items, data.encoded_record, name_of, listing,
                                    lambda i, indices=indices: tf.constant(indices[i]))
    names = [str(i) for i in range(records.num_identities)]
    return Source(f"insightface:{os.path.abspath(directory)}", names, splits)


def _tfds_source(name: str, data_dir: Optional[str]) -> Source:
    """A prepared TFDS set's train and validation (or test) splits, in stored order (TFDS
    shuffled them when it wrote them)."""
    from owt_tf.data.backends import TfdsDataset

    data = TfdsDataset(name, (1, 1, 3), data_dir)
    info = data.builder.info
    splits = {}
    for split, tfds_split in (("train", "train"), ("validation", data.val_split)):
        def items(start, tfds_split=tfds_split):
            return data._encoded(tfds_split).skip(start).map(
                lambda image, label: (image, tf.cast(label, tf.int64)))

        count = info.splits[tfds_split].num_examples
        splits[split] = SplitSource(count, items, lambda image: image,
                                    lambda i, s=tfds_split: f"{s}[{i}]",
                                    [info.full_name, tfds_split, count])
    return Source(f"tfds:{name}", list(data.label_names()), splits)
