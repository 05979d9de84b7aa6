"""owt_tf.parallelize against Keras itself: the same model trained by plain `fit` on one device.

Same initial weights, same global batches (no shuffle), same optimizer; after 3 steps every
weight must agree to 1e-5 relative and the logged loss and accuracy must be Keras' own.
For fc_batch='worker' the reference is a one-device loop that applies the K sequential FC
updates of a step (the paper's rows) with Keras optimizers.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import owt_tf
from keras_models import (alexnet_like, copy_of, dataset, max_rel_diff, random_data,
                          single_dense_head, update_rel_diff, worker_reference)

LR, MOMENTUM, BATCH, STEPS = 0.05, 0.9, 32, 3


def _compile(model, **kw):
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=MOMENTUM),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"], **kw)


def _parallel(model, devices, k, scheme, fc_batch="global"):
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme=scheme, fc_batch=fc_batch)
    with strategy.scope():
        parallel = owt_tf.parallelize(model, seed=0)
        _compile(parallel)
    return parallel


# Each scheme once and both K (every scheme at every K is tests/test_equivalence.py's).
@pytest.mark.parametrize("k,scheme", [(2, "owt-b"), pytest.param(4, "owt-a", marks=pytest.mark.slow),
                                      pytest.param(4, "owt-c", marks=pytest.mark.slow)])
def test_fit_equals_plain_keras_fit(devices, k, scheme):
    x, y = random_data(BATCH * STEPS)
    reference = alexnet_like()
    parallel = _parallel(copy_of(reference), devices, k, scheme)
    _compile(reference)
    want = reference.fit(dataset(x, y, BATCH), epochs=1, verbose=0).history
    got = parallel.fit(dataset(x, y, BATCH), epochs=1, verbose=0).history
    assert max_rel_diff(parallel.to_keras_model().get_weights(), reference.get_weights()) < 1e-5
    assert got["loss"][0] == pytest.approx(want["loss"][0], rel=1e-5)
    assert got["accuracy"][0] == pytest.approx(want["accuracy"][0], abs=1e-7)


@pytest.mark.parametrize("sgd", [dict(momentum=MOMENTUM, nesterov=True, weight_decay=0.01),
                                 dict(momentum=0.0, weight_decay=0.01)],
                         ids=["nesterov-decay", "plain-decay"])
def test_shard_sgd_variants_update_as_plain_keras(devices, sgd):
    """The shards' SGD (TensorFlow's fused momentum kernel for Keras' formula, Keras' own
    step without momentum) and weight decay over a dataset: each weight's update equals
    plain Keras fit's."""
    x, y = random_data(BATCH * STEPS, seed=5)
    reference = alexnet_like()
    before = reference.get_weights()
    strategy = owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-b")
    with strategy.scope():
        parallel = owt_tf.parallelize(copy_of(reference), seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(LR, **sgd),
                         loss="sparse_categorical_crossentropy")
    reference.compile(optimizer=keras.optimizers.SGD(LR, **sgd),
                      loss="sparse_categorical_crossentropy")
    reference.fit(dataset(x, y, BATCH), epochs=1, verbose=0)
    parallel.fit(dataset(x, y, BATCH), epochs=1, verbose=0)
    # A dataset's length is unknown to Keras here: its last call finds no batch, and must
    # not decay or count a step.
    assert (int(parallel.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
            == STEPS)
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4


@pytest.mark.slow
def test_single_dense_head_logits_and_numpy_input(devices):
    """A head of one Dense (classes sharded over 4), a from_logits loss object, numpy input."""
    x, y = random_data(BATCH * STEPS, seed=1)
    reference = single_dense_head()
    strategy = owt_tf.HybridStrategy(devices=devices[:4], scheme="owt-b")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        parallel = owt_tf.parallelize(copy_of(reference))
        parallel.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=["accuracy"])
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=["accuracy"])
    before = reference.get_weights()
    want = reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    got = parallel.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    # By the update (Adam divides by sqrt(v): a weight-relative check saw rounding at 2.3e-5)
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4
    assert got["loss"][0] == pytest.approx(want["loss"][0], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("k,scheme", [(2, "owt-b"), (4, "owt-c")])
def test_fc_batch_worker_equals_sequential_fc_updates(devices, k, scheme):
    x, y = random_data(BATCH * STEPS, seed=2)
    reference = alexnet_like()
    parallel = _parallel(copy_of(reference), devices, k, scheme, fc_batch="worker")
    losses = worker_reference(reference, x, y, k, scheme, STEPS, BATCH, LR, MOMENTUM)
    got = parallel.fit(dataset(x, y, BATCH), epochs=1, verbose=0).history
    assert max_rel_diff(parallel.to_keras_model().get_weights(), reference.get_weights()) < 1e-5
    assert got["loss"][0] == pytest.approx(np.mean(losses), rel=1e-5)


@pytest.mark.slow
def test_evaluate_and_predict_cover_every_row(devices):
    """A last partial batch (50 rows, batches of 32 over 4 devices) is padded, not dropped."""
    x, y = random_data(50, seed=3)
    reference = alexnet_like()
    reference.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    parallel = _parallel(copy_of(reference), devices, 4, "owt-b")
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=BATCH, verbose=0),
                               reference.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(parallel.evaluate(dataset(x, y, 20), verbose=0),
                               reference.evaluate(x, y, verbose=0), rtol=1e-5)
    got = parallel.predict(x, batch_size=BATCH, verbose=0)
    assert got.shape == (50, 10)
    np.testing.assert_allclose(got, reference.predict(x, verbose=0), atol=1e-6)
    np.testing.assert_allclose(parallel.predict(tf.data.Dataset.from_tensor_slices(x).batch(16),
                                                verbose=0), got, atol=1e-6)


def _fc_schedule():
    return keras.optimizers.schedules.ExponentialDecay(LR / 2, decay_steps=1, decay_rate=0.8)


@pytest.mark.slow
@pytest.mark.parametrize("k,scheme", [(2, "owt-b"), (4, "owt-c")])
def test_fc_optimizer_own_rate_and_schedule_equal_sequential_fc_updates(devices, k, scheme):
    """The paper's recipe through compile: the trunk at K times the rate, the shards with
    `fc_optimizer=` at their own rate, here a schedule that decays every FC update. Equals
    plain Keras optimizers applying K sequential FC updates a step (the schedule advancing
    once per update), compared by each weight's update."""
    x, y = random_data(BATCH * STEPS, seed=6)
    reference = alexnet_like()
    before = reference.get_weights()
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme=scheme, fc_batch="worker")
    with strategy.scope():
        parallel = owt_tf.parallelize(copy_of(reference), seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(LR * k, momentum=MOMENTUM),
                         fc_optimizer=keras.optimizers.SGD(_fc_schedule(), momentum=MOMENTUM),
                         loss="sparse_categorical_crossentropy")
    losses = worker_reference(reference, x, y, k, scheme, STEPS, BATCH, LR, MOMENTUM,
                              keras.optimizers.SGD(LR * k, momentum=MOMENTUM),
                              keras.optimizers.SGD(_fc_schedule(), momentum=MOMENTUM))
    got = parallel.fit(dataset(x, y, BATCH), epochs=1, verbose=0).history
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4
    assert got["loss"][0] == pytest.approx(np.mean(losses), rel=1e-5)
