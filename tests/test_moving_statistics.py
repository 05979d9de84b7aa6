"""BatchNormalization's moving statistics are one per model, as PyTorch DDP's
broadcast_buffers keeps them for arcface_torch: whenever they are read (evaluation,
features, a save, an export, the end of a fit) every replica holds the same, their mean over
the replicas, which is what averaging after every step would give (the update is linear).
For the CLI's Trainer and for `parallelize(model).fit`. So an image's embedding does not
depend on the row or the replica that embeds it, and an export (one copy) embeds as the run
does.

Under plain MirroredStrategy each replica keeps its own (Keras creates them with
aggregation NONE): on the code before this, `embed(x)` and `embed(x[::-1])[::-1]` differed
by ~2e-3 at K=4."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import owt_tf
from owt_tf.config.presets import PRESETS
from owt_tf.layers import NormalizedDense
from owt_tf.losses import ArcFace
from owt_tf.models.layers import moving_statistics
from owt_tf.training.loop import Trainer

K = 4
BATCH = 8  # per replica


def _copies(strategy, variables):
    """Each variable's value on every replica."""
    return [[np.asarray(c) for c in strategy.experimental_local_results(
        v.value if isinstance(v, keras.Variable) else v)] for v in variables]


def _assert_one_copy(strategy, trunk, moved_from=None):
    stats = moving_statistics(trunk)
    assert stats, "the trunk has BatchNormalization"
    for copies in _copies(strategy, stats):
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])
    if moved_from is not None:  # and they trained: not the initial ones
        assert any(not np.allclose(c[0], m) for c, m in zip(_copies(strategy, stats),
                                                            moved_from))


def _bn_face_net(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Rescaling(1 / 127.5, offset=-1)(inputs)
    h = keras.layers.Conv2D(8, 3, name="conv")(h)
    h = keras.layers.BatchNormalization(name="bn1")(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, name="embedding")(h)
    h = keras.layers.BatchNormalization(name="bn2")(h)
    return keras.Model(inputs, NormalizedDense(12, name="classes")(h))


def _images(n, seed):
    # rows differ in brightness by replica, so each replica's own statistics would differ
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 128, size=(n, 8, 8, 3))
    return np.clip(base + (np.arange(n) // BATCH)[:, None, None, None] * 30, 0, 255).astype(np.uint8)


def test_fit_keeps_one_set_of_statistics_and_embeddings_do_not_depend_on_the_row(devices, tmp_path):
    x = _images(4 * K * BATCH, 0)
    y = np.random.default_rng(1).integers(0, 12, len(x)).astype(np.int32)
    strategy = owt_tf.HybridStrategy(devices=devices[:K], scheme="owt-b")
    with strategy.scope():
        parallel = owt_tf.parallelize(_bn_face_net(), seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=ArcFace())
    initial = [np.asarray(v) for v in moving_statistics(parallel.trunk)]
    parallel.fit(x, y, batch_size=K * BATCH, epochs=2, shuffle=False, verbose=0)
    _assert_one_copy(strategy.strategy, parallel.trunk, initial)

    rows = _images(3 * K * BATCH + 5, 2)  # a padded last batch too
    embedded = parallel.embed(rows)
    np.testing.assert_allclose(parallel.embed(rows[::-1])[::-1], embedded, atol=1e-5)
    parallel.export(str(tmp_path / "export"))
    exported = tf.saved_model.load(str(tmp_path / "export")).signatures["embeddings"]
    np.testing.assert_allclose(exported(images=tf.constant(rows))["embeddings"].numpy(),
                               embedded, atol=1e-5)


def _moments(x):
    """What Keras' BatchNormalization takes from a batch in training: biased moments over
    every axis but the last."""
    axes = tuple(range(x.ndim - 1))
    return x.mean(axes), x.var(axes)


def test_statistics_equal_the_mean_over_replicas_of_each_steps_update(devices):
    """A reference in numpy: with a learning rate of 0 the weights stay, so each replica's
    batch statistics at each step are those of its 8 rows through the initial model; the
    moving statistics must be m <- mu m + (1 - mu) mean over replicas of them, at every
    BatchNormalization (on the code before this, each replica held its own rows' update)."""
    steps = 3
    x = _images(steps * K * BATCH, 0)
    y = np.random.default_rng(1).integers(0, 12, len(x)).astype(np.int32)
    model = _bn_face_net()
    initial = model.get_weights()
    # the inputs of the two BatchNormalization layers, in training mode, by a plain copy
    plain = keras.models.clone_model(model)
    plain.set_weights(initial)
    bn_inputs = keras.Model(plain.input, [plain.get_layer("bn1").input,
                                          plain.get_layer("bn2").input])
    expected = {name: [np.asarray(plain.get_layer(name).moving_mean),
                       np.asarray(plain.get_layer(name).moving_variance)]
                for name in ("bn1", "bn2")}
    for step in range(steps):
        replicas = [bn_inputs(x[(step * K + r) * BATCH:(step * K + r + 1) * BATCH],
                              training=True) for r in range(K)]
        for i, name in enumerate(("bn1", "bn2")):
            momentum = plain.get_layer(name).momentum
            moments = [_moments(np.asarray(outs[i], np.float64)) for outs in replicas]
            for j in range(2):
                batch = np.mean([m[j] for m in moments], axis=0)
                expected[name][j] = momentum * expected[name][j] + (1 - momentum) * batch

    strategy = owt_tf.HybridStrategy(devices=devices[:K], scheme="owt-b")
    with strategy.scope():
        parallel = owt_tf.parallelize(model, seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(0.0), loss=ArcFace())
    parallel.fit(x, y, batch_size=K * BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_one_copy(strategy.strategy, parallel.trunk)
    for name in ("bn1", "bn2"):
        layer = parallel.trunk.get_layer(name)
        np.testing.assert_allclose(np.asarray(layer.moving_mean), expected[name][0],
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(layer.moving_variance), expected[name][1],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_cli_keeps_one_set_of_statistics(devices, tmp_path):
    config = PRESETS["faces"]().replace(steps=4, eval_every=0, logdir=str(tmp_path))
    trainer = Trainer(config, devices=devices[:K])
    initial = [np.asarray(v) for v in moving_statistics(trainer.model.trunk)]
    trainer.fit(log=lambda line: None, progress=False)
    _assert_one_copy(trainer.hybrid.strategy, trainer.model.trunk, initial)
    pairs = trainer.dataset.verification_pairs()
    rows = pairs.first[: 3 * config.global_batch_size + 3]
    embedded = trainer.features(rows)
    np.testing.assert_allclose(trainer.features(rows[::-1])[::-1], embedded, atol=1e-5)
