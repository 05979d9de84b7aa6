"""The Keras workflow around a parallelized model: callbacks, files across K, save / export read
back by a fresh process without owt_tf, the models the split rule takes and the ones it refuses."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import owt_tf
from keras_models import (alexnet_like, batchnorm_trunk, copy_of, dataset, digits,
                          max_rel_diff, random_data)
from owt_tf.models.split import UnsupportedModel
from owt_tf.fit.compiling import CompileError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR, BATCH = 0.05, 32


def _parallel(model, devices, k, scheme="owt-b", **compile_kw):
    strategy = owt_tf.HybridStrategy(devices=devices[:k], scheme=scheme)
    with strategy.scope():
        parallel = owt_tf.parallelize(model, seed=0)
        parallel.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9),
                         loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                         **compile_kw)
    return parallel


class _StopAfterEpoch(keras.callbacks.Callback):
    class Stopped(RuntimeError):
        pass

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise self.Stopped(f"interrupted after epoch {epoch}")


@pytest.mark.slow
def test_backup_and_restore_at_k4_resumes_at_k2(devices, tmp_path):
    """Interrupted after 2 of 3 epochs at K=4, resumed at K=2: equals 3 epochs of plain Keras
    fit (momentum and step count of trunk and FC shards restored from Keras' own files)."""
    x, y = random_data(2 * BATCH, seed=4)
    reference = alexnet_like()
    first = _parallel(copy_of(reference), devices, 4)
    backup = str(tmp_path / "backup")
    with pytest.raises(_StopAfterEpoch.Stopped):
        first.fit(dataset(x, y, BATCH), epochs=3, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), _StopAfterEpoch(1)])
    resumed = _parallel(alexnet_like(seed=99), devices, 2)  # other initial weights
    history = resumed.fit(dataset(x, y, BATCH), epochs=3, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup)]).history
    assert len(history["loss"]) == 1  # only the third epoch ran
    reference.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    want = reference.fit(dataset(x, y, BATCH), epochs=3, verbose=0).history
    assert max_rel_diff(resumed.to_keras_model().get_weights(), reference.get_weights()) < 1e-5
    assert history["loss"][0] == pytest.approx(want["loss"][-1], rel=1e-5)


@pytest.mark.slow
def test_model_checkpoint_weights_restore_at_k1(devices, tmp_path):
    """ModelCheckpoint's weights file (save_weights_only) written at K=4 and its .keras file:
    continuing from the weights at K=1 equals continuing at K=4; the .keras file loads."""
    x, y = random_data(2 * BATCH, seed=5)
    run = _parallel(alexnet_like(), devices, 4, scheme="owt-c")
    weights = str(tmp_path / "ckpt.weights.h5")
    whole = str(tmp_path / "ckpt.keras")
    run.fit(dataset(x, y, BATCH), epochs=1, verbose=0,
            callbacks=[keras.callbacks.ModelCheckpoint(weights, save_weights_only=True),
                       keras.callbacks.ModelCheckpoint(whole)])
    np.testing.assert_allclose(keras.models.load_model(whole).predict(x, verbose=0),
                               run.predict(x, verbose=0), atol=1e-6)
    single = _parallel(alexnet_like(seed=98), devices, 1, scheme="owt-a")
    single.load_weights(weights)
    run.fit(dataset(x, y, BATCH), epochs=1, verbose=0)
    single.fit(dataset(x, y, BATCH), epochs=1, verbose=0)
    assert max_rel_diff(single.to_keras_model().get_weights(),
                        run.to_keras_model().get_weights()) < 1e-5


@pytest.mark.slow
def test_learning_rate_scheduler_drives_trunk_and_shards(devices):
    x, y = random_data(2 * BATCH, seed=6)
    reference = alexnet_like()
    parallel = _parallel(copy_of(reference), devices, 2)
    reference.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9),
                      loss="sparse_categorical_crossentropy")

    def schedule(epoch, lr):
        return LR / (10 ** epoch)

    for model in (reference, parallel):
        model.fit(dataset(x, y, BATCH), epochs=2, verbose=0,
                  callbacks=[keras.callbacks.LearningRateScheduler(schedule)])
    assert max_rel_diff(parallel.to_keras_model().get_weights(), reference.get_weights()) < 1e-5


@pytest.mark.slow
def test_tensorboard_early_stopping_and_validation(devices, tmp_path):
    x, y = random_data(2 * BATCH, seed=7)
    xv, yv = random_data(40, seed=8)
    parallel = _parallel(alexnet_like(), devices, 4)
    logs = str(tmp_path / "logs")
    history = parallel.fit(x, y, batch_size=BATCH, epochs=5, verbose=0,
                           validation_data=(xv, yv),
                           callbacks=[keras.callbacks.TensorBoard(logs),
                                      keras.callbacks.EarlyStopping(monitor="val_loss",
                                                                    patience=0, min_delta=1e9)])
    assert len(history.history["loss"]) == 2  # no epoch improves by 1e9: stopped after 2
    reference = parallel.to_keras_model()
    reference.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    np.testing.assert_allclose(history.history["val_loss"][-1],
                               reference.evaluate(xv, yv, verbose=0)[0], rtol=1e-5)
    tags = set()
    for path in glob.glob(os.path.join(logs, "train", "events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            tags.update(v.tag for v in event.summary.value)
    assert {"epoch_loss", "epoch_accuracy"} <= tags


@pytest.mark.slow
def test_adamw_weight_decay_with_uint8_column_labels(devices):
    """AdamW with weight decay, labels uint8 [N, 1] (keras.datasets' form): equals plain Keras."""
    x, y = random_data(2 * BATCH, seed=11)
    y = y.astype(np.uint8)[:, None]
    reference = alexnet_like()
    strategy_global = owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-b")
    with strategy_global.scope():
        global_fc = owt_tf.parallelize(copy_of(reference))
        global_fc.compile(optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.05),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    reference.compile(optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.05),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    want = reference.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0).history
    got = global_fc.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0).history
    assert max_rel_diff(global_fc.to_keras_model().get_weights(), reference.get_weights()) < 1e-5
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["accuracy"], want["accuracy"], atol=1e-7)


def test_early_stopping_restores_the_best_weights_of_trunk_and_head(devices):
    x, y = random_data(2 * BATCH, seed=12)
    parallel = _parallel(alexnet_like(), devices, 2)
    best = {}

    class Remember(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                best["weights"] = parallel.get_weights()

    # loss goes down every epoch, so 'higher loss is better' makes epoch 0 the best
    stop = keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1,
                                         restore_best_weights=True)
    parallel.fit(dataset(x, y, BATCH), epochs=3, verbose=0, callbacks=[Remember(), stop])
    assert max_rel_diff(parallel.get_weights(), best["weights"]) == 0.0
    assert max_rel_diff(parallel.to_keras_model().get_weights(), best["weights"]) == 0.0


_LOAD_WITHOUT_OWT = """
import sys, numpy as np, keras, tensorflow as tf
x = np.load(sys.argv[1])
model = keras.models.load_model(sys.argv[2])
serving = tf.saved_model.load(sys.argv[3])  # kept: a temporary's variables would be freed
served = serving.serve(tf.constant(x)).numpy()
np.save(sys.argv[4], np.stack([model.predict(x, verbose=0), served]))
assert "owt_tf" not in sys.modules
"""


@pytest.mark.slow
def test_save_and_export_load_in_a_fresh_process_without_owt_tf(devices, tmp_path):
    x, y = random_data(BATCH, seed=9)
    parallel = _parallel(alexnet_like(), devices, 4, scheme="owt-b")
    parallel.fit(x, y, batch_size=BATCH, verbose=0)
    parallel.save(str(tmp_path / "m.keras"))
    parallel.export(str(tmp_path / "serving" / "1"), verbose=False)
    np.save(tmp_path / "x.npy", x[:20])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ""}
    subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_OWT, str(tmp_path / "x.npy"),
                    str(tmp_path / "m.keras"), str(tmp_path / "serving" / "1"),
                    str(tmp_path / "out.npy")], check=True, env=env, cwd=str(tmp_path))
    loaded, served = np.load(tmp_path / "out.npy")
    distributed = parallel.predict(x[:20], verbose=0)
    np.testing.assert_allclose(loaded, distributed, atol=1e-5)
    np.testing.assert_allclose(served, distributed, atol=1e-5)


@pytest.mark.slow
def test_batchnorm_residual_trunk_trains_on_digits(devices):
    """BatchNormalization and a residual add in the trunk, Dropout in the head: learns."""
    x, y, xv, yv = digits()
    parallel = _parallel(batchnorm_trunk(), devices, 2)
    gamma_before = [w.numpy().copy() for w in parallel.trunk.weights if "gamma" in w.path]
    parallel.fit(x, y, batch_size=64, epochs=4, verbose=0)
    _, accuracy = parallel.evaluate(xv, yv, verbose=0)
    assert accuracy > 0.8, accuracy  # chance: 0.1
    gamma_after = [w.numpy() for w in parallel.trunk.weights if "gamma" in w.path]
    assert all(np.all(a != 0) for a in gamma_after)
    assert any(np.any(a != b) for a, b in zip(gamma_after, gamma_before))


@pytest.mark.slow
def test_keras_applications_vgg16(devices):
    vgg = keras.applications.VGG16(weights=None, input_shape=(32, 32, 3), classes=10)
    x, y = random_data(16, shape=(32, 32, 3), seed=10)
    parallel = _parallel(vgg, devices, 2, scheme="owt-a")
    history = parallel.fit(x, y, batch_size=8, verbose=0).history
    assert np.isfinite(history["loss"][0])
    np.testing.assert_allclose(parallel.predict(x, verbose=0),
                               parallel.to_keras_model().predict(x, verbose=0), atol=1e-5)


def _inputs(shape=(16, 16, 3)):
    inputs = keras.Input(shape)
    return inputs, keras.layers.Flatten()(keras.layers.Conv2D(4, 3)(inputs))


def _hidden_dense(name, **dense):
    """A conv net whose head has one hidden Dense built with `dense`; refused, naming it."""
    inputs, h = _inputs()
    h = keras.layers.Dense(name=name, **dense)(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="out")(h)), name


def _refused_tanh():
    return _hidden_dense("fc_tanh", units=16, activation="tanh")


def _refused_batchnorm_in_head():
    inputs, h = _inputs()
    h = keras.layers.Dense(16, activation="relu")(h)
    h = keras.layers.BatchNormalization(name="bn_head")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="out")(h)), "bn_head"


def _refused_skip_into_head():
    inputs, h = _inputs()
    a = keras.layers.Dense(16, activation="relu", name="fc_a")(h)
    b = keras.layers.Dense(16, activation="relu", name="fc_b")(a)
    merged = keras.layers.Add(name="skip")([a, b])
    return keras.Model(inputs, keras.layers.Dense(10, name="out")(merged)), "skip"


def _refused_width():
    return _hidden_dense("fc_30", units=30, activation="relu")


def _refused_regularizer():
    return _hidden_dense("fc_l2", units=16, activation="relu", kernel_regularizer="l2")


def _refused_frozen():
    inputs, h = _inputs()
    frozen = keras.layers.Dense(16, activation="relu", name="fc_frozen")
    frozen.trainable = False
    return keras.Model(inputs, keras.layers.Dense(10, name="out")(frozen(h))), "fc_frozen"


def _refused_no_dense_output():
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(10, 3)(inputs)
    return keras.Model(inputs, keras.layers.GlobalAveragePooling2D(name="gap")(h)), "Dense"


def _refused_subclassed():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="subclassed_net")
            self.dense = keras.layers.Dense(10)

        def call(self, x):
            return self.dense(x)

    return Net(), "subclassed_net"


@pytest.mark.parametrize("make", [_refused_tanh, _refused_batchnorm_in_head,
                                  _refused_skip_into_head, _refused_width, _refused_regularizer,
                                  _refused_frozen, _refused_no_dense_output,
                                  _refused_subclassed])
def test_refused_models_name_the_layer(devices, make):
    model, name = make()
    strategy = owt_tf.HybridStrategy(devices=devices[:4], scheme="owt-b")
    with pytest.raises(UnsupportedModel) as err:
        with strategy.scope():
            owt_tf.parallelize(model)
    message = str(err.value)
    assert name in message and "\n" not in message, message


@pytest.mark.parametrize("setting,words", [
    ({"steps_per_execution": 2}, "steps_per_execution"),
    ({"run_eagerly": True}, "run_eagerly"),
    ({"jit_compile": True}, "jit_compile"),
    ({"optimizer": keras.optimizers.SGD(0.1, use_ema=True)}, "use_ema"),
    ({"loss_scale_factor": 2.0}, "loss_scale_factor"),
    ({"loss": keras.losses.SparseCategoricalCrossentropy(reduction="none")}, "reduction"),
    ({"optimizer": keras.optimizers.SGD(0.1, global_clipnorm=1.0),
      "fc_optimizer": keras.optimizers.SGD(0.1)}, "global_clipnorm"),
    ({"optimizer": keras.optimizers.Lamb(0.1)}, "Lamb"),
])
def test_refused_compile_settings(devices, setting, words):
    model = alexnet_like()
    strategy = owt_tf.HybridStrategy(devices=devices[:2], scheme="owt-a")
    with strategy.scope():
        parallel = owt_tf.parallelize(model)
        kwargs = {"optimizer": keras.optimizers.SGD(0.1), "loss": "sparse_categorical_crossentropy"}
        kwargs.update(setting)
        with pytest.raises(CompileError) as err:
            parallel.compile(**kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_example_script_runs(tmp_path):
    """examples/keras_fit.py end to end at K=2, then its .keras file read back elsewhere."""
    out = tmp_path / "run"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "keras_fit.py"),
                           "--devices", "2", "--epochs", "2", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("validation:")][-1]
    accuracy = float(line.split("accuracy ")[1].split("%")[0]) / 100
    assert accuracy > 0.6, line  # chance: 0.1 (3 epochs at K=4 reach 0.95)
    for path in ("model.keras", "best.weights.h5", "serving/1/saved_model.pb"):
        assert (out / path).exists(), path
    assert glob.glob(str(out / "logs" / "train" / "events.out.tfevents.*"))
