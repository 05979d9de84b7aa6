"""Turning uint8 images into the network's input: the same function in training and export."""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def normalize(images: tf.Tensor, mean: Sequence[float], std: Sequence[float]) -> tf.Tensor:
    """uint8 [N, H, W, C] -> float32, per-channel mean subtracted and divided by std (0..255 units)."""
    x = tf.cast(images, tf.float32)
    return (x - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)
