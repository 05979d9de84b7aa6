"""The prepared check of a machine with NVIDIA GPUs (run by tools/gpu_check.sh, which bounds it).

1. Equivalence on the real GPU: the engine against the single-device reference of the test
   suite (tests/engine_harness.py, tests/reference.py; the reference runs on the CPU), 3 SGD
   steps of alexnet_tiny, dropout off, TF32 off: K = 1 on the whole GPU, K = 2 and 4 as
   logical GPUs split from it (owt_tf.runtime.devices, `--device-type gpu`).
2. `python -m owt_tf.bench`: the paper's AlexNet, B = 128 per replica, single vs data vs
   owt-a/b/c at K = 2 and 4 (single: one device, the same global batch), `--jit` off and on,
   in fp32 and, when bench has a `--precision` flag, bf16 (TF32 left as TensorFlow sets it).

Each part runs in a process of its own under its own time limit (a part that runs out is a
row that says so) and one table is printed at the end. Exit status: 0 all equivalence rows
within tolerance, 1 otherwise or a part failed, 2 no GPU (and no --allow-cpu).

`--allow-cpu --quick`: the same code on logical CPU devices at tiny sizes (alexnet_tiny,
B = 8, K = 1 and 2, two schemes), what the test suite runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "tools/gpu_check.sh"
GPU_TOL = 1e-4  # GPU kernels (cuDNN) against the CPU reference; the suite's CPU runs hold 1e-5
CPU_TOL = 1e-5


def full_plan() -> Dict[str, object]:
    return {"eq_groups": [[1], [2, 4]],
            "eq_cases": {1: [("single", "global")],
                         2: [("data", "global"), ("owt-a", "global"), ("owt-b", "worker"),
                             ("owt-c", "global")],
                         4: [("data", "global"), ("owt-a", "global"), ("owt-b", "worker"),
                             ("owt-c", "global")]},
            "bench": ["--model", "alexnet", "--devices", "2,4", "--batch-size", "128",
                      "--schemes", "single,data,owt-a,owt-b,owt-c",
                      "--steps", "5", "--warmup", "1"],
            # seconds: each equivalence process, then all bench runs together (shared by the
            # precisions); with the GPU probe about 7.5 minutes at most
            "budget": {"eq": [45, 105], "bench": 280}}


def quick_plan() -> Dict[str, object]:
    return {"eq_groups": [[1], [2]],
            "eq_cases": {1: [("single", "global")], 2: [("owt-b", "worker"), ("data", "global")]},
            "bench": ["--model", "alexnet_tiny", "--devices", "2", "--batch-size", "8",
                      "--classes", "10", "--schemes", "single,owt-b",
                      "--steps", "2", "--warmup", "1"],
            "budget": {"eq": [100, 140], "bench": 200}}


def has_gpu() -> Optional[str]:
    """The first GPU's name when nvidia-smi and TensorFlow both see one, else None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        return None
    probe = subprocess.run([sys.executable, "-c", "import tensorflow as tf; "
                            "print(len(tf.config.list_physical_devices('GPU')))"],
                           capture_output=True, text=True, timeout=120, env=_env())
    if probe.returncode != 0 or not probe.stdout.strip().splitlines()[-1:] or \
            probe.stdout.strip().splitlines()[-1] == "0":
        return None
    return listed.stdout.splitlines()[0]


def _env() -> Dict[str, str]:
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")] +
                           [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="2")


def run_part(args: List[str], timeout: float) -> Dict[str, object]:
    """A subprocess under `timeout` seconds: its exit code (None: timed out), output, seconds."""
    start = time.monotonic()
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_env(),
                              cwd=ROOT)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = None, _text(exc.stdout), _text(exc.stderr)
    return {"code": code, "stdout": out, "stderr": err, "seconds": time.monotonic() - start}


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def equivalence_worker(ks: List[int], device_type: str, cases: Dict[int, list], out: str) -> int:
    """In this process: K = max(ks) devices of `device_type`, each case against the reference."""
    import tensorflow as tf

    from owt_tf.runtime.devices import setup_devices

    tf.config.experimental.enable_tensor_float_32_execution(False)
    devices = setup_devices(max(ks), device_type)
    from engine_harness import compare_with_reference

    rows = []
    for k in ks:
        for scheme, fc_batch in cases[k]:
            start = time.monotonic()
            result = compare_with_reference(devices, scheme, k, 8, fc_batch)
            worst = max(result["worst"].values())
            rows.append({"k": k, "scheme": scheme, "fc_batch": fc_batch, "worst": worst,
                         "device": devices[0], "seconds": time.monotonic() - start})
            with open(out, "w") as f:  # after every case: a timed-out run keeps what it did
                json.dump(rows, f)
    return 0


def bench_has_precision() -> bool:
    proc = run_part([sys.executable, "-m", "owt_tf.bench", "--help"], 120)
    return proc["code"] == 0 and "--precision" in proc["stdout"]


def format_tables(eq_rows: List[dict], eq_notes: List[str], bench_rows: List[dict],
                  bench_notes: List[str], tol: float) -> str:
    lines = [f"equivalence with the single-device reference (3 steps, alexnet_tiny, B=8, "
             f"worst relative error of loss, gradients, weights; tolerance {tol:g})",
             f"{'K':>2} {'scheme':6} {'fc batch':8} {'device':18} {'worst':>9} {'s':>5}  result"]
    for r in eq_rows:
        ok = "ok" if r["worst"] <= tol else "FAIL"
        lines.append(f"{r['k']:>2} {r['scheme']:6} {r['fc_batch']:8} {r['device']:18} "
                     f"{r['worst']:9.2e} {r['seconds']:5.1f}  {ok}")
    lines += [f"  {n}" for n in eq_notes]
    lines += ["", "bench (step time median; x single: against one device with the same global "
                  "batch, same jit and precision)",
              f"{'model':12} {'prec':4} {'jit':3} {'K':>2} {'scheme':6} {'B':>4} {'step ms':>9} "
              f"{'img/s':>8} {'x single':>8} {'MB/step':>9}"]
    singles = {(r["precision"], r["jit"], r["k"]): r["step_time_s"] for r in bench_rows
               if r["scheme"] == "single"}
    for r in bench_rows:
        base = singles.get((r["precision"], r["jit"], r["k"]))
        ratio = f"{r['step_time_s'] / base:8.2f}" if base and r["step_time_s"] else f"{'-':>8}"
        step = f"{r['step_time_s'] * 1e3:9.1f}" if r["step_time_s"] else f"{'-':>9}"
        ips = f"{r['images_per_sec']:8.0f}" if r["images_per_sec"] else f"{'-':>8}"
        lines.append(f"{r['model']:12} {r['precision']:4} {'on' if r['jit'] else 'off':3} "
                     f"{r['k']:>2} {r['scheme']:6} {r['batch_size']:>4} {step} {ips} {ratio} "
                     f"{r['bytes_per_step'] / 1e6:9.3f}")
    lines += [f"  {n}" for n in bench_notes]
    return "\n".join(lines)


def check(args) -> int:
    gpu = has_gpu()
    if gpu is None and not args.allow_cpu:
        print(f"{PROG}: error: no NVIDIA GPU found (nvidia-smi and TensorFlow must both see "
              "one); nothing was checked (--allow-cpu --quick runs the same code on logical "
              "CPUs)", file=sys.stderr)
        return 2
    device_type = "gpu" if gpu else "cpu"
    plan = quick_plan() if args.quick else full_plan()
    tol = GPU_TOL if gpu else CPU_TOL
    print(f"{PROG}: {gpu or 'no GPU: logical CPU devices (--allow-cpu)'}; "
          f"{'quick' if args.quick else 'full'} check", flush=True)
    work = tempfile.mkdtemp(prefix="owt_tf_gpu_check_")
    eq_rows, eq_notes, failed = [], [], False
    for ks, eq_budget in zip(plan["eq_groups"], plan["budget"]["eq"]):
        out = os.path.join(work, f"eq_{'_'.join(map(str, ks))}.json")
        part = run_part([sys.executable, os.path.abspath(__file__), "--equivalence",
                         ",".join(map(str, ks)), "--device-type", device_type, "--out", out,
                         "--quick" if args.quick else "--full"], eq_budget)
        rows = json.load(open(out)) if os.path.exists(out) else []
        eq_rows += rows
        if part["code"] != 0:
            failed = True
            why = "timed out" if part["code"] is None else f"exit {part['code']}"
            tail = (part["stderr"].strip().splitlines() or [""])[-1]
            eq_notes.append(f"K={','.join(map(str, ks))}: {why} after {part['seconds']:.0f} s "
                            f"({len(rows)} cases done) {tail}")
    failed |= any(r["worst"] > tol for r in eq_rows)
    precisions = ["fp32"]
    bench_notes = []
    with_precision = bench_has_precision()
    if with_precision:
        precisions.append("bf16")
    else:
        bench_notes.append("bf16 rows skipped: this owt_tf.bench has no --precision flag")
    bench_rows = []
    # One bench process per (precision, jit), so that one that runs out of time loses only its rows.
    runs = [(precision, jit) for precision in precisions for jit in ("off", "on")]
    for precision, jit in runs:
        out = os.path.join(work, f"bench_{precision}_{jit}.json")
        extra = ["--precision", precision] if with_precision else []
        part = run_part([sys.executable, "-m", "owt_tf.bench", *plan["bench"], "--jit", jit,
                         *extra, "--out", out], plan["budget"]["bench"] / len(runs))
        if part["code"] != 0 or not os.path.exists(out):
            failed = True
            why = "timed out" if part["code"] is None else f"exit {part['code']}"
            tail = (part["stderr"].strip().splitlines() or [""])[-1]
            bench_notes.append(f"{precision} jit {jit}: {why} after {part['seconds']:.0f} s {tail}")
            continue
        batch = int(plan["bench"][plan["bench"].index("--batch-size") + 1])
        for r in json.load(open(out)):
            # single runs one device on the global batch B*K: its K is the one it stands in for
            bench_rows.append({"model": r["model"], "precision": precision, "jit": r["jit"],
                               "k": r["global_batch"] // batch, "scheme": r["scheme"],
                               "batch_size": r["batch_size"], "step_time_s": r["step_time_s"],
                               "images_per_sec": r["images_per_sec"],
                               "bytes_per_step": r["bytes_per_step"]})
    print(format_tables(eq_rows, eq_notes, bench_rows, bench_notes, tol))
    shutil.rmtree(work, ignore_errors=True)
    print(f"{PROG}: {'FAILED' if failed else 'passed'}")
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allow-cpu", action="store_true",
                   help="without a GPU, run on logical CPU devices instead of failing")
    p.add_argument("--quick", action="store_true", help="tiny sizes (what the test suite runs)")
    p.add_argument("--full", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--equivalence", default=None, help=argparse.SUPPRESS)  # a worker process
    p.add_argument("--device-type", default="gpu", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.equivalence:
        plan = quick_plan() if args.quick else full_plan()
        ks = [int(k) for k in args.equivalence.split(",")]
        return equivalence_worker(ks, args.device_type, plan["eq_cases"], args.out)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
