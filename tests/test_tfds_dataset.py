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
    config = RunConfig.from_flags(dataset="tfds:owt_tiny_digits", data_dir=data_dir, steps=4, devices=2,
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


def _prepared(tmp_path, shuffle_block):
    data_dir = str(tmp_path / "tfds")
    OwtTinyDigits(data_dir=data_dir).download_and_prepare()
    ds = load_dataset("tfds:owt_tiny_digits", (32, 32, 3), data_dir=data_dir)
    ds.shuffle_block = shuffle_block
    return ds


def test_tfds_stream_is_a_fresh_permutation_every_epoch(tmp_path):
    ds = _prepared(tmp_path, shuffle_block=32)  # 120 records: blocks of 32, 32, 32, 24
    stored = sorted(r.numpy() for r, _ in ds._ordered_train_records())
    stream = [r.numpy() for r, _ in ds._train_records(seed=5, skip=0).take(240)]
    assert sorted(stream[:120]) == stored and sorted(stream[120:]) == stored
    assert stream[:120] != stream[120:]
    other_seed = [r.numpy() for r, _ in ds._train_records(seed=6, skip=0).take(120)]
    assert other_seed != stream[:120]


def test_resumed_tfds_stream_gives_the_batches_of_the_uninterrupted_one(tmp_path):
    ds = _prepared(tmp_path, shuffle_block=32)
    stream = [r.numpy() for r, _ in ds._train_records(seed=5, skip=0).take(300)]
    for skip in (7, 40, 119, 131, 250):  # inside a block, across blocks and epochs
        assert [r.numpy() for r, _ in ds._train_records(seed=5, skip=skip).take(300 - skip)] \
            == stream[skip:]
    batches = [x.numpy() for x, _, _ in ds.train(12, seed=5).take(12)]
    resumed = [x.numpy() for x, _, _ in ds.train(12, seed=5, start=9 * 12).take(3)]
    for a, b in zip(resumed, batches[9:]):
        np.testing.assert_array_equal(a, b)
    # A million epochs in: found by arithmetic (re-reading them would take hours).
    far = 10**6 * ds.num_train + 7
    _, _, positions = next(iter(ds.train(12, seed=5, start=far)))
    np.testing.assert_array_equal(positions.numpy(), np.arange(far, far + 12))
