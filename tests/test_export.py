"""SavedModel export: a fresh process without owt_tf gets the training model's probabilities."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from owt_tf.config import RunConfig
from owt_tf.training.files.serving import ExportError, export_saved_model
from owt_tf.training.loop import Trainer

# One xdist worker runs this module: its module-scoped runs are made once, not per worker.
pytestmark = pytest.mark.xdist_group("test_export")

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


@pytest.fixture(scope="module")
def trained(devices, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("run")
    config = RunConfig.from_flags(steps=20, eval_every=0, devices=4, batch_size=8, scheme="owt-c",
                                  logdir=str(logdir))
    trainer = Trainer(config, devices=devices[:4])
    trainer.fit(log=lambda line: None, progress=False)
    return trainer


@pytest.mark.slow
def test_fresh_process_gets_the_training_models_probabilities(trained, tmp_path):
    out = tmp_path / "model" / "1"
    assert export_saved_model(trained.model, trained.dataset.mean, trained.dataset.std,
                              str(tmp_path / "model")) == str(out)
    images = trained.dataset.val_images[:37]
    np.save(tmp_path / "images.npy", images)
    logits = trained.predict_logits(images)
    want = np.exp(logits - logits.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    code = textwrap.dedent(f"""
        import sys, numpy as np, tensorflow as tf
        model = tf.saved_model.load({str(out)!r})
        out = model.signatures["serving_default"](images=tf.constant(np.load({str(tmp_path / 'images.npy')!r})))
        np.save({str(tmp_path / 'probs.npy')!r}, out["probabilities"].numpy())
        np.save({str(tmp_path / 'top5.npy')!r}, out["top5"].numpy())
        assert "owt_tf" not in sys.modules
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probs = np.load(tmp_path / "probs.npy")
    top5 = np.load(tmp_path / "top5.npy")
    np.testing.assert_allclose(probs, want, atol=1e-5)
    assert top5.dtype == np.int64 and top5.shape == (37, 5)
    np.testing.assert_array_equal(top5[:, 0], want.argmax(1))
    meta = json.loads((out / "owt_tf_export.json").read_text())
    assert meta["num_classes"] == 10


def test_saved_model_cli_lists_the_signature(trained, tmp_path):
    out = export_saved_model(trained.model, trained.dataset.mean, trained.dataset.std,
                             str(tmp_path / "model"))
    cli = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    proc = subprocess.run([cli, "show", "--dir", str(out), "--all"], capture_output=True,
                          text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "signature_def['serving_default']" in proc.stdout
    for name in ("images", "probabilities", "top5"):
        assert name in proc.stdout
    assert "DT_UINT8" in proc.stdout and "DT_INT64" in proc.stdout


def test_versions_are_numbered_and_an_existing_one_kept_unless_overwrite(trained, tmp_path):
    base = tmp_path / "served"
    base.mkdir()
    (base / "README.txt").write_text("mine")  # not a version: left alone
    args = (trained.model, trained.dataset.mean, trained.dataset.std, str(base))
    assert export_saved_model(*args) == str(base / "1")
    assert export_saved_model(*args) == str(base / "2")
    (base / "2" / "marker").write_text("old")
    with pytest.raises(ExportError, match="--overwrite"):
        export_saved_model(*args, version=2)
    assert (base / "2" / "marker").exists()
    assert export_saved_model(*args, version=2, overwrite=True) == str(base / "2")
    assert (base / "2" / "saved_model.pb").exists() and not (base / "2" / "marker").exists()
    assert export_saved_model(*args, version=7) == str(base / "7")
    assert sorted(os.listdir(base)) == ["1", "2", "7", "README.txt"]


@pytest.mark.slow
def test_export_cli_from_a_logdir(trained, tmp_path):
    out = tmp_path / "cli_model"
    proc = subprocess.run([sys.executable, "-m", "owt_tf.export", "--logdir", trained.logdir,
                           "--out", str(out)], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "1" / "saved_model.pb").exists()
    again = subprocess.run([sys.executable, "-m", "owt_tf.export", "--logdir", trained.logdir,
                            "--out", str(out), "--version", "1"],
                           capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 2 and "--overwrite" in again.stderr


@pytest.mark.slow
def test_evaluate_cli_reports_the_runs_validation_error(trained, tmp_path):
    """Center crop: the run's own validation numbers, from the checkpoint and from the export."""
    import re

    ev = trained.evaluate()
    out = tmp_path / "for_eval"  # a base path: evaluate takes its newest version
    export_saved_model(trained.model, trained.dataset.mean, trained.dataset.std, str(out),
                       dataset="digits")
    for source in (["--logdir", trained.logdir], ["--model", str(out)]):
        proc = subprocess.run([sys.executable, "-m", "owt_tf.evaluate", *source],
                              capture_output=True, text=True, env=ENV, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = re.search(r"top-1 error ([0-9.]+)%  top-5 error ([0-9.]+)%", proc.stdout)
        assert found, proc.stdout
        assert abs(float(found.group(1)) / 100 - ev.top1_error) < 1e-4
        assert abs(float(found.group(2)) / 100 - ev.top5_error) < 1e-4


def test_ten_crop_views():
    from owt_tf.training.evaluation import ten_crops

    images = np.arange(2 * 5 * 6 * 1).reshape(2, 5, 6, 1)
    crops = ten_crops(images, (3, 4))
    assert len(crops) == 10 and all(c.shape == (2, 3, 4, 1) for c in crops)
    np.testing.assert_array_equal(crops[0], images[:, :3, :4])
    np.testing.assert_array_equal(crops[3], images[:, 2:, 2:])
    np.testing.assert_array_equal(crops[5], images[:, :3, :4][:, :, ::-1])


def _served(trained, out, images):
    """The export's outputs through tf.saved_model.load (the reference for other consumers)."""
    import tensorflow as tf

    loaded = tf.saved_model.load(str(out))
    result = loaded.signatures["serving_default"](images=tf.constant(images))
    return {k: v.numpy() for k, v in result.items()}


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    base = tmp_path_factory.mktemp("consumers") / "model"
    return Path(export_saved_model(trained.model, trained.dataset.mean, trained.dataset.std,
                                   str(base)))


def test_tf1_session_loader_runs_the_export(trained, exported, tmp_path):
    """`saved_model_cli run` loads through the TF1/C++ path TF Serving uses (every variable
    restored, not only those tf.saved_model.load reconciles)."""
    images = trained.dataset.val_images[:6]
    np.save(tmp_path / "images.npy", images)
    cli = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    proc = subprocess.run([cli, "run", "--dir", str(exported), "--tag_set", "serve",
                           "--signature_def", "serving_default",
                           "--inputs", f"images={tmp_path / 'images.npy'}",
                           "--outdir", str(tmp_path / "cli_out")],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = _served(trained, exported, images)
    got = np.load(tmp_path / "cli_out" / "probabilities.npy")
    np.testing.assert_allclose(got, want["probabilities"], atol=1e-5)
    np.testing.assert_array_equal(np.load(tmp_path / "cli_out" / "top5.npy"), want["top5"])


def test_tflite_builtins_keep_uint8_input_and_any_image_size(trained, exported):
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_saved_model(str(exported))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    interpreter = tf.lite.Interpreter(model_content=converter.convert())
    runner = interpreter.get_signature_runner("serving_default")
    rng = np.random.default_rng(0)
    for shape in ((3, 32, 32, 3), (2, 45, 60, 3)):  # the model's size, and a larger one
        images = rng.integers(0, 256, size=shape).astype(np.uint8)
        got = runner(images=images)
        want = _served(trained, exported, images)
        assert np.all(np.isfinite(got["probabilities"]))
        np.testing.assert_allclose(got["probabilities"], want["probabilities"], atol=1e-5)
        np.testing.assert_array_equal(got["top5"], want["top5"])
        np.testing.assert_array_equal(got["top5_names"], want["top5_names"])


def test_keras_tfsm_layer_and_readable_files(trained, exported):
    import keras
    import tensorflow as tf

    layer = keras.layers.TFSMLayer(str(exported), call_endpoint="serving_default")
    images = trained.dataset.val_images[:4]
    got = layer(images)
    np.testing.assert_allclose(np.asarray(got["probabilities"]),
                               _served(trained, exported, images)["probabilities"], atol=1e-6)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(exported).st_mode & 0o777 == 0o777 & ~umask
    assert [v.shape for v in tf.saved_model.load(str(exported)).fc_layers][-2:] == [(256, 10), (10,)]
    assert os.stat(exported.parent).st_mode & 0o777 == 0o777 & ~umask
    assert os.stat(exported / "saved_model.pb").st_mode & 0o777 == 0o666 & ~umask


def test_top5_names_are_the_datasets_labels(trained, tmp_path):
    names = [f"class_{i}" for i in range(10)]
    out = Path(export_saved_model(trained.model, trained.dataset.mean, trained.dataset.std,
                                  str(tmp_path / "named"), class_names=names))
    got = _served(trained, out, trained.dataset.val_images[:5])
    want = np.array(names, dtype=object)[got["top5"]]
    np.testing.assert_array_equal(got["top5_names"].astype(str), want.astype(str))
    assert json.loads((out / "owt_tf_export.json").read_text())["class_names"] == names
    assert trained.dataset.label_names() == tuple("0123456789")


def test_onnx_through_tf2onnx_and_onnxruntime(trained, exported, tmp_path):
    """tf2onnx converts the SavedModel in its own process; onnxruntime runs it, at the
    model's input size and on images resized inside (ONNX's bilinear Resize)."""
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("tf2onnx")
    onnx_path = tmp_path / "model.onnx"
    proc = subprocess.run([sys.executable, "-m", "tf2onnx.convert", "--saved-model",
                           str(exported), "--output", str(onnx_path), "--opset", "17"],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    session = onnxruntime.InferenceSession(str(onnx_path))
    names = [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(1)
    for shape in ((3, 32, 32, 3), (2, 45, 60, 3)):
        images = rng.integers(0, 256, size=shape).astype(np.uint8)
        got = dict(zip(names, session.run(None, {"images": images})))
        want = _served(trained, exported, images)
        np.testing.assert_allclose(got["probabilities"], want["probabilities"], atol=1e-5)
        np.testing.assert_array_equal(got["top5"], want["top5"])


def test_a_large_padded_head_exports_and_serves_top5(devices, tmp_path):
    """5,003 classes at K=4 (the class layer padded to 5,004 on the shards), trained with the
    loss on the shards: the export serves the 5,003 classes' probabilities and their top 5,
    never a padding column."""
    config = RunConfig.from_flags(dataset="synthetic", classes=5003, steps=2, eval_every=0,
                                  devices=4, batch_size=8, scheme="owt-b", loss="sharded",
                                  logdir=str(tmp_path / "run"))
    trainer = Trainer(config, devices=devices[:4])
    trainer.fit(log=lambda line: None, progress=False)
    out = export_saved_model(trainer.model, trainer.dataset.mean, trainer.dataset.std,
                             str(tmp_path / "model"))
    images = trainer.dataset.val_images[:12]
    np.save(tmp_path / "images.npy", images)
    logits = trainer.predict_logits(images)
    assert logits.shape == (12, 5003)
    code = textwrap.dedent(f"""
        import numpy as np, tensorflow as tf
        model = tf.saved_model.load({out!r})
        out = model.signatures["serving_default"](images=tf.constant(np.load("images.npy")))
        np.save("probs.npy", out["probabilities"].numpy())
        np.save("top5.npy", out["top5"].numpy())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probs, top5 = np.load(tmp_path / "probs.npy"), np.load(tmp_path / "top5.npy")
    assert probs.shape == (12, 5003) and top5.shape == (12, 5)
    np.testing.assert_array_equal(top5, np.argsort(-logits, axis=1, kind="stable")[:, :5])
    assert json.loads((Path(out) / "owt_tf_export.json").read_text())["num_classes"] == 5003
