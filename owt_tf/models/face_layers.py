"""Keras layers the face trunks (owt_tf.models.face) need that Keras does not ship in the
form they need. Importing this module imports Keras; owt_tf.models.face imports it only
when a trunk is built."""
from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="owt_tf")
class ChannelPReLU(keras.layers.Layer):
    """PReLU with one slope per channel (PyTorch's nn.PReLU(C)): max(x, 0) + a * min(x, 0).

    Keras' PReLU with shared_axes keeps its slopes as a [1, 1, C] weight, which owt_tf's
    seeded initialisation (initial_trunk_weights) would redraw as a Glorot kernel; a [C]
    weight keeps its initial value, PyTorch's 0.25."""

    def __init__(self, initial_slope: float = 0.25, **kw):
        super().__init__(**kw)
        self.initial_slope = initial_slope

    def build(self, input_shape):
        self.alpha = self.add_weight(shape=(int(input_shape[-1]),), name="alpha",
                                     initializer=keras.initializers.Constant(self.initial_slope))

    def call(self, x):
        alpha = ops.cast(self.alpha, x.dtype)
        return ops.maximum(x, 0) + alpha * ops.minimum(x, 0)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "initial_slope": self.initial_slope}


@keras.saving.register_keras_serializable(package="owt_tf")
class GroupedConv2D(keras.layers.Conv2D):
    """Conv2D with `groups` > 1 computed as a depthwise conv (one output per input channel
    and output of its group) summed over each group's inputs: the same kernel, parameters,
    multiply-adds and result as Conv2D(groups=...), whose gradient TensorFlow computes on
    CPU ~400x slower (8.8 s against 0.02 s for a 3x3 conv of 128 channels in 64 groups on a
    batch of 2 at 56x56). groups = channels is a depthwise conv with a Conv2D's kernel
    (kh, kw, 1, C), so that the cost model counts it as the Conv2D it is."""

    def convolution_op(self, inputs, kernel):
        if self.groups == 1:
            return super().convolution_op(inputs, kernel)
        kh, kw, in_per_group, channels = kernel.shape
        out_per_group = channels // self.groups
        # (kh, kw, in/g, g*out/g) -> depthwise (kh, kw, g*in/g, out/g): input channel
        # g*in/g + j feeds its group's outputs m = 0 .. out/g - 1.
        depthwise = ops.reshape(kernel, (kh, kw, in_per_group, self.groups, out_per_group))
        depthwise = ops.reshape(ops.transpose(depthwise, (0, 1, 3, 2, 4)),
                                (kh, kw, self.groups * in_per_group, out_per_group))
        y = ops.depthwise_conv(inputs, depthwise, strides=self.strides, padding=self.padding,
                               data_format=self.data_format, dilation_rate=self.dilation_rate)
        if in_per_group == 1:
            return y
        batch, height, width = ops.shape(y)[0], ops.shape(y)[1], ops.shape(y)[2]
        y = ops.reshape(y, (batch, height, width, self.groups, in_per_group, out_per_group))
        return ops.reshape(ops.sum(y, axis=4), (batch, height, width, channels))
