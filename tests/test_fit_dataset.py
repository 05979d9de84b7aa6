"""owt_tf.fit_dataset: an owt_tf dataset name as (uint8 images, labels) for Keras fit.

The reference is the images themselves: a folder of PNG files (lossless) written from known
arrays, so `fit` on the named dataset is held to `fit` on those arrays, not to anything the
pipeline computed."""
import numpy as np
import pytest
import tensorflow as tf
import keras

import owt_tf
from keras_models import copy_of, update_rel_diff
from owt_tf.data import DatasetError
from owt_tf.fit.named_datasets import fit_dataset

SHAPE = (16, 16, 3)
CLASSES = ("a", "b", "c", "d")
PER_CLASS = 24
BATCH = 16


def _write_png_tree(root, seed: int = 0):
    """train/<class>/<i>.png and validation/<class>/<i>.png of random uint8 images; the
    training arrays in the folder's stored order (class by class, names sorted)."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for split, count in (("train", PER_CLASS), ("validation", 4)):
        for label, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                # brighter per class, so that a few steps learn something
                pixels = rng.integers(0, 160, SHAPE, dtype=np.uint8) + np.uint8(30 * label)
                tf.io.write_file(str(folder / f"{i:03d}.png"), tf.io.encode_png(pixels))
                if split == "train":
                    images.append(pixels)
                    labels.append(label)
    return np.stack(images), np.array(labels, np.int32)


def _model(normalization: keras.layers.Layer) -> keras.Model:
    inputs = keras.Input(SHAPE)
    x = normalization(inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu", name="conv",
                            kernel_initializer=keras.initializers.GlorotUniform(1))(x)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(32, activation="relu", name="fc1",
                           kernel_initializer=keras.initializers.GlorotUniform(2))(x)
    outputs = keras.layers.Dense(len(CLASSES), activation="softmax", name="fc2",
                                 kernel_initializer=keras.initializers.GlorotUniform(3))(x)
    return keras.Model(inputs, outputs)


def test_a_folder_gives_its_images_in_order_and_every_image_once_an_epoch(tmp_path):
    images, labels = _write_png_tree(tmp_path)
    stored = fit_dataset(f"folder:{tmp_path}", SHAPE, BATCH, shuffle=False)
    assert stored.steps_per_epoch == len(labels) // BATCH == int(stored.dataset.cardinality())
    assert stored.num_classes == len(CLASSES)
    got = list(stored.dataset)
    assert all(x.dtype == tf.uint8 and x.shape == (BATCH,) + SHAPE for x, _ in got)
    assert np.array_equal(np.concatenate([x for x, _ in got]), images)
    assert np.array_equal(np.concatenate([y for _, y in got]), labels)

    shuffled = fit_dataset(f"folder:{tmp_path}", SHAPE, BATCH, seed=3)
    epochs = [np.concatenate([x for x, _ in shuffled.dataset]) for _ in range(2)]
    key = lambda batch: sorted(map(bytes, batch))  # noqa: E731
    for epoch in epochs:  # every image exactly once an epoch
        assert key(epoch) == key(images)
    assert not np.array_equal(epochs[0], epochs[1])  # a new order each epoch
    # the normalisation layer: the set's own mean and spread, as the CLI's
    from owt_tf.data.datasets import load_dataset

    mean, std, _ = load_dataset(f"folder:{tmp_path}", SHAPE).input_statistics()
    normalised = np.asarray(stored.normalization(images[:4].astype(np.float32)))
    np.testing.assert_allclose(normalised, (images[:4] - np.array(mean)) / np.array(std),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_parallel_fit_on_it_equals_keras_fit_on_the_same_images_as_arrays(devices, tmp_path):
    images, labels = _write_png_tree(tmp_path)
    data = fit_dataset(f"folder:{tmp_path}", SHAPE, BATCH, shuffle=False)
    reference = _model(data.normalization)
    before = reference.get_weights()
    with owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-b").scope():
        parallel = owt_tf.parallelize(copy_of(reference))
        parallel.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                         loss="sparse_categorical_crossentropy")
    reference.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    want = reference.fit(images, labels, batch_size=BATCH, epochs=2, shuffle=False,
                         verbose=0).history
    got = parallel.fit(data.dataset, epochs=2, verbose=0).history
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert want["loss"][1] < want["loss"][0]  # it learned: the comparison is not of nothing
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4


def test_backup_and_restore_resumes_at_an_epoch_with_one_whole_pass(tmp_path):
    """Keras 3 restores a backup's epoch; each epoch of the dataset is a fresh whole pass,
    so the resumed fit reads every image once per remaining epoch: none repeated."""
    images, _ = _write_png_tree(tmp_path / "set")
    data = fit_dataset(f"folder:{tmp_path / 'set'}", SHAPE, BATCH, seed=1)
    seen = []

    def count(x, y):
        y = tf.py_function(lambda labels: seen.append(len(labels)) or labels, [y], tf.int32)
        return x, tf.ensure_shape(y, [BATCH])

    counted = data.dataset.map(count)
    counted = counted.apply(tf.data.experimental.assert_cardinality(data.steps_per_epoch))

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    def fit(callbacks):
        model = _model(data.normalization)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        return model.fit(counted, epochs=4, verbose=0, callbacks=[backup] + callbacks)

    with pytest.raises(RuntimeError, match="interrupted"):
        fit([Interrupt()])
    assert sum(seen) == 2 * data.steps_per_epoch * BATCH  # epochs 0 and 1, then the fault
    seen.clear()
    history = fit([])
    assert len(history.epoch) == 2  # epochs 2 and 3 only
    assert sum(seen) == 2 * data.steps_per_epoch * BATCH == 2 * (len(images) // BATCH) * BATCH


def test_bad_requests_say_what_is_wrong(tmp_path):
    _write_png_tree(tmp_path)
    with pytest.raises(DatasetError, match="fewer than one batch of 1000"):
        fit_dataset(f"folder:{tmp_path}", SHAPE, 1000)
    with pytest.raises(DatasetError, match="split must be 'train' or 'validation'"):
        fit_dataset(f"folder:{tmp_path}", SHAPE, BATCH, split="test")
    with pytest.raises(DatasetError, match="unknown dataset 'nope'"):
        fit_dataset("nope", SHAPE, BATCH)
