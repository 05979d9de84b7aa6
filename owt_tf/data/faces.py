"""`faces`: a synthetic face-identity set for a first face-recognition run, made in memory
from a seed in a fraction of a second (2 s at 112x112 on 2 cores), with no download.

Each identity is a smooth random pattern: the coefficients of a low-frequency cosine
basis (FREQUENCIES per axis), a part shared by every identity (all faces look alike) plus
the identity's own. Each image of an identity adds its own smaller coefficient change (pose,
expression), a sub-pixel shift, a brightness gain and offset, pixel noise and, half of the
time, a mirror image. Training identities are labels 0 .. identities-1; further held-out
identities, never trained on, give the verification pairs (half same, half different,
alternating so that every contiguous fold is balanced), as LFW's come from people not in
the training set. The raw pixels are far from trivially separable: the nearest template of
the identities seen unshifted and unmirrored finds 45 % of the training images
(`nearest_template_accuracy`; chance 0.2 %) and the best threshold on the cosine of raw
pixels gets 64 % of the pairs right; a network must learn the invariances (measured at
32x32: face_tiny with a plain softmax head, 2 minutes of Keras fit on 2 cores: 58 % of the
pairs before training, 92 % after).

Classification validation: one image of each training identity with at least 3 images is
held out, as for InsightFace sets (owt_tf.data.insightface.held_out_for_validation).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Tuple

import numpy as np

from owt_tf.data.arrays import ArrayDataset
from owt_tf.data.insightface import (held_out_for_validation, write_property,
                                     write_verification_bin)
from owt_tf.data.recordio import write_record_file
from owt_tf.data.verification import VerificationPairs

FACES_SEED = 20150612  # fixed: every run trains and verifies on the same faces
FREQUENCIES = 6  # cosine basis functions per axis: smooth, face-sized structure
SHARED_WEIGHT = 1.0  # the part of every identity's coefficients all identities share
OWN_WEIGHT = 0.6  # each identity's own part
VARIATION = 0.45  # an image's own coefficient change, relative to the identity's part
PIXEL_CONTRAST = 45.0  # pixel levels per unit of the rendered pattern
NOISE_LEVELS = 10.0  # pixel noise, standard deviation in pixel levels


@dataclasses.dataclass
class FacesDataset(ArrayDataset):
    """The `faces` set: ArrayDataset's training and validation images plus the held-out
    identities' verification pairs."""

    pairs: VerificationPairs = None
    pair_identities: np.ndarray = None  # int32 [P, 2]: who each pair's images show
    templates: np.ndarray = None  # uint8 [identities, H, W, C]: each identity unshifted

    def verification_pairs(self) -> VerificationPairs:
        """Pairs of images of held-out identities: half the same person, half not."""
        return self.pairs

    def write_insightface(self, directory: str, quality: int = 95) -> None:
        """Writes the set in InsightFace's layout (train.rec/.idx with a header record,
        `property`, faces.bin), training and validation images together."""
        import tensorflow as tf

        def jpeg(image):
            return tf.io.encode_jpeg(image, quality=quality).numpy()

        os.makedirs(directory, exist_ok=True)
        images = np.concatenate([self.train_images, self.val_images])
        labels = np.concatenate([self.train_labels, self.val_labels])
        order = np.argsort(labels, kind="stable")  # a header layout needs identities in turn
        write_record_file(os.path.join(directory, "train"),
                          ((jpeg(images[i]), int(labels[i])) for i in order), header=True)
        write_property(directory, self.num_classes, images.shape[1:3])
        write_verification_bin(os.path.join(directory, "faces.bin"),
                               [(jpeg(a), jpeg(b)) for a, b in zip(self.pairs.first,
                                                                   self.pairs.second)],
                               self.pairs.same)


def faces_dataset(image_shape: Tuple[int, int, int] = (112, 112, 3), identities: int = 500,
                  images_per_identity: int = 6, held_out_identities: int = 100,
                  pairs: int = 600, seed: int = FACES_SEED) -> FacesDataset:
    """The synthetic identity set at `image_shape` (module docstring): `identities` to train
    on, `held_out_identities` more for `pairs` verification pairs; the same for the same
    arguments."""
    if identities < 2 or held_out_identities < 2 or images_per_identity < 2:
        raise ValueError("faces needs at least 2 identities, 2 held-out identities and 2 "
                         "images per identity")
    rng = np.random.default_rng(seed)
    h, w, c = image_shape
    everyone = identities + held_out_identities
    coefficients = _identity_coefficients(rng, everyone, c)
    labels = np.repeat(np.arange(everyone, dtype=np.int32), images_per_identity)
    images = _render_images(rng, coefficients[labels], (h, w, c))
    templates = _render(coefficients[:identities], np.zeros(identities), np.zeros(identities), h, w)
    templates = _to_pixels(templates)

    trained = labels < identities
    train_images, train_labels = images[trained], labels[trained]
    held = held_out_for_validation(train_labels)
    keep = np.setdiff1d(np.arange(len(train_labels)), held)
    mean, std = channel_statistics(train_images[keep])
    verification, who = _pairs(rng, images[~trained], labels[~trained], pairs)
    return FacesDataset("faces", identities, train_images[keep], train_labels[keep],
                        train_images[held], train_labels[held], mean, std,
                        pairs=verification, pair_identities=who, templates=templates)


def _identity_coefficients(rng, count: int, channels: int) -> np.ndarray:
    """float32 [count, F, F, C]: the shared part plus each identity's own, low frequencies
    weighted more (a smooth image, not noise). An identity's own part has no constant term:
    who it is lies in its pattern, not in its average colour (which alone made raw pixels
    tell pairs apart too well)."""
    f = np.arange(FREQUENCIES)
    decay = (1.0 / (1.0 + f[:, None] + f[None, :]))[..., None].astype(np.float32)
    shared = rng.standard_normal((1, FREQUENCIES, FREQUENCIES, channels), np.float32)
    own = rng.standard_normal((count, FREQUENCIES, FREQUENCIES, channels), np.float32)
    own[:, 0, 0] = 0.0
    return (SHARED_WEIGHT * shared + OWN_WEIGHT * own) * decay


def _basis(positions: np.ndarray, side: int) -> np.ndarray:
    """float32 [..., F]: the cosine basis at (fractional) pixel `positions` of a side."""
    f = np.arange(FREQUENCIES, dtype=np.float32)
    return np.cos(np.pi * f * (positions[..., None] + 0.5) / side).astype(np.float32)


def _render(coefficients: np.ndarray, dy: np.ndarray, dx: np.ndarray, h: int, w: int) -> np.ndarray:
    """float32 [N, H, W, C] (zero-mean units): each image's coefficients rendered with its
    shift (dy, dx) in pixels: rows @ coefficients @ columns^T per channel."""
    n, _, _, c = coefficients.shape
    rows = _basis(np.arange(h, dtype=np.float32)[None] - dy[:, None].astype(np.float32), h)
    cols = _basis(np.arange(w, dtype=np.float32)[None] - dx[:, None].astype(np.float32), w)
    by_row = np.matmul(rows, coefficients.reshape(n, FREQUENCIES, FREQUENCIES * c))  # [N, H, F*C]
    by_row = by_row.reshape(n, h, FREQUENCIES, c).transpose(0, 1, 3, 2)  # [N, H, C, F]
    pixels = np.matmul(by_row.reshape(n, h * c, FREQUENCIES), cols.transpose(0, 2, 1))
    return pixels.reshape(n, h, c, w).transpose(0, 1, 3, 2)


def _to_pixels(units: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(127.5 + PIXEL_CONTRAST * units), 0, 255).astype(np.uint8)


def _render_images(rng, coefficients: np.ndarray, image_shape) -> np.ndarray:
    """uint8 [N, H, W, C]: per image a coefficient change, shift (up to 1/10 of a side),
    gain and offset, noise and, half of the time, the mirror image. All draws are made
    first, the pixels then rendered in chunks (a float copy of the whole set at 112x112
    would be half a gigabyte)."""
    h, w, c = image_shape
    n = len(coefficients)
    scale = np.abs(coefficients).mean()
    own = coefficients + VARIATION * scale * rng.standard_normal(coefficients.shape, np.float32)
    dy, dx = rng.uniform(-h / 10, h / 10, n), rng.uniform(-w / 10, w / 10, n)
    gain = rng.uniform(0.8, 1.2, n).astype(np.float32)
    offset = rng.uniform(-20, 20, n).astype(np.float32)
    mirrored = rng.random(n) < 0.5
    # Noise fields drawn once and shared: drawing one per image is most of the time at 112x112.
    noise = NOISE_LEVELS * rng.standard_normal((NOISE_FIELDS, h, w, c), np.float32)
    noise_of = rng.integers(0, NOISE_FIELDS, n)
    out = np.empty((n, h, w, c), np.uint8)
    for lo in range(0, n, RENDER_CHUNK):
        part = slice(lo, min(n, lo + RENDER_CHUNK))
        pixels = _render(own[part], dy[part], dx[part], h, w)
        pixels *= (gain[part] * PIXEL_CONTRAST)[:, None, None, None]
        pixels += (127.5 + offset[part])[:, None, None, None]
        pixels += noise[noise_of[part]]
        flip = mirrored[part]
        pixels[flip] = pixels[flip, :, ::-1]
        np.clip(np.rint(pixels, out=pixels), 0, 255, out=pixels)
        out[part] = pixels
    return out


RENDER_CHUNK = 256  # images rendered at once
NOISE_FIELDS = 61  # noise images the set's images draw theirs from
STATS_IMAGES = 500  # training images behind the mean and std


def channel_statistics(images: np.ndarray) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (STATS_IMAGES of them evenly spread), from
    each channel's histogram."""
    picks = np.unique(np.linspace(0, len(images) - 1, min(STATS_IMAGES, len(images))).astype(int))
    flat = images[picks].reshape(-1, images.shape[-1])
    levels = np.arange(256, dtype=np.float64)
    means, stds = [], []
    for ch in range(flat.shape[1]):
        counts = np.bincount(flat[:, ch], minlength=256).astype(np.float64)
        mean = (counts * levels).sum() / counts.sum()
        means.append(float(mean))
        stds.append(float(np.sqrt((counts * (levels - mean) ** 2).sum() / counts.sum())))
    return tuple(means), tuple(stds)


def _pairs(rng, images: np.ndarray, labels: np.ndarray, count: int):
    """(VerificationPairs, identities [count, 2]): `count` pairs alternating same,
    different, same, ...: a same pair is two distinct images of one identity, a different
    pair images of two identities."""
    people = np.unique(labels)
    by_person = {p: np.flatnonzero(labels == p) for p in people}
    first, second = np.zeros(count, np.int64), np.zeros(count, np.int64)
    same = np.arange(count) % 2 == 0
    for i in range(count):
        if same[i]:
            first[i], second[i] = rng.choice(by_person[rng.choice(people)], 2, replace=False)
        else:
            a, b = rng.choice(people, 2, replace=False)
            first[i], second[i] = rng.choice(by_person[a]), rng.choice(by_person[b])
    pairs = VerificationPairs(images[first], images[second], same, "faces")
    return pairs, np.stack([labels[first], labels[second]], axis=1)


def nearest_template_accuracy(dataset: FacesDataset) -> float:
    """The fraction of training images whose nearest identity template (Euclidean, raw
    pixels) is their own: how separable the set is with nothing learnt."""
    templates = dataset.templates.reshape(len(dataset.templates), -1).astype(np.float32)
    images = dataset.train_images.reshape(len(dataset.train_images), -1).astype(np.float32)
    distances = (templates ** 2).sum(1)[None] - 2.0 * images @ templates.T
    return float(np.mean(distances.argmin(1) == dataset.train_labels))
