"""Top-1 and top-5 error of a model given as `predict(uint8 images) -> probabilities`: on
the center crop, or AlexNet 2012's ten crops (four corners, the center and their mirror
images, softmax averaged); and face verification of a model given as `embed(uint8 images)
-> embeddings` on the pair sets a dataset offers or a user names (`faces`, a `*.bin`).
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.data.verification import VerificationPairs, VerificationResult, verify


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


def evaluate_ten_crop_batches(predict: Callable[[np.ndarray], np.ndarray], batches) -> dict:
    """`predict(uint8 images) -> probabilities` averaged over each image's ten views, for a
    streamed set's batches of (views [N, 10, h, w, C] float32 pixels, labels [N]): the views
    rounded to uint8 as `upscale_for_ten_crop` rounds an in-memory set's, so both paths
    score the same pixels."""
    probabilities, labels = [], []
    for views, batch_labels in batches:
        views = np.clip(np.rint(np.asarray(views)), 0, 255).astype(np.uint8)
        probabilities.append(np.mean([predict(views[:, v]) for v in range(views.shape[1])],
                                     axis=0))
        labels.append(np.asarray(batch_labels))
    return error_rates(np.concatenate(probabilities), np.concatenate(labels))


def softmax_predictor(trainer) -> Callable[[np.ndarray], np.ndarray]:
    """`predict(uint8 images) -> probabilities` of a Trainer's model."""
    def predict(x):
        logits = trainer.predict_logits(x)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    return predict


def dataset_pair_sets(dataset) -> List[VerificationPairs]:
    """The verification pairs a dataset offers: `faces`' held-out identities, an
    insightface:DIR's `*.bin` sets; none for other datasets."""
    if hasattr(dataset, "verification_pairs"):
        return [dataset.verification_pairs()]
    if hasattr(dataset, "verification_sets"):
        return list(dataset.verification_sets())
    return []


def load_pairs(source: str, image_size: Tuple[int, int]) -> VerificationPairs:
    """`faces` (the embedded set's pairs at `image_size`) or an InsightFace `*.bin` file."""
    from owt_tf.data.faces import faces_dataset
    from owt_tf.data.insightface import read_verification_bin

    if source == "faces":
        return faces_dataset(tuple(image_size) + (3,)).verification_pairs()
    if not os.path.isfile(source):
        raise FileNotFoundError(f"--verification {source}: no such file (a *.bin of pairs, "
                                "or 'faces')")
    return read_verification_bin(source, tuple(image_size))


def verify_sets(embed: Callable[[np.ndarray], np.ndarray], sets: Sequence[VerificationPairs],
                batch_size: int = 256) -> Dict[str, VerificationResult]:
    """Each pair set's 10-fold accuracy and TAR at FAR 1e-3 (InsightFace's protocol, on
    `embed`: uint8 images -> the backbone's outputs), by set name."""
    return {pairs.name: verify(embed, pairs, batch_size=batch_size) for pairs in sets}


def verification_text(results: Dict[str, VerificationResult],
                      highest: Optional[Dict[str, float]] = None) -> str:
    """'lfw 93.17% ± 1.20% (highest 93.50%, TAR@FAR=1e-3 41.00%)', one entry per set."""
    highest = highest or {}
    return ", ".join(
        f"{name} {r.accuracy:.2%} ± {r.accuracy_std:.2%} ("
        + (f"highest {highest[name]:.2%}, " if name in highest else "")
        + f"TAR@FAR=1e-3 {r.tar:.2%})" for name, r in results.items())


def by_global_batches(fn: Callable, images: np.ndarray, batch: int, size: Tuple[int, int],
                      dataset, distribute: Callable, after_each: Callable) -> np.ndarray:
    """`fn` of distributed global batches of `batch` uint8 `images`, eval-preprocessed to
    `size` with the dataset's normalisation (the last batch padded, the padding dropped);
    `after_each()` runs after every batch."""
    from owt_tf.data.preprocess import eval_preprocess

    n = len(images)
    padded = np.concatenate([images, np.zeros((-n % batch,) + images.shape[1:], images.dtype)])
    out = []
    for start in range(0, len(padded), batch):
        x = eval_preprocess(tf.constant(padded[start:start + batch]), size, dataset.mean,
                            dataset.std)
        out.append(fn(distribute(x)).numpy())
        after_each()
    return np.concatenate(out)[:n]
