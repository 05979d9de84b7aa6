"""imagenet2012 through TFDS' real builder, from a tiny archive in the real ILSVRC layout, offline."""
import io
import os
import tarfile

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from owt_tf.data.datasets import DatasetError, load_dataset

SYNSETS = ("n01440764", "n01443537")  # the first two of TFDS' ILSVRC-2012 class list


def _jpeg(rng, h, w):
    return tf.io.encode_jpeg(tf.constant(rng.integers(0, 256, (h, w, 3)), tf.uint8)).numpy()


def _add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_ilsvrc(manual_dir, per_synset=10, val_images=8):
    """train tar of per-synset tars of JPEGs; flat val tar whose sorted names map to TFDS'
    shipped validation labels."""
    rng = np.random.default_rng(0)
    os.makedirs(manual_dir, exist_ok=True)
    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_train.tar"), "w") as outer:
        for synset in SYNSETS:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as inner:
                for i in range(per_synset):
                    _add(inner, f"{synset}_{i}.JPEG", _jpeg(rng, 40 + i, 50))
            _add(outer, f"{synset}.tar", buf.getvalue())
    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_val.tar"), "w") as val:
        for i in range(1, val_images + 1):
            _add(val, f"ILSVRC2012_val_{i:08d}.JPEG", _jpeg(rng, 48, 44))


def test_imagenet2012_prepares_offline_and_trains(devices, tmp_path):
    from owt_tf.config import RunConfig
    from owt_tf.training.loop import Trainer

    manual = str(tmp_path / "manual")
    write_ilsvrc(manual)
    data_dir = str(tmp_path / "tfds")
    config = RunConfig.from_flags(dataset="imagenet2012", manual_dir=manual, data_dir=data_dir, steps=3,
                                  devices=2, batch_size=4, eval_every=0, logdir=str(tmp_path / "run"))
    trainer = Trainer(config, devices=devices[:2])
    assert trainer.dataset.num_classes == 1000 and trainer.dataset.num_train == 20
    labels = {int(y) for _, y in trainer.dataset._readable().take(20)}
    names = tfds.builder("imagenet2012", data_dir=data_dir).info.features["label"].names
    assert labels == {names.index(s) for s in SYNSETS}
    summary = trainer.fit(log=lambda line: None, progress=False)
    assert summary["steps"] == 3 and np.isfinite(summary["train_loss"])


def test_imagenet2012_missing_tar_is_named(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    (manual / "ILSVRC2012_img_train.tar").write_bytes(b"")
    with pytest.raises(DatasetError, match="ILSVRC2012_img_val.tar is missing"):
        load_dataset("imagenet2012", (32, 32, 3), data_dir=str(tmp_path / "d"), manual_dir=str(manual))
    with pytest.raises(DatasetError, match="--manual-dir"):
        load_dataset("imagenet2012", (32, 32, 3), data_dir=str(tmp_path / "d"))
