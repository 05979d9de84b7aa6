"""Margin softmax losses of face recognition: the combined margin of the ArcFace paper,
`s * (cos(m1*theta_y + m2) - m3)` at the label's column and `s * cos(theta_j)` elsewhere,
then softmax cross-entropy; `ArcFace` (m2) and `CosFace` (m3) are its presets.

Input: the cosines of a NormalizedDense head (owt_tf.layers), [N, C]; labels [N] or [N, 1].
Cosines are clamped to [-1, 1] first (rounding can put a normalised product just outside).

The margin is written so that it can be applied to a shard of the class columns: `logits`
takes labels relative to the shard and leaves rows whose label lies outside [0, C) (another
shard's class, or -1) without margin. A distributed softmax then only needs these logits.

Gradient. The exact derivative of cos(m1*theta + m2) with respect to cos(theta) is
m1 * sin(m1*theta + m2) / sin(theta): unbounded as theta -> 0 (cos -> 1) whenever m2 > 0
or m1 != 1, and at cos = +-1 exactly acos itself has an infinite derivative, so a sample
that fits its class perfectly would produce inf / NaN. InsightFace's arcface_torch computes
arccos and cos under `torch.no_grad()`: the margin acts as a constant shift of the target
logit. We do the same with `c + stop_gradient(margin(c) - c)`: the forward value is the
margin logit, and the gradient with respect to the label's cosine is `s`, as in a plain
normalised softmax (so d loss / d cos_j = s * (softmax_j - onehot_j) for every column,
with softmax taken of the margin logits). The margin still shapes training through the
softmax probabilities, which are computed from the margin logits.

Inter-class filtering (Partial FC v2's `interclass_filtering_threshold`, for noisy
identities in web-scale sets): with a threshold t > 0, a non-target cosine above t is set to
0 for that row (as arcface_torch multiplies it by a mask computed without gradient), so a
class that looks like the row's own identity (a duplicate identity, a mislabelled image)
is not pushed away. It is applied before the margin, to the cosines the softmax sees.

InsightFace's older ArcFace replaced the target by `cos(theta) - m*sin(m)` once
theta > pi - m (keeping the target monotonic in theta). Today's arcface_torch has no such
fallback and neither does this module.
"""
from __future__ import annotations

import math
from typing import Any, Dict

import keras
from keras import ops

from owt_tf.models.face import DEFAULT_MARGINS, MARGIN_RANGES


def _check_in_range(name: str, value: float, low: float, high: float, hint: str,
                    low_inclusive: bool = True) -> None:
    """One-line ValueError unless low <= value < high (low < value if not low_inclusive)."""
    above_low = value >= low if low_inclusive else value > low
    if not (above_low and value < high):  # NaN fails both
        bounds = f"{'[' if low_inclusive else '('}{low:g}, {high:g})"
        raise ValueError(f"{name} must be in {bounds} (got {value}); {hint}")


def _check_margins(scale: float, m1: float, m2: float, m3: float) -> None:
    _check_in_range("scale", scale, 0, math.inf, "pass e.g. scale=64.0", low_inclusive=False)
    _check_in_range("m1 (multiplicative angular margin)", m1, 0, math.inf,
                    "pass m1=1.0 for none", low_inclusive=False)
    _check_in_range("m2 (additive angular margin, radians)", m2, *MARGIN_RANGES["arcface"],
                    f"ArcFace uses {DEFAULT_MARGINS['arcface']}")
    _check_in_range("m3 (additive cosine margin)", m3, *MARGIN_RANGES["cosface"],
                    f"CosFace uses {DEFAULT_MARGINS['cosface']}")


@keras.saving.register_keras_serializable(package="owt_tf")
class MarginSoftmax(keras.losses.Loss):
    """Softmax cross-entropy of margin logits; per-example losses reduced by `reduction`.

    Args:
        scale: s, the logit scale (the radius of the hypersphere).
        m1: multiplicative angular margin (SphereFace); 1 means none.
        m2: additive angular margin in radians (ArcFace).
        m3: additive cosine margin (CosFace).
        interclass_filtering_threshold: t in [0, 1); 0 (default) filters nothing; else a
            non-target cosine above t counts as 0 (Partial FC v2).

    y_true: integer class ids, [N] or [N, 1], any numeric dtype. Keras' Loss converts y_true
    to float32 before `call`, which is exact for ids below 2^24 (16.7M classes); beyond that
    call `logits` directly with integer labels.
    y_pred: cosines [N, C]. Computes in float32 (Keras' floatx) under a mixed policy.
    """

    def __init__(self, scale: float = 64.0, m1: float = 1.0, m2: float = 0.0,
                 m3: float = 0.0, reduction: str = "sum_over_batch_size",
                 name: str = "margin_softmax",
                 interclass_filtering_threshold: float = 0.0) -> None:
        _check_margins(scale, m1, m2, m3)
        _check_in_range("interclass_filtering_threshold", interclass_filtering_threshold, 0, 1,
                        "0 filters nothing; arcface_torch's WebFace configs use 0.4")
        super().__init__(name=name, reduction=reduction)
        self.scale, self.m1, self.m2, self.m3 = float(scale), float(m1), float(m2), float(m3)
        self.interclass_filtering_threshold = float(interclass_filtering_threshold)

    def margin_cosine(self, cos_y: Any) -> Any:
        """cos(m1 * acos(c) + m2) - m3, the label's cosine after the margin (forward value
        only: `target_logit` keeps its gradient out of backprop)."""
        if self.m1 == 1.0 and self.m2 == 0.0:  # CosFace: c - m3 exactly, no acos round trip
            return cos_y - self.m3
        return ops.cos(self.m1 * ops.arccos(cos_y) + self.m2) - self.m3

    def target_logit(self, cos_y: Any) -> Any:
        """s * (cos(m1*acos(c) + m2) - m3) elementwise for the label's cosine `cos_y`
        (clamped to [-1, 1]), with the gradient of `s * c` (see the module docstring)."""
        c = ops.clip(cos_y, -1.0, 1.0)
        return self.scale * (c + ops.stop_gradient(self.margin_cosine(c) - c))

    def logits(self, cosines: Any, labels: Any) -> Any:
        """s * cos for all columns of `cosines` [N, C], with the margin at each row's label
        column. `labels` [N] index the columns of *this* tensor: a row whose label is
        outside [0, C) (-1, or a class on another shard) gets no margin."""
        cos = ops.clip(cosines, -1.0, 1.0)
        labels = ops.cast(ops.reshape(labels, (-1,)), "int32")
        num_columns = ops.shape(cos)[-1]
        on_this_tensor = ops.logical_and(labels >= 0, labels < num_columns)
        gather_at = ops.where(on_this_tensor, labels, ops.zeros_like(labels))
        cos_y = ops.take_along_axis(cos, ops.expand_dims(gather_at, -1), axis=-1)
        is_target = ops.equal(ops.expand_dims(labels, -1),
                              ops.expand_dims(ops.arange(num_columns, dtype="int32"), 0))
        if self.interclass_filtering_threshold > 0:
            dirty = ops.logical_and(cos > self.interclass_filtering_threshold,
                                    ops.logical_not(is_target))
            cos = ops.where(dirty, ops.zeros_like(cos), cos)
        return ops.where(is_target, self.target_logit(cos_y), self.scale * cos)

    def call(self, y_true, y_pred):
        labels = ops.cast(ops.reshape(y_true, (-1,)), "int32")
        return ops.sparse_categorical_crossentropy(
            labels, self.logits(y_pred, labels), from_logits=True)

    def get_config(self) -> Dict[str, Any]:
        return {"scale": self.scale, "m1": self.m1, "m2": self.m2, "m3": self.m3,
                "reduction": self.reduction, "name": self.name,
                "interclass_filtering_threshold": self.interclass_filtering_threshold}


@keras.saving.register_keras_serializable(package="owt_tf")
class ArcFace(MarginSoftmax):
    """Additive angular margin: s * cos(theta_y + margin) at the label (Deng et al. 2019)."""

    def __init__(self, scale: float = 64.0, margin: float = DEFAULT_MARGINS["arcface"],
                 reduction: str = "sum_over_batch_size", name: str = "arcface",
                 interclass_filtering_threshold: float = 0.0) -> None:
        _check_in_range("margin (radians)", margin, *MARGIN_RANGES["arcface"],
                        f"ArcFace uses {DEFAULT_MARGINS['arcface']}")
        super().__init__(scale=scale, m2=margin, reduction=reduction, name=name,
                         interclass_filtering_threshold=interclass_filtering_threshold)
        self.margin = float(margin)

    def get_config(self) -> Dict[str, Any]:
        return {"scale": self.scale, "margin": self.margin, "reduction": self.reduction,
                "name": self.name,
                "interclass_filtering_threshold": self.interclass_filtering_threshold}


@keras.saving.register_keras_serializable(package="owt_tf")
class CosFace(MarginSoftmax):
    """Additive cosine margin: s * (cos(theta_y) - margin) at the label (Wang et al. 2018).
    The paper's margin is 0.35; arcface_torch's configs use 0.4."""

    def __init__(self, scale: float = 64.0, margin: float = DEFAULT_MARGINS["cosface"],
                 reduction: str = "sum_over_batch_size", name: str = "cosface",
                 interclass_filtering_threshold: float = 0.0) -> None:
        _check_in_range("margin", margin, *MARGIN_RANGES["cosface"],
                        f"CosFace uses {DEFAULT_MARGINS['cosface']}")
        super().__init__(scale=scale, m3=margin, reduction=reduction, name=name,
                         interclass_filtering_threshold=interclass_filtering_threshold)
        self.margin = float(margin)

    def get_config(self) -> Dict[str, Any]:
        return {"scale": self.scale, "margin": self.margin, "reduction": self.reduction,
                "name": self.name,
                "interclass_filtering_threshold": self.interclass_filtering_threshold}
