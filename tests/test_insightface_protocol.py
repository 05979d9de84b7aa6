"""owt_tf's verification numbers are InsightFace's: held to an implementation written here
the way arcface_torch's eval/verification.py computes them (a loop over its threshold
grids, scikit-learn's KFold and normalize, float64 outputs), on pairs whose answer depends
on the mirror image and on the grid, so that the protocol owt_tf used before (no mirror,
cosine, the exact best threshold, a global rank for TAR) gives other numbers.

InsightFace's TAR interpolates with `interp1d(far, thresholds, kind="slinear")`, which
scipy >= 1.9 refuses for the repeated FAR values every such curve has
(deepinsight/insightface#2152). The reference evaluates what scipy built there before:
the linear B-spline through the points in stable order, knots [x0, x..., xn] (scipy's
make_interp_spline for k=1), here with scipy's BSpline."""
import math

import numpy as np
import pytest
from scipy.interpolate import BSpline
from sklearn.model_selection import KFold
from sklearn.preprocessing import normalize

from owt_tf.data.verification import VerificationPairs, verify


# ---- the reference: InsightFace's protocol, written out ----------------------------------
def _accuracy(threshold, dist, issame):
    predict = dist < threshold
    tp = np.sum(predict & issame)
    tn = np.sum(~predict & ~issame)
    return float(tp + tn) / dist.size


def _val_far(threshold, dist, issame):
    predict = dist < threshold
    return (np.sum(predict & issame) / np.sum(issame),
            np.sum(predict & ~issame) / np.sum(~issame))


def insightface_reference(embeddings1, embeddings2, issame, far_target=1e-3, folds=10):
    issame = np.asarray(issame, dtype=bool)
    dist = np.sum(np.square(embeddings1 - embeddings2), 1)
    indices = np.arange(len(issame))
    thresholds = np.arange(0, 4, 0.01)
    accuracy = []
    for train, test in KFold(n_splits=folds, shuffle=False).split(indices):
        train_acc = [_accuracy(t, dist[train], issame[train]) for t in thresholds]
        best = thresholds[int(np.argmax(train_acc))]
        accuracy.append(_accuracy(best, dist[test], issame[test]))
    thresholds = np.arange(0, 4, 0.001)
    val = []
    for train, test in KFold(n_splits=folds, shuffle=False).split(indices):
        far_train = np.array([_val_far(t, dist[train], issame[train])[1] for t in thresholds])
        if np.max(far_train) >= far_target:
            order = np.argsort(far_train, kind="mergesort")
            x, y = far_train[order], thresholds[order]
            threshold = BSpline(np.r_[x[0], x, x[-1]], y, 1)(far_target)
        else:
            threshold = 0.0
        val.append(_val_far(threshold, dist[test], issame[test])[0])
    return np.mean(accuracy), np.std(accuracy), np.mean(val)


def insightface_test(backbone, pairs):
    """Both sides of each pair through `backbone`, plus their mirror images', summed and
    normalised, then the protocol (arcface_torch's `test`)."""
    def embed(images):
        outputs = [np.zeros((len(images), 16)) for _ in range(2)]  # float64, as InsightFace
        outputs[0][:] = backbone(images)
        outputs[1][:] = backbone(images[:, :, ::-1])
        return normalize(outputs[0] + outputs[1])

    return insightface_reference(embed(pairs.first), embed(pairs.second), pairs.same)


# ---- what owt_tf did before: no mirror, cosine, exact threshold, rank TAR -----------------
def former_accuracy(backbone, pairs, folds=10):
    a, b = normalize(backbone(pairs.first)), normalize(backbone(pairs.second))
    scores, same = np.sum(a * b, 1), pairs.same
    accuracies = []
    for train, test in KFold(n_splits=folds, shuffle=False).split(scores):
        candidates = np.concatenate([[-math.inf], np.unique(scores[train]), [math.inf]])
        correct = [np.sum((scores[train] > t) == same[train]) for t in candidates]
        best = candidates[int(np.argmax(correct))]
        accuracies.append(np.mean((scores[test] > best) == same[test]))
    return np.mean(accuracies)


# ---- pairs and a backbone whose outputs change under the mirror --------------------------
def _backbone(seed=0, size=8, width=16):
    weights = np.random.default_rng(seed).normal(size=(size * size * 3, width)).astype(np.float32)

    def backbone(images):
        x = images.reshape(len(images), -1).astype(np.float32) / 255 - 0.5
        return x @ weights

    return backbone


def _pairs(seed, count=600, size=8, noise=60):
    rng = np.random.default_rng(seed)
    first = rng.integers(0, 256, size=(count, size, size, 3)).astype(np.int32)
    same = rng.random(count) < 0.5
    other = rng.integers(0, 256, size=(count, size, size, 3)).astype(np.int32)
    second = np.where(same[:, None, None, None], first, other)
    second = second + rng.normal(0, noise, size=second.shape).astype(np.int32)
    as_uint8 = lambda x: np.clip(x, 0, 255).astype(np.uint8)  # noqa: E731
    return VerificationPairs(as_uint8(first), as_uint8(second), same, name="toy")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verification_is_insightfaces_protocol_by_default(seed):
    pairs, backbone = _pairs(seed), _backbone(seed)
    want = insightface_test(backbone, pairs)
    got = verify(backbone, pairs, batch_size=128)
    assert (got.accuracy, got.accuracy_std, got.tar) == pytest.approx(want, abs=1e-12)
    assert got.protocol == "insightface" and got.flip
    # the case has teeth: the mirror and the grid change the answer
    assert former_accuracy(backbone, pairs) != pytest.approx(want[0], abs=1e-12)
    no_flip = insightface_reference(normalize(backbone(pairs.first)),
                                    normalize(backbone(pairs.second)), pairs.same)
    assert no_flip[0] != pytest.approx(want[0], abs=1e-12) or no_flip[2] != pytest.approx(
        want[2], abs=1e-12)


def test_the_exact_protocol_is_an_option_named_for_what_it_is():
    pairs, backbone = _pairs(3), _backbone(3)
    got = verify(backbone, pairs, flip=False, protocol="exact")
    assert got.accuracy == pytest.approx(former_accuracy(backbone, pairs), abs=1e-12)
    with pytest.raises(ValueError, match="protocol"):
        verify(backbone, pairs, protocol="lfw")


def test_tar_of_identical_genuine_pairs_on_a_small_set():
    # 100 pairs, the genuine ones identical (distance 0): the interpolation runs between the
    # last threshold no impostor passes and the first one does, far above 0.
    pairs, backbone = _pairs(4, count=100, noise=0), _backbone(4)
    want = insightface_test(backbone, pairs)
    got = verify(backbone, pairs)
    assert (got.accuracy, got.accuracy_std, got.tar) == pytest.approx(want, abs=1e-12)
