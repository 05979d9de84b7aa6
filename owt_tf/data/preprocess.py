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
        return tf.clip_by_value(tf.round(cropped), 0.0, 255.0)

    same = tf.logical_and(tf.equal(shape[1], height), tf.equal(shape[2], width))
    pixels = tf.cond(same, lambda: tf.cast(images, tf.float32), resize_and_crop)
    pixels = tf.ensure_shape(pixels, [None, height, width, None])
    return normalize(pixels, mean, std)
