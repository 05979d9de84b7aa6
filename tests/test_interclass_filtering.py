"""Partial FC v2's inter-class filtering (`interclass_filtering_threshold`): a non-target
cosine above the threshold counts as 0 for that row. The loss against numpy written here,
and on the shards (with and without class sampling) against it too: the sharded loss a fit
reports at rate 0 equals numpy's on the model's own cosines, and a step's update equals
one-device Keras `fit` with the same loss."""
import keras
import numpy as np
import pytest

import owt_tf
from keras_models import copy_of, update_rel_diff
from owt_tf.layers import NormalizedDense
from owt_tf.losses import ArcFace, CosFace

K, BATCH, CLASSES, THRESHOLD = 4, 16, 24, 0.2


def numpy_filtered_arcface(cos, labels, scale=64.0, margin=0.5, threshold=THRESHOLD,
                           cosface=False):
    """Per-example loss: cosines clamped; non-targets above the threshold set to 0; the
    margin at the label; softmax cross-entropy."""
    cos = np.clip(np.asarray(cos, np.float64), -1, 1)
    rows = np.arange(len(labels))
    target = np.zeros_like(cos, bool)
    target[rows, labels] = True
    filtered = np.where((cos > threshold) & ~target, 0.0, cos)
    logits = scale * filtered
    c = cos[rows, labels]
    logits[rows, labels] = scale * ((c - margin) if cosface else np.cos(np.arccos(c) + margin))
    top = logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    return log_norm - logits[rows, labels]


@pytest.mark.parametrize("loss,cosface", [(ArcFace, False), (CosFace, True)])
def test_the_loss_equals_numpy(loss, cosface):
    rng = np.random.default_rng(0)
    cos = rng.uniform(-0.5, 0.9, size=(32, CLASSES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, 32)
    cos[np.arange(32), labels] = rng.uniform(0.3, 0.9, 32)  # targets above the threshold too
    got = loss(reduction=None, interclass_filtering_threshold=THRESHOLD)(labels, cos)
    want = numpy_filtered_arcface(cos, labels, margin=0.35 if cosface else 0.5,
                                  cosface=cosface)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # the filter changes the loss here (the case has teeth)
    unfiltered = numpy_filtered_arcface(cos, labels, threshold=1.0,
                                        margin=0.35 if cosface else 0.5, cosface=cosface)
    assert np.abs(unfiltered - want).max() > 0.1
    with pytest.raises(ValueError, match="interclass_filtering_threshold"):
        loss(interclass_filtering_threshold=1.5)


def _face_net(seed=3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Flatten()(keras.layers.Conv2D(4, 3, activation="relu")(inputs))
    h = keras.layers.Dense(8, name="embedding")(h)  # 8 wide: cosines spread above 0.2
    return keras.Model(inputs, NormalizedDense(CLASSES, name="classes")(h))


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 8, 8, 3)).astype(np.float32),
            rng.integers(0, CLASSES, n).astype(np.int32))


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_on_the_shards_it_equals_numpy_and_one_device_keras(devices, sample_rate):
    reference = _face_net()
    x, y = _data(BATCH)
    loss = lambda: ArcFace(interclass_filtering_threshold=THRESHOLD)  # noqa: E731
    strategy = owt_tf.HybridStrategy(devices=devices[:K], scheme="owt-b",
                                     sample_rate=sample_rate)
    with strategy.scope():
        parallel = owt_tf.parallelize(copy_of(reference), seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss())
    assert parallel.head.loss_mode == "sharded"
    got = parallel.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"][0]
    cos = reference.predict(x, verbose=0)
    assert (cos > THRESHOLD).mean() > 0.1  # the filter has work to do
    if sample_rate == 1.0:
        assert got == pytest.approx(numpy_filtered_arcface(cos, y).mean(), rel=1e-5)
        # one step at a real rate: the update equals one-device Keras with the same loss
        with strategy.scope():
            stepped = owt_tf.parallelize(copy_of(reference), seed=0)
            stepped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
        stepped.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        plain = copy_of(reference)
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
        plain.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        assert update_rel_diff(reference.get_weights(), stepped.to_keras_model().get_weights(),
                               plain.get_weights()) < 1e-4
    else:
        # sampled: every label is kept, so the loss is at most the full softmax's and at
        # least the loss over the labels' own columns; it stays finite and below numpy's
        assert 0 < got <= numpy_filtered_arcface(cos, y).mean() + 1e-5
