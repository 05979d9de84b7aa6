"""The face-recognition head: `NormalizedDense`, whose outputs are the cosines between the
embedding and every class centre, and `embedding_model`, the part of a Keras model that
feeds it (the embedding that face verification compares).

The margin losses that turn these cosines into logits live in owt_tf.losses.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import keras
from keras import ops

# Floor of the squared L2 norm in `l2_normalize` (a norm floor of 1e-6), as
# tf.math.l2_normalize's default: an all-zero row maps to zeros with a finite gradient
# instead of 0/0, and any row of norm >= 1e-6 is normalised exactly.
NORM_EPSILON = 1e-12


def l2_normalize(x: Any, axis: int = -1) -> Any:
    """`x / max(||x||, 1e-6)` along `axis`.

    The floor is applied to the squared norm before rsqrt, so the gradient stays finite at a
    zero row (Keras' ops.normalize clamps after rsqrt: inf * 0 there)."""
    square_sum = ops.sum(ops.square(x), axis=axis, keepdims=True)
    return x * ops.rsqrt(ops.maximum(square_sum, NORM_EPSILON))


def _full_precision_dtype() -> str:
    """The global policy's variable dtype: float32 under mixed_float16 / mixed_bfloat16."""
    return keras.config.dtype_policy().variable_dtype


@keras.saving.register_keras_serializable(package="owt_tf")
class NormalizedDense(keras.layers.Layer):
    """Cosine logits: L2-normalised input rows times L2-normalised kernel columns.

    `kernel` is [in, units] (one class centre per column), with no bias. Outputs lie in
    [-1, 1]; a margin loss (owt_tf.losses) scales them into logits.

    Precision: without an explicit `dtype` the layer takes the global policy's *variable*
    dtype as its whole policy, so under `mixed_float16` / `mixed_bfloat16` it computes in
    float32 (Keras casts its inputs to float32 on the way in, the usual "last layer in
    float32" of Keras' mixed-precision guide). With s = 64 a half-precision cosine would
    step by 64 * 2^-11 = 0.03 near 1 (float16) and the logits would lose the margin.
    An explicit `dtype=` is respected.
    """

    def __init__(self, units: int, kernel_initializer: Any = "glorot_uniform",
                 kernel_regularizer: Any = None, **kwargs: Any) -> None:
        if kwargs.get("dtype") is None:
            kwargs["dtype"] = _full_precision_dtype()
        super().__init__(**kwargs)
        if int(units) != units or units < 1:
            raise ValueError(f"NormalizedDense: units must be a positive integer (got {units!r})")
        self.units = int(units)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.input_spec = keras.layers.InputSpec(min_ndim=2)

    def build(self, input_shape) -> None:
        self.kernel = self.add_weight(
            name="kernel", shape=(input_shape[-1], self.units),
            initializer=self.kernel_initializer, regularizer=self.kernel_regularizer)
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: input_shape[-1]})

    def call(self, inputs: Any) -> Any:
        return ops.matmul(l2_normalize(inputs, axis=-1), l2_normalize(self.kernel, axis=0))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self) -> Dict[str, Any]:
        return {**super().get_config(), "units": self.units,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer)}


def last_normalized_dense(model: keras.Model) -> NormalizedDense:
    """The last NormalizedDense among `model.layers` (top level only)."""
    for layer in reversed(model.layers):
        if isinstance(layer, NormalizedDense):
            return layer
    raise ValueError(f"model {model.name!r} has no NormalizedDense layer at its top level; "
                     "pass an embedding function instead")


def embedding_model(model: keras.Model, head: Optional[NormalizedDense] = None) -> keras.Model:
    """`keras.Model(model.inputs, head.input)`: the embedding that feeds `head` (default: the
    model's last NormalizedDense), sharing the model's layers and weights.

    The embedding is returned as the trunk computes it, not normalised: face verification
    (owt_tf.data.verification) normalises, and its flip test sums an image's and its mirror's
    raw embeddings before normalising, as InsightFace does. The model must be built (a
    functional or Sequential model with known inputs) and `head` called exactly once."""
    head = head if head is not None else last_normalized_dense(model)
    return keras.Model(model.inputs, head.input, name=f"{model.name}_embedding")
