"""The export contract every owt_tf SavedModel keeps, whichever front door wrote it (the
CLI's `owt_tf.export` / `--export-dir`, or `parallelize(model).export`).

- Input: `images`, uint8 [N, H, W, C], the decoded pixels. The model's own normalisation
  happens inside the signature, so a client never has to know a mean and std (the CLI's
  export applies its dataset's; a Keras model carries its own as layers, e.g.
  `keras.layers.Rescaling(1 / 127.5, offset=-1)`, and is fed the pixel values as floats).
- `serving_default` (a classifier): `probabilities` float32 [N, classes] (a cosine class
  layer's: the softmax of its margin loss's scale times the cosines), `top5` int64 [N, 5]
  and `top5_names` string [N, 5].
- `embeddings` (a model whose class layer is cosine: a face model): `embeddings` float32
  [N, D], L2-normalised, and `features` float32 [N, D], the same before normalising (the
  backbone's outputs, which InsightFace's verification sums for an image and its mirror).
  With `embeddings_only` it is also `serving_default` and the class layer is left out.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import keras
import tensorflow as tf
from keras import ops

from owt_tf.layers import l2_normalize

EXPORT_SIGNATURE = "serving_default"
EMBEDDINGS_SIGNATURE = "embeddings"
IMAGES = "images"


def images_spec(channels: int, height: Optional[int] = None,
                width: Optional[int] = None) -> tf.TensorSpec:
    """The signatures' one input: uint8 [N, H, W, C] named `images`."""
    return tf.TensorSpec([None, height, width, channels], tf.uint8, name=IMAGES)


def embedding_outputs(features: Any) -> Dict[str, Any]:
    """The embedding rule every export and prediction shares: `features`, the trunk's
    output (the cosine class layer's input) in float32 whatever the compute precision, and
    `embeddings`, the same L2-normalised."""
    features = ops.cast(features, "float32")
    return {"embeddings": l2_normalize(features, axis=-1), "features": features}


def class_outputs(logits: tf.Tensor, label_names: Sequence[str],
                  logit_scale: float = 1.0) -> Dict[str, tf.Tensor]:
    """`serving_default`'s outputs from the class layer's logits (a cosine layer's cosines
    scaled by `logit_scale`, its margin loss's s: the logits without the margin)."""
    probabilities = tf.nn.softmax(logit_scale * tf.cast(logits, tf.float32))
    top5 = tf.math.top_k(probabilities, k=min(5, len(label_names))).indices
    return {"probabilities": probabilities, "top5": tf.cast(top5, tf.int64),
            "top5_names": tf.gather(tf.constant(list(label_names)), top5)}


def keras_pixels(model: keras.Model, images: tf.Tensor) -> tf.Tensor:
    """uint8 `images` as a Keras model's input takes them: the pixel values in its input
    dtype (its normalisation is its own layers)."""
    return tf.cast(images, model.inputs[0].dtype)
