"""Datasets and the input pipeline. The names are importable without TensorFlow."""

DATASET_NAMES = ("digits", "faces", "imagenet2012", "synthetic")


class DatasetError(ValueError):
    """The dataset cannot be loaded as asked."""
