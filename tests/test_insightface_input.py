"""insightface:DIR's training input: uint8 images and their flip draws to the step, mirrored
and normalised there (preprocess.finish_images), equal to the former host path (each
record's bytes read alone, decoded, its eval view rounded, mirrored and normalised on the
host), at the input size and at another (resized), from the start and resumed."""
import numpy as np
import pytest
import tensorflow as tf

from owt_tf.data.datasets import load_dataset
from owt_tf.data.insightface import write_property
from owt_tf.data.preprocess import DeviceBatch, eval_pixels, finish_images, train_draws
from owt_tf.data.recordio import write_record_file

SIDE = 16
BATCH = 8


def _write_set(root, side, identities=4, per_identity=6):
    """Smooth random images (a mirror image differs from its image), JPEG, header layout."""
    rng = np.random.default_rng(side)
    items = []
    for k in range(identities):
        for _ in range(per_identity):
            field = rng.uniform(0, 255, (1, 4, 4, 3)).astype(np.float32)
            image = tf.image.resize(field, (side, side), method="bicubic")[0].numpy()
            image = np.clip(image, 0, 255).astype(np.uint8)
            items.append((tf.io.encode_jpeg(image, quality=95).numpy(), k))
    root.mkdir(parents=True)
    write_record_file(str(root / "train"), items, header=True)
    write_property(str(root), identities, (side, side))
    return str(root)


def _former_host_batches(ds, seed, batches, start=0):
    """What the former pipeline gave: tf.data's seeded shuffle of (index, label), each image
    read alone and decoded whole, its eval view (resized only when not at the input size)
    rounded to uint8, mirrored by the position's flip draw, normalised, on the host."""
    order = tf.data.Dataset.from_tensor_slices(
        (ds.train_indices, ds.records.labels[ds.train_indices]))
    order = order.shuffle(ds.num_train, seed=seed, reshuffle_each_iteration=True).repeat()
    count = batches * BATCH
    pairs = list(order.skip(start).take(count).as_numpy_iterator())
    draws = list(train_draws(seed, start).take(count))
    images = []
    for (index, _), draw in zip(pairs, draws):
        image = tf.io.decode_image(ds.records.image_bytes(int(index)), channels=3,
                                   expand_animations=False)
        pixels = tf.cast(tf.round(eval_pixels(image[None], (SIDE, SIDE))[0]), tf.uint8)
        if draw.flip:
            pixels = tf.reverse(pixels, axis=[1])
        images.append((tf.cast(pixels, tf.float32).numpy() - 127.5) / 127.5)
    labels = np.array([label for _, label in pairs], np.int32)
    flips = np.array([bool(d.flip) for d in draws])
    return np.stack(images), labels, np.arange(start, start + count), flips


def _device_batches(ds, seed, batches, start=0, on_device=True):
    images, labels, positions, flips = [], [], [], []
    for rows, row_labels, row_positions, failed in ds.train_rows(
            BATCH, seed, start, on_device=on_device).take(batches):
        assert not np.any(failed.numpy())
        if on_device:
            assert isinstance(rows, DeviceBatch) and rows.crops.dtype == tf.uint8
            assert not np.any(rows.lighting.numpy())  # the mirror only
            flips.append(rows.flips.numpy())
            rows = finish_images(rows, ds.mean, ds.std)  # what the step does on its device
        images.append(rows.numpy())
        labels.append(row_labels.numpy())
        positions.append(row_positions.numpy())
    return (np.concatenate(images), np.concatenate(labels), np.concatenate(positions),
            np.concatenate(flips) if flips else None)


@pytest.mark.parametrize("stored", [SIDE, 20])  # at the input size; resized from 20x20
def test_uint8_to_the_device_gives_the_former_host_inputs(tmp_path, stored):
    ds = load_dataset(f"insightface:{_write_set(tmp_path / 'set', stored)}", (SIDE, SIDE, 3))
    assert ds.augment == "flip" and ds.num_train == 20
    want_images, want_labels, want_positions, want_flips = _former_host_batches(ds, 3, 5)
    assert want_flips.any() and not want_flips.all()  # both kinds of rows are compared
    images, labels, positions, flips = _device_batches(ds, 3, 5)
    np.testing.assert_array_equal(positions, want_positions)
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_array_equal(flips, want_flips)
    np.testing.assert_allclose(images, want_images, rtol=0, atol=1e-6)
    host, host_labels, _, _ = _device_batches(ds, 3, 5, on_device=False)
    np.testing.assert_array_equal(host_labels, want_labels)
    np.testing.assert_allclose(host, want_images, rtol=0, atol=1e-6)


def test_a_resume_continues_the_same_stream(tmp_path):
    ds = load_dataset(f"insightface:{_write_set(tmp_path / 'set', SIDE)}", (SIDE, SIDE, 3))
    start = 3 * BATCH + BATCH // 2  # mid-epoch (20 images), not on a draw chunk's edge
    want_images, want_labels, want_positions, _ = _former_host_batches(ds, 7, 4, start)
    images, labels, positions, _ = _device_batches(ds, 7, 4, start)
    np.testing.assert_array_equal(positions, want_positions)
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_allclose(images, want_images, rtol=0, atol=1e-6)
    whole, whole_labels, _, _ = _device_batches(ds, 7, 8)
    resumed = slice(start, start + len(labels))
    np.testing.assert_array_equal(labels, whole_labels[resumed])
    np.testing.assert_array_equal(images, whole[resumed])
