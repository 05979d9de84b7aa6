"""owt_tf.data.ijb (IJB-B / IJB-C 1:1 verification as arcface_torch's eval_ijbc.py computes
it) against the protocol recomputed here without it: alignment by a 4-parameter linear
least-squares similarity and a bilinear warp with explicit border masks, a fixed random
linear projection as the backbone, flip sum, detector-score weighting, media means,
template sums, cosines, scikit-learn's roc_curve (the one eval_ijbc.py calls) and
eval_ijbc.py's table rule; then `python -m owt_tf.evaluate --ijb` on a SavedModel."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from sklearn.metrics import roc_curve

from owt_tf.data import DatasetError
from owt_tf.data.ijb import (FARS, REFERENCE_LANDMARKS, align_face, evaluate_ijb, tar_at_far,
                             write_ijb_layout)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
           PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
REFERENCE = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366],
                      [41.5493, 92.3655], [70.7299, 92.2041]])
DIM = 16

# 6 identities, 2 images each (one a JPEG); templates of 1-3 medias, medias of 1-2 images,
# an image in several templates, media ids reused across templates.
IMAGES = {f"{who}{k}.{'jpg' if (who, k) == ('c', 1) else 'png'}": (i, k)
          for i, who in enumerate("abcdef") for k in range(2)}
FACES = [("a0.png", 101, 1), ("a1.png", 101, 1), ("a0.png", 102, 3), ("a1.png", 103, 4),
         ("a0.png", 103, 5), ("a1.png", 103, 6),
         ("b0.png", 201, 1), ("b1.png", 202, 2), ("b0.png", 202, 3),
         ("c0.png", 301, 7), ("c1.jpg", 301, 7), ("c1.jpg", 302, 8),
         ("d0.png", 401, 9), ("d1.png", 402, 10),
         ("e0.png", 501, 11), ("e1.png", 501, 12),
         ("f0.png", 601, 13), ("f1.png", 601, 13), ("f1.png", 601, 14), ("f0.png", 602, 15)]
POSITIVES = [(101, 102), (101, 103), (102, 103), (201, 202), (301, 302), (401, 402),
             (601, 602)]
NEGATIVES = [(101, 201), (101, 301), (102, 401), (103, 501), (103, 602), (201, 302),
             (202, 401), (202, 501), (301, 601), (302, 402), (401, 501), (402, 602),
             (501, 601), (102, 202), (103, 301)]
PAIRS = [(a, b, 1) for a, b in POSITIVES] + [(a, b, 0) for a, b in NEGATIVES]


# --- the synthetic set ----------------------------------------------------------------------

def _identity_pattern(rng, size=130):
    """A smooth RGB pattern: a sum of random plane waves per channel."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    pattern = np.full((size, size, 3), 128.0)
    for c in range(3):
        for _ in range(3):
            fx, fy = rng.uniform(-0.25, 0.25, size=2)
            pattern[..., c] += rng.uniform(20, 40) * np.sin(fx * xx + fy * yy
                                                            + rng.uniform(0, 2 * np.pi))
    return pattern


def _landmarks(rng, size=130):
    """The reference points moved by a random similarity into a size x size image, plus a
    little noise (so that no similarity maps them exactly)."""
    angle, scale = rng.uniform(-0.2, 0.2), rng.uniform(0.95, 1.15)
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    centre = np.array([56.0, 56.0])
    points = scale * (REFERENCE - centre) @ rotation.T + size / 2 + rng.uniform(-4, 4, 2)
    return points + rng.normal(scale=0.7, size=points.shape)


@pytest.fixture(scope="module")
def ijb_set(tmp_path_factory):
    rng = np.random.default_rng(7)
    patterns = [_identity_pattern(rng) for _ in range(6)]
    images, landmarks, scores = {}, {}, {}
    for name, (identity, _) in IMAGES.items():
        noisy = patterns[identity] + rng.normal(scale=12, size=patterns[identity].shape)
        images[name] = np.clip(np.rint(noisy), 0, 255).astype(np.uint8)
        landmarks[name] = _landmarks(rng)
        scores[name] = float(rng.uniform(0.5, 1.0))
    directory = str(tmp_path_factory.mktemp("ijb") / "IJBC")
    write_ijb_layout(directory, "IJBC", images, landmarks, scores, FACES, PAIRS)
    projection = (rng.normal(size=(112 * 112 * 3, DIM)) / 300).astype(np.float32)
    return dict(directory=directory, landmarks=landmarks, scores=scores,
                projection=projection)


def _embed_with(projection):
    def embed(images):
        assert images.dtype == np.uint8 and images.shape[1:] == (112, 112, 3)
        pixels = images.astype(np.float32).reshape(len(images), -1) / np.float32(127.5)
        return (pixels - np.float32(1)) @ projection
    return embed


# --- the protocol, recomputed ---------------------------------------------------------------

def reference_similarity(source, target):
    """[2, 3]: x' = a x - b y + tx, y' = b x + a y + ty fitted by linear least squares."""
    rows = []
    for (x, y) in source:
        rows += [[x, -y, 1, 0], [y, x, 0, 1]]
    a, b, tx, ty = np.linalg.lstsq(np.array(rows, np.float64),
                                   np.asarray(target, np.float64).reshape(-1), rcond=None)[0]
    return np.array([[a, -b, tx], [b, a, ty]])


def reference_warp(image, matrix, size=112):
    """Each output pixel: the bilinear mix of the 4 source pixels around its preimage,
    source pixels outside the image counted as 0; rounded half up."""
    height, width = image.shape[:2]
    inverse = np.linalg.inv(np.vstack([matrix, [0, 0, 1]]))
    ys, xs = np.mgrid[0:size, 0:size]
    source = inverse @ np.stack([xs.ravel(), ys.ravel(), np.ones(xs.size)])
    sx, sy = source[0], source[1]
    x0, y0 = np.floor(sx).astype(int), np.floor(sy).astype(int)
    fx, fy = sx - x0, sy - y0
    out = np.zeros((xs.size, image.shape[2]))
    for dx in (0, 1):
        for dy in (0, 1):
            xi, yi = x0 + dx, y0 + dy
            inside = (xi >= 0) & (xi < width) & (yi >= 0) & (yi < height)
            pixel = image[np.clip(yi, 0, height - 1), np.clip(xi, 0, width - 1)].astype(float)
            weight = (fx if dx else 1 - fx) * (fy if dy else 1 - fy)
            out += np.where(inside[:, None], pixel, 0.0) * weight[:, None]
    return np.clip(np.floor(out + 0.5), 0, 255).astype(np.uint8).reshape(size, size, -1)


def reference_table(labels, scores):
    """eval_ijbc.py's TPR@FPR row: sklearn's ROC reversed, for each FAR the first point of
    the smallest |fpr - far|."""
    fpr, tpr, _ = roc_curve(labels, scores)
    fpr, tpr = np.flipud(fpr), np.flipud(tpr)
    row = {}
    for far in FARS:
        _, index = min(zip(abs(fpr - far), range(len(fpr))))
        row[far] = float(tpr[index])
    return row


def reference_result(ijb_set):
    """The scores and the TAR row of the set, recomputed from its files' values."""
    embed, directory = _embed_with(ijb_set["projection"]), ijb_set["directory"]
    faces = []
    for name, _, _ in FACES:
        data = tf.io.read_file(os.path.join(directory, "loose_crop", name))
        image = tf.io.decode_image(data, channels=3).numpy()
        points = ijb_set["landmarks"][name].astype(np.float32)  # as the file is read
        faces.append(reference_warp(image, reference_similarity(points, REFERENCE)))
    faces = np.stack(faces)
    # one call: OpenBLAS is erratic (up to 1 s) on 2-row products in this process
    outputs = embed(np.concatenate([faces, faces[:, :, ::-1]]))
    scores = np.array([ijb_set["scores"][name] for name, _, _ in FACES], dtype=np.float32)
    features = (outputs[:len(faces)] + outputs[len(faces):]) * scores[:, None]
    template_feature = {}
    for template in sorted({t for _, t, _ in FACES}):
        medias = {}
        for row, (_, t, media) in enumerate(FACES):
            if t == template:
                medias.setdefault(media, []).append(features[row].astype(np.float64))
        total = sum(np.mean(images, axis=0) for images in medias.values())
        template_feature[template] = total / np.linalg.norm(total)
    scores = np.array([template_feature[a] @ template_feature[b] for a, b, _ in PAIRS])
    labels = np.array([label for _, _, label in PAIRS])
    return scores, reference_table(labels, scores)


# --- tests ----------------------------------------------------------------------------------

def test_ijb_verification_equals_the_protocol_recomputed(ijb_set):
    result = evaluate_ijb(ijb_set["directory"], _embed_with(ijb_set["projection"]),
                          batch_size=5, progress=False)
    scores, table = reference_result(ijb_set)
    assert (result.target, result.templates, result.pairs, result.images) == (
        "IJBC", 12, len(PAIRS), len(FACES))
    np.testing.assert_allclose(result.scores, scores, rtol=0, atol=1e-6)
    assert result.tar_at_far == table
    np.testing.assert_array_equal(result.labels, [label for _, _, label in PAIRS])
    # the set tells identities apart, and its scores are not one value
    assert scores[:len(POSITIVES)].mean() > scores[len(POSITIVES):].mean()
    assert len(set(table.values())) > 1


def test_alignment_equals_a_least_squares_similarity_and_bilinear_warp():
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, size=(130, 120, 3), dtype=np.uint8)
    for _ in range(4):
        points = _landmarks(rng).astype(np.float32)
        expected = reference_warp(image, reference_similarity(points, REFERENCE))
        np.testing.assert_array_equal(align_face(image, points), expected)


def test_alignment_identity_and_integer_translation():
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, size=(112, 112, 3), dtype=np.uint8)
    np.testing.assert_array_equal(align_face(image, REFERENCE_LANDMARKS), image)
    # the face 3 pixels right and 2 up: output(x, y) = image(x + 3, y - 2), 0 outside
    shifted = align_face(image, REFERENCE_LANDMARKS + [3.0, -2.0])
    expected = np.zeros_like(image)
    expected[2:, :-3] = image[:-2, 3:]
    np.testing.assert_array_equal(shifted, expected)


@pytest.mark.parametrize("seed", range(40))
def test_tar_at_far_equals_sklearn_roc_and_the_table_rule(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(4, 300))
    labels = (rng.random(count) < rng.uniform(0.1, 0.9)).astype(int)
    labels[:2] = [0, 1]
    # rounded scores: ties, vertical and collinear stretches of the ROC
    scores = np.round(labels * rng.uniform(0, 1.5) + rng.normal(size=count),
                      int(rng.integers(0, 3)))
    assert tar_at_far(labels, scores) == reference_table(labels, scores)


def _save_projection_export(path, projection):
    class Projection(tf.Module):
        def __init__(self):
            super().__init__()
            self.projection = tf.constant(projection)

        @tf.function(input_signature=[tf.TensorSpec([None, 112, 112, 3], tf.uint8)])
        def embeddings(self, images):
            pixels = tf.cast(images, tf.float32) / 127.5 - 1.0
            return {"features": tf.reshape(pixels, [tf.shape(images)[0], -1])
                    @ self.projection}

    module = Projection()
    tf.saved_model.save(module, path, signatures={"embeddings": module.embeddings})


def _evaluate_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "owt_tf.evaluate", *args], cwd=cwd,
                          env=ENV, capture_output=True, text=True, timeout=300)


def test_evaluate_cli_prints_the_tar_row_of_a_saved_model(ijb_set, tmp_path):
    export = str(tmp_path / "export")
    _save_projection_export(export, ijb_set["projection"])
    proc = _evaluate_cli("--ijb", ijb_set["directory"], export, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = evaluate_ijb(ijb_set["directory"], _embed_with(ijb_set["projection"]),
                          progress=False)
    rates = " | ".join(f"TAR@FAR={far:.0e} {tar:.2%}"
                       for far, tar in result.tar_at_far.items())
    line = f"IJBC 1:1 (12 templates, {len(PAIRS)} pairs): {rates}"
    assert line in proc.stdout.splitlines(), proc.stdout
    assert "TAR@FAR=1e-06 " in line and "TAR@FAR=1e-01 " in line


def test_evaluate_cli_names_a_missing_meta_file_on_one_line(ijb_set, tmp_path):
    directory = str(tmp_path / "IJBC")
    write_ijb_layout(directory, "IJBC", {}, {}, {}, [], [])
    missing = os.path.join(directory, "meta", "ijbc_template_pair_label.txt")
    os.remove(missing)
    proc = _evaluate_cli("--ijb", directory, str(tmp_path / "no_export"), cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert missing in proc.stderr and proc.stdout == ""


def _copy_set(ijb_set, tmp_path, target="IJBC"):
    """The set's lists written under `target` into tmp_path, with small random PNG images
    (and the landmarks scaled to them)."""
    rng = np.random.default_rng(3)
    images = {name: rng.integers(0, 256, size=(40, 40, 3), dtype=np.uint8)
              for name, _, _ in FACES}
    marks = {name: ijb_set["landmarks"][name] * 0.3 for name in images}
    directory = str(tmp_path / target)
    layout = write_ijb_layout(directory, target, images, marks, ijb_set["scores"], FACES,
                              PAIRS)
    return directory, layout


def test_an_ijbb_directory_is_recognised(ijb_set, tmp_path):
    directory, _ = _copy_set(ijb_set, tmp_path, "IJBB")
    result = evaluate_ijb(directory, _embed_with(ijb_set["projection"]), progress=False)
    assert (result.target, result.templates, result.pairs) == ("IJBB", 12, len(PAIRS))


def _replace_line(path, number, text):
    with open(path) as f:
        lines = f.readlines()
    lines[number - 1] = text + "\n"
    with open(path, "w") as f:
        f.writelines(lines)


@pytest.mark.parametrize("damage,expected", [
    ("landmarks_path", ":3: expected 'image_name x1 y1"),
    ("faces_path", ":3: expected 'image_name template_id media_id'"),
    ("pairs_path", ":3: expected 'template_id template_id label'"),
    ("image", "not a decodable image"),
    ("order", "both list every image, in the same order"),
    ("template", "names template 999"),
])
def test_a_damaged_set_is_one_line_naming_the_file(ijb_set, tmp_path, damage, expected):
    directory, layout = _copy_set(ijb_set, tmp_path)
    if damage == "image":
        path = os.path.join(layout.images_dir, "b1.png")
        with open(path, "wb") as f:
            f.write(b"not an image")
    elif damage == "order":
        path = layout.landmarks_path
        with open(path) as f:
            lines = f.readlines()
        lines[1], lines[2] = lines[2], lines[1]
        with open(path, "w") as f:
            f.writelines(lines)
    elif damage == "template":
        path = layout.pairs_path
        _replace_line(path, 3, "101 999 1")
    else:
        path = getattr(layout, damage)
        _replace_line(path, 3, "a1.png 1 2.5 x")
    with pytest.raises(DatasetError) as err:
        evaluate_ijb(directory, _embed_with(ijb_set["projection"]), progress=False)
    message = str(err.value)
    assert "\n" not in message and path in message and expected in message, message
