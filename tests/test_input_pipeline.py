"""The training input pipeline: JPEG crops decoded from their window, the windows of a
resize-then-crop, per-batch augmentation row by row, formats by content, bad files skipped,
exact resume across draw chunks, and the bench's --input mode."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from owt_tf.data.datasets import load_dataset
from owt_tf.data.preprocess import (DRAW_CHUNK, augment_train_batch, crop_window,
                                    decode_train_crop)

MEAN, STD = (123.68, 116.78, 103.94), (58.4, 57.1, 57.4)


def _photo(h, w, seed, noise=6.0, period=(10, 60)):
    """A photo-like RGB image: smooth colour waves plus sensor-like noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    f = rng.uniform(*period, 6)
    img = np.stack([128 + 90 * np.sin(xx / f[0] + yy / f[1]),
                    128 + 80 * np.cos(yy / f[2] - xx / f[3]),
                    128 + 70 * np.sin((xx + yy) / f[4]) * np.cos(xx / f[5])], -1)
    return np.clip(img + rng.normal(0, noise, img.shape), 0, 255).astype(np.uint8)


def test_jpeg_window_decode_equals_the_whole_decode_cropped():
    """decode_and_crop_jpeg of the window vs the same pixels decoded whole (a PNG of them):
    only chroma upsampling at the window's edges may differ (measured: max 4 levels, mean
    0.035)."""
    rng = np.random.default_rng(1)
    for i, (h, w) in enumerate([(375, 500), (500, 375), (333, 500), (40, 50)]):
        jpeg = tf.io.encode_jpeg(_photo(h, w, i), quality=90)
        png = tf.io.encode_png(tf.io.decode_jpeg(jpeg, channels=3))
        for _ in range(5):
            corner = tf.constant(rng.uniform(size=2), tf.float32)
            a = decode_train_crop(jpeg, (224, 224), 3, corner).numpy().astype(int)
            b = decode_train_crop(png, (224, 224), 3, corner).numpy().astype(int)
            assert a.shape == (224, 224, 3)
            assert np.abs(a - b).max() <= 6 and np.abs(a - b).mean() <= 0.1


@pytest.mark.parametrize("size", [224, 32])
def test_windows_are_the_resize_then_crop_windows_in_whole_pixels(size):
    """A window is the crop of the image resized to shorter side size*256/224, at offsets
    uniform over that image, mapped back to the image's pixels: within half a pixel."""
    rng = np.random.default_rng(2)
    for _ in range(200):
        h, w = (int(v) for v in rng.integers(size // 2, 4 * size, 2))
        corner = rng.uniform(size=2).astype(np.float32)
        top, left, wh, ww = crop_window(tf.constant([h, w]), (size, size), tf.constant(corner)).numpy()
        scale = size * 256 / 224 / min(h, w)
        resized = np.maximum(np.round(np.array([h, w]) * scale), size)
        room = resized - size + 1
        offset = np.minimum(np.floor(corner * room), room - 1)
        ideal_extent = size * np.array([h, w]) / resized
        ideal_corner = offset * np.array([h, w]) / resized
        assert np.all(np.abs([wh, ww] - ideal_extent) <= 0.5 + 1e-4)
        assert np.all(np.abs([top, left] - np.minimum(ideal_corner, [h - wh, w - ww])) <= 0.5 + 1e-4)
        assert 0 <= top and top + wh <= h and 0 <= left and left + ww <= w


def test_crop_matches_resize_then_crop_on_a_smooth_image():
    """The content of a crop: within a level or two of the old path (resize the whole image,
    then crop) on a smooth image; the windows differ by under half a pixel."""
    rng = np.random.default_rng(3)
    for i, (h, w) in enumerate([(375, 500), (500, 375), (180, 240)]):
        img = _photo(h, w, i, noise=0.0, period=(40, 80))
        scale = 256 / min(h, w)
        nh, nw = max(round(h * scale), 224), max(round(w * scale), 224)
        whole = tf.image.resize(tf.cast(img, tf.float32), (nh, nw)).numpy()
        for _ in range(5):
            corner = rng.uniform(size=2).astype(np.float32)
            room = np.array([nh - 223, nw - 223])
            oy, ox = np.minimum((corner * room).astype(int), room - 1)
            crop = decode_train_crop(tf.io.encode_png(img), (224, 224), 3, tf.constant(corner))
            diff = np.abs(crop.numpy() - whole[oy:oy + 224, ox:ox + 224])
            assert diff.mean() <= 1.0 and diff.max() <= 6


def test_batch_augmentation_is_row_by_row():
    """The fused per-batch flip/lighting/normalisation treats each row as on its own."""
    rng = np.random.default_rng(4)
    crops = tf.constant(rng.integers(0, 256, (6, 16, 16, 3)), tf.uint8)
    flips = tf.constant([True, False, True, True, False, False])
    lighting = tf.constant(rng.normal(0, 0.1, (6, 3)), tf.float32)
    batch = augment_train_batch(crops, flips, lighting, MEAN, STD).numpy()
    for i in range(6):
        pixels = crops[i].numpy()[:, ::-1] if flips[i] else crops[i].numpy()
        rgb = np.array([[-0.5675, 0.7192, 0.4009], [-0.5808, -0.0045, -0.8140],
                        [-0.5836, -0.6948, 0.4203]]) @ (lighting[i].numpy() * [0.2175, 0.0188, 0.0045])
        want = (np.clip(pixels + 255 * rgb, 0, 255) - MEAN) / STD
        np.testing.assert_allclose(batch[i], want, atol=1e-4)


def _tree(root, files):
    """files: {(split, label, name): encoded bytes}."""
    for (split, label, name), data in files.items():
        folder = root / split / label
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return root


def test_formats_are_read_by_content_and_broken_jpegs_skipped(tmp_path):
    """A JPEG named .png and a PNG named .jpg train; truncated JPEGs (end marker missing, the
    header intact, so a window above the cut would decode) are skipped like any bad file:
    their rows hold the next readable image of the batch, and are counted."""
    files = {}
    for i in range(6):
        img = _photo(200, 150, i)  # portrait: windows of 131 of its 200 rows, from any top row
        jpeg, png = tf.io.encode_jpeg(img).numpy(), tf.io.encode_png(img).numpy()
        files[("train", "a_jpeg_as_png", f"{i}.png")] = jpeg
        files[("train", "b_png_as_jpg", f"{i}.jpg")] = png
        files[("train", "c_truncated", f"{i}.jpg")] = jpeg[: len(jpeg) * 4 // 5]
        files[("validation", "a_jpeg_as_png", f"{i}.png")] = jpeg
    ds = load_dataset(f"folder:{_tree(tmp_path, files)}", (32, 32, 3))
    batches = list(ds.train_rows(6, seed=0).take(6))
    labels = np.concatenate([y.numpy() for _, y, _, _ in batches])
    positions = np.concatenate([p.numpy() for _, _, p, _ in batches])
    failed = np.concatenate([f.numpy() for _, _, _, f in batches])
    assert set(labels.tolist()) == {0, 1}  # every readable file, no truncated one
    np.testing.assert_array_equal(positions, np.arange(36))  # no gaps: rows filled in place
    assert np.count_nonzero(failed) == 12  # 2 epochs of 18 files, 6 of them truncated
    assert all(np.isfinite(x.numpy()).all() for x, _, _, _ in batches)


def test_resume_across_a_draw_chunk_gives_the_same_batches(tmp_path):
    files = {("train", label, f"{i}.jpg"): tf.io.encode_jpeg(_photo(30 + i, 40, i)).numpy()
             for label in ("x", "y") for i in range(10)}
    files[("validation", "x", "0.jpg")] = files[("train", "x", "0.jpg")]
    ds = load_dataset(f"folder:{_tree(tmp_path, files)}", (24, 24, 3))
    batch = 10
    first = (DRAW_CHUNK // batch - 1) * batch  # the resumed stream starts in one chunk, goes on in the next
    stream = [x.numpy() for x, _, _ in ds.train(batch, seed=7).take(first // batch + 3)]
    resumed = [x.numpy() for x, _, _ in ds.train(batch, seed=7, start=first).take(3)]
    for a, b in zip(resumed, stream[first // batch:]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(stream[0], stream[2])


@pytest.mark.slow
def test_bench_input_mode_prints_both_rates(tmp_path):
    files = {(split, label, f"{i}.jpg"): tf.io.encode_jpeg(_photo(50, 70, i)).numpy()
             for split in ("train", "validation") for label in ("x", "y") for i in range(8)}
    root = _tree(tmp_path / "imgs", files)
    out = tmp_path / "input.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-m", "owt_tf.bench", "--input", f"folder:{root}",
                           "--image-size", "32", "--batch-size", "4", "--devices", "2",
                           "--steps", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [r["pipeline"] for r in records] == ["training", "bare decode"]
    for r in records:
        assert r["global_batch"] == 8 and r["images"] == 3 * 2 * 8 and r["images_per_sec"] > 0
    assert "training / bare decode:" in proc.stdout and "per core" in proc.stdout
    memory = subprocess.run([sys.executable, "-m", "owt_tf.bench", "--input", "digits"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert memory.returncode == 2 and "--input" in memory.stderr
