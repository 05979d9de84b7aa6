"""Face verification as face-recognition papers measure it: pairs of images labelled
same / different, scored by the cosine of their L2-normalised embeddings.

Owns the pair sets (`VerificationPairs`), the scores (`pair_scores`), the LFW protocol's
10-fold accuracy (`ten_fold_accuracy`), TAR at FAR (`tar_at_far`) and `verify`, which
embeds a pair set with any embedding function and reports both.

Pure numpy: no TensorFlow import.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Tuple

import numpy as np


@dataclasses.dataclass
class VerificationPairs:
    """Image pairs: `first[i]` and `second[i]` (uint8 [P, H, W, C]) show the same person
    when `same[i]` (bool [P])."""

    first: np.ndarray
    second: np.ndarray
    same: np.ndarray
    name: str = "pairs"

    def __len__(self) -> int:
        return int(self.same.shape[0])


@dataclasses.dataclass
class VerificationResult:
    """The LFW-protocol accuracy (mean and std over 10 folds) and TAR at FAR of one pair set."""

    accuracy: float
    accuracy_std: float
    tar: float
    far: float
    pairs: int


def l2_normalize_rows(x: np.ndarray) -> np.ndarray:
    """Rows of `x` divided by their L2 norm (norm floored at 1e-12: a zero row stays zero)."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def pair_scores(emb1: np.ndarray, emb2: np.ndarray) -> np.ndarray:
    """Cosine similarity of each pair of rows: [P, D], [P, D] -> [P] in [-1, 1]."""
    return np.sum(l2_normalize_rows(emb1) * l2_normalize_rows(emb2), axis=1)


def _contiguous_folds(count: int, folds: int) -> list:
    """Index arrays of `folds` contiguous folds, the first ones one longer when `count` does
    not divide evenly (sklearn's KFold(shuffle=False), which InsightFace uses)."""
    return np.array_split(np.arange(count), folds)


def best_threshold(scores: np.ndarray, same: np.ndarray) -> float:
    """The threshold t maximising the accuracy of "same iff score > t" on these pairs.

    Accuracy changes only where t crosses an observed score, so one candidate per gap
    between consecutive distinct scores (its midpoint), plus one below all (-inf) and one
    above all (+inf), reaches every achievable accuracy; the midpoint is the point of its
    gap farthest from both neighbours. Ties go to the lowest threshold."""
    order = np.argsort(scores, kind="stable")
    sorted_scores, sorted_same = scores[order], same[order]
    # cut k: the k lowest scores are called "different", the others "same"
    different_below = np.concatenate([[0], np.cumsum(~sorted_same)])
    same_above = sorted_same.sum() - np.concatenate([[0], np.cumsum(sorted_same)])
    correct = different_below + same_above
    is_gap = np.ones(len(scores) + 1, dtype=bool)
    is_gap[1:-1] = sorted_scores[:-1] < sorted_scores[1:]
    k = int(np.argmax(np.where(is_gap, correct, -1)))
    if k == 0:
        return -np.inf
    if k == len(scores):
        return np.inf
    return float((sorted_scores[k - 1] + sorted_scores[k]) / 2)


def ten_fold_accuracy(scores: np.ndarray, same: np.ndarray, folds: int = 10) -> Tuple[float, float]:
    """(mean, std) of verification accuracy over `folds` contiguous folds, the LFW protocol
    as InsightFace runs it: each fold is scored at the threshold best on the other folds
    (`best_threshold`, "same iff score > t"). std is the population std (numpy's default,
    as InsightFace). Pairs must be in the order of the protocol's folds (no shuffling)."""
    scores, same = np.asarray(scores, dtype=np.float64), np.asarray(same, dtype=bool)
    if len(scores) < folds:
        raise ValueError(f"ten_fold_accuracy needs at least folds={folds} pairs "
                         f"(got {len(scores)}); pass fewer folds")
    accuracies = []
    for held_out in _contiguous_folds(len(scores), folds):
        rest = np.ones(len(scores), dtype=bool)
        rest[held_out] = False
        threshold = best_threshold(scores[rest], same[rest])
        accuracies.append(np.mean((scores[held_out] > threshold) == same[held_out]))
    return float(np.mean(accuracies)), float(np.std(accuracies))


def tar_at_far(scores: np.ndarray, same: np.ndarray, far: float = 1e-3) -> float:
    """True accept rate at the threshold where at most a fraction `far` of impostor pairs
    passes: the threshold is the (k+1)-th highest impostor score, k = floor(far * impostors),
    and a pair is accepted when its score is strictly above it (so ties at the threshold
    never raise the false accepts above k).

    With fewer than 1/far impostors, k = 0: the threshold is the highest impostor score and
    the value returned is the TAR at zero false accepts, a lower bound of the TAR at `far`
    (the pairs cannot resolve that FAR). NaN when there are no impostor or no genuine pairs.
    """
    scores, same = np.asarray(scores, dtype=np.float64), np.asarray(same, dtype=bool)
    impostors, genuine = np.sort(scores[~same])[::-1], scores[same]
    if len(impostors) == 0 or len(genuine) == 0:
        return float("nan")
    # the 1e-9: far * impostors computed in binary can land just below an integer
    allowed_false_accepts = int(np.floor(far * len(impostors) + 1e-9))
    threshold = impostors[min(allowed_false_accepts, len(impostors) - 1)]
    return float(np.mean(genuine > threshold))


def _embed_images(embed_fn: Callable[[np.ndarray], Any], images: np.ndarray,
                  batch_size: int) -> np.ndarray:
    batches = [np.asarray(embed_fn(images[start:start + batch_size]))
               for start in range(0, len(images), batch_size)]
    return np.concatenate(batches, axis=0)


def embed_pairs(embed_fn: Callable[[np.ndarray], Any], pairs: VerificationPairs,
                batch_size: int = 64, flip: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """(emb1, emb2): both sides of `pairs` embedded by `embed_fn` (uint8 [B, H, W, C] ->
    [B, D]) in batches of `batch_size`. `flip=True` is InsightFace's "Accuracy-Flip": each
    image's embedding plus its horizontal mirror's (normalised later, by `pair_scores`)."""
    def embed(images: np.ndarray) -> np.ndarray:
        embeddings = _embed_images(embed_fn, images, batch_size)
        if flip:
            embeddings = embeddings + _embed_images(embed_fn, images[:, :, ::-1], batch_size)
        return embeddings

    return embed(pairs.first), embed(pairs.second)


def verify(embed_fn: Callable[[np.ndarray], Any], pairs: VerificationPairs,
           batch_size: int = 64, flip: bool = False, far: float = 1e-3) -> VerificationResult:
    """Embeds `pairs` with `embed_fn` and scores them: 10-fold accuracy and TAR at `far`."""
    scores = pair_scores(*embed_pairs(embed_fn, pairs, batch_size, flip))
    accuracy, accuracy_std = ten_fold_accuracy(scores, pairs.same)
    return VerificationResult(accuracy=accuracy, accuracy_std=accuracy_std,
                              tar=tar_at_far(scores, pairs.same, far), far=far,
                              pairs=len(pairs))
