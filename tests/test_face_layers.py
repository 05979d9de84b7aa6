"""owt_tf.layers.NormalizedDense and owt_tf.losses' margin softmax, against numpy
references: cosine outputs, the combined margin's loss, the straight-through gradient
(finite at cos = +-1), no margin for labels outside the tensor's columns, float32 under a
mixed policy, saving with a model, and a one-device fit."""
import math
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from owt_tf.layers import NormalizedDense, embedding_model
from owt_tf.losses import ArcFace, CosFace, MarginSoftmax


def numpy_cosines(x, kernel):
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    kernel = kernel / np.linalg.norm(kernel, axis=0, keepdims=True)
    return x @ kernel


def numpy_margin_logits(cos, labels, s, m1, m2, m3):
    """Combined-margin logits, written row by row."""
    cos = np.clip(np.asarray(cos, np.float64), -1, 1)
    logits = s * cos
    for row, label in enumerate(labels):
        if 0 <= label < cos.shape[1]:
            theta = math.acos(cos[row, label])
            logits[row, label] = s * (math.cos(m1 * theta + m2) - m3)
    return logits


def numpy_softmax(logits):
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def numpy_margin_loss(cos, labels, s, m1, m2, m3):
    logits = numpy_margin_logits(cos, labels, s, m1, m2, m3)
    log_p = np.log(numpy_softmax(logits))
    return -np.mean(log_p[np.arange(len(labels)), labels])


def random_cosines(rng, n=6, c=5):
    return rng.uniform(-0.95, 0.95, size=(n, c)).astype(np.float32)


# (loss, (s, m1, m2, m3)) for the presets and a combined margin (the ArcFace paper's
# combined-margin form with all three terms)
LOSSES = [
    (ArcFace(), (64.0, 1.0, 0.5, 0.0)),
    (CosFace(), (64.0, 1.0, 0.0, 0.35)),
    (MarginSoftmax(scale=30.0, m1=0.9, m2=0.4, m3=0.15), (30.0, 0.9, 0.4, 0.15)),
]


def test_normalized_dense_outputs_the_cosines_of_rows_and_kernel_columns():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 12)).astype(np.float32) * rng.uniform(0.1, 10, size=(7, 1))
    layer = NormalizedDense(5)
    out = keras.ops.convert_to_numpy(layer(x))
    assert [w.name for w in layer.weights] == ["kernel"] and layer.kernel.shape == (12, 5)
    np.testing.assert_allclose(out, numpy_cosines(x, layer.kernel.numpy()), atol=1e-6)
    assert np.all(np.abs(out) <= 1 + 1e-6)


def test_normalized_dense_has_a_finite_gradient_at_a_zero_row():
    layer = NormalizedDense(3)
    x = tf.constant([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x)
    np.testing.assert_array_equal(out.numpy()[0], 0.0)
    assert np.all(np.isfinite(tape.gradient(out, x).numpy()))


def test_normalized_dense_computes_in_float32_under_a_mixed_policy():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inputs = keras.Input((4,))
        features = keras.layers.Dense(6)(inputs)
        head = NormalizedDense(3)
        outputs = head(features)
        assert features.dtype == "float16"
        assert (head.compute_dtype, head.variable_dtype, outputs.dtype) == (
            "float32", "float32", "float32")
        assert NormalizedDense(3, dtype="mixed_float16").compute_dtype == "float16"
    finally:
        keras.config.set_dtype_policy(previous)


def _face_model(classes=4, features=8, inputs=6):
    x = keras.Input((inputs,))
    embedding = keras.layers.Dense(features, name="embedding")(x)
    return keras.Model(x, NormalizedDense(classes, name="head")(embedding))


def test_a_model_with_the_head_and_loss_saves_and_loads_in_a_fresh_process(tmp_path):
    model = _face_model()
    model.compile(loss=ArcFace(scale=32.0, margin=0.3), optimizer="sgd")
    x = np.random.default_rng(1).normal(size=(5, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", model.predict_on_batch(x))
    model.save(tmp_path / "face.keras")
    script = textwrap.dedent(f"""
        import numpy as np, keras
        import owt_tf.layers, owt_tf.losses
        model = keras.saving.load_model({str(tmp_path / "face.keras")!r})
        x, y = np.load({str(tmp_path / "x.npy")!r}), np.load({str(tmp_path / "y.npy")!r})
        np.testing.assert_allclose(model.predict_on_batch(x), y, rtol=1e-6, atol=1e-6)
        head = model.get_layer("head")
        assert type(head) is owt_tf.layers.NormalizedDense and head.units == 4
        loss = model.loss
        assert type(loss) is owt_tf.losses.ArcFace, type(loss)
        assert (loss.scale, loss.margin) == (32.0, 0.3), loss.get_config()
        print("loaded")
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("loss,margins", LOSSES, ids=["arcface", "cosface", "combined"])
@pytest.mark.parametrize("label_form", ["int64 [N]", "int32 [N,1]", "float32 [N]"])
def test_the_loss_equals_a_numpy_reference(loss, margins, label_form):
    rng = np.random.default_rng(2)
    cos = random_cosines(rng)
    labels = rng.integers(0, cos.shape[1], size=len(cos))
    dtype, shape = label_form.split()
    y_true = labels.astype(dtype).reshape((-1, 1) if shape == "[N,1]" else (-1,))
    got = float(loss(y_true, cos))
    np.testing.assert_allclose(got, numpy_margin_loss(cos, labels, *margins), rtol=1e-5)


@pytest.mark.parametrize("loss,margins", LOSSES, ids=["arcface", "cosface", "combined"])
def test_target_logit_and_logits_equal_the_numpy_margin(loss, margins):
    rng = np.random.default_rng(3)
    cos = np.concatenate([random_cosines(rng), [[1.0, -1.0, 0.0, 0.5, -0.5]]]).astype(np.float32)
    labels = np.concatenate([rng.integers(0, 5, size=6), [1]])
    np.testing.assert_allclose(loss.logits(cos, labels).numpy(),
                               numpy_margin_logits(cos, labels, *margins), rtol=1e-5, atol=1e-4)
    column = cos[:, 0]
    expected = numpy_margin_logits(column[:, None], np.zeros(len(column), int), *margins)[:, 0]
    np.testing.assert_allclose(loss.target_logit(column).numpy(), expected, rtol=1e-5, atol=1e-4)


def test_labels_outside_the_columns_get_no_margin():
    loss = ArcFace()
    cos = random_cosines(np.random.default_rng(4), n=4, c=5)
    logits = loss.logits(cos, np.array([-1, 5, 17, 2])).numpy()
    np.testing.assert_allclose(logits[:3], 64.0 * cos[:3], rtol=1e-6)
    np.testing.assert_allclose(logits[3], numpy_margin_logits(cos[3:], [2], 64.0, 1, 0.5, 0)[0],
                               rtol=1e-5)


def test_cosines_outside_minus_one_one_are_clamped():
    cos = np.array([[1.0001, -1.0001, 0.3]], np.float32)
    logits = CosFace(scale=10.0, margin=0.2).logits(cos, np.array([0])).numpy()
    np.testing.assert_allclose(logits, [[10 * (1 - 0.2), -10.0, 3.0]], rtol=1e-6)


@pytest.mark.parametrize("loss,margins", LOSSES, ids=["arcface", "cosface", "combined"])
def test_gradients_are_finite_at_cos_plus_and_minus_one_at_the_label(loss, margins):
    cos = tf.constant([[1.0, 0.2, -0.3], [0.1, -1.0, 0.4], [1.0, -1.0, 1.0]])
    labels = np.array([0, 1, 1])
    with tf.GradientTape() as tape:
        tape.watch(cos)
        value = loss(labels, cos)
    gradient = tape.gradient(value, cos).numpy()
    assert np.isfinite(float(value)) and np.all(np.isfinite(gradient)), gradient


@pytest.mark.parametrize("loss,margins", LOSSES, ids=["arcface", "cosface", "combined"])
def test_the_gradient_is_the_straight_through_softmax_gradient(loss, margins):
    """d loss / d cos = s * (softmax(margin logits) - onehot) / N: the margin shifts the
    target logit as a constant."""
    rng = np.random.default_rng(5)
    cos = tf.constant(random_cosines(rng, n=8, c=6))
    labels = rng.integers(0, 6, size=8)
    with tf.GradientTape() as tape:
        tape.watch(cos)
        value = loss(labels, cos)
    s = margins[0]
    probabilities = numpy_softmax(numpy_margin_logits(cos.numpy(), labels, *margins))
    expected = s * (probabilities - np.eye(6)[labels]) / len(labels)
    np.testing.assert_allclose(tape.gradient(value, cos).numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("make,match", [
    (lambda: MarginSoftmax(scale=0.0), "scale"),
    (lambda: MarginSoftmax(scale=float("nan")), "scale"),
    (lambda: MarginSoftmax(m1=0.0), "m1"),
    (lambda: MarginSoftmax(m2=-0.1), "m2"),
    (lambda: MarginSoftmax(m2=math.pi / 2), "m2"),
    (lambda: MarginSoftmax(m3=1.0), "m3"),
    (lambda: ArcFace(margin=2.0), "margin"),
    (lambda: CosFace(margin=-0.1), "margin"),
])
def test_bad_arguments_raise_one_line_errors_naming_the_argument(make, match):
    with pytest.raises(ValueError, match=match) as error:
        make()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("loss", [ArcFace(scale=30.0, margin=0.4), CosFace(margin=0.3),
                                  MarginSoftmax(scale=16.0, m1=1.2, m2=0.1, m3=0.05)])
def test_losses_serialize_with_their_own_arguments(loss):
    restored = keras.losses.deserialize(keras.losses.serialize(loss))
    assert type(restored) is type(loss) and restored.get_config() == loss.get_config()
    assert (restored.scale, restored.m1, restored.m2, restored.m3) == (
        loss.scale, loss.m1, loss.m2, loss.m3)


def test_one_device_fit_with_arcface_lowers_the_loss():
    rng = np.random.default_rng(6)
    centres = rng.normal(size=(4, 6))
    labels = rng.integers(0, 4, size=128)
    x = (centres[labels] + 0.3 * rng.normal(size=(128, 6))).astype(np.float32)
    keras.utils.set_random_seed(6)
    model = _face_model()
    model.compile(loss=ArcFace(), optimizer=keras.optimizers.Adam(1e-2))
    history = model.fit(x, labels, batch_size=32, epochs=8, verbose=0).history["loss"]
    assert np.all(np.isfinite(history)) and history[-1] < 0.5 * history[0], history


def test_embedding_model_returns_what_feeds_the_last_head():
    model = _face_model()
    x = np.random.default_rng(7).normal(size=(3, 6)).astype(np.float32)
    embedding = embedding_model(model)
    expected = model.get_layer("embedding")(x)
    np.testing.assert_allclose(embedding.predict_on_batch(x), expected.numpy(), rtol=1e-6)
    assert embedding.get_layer("embedding") is model.get_layer("embedding")  # shared weights
    with pytest.raises(ValueError, match="NormalizedDense"):
        embedding_model(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
