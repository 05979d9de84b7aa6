"""The README's walkthrough, run as written: the demo trained into runs/demo, evaluated,
exported to models/demo and the export evaluated, each command copied from the README."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WALKTHROUGH_PATHS = ("runs/demo", "models/demo")


def walkthrough_commands() -> list:
    """Every `python -m owt_tf.*` line of the README's bash blocks that uses the
    walkthrough's run or model directory, in README order, without its comment."""
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    commands = []
    for block in blocks:
        for line in block.splitlines():
            command = line.split(" #")[0].strip()
            if command.startswith("python -m owt_tf.") and any(
                    p in command for p in WALKTHROUGH_PATHS):
                commands.append(command)
    return commands


def test_the_walkthrough_is_train_evaluate_export_evaluate():
    modules = [shlex.split(c)[2] for c in walkthrough_commands()]
    assert modules[0] == "owt_tf.train" and "owt_tf.export" in modules, modules
    assert modules.index("owt_tf.export") < len(modules) - 1  # the export is evaluated too


@pytest.mark.slow
def test_readme_walkthrough_runs_as_written(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for command in walkthrough_commands():
        proc = subprocess.run([sys.executable] + shlex.split(command)[1:], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        if "owt_tf.evaluate" in command:
            assert re.search(r"top-1 error [0-9.]+%", proc.stdout), proc.stdout
        if "--ten-crop" in command:  # digits train without mirror images
            assert "trains without mirror images" in proc.stderr, proc.stderr[-2000:]
        if "owt_tf.train" in command:
            assert "writing to runs/demo" in proc.stdout, proc.stdout[:2000]
            with open(tmp_path / "runs" / "demo" / "run_config.json") as f:
                assert json.load(f)["run"]["logdir"] == "runs/demo"
    assert os.path.exists(tmp_path / "runs" / "demo" / "checkpoints" / "checkpoint")
    assert os.path.exists(tmp_path / "models" / "demo" / "1" / "saved_model.pb")
