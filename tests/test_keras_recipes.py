"""Everyday Keras recipes on a parallelized model, each against plain one-device Keras with the
same weights and data: fine-tuning with a frozen base, binary and multi-label sigmoid heads,
count metrics, string and function losses on a one-unit head, the on-batch methods, the
optimizer object the user passed, dropout across a recompile, optimizer state restored only
into the same kind of optimizer, full shuffling of arrays, and what is refused."""
from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import owt_tf
from keras_models import alexnet_like, conv_dense_net, copy_of, random_data, update_rel_diff
from owt_tf.fit import data as keras_data
from owt_tf.fit.steps import TrainingCallError

LR, BATCH = 0.05, 32


def _parallel(model, devices, k=4, scheme="owt-b", **compile_kw):
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme=scheme)
    with strategy.scope():
        parallel = owt_tf.parallelize(model, seed=0)
        if compile_kw:
            parallel.compile(**compile_kw)
    return parallel


def _small_net(units: int, activation, seed: int = 7) -> keras.Model:
    return conv_dense_net((16, 16, 3), 8, units, activation, seed, "small", "out")


def _fit_both(reference, parallel, x, y, compile_kw, epochs=1):
    """Plain Keras and the parallelized copy fitted alike; (history, history, weights before).
    `compile_kw()` gives each model its own optimizer and metrics."""
    before = reference.get_weights()
    reference.compile(**compile_kw())
    want = reference.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0).history
    got = parallel.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0).history
    return got, want, before


def _assert_same_run(got, want, before, parallel, reference, tol=1e-4):
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < tol
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_frozen_base_with_a_new_head_equals_plain_keras(devices):
    """Fine-tuning: a frozen base (no trainable trunk weight) and a new Dense head; the base
    stays as it was and the head trains as in plain Keras."""
    x, y = random_data(3 * BATCH, seed=11)
    keras.utils.set_random_seed(3)
    base = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(4, 3, name="conv"),
                             keras.layers.Flatten(name="flatten")], name="base")
    base.trainable = False
    reference = keras.Sequential([base, keras.layers.Dense(8, activation="relu", name="fc1"),
                                  keras.layers.Dense(10, name="logits")], name="tuned")
    compile_kw = lambda: dict(optimizer=keras.optimizers.SGD(LR, momentum=0.9),  # noqa: E731
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              metrics=["accuracy"])
    parallel = _parallel(copy_of(reference), devices, **compile_kw())
    base_before = base.get_weights()
    got, want, before = _fit_both(reference, parallel, x, y, compile_kw)
    _assert_same_run(got, want, before, parallel, reference)
    plain = parallel.to_keras_model()
    for w, w0 in zip(plain.get_layer("base").get_weights(), base_before, strict=True):
        np.testing.assert_array_equal(w, w0)
    assert int(parallel.optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize("units,labels", [(1, "binary"), (5, "multilabel")])
def test_sigmoid_heads_equal_plain_keras(devices, units, labels):
    """Dense(1, sigmoid) with [B] labels and Dense(5, sigmoid) with multi-hot labels, trained
    with binary cross-entropy; 'accuracy' becomes Keras' binary accuracy in both."""
    x, classes = random_data(3 * BATCH, seed=12)
    if labels == "binary":
        y = (classes % 2).astype(np.float32)
    else:
        y = (np.random.default_rng(1).random((len(x), units)) < 0.3).astype(np.float32)
    reference = _small_net(units, "sigmoid")
    compile_kw = lambda: dict(optimizer=keras.optimizers.SGD(LR, momentum=0.9),  # noqa: E731
                              loss="binary_crossentropy", metrics=["accuracy", keras.metrics.AUC(name="auc")])
    parallel = _parallel(copy_of(reference), devices, **compile_kw())
    got, want, before = _fit_both(reference, parallel, x, y, compile_kw)
    _assert_same_run(got, want, before, parallel, reference)
    np.testing.assert_allclose(parallel.predict(x[:40], batch_size=BATCH, verbose=0),
                               reference.predict(x[:40], verbose=0), atol=1e-6)


def test_count_metrics_equal_plain_keras_in_history_and_evaluate(devices):
    """TruePositives / FalseNegatives are sums: fed the whole gathered batch on every replica
    they came out K times too large. History and evaluate (a padded last batch) equal Keras'."""
    x, classes = random_data(3 * BATCH, seed=13)
    y = (classes % 2).astype(np.float32)
    reference = _small_net(1, "sigmoid")

    def compile_kw():
        return dict(optimizer=keras.optimizers.SGD(LR), loss="binary_crossentropy",
                    metrics=[keras.metrics.TruePositives(name="tp"),
                             keras.metrics.FalseNegatives(name="fn"), "accuracy"])

    parallel = _parallel(copy_of(reference), devices, **compile_kw())
    got, want, before = _fit_both(reference, parallel, x, y, compile_kw)
    assert want["tp"][0] + want["fn"][0] == pytest.approx(float(y.sum()))  # counts, not ratios
    _assert_same_run(got, want, before, parallel, reference)
    got_eval = parallel.evaluate(x[:70], y[:70], batch_size=BATCH, verbose=0, return_dict=True)
    want_eval = reference.evaluate(x[:70], y[:70], batch_size=BATCH, verbose=0, return_dict=True)
    assert got_eval == pytest.approx(want_eval, rel=1e-5)


def _mean_abs(y_true, y_pred):
    return tf.reduce_mean(tf.abs(y_true - y_pred), axis=-1)


@pytest.mark.parametrize("loss", ["hinge", "poisson", "kl_divergence", _mean_abs])
def test_string_and_function_losses_on_a_one_unit_head(devices, loss):
    """A Dense(1) head with [B] labels: Keras aligns the ranks before a loss function, so each
    example's loss is its own, not a mean over the batch's broadcast [B, B]."""
    x, classes = random_data(3 * BATCH, seed=14)
    y = (classes % 2).astype(np.float32) + (0.5 if loss == "poisson" else 0.0)
    positive = loss in ("poisson", "kl_divergence")  # their predictions must be > 0
    reference = _small_net(1, "sigmoid" if positive else None)
    compile_kw = lambda: dict(optimizer=keras.optimizers.SGD(LR), loss=loss)  # noqa: E731
    parallel = _parallel(copy_of(reference), devices, **compile_kw())
    got, want, before = _fit_both(reference, parallel, x, y, compile_kw)
    _assert_same_run(got, want, before, parallel, reference)


@pytest.mark.slow
def test_on_batch_methods_equal_plain_keras(devices):
    """train_on_batch / test_on_batch / predict_on_batch: each replica takes its own rows of
    the batch (Keras' own would hand every replica the whole batch)."""
    x, y = random_data(2 * BATCH, seed=15)
    reference = alexnet_like()
    compile_kw = lambda: dict(optimizer=keras.optimizers.SGD(LR, momentum=0.9),  # noqa: E731
                              loss="sparse_categorical_crossentropy",
                              metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(3)])
    parallel = _parallel(copy_of(reference), devices, scheme="owt-c", **compile_kw())
    reference.compile(**compile_kw())
    before = reference.get_weights()
    for step in range(2):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        got = parallel.train_on_batch(x[rows], y[rows], return_dict=True)
        want = reference.train_on_batch(x[rows], y[rows], return_dict=True)
        assert got == pytest.approx(want, rel=1e-5)
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4
    assert parallel.test_on_batch(x[:30], y[:30]) == pytest.approx(
        reference.test_on_batch(x[:30], y[:30]), rel=1e-5)
    np.testing.assert_allclose(parallel.predict_on_batch(x[:6]), reference.predict_on_batch(x[:6]),
                               atol=1e-6)
    # Sample weights: one more weighted step, and a weighted evaluation, alike.
    weights = np.linspace(0.2, 2.0, BATCH).astype("float32")
    got = parallel.train_on_batch(x[:BATCH], y[:BATCH], sample_weight=weights, return_dict=True)
    want = reference.train_on_batch(x[:BATCH], y[:BATCH], sample_weight=weights, return_dict=True)
    assert got == pytest.approx(want, rel=1e-5)
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4
    assert parallel.test_on_batch(x[:30], y[:30], sample_weight=weights[:30]) == pytest.approx(
        reference.test_on_batch(x[:30], y[:30], sample_weight=weights[:30]), rel=1e-5)


def test_compile_keeps_the_users_optimizer_object(devices):
    """`model.optimizer is opt`, made inside or outside the scope: a callback that changes
    `opt` changes the run (here its rate, set to 0 after the first step: nothing moves)."""
    x, y = random_data(3 * BATCH, seed=16)
    outside = keras.optimizers.SGD(LR)
    parallel = _parallel(alexnet_like(), devices)
    parallel.compile(optimizer=outside, loss="sparse_categorical_crossentropy")
    assert parallel.optimizer is outside
    start = parallel.get_weights()

    class Freeze(keras.callbacks.Callback):
        weights = None

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                outside.learning_rate = 0.0
                self.weights = parallel.get_weights()

    freeze = Freeze()
    parallel.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[freeze])
    assert int(outside.iterations.numpy()) == 3
    assert any(np.any(a != b) for a, b in zip(start, freeze.weights, strict=True))  # step 1 moved
    for got, want in zip(parallel.get_weights(), freeze.weights, strict=True):  # steps 2-3 did not
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_head_dropout_goes_on_across_a_recompile(devices):
    """Dropout masks follow the step count: fit, recompile, fit equals fit, fit (SGD without
    momentum, so the new optimizer's fresh state changes nothing else)."""
    from keras_models import batchnorm_trunk

    x = np.random.default_rng(3).normal(size=(BATCH, 8, 8, 1)).astype(np.float32)
    y = np.arange(BATCH) % 10
    reference = batchnorm_trunk()  # has Dropout(0.3) between its Dense layers
    runs = []
    for recompile in (False, True):
        model = _parallel(copy_of(reference), devices, optimizer=keras.optimizers.SGD(LR),
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        if recompile:
            model.compile(optimizer=keras.optimizers.SGD(LR),
                          loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        runs.append(model.get_weights())
    for a, b in zip(*runs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_fc_optimizer_state_loads_only_into_the_same_kind(devices, tmp_path):
    """Adam's moments are not SGD momentum: a weights file of an Adam run loads into an SGD
    run's weights but leaves its momentum fresh, with a warning (Keras' rule); into an Adam
    run it restores the moments and the FC step count."""
    x, y = random_data(BATCH, seed=17)
    path = str(tmp_path / "adam.weights.h5")
    adam = _parallel(alexnet_like(), devices, optimizer=keras.optimizers.Adam(1e-3),
                     loss="sparse_categorical_crossentropy")
    adam.fit(x, y, batch_size=BATCH, verbose=0)
    adam.save_weights(path)
    saved = adam.head_state()

    sgd = _parallel(alexnet_like(seed=5), devices, optimizer=keras.optimizers.SGD(LR, momentum=0.9),
                    loss="sparse_categorical_crossentropy")
    with pytest.warns(UserWarning, match="Skipping the FC optimizer state.*Adam"):
        sgd.load_weights(path)
    state = sgd.head_state()
    np.testing.assert_array_equal(state["fc0_kernel"], saved["fc0_kernel"])
    assert not np.any(state["fc0_kernel_slot0"])  # momentum untouched
    assert int(state["fc_iterations"]) == 0

    again = _parallel(alexnet_like(seed=6), devices, k=2, optimizer=keras.optimizers.Adam(1e-3),
                      loss="sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Skipping the FC")
        again.load_weights(path)
    state = again.head_state()
    for key in ("fc0_kernel_slot0", "fc2_bias_slot1", "fc_iterations"):
        np.testing.assert_array_equal(state[key], saved[key])


def test_arrays_are_shuffled_whole_every_epoch():
    """Keras shuffles every row of arrays each epoch: the first batch draws from all rows (a
    100,000-row window would keep it among the first 100,032), and epochs differ."""
    n = 200_000
    x = np.arange(n, dtype=np.float32)[:, None]
    batches, _ = keras_data.training_batches(x, np.arange(n, dtype=np.int64), BATCH, True, 4)
    first = [next(iter(batches)) for _ in range(2)]
    rows = [b[0].numpy()[:, 0] for b in first]
    assert max(rows[0].max(), rows[1].max()) > 100_032
    assert not np.array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(first[0][1].numpy(), rows[0].astype(np.int64))


def test_training_call_is_refused_in_one_line(devices):
    """A custom GradientTape loop would train the trunk only: model(x, training=True) says so."""
    parallel = _parallel(alexnet_like(), devices, optimizer="sgd",
                         loss="sparse_categorical_crossentropy")
    x, _ = random_data(4)
    assert parallel(x, training=False).shape == (4, 10)
    with pytest.raises(TrainingCallError, match="fit or train_on_batch"):
        parallel(x, training=True)


def test_trunk_regularization_losses_equal_plain_keras(devices):
    """An L2 kernel regularizer on a trunk convolution: its loss is in the logged loss and its
    gradient in the convolution's update, as in plain Keras (dropped, both differ)."""
    x, y = random_data(3 * BATCH, seed=18)
    keras.utils.set_random_seed(8)
    reference = keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv",
                            kernel_regularizer=keras.regularizers.L2(0.05)),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(8, activation="relu", name="fc1"),
        keras.layers.Dense(10, name="logits"),
    ], name="regularized")
    compile_kw = lambda: dict(optimizer=keras.optimizers.SGD(LR, momentum=0.9),  # noqa: E731
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    parallel = _parallel(copy_of(reference), devices, **compile_kw())
    got, want, before = _fit_both(reference, parallel, x, y, compile_kw)
    _assert_same_run(got, want, before, parallel, reference)
