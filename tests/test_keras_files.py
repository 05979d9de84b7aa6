""".keras files of a parallelized model resume a run as a plain Keras file does: `save`
(and ModelCheckpoint(save_weights_only=False)) write the optimizer's state, trunk and every
shard whole, under a plain optimizer's names; `load_model` + `fit` continues the run on one
device, and `parallelize` of the loaded model continues it at another K. Compared with a
plain Keras model trained alike, by each optimizer tensor and by each weight's update."""
from __future__ import annotations

import keras
import numpy as np
import pytest

import owt_tf
from keras_models import alexnet_like, copy_of, random_data, update_rel_diff

BATCH = 32


def _parallel(model, devices, k):
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme="owt-b")
    with strategy.scope():
        return owt_tf.parallelize(model, seed=0)


def _compile_kw():
    return dict(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                metrics=["accuracy"])


def _state(model) -> dict:
    return {v.name: np.asarray(v.numpy(), np.float64) for v in model.optimizer.variables}


def _assert_same_state(got: dict, want: dict, tol=1e-4):
    assert set(got) == set(want)
    for name, value in want.items():
        scale = max(np.linalg.norm(value), 1e-12)
        assert np.linalg.norm(got[name] - value) / scale < tol, name


@pytest.fixture
def trained(devices, tmp_path):
    """A parallelized model at K=4 and a plain one, one epoch alike, each saved."""
    x, y = random_data(3 * BATCH, seed=30)
    reference = alexnet_like()
    parallel = _parallel(copy_of(reference), devices, 4)
    for model in (parallel, reference):
        model.compile(**_compile_kw())
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    parallel.save(tmp_path / "parallel.keras")
    reference.save(tmp_path / "plain.keras")
    return tmp_path / "parallel.keras", tmp_path / "plain.keras"


@pytest.mark.slow
def test_the_file_holds_the_plain_optimizers_state(trained):
    got = keras.models.load_model(trained[0])
    want = keras.models.load_model(trained[1])
    assert type(got.optimizer) is keras.optimizers.Adam
    assert int(got.optimizer.iterations.numpy()) == 3
    # Adam's two slots for every weight, FC layers included (joined from 4 shards, padding
    # dropped), each equal to the plain run's.
    assert any(name.startswith("predictions_kernel") for name in _state(got))
    _assert_same_state(_state(got), _state(want))


@pytest.mark.slow
@pytest.mark.parametrize("k", [None, 2])
def test_load_model_and_fit_continue_the_run(devices, trained, k):
    """None: the loaded plain model fits on one device; 2: parallelize(loaded) at K=2."""
    x, y = random_data(3 * BATCH, seed=31)
    loaded = keras.models.load_model(trained[0])
    model = loaded if k is None else _parallel(loaded, devices, k)
    reference = keras.models.load_model(trained[1])
    before = reference.get_weights()
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    after = model.get_weights() if k is None else model.to_keras_model().get_weights()
    assert update_rel_diff(before, after, reference.get_weights()) < 1e-4
    if k is not None:
        assert int(model.optimizer.iterations.numpy()) == 6
        model.save(trained[0].parent / "again.keras")
        again = keras.models.load_model(trained[0].parent / "again.keras")
        _assert_same_state(_state(again), _state(reference))


@pytest.mark.slow
def test_a_fresh_optimizer_would_differ(trained):
    """The yardstick can fail: a run continued with fresh Adam state moves differently."""
    x, y = random_data(3 * BATCH, seed=31)
    resumed = keras.models.load_model(trained[1])
    fresh = keras.models.load_model(trained[1])
    fresh.compile(**_compile_kw())
    before = resumed.get_weights()
    for model in (resumed, fresh):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert update_rel_diff(before, fresh.get_weights(), resumed.get_weights()) > 0.05


def test_a_different_fc_optimizer_is_left_out_with_a_warning(devices, tmp_path):
    x, y = random_data(BATCH, seed=32)
    parallel = _parallel(alexnet_like(), devices, 2)
    parallel.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                     fc_optimizer=keras.optimizers.Adam(1e-3),
                     loss="sparse_categorical_crossentropy")
    parallel.fit(x, y, batch_size=BATCH, verbose=0)
    with pytest.warns(UserWarning, match="left out"):
        parallel.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is keras.optimizers.SGD
