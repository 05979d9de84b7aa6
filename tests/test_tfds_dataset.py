"""tfds:NAME: a TFDS dataset the test prepares itself (offline), trained from; unprepared fails fast."""
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from owt_tf.config import RunConfig
from owt_tf.data.datasets import DatasetError, load_dataset
from owt_tf.training.loop import Trainer


class OwtTinyDigits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's digits 0-3 as 24x24 RGB PNGs: a real TFDS builder, prepared offline."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(24, 24, 3)),
                "label": tfds.features.ClassLabel(num_classes=4)}),
            supervised_keys=("image", "label"))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0, 120),
                "validation": self._generate_examples(120, 160)}

    def _generate_examples(self, start, stop):
        from sklearn.datasets import load_digits

        digits = load_digits()
        keep = np.flatnonzero(digits.target < 4)[start:stop]
        for i in keep:
            small = (digits.images[i] * 16).astype(np.uint8)
            image = np.repeat(np.repeat(small, 3, 0), 3, 1)[..., None].repeat(3, -1)
            yield int(i), {"image": image, "label": int(digits.target[i])}


def test_prepared_tfds_dataset_trains(devices, tmp_path):
    data_dir = str(tmp_path / "tfds")
    OwtTinyDigits(data_dir=data_dir).download_and_prepare()
    ds = load_dataset("tfds:owt_tiny_digits", (32, 32, 3), data_dir=data_dir)
    assert ds.num_classes == 4 and ds.num_train == 120
    config = RunConfig(dataset="tfds:owt_tiny_digits", data_dir=data_dir, steps=4, devices=2,
                       batch_size=8, eval_every=0, logdir=str(tmp_path / "run"))
    summary = Trainer(config, devices=devices[:2]).fit(log=lambda line: None, progress=False)
    assert np.isfinite(summary["train_loss"]) and summary["steps"] == 4


def test_unprepared_tfds_dataset_fails_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(DatasetError, match="not prepared"):
        load_dataset("tfds:mnist", (32, 32, 3), data_dir=str(tmp_path))
    assert time.monotonic() - start < 30


def test_unknown_tfds_name(tmp_path):
    with pytest.raises(DatasetError, match="tfds:no_such_set"):
        load_dataset("tfds:no_such_set", (32, 32, 3), data_dir=str(tmp_path))
