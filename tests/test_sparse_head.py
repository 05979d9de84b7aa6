"""Heads at face-recognition scale (small heads here; the 10M-class figures are the bench's):
a model never built is split with its head drawn shard by shard from the Dense layer's own
initializer, with the distribution the whole layer would get; shards too large for one
piece are made a block at a time and equal the whole; optimizers that cannot update
sparsely are refused under sampling; a sampled run saved at one K resumes at another with
its weights, velocities and step count, and goes on moving only sampled classes."""
from __future__ import annotations

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import owt_tf
from owt_tf.fit.compiling import CompileError
from owt_tf.layers import NormalizedDense
from owt_tf.models import head_weights
from owt_tf.models.head_weights import ArrayWeights, UndrawableInitializer
from owt_tf.models.split import UnsupportedModel
from owt_tf.parallel.head import layout
from owt_tf.parallel.head.layout import ShardedDense, assemble

FEATURES, CLASSES = 48, 4003  # padded to 4004 over 4 and over 2
SIDE = 8


def _unbuilt(classes: int = CLASSES, cosine: bool = False, initializer="glorot_uniform"):
    head = (NormalizedDense(classes, name="classes", kernel_initializer=initializer) if cosine
            else keras.layers.Dense(classes, name="classes", kernel_initializer=initializer))
    return keras.Sequential([keras.layers.Conv2D(FEATURES, 3, name="conv"),
                             keras.layers.GlobalAveragePooling2D(name="pool"), head],
                            name="unbuilt")


def _parallel(model, devices, k, rate=1.0, seed=0, optimizer=None):
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme="owt-b", sample_rate=rate)
    with strategy.scope():
        parallel = owt_tf.parallelize(model, seed=seed, input_shape=(SIDE, SIDE, 3))
        if optimizer is not None:
            parallel.compile(optimizer=optimizer,
                             loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return parallel


# -- drawn shard by shard -------------------------------------------------------------------
@pytest.mark.parametrize("cosine,rate", [(False, 1.0), (True, 0.1)])
def test_an_unbuilt_head_is_drawn_with_the_whole_layers_distribution(devices, cosine, rate):
    """Glorot uniform over the whole [48, 4003] kernel: bound sqrt(6 / (48 + 4003)). Every
    shard's draw stays inside it and fills it (a per-shard fan would give a bound of
    sqrt(6 / (48 + 1001)), twice as wide), with the uniform's standard deviation; the bias
    is zero; the same seed draws the same head, another seed another."""
    whole = np.sqrt(6.0 / (FEATURES + CLASSES))
    kernel, bias = _parallel(_unbuilt(cosine=cosine), devices, 4, rate).fc_weights()[-1]
    assert kernel.shape == (FEATURES, CLASSES)
    assert np.abs(kernel).max() <= whole and np.abs(kernel).max() > 0.99 * whole
    assert kernel.std() == pytest.approx(whole / np.sqrt(3.0), rel=0.02)
    assert np.abs(kernel.mean()) < 0.01 * whole
    np.testing.assert_array_equal(bias, 0.0)
    # shards are not copies of one draw
    assert not np.allclose(kernel[:, :1001], kernel[:, 1001:2002])
    if cosine:  # the seed decides the draw (checked once: each split costs a parallelize)
        again = _parallel(_unbuilt(cosine=cosine), devices, 4, rate).fc_weights()[-1][0]
        other = _parallel(_unbuilt(cosine=cosine), devices, 4, rate, seed=1).fc_weights()[-1][0]
        np.testing.assert_array_equal(again, kernel)
        assert not np.allclose(other, kernel)


def test_he_normal_keeps_the_whole_layers_fan_in(devices):
    """He normal scales by fan_in only, which a column shard keeps: std sqrt(2 / 48)
    (truncated normal: Keras' draw, stddev corrected for the truncation)."""
    kernel = _parallel(_unbuilt(initializer="he_normal"), devices, 4).fc_weights()[-1][0]
    assert kernel.std() == pytest.approx(np.sqrt(2.0 / FEATURES), rel=0.03)


def test_an_unbuilt_model_trains_and_saves_as_a_plain_model(devices, tmp_path):
    """The unbuilt model's run: fit, then `save` gives a plain built model with the trained
    head, its layer's initializer as the user wrote it."""
    parallel = _parallel(_unbuilt(cosine=True), devices, 4, 0.5,
                         optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, SIDE, SIDE, 3)).astype(np.float32)
    y = rng.integers(0, CLASSES, 32).astype(np.int32)
    parallel.fit(x, y, batch_size=32, epochs=2, verbose=0)
    path = str(tmp_path / "m.keras")
    parallel.save(path)
    plain = keras.models.load_model(path, compile=False)
    np.testing.assert_array_equal(plain.get_layer("classes").kernel.numpy(),
                                  parallel.fc_weights()[-1][0])
    assert isinstance(plain.get_layer("classes").kernel_initializer,
                      keras.initializers.GlorotUniform)


def test_unbuilt_models_need_an_input_shape_and_a_drawable_initializer(devices):
    strategy = owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-b")
    with strategy.scope():
        with pytest.raises(UnsupportedModel, match="input_shape="):
            owt_tf.parallelize(_unbuilt())
        with pytest.raises(UndrawableInitializer, match="Orthogonal cannot be drawn a shard"):
            owt_tf.parallelize(_unbuilt(initializer="orthogonal"), input_shape=(SIDE, SIDE, 3))
        built = keras.Sequential([keras.Input((SIDE, SIDE, 3)), *_unbuilt().layers])
        with pytest.raises(UnsupportedModel, match="input_shape= is for a Sequential"):
            owt_tf.parallelize(built, input_shape=(SIDE, SIDE, 3))


# -- built inside the scope ------------------------------------------------------------------
class _Recorded(keras.initializers.GlorotUniform):
    """Glorot uniform that records the shapes it draws (not those traced into a graph)."""
    drawn: list = []

    def __call__(self, shape, dtype=None):
        if tf.executing_eagerly():
            _Recorded.drawn.append(tuple(shape))
        return super().__call__(shape, dtype)


keras.saving.register_keras_serializable("test_sparse_head")(_Recorded)


def _built(functional: bool, cosine: bool):
    """_unbuilt()'s model built on a keras.Input: functionally, or as a built Sequential."""
    head = (NormalizedDense(CLASSES, name="classes", kernel_initializer=_Recorded()) if cosine
            else keras.layers.Dense(CLASSES, name="classes", kernel_initializer=_Recorded()))
    trunk = [keras.layers.Conv2D(FEATURES, 3, name="conv"),
             keras.layers.GlobalAveragePooling2D(name="pool")]
    if not functional:
        return keras.Sequential([keras.Input((SIDE, SIDE, 3)), *trunk, head], name="built")
    inputs = keras.Input((SIDE, SIDE, 3))
    return keras.Model(inputs, head(trunk[1](trunk[0](inputs))), name="built")


@pytest.mark.parametrize("functional,cosine", [(True, False), (False, True)])
def test_a_head_built_in_the_scope_is_drawn_only_shard_by_shard(monkeypatch, devices,
                                                                functional, cosine):
    """A class layer built inside strategy.scope() (a keras.Input model, functional or a
    built Sequential) with a kernel over the size limit gets no value there; parallelize
    draws its shards exactly as for a model never built (the same seed: the same head, so
    the whole layer's distribution), keeps the user's trunk, and neither it, its config
    check nor its clone draws the whole kernel, then or when the scope closes."""
    monkeypatch.setattr(head_weights, "UNDRAWN_KERNEL_BYTES", FEATURES * CLASSES * 4)
    _Recorded.drawn = []
    strategy = owt_tf.HybridStrategy(devices=devices[:4], scheme="owt-b")
    with strategy.scope():
        model = _built(functional, cosine)
        kernel = model.get_layer("classes").kernel
        assert head_weights.is_undrawn(kernel)
        trunk = [w.numpy() for w in model.get_layer("conv").weights]
        parallel = owt_tf.parallelize(model, seed=7)
    assert _Recorded.drawn == []
    assert not bool(kernel.value.is_initialized())  # not drawn when the scope closed
    never_built = _parallel(_unbuilt(cosine=cosine), devices, 4, seed=7)
    for (k1, b1), (k2, b2) in zip(parallel.fc_weights(), never_built.fc_weights()):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(b1, b2)
    for mine, theirs in zip(parallel.get_layer("conv").get_weights(), trunk):
        np.testing.assert_array_equal(mine, theirs)


def test_kernels_built_in_the_scope_given_values_or_not_parallelized(monkeypatch, devices):
    """Values given to an undrawn kernel in the scope (set_weights, load_weights) are the
    head parallelize shards; a model no parallelize took is drawn whole when the outermost
    scope closes (not an inner one), with its initializer's distribution."""
    monkeypatch.setattr(head_weights, "UNDRAWN_KERNEL_BYTES", FEATURES * CLASSES * 4)
    strategy = owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-b")
    mine = np.random.default_rng(0).normal(size=(FEATURES, CLASSES)).astype(np.float32)
    with strategy.scope():
        loaded = _built(functional=True, cosine=False)
        loaded.get_layer("classes").kernel.assign(mine)
        parallel = owt_tf.parallelize(loaded, seed=0)
        kept = _built(functional=True, cosine=False)
        with strategy.scope():
            pass
        assert head_weights.is_undrawn(kept.get_layer("classes").kernel)
    np.testing.assert_array_equal(parallel.fc_weights()[-1][0], mine)
    kernel = kept.get_layer("classes").kernel.numpy()
    whole = np.sqrt(6.0 / (FEATURES + CLASSES))
    assert np.abs(kernel).max() <= whole and kernel.std() == pytest.approx(whole / np.sqrt(3),
                                                                           rel=0.02)


def test_an_undrawn_trunk_kernel_is_drawn_whole_for_the_trunk(monkeypatch, devices):
    """A face model's embedding Dense is the trunk's (the cosine class layer alone is the
    head): over the size limit in the scope it has no value either, and parallelize draws
    it whole for the mirrored trunk, which then trains."""
    monkeypatch.setattr(head_weights, "UNDRAWN_KERNEL_BYTES", FEATURES * FEATURES * 4)
    strategy = owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-b")
    with strategy.scope():
        inputs = keras.Input((SIDE, SIDE, 3))
        h = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(FEATURES, 3)(inputs))
        h = keras.layers.BatchNormalization()(keras.layers.Dense(FEATURES, name="embed")(h))
        model = keras.Model(inputs, NormalizedDense(CLASSES, name="classes")(h))
        assert head_weights.is_undrawn(model.get_layer("embed").kernel)
        parallel = owt_tf.parallelize(model, seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(0.1),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    embed = parallel.get_layer("embed").kernel.numpy()
    assert embed.std() == pytest.approx(np.sqrt(2.0 / (2 * FEATURES)), rel=0.1)  # Glorot
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, SIDE, SIDE, 3)).astype(np.float32)
    history = parallel.fit(x, rng.integers(0, CLASSES, 8), batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.parametrize("class_major", [False, True])
def test_shards_made_a_block_at_a_time_equal_the_whole(monkeypatch, devices, class_major):
    """A shard above the block size is filled a block of columns at a time, the padding of
    the last shard included: the layer joined again is the whole it was cut from."""
    monkeypatch.setattr(layout, "BLOCK_BYTES", 7 * 4 * 12)  # 7 columns of 12 a block
    rng = np.random.default_rng(3)
    kernel = rng.normal(size=(12, 103)).astype(np.float32)
    bias = rng.normal(size=(103,)).astype(np.float32)
    layer = ShardedDense("fc", ArrayWeights(kernel, bias), None, layout.COL, devices[:4],
                         class_major=class_major)
    stored = layer.kernels[0].shape
    assert stored == ((26, 12) if class_major else (12, 26))
    got_kernel, got_bias = assemble(layer, [v.numpy() for v in layer.kernels],
                                    [b.numpy() for b in layer.biases])
    np.testing.assert_array_equal(got_kernel, kernel)
    np.testing.assert_array_equal(got_bias, bias)
    np.testing.assert_array_equal(layer.kernels[3].numpy()[..., -1] if not class_major
                                  else layer.kernels[3].numpy()[-1], 0.0)


# -- optimizers under sampling ----------------------------------------------------------------
def test_an_optimizer_without_a_sparse_update_is_refused_under_sampling(devices):
    """Adam's moments and bias correction have no sparse form equal to its dense update:
    refused in one line naming the fix, never a silent dense update."""
    with pytest.raises(CompileError, match=r"optimizer Adam: sample_rate=0.1 .*SGD") as err:
        _parallel(_unbuilt(), devices, 4, 0.1, optimizer=keras.optimizers.Adam())
    assert "\n" not in str(err.value)
    # at rate 1 Adam is fine (the dense update)
    _parallel(_unbuilt(), devices, 4, 1.0, optimizer=keras.optimizers.Adam())


# -- a sampled run resumed at another K -------------------------------------------------------
def _batches(n, seed):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(32, SIDE, SIDE, 3)).astype(np.float32),
             rng.integers(0, CLASSES, 32).astype(np.int32)) for _ in range(n)]


@pytest.mark.parametrize("k_from,k_to", [(4, 2), (2, 4)])
def test_a_sampled_run_resumes_at_another_k(monkeypatch, devices, tmp_path, k_from, k_to):
    """Two sampled steps at K=k_from, save_weights, load into the same model split over
    k_to: the head's weights, its SGD velocities and the step count are the saved ones
    (whole, so the split does not matter); the next step moves only the classes the new
    K's sample kept (a class whose velocity is nonzero but was not sampled waits). Shards
    are made, written and read in blocks of 300 classes, as a 10M-class head's are in
    64 MB blocks."""
    monkeypatch.setattr(layout, "BLOCK_BYTES", 300 * 4 * FEATURES)
    sgd = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731
    first = _parallel(_unbuilt(cosine=True), devices, k_from, 0.1, seed=5, optimizer=sgd())
    for x, y in _batches(2, 0):
        first.train_on_batch(x, y)
    path = str(tmp_path / "run.weights.h5")
    first.save_weights(path)
    saved = first.head_state()
    assert np.abs(saved["fc0_kernel_slot0"]).max() > 0  # velocities to carry
    # written a shard at a time, read back as the whole [features, classes] tensors
    found = {}

    def keep(name, obj):  # returns None: visititems stops at the first other value
        if isinstance(obj, h5py.Dataset):
            found[name.rsplit("/", 1)[-1]] = obj[()]

    with h5py.File(path, "r") as f:
        f.visititems(keep)
    for key in ("fc0_kernel", "fc0_kernel_slot0", "fc0_bias"):
        np.testing.assert_array_equal(found[key], saved[key])
    assert found["fc0_kernel"].shape == (FEATURES, CLASSES)

    second = _parallel(_unbuilt(cosine=True), devices, k_to, 0.1, seed=5, optimizer=sgd())
    second.load_weights(path)
    assert second.head.num_shards == k_to
    restored = second.head_state()
    for key in ("fc0_kernel", "fc0_kernel_slot0"):
        np.testing.assert_array_equal(restored[key], saved[key])
    assert int(second.optimizer.iterations.numpy()) == int(first.optimizer.iterations.numpy())

    x, y = _batches(1, 1)[0]
    before = second.head_state()
    logs = second.train_on_batch(x, y, return_dict=True)
    after = second.head_state()
    moved = np.any(after["fc0_kernel"] != before["fc0_kernel"], axis=0)
    velocity_moved = np.any(after["fc0_kernel_slot0"] != before["fc0_kernel_slot0"], axis=0)
    np.testing.assert_array_equal(moved, velocity_moved)
    assert 0.05 * CLASSES < moved.sum() < 0.2 * CLASSES  # about the rate, plus positives
    assert moved[y].all()
    waiting = (np.abs(before["fc0_kernel_slot0"]).max(axis=0) > 0) & ~moved
    assert waiting.sum() > 10
    assert np.isfinite(logs["loss"])


def test_loss_scaled_sampled_updates_skip_together_and_move_only_sampled_classes(devices):
    """mixed_float16 with Keras' LossScaleOptimizer and a class sample: an overflowing
    step moves nothing anywhere (the sample's rows cross into the cross-replica verdict);
    once the scale is low enough the update applies, to the sampled classes only."""
    from owt_tf.parallel.precision import keras_policy

    with keras_policy("float16"):
        model = _unbuilt(cosine=True)
    strategy = owt_tf.HybridStrategy(devices=devices[:4], scheme="owt-b", sample_rate=0.1)
    with strategy.scope():
        parallel = owt_tf.parallelize(model, seed=2, input_shape=(SIDE, SIDE, 3))
        parallel.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0 ** 40),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    (x, y), = _batches(1, 4)
    before = parallel.head_state()["fc0_kernel"]
    parallel.train_on_batch(x, y)
    np.testing.assert_array_equal(parallel.head_state()["fc0_kernel"], before)
    for _ in range(40):
        parallel.train_on_batch(x, y)
        if int(parallel.optimizer.iterations.numpy()):
            break
    assert int(parallel.optimizer.iterations.numpy()) == 1
    moved = np.any(parallel.head_state()["fc0_kernel"] != before, axis=0)
    assert moved[y].all() and 0.05 * CLASSES < moved.sum() < 0.2 * CLASSES
