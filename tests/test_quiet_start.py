"""Every entry point starts as quietly as `train`: none of TensorFlow's C++ start-up lines
(the oneDNN notice, CUDA stub messages, "failed call to cuInit" without a GPU) on stderr."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = ("train", "evaluate", "export", "plan", "bench", "study", "launch")
NOISE = ("cuInit", "oneDNN", "absl::InitializeLog")


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as a user's shell has it
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_quiet(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines() if any(n in line for n in NOISE)]
    assert not noise, "\n".join(noise)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_is_quiet(module):
    proc = run(f"owt_tf.{module}", "--help")
    assert_quiet(proc)
    assert f"python -m owt_tf.{module}" in proc.stdout


def test_plan_starts_tensorflow_quietly():
    proc = run("owt_tf.plan", "--model", "alexnet_tiny", "--devices", "1,2", "--batch-size", "8")
    assert_quiet(proc)
    assert "owt-b" in proc.stdout


@pytest.mark.slow
def test_bench_starts_tensorflow_quietly():
    proc = run("owt_tf.bench", "--model", "alexnet_tiny", "--devices", "2", "--schemes", "single,owt-b",
               "--batch-size", "4", "--count-only")
    assert_quiet(proc)
    assert "owt-b" in proc.stdout and "MB/step" in proc.stdout

