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


@pytest.mark.slow
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


def _write_sized_tree(root, side, per_class=8, val_per_class=2, image=None):
    """Three classes of random RGB PNGs of side x side (or every one `image`); returns the
    uint8 training images by file path."""
    rng = np.random.default_rng(7)
    written = {}
    for split, count in (("train", per_class), ("validation", val_per_class)):
        for name in ("a", "b", "c"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = image if image is not None else rng.integers(0, 256, (side, side, 3),
                                                                      dtype=np.uint8)
                path = folder / f"{i}.png"
                tf.io.write_file(str(path), tf.io.encode_png(pixels))
                if split == "train":
                    written[str(path)] = pixels
    return written


def test_augment_none_trains_on_the_plain_normalised_images(tmp_path):
    """Images of the model's size: each training row is one training image, (x - mean) / std
    with the dataset's own statistics, computed here in numpy, and nothing else."""
    from owt_tf.data.stats import settle_normalisation

    images = _write_sized_tree(tmp_path / "d", 32)
    ds = load_dataset(f"folder:{tmp_path / 'd'}", (32, 32, 3), augment="none")
    stats = settle_normalisation(ds, str(tmp_path / "run"), started_before=False, writer=True)
    pixels = np.stack(list(images.values())).astype(np.float64)
    mean, std = pixels.mean(axis=(0, 1, 2)), pixels.std(axis=(0, 1, 2))
    np.testing.assert_allclose(stats["mean"], mean, rtol=1e-9)
    np.testing.assert_allclose(stats["std"], std, rtol=1e-9)
    batch, labels, _ = next(iter(ds.train(12, seed=0)))
    wanted = (pixels - mean) / std
    for row, label in zip(batch.numpy(), labels.numpy()):
        distance = np.abs(wanted - row).max(axis=(1, 2, 3))
        match = int(np.argmin(distance))
        assert distance[match] < 1e-4
        assert os.path.basename(os.path.dirname(list(images)[match])) == ds.class_names[label]


def test_statistics_are_stored_with_the_run_and_reused(tmp_path):
    """Sample statistics of upscaled small images, stored in the run directory; a later
    reader takes the stored ones, and a run started before statistics existed keeps ImageNet's."""
    import json

    from owt_tf.data.preprocess import eval_pixels
    from owt_tf.data.stats import STATS_FILE, settle_normalisation

    images = _write_sized_tree(tmp_path / "d", 8)
    ds = load_dataset(f"folder:{tmp_path / 'd'}", (32, 32, 3))
    settle_normalisation(ds, str(tmp_path / "run"), started_before=False, writer=True)
    stored = json.loads((tmp_path / "run" / STATS_FILE).read_text())
    views = eval_pixels(tf.constant(np.stack(list(images.values()))), (32, 32)).numpy()
    views = views.astype(np.float64)
    np.testing.assert_allclose(stored["mean"], views.mean(axis=(0, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(stored["std"], views.std(axis=(0, 1, 2)), rtol=1e-5)
    assert stored["images"] == 24 and stored["augment"] == "none"
    assert ds.mean == tuple(stored["mean"]) and ds.std == tuple(stored["std"])
    again = load_dataset(f"folder:{tmp_path / 'd'}", (32, 32, 3))
    (tmp_path / "run" / STATS_FILE).write_text(json.dumps({**stored, "mean": [1.0, 2.0, 3.0]}))
    settle_normalisation(again, str(tmp_path / "run"), started_before=False, writer=False)
    assert again.mean == (1.0, 2.0, 3.0)
    old = load_dataset(f"folder:{tmp_path / 'd'}", (32, 32, 3))
    settle_normalisation(old, str(tmp_path / "old"), started_before=True, writer=False)
    assert old.mean == (123.68, 116.78, 103.94)


def test_small_images_default_to_no_mirror_images(tmp_path):
    """Every image a left-to-right ramp: under the small-image default ('none') and under
    'crop' no training row is mirrored (all rise left to right); AlexNet's augmentation
    mirrors about half."""
    ramp = np.broadcast_to(np.linspace(0, 255, 8).astype(np.uint8)[None, :, None], (8, 8, 3))
    _write_sized_tree(tmp_path / "small", 8, image=np.ascontiguousarray(ramp))
    big = tmp_path / "big"
    wide = np.broadcast_to(np.linspace(0, 255, 48).astype(np.uint8)[None, :, None], (48, 48, 3))
    _write_sized_tree(big, 48, image=np.ascontiguousarray(wide))
    small = load_dataset(f"folder:{tmp_path / 'small'}", (32, 32, 3))
    assert small.augment == "none"
    assert load_dataset(f"folder:{big}", (32, 32, 3)).augment == "alexnet"

    def rising(ds):
        x = next(iter(ds.train(24, seed=0)))[0].numpy()
        return x[:, :, -4:].mean(axis=(1, 2, 3)) > x[:, :, :4].mean(axis=(1, 2, 3))

    assert rising(small).all()
    assert rising(load_dataset(f"folder:{tmp_path / 'small'}", (32, 32, 3), augment="crop")).all()
    mirrored = load_dataset(f"folder:{tmp_path / 'small'}", (32, 32, 3), augment="alexnet")
    assert 0 < (~rising(mirrored)).sum() < 24


def test_export_of_a_folder_run_normalises_with_the_runs_statistics(tmp_path):
    """The SavedModel's probabilities equal the trained model's on inputs normalised by hand
    with the statistics stored in the run."""
    import json

    from owt_tf.config import RunConfig
    from owt_tf.data.stats import STATS_FILE
    from owt_tf.training.files.serving import export_saved_model
    from owt_tf.training.loop import Trainer

    images = _write_sized_tree(tmp_path / "d", 32)
    config = RunConfig.from_flags(dataset=f"folder:{tmp_path / 'd'}", devices=1, scheme="single",
                                  batch_size=8, steps=2, eval_every=0, logdir=str(tmp_path / "run"))
    trainer = Trainer(config)
    trainer.fit(log=lambda line: None, progress=False)
    stats = json.loads((tmp_path / "run" / STATS_FILE).read_text())
    pixels = np.stack(list(images.values())).astype(np.float64)
    np.testing.assert_allclose(stats["mean"], pixels.mean(axis=(0, 1, 2)), rtol=1e-9)
    out = export_saved_model(trainer.model, trainer.dataset.mean, trainer.dataset.std,
                             str(tmp_path / "export"))
    x = np.stack(list(images.values()))[:8]
    served = tf.saved_model.load(out).signatures["serving_default"](images=tf.constant(x))
    normalised = (x.astype(np.float32) - np.float32(stats["mean"])) / np.float32(stats["std"])
    logits = trainer._predict_fn(trainer.hybrid.placement.distribute_global_batch(tf.constant(normalised)))
    np.testing.assert_allclose(served["probabilities"].numpy(),
                               tf.nn.softmax(logits.numpy()[:, :3]).numpy(), atol=1e-5)
    with open(os.path.join(out, "owt_tf_export.json")) as f:
        meta = json.load(f)
    np.testing.assert_allclose(meta["mean"], stats["mean"])
    np.testing.assert_allclose(meta["std"], stats["std"])
