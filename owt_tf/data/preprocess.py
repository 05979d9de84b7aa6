"""Turning uint8 images into the network's input: the same function in training and export."""
from __future__ import annotations

from typing import Sequence, Tuple

import tensorflow as tf


def normalize(images: tf.Tensor, mean: Sequence[float], std: Sequence[float]) -> tf.Tensor:
    """[N, H, W, C] pixels in 0..255 -> float32, per-channel mean subtracted, divided by std."""
    x = tf.cast(images, tf.float32)
    return (x - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def eval_preprocess(images: tf.Tensor, size: Tuple[int, int], mean: Sequence[float],
                    std: Sequence[float]) -> tf.Tensor:
    """Eval-time input: images of the model's size are only normalized; others have their
    shorter side resized to size*256/224 (AlexNet's 256 for 224) and are center-cropped."""
    height, width = size
    shape = tf.shape(images)

    def resize_and_crop():
        scale = 256.0 / 224.0
        short = tf.cast(tf.minimum(shape[1], shape[2]), tf.float32)
        factor = tf.cast(height, tf.float32) * scale / short
        new_size = tf.cast(tf.round(tf.cast(shape[1:3], tf.float32) * factor), tf.int32)
        resized = tf.image.resize(tf.cast(images, tf.float32), new_size, method="bilinear")
        top = (new_size[0] - height) // 2
        left = (new_size[1] - width) // 2
        cropped = resized[:, top:top + height, left:left + width, :]
        # Not rounded to whole pixel levels: a value at .5 would round the other way under
        # another runtime's bilinear resize (ONNX's), a whole level off (1.4e-4 measured).
        return tf.clip_by_value(cropped, 0.0, 255.0)

    same = tf.logical_and(tf.equal(shape[1], height), tf.equal(shape[2], width))
    pixels = tf.cond(same, lambda: tf.cast(images, tf.float32), resize_and_crop)
    # A reshape, not tf.ensure_shape: TFLite has no EnsureShape builtin.
    pixels = tf.reshape(pixels, [-1, height, width, images.shape[-1] or shape[3]])
    return normalize(pixels, mean, std)


# AlexNet 2012's PCA lighting noise: eigenvalues and eigenvectors of the RGB covariance of
# ImageNet pixels (0..1 scale), as published with the fb.resnet.torch / AlexNet reproductions.
IMAGENET_EIGVAL = (0.2175, 0.0188, 0.0045)
IMAGENET_EIGVEC = ((-0.5675, 0.7192, 0.4009),
                   (-0.5808, -0.0045, -0.8140),
                   (-0.5836, -0.6948, 0.4203))


def train_augment(image: tf.Tensor, size: Tuple[int, int], seed: tf.Tensor,
                  lighting_std: float = 0.1) -> tf.Tensor:
    """One uint8 image [H, W, C] -> float pixels [h, w, C] (0..255), AlexNet 2012 style:
    shorter side resized to size*256/224, a random crop of `size`, a random horizontal flip,
    and PCA lighting noise (RGB only). Stateless in `seed` (int32 [2]), so runs repeat."""
    height, width = size
    shape = tf.shape(image)
    scale = tf.cast(height, tf.float32) * 256.0 / 224.0 / tf.cast(tf.minimum(shape[0], shape[1]), tf.float32)
    new_size = tf.maximum(tf.cast(tf.round(tf.cast(shape[:2], tf.float32) * scale), tf.int32),
                          [height, width])
    x = tf.image.resize(tf.cast(image, tf.float32), new_size, method="bilinear")
    seeds = tf.random.experimental.stateless_split(seed, 3)
    x = tf.image.stateless_random_crop(x, [height, width, image.shape[-1]], seed=seeds[0])
    x = tf.image.stateless_random_flip_left_right(x, seed=seeds[1])
    if image.shape[-1] == 3 and lighting_std > 0:
        alpha = tf.random.stateless_normal([3], seeds[2], stddev=lighting_std)
        rgb = tf.linalg.matvec(tf.constant(IMAGENET_EIGVEC), alpha * tf.constant(IMAGENET_EIGVAL))
        x = x + 255.0 * rgb
    return tf.clip_by_value(x, 0.0, 255.0)
