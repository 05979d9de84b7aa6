"""`python -m owt_tf.bench`: schemes measured side by side, interleaved, in one process.

Every configuration (scheme x K x jit x precision) is built first and warmed up (traced,
compiled); then timed steps go round-robin over all of them, so slow drift of the machine
hits every configuration alike. Reported per configuration: median step time and images/s,
bytes one replica sends per step from the byte ledger, and peak memory. `single` runs on one device with the
same global batch as the K-device schemes it is compared with.

`--count-only` traces each step without running it and reports the ledger's bytes: how the
paper's AlexNet at K=8 is counted without K GPUs' worth of compute.

`--input folder:PATH|tfds:NAME` times the input pipeline instead of the model: training
batches (global batch B x max K, the model's input size) against bare decoding of the same
records, in alternating rounds in one process; images/s and per core.

`--big-head` times a huge classifier head through Keras `fit` instead: owt_tf's
`parallelize` against plain Keras under MirroredStrategy, each in a fresh process, peak
memory and step time side by side (owt_tf.experiments.big_head).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

from owt_tf.cli import OneLineParser
from owt_tf.config import PRECISIONS, SCHEMES, ConfigError
from owt_tf.planner.plan import Scheme, sample_rate_problem

DEFAULT_SCHEMES = "single,data,owt-a,owt-b,owt-c"


@dataclasses.dataclass
class BenchRecord:
    model: str
    scheme: str
    devices: int
    batch_size: int  # per replica
    global_batch: int
    fc_batch: str
    fc_exchange: str
    loss: str
    jit: bool
    precision: str
    images_per_sec: Optional[float]
    step_time_s: Optional[float]
    bytes_per_step: float  # sent by one worker per step (it receives as many)
    bytes_by_purpose: Dict[str, float]
    # GPUs: the allocators' peak over the configuration's devices while it was built and
    # warmed up. CPUs (no allocator statistics): growth of the process's peak RSS then.
    peak_memory_bytes: Optional[int]


def _parse_list(text: str, kind=str) -> List:
    return [kind(part) for part in text.split(",") if part]


def _number_or_text(text: str):
    """`text` as a float, or as it is when it is none (for the error that names it)."""
    try:
        return float(text)
    except ValueError:
        return text


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m owt_tf.bench", description=__doc__,
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="alexnet_tiny", help="alexnet, alexnet_tiny, vgg16 or vgg_tiny")
    p.add_argument("--devices", default="4", help="comma-separated K values, e.g. 1,2,4,8")
    p.add_argument("--schemes", default=None,
                   help="comma-separated schemes to measure side by side (default "
                        f"{DEFAULT_SCHEMES}; with --big-head: the one owt scheme, default owt-b)")
    p.add_argument("--batch-size", type=int, default=32, help="examples per replica (device) per step (B)")
    p.add_argument("--image-size", type=int, default=None, help="input side (none: the model's)")
    p.add_argument("--classes", type=int, default=1000, help="classes of the last FC layer")
    p.add_argument("--fc-batch", default="global", choices=("global", "worker"), help="as train's")
    p.add_argument("--fc-exchange", default="gather", choices=("gather", "colrow"), help="as train's")
    p.add_argument("--loss", default="gathered", choices=("gathered", "sharded"), help="as train's")
    p.add_argument("--jit", default="off", choices=("off", "on", "both"), help="XLA-compile the trunk")
    p.add_argument("--precision", default="fp32",
                   help="comma-separated compute precisions to run each configuration in: fp32, "
                        "bf16, fp16 (e.g. fp32,bf16)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    p.add_argument("--count-only", action="store_true", help="trace only: report bytes, no timing")
    p.add_argument("--out", default=None, help="write the records as JSON here")
    p.add_argument("--input", default=None, metavar="DATASET", help="time the input pipeline of folder:PATH or tfds:NAME")
    p.add_argument("--data-dir", default=None, help="TFDS data directory (with --input tfds:NAME)")
    p.add_argument("--big-head", action="store_true",
                   help="a conv trunk + Dense(--classes) head through Keras fit: owt_tf against "
                        "MirroredStrategy over the same K devices, each in a fresh process")
    p.add_argument("--baseline", default="mirrored", choices=("mirrored", "none"),
                   help="with --big-head: none runs owt_tf alone (a head MirroredStrategy "
                        "cannot hold)")
    p.add_argument("--sample-rates", default="1",
                   help="with --big-head: comma-separated Partial FC sample rates owt_tf trains "
                        "at, each in its own process, e.g. 1,0.1 (step time and peak memory "
                        "of each rate over rate 1's printed)")
    p.add_argument("--head", default="softmax", choices=("softmax", "arcface"),
                   help="with --big-head: the class layer, a Dense softmax or a face model's "
                        "cosine layer (NormalizedDense) trained with ArcFace")
    p.add_argument("--save-weights", action="store_true", help="with --big-head: owt_tf "
                   "then saves and loads its weights file (peak RSS after each)")
    p.add_argument("--head-classes", default=None, help="with --big-head: comma-separated "
                   "class counts, one table of classes x sample rate (default: --classes)")
    p.add_argument("--features", type=int, default=256, help="with --big-head: the head's "
                   "input width (a face model's embedding: 128 or 512)")
    p.add_argument("--head-build", default="scope", choices=("scope", "unbuilt"), help="with "
                   "--big-head --baseline none: owt_tf's model built on a keras.Input inside "
                   "strategy.scope(), or a Sequential never built given input_shape=")
    p.add_argument("--keras-step", action="store_true",
                   help="one model's step three ways, each in a fresh process: the CLI's, "
                        "owt_tf.parallelize(model).fit and MirroredStrategy fit, and its "
                        "conv trunk alone (the floor) (the first of --schemes and --devices)")
    p.add_argument("--first-step", action="store_true",
                   help="time the first step (trace, compile, step) of --schemes at each K in "
                        "--devices, each in a fresh process (--fc-batch applies to owt-b/c)")
    return p


def _check(args) -> None:
    from owt_tf.models.registry import MODEL_NAMES

    if args.model not in MODEL_NAMES:
        raise ConfigError("--model", f"unknown value {args.model!r}; allowed: {', '.join(MODEL_NAMES)}")
    for s in args.schemes:
        if s not in SCHEMES:
            raise ConfigError("--schemes", f"unknown scheme {s!r}; allowed: {', '.join(SCHEMES)}")
    if not args.devices or min(args.devices) < 1:
        raise ConfigError("--devices", "K values must be integers >= 1")
    for precision in args.precision:
        if precision not in PRECISIONS:
            raise ConfigError("--precision", f"unknown precision {precision!r}; allowed: "
                              f"{', '.join(PRECISIONS)}")
    if args.batch_size < 1 or args.steps < 1 or args.warmup < 0:
        raise ConfigError("--batch-size", "batch size and step counts must be positive")


class _Config:
    """One configuration under test: its strategy, model, optimizer, batch and step."""

    def __init__(self, args, devices, scheme: str, k: int, jit: bool, precision: str):
        import numpy as np
        import tensorflow as tf

        from owt_tf.models import build_model
        from owt_tf.parallel.strategy import HybridStrategy
        from owt_tf.training.driver import StepDriver
        from owt_tf.training.optim import build_optimizer

        self.scheme, self.k, self.jit, self.precision = scheme, k, jit, precision
        self.global_batch = args.batch_size * k
        run_k = 1 if Scheme(scheme) is Scheme.SINGLE else k
        self.batch = self.global_batch // run_k
        spec = build_model(args.model, args.classes, dropout=0.5, image_size=args.image_size)
        fc_batch = args.fc_batch if Scheme(scheme).has_rounds else "global"
        self.fc_batch = fc_batch
        self.hybrid = HybridStrategy(
            devices[:run_k], scheme, batch_size=self.batch, fc_batch=fc_batch,
            fc_exchange=args.fc_exchange if Scheme(scheme).model_parallel else "gather",
            loss=args.loss, jit=jit, precision=precision)
        self.driver = StepDriver(self.hybrid)
        self.model = self.hybrid.placement.build_model(self.hybrid.parallel_plan, spec, seed=0)
        self.optim = build_optimizer(self.hybrid, self.model, 0.001, 0.001, 0.9, 5e-4)
        rng = np.random.default_rng(0)
        shape = (self.global_batch,) + tuple(spec.input_shape)
        images = (np.zeros(shape, np.float32) if args.count_only
                  else rng.normal(size=shape).astype(np.float32))
        labels = rng.integers(0, args.classes, size=(self.global_batch,)).astype(np.int32)
        self.inputs = [self.hybrid.placement.distribute_global_batch(images),
                       self.hybrid.placement.distribute_global_batch(labels)]
        seed = tf.constant([0, 1], tf.int32)
        # fp16 steps are taken at a loss scale, as in training (its overflow checks are the
        # training loop's, between steps, and not timed here)
        scale = tf.constant(2.0 ** 15) if precision == "fp16" else None

        @tf.function
        def step(x, y):
            return self.driver.train_step(self.model, self.optim, x, y, seed, loss_scale=scale)

        self.step = step

    def trace(self) -> None:
        self.step.get_concrete_function(*self.inputs)

    def run_once(self) -> float:
        start = time.perf_counter()
        out = self.step(*self.inputs)
        float(out["loss_sum"])  # wait for the step to finish
        return time.perf_counter() - start


def _rss_peak_reset() -> None:
    try:  # Linux: writing 5 resets the peak resident set size (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _proc_status_bytes(field: str) -> Optional[int]:
    """A memory figure from /proc/self/status (VmHWM: peak RSS, VmRSS: RSS), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_bench(args) -> List[BenchRecord]:
    import tensorflow as tf

    from owt_tf.runtime.devices import setup_devices

    # Each configuration is its own tf.function by design; TF's retracing warning is noise here.
    tf.get_logger().setLevel("ERROR")
    devices = setup_devices(max(args.devices))
    jits = {"off": [False], "on": [True], "both": [False, True]}[args.jit]
    configs: List[_Config] = []
    memory: Dict[int, Optional[int]] = {}
    for k in args.devices:
        for scheme in args.schemes:
            problem = Scheme(scheme).batch_problem(k, args.batch_size)
            if problem:
                print(f"skip {scheme} at K={k}: {problem}", file=sys.stderr)
                continue
            for jit, precision in [(j, p) for j in jits for p in args.precision]:
                on_gpu = "GPU" in devices[0]
                before = _proc_status_bytes("VmRSS")
                _rss_peak_reset()
                for d in devices if on_gpu else []:
                    tf.config.experimental.reset_memory_stats(d)
                cfg = _Config(args, devices, scheme, k, jit, precision)
                if args.count_only:
                    cfg.trace()
                else:
                    for _ in range(max(args.warmup, 1)):
                        cfg.run_once()
                if on_gpu:
                    memory[id(cfg)] = sum(tf.config.experimental.get_memory_info(d)["peak"]
                                          for d in cfg.hybrid.placement.devices)
                else:
                    peak = _proc_status_bytes("VmHWM")
                    memory[id(cfg)] = (peak - before) if peak and before else None
                configs.append(cfg)
                print(f"ready: {scheme} K={k} jit={'on' if jit else 'off'} {precision}",
                      file=sys.stderr)
    times: Dict[int, List[float]] = {id(c): [] for c in configs}
    if not args.count_only:
        for _ in range(args.steps):
            for cfg in configs:  # interleaved: every configuration sees the same machine
                times[id(cfg)].append(cfg.run_once())
    records = []
    for cfg in configs:
        t = statistics.median(times[id(cfg)]) if times[id(cfg)] else None
        ledger = cfg.driver.ledger
        records.append(BenchRecord(
            model=args.model, scheme=cfg.scheme, devices=1 if Scheme(cfg.scheme) is Scheme.SINGLE else cfg.k,
            batch_size=cfg.batch, global_batch=cfg.global_batch, fc_batch=cfg.fc_batch,
            fc_exchange=cfg.hybrid.parallel_plan.fc_exchange, loss=cfg.hybrid.parallel_plan.loss, jit=cfg.jit,
            precision=cfg.precision,
            images_per_sec=(cfg.global_batch / t) if t else None, step_time_s=t,
            bytes_per_step=float(ledger.total), bytes_by_purpose=ledger.summary(),
            peak_memory_bytes=memory[id(cfg)]))
    return records


def format_table(records: List[BenchRecord]) -> str:
    head = (f"{'scheme':8} {'K':>2} {'B':>4} {'glob':>5} {'fc':6} {'jit':3} {'prec':4} {'step ms':>9} "
            f"{'img/s':>8} {'MB/step':>9} {'peak MB':>8}")
    lines = [head, "-" * len(head)]
    for r in records:
        step = f"{r.step_time_s * 1e3:9.1f}" if r.step_time_s else f"{'-':>9}"
        ips = f"{r.images_per_sec:8.0f}" if r.images_per_sec else f"{'-':>8}"
        mem = f"{r.peak_memory_bytes / 1e6:8.0f}" if r.peak_memory_bytes else f"{'-':>8}"
        lines.append(f"{r.scheme:8} {r.devices:>2} {r.batch_size:>4} {r.global_batch:>5} "
                     f"{r.fc_batch:6} {'on' if r.jit else 'off':3} {r.precision:4} {step} {ips} "
                     f"{r.bytes_per_step / 1e6:9.3f} {mem}")
    return "\n".join(lines)


@dataclasses.dataclass
class InputRecord:
    dataset: str
    pipeline: str  # "training" or "bare decode"
    image_size: int
    global_batch: int
    images: int
    seconds: float
    images_per_sec: float
    images_per_sec_per_core: float


def _timed_batches(iterator, batches: int) -> float:
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return time.perf_counter() - start


def _timed_run(dataset, warmup: int, batches: int) -> float:
    """Seconds for `batches` batches of a fresh iterator after `warmup` untimed ones. Fresh
    for every round: an iterator left idle while the other pipeline is timed fills its
    buffers, and the batches it holds would come free in its next round."""
    iterator = iter(dataset)
    _timed_batches(iterator, max(warmup, 1))
    return _timed_batches(iterator, batches)


def run_input_bench(args) -> List[InputRecord]:
    """Training batches and bare decoding of the same records, timed in alternating rounds
    (`--steps` batches each, three rounds, each from a fresh iterator after `--warmup`
    batches)."""
    import tensorflow as tf

    from owt_tf.data.datasets import DatasetError, StreamDataset, load_dataset
    from owt_tf.models import build_model

    side = args.image_size or build_model(args.model, args.classes).input_shape[0]
    global_batch = args.batch_size * max(args.devices)
    try:
        data = load_dataset(args.input, (side, side, 3), data_dir=args.data_dir)
        if not isinstance(data, StreamDataset):
            raise DatasetError(f"{args.input!r} is held in memory; time folder:PATH or tfds:NAME")
        training = data.train_rows(global_batch, seed=0, on_device=True)  # what `train` reads
    except DatasetError as err:
        raise ConfigError("--input", str(err)) from None
    # Only the shape leaves the map, so the batches are as cheap to move as the training ones.
    bare = data.decoded_train_records(seed=0).map(lambda image, label: tf.shape(image))
    bare = bare.batch(global_batch, drop_remainder=True).prefetch(2)
    pipelines = {"training": training, "bare decode": bare}
    seconds = dict.fromkeys(pipelines, 0.0)
    rounds = 3
    for _ in range(rounds):
        for name, dataset in pipelines.items():
            seconds[name] += _timed_run(dataset, args.warmup, args.steps)
    cores = len(os.sched_getaffinity(0))
    images = rounds * args.steps * global_batch
    return [InputRecord(args.input, name, side, global_batch, images, t, images / t,
                        images / t / cores) for name, t in seconds.items()]


def format_input_table(records: List[InputRecord]) -> str:
    cores = len(os.sched_getaffinity(0))
    first = records[0]
    lines = [f"{first.dataset}: {first.image_size}x{first.image_size}, global batch "
             f"{first.global_batch}, {first.images} images per pipeline, {cores} cores",
             f"{'pipeline':12} {'img/s':>8} {'per core':>9}"]
    for r in records:
        lines.append(f"{r.pipeline:12} {r.images_per_sec:8.0f} {r.images_per_sec_per_core:9.0f}")
    rates = {r.pipeline: r.images_per_sec for r in records}
    lines.append(f"training / bare decode: {rates['training'] / rates['bare decode']:.2f}x")
    return "\n".join(lines)


def _write_json(path: str, records) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump([dataclasses.asdict(r) for r in records], f, indent=1)
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.devices = _parse_list(args.devices, int)
        args.schemes = _parse_list(args.schemes or
                                   ("owt-b" if args.big_head else DEFAULT_SCHEMES))
        args.precision = _parse_list(args.precision)
        _check(args)
    except (ConfigError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    if args.big_head:
        return _big_head_main(parser, args)
    if args.keras_step:
        from owt_tf.experiments import keras_step

        records = keras_step.run_keras_step(args.model, args.schemes[0], args.devices[0],
                                            args.batch_size, args.classes, args.warmup,
                                            args.steps)
        print(keras_step.format_table(records))
        if args.out:
            _write_json(args.out, records)
        return 0 if len(records) == len(keras_step.RUNNERS) else 1
    if args.first_step:
        from owt_tf.experiments.first_step import run_first_step

        records = run_first_step(args.model, args.schemes, args.fc_batch, args.devices,
                                 args.batch_size, args.classes)
        if args.out:
            _write_json(args.out, records)
        return 0 if records else 1
    if args.input:
        try:
            records = run_input_bench(args)
        except ConfigError as err:
            print(f"{parser.prog}: error: {err}", file=sys.stderr)
            return 2
        print(format_input_table(records))
    else:
        records = run_bench(args)
        print(format_table(records))
    if args.out:
        _write_json(args.out, records)
    return 0


def _big_head_main(parser, args) -> int:
    """`--big-head`: one K, one owt scheme; the global batch is B*K for both runners."""
    from owt_tf.experiments import big_head

    owt = [s for s in args.schemes if Scheme(s).model_parallel]
    if len(args.devices) != 1 or len(owt) != 1 or len(args.schemes) != 1 or \
            args.precision[0] not in big_head.PRECISIONS or len(args.precision) != 1:
        print(f"{parser.prog}: error: --big-head measures one K (--devices), one precision "
              "(fp32|bf16) and one model-parallel scheme (--schemes owt-a|owt-b|owt-c)",
              file=sys.stderr)
        return 2
    rates = [_number_or_text(r) for r in _parse_list(args.sample_rates)] or [1.0]
    problem = next(filter(None, map(sample_rate_problem, rates)), None)
    if problem:
        print(f"{parser.prog}: error: --sample-rates: {problem}", file=sys.stderr)
        return 2
    runners = big_head.RUNNERS if args.baseline == "mirrored" else ("owt_tf",)
    k = args.devices[0]
    sizes = [int(c) for c in _parse_list(args.head_classes)] if args.head_classes else [args.classes]
    records = []
    for classes in sizes:
        records += big_head.run_big_head(big_head.BigHeadArgs(
            classes, k, args.batch_size * k, args.warmup, args.steps, owt[0], runners, rates,
            args.head, args.features, args.save_weights, args.head_build, args.precision[0]))
    print(big_head.format_big_head_table(records))
    if args.out:
        big_head.write_json(args.out, records)
    return 0 if len(records) == len(sizes) * (len(rates) + len(runners) - 1) else 1


if __name__ == "__main__":
    sys.exit(main())
