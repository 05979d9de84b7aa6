"""VGG-16 (Simonyan & Zisserman 2014, configuration D) and `vgg_tiny`, its shape for a 2-core CPU.

A second network through the same engine: 13 3x3 conv layers in five blocks, each block
ending in a 2x2 max-pool, then FC 4096, 4096 and the logits. FC holds ~90 % of VGG-16's
138 M parameters, even more lopsided than AlexNet: the case the paper's trick is for.
"""
from __future__ import annotations

from typing import Sequence

from owt_tf.models.spec import HeadSpec, ModelSpec

# Keras loads only when a trunk is built, as in alexnet.py.
VGG16_BLOCKS = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))
VGG_TINY_BLOCKS = ((16, 16), (32, 32), (64, 64, 64), (64, 64, 64), (64, 64, 64))


def _trunk(name: str, input_shape, blocks: Sequence[Sequence[int]]):
    import keras

    layers = [keras.Input(input_shape, name="images")]
    for b, widths in enumerate(blocks, start=1):
        for i, filters in enumerate(widths, start=1):
            layers.append(keras.layers.Conv2D(filters, 3, padding="same", activation="relu",
                                              name=f"conv{b}_{i}"))
        layers.append(keras.layers.MaxPooling2D(2, strides=2, name=f"pool{b}"))
    layers.append(keras.layers.Flatten(name="flatten"))
    return keras.Sequential(layers, name=name)


def _vgg_family(name: str, side: int, blocks, fc_width: int, num_classes: int,
                dropout: float) -> ModelSpec:
    shape = (side, side, 3)
    return ModelSpec(name=name, input_shape=shape,
                     build_trunk=lambda: _trunk(f"{name}_trunk", shape, blocks),
                     head=HeadSpec(hidden=(fc_width, fc_width), num_classes=num_classes,
                                   dropout=dropout))


def vgg16(num_classes: int = 1000, dropout: float = 0.5, image_size: int = 224) -> ModelSpec:
    """224x224x3 -> five blocks (64, 128, 256, 512, 512 filters) -> 7*7*512 = 25088 features
    -> fc6, fc7 (4096) -> logits. 14.7 M conv and 123.6 M FC parameters at 1000 classes."""
    return _vgg_family("vgg16", image_size, VGG16_BLOCKS, 4096, num_classes, dropout)


def vgg_tiny(num_classes: int = 10, dropout: float = 0.5, image_size: int = 32) -> ModelSpec:
    """VGG-16's 13 conv layers with 16-64 filters on 32x32x3: 32 -> 16 -> 8 -> 4 -> 2 -> 1,
    so 64 features into FC 256, 256 and the logits."""
    return _vgg_family("vgg_tiny", image_size, VGG_TINY_BLOCKS, 256, num_classes, dropout)
