"""`python -m owt_tf.evaluate`: top-1 and top-5 error of a run or of an exported SavedModel.

    python -m owt_tf.evaluate --logdir RUN            the run's latest checkpoint
    python -m owt_tf.evaluate --model EXPORT_DIR      a SavedModel from owt_tf.export

on the run's validation split (its dataset is read from the run's config or the export's
metadata), center crop, or `--ten-crop`: the mean of the softmax over the four corner
crops, the center crop and their mirror images (AlexNet 2012).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, List, Optional

import numpy as np

from owt_tf.startup import start_tensorflow


def ten_crops(images: np.ndarray, size) -> List[np.ndarray]:
    """Corner and center crops of `size` and their horizontal mirrors (needs larger images)."""
    h, w = size
    big_h, big_w = images.shape[1:3]
    offsets = [(0, 0), (0, big_w - w), (big_h - h, 0), (big_h - h, big_w - w),
               ((big_h - h) // 2, (big_w - w) // 2)]
    crops = [images[:, t:t + h, l:l + w] for t, l in offsets]
    return crops + [c[:, :, ::-1] for c in crops]


def upscale_for_ten_crop(images: np.ndarray, size) -> np.ndarray:
    """Images resized so that the shorter side is size*256/224, as AlexNet's 256 for 224."""
    import tensorflow as tf

    h, w = size
    target = (int(round(h * 256 / 224)), int(round(w * 256 / 224)))
    resized = tf.image.resize(tf.cast(images, tf.float32), target, method="bilinear")
    return np.clip(np.rint(resized.numpy()), 0, 255).astype(np.uint8)


def error_rates(probabilities: np.ndarray, labels: np.ndarray) -> dict:
    order = np.argsort(-probabilities, axis=1)
    top1 = order[:, 0] == labels
    top5 = (order[:, :5] == labels[:, None]).any(axis=1)
    return {"top1_error": float(1 - top1.mean()), "top5_error": float(1 - top5.mean()),
            "examples": int(len(labels))}


def evaluate_probabilities(predict: Callable[[np.ndarray], np.ndarray], images: np.ndarray,
                           labels: np.ndarray, size, ten_crop: bool, batch: int = 256) -> dict:
    """`predict(uint8 images) -> probabilities`, center crop or averaged over ten crops."""
    def batched(x):
        return np.concatenate([predict(x[i:i + batch]) for i in range(0, len(x), batch)])

    if not ten_crop:
        return error_rates(batched(images), labels)
    views = ten_crops(upscale_for_ten_crop(images, size), size)
    return error_rates(np.mean([batched(v) for v in views], axis=0), labels)


def main(argv: Optional[List[str]] = None) -> int:
    from owt_tf.train import OneLineParser

    parser = OneLineParser(prog="python -m owt_tf.evaluate", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--logdir", help="a run directory (its latest checkpoint)")
    source.add_argument("--model", help="a SavedModel written by owt_tf.export (a version "
                        "directory, or its base path: the newest version)")
    parser.add_argument("--split", default="validation", choices=("validation", "train"))
    parser.add_argument("--ten-crop", action="store_true", help="average 10 crops per image")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorFlow's C++ start-up log lines")
    args = parser.parse_args(argv)
    start_tensorflow(args.verbose)

    from owt_tf.export import ExportError, load_run
    from owt_tf.training.checkpoint import NoReadableCheckpoint

    try:
        if args.logdir:
            trainer = load_run(args.logdir)
            print(f"checkpoint {trainer.resumed_from}")
            dataset, size = trainer.dataset, trainer.spec.input_shape[:2]

            def predict(x):
                logits = trainer.predict_logits(x)
                e = np.exp(logits - logits.max(axis=1, keepdims=True))
                return e / e.sum(axis=1, keepdims=True)
        else:
            dataset, size, predict = _load_export(args.model)
    except (ExportError, FileNotFoundError, NoReadableCheckpoint) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    if not hasattr(dataset, "val_images"):  # streamed from disk
        if args.ten_crop or args.model or args.split != "validation":
            print(f"{parser.prog}: error: --ten-crop, --model and --split train need an in-memory "
                  f"dataset; {dataset.name} is streamed: use --logdir", file=sys.stderr)
            return 2
        ev = trainer.evaluate()
        print(f"{dataset.name} validation ({ev.examples} images, center crop): "
              f"top-1 error {ev.top1_error:.2%}  top-5 error {ev.top5_error:.2%}")
        return 0
    if args.ten_crop and not dataset.trains_with_flips:
        print(f"{parser.prog}: warning: --ten-crop averages 5 crops and their mirror images, "
              f"but {dataset.name} trains without mirror images: expect a worse error than "
              "the center crop", file=sys.stderr)
    images = dataset.val_images if args.split == "validation" else dataset.train_images
    labels = dataset.val_labels if args.split == "validation" else dataset.train_labels
    result = evaluate_probabilities(predict, images, labels, size, args.ten_crop)
    crop = "10-crop" if args.ten_crop else "center crop"
    print(f"{dataset.name} {args.split} ({result['examples']} images, {crop}): "
          f"top-1 error {result['top1_error']:.2%}  top-5 error {result['top5_error']:.2%}")
    return 0


def _load_export(path: str):
    import tensorflow as tf

    from owt_tf.data.datasets import load_dataset
    from owt_tf.export import ExportError

    from owt_tf.export import latest_version

    path = latest_version(path)
    meta_path = os.path.join(path, "owt_tf_export.json")
    if not os.path.exists(meta_path):
        raise ExportError(f"--model {path} is not an owt_tf export (no owt_tf_export.json)")
    with open(meta_path) as f:
        meta = json.load(f)
    serve = tf.saved_model.load(path).signatures["serving_default"]
    dataset = load_dataset(meta.get("dataset", "digits"), tuple(meta["input_shape"]))

    def predict(x):
        return serve(images=tf.constant(x))["probabilities"].numpy()

    return dataset, tuple(meta["input_shape"][:2]), predict


if __name__ == "__main__":
    sys.exit(main())
