"""Turning images into the network's input: eval_preprocess (the same function in evaluation
and export) and the training augmentations (--augment): AlexNet's (crop window decoded
from the encoded image, then flip, lighting and normalisation per batch), its crop alone, or
none (the eval view)."""
from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

import tensorflow as tf


def normalize(images: tf.Tensor, mean: Sequence[float], std: Sequence[float]) -> tf.Tensor:
    """[N, H, W, C] pixels in 0..255 -> float32, per-channel mean subtracted, divided by std."""
    x = tf.cast(images, tf.float32)
    return (x - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def eval_preprocess(images: tf.Tensor, size: Tuple[int, int], mean: Sequence[float],
                    std: Sequence[float]) -> tf.Tensor:
    """Eval-time input: images of the model's size are only normalized; others have their
    shorter side resized to size*256/224 (AlexNet's 256 for 224) and are center-cropped."""
    return normalize(eval_pixels(images, size), mean, std)


def eval_pixels(images: tf.Tensor, size: Tuple[int, int]) -> tf.Tensor:
    """The eval view of [N, H, W, C] images as float32 pixels in 0..255, not normalized:
    unchanged at the model's size, else shorter side to size*256/224 and center-cropped."""
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
    return tf.reshape(pixels, [-1, height, width, images.shape[-1] or shape[3]])


# AlexNet 2012's PCA lighting noise: eigenvalues and eigenvectors of the RGB covariance of
# ImageNet pixels (0..1 scale), as published with the fb.resnet.torch / AlexNet reproductions.
IMAGENET_EIGVAL = (0.2175, 0.0188, 0.0045)
IMAGENET_EIGVEC = ((-0.5675, 0.7192, 0.4009),
                   (-0.5808, -0.0045, -0.8140),
                   (-0.5836, -0.6948, 0.4203))


DRAW_CHUNK = 256  # stream positions whose draws come from one call of the generator


class TrainDraws(NamedTuple):
    """One example's random augmentation, fixed by the run's seed and its stream position."""

    corner: tf.Tensor  # float32 [2] in [0, 1): where the crop sits in the room it has, (y, x)
    flip: tf.Tensor  # bool []: mirror left-right
    lighting: tf.Tensor  # float32 [3]: PCA lighting coefficients (alpha)


def train_draws(seed: int, start: int, lighting_std: float = 0.1) -> tf.data.Dataset:
    """TrainDraws for stream positions start, start+1, ...: position p gets row p % 256 of
    the stateless draws seeded by (seed, p // 256). They depend on the seed and the position
    only (not on skipped images, resumes or K), and one generator call serves 256 examples
    (per-example generator ops cost as much as a third of a JPEG decode)."""
    return _draw_chunks(seed, start, lighting_std).unbatch()


def train_draw_batches(seed: int, start: int, batch: int,
                       lighting_std: float = 0.1) -> tf.data.Dataset:
    """`train_draws(seed, start)` in batches of `batch` positions, cut from the generator's
    chunks without handling each position on its own."""
    return _draw_chunks(seed, start, lighting_std).rebatch(batch, drop_remainder=True)


def _draw_chunks(seed: int, start: int, lighting_std: float) -> tf.data.Dataset:
    """The draws of positions start, start+1, ... in the generator's chunks of DRAW_CHUNK
    (the first cut to begin at `start`)."""
    def chunk(index):
        seeds = tf.random.experimental.stateless_split(
            tf.stack([tf.constant(seed, tf.int64), index]), 2)
        uniform = tf.random.stateless_uniform([DRAW_CHUNK, 3], seeds[0])
        lighting = tf.random.stateless_normal([DRAW_CHUNK, 3], seeds[1], stddev=lighting_std)
        skip = tf.where(index == start // DRAW_CHUNK, start % DRAW_CHUNK, 0)
        return TrainDraws(uniform[skip:, :2], uniform[skip:, 2] < 0.5, lighting[skip:])

    return tf.data.Dataset.counter(start // DRAW_CHUNK).map(chunk)


def crop_window(image_hw: tf.Tensor, size: Tuple[int, int], corner: tf.Tensor) -> tf.Tensor:
    """AlexNet 2012's random crop for an image of `image_hw` pixels, as int32 [top, left,
    height, width] in the image's own pixels: the `size` crop at `corner` of the image
    resized to shorter side size*256/224 (offsets uniform over that resized image), mapped
    back and rounded to whole pixels, so that only the window is decoded and resized."""
    hw = tf.cast(image_hw, tf.int32)
    out = tf.constant(size, tf.int32)
    scale = float(size[0]) * 256.0 / 224.0 / tf.cast(tf.reduce_min(hw), tf.float32)
    resized = tf.maximum(tf.cast(tf.round(tf.cast(hw, tf.float32) * scale), tf.int32), out)
    room = resized - out + 1  # the crop's possible offsets in the resized image
    offset = tf.minimum(tf.cast(corner * tf.cast(room, tf.float32), tf.int32), room - 1)
    per_pixel = tf.cast(hw, tf.float32) / tf.cast(resized, tf.float32)
    extent = tf.clip_by_value(tf.cast(tf.round(tf.cast(out, tf.float32) * per_pixel), tf.int32),
                              1, hw)
    top_left = tf.clip_by_value(tf.cast(tf.round(tf.cast(offset, tf.float32) * per_pixel), tf.int32),
                                0, hw - extent)
    return tf.concat([top_left, extent], 0)


def decode_train_crop(encoded: tf.Tensor, size: Tuple[int, int], channels: int,
                      corner: tf.Tensor) -> tf.Tensor:
    """Encoded image bytes -> its training crop (`crop_window` at `corner`) resized to
    `size`, uint8 [h, w, C].

    A complete JPEG has only its crop window decoded (tf.image.decode_and_crop_jpeg, the
    window computed from the header's shape); any other image (PNG, BMP, GIF, a JPEG that
    does not end with its end marker) is decoded whole and then cropped, so a truncated JPEG
    fails to decode and is skipped as before instead of yielding a crop of its readable part."""
    whole_jpeg = tf.logical_and(tf.io.is_jpeg(encoded),
                                tf.equal(tf.strings.substr(encoded, -2, 2), b"\xff\xd9"))

    def jpeg_window():
        window = crop_window(tf.io.extract_jpeg_shape(encoded)[:2], size, corner)
        return tf.image.decode_and_crop_jpeg(encoded, window, channels=channels)

    def whole_image():
        image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
        top, left, h, w = tf.unstack(crop_window(tf.shape(image)[:2], size, corner))
        return image[top:top + h, left:left + w]

    crop = tf.cond(whole_jpeg, jpeg_window, whole_image)
    crop.set_shape([None, None, channels])
    # Bilinear weights are convex: the resized pixels stay within 0..255.
    return tf.cast(tf.round(tf.image.resize(crop, size, method="bilinear")), tf.uint8)


class DeviceBatch(NamedTuple):
    """Training crops as a streamed dataset hands them to the CLI's step: uint8 [N, h, w, C]
    (float32 pixels in 0..255 under --augment none: the eval view, not rounded), each row's
    flip (bool [N]) and lighting draws (float32 [N, 3]; zeros but for 'alexnet'). The step
    finishes them on its device (`finish_images`): the float work leaves the input
    pipeline's cores (on a GPU it is free) and, as uint8, a quarter of the bytes cross to
    the device."""

    crops: tf.Tensor
    flips: tf.Tensor
    lighting: tf.Tensor


def finish_images(images, mean: Sequence[float], std: Sequence[float]) -> tf.Tensor:
    """The network's float32 input from a DeviceBatch (augment_train_batch); anything else
    (an already finished batch) as it is."""
    if isinstance(images, DeviceBatch):
        return augment_train_batch(images.crops, images.flips, images.lighting, mean, std)
    return images


# XLA fuses the flip, cast, lighting, clip and normalisation into one pass over the batch;
# without it every op is its own pass over the float batch (and a broadcast select is slow):
# 7 ms against 195 ms for 64 crops of 224x224 inside tf.data on 2 cores.
@tf.function(jit_compile=True)
def augment_train_batch(crops: tf.Tensor, flips: tf.Tensor, lighting: tf.Tensor,
                        mean: Sequence[float], std: Sequence[float]) -> tf.Tensor:
    """A batch of uint8 training crops [N, h, w, C] -> the network's float32 input: each row
    mirrored where `flips` says, PCA lighting noise `lighting` [N, 3] added (RGB only),
    clipped to 0..255, normalized; one fused computation for the whole batch.

    Lighting, clipping and normalisation as one multiply-add and one clip: normalising is
    increasing, so clip(x + light, 0, 255) normalised is x / std + (light - mean) / std
    clipped to each channel's normalised 0 and 255 (two passes over the batch's floats
    fewer than adding, clipping, subtracting and dividing in turn; the input pipeline's
    float work per image is most of what is not decoding)."""
    mirrored = tf.where(flips[:, None, None, None], tf.reverse(crops, axis=[2]), crops)
    pixels = tf.cast(mirrored, tf.float32)
    mean = tf.constant(mean, tf.float32)
    scale = 1.0 / tf.constant(std, tf.float32)
    if crops.shape[-1] != 3:
        return pixels * scale - mean * scale
    rgb = tf.linalg.matvec(tf.constant(IMAGENET_EIGVEC),
                           lighting * tf.constant(IMAGENET_EIGVAL))  # [N, 3]
    offset = (255.0 * rgb - mean) * scale  # [N, 3]
    return tf.clip_by_value(pixels * scale + offset[:, None, None, :], -mean * scale,
                            (255.0 - mean) * scale)
