"""Large heads on the Keras path: a cross-entropy and accuracy metrics computed on the FC
shards (no [rows, classes] logits gather) equal plain one-device Keras in fit and evaluate;
`predict(top_k=)` equals the top classes of plain Keras' predict; what falls back to the
gathered logits, and what HybridStrategy(loss='sharded') refuses."""
from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import owt_tf
from keras_models import conv_dense_net, copy_of, update_rel_diff
from owt_tf.planner import ledger
from owt_tf.fit import model as keras_model
from owt_tf.fit.compiling import CompileError

CLASSES, K, BATCH, LR = 2003, 4, 32, 0.1  # 2003: the class layer is padded to 2004


def _big_head(softmax: bool, seed: int = 5) -> keras.Model:
    return conv_dense_net((8, 8, 1), 32, CLASSES, "softmax" if softmax else None, seed,
                          "big_head", "classes")


def _data(model: keras.Model, n: int, seed: int = 0):
    """Images, and labels that the model ranks 1st, 2nd, ... 7th, 100th and 1500th in turn:
    accuracy and top-5 accuracy far from 0 and from 1, labels among the candidates at every
    rank and labels outside them."""
    x = np.random.default_rng(seed).normal(size=(n, 8, 8, 1)).astype(np.float32)
    order = np.argsort(-model.predict(x, verbose=0), axis=1, kind="stable")
    ranks = np.array([0, 1, 2, 3, 4, 5, 6, 99, 1499])[np.arange(n) % 9]
    return x, order[np.arange(n), ranks].astype(np.int32)


def _parallel(model, devices, scheme="owt-b", loss_mode="gathered", **compile_kw):
    strategy = owt_tf.HybridStrategy(devices=devices[:K], scheme=scheme, loss=loss_mode)
    with strategy.scope():
        parallel = owt_tf.parallelize(model, seed=0)
        if compile_kw:
            parallel.compile(**compile_kw)
    return parallel


def _sparse_softmax():
    return dict(loss="sparse_categorical_crossentropy",
                metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(5, name="top5")])


def _sparse_logits():
    return dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
                         "sparse_top_k_categorical_accuracy"])


def _one_hot_smoothed():
    return dict(loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1),
                metrics=["accuracy", keras.metrics.TopKCategoricalAccuracy(5, name="top5")])


CASES = {  # name: (softmax head, compile settings, one-hot labels, scheme)
    "sparse-softmax-owt-b": (True, _sparse_softmax, False, "owt-b"),
    "sparse-logits-owt-a": (False, _sparse_logits, False, "owt-a"),
    "one-hot-smoothed-owt-c": (False, _one_hot_smoothed, True, "owt-c"),
}


def _ledger_of(run):
    """The bytes by purpose of the collectives traced while `run()` traces its step."""
    with ledger.recording(ledger.TrafficLedger()) as recorded:
        result = run()
    return recorded, result


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_loss_and_metrics_equal_plain_keras(devices, case):
    """fit (History), the weights' updates and evaluate (a padded last batch) equal plain
    Keras; the traced train and test steps move no [rows, classes] logits."""
    softmax, settings, one_hot, scheme = CASES[case]
    reference = _big_head(softmax)
    x, y = _data(reference, 3 * BATCH)
    if one_hot:
        y = np.eye(CLASSES, dtype=np.float32)[y]
    parallel = _parallel(copy_of(reference), devices, scheme, optimizer=keras.optimizers.SGD(LR),
                         **settings())
    assert parallel.head.loss_mode == "sharded"
    before = reference.get_weights()
    reference.compile(optimizer=keras.optimizers.SGD(LR), **settings())
    want = reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    train, got = _ledger_of(lambda: parallel.fit(x, y, batch_size=BATCH, shuffle=False,
                                                 verbose=0).history)
    assert update_rel_diff(before, parallel.to_keras_model().get_weights(),
                           reference.get_weights()) < 1e-4
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert 0.05 < want["accuracy"][0] < 0.5 and want["accuracy"][0] < max(
        v[0] for n, v in want.items() if n not in ("loss", "accuracy"))  # not trivially 0 or 1
    test, got_eval = _ledger_of(lambda: parallel.evaluate(x[:70], y[:70], batch_size=BATCH,
                                                          verbose=0, return_dict=True))
    want_eval = reference.evaluate(x[:70], y[:70], batch_size=BATCH, verbose=0, return_dict=True)
    assert got_eval == pytest.approx(want_eval, rel=1e-5)
    whole_logits = ledger.all_gather_cost(BATCH * (CLASSES + 1) // K * 4, K)  # one round's gather
    for recorded in (train, test):
        assert 0 < recorded.by_purpose[ledger.LOGITS] < whole_logits / 10, recorded.summary()


@pytest.mark.slow
def test_sharded_loss_without_metrics_evaluates_as_plain_keras(devices):
    """No metric: the head gathers no candidates; evaluate's loss equals plain Keras'."""
    reference = _big_head(False)
    x, y = _data(reference, 70, seed=3)
    settings = dict(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    parallel = _parallel(copy_of(reference), devices, **settings)
    assert parallel.head.loss_mode == "sharded" and parallel.head.loss.candidates_k == 0
    reference.compile(**settings)
    assert parallel.evaluate(x, y, batch_size=BATCH, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5)


@pytest.mark.slow
def test_other_metrics_fall_back_to_the_gathered_logits(devices):
    """A metric the candidates cannot serve (here a cross-entropy metric) keeps the gathered
    logits, and its results still equal plain Keras'; the logits gather is in the step."""
    reference = _big_head(True)
    x, y = _data(reference, 2 * BATCH, seed=1)

    def settings():
        return dict(optimizer=keras.optimizers.SGD(LR), loss="sparse_categorical_crossentropy",
                    metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(name="ce")])

    parallel = _parallel(copy_of(reference), devices, **settings())
    assert parallel.head.loss_mode == "gathered"
    reference.compile(**settings())
    want = reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    recorded, got = _ledger_of(lambda: parallel.fit(x, y, batch_size=BATCH, shuffle=False,
                                                    verbose=0).history)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert recorded.by_purpose[ledger.LOGITS] >= ledger.all_gather_cost(BATCH * 2004 // K * 4, K)


@pytest.mark.slow
@pytest.mark.parametrize("softmax", [True, False])
def test_predict_top_k_equals_the_top_classes_of_plain_predict(devices, softmax):
    """predict(x, top_k=5): (scores, ids) [rows, 5], the ids those of numpy's stable top-5
    of plain Keras' outputs, the scores those outputs (softmax: with the global normalizer);
    70 rows: the last batch padded. The traced step gathers candidates, not the outputs."""
    reference = _big_head(softmax, seed=6)
    x = np.random.default_rng(2).normal(size=(70, 8, 8, 1)).astype(np.float32)
    parallel = _parallel(copy_of(reference), devices)
    recorded, (scores, ids) = _ledger_of(
        lambda: parallel.predict(x, batch_size=BATCH, top_k=5, verbose=0))
    want = reference.predict(x, verbose=0)
    top = np.argsort(-want, axis=1, kind="stable")[:, :5]
    assert scores.shape == ids.shape == (70, 5)
    np.testing.assert_array_equal(ids, top)
    np.testing.assert_allclose(scores, np.take_along_axis(want, top, 1), rtol=1e-5, atol=1e-9)
    assert recorded.by_purpose[ledger.LOGITS] < ledger.all_gather_cost(BATCH * 2004 // K * 4, K) / 10
    np.testing.assert_allclose(parallel.predict(x, batch_size=BATCH, verbose=0), want,
                               rtol=1e-5, atol=1e-7)  # and whole outputs without top_k


@pytest.mark.slow
def test_predict_of_large_outputs_warns_and_suggests_top_k(devices, monkeypatch):
    monkeypatch.setattr(keras_model, "LARGE_OUTPUTS", 40 * CLASSES)
    parallel = _parallel(_big_head(True), devices)
    x = np.zeros((64, 8, 8, 1), np.float32)
    with pytest.warns(UserWarning, match="top_k"):
        parallel.predict(x, batch_size=BATCH, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.predict(x, batch_size=BATCH, top_k=3, verbose=0)
    with pytest.raises(ValueError, match="top_k"):
        parallel.predict(x, top_k=CLASSES + 1)


@pytest.mark.parametrize("settings,why", [
    (dict(loss="sparse_categorical_crossentropy"), "does not read the logits"),
    (dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          metrics=[keras.metrics.AUC()]), "needs each row's whole outputs"),
    (dict(loss="kl_divergence"), "not a categorical cross-entropy"),
])
def test_strategy_sharded_loss_refuses_what_it_cannot_compute(devices, settings, why):
    """HybridStrategy(loss='sharded') on a linear head: a loss that reads probabilities, a
    metric that needs whole rows, another loss: refused at compile in one line; a logits
    cross-entropy with accuracy metrics is accepted."""
    parallel = _parallel(_big_head(False), devices, loss_mode="sharded")
    with pytest.raises(CompileError, match=why) as err:
        parallel.compile(optimizer="sgd", **settings)
    assert "\n" not in str(err.value)
    parallel.compile(optimizer="sgd", **_sparse_logits())
    assert parallel.head.loss_mode == "sharded" and parallel.head.loss.candidates_k == 5


def test_auto_choosing_the_sharded_loss_never_makes_compile_refuse(devices, monkeypatch):
    """scheme='auto' picks the loss before the compiled loss is known: when it picked
    'sharded' and the loss cannot be, compile warns and gathers instead of refusing."""
    from owt_tf.planner import auto
    from owt_tf.planner.cost_model import preset

    monkeypatch.setattr(auto, "run_hardware", lambda devices: preset("h100-nvlink"))
    monkeypatch.setattr(auto, "choose", lambda *a, **kw: auto.AutoChoice(
        "owt-b", "gather", "sharded", "test"))
    strategy = owt_tf.HybridStrategy(devices=devices[:K], scheme="auto")
    with strategy.scope():
        parallel = owt_tf.parallelize(_big_head(False), seed=0)
    assert strategy.parallel_plan.loss == "sharded"
    with pytest.warns(UserWarning, match="gathered"):
        parallel.compile(optimizer="sgd", loss="kl_divergence")
    assert parallel.head.loss_mode == "gathered"
    parallel.compile(optimizer="sgd", **_sparse_logits())
    assert parallel.head.loss_mode == "sharded"
