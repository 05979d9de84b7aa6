"""`python -m owt_tf.train --model PATH.keras | module:function`: the user's own model through
the CLI's loop, with its own weights, resumed at another K, exported, and refused in one line."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from keras_models import max_rel_diff
from owt_tf.config import ConfigError, RunConfig
from owt_tf.training.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODULE = '''
import keras

def build(num_classes):
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu", name="fc1"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(num_classes, activation="softmax", name="predictions"),
    ], name="user_net")

def tanh_head(num_classes):
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Flatten()(inputs)
    h = keras.layers.Dense(32, activation="tanh", name="fc_tanh")(h)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(h))
'''


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_models", None)
    import user_models

    return user_models


def _cli(args, cwd, pythonpath):
    # The user's module first, then this checkout (not whichever owt_tf is installed).
    path = os.pathsep.join(p for p in (pythonpath, ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=path)
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_keras_file_keeps_its_weights(devices, tmp_path, user_module):
    """The CLI's model starts from the file's weights, trunk and head, at K=4."""
    model = user_module.build(10)
    path = str(tmp_path / "user.keras")
    model.save(path)
    trainer = Trainer(RunConfig.from_flags(model=path, devices=4, batch_size=8, scheme="owt-c",
                                           steps=1, eval_every=0, logdir=str(tmp_path / "run")),
                      devices=devices[:4])
    got = trainer.model.full_weights()
    want = model.get_weights()
    head = [w for pair in got["head"] for w in pair]
    assert max_rel_diff(got["trunk"] + head, want) == 0.0
    assert trainer.spec.head.dropouts == (0.2,)
    assert trainer.spec.head.output_activation == "softmax"


@pytest.mark.slow
def test_cli_trains_resumes_at_another_k_and_exports(devices, tmp_path, user_module):
    pythonpath = str(tmp_path)
    logdir = str(tmp_path / "run")
    common = ["owt_tf.train", "--model", "user_models:build", "--logdir", logdir,
              "--eval-every", "0", "--batch-size", "8"]
    first = _cli(common + ["--devices", "2", "--steps", "30"], tmp_path, pythonpath)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "done: 30 steps" in first.stdout, first.stdout
    second = _cli(common + ["--devices", "4", "--steps", "40"], tmp_path, pythonpath)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "done: steps 31-40 (10 this run, 40 in all)" in second.stdout, second.stdout
    out = str(tmp_path / "export")
    exported = _cli(["owt_tf.export", "--logdir", logdir, "--out", out], tmp_path, pythonpath)
    assert exported.returncode == 0, exported.stderr[-3000:]
    serving = tf.saved_model.load(os.path.join(out, "1"))
    images = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 3)).astype(np.uint8)
    probabilities = serving.signatures["serving_default"](
        images=tf.constant(images))["probabilities"].numpy()
    # The trained model itself (restored from the run's last checkpoint, nothing trained)
    # gives the same probabilities.
    restored = Trainer(RunConfig.from_flags(model="user_models:build", logdir=logdir, devices=2,
                                            batch_size=8, steps=40, eval_every=0),
                       devices=devices[:2])
    logits = restored.predict_logits(images)
    restored.rundir.release()
    want = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(probabilities, want / want.sum(1, keepdims=True), atol=1e-5)


def test_refused_user_models_are_one_line_flag_errors(devices, tmp_path, user_module):
    with pytest.raises(ConfigError, match="fc_tanh"):
        Trainer(RunConfig.from_flags(model="user_models:tanh_head", devices=2, steps=1, eval_every=0,
                                     logdir=str(tmp_path / "a")), devices=devices[:2])
    with pytest.raises(ConfigError, match="fc1: width 32 is not divisible by 3"):
        Trainer(RunConfig.from_flags(model="user_models:build", devices=3, batch_size=3, steps=1,
                                     eval_every=0, logdir=str(tmp_path / "b")), devices=devices[:3])
    missing = _cli(["owt_tf.train", "--model", str(tmp_path / "none.keras")], tmp_path,
                   str(tmp_path))
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "no such file" in missing.stderr
