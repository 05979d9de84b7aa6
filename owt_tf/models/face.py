"""Face-recognition trunks at 112x112: IResNet-18/50 and MobileFaceNet as InsightFace's
arcface_torch defines them (recognition/arcface_torch/backbones), and `face_tiny`, a small
IResNet for the synthetic `faces` set and fast tests.

Each trunk maps [N, H, W, 3] normalised images to [N, D] embeddings (`embedding_dim`, 512 by
default) with the embedding block face models end in; the head is a HeadSpec with no
hidden layers, the class layer alone, on the embedding (ArcFace's class centres).

IResNet ("improved" pre-activation ResNet, ArcFace paper): stem conv3x3 64 + BN + PReLU;
four stages of IBasicBlocks (BN - conv3x3 - BN - PReLU - conv3x3 (stride) - BN, plus the
shortcut, a 1x1 conv + BN where the shape changes), each stage's first block halving the
side (112 -> 56 -> 28 -> 14 -> 7); then BN, flatten, dropout, FC to D and a BatchNorm of
the embedding whose scale is fixed at 1 (arcface_torch freezes it; here it has none).

MobileFaceNet (arcface_torch's, scale 2, blocks (1, 4, 6, 2)): conv3x3/2 128, a grouped
conv3x3 (64 groups), then bottlenecks (1x1 expand + PReLU, depthwise 3x3 + PReLU, 1x1
linear projection; residual where the shape stays), conv1x1 512 and the GDC embedding:
a global depthwise 7x7 conv + BN, a bias-free FC to D and a BatchNorm.

As PyTorch pads: a stride-2 3x3 conv pads one pixel on every side (Keras' "same" would pad
only the bottom and right of an even side). BatchNorm as PyTorch's (eps 1e-5, momentum
0.1, i.e. Keras' 0.9). PReLU slopes are per channel (ChannelPReLU), as nn.PReLU(C).
Grouped and depthwise convs are GroupedConv2D (owt_tf.models.face_layers: a Conv2D whose
gradient is fast on CPU).

Keras loads only when a trunk is built, as in alexnet.py.
"""
from __future__ import annotations

import math
from typing import Sequence

from owt_tf.models.spec import HeadSpec, ModelSpec


# The margin objectives face models train with (owt_tf.losses' ArcFace and CosFace, and
# --margin's check, take them from here; no TensorFlow, the flag parser reads them): each
# margin's default and its valid range [low, high). ArcFace's margin is an angle in
# radians; CosFace's is subtracted from the cosine.
DEFAULT_MARGINS = {"arcface": 0.5, "cosface": 0.35}
MARGIN_RANGES = {"arcface": (0.0, math.pi / 2), "cosface": (0.0, 1.0)}

IRESNET_WIDTHS = (64, 128, 256, 512)
IRESNET18_BLOCKS = (2, 2, 2, 2)
IRESNET50_BLOCKS = (3, 4, 14, 3)
IRESNET100_BLOCKS = (3, 13, 30, 3)
FACE_TINY_WIDTHS = (32, 64, 128)
FACE_TINY_BLOCKS = (1, 1, 1)
# MobileFaceNet (scale 2): (output channels, expansion channels, blocks, stride) per stage.
MOBILEFACENET_STAGES = ((128, 128, 1, 2), (128, 128, 4, 1), (256, 256, 1, 2), (256, 256, 6, 1),
                        (256, 512, 1, 2), (256, 256, 2, 1))
BN_EPSILON, BN_MOMENTUM = 1e-5, 0.9


def _layers():
    import keras

    return keras.layers


def _bn(name: str, scale: bool = True):
    return _layers().BatchNormalization(epsilon=BN_EPSILON, momentum=BN_MOMENTUM, scale=scale,
                                        name=name)


def _prelu(name: str):
    from owt_tf.models.face_layers import ChannelPReLU

    return ChannelPReLU(name=name)


def _conv(x, filters: int, kernel: int, stride: int, name: str, groups: int = 1,
          depthwise: bool = False, pad: bool = True):
    """A bias-free conv padded as PyTorch pads it (kernel // 2 on every side when `pad`)."""
    layers = _layers()
    padding = "valid"
    if pad and kernel > 1:
        if stride == 1:
            padding = "same"  # the same as PyTorch's at stride 1 with an odd kernel
        else:
            x = layers.ZeroPadding2D(kernel // 2, name=f"{name}_pad")(x)
    if depthwise or groups > 1:
        from owt_tf.models.face_layers import GroupedConv2D

        groups = int(x.shape[-1]) if depthwise else groups
        return GroupedConv2D(filters, kernel, strides=stride, padding=padding, groups=groups,
                             use_bias=False, name=name)(x)
    return layers.Conv2D(filters, kernel, strides=stride, padding=padding, groups=groups,
                         use_bias=False, name=name)(x)


def _ibasic_block(x, planes: int, stride: int, name: str):
    """BN - conv3x3 - BN - PReLU - conv3x3(stride) - BN, plus the shortcut."""
    shortcut = x
    if stride != 1 or int(x.shape[-1]) != planes:
        shortcut = _bn(f"{name}_down_bn")(_conv(x, planes, 1, stride, f"{name}_down_conv"))
    out = _bn(f"{name}_bn1")(x)
    out = _conv(out, planes, 3, 1, f"{name}_conv1")
    out = _prelu(f"{name}_prelu")(_bn(f"{name}_bn2")(out))
    out = _bn(f"{name}_bn3")(_conv(out, planes, 3, stride, f"{name}_conv2"))
    return _layers().Add(name=f"{name}_add")([out, shortcut])


def iresnet_trunk(name: str, image_size: int, blocks: Sequence[int],
                  widths: Sequence[int] = IRESNET_WIDTHS, stem: int = 64,
                  embedding_dim: int = 512, dropout: float = 0.0):
    """An IResNet trunk: [N, S, S, 3] -> [N, embedding_dim] (module docstring)."""
    import keras

    layers = _layers()
    images = keras.Input((image_size, image_size, 3), name="images")
    x = _prelu("prelu")(_bn("bn1")(_conv(images, stem, 3, 1, "conv1")))
    for stage, (planes, count) in enumerate(zip(widths, blocks), start=1):
        for b in range(count):
            x = _ibasic_block(x, planes, 2 if b == 0 else 1, f"layer{stage}_{b}")
    x = layers.Flatten(name="flatten")(_bn("bn2")(x))
    x = layers.Dropout(dropout, name="dropout")(x)
    x = layers.Dense(embedding_dim, name="fc")(x)
    embedding = _bn("features", scale=False)(x)
    return keras.Model(images, embedding, name=name)


def _conv_block(x, filters: int, kernel: int, stride: int, name: str, groups: int = 1,
                depthwise: bool = False, linear: bool = False, pad: bool = True):
    """conv - BN (- PReLU unless `linear`): arcface_torch's ConvBlock / LinearBlock."""
    x = _bn(f"{name}_bn")(_conv(x, filters, kernel, stride, f"{name}_conv", groups, depthwise, pad))
    return x if linear else _prelu(f"{name}_prelu")(x)


def _bottleneck(x, out: int, expansion: int, stride: int, name: str):
    """1x1 to `expansion` - depthwise 3x3 (stride) - linear 1x1 to `out`; residual when
    the shape stays (arcface_torch's DepthWise)."""
    y = _conv_block(x, expansion, 1, 1, f"{name}_expand")
    y = _conv_block(y, expansion, 3, stride, f"{name}_dw", depthwise=True)
    y = _conv_block(y, out, 1, 1, f"{name}_project", linear=True)
    if stride == 1 and int(x.shape[-1]) == out:
        return _layers().Add(name=f"{name}_add")([x, y])
    return y


def mobilefacenet_trunk(name: str, image_size: int, embedding_dim: int = 512,
                        dropout: float = 0.0):
    """arcface_torch's MobileFaceNet ('mbf'): [N, S, S, 3] -> [N, embedding_dim]. Dropout
    (none in theirs) is applied before the embedding FC when `dropout` > 0."""
    import keras

    layers = _layers()
    images = keras.Input((image_size, image_size, 3), name="images")
    x = _conv_block(images, 128, 3, 2, "conv1")
    x = _conv_block(x, 128, 3, 1, "conv2", groups=64)
    for stage, (out, expansion, count, stride) in enumerate(MOBILEFACENET_STAGES, start=1):
        for b in range(count):
            x = _bottleneck(x, out, expansion, stride if b == 0 else 1, f"stage{stage}_{b}")
    x = _conv_block(x, 512, 1, 1, "conv_sep")
    side = int(x.shape[1])  # 7 at 112x112: the global depthwise conv spans the whole map
    x = _conv_block(x, 512, side, 1, "gdc", depthwise=True, linear=True, pad=False)
    x = layers.Flatten(name="flatten")(x)
    if dropout:
        x = layers.Dropout(dropout, name="dropout")(x)
    x = layers.Dense(embedding_dim, use_bias=False, name="fc")(x)
    embedding = _bn("features")(x)
    return keras.Model(images, embedding, name=name)


def _face_spec(name: str, image_size: int, build, num_classes: int) -> ModelSpec:
    return ModelSpec(name=name, input_shape=(image_size, image_size, 3), build_trunk=build,
                     head=HeadSpec(hidden=(), num_classes=num_classes))


def _checked(image_size: int, multiple: int, name: str) -> int:
    if image_size % multiple:
        raise ValueError(f"{name}: image_size {image_size} is not a multiple of {multiple}")
    return image_size


def iresnet18(num_classes: int = 1000, dropout: float = 0.0, image_size: int = 112,
              embedding_dim: int = 512) -> ModelSpec:
    """IResNet-18, arcface_torch's r18: stages of (2, 2, 2, 2) blocks, 24.0 M parameters
    and 2.6 G multiply-adds at 112x112 and D=512 (tests/test_face_models.py)."""
    size = _checked(image_size, 16, "iresnet18")
    return _face_spec("iresnet18", size, lambda: iresnet_trunk(
        "iresnet18_trunk", size, IRESNET18_BLOCKS, embedding_dim=embedding_dim,
        dropout=dropout), num_classes)


def iresnet50(num_classes: int = 1000, dropout: float = 0.0, image_size: int = 112,
              embedding_dim: int = 512) -> ModelSpec:
    """IResNet-50, arcface_torch's r50: stages of (3, 4, 14, 3) blocks, 43.6 M parameters
    and 6.3 G multiply-adds at 112x112 and D=512."""
    size = _checked(image_size, 16, "iresnet50")
    return _face_spec("iresnet50", size, lambda: iresnet_trunk(
        "iresnet50_trunk", size, IRESNET50_BLOCKS, embedding_dim=embedding_dim,
        dropout=dropout), num_classes)


def iresnet100(num_classes: int = 1000, dropout: float = 0.0, image_size: int = 112,
               embedding_dim: int = 512) -> ModelSpec:
    """IResNet-100, arcface_torch's r100: stages of (3, 13, 30, 3) blocks, 65.2 M
    parameters and 12.1 G multiply-adds at 112x112 and D=512."""
    size = _checked(image_size, 16, "iresnet100")
    return _face_spec("iresnet100", size, lambda: iresnet_trunk(
        "iresnet100_trunk", size, IRESNET100_BLOCKS, embedding_dim=embedding_dim,
        dropout=dropout), num_classes)


def mobilefacenet(num_classes: int = 1000, dropout: float = 0.0, image_size: int = 112,
                  embedding_dim: int = 512) -> ModelSpec:
    """arcface_torch's MobileFaceNet ('mbf', "mobilefacenet-0.45G"): 2.0 M parameters and
    0.45 G multiply-adds at 112x112 and D=512."""
    size = _checked(image_size, 16, "mobilefacenet")
    return _face_spec("mobilefacenet", size, lambda: mobilefacenet_trunk(
        "mobilefacenet_trunk", size, embedding_dim=embedding_dim, dropout=dropout), num_classes)


def face_tiny(num_classes: int = 500, dropout: float = 0.0, image_size: int = 32,
              embedding_dim: int = 64) -> ModelSpec:
    """A small IResNet for a 2-core CPU: stem conv3x3 16, one IBasicBlock per stage of 32,
    64 and 128 channels (32 -> 16 -> 8 -> 4), the IResNet embedding block to D=64:
    0.4 M parameters at 32x32 (56x56 works too: 7x7 before the FC)."""
    size = _checked(image_size, 8, "face_tiny")
    return _face_spec("face_tiny", size, lambda: iresnet_trunk(
        "face_tiny_trunk", size, FACE_TINY_BLOCKS, FACE_TINY_WIDTHS, stem=16,
        embedding_dim=embedding_dim, dropout=dropout), num_classes)

