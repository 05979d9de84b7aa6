"""Model definitions only: Keras conv trunks plus head specs. No parallelism here.

Importing this package does not import TensorFlow: a spec is data, and Keras loads when a
trunk is built (the CLI validates --model and FC widths before anything heavy loads).
"""
from __future__ import annotations

from owt_tf.models.alexnet import alexnet, alexnet_tiny
from owt_tf.models.face import face_tiny, iresnet18, iresnet50, iresnet100, mobilefacenet
from owt_tf.models.registry import MODEL_NAMES, build_model
from owt_tf.models.vgg import vgg16, vgg_tiny
from owt_tf.models.spec import (HeadSpec, ModelSpec, fc_param_count, initial_head_weights,
                                initial_trunk_weights)


def __getattr__(name):
    if name == "CrossMapNorm":  # a Keras layer: importing it imports TensorFlow
        from owt_tf.models.layers import CrossMapNorm

        return CrossMapNorm
    if name == "ChannelPReLU":
        from owt_tf.models.face_layers import ChannelPReLU

        return ChannelPReLU
    raise AttributeError(name)


__all__ = ["MODEL_NAMES", "build_model", "alexnet", "alexnet_tiny", "vgg16", "vgg_tiny", "iresnet18",
           "iresnet50", "iresnet100", "mobilefacenet", "face_tiny", "HeadSpec", "ModelSpec",
           "fc_param_count", "initial_head_weights", "initial_trunk_weights", "CrossMapNorm",
           "ChannelPReLU"]
