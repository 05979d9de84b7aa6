"""Model definitions only: Keras conv trunks plus head specs. No parallelism here."""
from __future__ import annotations

from typing import Callable, Dict

from owt_tf.models.alexnet import CrossMapNorm, alexnet, alexnet_tiny
from owt_tf.models.spec import (HeadSpec, ModelSpec, fc_param_count, initial_head_weights,
                                initial_trunk_weights)

MODELS: Dict[str, Callable[..., ModelSpec]] = {
    "alexnet": alexnet,
    "alexnet_tiny": alexnet_tiny,
}
MODEL_NAMES = tuple(MODELS)


def build_model(name: str, num_classes: int, dropout: float = 0.5) -> ModelSpec:
    """The ModelSpec registered under `name`."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    return MODELS[name](num_classes=num_classes, dropout=dropout)


__all__ = ["MODELS", "MODEL_NAMES", "build_model", "HeadSpec", "ModelSpec", "CrossMapNorm",
           "alexnet", "alexnet_tiny", "fc_param_count", "initial_head_weights",
           "initial_trunk_weights"]
