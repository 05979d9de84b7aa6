"""Datasets by name, as tf.data pipelines of global batches.

    digits       scikit-learn's bundled 8x8 handwritten digits (real data, no download),
                 resized to the model's input; a fixed 80/20 train/validation split
    folder:PATH  images in PATH/train/<label>/* and PATH/validation/<label>/* (or test/),
                 the tfds.ImageFolder layout, streamed and decoded by tf.data with a training
                 augmentation (--augment) and a center crop for eval
    prepared:DIR a set written once by `python -m owt_tf.prepare` (shorter side 256, central
                 256x256, JPEG in TFRecord shards, a manifest), streamed like a folder with
                 the same augmentation; owt_tf.data.prepared
    insightface:DIR  InsightFace's face-recognition sets as shipped (train.rec + train.idx,
                 verification *.bin), streamed like a folder; owt_tf.data.insightface
    faces        synthetic face identities made in memory, with verification pairs of
                 held-out identities, for a first face-recognition run; owt_tf.data.faces
    synthetic    random images and labels of the model's size, for benchmarks only

A training batch is the *global* batch of B*K examples; MirroredStrategy's
experimental_distribute_dataset gives replica k rows k*B ... (k+1)*B-1 of it, so step t
sees the same examples whatever K is (the run contract, docs/design.md).

Training batches are (images, labels, positions): an example's position is its index in
the endless, seeded input stream, counted before anything is decoded; the position after
the last example used is what a resumed run starts from.

The streamed pipeline and its own-rows rule: owt_tf.data.stream; the file and TFDS
backends: owt_tf.data.backends.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.data import AUGMENTATIONS, DatasetError, dataset_forms, dataset_prefix
from owt_tf.data.backends import FolderDataset, TfdsDataset
from owt_tf.data.insightface_stream import InsightFaceDataset
from owt_tf.data.prepared import PreparedDataset
from owt_tf.data.stream import StreamDataset  # noqa: F401 (the loop tells streamed data apart)
from owt_tf.data.arrays import ArrayDataset
_SPLIT_SEED = 20140421  # fixed: the validation split never changes with --seed


IMAGENET_TARS = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")


def load_dataset(name: str, image_shape: Tuple[int, int, int], num_classes: Optional[int] = None,
                 seed: int = 0, data_dir: Optional[str] = None, download: bool = False,
                 manual_dir: Optional[str] = None, augment: str = "auto"):
    """The dataset called `name`, with images of `image_shape` (H, W, C); a streamed one
    trains with the augmentation `augment` ('auto': default_augmentation)."""
    if name == "digits":
        return _digits(image_shape)
    if name == "synthetic":
        return _synthetic(image_shape, num_classes or 10, seed)
    if name == "faces":
        from owt_tf.data.faces import faces_dataset  # it builds on ArrayDataset, above

        return faces_dataset(image_shape)
    prefix, argument = dataset_prefix(name)
    if prefix == "folder":
        dataset = FolderDataset(argument, image_shape)
    elif prefix == "prepared":
        dataset = PreparedDataset(argument, image_shape)
    elif prefix == "insightface":
        dataset = InsightFaceDataset(argument, image_shape)
    elif prefix == "tfds":
        dataset = TfdsDataset(argument, image_shape, data_dir, download)
    elif name == "imagenet2012":
        # TFDS' own builder, from the ILSVRC tars the user downloaded (no network).
        dataset = TfdsDataset("imagenet2012", image_shape, data_dir, manual_dir=manual_dir,
                              required_files=IMAGENET_TARS)
    else:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(dataset_forms())}")
    if augment not in AUGMENTATIONS:
        raise DatasetError(f"unknown augmentation {augment!r}; known: {', '.join(AUGMENTATIONS)}")
    if augment != "auto":
        dataset.augment = augment
    else:  # a dataset may know its own (face sets: the mirror image only)
        dataset.augment = getattr(dataset, "auto_augment", None) or default_augmentation(dataset)
    return dataset


def default_augmentation(dataset: "StreamDataset") -> str:
    """'alexnet' for ImageNet-sized images (ImageNet itself, or a set whose sampled images
    have a shorter side of at least the model's input side * 256/224); 'none' for smaller
    ones, which the network sees upscaled: no mirror images, no ImageNet lighting noise and
    no crop (measured on handwritten digits against keras.Model.fit, README 'Data')."""
    if dataset.name == "tfds:imagenet2012":
        return "alexnet"
    sides = [min(image.shape[:2]) for image, _ in dataset._readable().take(SIZE_SAMPLE)]
    needed = dataset.image_shape[0] * 256.0 / 224.0
    return "alexnet" if sides and float(np.median(sides)) >= needed else "none"


SIZE_SAMPLE = 32  # images whose size decides default_augmentation


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
