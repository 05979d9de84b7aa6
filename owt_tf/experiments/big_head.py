"""`python -m owt_tf.bench --big-head`: a huge classifier head trained through Keras `fit`,
owt_tf against tf.distribute.MirroredStrategy, each in its own fresh process.

The model is a small conv trunk giving FEATURES-wide features on small images and one
`Dense(classes)` softmax head, compiled with SparseCategoricalCrossentropy and SGD with
momentum. One child process trains it with `owt_tf.parallelize(model).fit` (the head as K
FC shards, loss and accuracy on the shards), another trains the same model with plain Keras
`fit` under MirroredStrategy over the same K logical devices (every replica holds the whole
head), same global batch. A fresh process each: the peak RSS (VmHWM) is then that run's
alone. Each reports its median step time over the timed steps (a callback times every train
batch, after the warm-up ones) and the bytes one replica sends per step: owt_tf's from the
byte ledger of the traced step, MirroredStrategy's as the ring all-reduce of every gradient.
The parent prints both and the ratios owt_tf / MirroredStrategy side by side.

`head` (bench's --head arcface): the face heads' class layer instead, a cosine layer
(owt_tf.layers.NormalizedDense) trained with ArcFace (scale 64, margin 0.5).

`sample_rates` (bench's --sample-rates 1,0.1): owt_tf trains once per Partial FC rate, each
in its own process, one after the other, and the parent also prints each rate's step time
and peak RSS over those of rate 1 (owt_tf.parallel.head.sampling).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

FEATURES = 256  # width of the trunk's features, the head's input
IMAGE_SIDE = 16
RUNNERS = ("owt_tf", "mirrored")
LEARNING_RATE, MOMENTUM = 0.01, 0.9


@dataclasses.dataclass
class BigHeadRecord:
    runner: str  # "owt_tf" (parallelize + fit) or "mirrored" (MirroredStrategy + fit)
    classes: int
    features: int
    devices: int
    global_batch: int
    warmup: int
    steps: int  # timed
    step_time_s: float  # median of the timed steps
    step_times_s: List[float]
    peak_rss_bytes: int  # the child process's VmHWM
    baseline_rss_bytes: int  # its RSS once TensorFlow and the devices were up
    bytes_per_step: float  # one replica sends per step (it receives as many)
    bytes_by_purpose: Dict[str, float]
    losses: List[float]  # the training loss after each batch, as fit reports it
    how: str  # how it trained: "parallelize owt-b, loss on the shards", "MirroredStrategy"
    loss_mode: Optional[str] = None  # owt_tf: model.head.loss_mode
    head_shards: Optional[int] = None  # owt_tf: the FC shards of the class layer
    sample_rate: float = 1.0  # owt_tf: Partial FC's share of each shard's classes per update
    head: str = "softmax"  # the class layer: Dense + softmax, or "arcface" (cosine + ArcFace)
    # owt_tf with --save-weights: the process's peak RSS after save_weights, then after
    # load_weights of that file (None: not run)
    save_peak_rss_bytes: Optional[int] = None
    load_peak_rss_bytes: Optional[int] = None
    precision: str = "fp32"  # the Keras policy both runners build in: fp32 or bf16 (PRECISIONS)

    @property
    def peak_growth_bytes(self) -> int:
        return self.peak_rss_bytes - self.baseline_rss_bytes


HEADS = ("softmax", "arcface")
BUILDS = ("scope", "unbuilt", "outside")  # how owt_tf's model is built: _train_owt
PRECISIONS = {"fp32": "float32", "bf16": "mixed_bfloat16"}  # the Keras dtype policies


def build_big_head_model(classes: int, features: int = FEATURES, side: int = IMAGE_SIDE,
                         head: str = "softmax", built: bool = True):
    """A small conv trunk (two convolutions, global average pooling to `features` values)
    and a `Dense(classes)` softmax head, or a cosine `NormalizedDense(classes)` for ArcFace:
    the head holds nearly every parameter. `built` False: no keras.Input, so no weights
    exist yet (owt_tf draws the head shard by shard: parallelize(..., input_shape=))."""
    import keras

    from owt_tf.layers import NormalizedDense

    keras.utils.set_random_seed(0)
    classifier = (NormalizedDense(classes, name="classes") if head == "arcface" else
                  keras.layers.Dense(classes, activation="softmax", name="classes"))
    return keras.Sequential([
        *([keras.Input((side, side, 3))] if built else []),
        keras.layers.Conv2D(64, 3, strides=2, activation="relu", name="conv1"),
        keras.layers.Conv2D(features, 3, activation="relu", name="conv2"),
        keras.layers.GlobalAveragePooling2D(name="pool"),
        classifier,
    ], name="big_head")


def _compile(model, head: str = "softmax") -> None:
    import keras

    from owt_tf.losses import ArcFace

    loss = ArcFace() if head == "arcface" else keras.losses.SparseCategoricalCrossentropy()
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM), loss=loss)


def _synthetic_data(classes: int, rows: int, side: int = IMAGE_SIDE):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, side, side, 3)).astype(np.float32)
    y = rng.integers(0, classes, size=(rows,)).astype(np.int32)
    return x, y


def _batch_timer():
    """A Keras callback that records every train batch's wall time and loss."""
    import keras

    class BatchTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times: List[float] = []
            self.losses: List[float] = []
            self._start = 0.0

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            loss = float(logs["loss"])  # waits for the step to finish
            self.times.append(time.perf_counter() - self._start)
            self.losses.append(loss)

    return BatchTimer()


def _proc_status_bytes(field: str) -> int:
    """VmHWM (peak RSS) or VmRSS from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _fit_and_time(model, classes: int, global_batch: int, warmup: int, steps: int):
    x, y = _synthetic_data(classes, global_batch * (warmup + steps))
    timer = _batch_timer()
    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[timer])
    return timer


def _train_owt(classes: int, devices: Sequence[str], global_batch: int, warmup: int,
               steps: int, scheme: str, sample_rate: float = 1.0, head: str = "softmax",
               features: int = FEATURES, build: str = "scope",
               save_weights: bool = False) -> Dict:
    """`owt_tf.parallelize(model).fit`; the step's collectives counted while it is traced.
    `build`: "scope", the model built on a keras.Input inside strategy.scope() (its head
    never drawn whole: drawn shard by shard); "unbuilt", a Sequential never built, given
    with input_shape= (the same); "outside", built before the strategy, whole (the weights
    MirroredStrategy's run starts from), split and then dropped."""
    import gc

    import owt_tf
    from owt_tf.planner import ledger

    plain = (None if build == "scope" else
             build_big_head_model(classes, features, head=head, built=build == "outside"))
    strategy = owt_tf.HybridStrategy(devices=list(devices), scheme=scheme,
                                     sample_rate=sample_rate)
    with strategy.scope():
        if build == "scope":
            plain = build_big_head_model(classes, features, head=head)
        shape = dict(input_shape=(IMAGE_SIDE, IMAGE_SIDE, 3)) if build == "unbuilt" else {}
        model = owt_tf.parallelize(plain, seed=0, **shape)
        _compile(model, head)
    del plain  # the user's one-device copy is no longer needed once split
    gc.collect()
    with ledger.recording(ledger.TrafficLedger()) as recorded:
        timer = _fit_and_time(model, classes, global_batch, warmup, steps)
    # the training's peak, before any file is written
    peaks = dict(peak_rss_bytes=_proc_status_bytes("VmHWM"))
    if save_weights:
        peaks.update(_save_and_load_peaks(model))
    return dict(timer=timer, **peaks, bytes_per_step=float(recorded.total),
                bytes_by_purpose=recorded.summary(), loss_mode=model.head.loss_mode,
                head_shards=model.head.num_shards, sample_rate=sample_rate,
                how=f"owt_tf.parallelize {strategy.scheme}, loss {model.head.loss_mode}"
                    + (f", sample_rate {sample_rate:g}" if sample_rate < 1 else ""))


def _save_and_load_peaks(model) -> Dict[str, int]:
    """save_weights of the trained model to a temporary file, then load_weights of it: the
    process's peak RSS after each."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "head.weights.h5")
        model.save_weights(path)
        saved = _proc_status_bytes("VmHWM")
        model.load_weights(path)
        return dict(save_peak_rss_bytes=saved, load_peak_rss_bytes=_proc_status_bytes("VmHWM"))


def _train_mirrored(classes: int, devices: Sequence[str], global_batch: int, warmup: int,
                    steps: int, head: str = "softmax", features: int = FEATURES) -> Dict:
    """Plain Keras `fit` under MirroredStrategy: every replica holds the whole model and
    all-reduces every gradient."""
    from owt_tf.runtime.devices import make_strategy
    from owt_tf.planner import ledger

    strategy = make_strategy(devices)
    with strategy.scope():
        model = build_big_head_model(classes, features, head=head)
        _compile(model, head)
    timer = _fit_and_time(model, classes, global_batch, warmup, steps)
    head = model.get_layer("classes").trainable_variables
    trunk = [v for v in model.trainable_variables if all(v is not h for h in head)]
    sent = {ledger.CONV_GRAD: _all_reduce_bytes(trunk, len(devices)),
            ledger.FC_GRAD: _all_reduce_bytes(head, len(devices))}
    return dict(timer=timer, bytes_per_step=sum(sent.values()), bytes_by_purpose=sent,
                how="tf.distribute.MirroredStrategy")


def _all_reduce_bytes(variables, k: int) -> float:
    """Bytes one replica sends to ring-all-reduce the gradients of `variables` over K."""
    import numpy as np

    from owt_tf.planner import ledger

    nbytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)
    return float(ledger.all_reduce_cost(nbytes, k))


def run_child(runner: str, classes: int, k: int, global_batch: int, warmup: int, steps: int,
              scheme: str = "owt-b", sample_rate: float = 1.0,
              head: str = "softmax", features: int = FEATURES,
              build: str = "scope", save_weights: bool = False) -> BigHeadRecord:
    """One runner's training, in this (fresh) process."""
    import tensorflow as tf

    from owt_tf.runtime.devices import setup_devices

    tf.get_logger().setLevel("ERROR")
    devices = setup_devices(k, "cpu")
    baseline = _proc_status_bytes("VmRSS")
    if runner == "owt_tf":
        out = _train_owt(classes, devices, global_batch, warmup, steps, scheme, sample_rate, head,
                         features, build, save_weights)
    else:
        out = _train_mirrored(classes, devices, global_batch, warmup, steps, head, features)
    timer = out.pop("timer")
    timed = timer.times[warmup:]
    return BigHeadRecord(
        runner=runner, classes=classes, features=features, devices=k,
        global_batch=global_batch, warmup=warmup, steps=len(timed),
        step_time_s=statistics.median(timed), step_times_s=timed,
        peak_rss_bytes=out.pop("peak_rss_bytes", None) or _proc_status_bytes("VmHWM"),
        baseline_rss_bytes=baseline,
        losses=timer.losses, head=head, **out)


def _child_command(runner: str, args, out: str, sample_rate: float = 1.0) -> List[str]:
    # Without the MirroredStrategy run to match, owt_tf's head is never drawn whole (a head
    # one device cannot hold); with it, both start from the same built model's weights.
    extra = ["--build", args.build if "mirrored" not in args.runners else "outside",
             "--precision", args.precision]
    extra += ["--save-weights"] if runner == "owt_tf" and args.save_weights else []
    return [sys.executable, "-m", "owt_tf.experiments.big_head", "--child", runner,
            "--classes", str(args.classes), "--devices", str(args.k),
            "--global-batch", str(args.global_batch), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--scheme", args.scheme,
            "--sample-rate", repr(sample_rate), "--head", args.head,
            "--features", str(args.features), "--out", out] + extra


def run_in_fresh_process(runner: str, args, sample_rate: float = 1.0) -> Optional[BigHeadRecord]:
    """`runner`'s record from a child process of its own; None (and why, on stderr) when the
    child failed, e.g. out of memory."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record.json")
        rate = f", sample_rate {sample_rate:g}" if sample_rate < 1 else ""
        print(f"big head: {runner}, {args.classes} classes, K={args.k}{rate} ...",
              file=sys.stderr, flush=True)
        proc = subprocess.run(_child_command(runner, args, out, sample_rate), capture_output=True,
                              text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"big head: {runner} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}",
                  file=sys.stderr)
            return None
        with open(out) as f:
            return BigHeadRecord(**json.load(f))


def ratios(records: Sequence[BigHeadRecord]) -> Optional[Dict[str, float]]:
    """owt_tf (its first record at rate 1, else its first) / MirroredStrategy for peak RSS,
    its growth over the start, step time and bytes; None unless both ran."""
    owt = [r for r in records if r.runner == "owt_tf"]
    mirrored = [r for r in records if r.runner == "mirrored"]
    if not owt or not mirrored:
        return None
    o = next((r for r in owt if r.sample_rate == 1.0), owt[0])
    m = mirrored[0]
    return {"peak_rss": o.peak_rss_bytes / m.peak_rss_bytes,
            "peak_growth": o.peak_growth_bytes / m.peak_growth_bytes,
            "step_time": o.step_time_s / m.step_time_s,
            "bytes_per_step": o.bytes_per_step / m.bytes_per_step}


def sampling_ratios(records: Sequence[BigHeadRecord]) -> Dict[str, Dict[str, float]]:
    """Per sample rate < 1 (its str as key): owt_tf's step time and peak RSS at that rate over
    those at rate 1; empty unless owt_tf ran at 1 and at another rate."""
    owt = {r.sample_rate: r for r in records if r.runner == "owt_tf"}
    full = owt.get(1.0)
    if full is None:
        return {}
    return {f"{rate:g}": {"step_time": r.step_time_s / full.step_time_s,
                          "peak_rss": r.peak_rss_bytes / full.peak_rss_bytes}
            for rate, r in owt.items() if rate < 1.0}


def format_big_head_table(records: Sequence[BigHeadRecord]) -> str:
    head = (f"{'runner':9} {'classes':>9} {'K':>2} {'glob':>5} {'step ms':>9} {'peak MB':>8} "
            f"{'growth MB':>9} {'MB/step':>9}  how")
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(f"{r.runner:9} {r.classes:>9} {r.devices:>2} {r.global_batch:>5} "
                     f"{r.step_time_s * 1e3:9.1f} {r.peak_rss_bytes / 1e6:8.0f} "
                     f"{r.peak_growth_bytes / 1e6:9.0f} {r.bytes_per_step / 1e6:9.1f}  {r.how}"
                     + (f", {r.precision}" if r.precision != "fp32" else ""))
    for r in records:
        if r.save_peak_rss_bytes is not None:
            lines.append(f"{r.classes} classes, owt_tf r={r.sample_rate:g}: peak RSS "
                         f"{r.save_peak_rss_bytes / 1e6:,.0f} MB after save_weights, "
                         f"{r.load_peak_rss_bytes / 1e6:,.0f} MB after load_weights")
    for classes in sorted({r.classes for r in records}):
        same = [r for r in records if r.classes == classes]
        rel = ratios(same)
        if rel:
            lines.append(f"{classes} classes, owt_tf / MirroredStrategy: peak memory "
                         f"{rel['peak_rss']:.2f}x (growth over start {rel['peak_growth']:.2f}x), "
                         f"step time {rel['step_time']:.2f}x, bytes per step "
                         f"{rel['bytes_per_step']:.3f}x")
        for rate, rel in sampling_ratios(same).items():
            lines.append(f"{classes} classes, owt_tf sample_rate {rate} / 1: step time "
                         f"{rel['step_time']:.2f}x, peak memory {rel['peak_rss']:.2f}x")
    return "\n".join(lines + ["", format_grid(records)])


def format_grid(records: Sequence[BigHeadRecord]) -> str:
    """Classes x sample rate (and MirroredStrategy where it ran): step ms / peak MB."""
    columns = sorted({r.sample_rate for r in records if r.runner == "owt_tf"}, reverse=True)
    names = [f"owt_tf r={rate:g}" for rate in columns]
    mirrored = any(r.runner == "mirrored" for r in records)
    names += ["MirroredStrategy"] if mirrored else []
    lines = [f"{'classes':>10} | " + " | ".join(f"{n:>20}" for n in names),
             f"{'':>10} | " + " | ".join(f"{'step ms / peak MB':>20}" for _ in names)]
    for classes in sorted({r.classes for r in records}):
        cells = []
        for rate in columns:
            found = [r for r in records if r.runner == "owt_tf" and r.classes == classes
                     and r.sample_rate == rate]
            cells.append(_cell(found[0] if found else None))
        if mirrored:
            found = [r for r in records if r.runner == "mirrored" and r.classes == classes]
            cells.append(_cell(found[0] if found else None))
        lines.append(f"{classes:>10} | " + " | ".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)


def _cell(record: Optional[BigHeadRecord]) -> str:
    if record is None:
        return "not run"
    return f"{record.step_time_s * 1e3:,.0f} / {record.peak_rss_bytes / 1e6:,.0f}"


@dataclasses.dataclass
class BigHeadArgs:
    classes: int
    k: int
    global_batch: int
    warmup: int
    steps: int
    scheme: str = "owt-b"
    runners: Sequence[str] = RUNNERS
    sample_rates: Sequence[float] = (1.0,)  # owt_tf runs once per rate
    head: str = "softmax"
    features: int = FEATURES  # the head's input width
    save_weights: bool = False  # owt_tf: save_weights + load_weights after training
    build: str = "scope"  # owt_tf without the mirrored runner: "scope" or "unbuilt" (BUILDS)
    precision: str = "fp32"  # a key of PRECISIONS


def run_big_head(args: BigHeadArgs) -> List[BigHeadRecord]:
    """Each runner (owt_tf: at each sample rate) in its own fresh process, one after the
    other (never two at once: they would share the cores and the memory)."""
    jobs = [(runner, rate) for runner in args.runners
            for rate in (args.sample_rates if runner == "owt_tf" else (1.0,))]
    records = [run_in_fresh_process(runner, args, rate) for runner, rate in jobs]
    return [r for r in records if r is not None]


def write_json(path: str, records: Sequence[BigHeadRecord]) -> None:
    rows = [dict(dataclasses.asdict(r), peak_growth_bytes=r.peak_growth_bytes) for r in records]
    data = {"records": rows, "ratios": ratios(records),
            "sampling_ratios": sampling_ratios(records)}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _child_main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m owt_tf.experiments.big_head",
                                description="one runner of `bench --big-head` (a child process)")
    p.add_argument("--child", required=True, choices=RUNNERS)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--scheme", default="owt-b")
    p.add_argument("--sample-rate", type=float, default=1.0)
    p.add_argument("--head", default="softmax", choices=HEADS)
    p.add_argument("--features", type=int, default=FEATURES)
    p.add_argument("--save-weights", action="store_true",
                   help="owt_tf: save_weights and load_weights after training (peak RSS of each)")
    p.add_argument("--build", default="scope", choices=BUILDS,
                   help="owt_tf: how the model is built (_train_owt)")
    p.add_argument("--precision", default="fp32", choices=tuple(PRECISIONS))
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from owt_tf.runtime.startup import start_tensorflow

    start_tensorflow()
    import keras

    keras.mixed_precision.set_global_policy(PRECISIONS[a.precision])  # before any model
    record = run_child(a.child, a.classes, a.devices, a.global_batch, a.warmup, a.steps,
                       a.scheme, a.sample_rate, a.head, a.features, a.build, a.save_weights)
    with open(a.out, "w") as f:
        json.dump(dataclasses.asdict(dataclasses.replace(record, precision=a.precision)), f)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
