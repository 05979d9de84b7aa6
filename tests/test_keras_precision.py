"""Mixed precision the Keras way on a parallelized model: `mixed_float16` with the
LossScaleOptimizer Keras' compile adds (one dynamic scale for trunk and shards, an overflow
skips the step on every device), activations exchanged in the compute dtype under both
mixed policies (half the float32 bytes in the step's ledger)."""
from __future__ import annotations

import keras
import numpy as np
import pytest

import owt_tf
from keras_models import alexnet_like, copy_of, dataset, random_data
from owt_tf.planner import ledger
from owt_tf.fit.compiling import CompileError
from owt_tf.parallel.precision import keras_policy

BATCH = 32


def _parallel(model, devices, k=4, scheme="owt-b", fc_batch="global"):
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme=scheme, fc_batch=fc_batch)
    with strategy.scope():
        return owt_tf.parallelize(model, seed=0)


def _sgd():
    return dict(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss="sparse_categorical_crossentropy")


@pytest.mark.slow
def test_mixed_float16_fit_tracks_keras_own(devices):
    """compile adds Keras' LossScaleOptimizer; the shards compute in float16; fit's loss stays
    as close to Keras' own mixed_float16 fit as that is to the float32 fit."""
    x, y = random_data(BATCH * 3)
    with keras_policy("float16"):
        reference = alexnet_like()
    assert reference.layers[-2].dtype_policy.name == "mixed_float16"
    fp32 = alexnet_like()
    parallel = _parallel(copy_of(reference), devices)
    parallel.compile(**_sgd())
    assert isinstance(parallel.optimizer, keras.optimizers.LossScaleOptimizer)
    assert parallel.head.compute_dtype.name == "float16"
    for m in (reference, fp32):
        m.compile(**_sgd())
    want = reference.fit(dataset(x, y, BATCH), epochs=1, verbose=0).history["loss"][0]
    exact = fp32.fit(dataset(x, y, BATCH), epochs=1, verbose=0).history["loss"][0]
    got = parallel.fit(dataset(x, y, BATCH), epochs=1, verbose=0).history["loss"][0]
    assert abs(got - exact) <= 2 * abs(want - exact) + 1e-2 * exact, (got, want, exact)
    assert int(parallel.optimizer.iterations.numpy()) == 3


def _every_value(parallel):
    """Every trunk variable on every device and every FC shard: what a skipped step keeps."""
    strategy = parallel.hybrid.strategy
    trunk = [np.array(t) for v in parallel.trunk.weights
             for t in strategy.experimental_local_results(v.value)]
    shards = [v.numpy() for k in parallel.head.local_shards
              for v in parallel.head.shard_variables(k)]
    return trunk + shards


def _float16_parallel(devices, optimizer, **scaling):
    """A mixed_float16 model, parallelized and compiled with LossScaleOptimizer(**scaling)."""
    with keras_policy("float16"):
        model = alexnet_like()
    parallel = _parallel(model, devices)
    parallel.compile(optimizer=keras.optimizers.LossScaleOptimizer(optimizer, **scaling),
                     loss="sparse_categorical_crossentropy")
    return parallel


@pytest.mark.slow
def test_an_overflow_skips_the_step_on_every_device_and_halves_the_scale(devices):
    x, y = random_data(BATCH * 2, seed=3)
    # A scale of 2**40 overflows float16 (max 65504) in every backward pass.
    parallel = _float16_parallel(devices, keras.optimizers.SGD(0.05, momentum=0.9),
                                 initial_scale=2.0 ** 40)
    before = _every_value(parallel)
    parallel.train_on_batch(x[:BATCH], y[:BATCH])
    after = _every_value(parallel)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    scaler = parallel.optimizer
    assert float(scaler.dynamic_scale.numpy()) == 2.0 ** 39
    assert int(scaler.iterations.numpy()) == 0 and int(parallel._fc_optimizer.iterations.numpy()) == 0
    # Lowered until finite, the steps apply again: every shard and the trunk move.
    for _ in range(40):
        parallel.train_on_batch(x[BATCH:], y[BATCH:])
        if int(scaler.iterations.numpy()):
            break
    assert int(scaler.iterations.numpy()) == 1
    moved = _every_value(parallel)
    assert all(not np.array_equal(a, b) for a, b in zip(before, moved, strict=True)
               if a.dtype.kind == "f")


@pytest.mark.slow
def test_the_scale_grows_after_finite_steps(devices):
    x, y = random_data(BATCH * 3, seed=4)
    parallel = _float16_parallel(devices, keras.optimizers.SGD(0.01), initial_scale=8.0,
                                 dynamic_growth_steps=2)
    parallel.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert float(parallel.optimizer.dynamic_scale.numpy()) == 16.0  # 3 steps: one doubling
    assert int(parallel.optimizer.step_counter.numpy()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["bfloat16", "float16"])
def test_activations_travel_in_the_compute_dtype(devices, policy):
    """The step's ledger: the exchanged activations take half the float32 bytes."""
    x, y = random_data(BATCH, seed=5)
    counted = {}
    for name in ("float32", policy):
        with keras_policy(name):
            model = alexnet_like()
        parallel = _parallel(model, devices)
        parallel.compile(**_sgd())
        book = ledger.TrafficLedger()
        with ledger.recording(book):
            parallel.train_on_batch(x, y)
        counted[name] = book.by_purpose[ledger.ACTIVATIONS]
    assert counted[policy] * 2 == counted["float32"] > 0


@pytest.mark.slow
def test_loss_scaling_with_worker_fc_updates_is_refused(devices):
    with keras_policy("float16"):
        model = alexnet_like()
    parallel = _parallel(model, devices, fc_batch="worker")
    with pytest.raises(CompileError, match="fc_batch='global'"):
        parallel.compile(**_sgd())


def _digits_net(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax")])


@pytest.mark.slow
def test_each_mixed_policy_trains_digits_to_the_float32_accuracy_within_a_point(devices):
    """The bundled digits, K = 2, owt-b, 6 epochs, seeds 0-3: mean validation accuracy
    under mixed_float16 and mixed_bfloat16 within 1 point of float32. Measured over seeds
    0-4: 98.0 % float32, 98.2 % float16, 98.0 % bfloat16, no seed's pair more than 1.1
    points apart. (3 epochs were too few: 96.7 / 95.9 / 95.8 %, a systematic gap of 0.8
    points at K = 2 that a 1-point check would trip on with the next seed.) K is not what
    is checked here (every K equals one device: test_equivalence.py); K = 2 traces fast."""
    from keras_models import digits

    x, y, x_val, y_val = digits()
    accuracy = {policy: [] for policy in ("float32", "float16", "bfloat16")}
    for seed in (0, 1, 2, 3):
        for policy in accuracy:
            with keras_policy(policy):
                model = _digits_net(seed)
            parallel = _parallel(model, devices, k=2)
            parallel.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                             loss="sparse_categorical_crossentropy", metrics=["accuracy"])
            parallel.fit(x, y, batch_size=BATCH, epochs=6, verbose=0)
            accuracy[policy].append(parallel.evaluate(x_val, y_val, batch_size=64, verbose=0)[1])
    mean = {policy: float(np.mean(a)) for policy, a in accuracy.items()}
    assert mean["float32"] > 0.9, accuracy
    for policy in ("float16", "bfloat16"):
        assert abs(mean[policy] - mean["float32"]) <= 0.01, accuracy
