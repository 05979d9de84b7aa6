"""Face verification as InsightFace publishes it: pairs of images labelled same /
different, each image's embedding the sum of the backbone's outputs for it and for its
mirror image, L2-normalised, and pairs compared by squared distance.

The protocol (`protocol="insightface"`, the default everywhere owt_tf verifies) is the one
behind every published LFW / CFP-FP / AgeDB-30 figure (arcface_torch's eval/verification.py):
10 contiguous folds; each fold scored at the threshold of `ACCURACY_THRESHOLDS` (0, 0.01,
..., 3.99) that is best on the other nine, a pair called "same" when its squared distance is
below it; accuracy as mean and std over the folds; TAR at FAR (InsightFace's "val") per fold:
the threshold for the FAR on the train folds found by linear interpolation over
`VAL_THRESHOLDS` (0, 0.001, ..., 3.999), TAR on the held-out fold, mean over the folds.
`protocol="exact"` keeps owt_tf's earlier numbers: cosine scores, the exactly best threshold
on the train folds, TAR at FAR from the rank of the impostor scores over all pairs.

Owns the pair sets (`VerificationPairs`), the embedding of a pair set (`embed_pairs`), both
protocols, and `verify`, which embeds a pair set with any function of images and reports.
Pure numpy (and scikit-learn's `normalize`, as InsightFace calls it): no TensorFlow import.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Tuple

import numpy as np

PROTOCOLS = ("insightface", "exact")
FOLDS = 10
# InsightFace's grids of squared-distance thresholds: accuracy, then TAR at FAR ("val").
ACCURACY_THRESHOLDS = np.arange(0, 4, 0.01)
VAL_THRESHOLDS = np.arange(0, 4, 0.001)


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
    """Accuracy (mean and std over the folds) and TAR at FAR (mean over the folds under the
    InsightFace protocol) of one pair set, and how they were computed."""

    accuracy: float
    accuracy_std: float
    tar: float
    far: float
    pairs: int
    protocol: str = "insightface"
    flip: bool = True


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
    """The "exact" protocol's accuracy: (mean, std) over `folds` contiguous folds, each fold
    scored at the threshold best on the other folds
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
    """The "exact" protocol's TAR: the true accept rate at the threshold where at most a fraction `far` of impostor pairs
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


def normalized_rows(x: np.ndarray) -> np.ndarray:
    """Rows of `x` L2-normalised as InsightFace does it (scikit-learn's `normalize`: a zero
    row stays zero)."""
    from sklearn.preprocessing import normalize

    return normalize(np.asarray(x))


def squared_distances(emb1: np.ndarray, emb2: np.ndarray) -> np.ndarray:
    """[P]: the squared distance of each pair of rows after L2 normalisation, in [0, 4]."""
    return np.sum(np.square(normalized_rows(emb1) - normalized_rows(emb2)), axis=1)


def _accepted(sorted_distances: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """For each threshold, how many of the (sorted) distances lie below it."""
    return np.searchsorted(sorted_distances, thresholds, side="left")


def _counts(distances: np.ndarray, same: np.ndarray, thresholds: np.ndarray):
    """(pairs of the same person accepted, impostors accepted, same, impostors) at each
    threshold, a pair accepted when its distance is below the threshold."""
    genuine, impostor = np.sort(distances[same]), np.sort(distances[~same])
    return (_accepted(genuine, thresholds), _accepted(impostor, thresholds),
            len(genuine), len(impostor))


def _check_folds(count: int, folds: int) -> None:
    if count < folds:
        raise ValueError(f"verification needs at least folds={folds} pairs (got {count}); "
                         "pass fewer folds")


def _fold_counts(distances: np.ndarray, same: np.ndarray, folds: int,
                 thresholds: np.ndarray):
    """For each of `folds` contiguous folds: (its indices, `_counts` of the other folds)."""
    _check_folds(len(distances), folds)
    for held_out in _contiguous_folds(len(distances), folds):
        train = np.ones(len(distances), dtype=bool)
        train[held_out] = False
        yield held_out, _counts(distances[train], same[train], thresholds)


def grid_accuracy(distances: np.ndarray, same: np.ndarray, folds: int = FOLDS,
                  thresholds: np.ndarray = ACCURACY_THRESHOLDS) -> Tuple[float, float]:
    """(mean, std) over `folds` contiguous folds of the accuracy at the threshold of
    `thresholds` best on the other folds (the first of equals), InsightFace's
    `calculate_roc`: a pair is "same" when its squared distance is below the threshold."""
    distances, same = np.asarray(distances), np.asarray(same, dtype=bool)
    accuracies = []
    for held_out, counts in _fold_counts(distances, same, folds, thresholds):
        genuine_in, impostor_in, _, impostors = counts
        correct = genuine_in + (impostors - impostor_in)
        threshold = thresholds[int(np.argmax(correct))]
        called_same = distances[held_out] < threshold
        accuracies.append(np.mean(called_same == same[held_out]))
    return float(np.mean(accuracies)), float(np.std(accuracies))


def grid_tar_at_far(distances: np.ndarray, same: np.ndarray, far: float = 1e-3,
                    folds: int = FOLDS,
                    thresholds: np.ndarray = VAL_THRESHOLDS) -> Tuple[float, float]:
    """(mean, std) over the folds of the TAR at FAR `far`, InsightFace's `calculate_val`:
    per fold, the FAR of each of `thresholds` on the train folds; the threshold for `far`
    by linear interpolation of threshold on FAR (`threshold_at_far`; 0 when no threshold
    reaches that FAR); the TAR of the held-out fold at it. NaN when a fold has no pair of
    the same person, or the train folds no impostor pair (InsightFace divides by zero)."""
    distances, same = np.asarray(distances), np.asarray(same, dtype=bool)
    tars = []
    for held_out, (_, impostor_in, _, impostors) in _fold_counts(distances, same, folds,
                                                                  thresholds):
        genuine_held_out = same[held_out]
        if impostors == 0 or not genuine_held_out.any():
            return float("nan"), float("nan")
        threshold = threshold_at_far(impostor_in / impostors, thresholds, far)
        accepted = distances[held_out][genuine_held_out] < threshold
        tars.append(np.mean(accepted))
    return float(np.mean(tars)), float(np.std(tars))


def threshold_at_far(far_train: np.ndarray, thresholds: np.ndarray, far: float) -> float:
    """The threshold at which the (non-decreasing) FAR curve `far_train` over ascending
    `thresholds` reaches `far`, as InsightFace's `interp1d(far_train, thresholds,
    kind="slinear")(far)` computed it with the scipy it was written for: linear between
    the last threshold below `far` and the first above it; at a FAR met exactly, the last
    threshold with that FAR; 0 when the curve never reaches `far`.

    Why not scipy itself: the curve repeats FAR values at almost every threshold, and
    scipy >= 1.9 refuses repeated x in `slinear` ("Expect x to not have duplicates",
    deepinsight/insightface#2152, #2438): InsightFace's own code fails there today. Before,
    scipy built the linear B-spline through the points in stable order, which is the rule
    above."""
    if far_train[-1] < far:
        return 0.0
    above = int(np.searchsorted(far_train, far, side="right"))  # first FAR above `far`
    if far_train[above - 1] == far:
        return float(thresholds[above - 1])
    below = above - 1  # the last FAR below `far`
    f_lo, f_hi = far_train[below], far_train[above]
    t_lo, t_hi = thresholds[below], thresholds[above]
    return float(t_lo + (far - f_lo) * (t_hi - t_lo) / (f_hi - f_lo))


def _embed_images(embed_fn: Callable[[np.ndarray], Any], images: np.ndarray,
                  batch_size: int) -> np.ndarray:
    # float64, as InsightFace holds the outputs (np.zeros) before summing and normalising
    batches = [np.asarray(embed_fn(images[start:start + batch_size]), dtype=np.float64)
               for start in range(0, len(images), batch_size)]
    return np.concatenate(batches, axis=0)


def embed_pairs(embed_fn: Callable[[np.ndarray], Any], pairs: VerificationPairs,
                batch_size: int = 64, flip: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """(emb1, emb2): both sides of `pairs` through `embed_fn` (uint8 [B, H, W, C] -> the
    backbone's outputs [B, D]) in batches of `batch_size`. `flip` (InsightFace's protocol):
    each image's outputs plus its horizontal mirror's, not yet normalised."""
    def embed(images: np.ndarray) -> np.ndarray:
        embeddings = _embed_images(embed_fn, images, batch_size)
        if flip:
            embeddings = embeddings + _embed_images(embed_fn, images[:, :, ::-1], batch_size)
        return embeddings

    return embed(pairs.first), embed(pairs.second)


def score_pairs(emb1: np.ndarray, emb2: np.ndarray, same: np.ndarray, far: float = 1e-3,
                protocol: str = "insightface", folds: int = FOLDS):
    """(accuracy, accuracy std, TAR at `far`) of embedded pairs under `protocol`."""
    if protocol == "insightface":
        distances = squared_distances(emb1, emb2)
        return grid_accuracy(distances, same, folds) + (grid_tar_at_far(distances, same, far,
                                                                        folds)[0],)
    if protocol == "exact":
        scores = pair_scores(emb1, emb2)
        return ten_fold_accuracy(scores, same, folds) + (tar_at_far(scores, same, far),)
    raise ValueError(f"unknown verification protocol {protocol!r}; known: "
                     f"{', '.join(PROTOCOLS)}")


def verify(embed_fn: Callable[[np.ndarray], Any], pairs: VerificationPairs,
           batch_size: int = 64, flip: bool = True, far: float = 1e-3,
           protocol: str = "insightface") -> VerificationResult:
    """Embeds `pairs` with `embed_fn` (uint8 images -> the backbone's outputs, normalised or
    not: the flip sum is taken before normalising, as InsightFace does, so pass the raw
    outputs to reproduce its numbers) and scores them: by default InsightFace's protocol."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown verification protocol {protocol!r}; known: "
                         f"{', '.join(PROTOCOLS)}")
    emb1, emb2 = embed_pairs(embed_fn, pairs, batch_size, flip)
    accuracy, accuracy_std, tar = score_pairs(emb1, emb2, pairs.same, far, protocol)
    return VerificationResult(accuracy=accuracy, accuracy_std=accuracy_std, tar=tar, far=far,
                              pairs=len(pairs), protocol=protocol, flip=flip)
