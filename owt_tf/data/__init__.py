"""Datasets and the input pipeline. The names are importable without TensorFlow: this is the
registry of dataset names the config validates --dataset against and load_dataset
(owt_tf.data.datasets) dispatches on."""
from __future__ import annotations

from typing import Optional, Tuple

DATASET_NAMES = ("digits", "faces", "imagenet2012", "synthetic")
# PREFIX:ARG datasets, each with what its argument is. A DIR or PATH is a directory.
DATASET_PREFIXES = {"folder": "PATH", "prepared": "DIR", "insightface": "DIR", "tfds": "NAME"}
# What `python -m owt_tf.prepare` reads (a prepared set is its output, not a source).
PREPARE_SOURCES = ("folder", "tfds", "insightface")
# --augment: AlexNet's crop + flip + PCA lighting; the random crop alone (no mirror images:
# digits and text are not symmetric); none (training sees the eval view); auto picks per
# dataset (owt_tf.data.datasets.default_augmentation).
AUGMENTATIONS = ("auto", "alexnet", "crop", "none")


class DatasetError(ValueError):
    """The dataset cannot be loaded as asked."""


def dataset_prefix(name: str) -> Tuple[Optional[str], str]:
    """(prefix, argument) of a PREFIX:ARG dataset name; (None, name) for any other."""
    prefix, colon, argument = name.partition(":")
    return (prefix, argument) if colon and prefix in DATASET_PREFIXES else (None, name)


def dataset_forms() -> Tuple[str, ...]:
    """Every form --dataset takes: the names, then PREFIX:ARG."""
    return DATASET_NAMES + tuple(f"{p}:{a}" for p, a in DATASET_PREFIXES.items())
