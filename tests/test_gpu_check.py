"""tools/gpu_check.sh: refuses a machine without a GPU in one line; its CPU mode runs the
same equivalence and bench code at tiny sizes and prints one table."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")


def _run(*args, timeout=600):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_no_gpu_is_a_clear_error():
    proc = _run(timeout=300)
    assert proc.returncode == 2
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(errors) == 1 and "no NVIDIA GPU found" in errors[0], proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_cpu_quick_mode_checks_equivalence_and_benches():
    proc = _run("--allow-cpu", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    eq = [l.split() for l in lines if l.endswith(" ok") or l.endswith(" FAIL")]
    assert {(int(r[0]), r[1]) for r in eq} == {(1, "single"), (2, "owt-b"), (2, "data")}
    assert all(r[-1] == "ok" and float(r[-3]) <= 1e-5 for r in eq)
    bench = [l.split() for l in lines if l.startswith("alexnet_tiny ")]
    # every (jit, scheme) at K=2, fp32: single and owt-b, jit off and on
    assert {(r[2], r[4]) for r in bench} == {("off", "single"), ("on", "single"),
                                             ("off", "owt-b"), ("on", "owt-b")}
    singles = [r for r in bench if r[4] == "single"]
    assert all(r[8] == "1.00" for r in singles)
    assert all(float(r[6]) > 0 for r in bench)
    assert lines[-1] == "tools/gpu_check.sh: passed"
