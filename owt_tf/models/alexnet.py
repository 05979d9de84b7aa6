"""The paper's one-tower AlexNet and `alexnet_tiny`, the same shape sized for a 2-core CPU.

Only the convolutional trunk is a Keras model; the FC layers are a HeadSpec because the
parallelism plan (owt_tf.parallel) splits them over devices.
"""
from __future__ import annotations

from owt_tf.models.spec import HeadSpec, ModelSpec

# Keras loads only when a trunk is built: a spec (and the CLI's checks) needs no TensorFlow.


def _trunk(name, input_shape, filters, first_kernel, first_stride, first_pad, norm):
    """conv1..conv5 with norm+pool after conv1 and conv2 and pool after conv5, then flatten."""
    import keras

    from owt_tf.models.layers import CrossMapNorm

    def conv(filters, size, name, stride=1, padding="same"):
        return keras.layers.Conv2D(filters, size, strides=stride, padding=padding,
                                   activation="relu", name=name)

    def pool(name):
        return keras.layers.MaxPooling2D(pool_size=3, strides=2, name=name)

    f1, f2, f3, f4, f5 = filters
    layers = [keras.Input(input_shape, name="images")]
    if first_pad:
        layers.append(keras.layers.ZeroPadding2D(first_pad, name="conv1_pad"))
    layers.append(conv(f1, first_kernel, "conv1", first_stride, "valid" if first_pad else "same"))
    if norm:
        layers.append(CrossMapNorm(name="norm1"))
    layers += [pool("pool1"), conv(f2, 5, "conv2")]
    if norm:
        layers.append(CrossMapNorm(name="norm2"))
    layers += [pool("pool2"), conv(f3, 3, "conv3"), conv(f4, 3, "conv4"), conv(f5, 3, "conv5"),
               pool("pool5"), keras.layers.Flatten(name="flatten")]
    return keras.Sequential(layers, name=name)


def _alexnet_family(name: str, side: int, filters, conv1: tuple, fc_width: int,
                    num_classes: int, dropout: float, response_norm: bool) -> ModelSpec:
    """An AlexNet-shaped spec: `conv1` is (kernel, stride, padding) of the first conv."""
    shape = (side, side, 3)
    kernel, stride, pad = conv1
    return ModelSpec(
        name=name,
        input_shape=shape,
        build_trunk=lambda: _trunk(f"{name}_trunk", shape, filters, kernel, stride, pad,
                                   response_norm),
        head=HeadSpec(hidden=(fc_width, fc_width), num_classes=num_classes, dropout=dropout),
    )


def alexnet(num_classes: int = 1000, dropout: float = 0.5, response_norm: bool = True,
            image_size: int = 224) -> ModelSpec:
    """One-tower AlexNet (the paper's (docs/paper.md) table; conv4 has 256 filters as in cuda-convnet2).

    224x224x3 -> conv1 11x11/4 pad 2 (55) -> pool (27) -> conv2 (27) -> pool (13) ->
    conv3..5 (13) -> pool (6): 6*6*256 = 9216 features into fc6, fc7 (4096) and fc8.
    """
    return _alexnet_family("alexnet", image_size, (64, 192, 384, 256, 256), (11, 4, 2), 4096,
                           num_classes, dropout, response_norm)


def alexnet_tiny(num_classes: int = 10, dropout: float = 0.5, response_norm: bool = True,
                 image_size: int = 32) -> ModelSpec:
    """AlexNet's shape for a 2-core CPU: 32x32x3 input, 5 convs (16-48 filters), FC 256, 256.

    32 -> conv1 5x5 (32) -> pool (15) -> conv2 (15) -> pool (7) -> conv3..5 (7) -> pool (3):
    3*3*32 = 288 features into the head.
    """
    return _alexnet_family("alexnet_tiny", image_size, (16, 32, 48, 32, 32), (5, 1, 0), 256,
                           num_classes, dropout, response_norm)
