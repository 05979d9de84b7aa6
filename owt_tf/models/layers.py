"""Keras layers the model definitions need that Keras does not ship, and which of a model's
variables are BatchNormalization's moving statistics."""
from __future__ import annotations

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="owt_tf")
class CrossMapNorm(keras.layers.Layer):
    """AlexNet's local response normalization across channels: a / (k + alpha*sum a^2)^beta.

    Constants from Krizhevsky et al. 2012 (k=2, n=5, alpha=1e-4, beta=0.75); TF's lrn takes
    the half-width n//2 and applies alpha to the plain sum, as in the 2012 formula.
    """

    def __init__(self, size: int = 5, k: float = 2.0, alpha: float = 1e-4, beta: float = 0.75, **kw):
        super().__init__(**kw)
        self.size, self.k, self.alpha, self.beta = size, k, alpha, beta

    def call(self, x):
        # In float32 whatever the compute dtype: TF's LRN kernels are float32 only on GPU and
        # float32/float16 on CPU (no bfloat16).
        y = tf.nn.local_response_normalization(
            tf.cast(x, tf.float32), depth_radius=self.size // 2, bias=self.k, alpha=self.alpha,
            beta=self.beta)
        return tf.cast(y, x.dtype)

    def get_config(self):
        return {**super().get_config(), "size": self.size, "k": self.k,
                "alpha": self.alpha, "beta": self.beta}


# The names Keras gives BatchNormalization's moving statistics (layers.BatchNormalization.build).
MOVING_STATISTICS = ("moving_mean", "moving_variance")


def moving_statistics(model: keras.Model) -> list:
    """The model's BatchNormalization moving means and variances, at any depth of nesting."""
    return [v for v in model.non_trainable_variables if v.name in MOVING_STATISTICS]
