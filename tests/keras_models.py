"""Small user-style Keras models and data for the Keras-path tests (built on one device)."""
from __future__ import annotations

from typing import Tuple

import keras
import numpy as np
import tensorflow as tf


def alexnet_like(seed: int = 1, softmax: bool = True, input_shape=(16, 16, 3)) -> keras.Model:
    """An AlexNet-shaped Sequential: convs, flatten, two ReLU Dense layers, class layer."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(8, 3, activation="relu", name="conv1"),
        keras.layers.MaxPooling2D(name="pool1"),
        keras.layers.Conv2D(8, 3, activation="relu", name="conv2"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(32, activation="relu", name="fc1"),
        keras.layers.Dense(16, activation="relu", name="fc2"),
        keras.layers.Dense(10, activation="softmax" if softmax else None, name="predictions"),
    ], name="alexnet_like")


def conv_dense_net(input_shape, hidden: int, classes: int, activation, seed: int,
                   name: str, class_layer: str) -> keras.Model:
    """One small conv layer, Flatten, a ReLU Dense layer `fc1` and a class layer."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(hidden, activation="relu", name="fc1"),
        keras.layers.Dense(classes, activation=activation, name=class_layer),
    ], name=name)


def single_dense_head(seed: int = 2) -> keras.Model:
    """A functional conv net whose head is one Dense (only the classes are sharded)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(h), name="gap_net")


def batchnorm_trunk(seed: int = 3, input_shape=(8, 8, 1)) -> keras.Model:
    """A functional trunk with BatchNormalization and a residual add; Dropout in the head."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(input_shape)
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    r = keras.layers.Conv2D(16, 3, padding="same")(h)
    h = keras.layers.Add()([h, keras.layers.BatchNormalization()(r)])
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu", name="fc1")(h)
    h = keras.layers.Dropout(0.3, name="drop1")(h)
    outputs = keras.layers.Dense(10, activation="softmax", name="predictions")(h)
    return keras.Model(inputs, outputs, name="bn_net")


def random_data(n: int, shape=(16, 16, 3), classes: int = 10, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n,) + tuple(shape)).astype(np.float32),
            rng.integers(0, classes, size=n).astype(np.int32))


def digits() -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits in [0, 1], a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    y = d.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def copy_of(model: keras.Model) -> keras.Model:
    """The same architecture with the same weights, on one device."""
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    return clone


def max_rel_diff(a, b) -> float:
    """Worst relative difference over two lists of arrays (scale: the reference's max)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, (x.shape, y.shape)
        worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-6)))
    return worst


def update_rel_diff(before, got, want) -> float:
    """Worst per-tensor norm of the difference of two updates (`got - before` against
    `want - before`), relative to the reference update's norm. A weight-relative check would
    miss a wrong rate or decay: after a few steps an update is ~1e-5 of its weight."""
    assert len(before) == len(got) == len(want), (len(before), len(got), len(want))
    worst = 0.0
    for b, g, w in zip(before, got, want):
        b, g, w = (np.asarray(t, np.float64) for t in (b, g, w))
        assert b.shape == g.shape == w.shape, (b.shape, g.shape, w.shape)
        scale = max(np.linalg.norm(w - b), 1e-12)
        worst = max(worst, float(np.linalg.norm((g - b) - (w - b)) / scale))
    return worst


def dataset(x, y, batch: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def round_rows(scheme, k, b, r):
    if scheme == "owt-b":
        return np.arange(r * b, (r + 1) * b)
    s = b // k
    return np.concatenate([np.arange(j * b + r * s, j * b + (r + 1) * s) for j in range(k)])


def worker_reference(model, x, y, k, scheme, steps, batch, lr, momentum, trunk_opt=None,
                     fc_opt=None):
    """One device: per step, K FC updates on the rounds' rows, then one trunk update from
    the mean of the rounds' activation gradients (each taken at that round's FC weights)."""
    trunk = keras.Model(model.inputs, model.get_layer("flatten").output)
    dense = [model.get_layer(n) for n in ("fc1", "fc2", "predictions")]
    fc_vars = [v for layer in dense for v in layer.trainable_variables]
    trunk_opt = trunk_opt or keras.optimizers.SGD(lr, momentum=momentum)
    fc_opt = fc_opt or keras.optimizers.SGD(lr, momentum=momentum)
    losses = []
    for step in range(steps):
        xb, yb = x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch]
        with tf.GradientTape() as tape:
            features = trunk(xb)
        feature_grad = tf.zeros_like(features)
        for r in range(k):
            rows = round_rows(scheme, k, batch // k, r)
            with tf.GradientTape() as round_tape:
                round_tape.watch(features)
                h = tf.gather(features, rows)
                for layer in dense:
                    h = layer(h)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb[rows], h))
            g_features, *g_fc = round_tape.gradient(loss, [features] + fc_vars)
            feature_grad += tf.convert_to_tensor(g_features) / k
            fc_opt.apply_gradients(zip(g_fc, fc_vars))
            losses.append(float(loss))
        grads = tape.gradient(features, trunk.trainable_variables, output_gradients=feature_grad)
        trunk_opt.apply_gradients(zip(grads, trunk.trainable_variables))
    return losses
