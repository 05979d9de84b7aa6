"""Face recognition on the command line: --objective arcface|cosface (the margin softmax on
the class layer's shards) equals a one-device Keras reference; the run verifies the
dataset's pairs; the export's `embeddings` signature (and --embeddings-only) serves the
Trainer's embeddings without owt_tf; `evaluate --verification` prints what
owt_tf.data.verification computes; the `faces` preset learns; bad flags fail in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from owt_tf.config import PRESETS, ConfigError, RunConfig
from owt_tf.layers import NormalizedDense
from owt_tf.losses import ArcFace, CosFace
from owt_tf.training.files import summaries
from owt_tf.training.loop import Trainer
from owt_tf.data.verification import verify
from reference import update_err

# One xdist worker runs this module: its module-scoped run is made once, not per worker.
pytestmark = pytest.mark.xdist_group("test_face_cli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
           PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
NOISE = 1e-6  # the norm of an update rounding alone makes (FaceReference's tests)
FACE = dict(model="face_tiny", dataset="faces", objective="arcface", loss="sharded",
            dropout=0.0)


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=600)


def _refused(**flags) -> str:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flags(**flags).validate()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_face_flags_fail_in_one_line(tmp_path):
    assert _refused(**{**FACE, "loss": "gathered"}).startswith("--objective: ")
    assert "add --loss sharded" in _refused(**{**FACE, "loss": "gathered"})
    assert "arcface's margin must be in [0, 1.571)" in _refused(**FACE, margin=1.6)
    assert "cosface's margin must be in [0, 1)" in _refused(**{**FACE, "objective": "cosface"},
                                                            margin=1.0)
    assert _refused(**FACE, scale=0.0) == "--scale: must be a number > 0, got 0.0"
    assert _refused(model="alexnet_tiny", embedding_dim=32).startswith(
        "--embedding-dim: model alexnet_tiny has no embedding")
    assert _refused(**{**FACE, "model": "vgg_tiny"}).startswith("--objective: arcface trains "
                                                                "a cosine class layer")
    assert _refused(margin=0.3).startswith("--margin: ")
    assert _refused(embeddings_only=True).startswith("--embeddings-only: ")
    assert RunConfig.from_flags(**FACE, embedding_dim=32).validate().model.margin_value == 0.5
    # the command line: exit code 2 and one line, before TensorFlow loads
    proc = _cli("owt_tf.train", "--model", "face_tiny", "--objective", "cosface", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--objective: cosface puts its margin on the shard" in proc.stderr


def test_a_dense_headed_user_model_is_refused_a_margin(devices, tmp_path, monkeypatch):
    (tmp_path / "dense_models.py").write_text(textwrap.dedent("""
        import keras

        def build(num_classes):
            inputs = keras.Input((32, 32, 3))
            h = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(8, 3)(inputs))
            return keras.Model(inputs, keras.layers.Dense(num_classes, name="logits")(h))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = RunConfig.from_flags(**{**FACE, "model": "dense_models:build"}, steps=1,
                                  eval_every=0, logdir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^--objective: arcface needs a cosine class layer: "
                                          r"model dense_models:build ends in the Dense 'logits'"):
        Trainer(config, devices=devices[:2])


class FaceReference:
    """One device, plain Keras: the spec's trunk and a NormalizedDense with the run's first
    weights, the margin loss of owt_tf.losses (a Keras loss: not the sharded one), its
    gradient by tf.GradientTape over the whole global batch, and coupled SGD in numpy at the
    CLI's conv and FC rates. BatchNormalization computes each replica's rows' statistics,
    as data parallelism does: the trunk is called on each replica's rows on their own."""

    def __init__(self, spec, seed: int, loss, replicas: int):
        self.trunk = spec.build_trunk()
        trunk_weights, [(kernel, _)] = spec.initial_weights_for(self.trunk, seed)
        self.trunk.set_weights(trunk_weights)
        self.classes = NormalizedDense(kernel.shape[1])
        self.classes.build((None, kernel.shape[0]))
        self.classes.set_weights([kernel])
        self.loss, self.replicas = loss, replicas
        self.velocity = {}

    def variables(self):
        return list(self.trunk.trainable_variables) + [self.classes.kernel]

    def step(self, images, labels, conv_lr, fc_lr, momentum, weight_decay) -> float:
        with tf.GradientTape() as tape:
            parts = tf.split(images, self.replicas)
            embeddings = tf.concat([self.trunk(x, training=True) for x in parts], axis=0)
            loss = self.loss(labels, self.classes(embeddings))
        variables = self.variables()
        for i, (v, g) in enumerate(zip(variables, tape.gradient(loss, variables))):
            lr = fc_lr if v is self.classes.kernel else conv_lr
            w = v.numpy()
            velocity = momentum * self.velocity.get(i, 0.0) - lr * (g.numpy() + weight_decay * w)
            self.velocity[i] = velocity
            v.assign(w + velocity)
        return float(loss)


@pytest.mark.parametrize("scheme,objective,margin", [("owt-b", "arcface", ArcFace),
                                                     ("data", "cosface", CosFace)])
def test_cli_margin_objective_equals_one_device_keras(devices, tmp_path, scheme, objective,
                                                      margin):
    """The CLI's Trainer (K=2, face_tiny on faces, weight decay on) for 2 steps against
    FaceReference on the same global batches: per-tensor updates within 1e-4 and the same
    losses; under 'data' the mirrored class layer computes the margin loss too. Tensors
    whose gradient is zero in exact arithmetic (a bias or beta feeding a BatchNorm: updates
    of 1e-9, rounding alone) are held to staying that small instead."""
    k, b, seed, steps = 2, 16, 3, 2
    config = RunConfig.from_flags(**{**FACE, "objective": objective}, scheme=scheme, devices=k,
                                  batch_size=b, lr=0.05, seed=seed, steps=steps, eval_every=0,
                                  logdir=str(tmp_path))
    trainer = Trainer(config, devices=devices[:k])
    assert trainer.spec.head.cosine and trainer.model.head.loss.sharded.margin is not None
    reference = FaceReference(trainer.spec, seed, margin(scale=64.0), k)
    start = [v.numpy() for v in reference.variables()]
    batches = iter(trainer.dataset.train(k * b, seed))  # the stream the Trainer reads
    o = config.optimizer
    for _ in range(steps):
        got = trainer.train_step().loss
        images, labels, _ = next(batches)
        want = reference.step(images, labels, config.conv_lr, config.fc_lr, o.momentum,
                              o.weight_decay)
        assert got == pytest.approx(want, rel=1e-5)
    kernel = trainer.model.full_weights()["head"][0][0]
    got = [v.numpy() for v in trainer.model.trunk.trainable_variables] + [kernel]
    worst = 0.0
    for g, w, s in zip(got, reference.variables(), start, strict=True):
        if np.linalg.norm(w.numpy() - s) < NOISE:
            assert np.linalg.norm(g - s) < NOISE
        else:
            worst = max(worst, update_err(g, w.numpy(), s))
    assert worst < 1e-4, worst


@pytest.fixture(scope="module")
def face_run(devices, tmp_path_factory):
    """A short ArcFace run of the faces preset, validated twice, exported at the end; and
    the Trainer restored from its checkpoint."""
    logdir = tmp_path_factory.mktemp("face_run")
    config = PRESETS["faces"]().replace(steps=20, eval_every=10, logdir=str(logdir),
                                        export_dir=str(logdir / "export"))
    trainer = Trainer(config, devices=devices[:2])
    summary = trainer.fit(log=lambda line: None, progress=False)
    restored = Trainer(config, devices=devices[:2], read_only=True)
    return summary, restored, logdir


@pytest.mark.slow
def test_the_run_reports_verification(face_run):
    from tensorboard.backend.event_processing import event_accumulator

    summary, restored, logdir = face_run
    assert 0.4 < summary["verification_accuracy"] <= 1.0
    assert set(summary["verification"]) == {"faces"}
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    for tag in (summaries.VAL_VERIFICATION, summaries.VAL_TAR):
        assert [e.step for e in acc.Tensors(tag)] == [10, 20], tag
    last = tf.make_ndarray(acc.Tensors(summaries.VAL_VERIFICATION)[-1].tensor_proto)
    assert float(last) == pytest.approx(summary["verification_accuracy"], rel=1e-6)


@pytest.mark.slow
def test_the_exports_embeddings_serve_the_trainers_without_owt_tf(face_run, tmp_path):
    """The run's export: `serving_default` and `embeddings`, loaded in a fresh process
    without owt_tf, give the restored Trainer's embeddings; an --embeddings-only export
    (python -m owt_tf.export) has the embedding alone: no class kernel among its variables."""
    _, restored, logdir = face_run
    full = logdir / "export" / "1"
    only = tmp_path / "only"
    proc = _cli("owt_tf.export", "--logdir", str(logdir), "--out", str(only),
                "--embeddings-only", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    images = restored.dataset.verification_pairs().first[:45]
    np.save(tmp_path / "images.npy", images)
    code = textwrap.dedent(f"""
        import json, sys, numpy as np, tensorflow as tf
        out = {{}}
        for name, path in (("full", {str(full)!r}), ("only", {str(only / '1')!r})):
            model = tf.saved_model.load(path)
            images = tf.constant(np.load({str(tmp_path / 'images.npy')!r}))
            out[name] = sorted(model.signatures)
            np.save({str(tmp_path)!r} + f"/{{name}}.npy",
                    model.signatures["embeddings"](images=images)["features"].numpy())
            shapes = [tuple(s) for _, s in tf.train.list_variables(path + "/variables/variables")]
            out[name + "_kernel"] = (64, 500) in shapes
        assert "owt_tf" not in sys.modules
        print(json.dumps(out))
    """)
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), timeout=300,
                           cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    seen = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert seen == {"full": ["embeddings", "serving_default"], "full_kernel": True,
                    "only": ["embeddings", "serving_default"], "only_kernel": False}
    want = restored.features(images)
    for name in ("full", "only"):
        np.testing.assert_allclose(np.load(tmp_path / f"{name}.npy"), want, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.slow
def test_evaluate_verification_prints_owt_tf_verifications_numbers(face_run, tmp_path):
    summary, restored, logdir = face_run
    export = str(logdir / "export")
    proc = _cli("owt_tf.evaluate", "--verification", "faces", export, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = verify(restored.features, restored.dataset.verification_pairs())
    line = (f"faces (600 pairs): verification accuracy {want.accuracy:.2%} ± "
            f"{want.accuracy_std:.2%} (10 folds) | TAR@FAR=1e-3 {want.tar:.2%}")
    assert line in proc.stdout
    # the run's own last verification: the same numbers (one set of BN statistics)
    run = summary["verification"]["faces"]
    assert (run["accuracy"], run["accuracy_std"], run["tar"]) == pytest.approx(
        (want.accuracy, want.accuracy_std, want.tar), abs=1e-12)
    # one-line errors: no such file, no embeddings signature
    missing = _cli("owt_tf.evaluate", "--verification", str(tmp_path / "lfw.bin"), export,
                   cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "lfw.bin: no such file" in missing.stderr
    plain = tmp_path / "plain"

    class Plain(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
        def serve(self, x):
            return {"y": x}

    module = Plain()
    tf.saved_model.save(module, str(plain), signatures={"serving_default": module.serve})
    no_signature = _cli("owt_tf.evaluate", "--verification", "faces", str(plain), cwd=tmp_path)
    assert no_signature.returncode == 2 and no_signature.stderr.count("\n") == 1
    assert "has no 'embeddings' signature" in no_signature.stderr


@pytest.mark.slow
def test_the_embeddings_signature_converts_to_onnx(face_run, tmp_path):
    """tf2onnx converts the export's `embeddings` signature (the backbone alone, as face
    users ship it: arcface_torch #2406); onnxruntime gives TensorFlow's `features` and
    `embeddings` to 1e-5 at batch 1 and batch 64."""
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("tf2onnx")
    _, _, logdir = face_run
    export = str(logdir / "export" / "1")
    onnx_path = tmp_path / "face.onnx"
    proc = subprocess.run([sys.executable, "-m", "tf2onnx.convert", "--saved-model", export,
                           "--signature_def", "embeddings", "--output", str(onnx_path),
                           "--opset", "17"], capture_output=True, text=True, env=ENV,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    session = onnxruntime.InferenceSession(str(onnx_path))
    names = [o.name for o in session.get_outputs()]
    assert set(names) == {"features", "embeddings"}
    signature = tf.saved_model.load(export).signatures["embeddings"]
    rng = np.random.default_rng(3)
    for batch in (1, 64):
        images = rng.integers(0, 256, size=(batch, 32, 32, 3)).astype(np.uint8)
        got = dict(zip(names, session.run(None, {"images": images})))
        want = signature(images=tf.constant(images))
        for name in names:
            np.testing.assert_allclose(got[name], want[name].numpy(), atol=1e-5)
