"""`python -m owt_tf.bench --keras-step`: one model's training step three ways, each in a
fresh process, one after the other: the CLI's step (owt_tf.training.driver, as
`python -m owt_tf.train` runs it), `owt_tf.parallelize(model).fit`, and plain Keras `fit`
under tf.distribute.MirroredStrategy, same K logical devices, same global batch. A fourth
runner times the floor: the conv trunk alone under MirroredStrategy (a one-unit Dense on
it, so no FC work). The trunk is data parallel in every scheme, the same work each time, so
no way of running the head brings a step below it.

The Keras model is the registry model's own network as one `keras.Sequential` (its conv
trunk, the head's Dense layers with ReLU and dropout, the class layer); SGD with momentum
0.9; synthetic images. Each runner reports the median of its timed steps (after warm-up);
the parent prints them and the ratios Keras path / CLI and Keras path / MirroredStrategy.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from typing import List, Optional

RUNNERS = ("cli", "keras", "mirrored", "trunk")


@dataclasses.dataclass
class KerasStepRecord:
    runner: str
    model: str
    scheme: str
    devices: int
    global_batch: int
    step_time_s: float  # median of the timed steps
    step_times_s: List[float]


def spec_as_keras(spec):
    """The spec's trunk and head as one Sequential (the registry model as a Keras user would
    write it)."""
    import keras

    trunk = spec.build_trunk()
    layers = [keras.Input(spec.input_shape)] + list(trunk.layers)
    for i, width in enumerate(spec.head.hidden):
        layers.append(keras.layers.Dense(width, activation=spec.head.hidden_activation(i),
                                         name=f"fc{i + 6}"))
        if spec.head.hidden_dropout(i):
            layers.append(keras.layers.Dropout(spec.head.hidden_dropout(i)))
    layers.append(keras.layers.Dense(spec.head.num_classes, name="classes"))
    return keras.Sequential(layers, name=spec.name)


def trunk_as_keras(spec):
    """The spec's conv trunk with a one-unit Dense on it: the step's work without the head."""
    import keras

    trunk = spec.build_trunk()
    return keras.Sequential([keras.Input(spec.input_shape)] + list(trunk.layers)
                            + [keras.layers.Flatten(name="floor_flatten"),
                               keras.layers.Dense(1, name="floor")],
                            name=f"{spec.name}_trunk")


def _data(spec, rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows,) + tuple(spec.input_shape)).astype(np.float32)
    y = rng.integers(0, spec.head.num_classes, rows).astype(np.int32)
    return x, y


def _keras_times(model, x, y, global_batch: int) -> List[float]:
    import keras

    times: List[float] = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # waits for the step
            times.append(time.perf_counter() - self.start)

    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[Timer()])
    return times


def run_runner(runner: str, model_name: str, scheme: str, k: int, batch: int, classes: int,
               warmup: int, steps: int) -> KerasStepRecord:
    """One runner's steps, in this (fresh) process."""
    from owt_tf.runtime.devices import setup_devices

    devices = setup_devices(k, "cpu")
    import keras
    import tensorflow as tf

    from owt_tf.models import build_model

    spec = build_model(model_name, classes, dropout=0.5)
    global_batch = batch * k
    x, y = _data(spec, global_batch * (warmup + steps))
    if runner == "cli":
        from owt_tf.parallel.strategy import HybridStrategy
        from owt_tf.training.driver import StepDriver
        from owt_tf.training.optim import build_optimizer

        hybrid = HybridStrategy(devices, scheme, batch_size=batch)
        driver = StepDriver(hybrid)
        model = hybrid.placement.build_model(hybrid.parallel_plan, spec, seed=0)
        optim = build_optimizer(hybrid, model, 0.001, 0.001, 0.9, 0.0)
        seed = tf.constant([0, 1], tf.int32)
        step = tf.function(lambda a, b: driver.train_step(model, optim, a, b, seed))
        times = []
        for i in range(warmup + steps):
            rows = slice(i * global_batch, (i + 1) * global_batch)
            a = hybrid.placement.distribute_global_batch(x[rows])
            b = hybrid.placement.distribute_global_batch(y[rows])
            start = time.perf_counter()
            float(step(a, b)["loss_sum"])
            times.append(time.perf_counter() - start)
    else:
        import owt_tf

        def compiled(m):
            m.compile(optimizer=keras.optimizers.SGD(0.001, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return m

        if runner == "keras":
            strategy = owt_tf.HybridStrategy(devices, scheme)
            with strategy.scope():
                model = compiled(owt_tf.parallelize(spec_as_keras(spec), seed=0))
        elif runner == "mirrored":
            strategy = tf.distribute.MirroredStrategy(devices)
            with strategy.scope():
                model = compiled(spec_as_keras(spec))
        else:
            strategy = tf.distribute.MirroredStrategy(devices)
            with strategy.scope():
                model = trunk_as_keras(spec)
                model.compile(optimizer=keras.optimizers.SGD(0.001, momentum=0.9), loss="mse")
            y = y.astype("float32")
        times = _keras_times(model, x, y, global_batch)
    timed = times[warmup:]
    return KerasStepRecord(runner, model_name, scheme, k, global_batch,
                           statistics.median(timed), timed)


def run_keras_step(model: str, scheme: str, k: int, batch: int, classes: int, warmup: int,
                   steps: int) -> List[KerasStepRecord]:
    records = []
    for runner in RUNNERS:
        cmd = [sys.executable, "-m", "owt_tf.experiments.keras_step", "--runner", runner,
               "--model", model, "--scheme", scheme, "--devices", str(k), "--batch-size",
               str(batch), "--classes", str(classes), "--warmup", str(warmup), "--steps",
               str(steps)]
        print(f"keras step: {runner}, {model}, {scheme}, K={k} ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"keras step: {runner} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        records.append(KerasStepRecord(**json.loads(out.stdout.strip().splitlines()[-1])))
    return records


def format_table(records: List[KerasStepRecord]) -> str:
    lines = [f"{'runner':9} {'model':13} {'scheme':6} {'K':>2} {'global':>6} {'step ms':>9}"]
    by = {r.runner: r for r in records}
    for r in records:
        lines.append(f"{r.runner:9} {r.model:13} {r.scheme:6} {r.devices:>2} {r.global_batch:>6} "
                     f"{r.step_time_s * 1e3:9.1f}")
    if "keras" in by and "cli" in by:
        lines.append(f"parallelize(model).fit / the CLI's step: "
                     f"{by['keras'].step_time_s / by['cli'].step_time_s:.2f}x")
    if "keras" in by and "mirrored" in by:
        lines.append(f"parallelize(model).fit / MirroredStrategy fit: "
                     f"{by['keras'].step_time_s / by['mirrored'].step_time_s:.2f}x")
    if "trunk" in by and "mirrored" in by:
        lines.append(f"the conv trunk alone under MirroredStrategy / its whole step: "
                     f"{by['trunk'].step_time_s / by['mirrored'].step_time_s:.2f}x "
                     f"(the floor: no head scheme goes below it)")
    return "\n".join(lines)


def _main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="one runner of bench --keras-step")
    p.add_argument("--runner", choices=RUNNERS, required=True)
    p.add_argument("--model", default="alexnet")
    p.add_argument("--scheme", default="owt-b")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args(argv)
    record = run_runner(a.runner, a.model, a.scheme, a.devices, a.batch_size, a.classes,
                        a.warmup, a.steps)
    print(json.dumps(dataclasses.asdict(record)))
    return 0


if __name__ == "__main__":
    from owt_tf.runtime.startup import start_tensorflow

    start_tensorflow()
    sys.exit(_main())
