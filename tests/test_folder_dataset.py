"""folder:PATH datasets: the ImageFolder layout, decoded and augmented by tf.data, trainable."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

from owt_tf.data.datasets import DatasetError, load_dataset
from owt_tf.data.preprocess import augment_train_batch, decode_train_crop


def _write_tree(root, per_class=12, val_per_class=4, classes=("five", "one", "zero")):
    digits = load_digits()
    wanted = {"zero": 0, "one": 1, "five": 5}
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("validation", val_per_class)):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            picks = np.flatnonzero(digits.target == wanted[name])[:count + per_class]
            picks = picks[:count] if split == "train" else picks[per_class:per_class + count]
            for i, idx in enumerate(picks):
                side = int(rng.integers(36, 60))  # sizes vary, as real photos do
                img = tf.image.resize(digits.images[idx][..., None] * 16.0, (side, side + 4))
                rgb = tf.cast(tf.clip_by_value(tf.tile(img, [1, 1, 3]), 0, 255), tf.uint8)
                ext = "png" if i % 2 else "jpg"
                data = tf.io.encode_png(rgb) if ext == "png" else tf.io.encode_jpeg(rgb)
                tf.io.write_file(str(folder / f"{i}.{ext}"), data)
    return root


def test_folder_layout_labels_and_batches(tmp_path):
    ds = load_dataset(f"folder:{_write_tree(tmp_path)}", (32, 32, 3))
    assert ds.class_names == ["five", "one", "zero"] and ds.num_classes == 3
    assert ds.num_train == 36
    images, labels, positions = next(iter(ds.train(12, seed=0)))
    np.testing.assert_array_equal(positions.numpy(), np.arange(12))
    assert images.shape == (12, 32, 32, 3) and images.dtype == tf.float32
    assert set(labels.numpy()) <= {0, 1, 2}
    val_labels = np.concatenate([y.numpy() for _, y in ds.validation(8)])
    assert (val_labels[val_labels >= 0] == ds.val_file_labels).all() and len(val_labels) == 16
    again = next(iter(ds.train(12, seed=0)))[0]
    np.testing.assert_array_equal(images.numpy(), again.numpy())  # augmentation is seeded


def test_augmentation_crops_flips_and_stays_in_range():
    image = tf.constant(np.random.default_rng(1).integers(0, 256, (50, 70, 3)), tf.uint8)
    png = tf.io.encode_png(image)
    crops = [decode_train_crop(png, (32, 32), 3, tf.constant(c)) for c in ([0.0, 0.0], [0.9, 0.9])]
    assert crops[0].shape == (32, 32, 3) and crops[0].dtype == tf.uint8
    assert not np.array_equal(crops[0].numpy(), crops[1].numpy())
    flips = tf.constant([True, False])
    lighting = tf.constant([[0.1, -0.2, 0.3], [-0.3, 0.2, 0.1]])
    batch = augment_train_batch(tf.stack(crops), flips, lighting, (0.0,) * 3, (1.0,) * 3)
    assert batch.dtype == tf.float32
    assert float(tf.reduce_min(batch)) >= 0 and float(tf.reduce_max(batch)) <= 255
    unlit = augment_train_batch(tf.stack(crops), flips, tf.zeros([2, 3]), (0.0,) * 3, (1.0,) * 3)
    np.testing.assert_array_equal(unlit[0].numpy(), crops[0].numpy()[:, ::-1])  # mirrored
    np.testing.assert_array_equal(unlit[1].numpy(), crops[1].numpy())


def test_folder_errors(tmp_path):
    with pytest.raises(DatasetError, match="no train/"):
        load_dataset(f"folder:{tmp_path}", (32, 32, 3))
    (tmp_path / "train" / "cat").mkdir(parents=True)
    (tmp_path / "validation").mkdir()
    with pytest.raises(DatasetError, match="has no images"):
        load_dataset(f"folder:{tmp_path}", (32, 32, 3))


def test_train_cli_on_a_folder(tmp_path):
    root = _write_tree(tmp_path / "data")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-m", "owt_tf.train", "--dataset", f"folder:{root}",
                           "--steps", "6", "--batch-size", "6", "--devices", "2", "--eval-every", "3",
                           "--logdir", str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 6 steps" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "checkpoint").exists()
    missing = subprocess.run([sys.executable, "-m", "owt_tf.train", "--dataset",
                              f"folder:{tmp_path / 'nope'}"], capture_output=True, text=True,
                             env=env, timeout=120)
    assert missing.returncode == 2 and "--dataset" in missing.stderr


def test_resumed_stream_starts_at_the_right_batch(tmp_path):
    ds = load_dataset(f"folder:{_write_tree(tmp_path)}", (32, 32, 3))
    from_start = [x.numpy() for x, _, _ in ds.train(6, seed=3).take(4)]
    resumed = [x.numpy() for x, _, _ in ds.train(6, seed=3, start=2 * 6).take(2)]
    np.testing.assert_array_equal(resumed[0], from_start[2])
    np.testing.assert_array_equal(resumed[1], from_start[3])
