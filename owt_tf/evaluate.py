"""`python -m owt_tf.evaluate`: top-1 and top-5 error of a run or of an exported SavedModel.

    python -m owt_tf.evaluate --logdir RUN            the run's latest checkpoint
    python -m owt_tf.evaluate --model EXPORT_DIR      a SavedModel from owt_tf.export

on the run's validation split (its dataset is read from the run's config or the export's
metadata), center crop, or `--ten-crop`: the mean of the softmax over the four corner
crops, the center crop and their mirror images (AlexNet 2012).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from owt_tf.cli import OneLineParser, fail
from owt_tf.startup import start_tensorflow

PROG = "python -m owt_tf.evaluate"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--logdir", help="a run directory (its latest checkpoint)")
    source.add_argument("--model", help="a SavedModel written by owt_tf.export (a version "
                        "directory, or its base path: the newest version)")
    parser.add_argument("--split", default="validation", choices=("validation", "train"))
    parser.add_argument("--ten-crop", action="store_true", help="average 10 crops per image")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorFlow's C++ start-up log lines")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    # TensorFlow loads only now, after the flags were found good.
    start_tensorflow(args.verbose)
    from owt_tf.training.files.checkpoint import NoReadableCheckpoint
    from owt_tf.training.evaluation import evaluate_probabilities, softmax_predictor
    from owt_tf.training.files.runs import load_run
    from owt_tf.training.files.serving import ExportError, load_export

    try:
        if args.logdir:
            trainer = load_run(args.logdir)
            print(f"checkpoint {trainer.resumed_from}")
            dataset, size = trainer.dataset, trainer.spec.input_shape[:2]
            predict = softmax_predictor(trainer)
        else:
            dataset, size, predict = load_export(args.model)
    except (ExportError, FileNotFoundError, NoReadableCheckpoint) as err:
        return fail(PROG, err)
    if not hasattr(dataset, "val_images"):  # streamed from disk
        if args.ten_crop or args.model or args.split != "validation":
            return fail(PROG, f"--ten-crop, --model and --split train need an in-memory "
                              f"dataset; {dataset.name} is streamed: use --logdir")
        ev = trainer.evaluate()
        print(f"{dataset.name} validation ({ev.examples} images, center crop): "
              f"top-1 error {ev.top1_error:.2%}  top-5 error {ev.top5_error:.2%}")
        return 0
    if args.ten_crop and not dataset.trains_with_flips:
        print(f"{PROG}: warning: --ten-crop averages 5 crops and their mirror images, but "
              f"{dataset.name} trains without mirror images: expect a worse error than the "
              "center crop", file=sys.stderr)
    images = dataset.val_images if args.split == "validation" else dataset.train_images
    labels = dataset.val_labels if args.split == "validation" else dataset.train_labels
    result = evaluate_probabilities(predict, images, labels, size, args.ten_crop)
    crop = "10-crop" if args.ten_crop else "center crop"
    print(f"{dataset.name} {args.split} ({result['examples']} images, {crop}): "
          f"top-1 error {result['top1_error']:.2%}  top-5 error {result['top5_error']:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
