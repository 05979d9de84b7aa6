"""`python -m owt_tf.bench --first-step`: how long a run waits for its first step (trace,
graph optimisation, compile and the step itself) as K grows, each K in a fresh process.

The CLI's step (owt_tf.training.driver) on the bench's model, scheme and FC batch; the
first call of the traced step is timed, then a second one (the steady step) for scale. One
process per configuration: a trace reuses nothing from an earlier one.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from typing import List, Optional


@dataclasses.dataclass
class FirstStepRecord:
    model: str
    scheme: str
    fc_batch: str
    devices: int
    batch_size: int
    first_step_s: float  # trace + optimisation + compile + the step
    second_step_s: float
    graph_ops: int  # operations in the traced step's graph, all replicas


def measure(model: str, scheme: str, fc_batch: str, k: int, batch: int, classes: int) -> FirstStepRecord:
    """In this process (K logical devices set up here): the first and second step."""
    from owt_tf.runtime.devices import setup_devices

    devices = setup_devices(k)
    import numpy as np
    import tensorflow as tf

    from owt_tf.models import build_model
    from owt_tf.parallel.step import step_seed
    from owt_tf.parallel.strategy import HybridStrategy
    from owt_tf.training.driver import StepDriver
    from owt_tf.training.optim import build_optimizer

    spec = build_model(model, classes, dropout=0.5)
    hybrid = HybridStrategy(devices, scheme, batch_size=batch, fc_batch=fc_batch)
    driver = StepDriver(hybrid)
    built = hybrid.placement.build_model(hybrid.parallel_plan, spec, seed=0)
    optim = build_optimizer(hybrid, built, 0.001, 0.001, 0.9, 5e-4)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(batch * k,) + tuple(spec.input_shape)).astype(np.float32)
    labels = rng.integers(0, classes, size=(batch * k,)).astype(np.int32)
    x = hybrid.placement.distribute_global_batch(images)
    y = hybrid.placement.distribute_global_batch(labels)
    # The seed follows a step counter, as the CLI's loop's does (a constant seed would be
    # folded into the graph, which the CLI's is not).
    counter = tf.Variable(0, dtype=tf.int64)
    step = tf.function(lambda x, y: driver.train_step(built, optim, x, y, step_seed(0, counter)))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        float(step(x, y)["loss_sum"])
        times.append(time.perf_counter() - start)
    ops = len(step.get_concrete_function(x, y).graph.get_operations())
    return FirstStepRecord(model, scheme, fc_batch, k, batch, times[0], times[1], ops)


def run_first_step(model: str, schemes: List[str], fc_batch: str, ks: List[int], batch: int,
                   classes: int) -> List[FirstStepRecord]:
    """Every (scheme, K), each in a fresh process."""
    from owt_tf.planner.plan import Scheme

    records = []
    for scheme in schemes:
        for k in ks:
            cmd = [sys.executable, "-m", "owt_tf.experiments.first_step", "--model", model,
                   "--scheme", scheme,
                   "--fc-batch", fc_batch if Scheme(scheme).allows_worker_fc_batch else "global",
                   "--devices", str(k), "--batch-size", str(batch), "--classes", str(classes)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"first step of {scheme} at K={k} failed:\n{out.stderr[-2000:]}",
                      file=sys.stderr)
                continue
            records.append(FirstStepRecord(**json.loads(out.stdout.strip().splitlines()[-1])))
            lines = format_table(records).splitlines()  # each line as its K is done
            print("\n".join(lines if len(records) == 1 else lines[-1:]), flush=True)
    return records


def format_table(records: List[FirstStepRecord]) -> str:
    """One line per record; `x first K`: its first step over the same scheme's at the first
    K measured."""
    lines = [f"{'model':<13} {'scheme':<6} {'fc batch':<8} {'K':>3} {'first step s':>12} "
             f"{'x first K':>9} {'2nd step s':>10} {'graph ops':>9}"]
    base = {}
    for r in records:
        base.setdefault((r.scheme, r.fc_batch), r.first_step_s)
        lines.append(f"{r.model:<13} {r.scheme:<6} {r.fc_batch:<8} {r.devices:>3} "
                     f"{r.first_step_s:>12.1f} {r.first_step_s / base[(r.scheme, r.fc_batch)]:>9.2f} "
                     f"{r.second_step_s:>10.3f} {r.graph_ops:>9}")
    return "\n".join(lines)


def _main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="one first-step measurement (run by the bench)")
    p.add_argument("--model", default="alexnet_tiny")
    p.add_argument("--scheme", default="owt-b")
    p.add_argument("--fc-batch", default="worker")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--classes", type=int, default=10)
    a = p.parse_args(argv)
    record = measure(a.model, a.scheme, a.fc_batch, a.devices, a.batch_size, a.classes)
    print(json.dumps(dataclasses.asdict(record)))
    return 0


if __name__ == "__main__":
    from owt_tf.runtime.startup import start_tensorflow

    start_tensorflow()
    sys.exit(_main())
