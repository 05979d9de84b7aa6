"""owt_tf.data.verification (numpy: scores, LFW 10-fold accuracy, TAR at FAR, flip embedding)
against references written differently here, and owt_tf.callbacks.Verification in a small
fit: its keys reach History and TensorBoard event files."""
import glob
import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from owt_tf.callbacks import Verification
from owt_tf.layers import NormalizedDense
from owt_tf.data.verification import (VerificationPairs, VerificationResult, embed_pairs,
                                 pair_scores, tar_at_far, ten_fold_accuracy, verify)


def brute_force_ten_fold(scores, same, folds=10):
    """Every fold: try every threshold (below all, each midpoint of neighbouring distinct
    training scores, above all) one by one; keep the first best; score the held-out fold."""
    scores, same = list(map(float, scores)), list(map(bool, same))
    n = len(scores)
    sizes = [n // folds + (1 if f < n % folds else 0) for f in range(folds)]
    accuracies, start = [], 0
    for size in sizes:
        test = set(range(start, start + size))
        start += size
        train = [i for i in range(n) if i not in test]
        distinct = sorted({scores[i] for i in train})
        candidates = ([-math.inf] + [(a + b) / 2 for a, b in zip(distinct, distinct[1:])]
                      + [math.inf])
        best, best_correct = None, -1
        for t in candidates:
            correct = sum((scores[i] > t) == same[i] for i in train)
            if correct > best_correct:
                best, best_correct = t, correct
        accuracies.append(sum((scores[i] > best) == same[i] for i in test) / size)
    return float(np.mean(accuracies)), float(np.std(accuracies))


def test_pair_scores_are_cosines_of_the_embeddings():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 7)), rng.normal(size=(5, 7)) * 3
    expected = [np.dot(x, y) / np.linalg.norm(x) / np.linalg.norm(y) for x, y in zip(a, b)]
    np.testing.assert_allclose(pair_scores(a, b), expected, rtol=1e-12)


@pytest.mark.parametrize("count,folds", [(600, 10), (613, 10), (47, 5)])
def test_ten_fold_accuracy_equals_a_brute_force_search(count, folds):
    rng = np.random.default_rng(count)
    same = rng.random(count) < 0.5
    # overlapping classes and rounded scores, so that ties and uneven folds occur
    scores = np.round(np.where(same, 0.6, 0.1) + 0.25 * rng.normal(size=count), 2)
    got = ten_fold_accuracy(scores, same, folds=folds)
    expected = brute_force_ten_fold(scores, same, folds)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert 0.6 < got[0] < 0.95


def test_ten_fold_accuracy_of_separable_scores_is_one():
    rng = np.random.default_rng(1)
    same = rng.random(300) < 0.5
    scores = np.where(same, rng.uniform(0.5, 1.0, 300), rng.uniform(-1.0, 0.3, 300))
    assert ten_fold_accuracy(scores, same) == (1.0, 0.0)


def test_ten_fold_accuracy_needs_a_pair_per_fold():
    with pytest.raises(ValueError, match="folds"):
        ten_fold_accuracy(np.zeros(5), np.zeros(5, bool))


def test_tar_at_far_on_scores_with_a_known_answer():
    impostors = np.arange(1000) / 1000  # 0.000 .. 0.999
    genuine = np.array([0.5, 0.985, 0.9895, 0.995, 1.0])
    scores = np.concatenate([impostors, genuine])
    same = np.concatenate([np.zeros(1000, bool), np.ones(5, bool)])
    # FAR 1%: 10 impostors may pass, the threshold is the 11th highest impostor, 0.989
    assert tar_at_far(scores, same, far=0.01) == 3 / 5
    # FAR 0.1%: one impostor may pass (0.999), threshold 0.998: only 1.0 passes
    assert tar_at_far(scores, same, far=1e-3) == 1 / 5
    # FAR 1e-4 cannot be resolved by 1000 impostors: zero false accepts (threshold 0.999)
    assert tar_at_far(scores, same, far=1e-4) == 1 / 5


def test_tar_at_far_with_ties_and_without_impostors():
    same = np.array([False, False, True, True])
    # both impostors tie at 0.7: a threshold at 0.7 lets none pass, genuine 0.7 fails too
    assert tar_at_far(np.array([0.7, 0.7, 0.7, 0.9]), same, far=0.5) == 0.5
    assert math.isnan(tar_at_far(np.array([0.1, 0.2]), np.array([True, True])))


def _pairs(rng, count=40, size=6):
    first = rng.integers(0, 256, size=(count, size, size, 3), dtype=np.uint8)
    second = rng.integers(0, 256, size=(count, size, size, 3), dtype=np.uint8)
    same = np.arange(count) % 2 == 0
    second[same] = first[same]  # genuine pairs are the same image
    return VerificationPairs(first, second, same, name="toy")


def test_flip_sums_the_embeddings_of_an_image_and_its_mirror():
    rng = np.random.default_rng(2)
    pairs = _pairs(rng, count=10)
    top_row = lambda images: images[:, 0, :, 0].astype(np.float64)  # noqa: E731
    emb1, emb2 = embed_pairs(top_row, pairs, batch_size=3, flip=True)
    first, second = (p[:, 0, :, 0].astype(int) for p in (pairs.first, pairs.second))
    np.testing.assert_array_equal(emb1, first + first[:, ::-1])
    np.testing.assert_array_equal(emb2, second + second[:, ::-1])
    plain1, _ = embed_pairs(top_row, pairs, batch_size=4, flip=False)
    np.testing.assert_array_equal(plain1, pairs.first[:, 0, :, 0])


def test_verify_scores_the_pairs_it_embeds():
    pairs = _pairs(np.random.default_rng(3))
    flatten = lambda images: images.reshape(len(images), -1).astype(np.float64)  # noqa: E731
    result = verify(flatten, pairs, batch_size=7)
    assert isinstance(result, VerificationResult)
    assert (result.accuracy, result.accuracy_std, result.tar, result.far, result.pairs) == (
        1.0, 0.0, 1.0, 1e-3, 40)


def test_the_verification_module_does_not_import_tensorflow():
    code = ("import sys, owt_tf.data.verification; "
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _event_scalars(directory):
    """{tag: {step: value}} of every event file under `directory`."""
    found = {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                found.setdefault(value.tag, {})[event.step] = float(
                    tf.make_ndarray(value.tensor))
    return found


def _image_model(size=6, classes=4):
    x = keras.Input((size, size, 3))
    features = keras.layers.Dense(8)(keras.layers.Flatten()(x))
    return keras.Model(x, NormalizedDense(classes)(features))


def test_the_callback_logs_reach_history_and_tensorboard(tmp_path):
    # Seeded: with some unseeded draws of the Dense, an impostor pair of these all-positive
    # random images scores as high as the identical genuine pairs and one fold errs.
    keras.utils.set_random_seed(4)
    rng = np.random.default_rng(4)
    pairs = _pairs(rng)
    images = rng.random((32, 6, 6, 3)).astype(np.float32)
    labels = rng.integers(0, 4, size=32)
    model = _image_model()
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
    verification = Verification(pairs, batch_size=16, log_dir=str(tmp_path / "own"),
                                preprocess=lambda im: im.astype(np.float32) / 255)
    callbacks = [keras.callbacks.TensorBoard(str(tmp_path / "before")), verification,
                 keras.callbacks.TensorBoard(str(tmp_path / "after"))]
    history = model.fit(images, labels, epochs=2, batch_size=16, verbose=0,
                        callbacks=callbacks).history

    keys = ["val_toy_accuracy", "val_toy_accuracy_std", "val_toy_tar_at_far_1e-3"]
    for key in keys:
        assert len(history[key]) == 2 and all(np.isfinite(history[key])), history
    # the genuine pairs are identical images: cosine 1, above every impostor
    assert history["val_toy_accuracy"] == [1.0, 1.0]
    assert verification.result.pairs == 40
    tags = ["epoch_toy_accuracy", "epoch_toy_accuracy_std", "epoch_toy_tar_at_far_1e-3"]
    for run in ("after", "own"):
        written = _event_scalars(str(tmp_path / run / "validation"))
        for key, tag in zip(keys, tags):
            assert written[tag] == {0: pytest.approx(history[key][0]),
                                    1: pytest.approx(history[key][1])}, (run, written)
    # a TensorBoard listed before the callback gets the logs before the keys are added
    assert not set(tags) & set(_event_scalars(str(tmp_path / "before" / "validation")))


def test_the_callback_embeds_with_what_it_is_given_every_nth_epoch():
    rng = np.random.default_rng(5)
    pairs = _pairs(rng, count=20)
    seen = []

    def embed(images):
        seen.append(images.dtype)
        return images.reshape(len(images), -1).astype(np.float32)

    model = _image_model()
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
    model.embed = lambda images: pytest.fail("an `embed=` argument comes first")
    verification = Verification(pairs, every=2, name="val_faces", flip=True, embed=embed)
    history = model.fit(rng.random((16, 6, 6, 3)).astype(np.float32),
                        rng.integers(0, 4, size=16), epochs=4, verbose=0,
                        callbacks=[verification]).history
    assert history["val_faces_accuracy"] == [1.0, 1.0]  # epochs 2 and 4 only
    assert set(seen) == {np.dtype(np.uint8)}


def test_the_callback_rejects_a_bad_period():
    with pytest.raises(ValueError, match="every"):
        Verification(_pairs(np.random.default_rng(6), count=10), every=0)
