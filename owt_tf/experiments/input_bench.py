"""`python -m owt_tf.bench --input prepared:DIR`: owt_tf's training pipeline reading a
prepared set against bare `tf.io.decode_jpeg` of the originals it was made from (the
manifest's source), in alternating rounds in one process. `--input insightface:DIR`: the
training pipeline reading an InsightFace set against bare `tf.io.decode_jpeg` of the same
JPEG bytes.

Each round times `--steps` batches of each pipeline from a fresh iterator after `--warmup`
untimed ones (as `--input folder:PATH`, owt_tf.experiments.bench); five rounds, and the
median round's images/s of each is reported, with the ratio of the medians. The training
pipeline is the one `python -m owt_tf.train --dataset prepared:DIR` reads: global batches
of B x max K random crops, as uint8 with each row's flip and lighting draws (the step does
flip, lighting and normalisation on its device: preprocess.DeviceBatch), at
`--image-size` or the model's input. The bare decode reads the originals' records in
training order, decodes each whole JPEG (`tf.io.decode_jpeg`, nothing else) in a parallel
map and keeps only its shape; an original that does not decode as a JPEG is passed over.
For an InsightFace set the bare decode's bytes are those the timed batches of training
read (the first (--warmup + --steps) x B x max K records of the training order, read
into memory before timing, so the bare pipeline pays no reading at all), decoded the same
way.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from typing import Dict, List, Optional

from owt_tf.config import ConfigError
from owt_tf.experiments.bench import _timed_run, _write_json, build_parser

ROUNDS = 5
TRAINING, BARE = "training, prepared set", "bare decode_jpeg, originals"
FACE_TRAINING, FACE_BARE = "training, insightface set", "bare decode_jpeg, same bytes"


@dataclasses.dataclass
class PreparedInputRecord:
    dataset: str
    source: str
    pipeline: str
    image_size: int
    global_batch: int
    images_per_round: int
    rounds_images_per_sec: List[float]
    images_per_sec: float  # the median round's
    images_per_sec_per_core: float


def _pipelines(args, side: int, global_batch: int):
    """(prepared set, {pipeline name: tf.data pipeline}); ConfigError for an unusable one."""
    import tensorflow as tf

    from owt_tf.data.datasets import DatasetError, load_dataset

    try:
        prepared = load_dataset(args.input, (side, side, 3))
        originals = load_dataset(prepared.manifest["source"], (side, side, 3),
                                 data_dir=args.data_dir)
        # what `train` reads: uint8 crops and their draws, finished on the step's device
        training = prepared.train_rows(global_batch, seed=0, on_device=True)
    except DatasetError as err:
        raise ConfigError("--input", str(err)) from None

    def decoded_shape(record, label):
        # the originals' own reading (file, or record bytes), then bare decode_jpeg
        return tf.shape(tf.io.decode_jpeg(originals._encoded_image(record), channels=3))

    bare = originals._train_records(0, 0).map(decoded_shape, num_parallel_calls=tf.data.AUTOTUNE,
                                              deterministic=True)
    # an original that is no JPEG, or a broken one, is passed over as training passes it over
    bare = bare.ignore_errors().batch(global_batch, drop_remainder=True).prefetch(2)
    return prepared, {TRAINING: training, BARE: bare}


def _face_pipelines(args, side: int, global_batch: int):
    """(InsightFace set, {pipeline name: tf.data pipeline}): what `train` reads, and bare
    decode_jpeg of the bytes its timed batches hold (module docstring)."""
    import tensorflow as tf

    from owt_tf.data.datasets import DatasetError, load_dataset

    try:
        data = load_dataset(args.input, (side, side, 3))
        training = data.train_rows(global_batch, seed=0, on_device=True)
    except DatasetError as err:
        raise ConfigError("--input", str(err)) from None
    images = (max(args.warmup, 1) + args.steps) * global_batch  # _timed_run's batches
    encoded = [e for e, _ in data._train_records(0, 0).take(images).as_numpy_iterator()]

    def decoded_shape(jpeg):
        return tf.shape(tf.io.decode_jpeg(jpeg, channels=3))

    bare = tf.data.Dataset.from_tensor_slices(encoded).map(
        decoded_shape, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    bare = bare.ignore_errors().batch(global_batch, drop_remainder=True).prefetch(2)
    return data, {FACE_TRAINING: training, FACE_BARE: bare}


def run_prepared_input_bench(args) -> List[PreparedInputRecord]:
    from owt_tf.models import build_model

    side = args.image_size or build_model(args.model, args.classes).input_shape[0]
    global_batch = args.batch_size * max(args.devices)
    faces = args.input.startswith("insightface:")
    data, pipelines = (_face_pipelines if faces else _pipelines)(args, side, global_batch)
    source = data.name if faces else data.manifest["source"]
    rates: Dict[str, List[float]] = {name: [] for name in pipelines}
    images = args.steps * global_batch
    for _ in range(ROUNDS):
        for name, dataset in pipelines.items():  # alternating: both see the same machine
            rates[name].append(images / _timed_run(dataset, args.warmup, args.steps))
    cores = len(os.sched_getaffinity(0))
    return [PreparedInputRecord(args.input, source, name, side,
                                global_batch, images, [round(r, 1) for r in rates[name]],
                                statistics.median(rates[name]),
                                statistics.median(rates[name]) / cores) for name in pipelines]


def format_prepared_table(records: List[PreparedInputRecord]) -> str:
    first = records[0]
    cores = len(os.sched_getaffinity(0))
    faces = first.pipeline == FACE_TRAINING
    origin = "" if faces else f" (prepared from {first.source})"
    lines = [f"{first.dataset}{origin}: {first.image_size}x"
             f"{first.image_size}, global batch {first.global_batch}, {ROUNDS} alternating rounds "
             f"of {first.images_per_round} images each, {cores} cores",
             f"{'pipeline':30} {'img/s':>8} {'per core':>9}   rounds"]
    for r in records:
        rounds = " ".join(f"{v:.0f}" for v in r.rounds_images_per_sec)
        lines.append(f"{r.pipeline:30} {r.images_per_sec:8.0f} {r.images_per_sec_per_core:9.0f}"
                     f"   {rounds}")
    rates = [r.images_per_sec for r in records]  # training first, then the bare decode
    compared = ("training / bare decode of the same bytes" if faces
                else "prepared training / bare decode of the originals")
    lines.append(f"{compared}: {rates[0] / rates[1]:.2f}x")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """The bench's flags (owt_tf.experiments.bench.build_parser); --input prepared:DIR or
    insightface:DIR."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.devices = [int(k) for k in args.devices.split(",") if k]
        if not args.devices or min(args.devices) < 1 or args.batch_size < 1 or args.steps < 1:
            raise ConfigError("--devices", "K values, --batch-size and --steps must be >= 1")
        records = run_prepared_input_bench(args)
    except (ConfigError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(format_prepared_table(records))
    if args.out:
        _write_json(args.out, records)
    return 0
