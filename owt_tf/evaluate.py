"""`python -m owt_tf.evaluate`: top-1 and top-5 error of a run or of an exported SavedModel,
or face verification of an export's embeddings (image pairs, or IJB-B / IJB-C templates).

    python -m owt_tf.evaluate --logdir RUN            the run's latest checkpoint
    python -m owt_tf.evaluate --model EXPORT_DIR      a SavedModel from owt_tf.export
    python -m owt_tf.evaluate --verification PAIRS EXPORT_DIR
                                                      10-fold accuracy and TAR@FAR=1e-3
    python -m owt_tf.evaluate --ijb DIR EXPORT_DIR    IJB-C / IJB-B 1:1 verification:
                                                      TAR@FAR=1e-6 ... 1e-1

on the run's validation split (its dataset is read from the run's config or the export's
metadata), center crop, or `--ten-crop`: the mean of the softmax over the four corner
crops, the center crop and their mirror images (AlexNet 2012).

--verification reads the `embeddings` signature of any SavedModel that has one (owt_tf's
exports of a face model, from the CLI or from `parallelize(model).export`) with plain
TensorFlow, no model code, and scores it under InsightFace's protocol (each image's outputs
plus its mirror's, squared distances, 10 folds; docs/faces.md); PAIRS is an InsightFace
`*.bin` (lfw.bin, cfp_fp.bin, ...) or `faces`, the embedded synthetic set's held-out pairs.

--ijb reads the same signature and scores it as arcface_torch's eval_ijbc.py does
(owt_tf.data.ijb): DIR is an IJB release's IJBC or IJBB directory (meta/ijbc_*.txt or
meta/ijbb_*.txt, and loose_crop/); each face aligned to 112x112 by its 5 landmarks, its
features plus its mirror's times the detector score, pooled per media then per template,
templates compared by cosine, TAR at FAR read off the ROC of all pairs.
"""
from __future__ import annotations

import argparse
import sys
import os
from typing import List, Optional

from owt_tf.cli import OneLineParser, fail
from owt_tf.runtime.startup import start_tensorflow

PROG = "python -m owt_tf.evaluate"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--logdir", help="a run directory (its latest checkpoint)")
    source.add_argument("--model", help="a SavedModel written by owt_tf.export (a version "
                        "directory, or its base path: the newest version)")
    source.add_argument("--verification", nargs=2, metavar=("PAIRS", "EXPORT_DIR"),
                        help="face verification of the export's embeddings signature on "
                             "PAIRS: an InsightFace *.bin of pairs, or faces (the embedded "
                             "set's held-out pairs): 10-fold accuracy and TAR@FAR=1e-3")
    source.add_argument("--ijb", nargs=2, metavar=("DIR", "EXPORT_DIR"),
                        help="IJB-C / IJB-B 1:1 verification of the export's embeddings "
                             "signature on DIR, an IJB release's IJBC or IJBB directory "
                             "(meta/ and loose_crop/): TAR at FAR=1e-6 ... 1e-1")
    parser.add_argument("--split", default="validation", choices=("validation", "train"))
    parser.add_argument("--ten-crop", action="store_true", help="average 10 crops per image")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorFlow's C++ start-up log lines")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verification:
        return verification(*args.verification, verbose=args.verbose)
    if args.ijb:
        return ijb(*args.ijb, verbose=args.verbose)

    # TensorFlow loads only now, after the flags were found good.
    start_tensorflow(args.verbose)
    from owt_tf.training.files.checkpoint import NoReadableCheckpoint
    from owt_tf.training.evaluation import (evaluate_probabilities, evaluate_ten_crop_batches,
                                            softmax_predictor)
    from owt_tf.training.runs import load_run
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
        # A prepared set streams its validation images' ten views (prepared:DIR)
        streams_views = args.ten_crop and hasattr(dataset, "validation_ten_crops")
        if args.split != "validation" or (args.ten_crop and not streams_views) or (
                args.model and not streams_views):
            return fail(PROG, f"--ten-crop (but on a prepared: set), --model (but with "
                              f"--ten-crop on a prepared: set) and --split train need an "
                              f"in-memory dataset; {dataset.name} is streamed: use --logdir")
        if streams_views:
            result = evaluate_ten_crop_batches(
                predict, dataset.validation_ten_crops(256, normalized=False))
            print(f"{dataset.name} validation ({result['examples']} images, 10-crop): "
                  f"top-1 error {result['top1_error']:.2%}  "
                  f"top-5 error {result['top5_error']:.2%}")
            return 0
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


def verification(pairs_source: str, export_dir: str, verbose: bool = False) -> int:
    """Prints the 10-fold accuracy (± its std over the folds) and TAR@FAR=1e-3 of the
    export's embeddings on the pairs."""
    if pairs_source != "faces" and not os.path.isfile(pairs_source):
        return fail(PROG, f"--verification {pairs_source}: no such file (a *.bin of pairs, "
                          "or faces)")
    if not os.path.isdir(export_dir):
        return fail(PROG, f"--verification {export_dir}: no such export directory")
    start_tensorflow(verbose)
    from owt_tf.training.evaluation import load_pairs
    from owt_tf.training.files.serving import load_embeddings
    from owt_tf.data.verification import verify

    try:
        size, embed = load_embeddings(export_dir)
        pairs = load_pairs(pairs_source, size)
        result = verify(embed, pairs, batch_size=256)
    except (OSError, ValueError) as err:  # ExportError, DatasetError: ValueErrors; a
        return fail(PROG, err)             # directory SavedModel cannot read: OSError
    print(f"{pairs.name} ({result.pairs} pairs): verification accuracy {result.accuracy:.2%} "
          f"± {result.accuracy_std:.2%} (10 folds) | TAR@FAR=1e-3 {result.tar:.2%}")
    return 0


def ijb(directory: str, export_dir: str, verbose: bool = False) -> int:
    """Prints the TAR at each FAR (1e-6 ... 1e-1) of the export's embeddings on the IJB-C
    or IJB-B set in `directory`, on one line."""
    from owt_tf.data import DatasetError
    from owt_tf.data.ijb import ALIGNED_SIZE, evaluate_ijb, ijb_layout

    try:  # the set's lists and images directory are found before TensorFlow starts
        ijb_layout(directory)
    except DatasetError as err:
        return fail(PROG, f"--ijb {err}")
    if not os.path.isdir(export_dir):
        return fail(PROG, f"--ijb {export_dir}: no such export directory")
    start_tensorflow(verbose)
    from owt_tf.training.files.serving import load_embeddings

    try:
        size, embed = load_embeddings(export_dir)
        if tuple(size) != ALIGNED_SIZE:
            return fail(PROG, f"--ijb aligns faces to 112x112 (arcface's reference points); "
                              f"{export_dir} takes {size[0]}x{size[1]} images")
        result = evaluate_ijb(directory, embed)
    except (OSError, ValueError) as err:  # ExportError, DatasetError: ValueErrors
        return fail(PROG, err)
    rates = " | ".join(f"TAR@FAR={far:.0e} {tar:.2%}" for far, tar in result.tar_at_far.items())
    print(f"{result.target} 1:1 ({result.templates} templates, {result.pairs} pairs): {rates}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
