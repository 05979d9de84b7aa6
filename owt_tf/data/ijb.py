"""IJB-B / IJB-C 1:1 template verification as arcface_torch's eval_ijbc.py reports it (its
defaults: flip test, detector scores, image features not normalised before pooling).

Owns the release's layout (DIR/meta/{ijbc,ijbb}_face_tid_mid.txt, _template_pair_label.txt,
_name_5pts_score.txt, DIR/loose_crop/<image>) and its lists; the alignment of a face to
112x112 by its 5 landmarks; the image features (the backbone's outputs for the face plus its
mirror's, times the detector score); template pooling (media means, summed, L2-normalised);
the pairs' cosines; TAR at FAR=1e-6 ... 1e-1 off the ROC of all pairs as eval_ijbc.py's
table reads it; `evaluate_ijb`, all of it for any function of images; `write_ijb_layout`.
Numpy only: TensorFlow (image decoding, encoding) and Keras (the progress bar) are imported
where needed. Images are decoded and aligned on threads, a batch ahead of the embedding.
"""
from __future__ import annotations

import array
import concurrent.futures
import dataclasses
import os
import warnings
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from owt_tf.data import DatasetError

TARGETS = ("IJBC", "IJBB")
FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
ALIGNED_SIZE = (112, 112)
# arcface's 5 reference points (eyes, nose tip, mouth corners) in a 112x112 face: its
# 96x112 points moved 8 pixels right.
REFERENCE_LANDMARKS = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366],
                                [41.5493, 92.3655], [70.7299, 92.2041]], dtype=np.float64)
LOAD_THREADS = min(8, os.cpu_count() or 1)  # images decoded and aligned at once
PAIR_SCORE_BATCH = 100_000  # pairs scored at a time: 15.6M pairs at once would not fit

EmbedFn = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class IJBLayout:
    """Where one IJB set's files are."""

    target: str
    faces_path: str      # image_name template_id media_id
    pairs_path: str      # template_id template_id label
    landmarks_path: str  # image_name x1 y1 ... x5 y5 detection_score
    images_dir: str


@dataclasses.dataclass
class IJBResult:
    """TAR at each FAR of `FARS` over all pairs of one IJB set, and the pairs' scores."""

    target: str
    templates: int
    pairs: int
    tar_at_far: Dict[float, float]
    images: int = 0
    scores: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)  # [pairs]
    labels: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)


# --- the layout and its lists -------------------------------------------------------------

def layout_paths(directory: str, target: str) -> IJBLayout:
    """The paths of `target`'s files in `directory` (whether they exist or not)."""
    if target not in TARGETS:
        raise ValueError(f"target {target!r}: one of {', '.join(TARGETS)}")
    meta, prefix = os.path.join(directory, "meta"), target.lower()
    return IJBLayout(target=target,
                     faces_path=os.path.join(meta, f"{prefix}_face_tid_mid.txt"),
                     pairs_path=os.path.join(meta, f"{prefix}_template_pair_label.txt"),
                     landmarks_path=os.path.join(meta, f"{prefix}_name_5pts_score.txt"),
                     images_dir=os.path.join(directory, "loose_crop"))


def detect_target(directory: str) -> str:
    """IJBC or IJBB: whose faces list DIR/meta holds (a DatasetError when neither or both)."""
    found = [t for t in TARGETS if os.path.isfile(layout_paths(directory, t).faces_path)]
    if len(found) != 1:
        expected = " or ".join(layout_paths(directory, t).faces_path for t in TARGETS)
        raise DatasetError(f"{directory} is not an IJB-C or IJB-B directory: no {expected}"
                           if not found else f"{directory}/meta holds both IJB-C's and "
                           "IJB-B's lists: name the target (IJBC or IJBB)")
    return found[0]


def ijb_layout(directory: str, target: Optional[str] = None) -> IJBLayout:
    """The layout of the IJB set in `directory` (its target detected unless given), its
    three lists and its images directory found (else a DatasetError naming the first
    missing)."""
    if not os.path.isdir(directory):
        raise DatasetError(f"{directory}: no such directory")
    layout = layout_paths(directory, target or detect_target(directory))
    for path in (layout.faces_path, layout.pairs_path, layout.landmarks_path):
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: no such file (an {layout.target} directory holds "
                               f"meta/{os.path.basename(path)})")
    if not os.path.isdir(layout.images_dir):
        raise DatasetError(f"{layout.images_dir}: no such directory (an IJB release's face "
                           "crops are in loose_crop/)")
    return layout


def _rows(path: str) -> Iterator[Tuple[int, List[str]]]:
    """(line number, whitespace-separated fields) of each non-blank line of `path`."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for number, line in enumerate(f, start=1):
                fields = line.split()
                if fields:
                    yield number, fields
    except OSError as err:
        raise DatasetError(f"{path}: cannot be read ({err.strerror or err})") from None


def read_rows(path: str, count: int, number: type, expected: str,
              named: bool = True) -> Tuple[List[str], np.ndarray, np.ndarray]:
    """Lines of a name (unless not `named`) and `count` numbers (`number`: int or float):
    (names, numbers [N, count] int64 or float64, line numbers [N]); a DatasetError naming
    the first line that is not one, or the file when it has none."""
    names, values = [], array.array("q" if number is int else "d")
    lines = array.array("q")
    for line, fields in _rows(path):
        try:
            if len(fields) != count + named:
                raise ValueError
            values.extend([number(x) for x in fields[named:]])
        except ValueError:
            shown = " ".join(fields)[:80]
            raise DatasetError(f"{path}:{line}: expected {expected}, got {shown!r}") from None
        names.append(fields[0] if named else "")
        lines.append(line)
    if not lines:
        raise DatasetError(f"{path}: lists nothing (expected {expected} per line)")
    return names, np.frombuffer(values, values.typecode).reshape(-1, count), np.array(lines)


def read_faces(path: str) -> Tuple[List[str], np.ndarray, np.ndarray]:
    """`image_name template_id media_id` per line: (names, templates, medias)."""
    names, table, _ = read_rows(path, 2, int, "'image_name template_id media_id'")
    return names, table[:, 0].copy(), table[:, 1].copy()


def read_landmarks(path: str) -> Tuple[List[str], np.ndarray, np.ndarray]:
    """`image_name x1 y1 ... x5 y5 detection_score` per line (eyes, nose tip, mouth corners
    in the image's pixels): (names, landmarks [N, 5, 2], scores [N]), float32 as
    eval_ijbc.py reads them."""
    names, table, lines = read_rows(path, 11, float, "'image_name x1 y1 ... x5 y5 "
                                    "detection_score' (a name and 11 numbers)")
    table = table.astype(np.float32)
    landmarks = table[:, :10].reshape(-1, 5, 2)
    for bad, why in ((~np.all(np.isfinite(table), axis=1), "has a number that is not finite"),
                     (np.ptp(landmarks, axis=1).max(axis=1) == 0,
                      "puts the 5 landmarks on one point: the face cannot be aligned")):
        if bad.any():
            row = int(np.argmax(bad))
            raise DatasetError(f"{path}:{lines[row]}: {names[row]} {why}")
    return names, landmarks, table[:, 10].copy()


def read_pairs(path: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`template_id template_id label` per line (label 1: the same person): (t1, t2,
    labels) int64. Read with numpy's C parser (IJB-C lists 15.6M pairs); when it refuses
    the file, read again line by line to name the line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            table = np.loadtxt(path, dtype=np.int64, ndmin=2, comments=None,
                               encoding="utf-8")
    except OSError as err:
        raise DatasetError(f"{path}: cannot be read ({err.strerror or err})") from None
    except ValueError:
        table = np.empty((0, 0), np.int64)
    if table.shape[1:] != (3,):
        _, table, _ = read_rows(path, 3, int, "'template_id template_id label'", named=False)
    bad = np.flatnonzero((table[:, 2] != 0) & (table[:, 2] != 1))
    if len(bad):
        raise DatasetError(f"{path}: pair {bad[0] + 1} is labelled {table[bad[0], 2]}; "
                           "labels are 1 (the same person) or 0")
    return table[:, 0], table[:, 1], table[:, 2]


def check_lists(layout: IJBLayout, faces: Sequence[str], marked: Sequence[str]) -> None:
    """eval_ijbc.py pairs the faces list's rows with the landmarks list's by their order:
    both must name the same images in the same order."""
    if list(faces) != list(marked):
        row = next((i for i, (a, b) in enumerate(zip(faces, marked)) if a != b),
                   min(len(faces), len(marked)))
        first, second = (names[row] if row < len(names) else "(none)"
                         for names in (marked, faces))
        raise DatasetError(f"{layout.landmarks_path}: image {row + 1} is {first}, in "
                           f"{layout.faces_path} {second}: both list every image, in the "
                           "same order")


def check_pairs(layout: IJBLayout, template_ids: np.ndarray, t1: np.ndarray,
                t2: np.ndarray, labels: np.ndarray) -> None:
    """Every template a pair names has faces (eval_ijbc.py would score an unknown one as
    the first template), and both labels occur."""
    known = np.isin(t1, template_ids) & np.isin(t2, template_ids)
    if not known.all():
        i = int(np.argmin(known))
        unknown = t1[i] if t1[i] not in template_ids else t2[i]
        raise DatasetError(f"{layout.pairs_path}: pair {i + 1} ({t1[i]} {t2[i]}) names "
                           f"template {unknown}, which has no face in {layout.faces_path}")
    if np.all(labels == labels[0]):
        raise DatasetError(f"{layout.pairs_path}: every pair is labelled {labels[0]}: TAR "
                           "at FAR needs pairs of the same person (1) and of two (0)")


# --- alignment ----------------------------------------------------------------------------

def similarity_transform(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The similarity (rotation, uniform scale, translation; no reflection) that maps the
    points `source` [K, 2] closest to `target` [K, 2] in least squares (Umeyama 1991, as
    scikit-image's SimilarityTransform.estimate): a [2, 3] matrix, target ~ M @ [x, y, 1]."""
    source, target = np.asarray(source, np.float64), np.asarray(target, np.float64)
    source_mean, target_mean = source.mean(axis=0), target.mean(axis=0)
    src, dst = source - source_mean, target - target_mean
    source_variance = np.sum(src ** 2) / len(src)
    if source_variance == 0:
        raise ValueError("the source points are one point: no similarity maps them")
    u, s, vt = np.linalg.svd(dst.T @ src / len(src))
    d = np.array([1.0, np.sign(np.linalg.det(u) * np.linalg.det(vt)) or 1.0])
    rotation = u @ np.diag(d) @ vt  # the best rotation, not a reflection
    scale = float(s @ d) / source_variance
    return np.column_stack([scale * rotation, target_mean - scale * rotation @ source_mean])


def warp_affine(image: np.ndarray, matrix: np.ndarray,
                size: Tuple[int, int] = ALIGNED_SIZE) -> np.ndarray:
    """cv2.warpAffine(image, matrix, (w, h), borderValue=0) in float64 (not cv2's fixed
    point): each output pixel (centres at integer coordinates) the bilinear mix of the 4
    pixels of the uint8 image [H, W, C] around its preimage under `matrix` [2, 3] (image ->
    output), those outside the image 0, rounded half up."""
    image = np.asarray(image)
    height, width, channels = image.shape
    inverse, shift = np.linalg.inv(matrix[:, :2]), matrix[:, 2]
    ys, xs = np.indices(size, dtype=np.float64).reshape(2, -1)
    # each output pixel's preimage; far outside the image is all border: clip it there
    sx = inverse[0, 0] * (xs - shift[0]) + inverse[0, 1] * (ys - shift[1])
    sy = inverse[1, 0] * (xs - shift[0]) + inverse[1, 1] * (ys - shift[1])
    sx, sy = np.clip(sx, -2.0, width + 1.0), np.clip(sy, -2.0, height + 1.0)
    fx, fy = sx - np.floor(sx), sy - np.floor(sy)
    x0, y0 = np.floor(sx).astype(np.int64), np.floor(sy).astype(np.int64)
    # the pixels around all preimages, 0 outside the image, as float64 planes [C, rows, cols]
    left, top, right, bottom = x0.min(), y0.min(), x0.max() + 2, y0.max() + 2
    planes = np.zeros((channels, bottom - top, right - left))
    rows, cols = slice(max(top, 0), min(bottom, height)), slice(max(left, 0), min(right, width))
    if rows.start < rows.stop and cols.start < cols.stop:
        planes[:, rows.start - top:rows.stop - top, cols.start - left:cols.stop - left] = \
            np.moveaxis(image[rows, cols], 2, 0)
    stride = right - left
    corner = (y0 - top) * stride + (x0 - left)  # each preimage's top-left neighbour
    planes = planes.reshape(channels, -1)

    def pixels(offset: int) -> np.ndarray:  # np.take: several times faster than [:, ...]
        return np.take(planes, corner + offset, axis=1)

    upper = pixels(0) * (1 - fx) + pixels(1) * fx
    lower = pixels(stride) * (1 - fx) + pixels(stride + 1) * fx
    value = np.clip(np.floor(upper * (1 - fy) + lower * fy + 0.5), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(value.T).reshape(size[0], size[1], channels)


def align_face(image: np.ndarray, landmarks: np.ndarray) -> np.ndarray:
    """The 112x112 face of `image` (uint8 [H, W, 3]) whose 5 landmarks [5, 2] (x, y) land
    on arcface's reference points."""
    return warp_affine(image, similarity_transform(landmarks, REFERENCE_LANDMARKS))


def decode_image(path: str) -> np.ndarray:
    """The RGB pixels (uint8 [H, W, 3]) of a JPEG, PNG, BMP or GIF file; a DatasetError
    naming it when it cannot be read or decoded."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise DatasetError(f"{path}: cannot be read ({err.strerror or err})") from None
    import tensorflow as tf

    try:
        return tf.io.decode_image(data, channels=3, expand_animations=False).numpy()
    except (tf.errors.InvalidArgumentError, ValueError) as err:
        reason = str(getattr(err, "message", err)).strip().splitlines() or ["?"]
        raise DatasetError(f"{path}: not a decodable image ({reason[0]})") from None


# --- features, templates, scores, TAR at FAR ---------------------------------------------

def embed_faces(images_dir: str, names: Sequence[str], landmarks: np.ndarray,
                embed_fn: EmbedFn, batch_size: int = 64, progress: bool = True) -> np.ndarray:
    """[N, D] float32: for each image, aligned to 112x112 by its landmarks, the sum of
    `embed_fn`'s outputs for it and for its mirror image (one call of 2 x batch_size
    images a batch: the faces, then their mirror images)."""
    if batch_size < 1:
        raise ValueError(f"batch_size {batch_size}: at least 1")
    if progress:
        import keras

        bar = keras.utils.Progbar(len(names), unit_name="image")
    features = None
    for start, faces in _face_batches(images_dir, names, landmarks, batch_size):
        both = np.asarray(embed_fn(np.concatenate([faces, faces[:, :, ::-1]])), np.float32)
        if both.ndim != 2 or len(both) != 2 * len(faces):
            raise ValueError(f"the embedding function returned shape {both.shape} for "
                             f"{2 * len(faces)} images; expected [{2 * len(faces)}, D]")
        if features is None:
            features = np.empty((len(names), both.shape[1]), dtype=np.float32)
        features[start:start + len(faces)] = both[:len(faces)] + both[len(faces):]
        if progress:
            bar.update(start + len(faces))
    return features


def _face_batches(images_dir: str, names: Sequence[str], landmarks: np.ndarray,
                  batch_size: int) -> Iterator[Tuple[int, np.ndarray]]:
    """(first index, aligned faces uint8 [B, 112, 112, 3]) of each batch in order, decoded
    and aligned on LOAD_THREADS threads, the next batch while the caller embeds this one."""
    def load(i: int) -> np.ndarray:
        return align_face(decode_image(os.path.join(images_dir, names[i])), landmarks[i])

    with concurrent.futures.ThreadPoolExecutor(LOAD_THREADS) as pool:
        def submit(start: int) -> list:
            stop = min(start + batch_size, len(names))
            return [pool.submit(load, i) for i in range(start, stop)]

        pending = submit(0)
        for start in range(0, len(names), batch_size):
            current, pending = pending, submit(start + batch_size)
            yield start, np.stack([future.result() for future in current])


def template_features(features: np.ndarray, templates: np.ndarray,
                      medias: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """eval_ijbc.py's image2template_feature: per template (increasing id), per media in it
    the mean of its images' features; their sum over the template's medias, L2-normalised
    (a zero one stays zero). Returns ([T, D] float64, the template ids [T])."""
    order = np.lexsort((medias, templates))  # by template, then media
    sorted_templates, sorted_medias = templates[order], medias[order]
    starts = np.flatnonzero(np.r_[True, sorted_templates[1:] != sorted_templates[:-1]])
    pooled = np.empty((len(starts), features.shape[1]), dtype=np.float64)
    for t, (start, end) in enumerate(zip(starts, np.r_[starts[1:], len(order)])):
        rows, template_medias = order[start:end], sorted_medias[start:end]
        media_starts = np.flatnonzero(np.r_[True, template_medias[1:] != template_medias[:-1]])
        counts = np.diff(np.r_[media_starts, len(rows)])
        media_sums = np.add.reduceat(features[rows].astype(np.float64), media_starts, axis=0)
        pooled[t] = np.sum(media_sums / counts[:, None], axis=0)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    return pooled / np.where(norms == 0, 1.0, norms), sorted_templates[starts]


def pair_scores(template_feats: np.ndarray, template_ids: np.ndarray, t1: np.ndarray,
                t2: np.ndarray) -> np.ndarray:
    """[P] float64: the dot product of each pair's normalised template features (their
    cosine), PAIR_SCORE_BATCH pairs at a time; `template_ids` increasing, holding them all."""
    first, second = np.searchsorted(template_ids, t1), np.searchsorted(template_ids, t2)
    scores = np.empty(len(first), dtype=np.float64)
    for start in range(0, len(first), PAIR_SCORE_BATCH):
        batch = slice(start, start + PAIR_SCORE_BATCH)
        scores[batch] = np.einsum("ij,ij->i", template_feats[first[batch]],
                                  template_feats[second[batch]])
    return scores


def roc_curve(labels: np.ndarray, scores: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) as scikit-learn's roc_curve(labels, scores) returns them (its default
    drop_intermediate=True): one point per distinct score, from the highest down, after
    (0, 0); the points collinear with both neighbours on a straight stretch dropped."""
    labels, scores = np.asarray(labels), np.asarray(scores)
    order = np.argsort(scores, kind="mergesort")[::-1]
    sorted_scores, positives = scores[order], (labels[order] == 1).astype(np.float64)
    last_of_each_score = np.r_[np.flatnonzero(np.diff(sorted_scores)), len(scores) - 1]
    tps = np.cumsum(positives)[last_of_each_score]
    fps = 1 + last_of_each_score - tps
    if len(fps) > 2:
        corners = np.r_[True, (np.diff(fps, 2) != 0) | (np.diff(tps, 2) != 0), True]
        fps, tps = fps[corners], tps[corners]
    fps, tps = np.r_[0.0, fps], np.r_[0.0, tps]
    return fps / fps[-1], tps / tps[-1]


def tar_at_far(labels: np.ndarray, scores: np.ndarray,
               fars: Sequence[float] = FARS) -> Dict[float, float]:
    """eval_ijbc.py's table: for each FAR x, the TPR of the ROC point whose FPR is nearest
    to x (above or below it); among equally near points, the one latest on the curve (the
    highest TPR): the table searches the reversed curve for the first minimum."""
    labels = np.asarray(labels)
    if np.all(labels == 1) or np.all(labels == 0):
        raise ValueError("TAR at FAR needs pairs of both labels (1: the same person, 0 not)")
    fpr, tpr = roc_curve(labels, scores)
    fpr, tpr = fpr[::-1], tpr[::-1]
    return {far: float(tpr[np.argmin(np.abs(fpr - far))]) for far in fars}


def evaluate_ijb(directory: str, embed_fn: EmbedFn, batch_size: int = 64,
                 progress: bool = True, target: Optional[str] = None) -> IJBResult:
    """IJB-C or IJB-B (`target`, else the one `directory` holds) 1:1 verification of
    `embed_fn` (uint8 [B, 112, 112, 3] -> the backbone's raw outputs [B, D]) under
    eval_ijbc.py's protocol: TAR at each FAR of `FARS` over all template pairs."""
    layout = ijb_layout(directory, target)
    names, templates, medias = read_faces(layout.faces_path)
    marked, landmarks, detector_scores = read_landmarks(layout.landmarks_path)
    t1, t2, labels = read_pairs(layout.pairs_path)
    check_lists(layout, names, marked)
    check_pairs(layout, np.unique(templates), t1, t2, labels)
    features = embed_faces(layout.images_dir, names, landmarks, embed_fn, batch_size,
                           progress)
    features *= detector_scores[:, None]  # the detector's confidence weighs each image
    template_feats, template_ids = template_features(features, templates, medias)
    scores = pair_scores(template_feats, template_ids, t1, t2)
    return IJBResult(target=layout.target, templates=len(template_ids), pairs=len(scores),
                     tar_at_far=tar_at_far(labels, scores), images=len(names),
                     scores=scores, labels=labels)


def write_ijb_layout(directory: str, target: str, images: Mapping[str, np.ndarray],
                     landmarks: Mapping[str, np.ndarray], scores: Mapping[str, float],
                     faces: Sequence[Tuple[str, int, int]],
                     pairs: Sequence[Tuple[int, int, int]]) -> IJBLayout:
    """Writes an IJB set in the release's layout: each image (uint8 [H, W, 3]) as PNG or
    JPEG (quality 95) by its name's extension, the faces list in `faces`' order (image,
    template, media), the landmarks list in the same order (each face's 5 (x, y) points
    and detector score) and the pairs (template, template, label)."""
    import tensorflow as tf

    layout = layout_paths(directory, target)
    os.makedirs(os.path.dirname(layout.faces_path), exist_ok=True)
    os.makedirs(layout.images_dir, exist_ok=True)
    for name, pixels in images.items():
        extension = os.path.splitext(name)[1].lower()
        if extension not in (".png", ".jpg", ".jpeg"):
            raise ValueError(f"{name}: write_ijb_layout writes .png or .jpg images")
        pixels = np.asarray(pixels, dtype=np.uint8)
        data = (tf.io.encode_png(pixels) if extension == ".png"
                else tf.io.encode_jpeg(pixels, quality=95))
        with open(os.path.join(layout.images_dir, name), "wb") as f:
            f.write(data.numpy())
    with open(layout.faces_path, "w") as f:
        f.writelines(f"{name} {int(t)} {int(m)}\n" for name, t, m in faces)
    with open(layout.landmarks_path, "w") as f:
        for name, _, _ in faces:
            numbers = list(np.asarray(landmarks[name], np.float64).reshape(10)) + [scores[name]]
            f.write(" ".join([name] + [repr(float(v)) for v in numbers]) + "\n")
    with open(layout.pairs_path, "w") as f:
        f.writelines(f"{int(a)} {int(b)} {int(label)}\n" for a, b, label in pairs)
    return layout
