"""docs/faces.md's and docs/keras.md's Python, run as written in fresh processes (a user's:
no test devices set up); faces.md's `evaluate --verification` line on what its snippet
exported; and its command lines for the `faces` preset, as written."""
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")


def python_blocks(path: str) -> list:
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    return [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
            if lang == "python"]


def shell_lines(path: str) -> list:
    """Each command of the page's bash blocks as argv (continuations joined, comments off)."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    blocks = [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
              if lang == "bash"]
    return [shlex.split(line, comments=True)
            for body in blocks for line in body.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow
def test_the_faces_preset_as_the_page_runs_it_verifies_well_above_chance(tmp_path):
    """docs/faces.md's first two command lines as written: the preset as shipped (K=2,
    owt-b, ArcFace on the shards) trains and exports, and `evaluate --verification` of the
    export scores the held-out identities' pairs (chance 50 %, raw pixels 64 %) at 10-fold
    accuracy >= 0.85 (measured at seeds 0, 1, 2: 0.918, 0.908, 0.912; docs/faces.md)."""
    train, evaluate = shell_lines("docs/faces.md")[:2]
    assert train[:4] == ["python", "-m", "owt_tf.train", "--preset"] and "faces" in train
    assert evaluate[:4] == ["python", "-m", "owt_tf.evaluate", "--verification"]
    proc = subprocess.run([sys.executable] + train[1:], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([sys.executable] + evaluate[1:], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"faces \(600 pairs\): verification accuracy ([0-9.]+)%", proc.stdout)
    assert found, proc.stdout
    assert float(found.group(1)) >= 85.0, proc.stdout


def test_the_faces_pages_other_commands_are_train_flags_that_validate(tmp_path):
    """The page's training commands on a full InsightFace set (8 devices, 112x112 images:
    no run in the suite; tests/test_arcface_torch_presets.py trains the presets on a small
    set) are flags the train CLI parses and validates as written, with the set's directory
    in place of /data/... ."""
    from owt_tf.cli import parse_config
    from owt_tf.data.faces import faces_dataset

    directory = tmp_path / "insightface"
    directory.mkdir()
    faces_dataset((32, 32, 3), identities=8, images_per_identity=3, held_out_identities=2,
                  pairs=4).write_insightface(str(directory))
    commands = [argv for argv in shell_lines("docs/faces.md")
                if argv[:3] == ["python", "-m", "owt_tf.train"] and any(
                    a.startswith("insightface:/data/") for a in argv)]
    assert len(commands) >= 2
    for argv in commands:
        args = [f"insightface:{directory}" if a.startswith("insightface:") else a
                for a in argv[3:]]
        config = parse_config(args).validate()
        assert config.data.dataset == f"insightface:{directory}"


@pytest.mark.slow
def test_the_faces_pages_keras_recipe_runs_as_written(tmp_path):
    (block,) = [b for b in python_blocks("docs/faces.md") if "parallel.fit(" in b]
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val_faces_accuracy" in proc.stdout  # the Verification callback's key, in the bar
    export = tmp_path / "face_savedmodel"
    assert (export / "saved_model.pb").exists()
    line = "python -m owt_tf.evaluate --verification faces face_savedmodel"
    with open(os.path.join(ROOT, "docs/faces.md")) as f:
        assert line in f.read()
    proc = subprocess.run([sys.executable] + line.split()[1:], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "faces (600 pairs): verification accuracy" in proc.stdout


@pytest.mark.slow
def test_the_keras_pages_python_runs_as_written_in_one_process(tmp_path):
    """docs/keras.md's Python blocks, in order, in one fresh process (a later block uses what
    an earlier one defined), on the embedded digits and faces sets it names."""
    blocks = python_blocks("docs/keras.md")
    assert len(blocks) >= 4 and "owt_tf.fit_dataset(" in blocks[0]
    proc = subprocess.run([sys.executable, "-c", "\n\n".join(blocks)], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for written in ("m.keras", "best.keras", "serving/1/saved_model.pb", "logs/train"):
        assert (tmp_path / written).exists(), written
    import keras

    plain = keras.models.load_model(tmp_path / "m.keras")  # a plain model: no owt_tf needed
    assert plain.output_shape == (None, 10)
