"""What Keras' inspection tools see of a parallelized model (owt_tf.fit.view):
summary, count_params, get_layer and TensorBoard's weight histograms show the user's layers
with the head's weights whole, as for the plain model, while Keras' optimizer and weight files
still never see the FC shards. K=4 pads the 10 classes to 12: a count or a value taken from the
shards as they are would be wrong."""
from __future__ import annotations

import glob
import os
from typing import Tuple

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import owt_tf
from keras_models import alexnet_like, batchnorm_trunk, copy_of, random_data
from owt_tf.fit.view import DenseView, ReadOnlyView

BATCH = 32
DENSE = ("fc1", "fc2", "predictions")  # alexnet_like's head


def _compile_kw() -> dict:
    return dict(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss="sparse_categorical_crossentropy", metrics=["accuracy"])


def _parallel(model, devices, k=4, scheme="owt-b"):
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme=scheme)
    with strategy.scope():
        parallel = owt_tf.parallelize(model, seed=0)
        parallel.compile(**_compile_kw())
    return parallel


def _summary_lines(model) -> list:
    lines = []
    model.summary(print_fn=lambda text, **_: lines.extend(text.splitlines()))
    return lines


def _row(lines, name: str) -> str:
    rows = [line for line in lines if f" {name} (" in line]
    assert len(rows) == 1, (name, lines)
    return rows[0]


def test_summary_lists_the_users_layers_with_whole_counts(devices):
    plain = alexnet_like()
    parallel = _parallel(copy_of(plain), devices)
    plain.compile(**_compile_kw())
    plain.optimizer.build(plain.trainable_variables)
    want, got = _summary_lines(plain), _summary_lines(parallel)
    for layer in plain.layers:
        count = f"{layer.count_params():,}"
        assert _row(got, layer.name).rstrip(" │").endswith(f" {count}"), (layer.name, got)
    assert " fc1 (DenseView)" in "\n".join(got)
    totals = ("Total params", "Trainable params", "Non-trainable params", "Optimizer params")
    assert ([line for line in got if line.strip().startswith(totals)]
            == [line for line in want if line.strip().startswith(totals)])


@pytest.mark.parametrize("make", [alexnet_like, batchnorm_trunk], ids=["sequential", "bn"])
def test_count_params_equals_the_plain_models(devices, make):
    plain = make()
    parallel = _parallel(copy_of(plain), devices, k=4 if make is alexnet_like else 2)
    assert parallel.count_params() == plain.count_params()


@pytest.mark.slow
def test_get_layer_gives_whole_weights_after_a_fit_step(devices):
    x, y = random_data(BATCH, seed=3)
    plain = alexnet_like()
    parallel = _parallel(copy_of(plain), devices)
    parallel.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    trained = parallel.to_keras_model()
    for name in DENSE:
        view = parallel.get_layer(name)
        assert isinstance(view, DenseView) and view.name == name
        want = trained.get_layer(name).get_weights()
        assert not np.array_equal(want[0], plain.get_layer(name).get_weights()[0])  # trained
        for got in (view.get_weights(), [w.numpy() for w in view.weights],
                    [np.asarray(w) for w in view.weights]):
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
        assert [w.path for w in view.weights] == [f"{name}/kernel", f"{name}/bias"]
        with pytest.raises(ReadOnlyView, match="model.set_weights"):
            view.set_weights(want)
    np.testing.assert_array_equal(parallel.get_layer("conv1").get_weights()[0],
                                  trained.get_layer("conv1").get_weights()[0])
    assert [layer.name for layer in parallel.own_layers()] == [l.name for l in plain.layers]
    assert parallel.get_layer(index=len(plain.layers) - 1).name == "predictions"
    with pytest.raises(ValueError, match="No such layer"):
        parallel.get_layer("nope")


def _summaries(logdir: str) -> Tuple[dict, set]:
    """({histogram tag: (number of values, lowest, highest)}, every tag) of the event files
    under logdir/train."""
    counts, tags = {}, set()
    for path in glob.glob(os.path.join(logdir, "train", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags.add(value.tag)
                if value.tag.endswith("/histogram"):
                    buckets = tf.make_ndarray(value.tensor)
                    counts[value.tag] = (int(round(buckets[:, 2].sum())), buckets[0, 0], buckets[-1, 1])
    return counts, tags


def test_tensorboard_writes_a_histogram_of_every_head_weight(devices, tmp_path):
    x, y = random_data(2 * BATCH, seed=5)
    plain = alexnet_like()
    parallel = _parallel(copy_of(plain), devices)
    logs = str(tmp_path / "logs")
    parallel.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                 callbacks=[keras.callbacks.TensorBoard(logs, histogram_freq=1,
                                                          write_images=True)])
    counts, tags = _summaries(logs)
    trained = parallel.to_keras_model()  # the epoch's end, when the histograms are written
    for name in DENSE + ("conv1",):
        for part, value in zip(("kernel", "bias"), trained.get_layer(name).get_weights()):
            count, lowest, highest = counts[f"{name}/{part}/histogram"]
            assert count == value.size, (name, part, count)
            np.testing.assert_allclose([lowest, highest], [value.min(), value.max()], rtol=1e-6)
    for name in DENSE:  # Keras draws 1-d and 2-d weights (a conv kernel only in some shapes)
        assert {f"{name}/kernel/image", f"{name}/bias/image"} <= tags, (name, tags)


@pytest.mark.slow
def test_keras_optimizer_and_weight_files_never_see_the_shards(devices, tmp_path):
    x, y = random_data(BATCH, seed=9)
    parallel = _parallel(alexnet_like(), devices)
    parallel.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    parallel.summary(print_fn=lambda *a, **k: None)  # views made: they must stay untracked
    shards = {id(v) for layer in parallel.head.layers for v in layer.kernels + layer.biases}
    for variables in (parallel.trainable_variables, parallel.weights,
                      parallel.optimizer.variables):
        assert not shards & {id(v) for v in variables}
    assert ([v.path for v in parallel.trainable_variables]
            == [v.path for v in parallel.trunk.trainable_variables])

    path = str(tmp_path / "w.weights.h5")
    parallel.save_weights(path)
    with h5py.File(path) as f:
        assert sorted(f.keys()) == ["layers", "optimizer", "vars"]
        assert list(f["layers"].keys()) == ["functional"]  # the trunk, as before the views
    resumed = _parallel(alexnet_like(seed=4), devices, k=2)
    resumed.load_weights(path)
    for name in DENSE:
        for g, w in zip(resumed.get_layer(name).get_weights(),
                        parallel.get_layer(name).get_weights(), strict=True):
            np.testing.assert_array_equal(g, w)
