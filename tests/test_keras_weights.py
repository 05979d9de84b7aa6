"""What compile and fit accept under MirroredStrategy, with Keras' exact meaning, each against
plain one-device Keras `fit` with the same arguments: sample and class weights,
validation_split, the loss reductions "sum" and "mean_with_sample_weight", weighted
metrics, and the optimizers' clipnorm / global_clipnorm / clipvalue (clipped as one device
clips: the trunk's gradient summed over replicas, an FC weight's norm over its shards)."""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import owt_tf
from keras_models import (alexnet_like, copy_of, dataset, random_data, update_rel_diff,
                          worker_reference)
from owt_tf.fit.compiling import CompileError

LR, BATCH, ROWS = 0.05, 32, 96


def _parallel(model, devices, scheme="owt-b", fc_batch="global", k=4):
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme=scheme, fc_batch=fc_batch)
    with strategy.scope():
        return owt_tf.parallelize(model, seed=0)


def _weights(n: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.0, 3.0, n).astype("float32")


def _run_both(devices, compile_kw, fit_kw, scheme="owt-b", epochs=2, x=None, y=None):
    """(parallel history, plain history, update difference) after fitting both alike."""
    if x is None:
        x, y = random_data(ROWS, seed=21)
    reference = alexnet_like()
    parallel = _parallel(copy_of(reference), devices, scheme)
    parallel.compile(**compile_kw())
    reference.compile(**compile_kw())
    before = reference.get_weights()
    want = reference.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                         **fit_kw).history
    got = parallel.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                       **fit_kw).history
    return got, want, update_rel_diff(before, parallel.to_keras_model().get_weights(),
                                      reference.get_weights())


def _sgd(**kw):
    return lambda: dict(optimizer=keras.optimizers.SGD(LR, momentum=0.9, **kw),
                        loss="sparse_categorical_crossentropy", metrics=["accuracy"])


def _assert_same_history(got, want, rtol=1e-5):
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-6, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["owt-b", "owt-c"])
def test_sample_weights_equal_plain_keras(devices, scheme):
    """Keras' reduction: sum(loss x weight) over the batch size; weighted_metrics weighted,
    plain metrics not."""
    x, y = random_data(ROWS, seed=21)
    weights = _weights(ROWS)

    def compile_kw():
        return dict(optimizer=keras.optimizers.SGD(LR, momentum=0.9),
                    loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                    weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="wacc")])

    got, want, diff = _run_both(devices, compile_kw, dict(sample_weight=weights), scheme, x=x, y=y)
    assert diff < 1e-4
    _assert_same_history(got, want)


def test_weights_matter_to_the_comparison(devices):
    """The yardstick can fail: unweighted and weighted plain runs differ far beyond the
    tolerance the equality tests use."""
    x, y = random_data(ROWS, seed=21)
    a, b = alexnet_like(), alexnet_like()
    before = a.get_weights()
    for model, kw in ((a, {}), (b, dict(sample_weight=_weights(ROWS)))):
        model.compile(**_sgd()())
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **kw)
    assert update_rel_diff(before, a.get_weights(), b.get_weights()) > 0.05


def test_class_weights_equal_plain_keras(devices):
    class_weight = {c: 0.25 + 0.3 * c for c in range(9)}  # class 9 absent: weight 1, as Keras
    got, want, diff = _run_both(devices, _sgd(), dict(class_weight=class_weight))
    assert diff < 1e-4
    _assert_same_history(got, want)


def test_dataset_with_sample_weights_equals_plain_keras(devices):
    """A tf.data.Dataset of (x, y, sample_weight)."""
    x, y = random_data(ROWS, seed=22)
    weights = _weights(ROWS, seed=4)
    reference = alexnet_like()
    parallel = _parallel(copy_of(reference), devices)
    for model in (parallel, reference):
        model.compile(**_sgd()())
    before = reference.get_weights()
    data = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(BATCH)
    want = reference.fit(data, epochs=1, verbose=0).history
    got = parallel.fit(data, epochs=1, verbose=0).history
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4
    _assert_same_history(got, want)


@pytest.mark.slow
def test_validation_split_and_weighted_evaluate_equal_plain_keras(devices):
    """validation_split holds out the last rows (with their sample weights), before any
    shuffling; evaluate(sample_weight=) weighs the loss as Keras does, a partial last batch
    included."""
    x, y = random_data(ROWS + 32, seed=23)
    weights = _weights(ROWS + 32, seed=5)
    got, want, diff = _run_both(devices, _sgd(), dict(validation_split=0.25, sample_weight=weights),
                                x=x, y=y)
    assert "val_loss" in got and diff < 1e-4
    _assert_same_history(got, want)


def test_weighted_evaluate_equals_plain_keras(devices):
    x, y = random_data(70, seed=24)  # 70 rows: a padded last batch
    weights = _weights(70, seed=6)
    reference = alexnet_like()
    parallel = _parallel(copy_of(reference), devices)
    for model in (parallel, reference):
        model.compile(**_sgd()())
    got = parallel.evaluate(x, y, batch_size=BATCH, sample_weight=weights, verbose=0)
    want = reference.evaluate(x, y, batch_size=BATCH, sample_weight=weights, verbose=0)
    assert got == pytest.approx(want, rel=1e-5)
    unweighted = reference.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert abs(unweighted[0] - want[0]) > 1e-3  # the weights change the loss


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_loss_reductions_equal_plain_keras(devices, reduction):
    def compile_kw():
        loss = keras.losses.SparseCategoricalCrossentropy(reduction=reduction)
        return dict(optimizer=keras.optimizers.SGD(0.002 if reduction == "sum" else LR,
                                                   momentum=0.9),
                    loss=loss, metrics=["accuracy"])

    got, want, diff = _run_both(devices, compile_kw, dict(sample_weight=_weights(ROWS)))
    assert diff < 1e-4
    _assert_same_history(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("clip", [dict(clipnorm=0.05), dict(global_clipnorm=0.08),
                                  dict(clipvalue=0.002)])
@pytest.mark.parametrize("scheme", ["owt-b", "owt-c"])
def test_clipping_equals_plain_keras(devices, clip, scheme):
    """Clipping as one device clips: Keras under a strategy clips each replica's part of a
    trunk gradient instead (a different update, which this test would catch)."""
    got, want, diff = _run_both(devices, _sgd(**clip), {}, scheme)
    assert diff < 1e-4
    _assert_same_history(got, want)


@pytest.mark.parametrize("clip", [dict(clipnorm=0.05), dict(global_clipnorm=0.08),
                                  dict(clipvalue=0.002)])
def test_clipping_binds(clip):
    """The clipping tests compare runs in which clipping changes the update."""
    x, y = random_data(ROWS, seed=21)
    a, b = alexnet_like(), alexnet_like()
    before = a.get_weights()
    for model, kw in ((a, {}), (b, clip)):
        model.compile(**_sgd(**kw)())
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert update_rel_diff(before, a.get_weights(), b.get_weights()) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("clip", [dict(clipnorm=0.05), dict(clipvalue=0.002)])
def test_clipping_with_worker_updates_equals_sequential_fc_updates(devices, clip):
    """fc_batch='worker': each of a step's K FC updates clipped on its own, as K sequential
    one-device Keras updates with this optimizer clip them; the trunk's once."""
    k, steps = 4, 3
    x, y = random_data(BATCH * steps, seed=25)
    reference = alexnet_like()
    before = reference.get_weights()
    parallel = _parallel(copy_of(reference), devices, "owt-b", fc_batch="worker", k=k)
    parallel.compile(**_sgd(**clip)())
    losses = worker_reference(reference, x, y, k, "owt-b", steps, BATCH, LR, 0.9,
                              keras.optimizers.SGD(LR, momentum=0.9, **clip),
                              keras.optimizers.SGD(LR, momentum=0.9, **clip))
    got = parallel.fit(dataset(x, y, BATCH), epochs=1, verbose=0).history
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4
    assert got["loss"][0] == pytest.approx(np.mean(losses), rel=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(optimizer=keras.optimizers.SGD(LR, global_clipnorm=1.0)), "global_clipnorm"),
    (dict(loss=keras.losses.SparseCategoricalCrossentropy(reduction="sum")), "reduction"),
])
def test_whole_batch_settings_refused_with_worker_updates(devices, kw, match):
    model = _parallel(alexnet_like(), devices, scheme="owt-b", fc_batch="worker")
    settings = dict(optimizer=keras.optimizers.SGD(LR), loss="sparse_categorical_crossentropy")
    settings.update(kw)
    with pytest.raises(CompileError, match=match):
        model.compile(**settings)


def test_class_and_sample_weights_together_refused(devices):
    x, y = random_data(BATCH, seed=26)
    model = _parallel(alexnet_like(), devices)
    model.compile(**_sgd()())
    with pytest.raises(ValueError, match="together"):
        model.fit(x, y, batch_size=BATCH, sample_weight=np.ones(BATCH), class_weight={0: 2.0},
                  verbose=0)
