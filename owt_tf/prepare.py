"""`python -m owt_tf.prepare SOURCE --out DIR`: the paper's preprocessing, done once.

Every image of SOURCE is rescaled so that its shorter side is 256 and its central 256x256
kept (AlexNet 2012, cuda-convnet2), stored as JPEG in TFRecord shards with its label, and
described by DIR/manifest.json (classes in label order, counts, per-channel mean and
spread, source, settings, the files that could not be read). Train with
`python -m owt_tf.train --dataset prepared:DIR`: the same augmentation, a third of the
pixels of a 500x375 photo to decode.

    python -m owt_tf.prepare folder:/data/photos --out /data/photos_256
    python -m owt_tf.prepare folder:/data/photos --out /data/photos_keep --keep-aspect
    python -m owt_tf.prepare tfds:imagenet2012 --data-dir /data/tfds --out /data/imagenet_256

Runs on every core with a progress bar. Stopped (Ctrl-C, killed), the same command
continues where it stopped and ends with the same shards. A file that does not decode is
left out, counted on stderr and listed in the manifest. Exit codes: 0 done (or nothing
left to do), 2 bad flags or an unusable SOURCE or DIR, 130 stopped by Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from owt_tf.cli import OneLineParser, fail
from owt_tf.runtime.startup import start_tensorflow

PROG = "python -m owt_tf.prepare"
SOURCE_HELP = ("folder:PATH (PATH/train/<class>/*, PATH/validation/<class>/* or test/), "
               "tfds:NAME (a TFDS set prepared in --data-dir), or insightface:PATH "
               "(train.rec + train.idx; one image of each identity held out for validation)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="where the shards and manifest.json go: a new or empty directory, "
                             "or one a stopped prepare of the same SOURCE left")
    parser.add_argument("--side", type=int, default=256,
                        help="shorter side of the stored images, in pixels (default 256, the "
                             "paper's; train at an input of side*224/256)")
    parser.add_argument("--keep-aspect", action="store_true",
                        help="keep the whole rescaled image instead of its central side x side")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality, 1-100 (default 90)")
    parser.add_argument("--shard-size", type=int, default=1024,
                        help="images per shard (default 1024): the unit a stopped prepare redoes")
    parser.add_argument("--data-dir", default=None, help="tfds:NAME: where prepared TFDS sets live")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorFlow's C++ start-up log lines")
    return parser


def check_args(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the flags (before TensorFlow loads), or None."""
    kind, _, where = args.source.partition(":")
    if kind != "tfds" and where.startswith("~"):  # the shell leaves a ~ after "folder:" alone
        where = os.path.expanduser(where)
        args.source = f"{kind}:{where}"
    if kind not in ("folder", "tfds", "insightface") or not where:
        return f"SOURCE {args.source!r}: give {SOURCE_HELP}"
    if kind != "tfds" and not os.path.isdir(where):
        return f"SOURCE {args.source}: no such directory"
    if not 1 <= args.quality <= 100:
        return f"--quality must be in 1..100, got {args.quality}"
    if args.side < 1 or args.shard_size < 1:
        return "--side and --shard-size must be >= 1"
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return f"--out {args.out} is a file, not a directory"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    if not args.verbose:  # a file that does not decode is expected, and listed: no C++ log line
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    start_tensorflow(args.verbose)
    from owt_tf.data import DatasetError
    from owt_tf.data.prepared.writer import PrepareSettings, prepare

    settings = PrepareSettings(args.side, args.keep_aspect, args.quality, args.shard_size)
    try:
        result = prepare(args.source, args.out, settings, args.data_dir,
                         verbose=0 if args.quiet else 1)
    except DatasetError as err:
        return fail(PROG, err)
    except KeyboardInterrupt:
        print(f"{PROG}: stopped; the same command continues where it stopped", file=sys.stderr)
        return 130
    report(result, args.out)
    return 0


def report(result, out: str) -> None:
    """What was written (stdout) and how many files could not be read (stderr)."""
    m = result.manifest
    if result.already_done:
        print(f"{out} already holds this prepared set: nothing to do")
    elif result.resumed_images:
        print(f"resumed: {result.resumed_images} images had been prepared by a prepare that "
              "stopped")
    shards = sum(len(m["splits"][s]["shards"]) for s in m["splits"])
    mean = ", ".join(f"{v:.1f}" for v in m["mean"])
    std = ", ".join(f"{v:.1f}" for v in m["std"])
    print(f"{out}: {m['counts']['train']} training and {m['counts']['validation']} validation "
          f"images of {len(m['classes'])} classes in {shards} shards ({m['settings']['side']} "
          f"pixels, {m['settings']['crop']} crop, JPEG quality {m['settings']['quality']}); "
          f"mean ({mean}), std ({std})")
    print(f"  train with: python -m owt_tf.train --dataset prepared:{out}")
    bad = m["counts"]["unreadable"]
    if bad:
        print(f"{PROG}: {bad} file{'s' if bad > 1 else ''} could not be read (corrupt or not "
              f"an image): left out, listed under bad_files in "
              f"{os.path.join(out, 'manifest.json')}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
