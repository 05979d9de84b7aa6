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


# A fresh process frees 200 MB of 100 KB blocks (below glibc's mmap threshold: heap, not
# mmap) and prints how much of it its resident set still holds.
FREED_HEAP = """
import ctypes, os, sys
sys.path.insert(0, {root!r})
if sys.argv[1] == "kept":
    from owt_tf.runtime.startup import keep_freed_heap
    assert keep_freed_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
before = rss()
blocks = [0] * 2000  # allocated before the blocks: nothing of Python's above them
for i in range(2000):
    blocks[i] = libc.malloc(100_000)
for b in blocks:
    ctypes.memset(b, 1, 100_000)
for b in reversed(blocks):
    libc.free(b)
print((rss() - before) / 2000 / 100_000)
"""


# A process that keeps its freed heap, then measures FREED_HEAP in a child of its own with
# glibc's defaults asked for there: what the child inherits through the environment alone.
PARENT = """
import subprocess, sys
sys.path.insert(0, {root!r})
from owt_tf.runtime.startup import keep_freed_heap
assert keep_freed_heap()
print(subprocess.run([sys.executable, "-c", sys.argv[1], "default"], capture_output=True,
                     text=True, check=True).stdout)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_heap_keeps_it_and_passes_it_on():
    """keep_freed_heap (start_tensorflow's first step) has glibc keep a freed heap top mapped
    (a step's temporaries are not page-faulted and zeroed again at every step: 1.9x the
    demo's images/s on 2 cores), the processes it starts inherit it, and a user's own
    malloc settings are left alone."""
    script = FREED_HEAP.format(root=ROOT)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def run_python(*args, env=clean):
        proc = subprocess.run([sys.executable, "-c", *args], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert float(run_python(script, "default")) < 0.2  # glibc's default gives it back
    assert float(run_python(script, "kept")) > 0.9
    assert float(run_python(PARENT.format(root=ROOT), script)) > 0.9  # the child inherits it
    asked = ("import sys; sys.path.insert(0, %r); from owt_tf.runtime.startup import "
             "keep_freed_heap; print(keep_freed_heap())" % ROOT)
    for users in ({"MALLOC_TRIM_THRESHOLD_": "131072"},
                  {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}):
        assert run_python(asked, env={**clean, **users}) == "False", users
    assert run_python(asked, env={**clean, "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}) == "True"
