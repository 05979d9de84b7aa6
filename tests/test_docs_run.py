"""docs/faces.md's Python, run as written in a fresh process (a user's: no test devices set
up), then its `evaluate --verification` line on what the snippet exported."""
import os
import re
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
