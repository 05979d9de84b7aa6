"""What a model is to owt_tf: a Keras conv trunk plus a spec of the FC head.

The engine never looks inside the trunk; it only needs its output width. The head is
described, not built, because the parallelism plan decides how its layers are split.
Initial weights come from here and depend on the seed only, never on K or the scheme.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import numpy as np

if TYPE_CHECKING:
    import keras


HIDDEN_ACTIVATIONS = ("relu", "linear")
OUTPUT_ACTIVATIONS = ("linear", "softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """The fully connected layers after the trunk: hidden layers (each with its activation and
    the dropout rate after it), then the class layer.

    `activations` / `dropouts` give one entry per hidden layer; left empty, every hidden layer
    is ReLU followed by dropout at `dropout` (the registry models). `output_activation` is
    'linear' (the model outputs logits), 'softmax' (class probabilities) or 'sigmoid'
    (a binary or multi-label head: one probability per unit); the engine always
    computes logits and applies it where the output is used.
    """

    hidden: Tuple[int, ...]
    num_classes: int
    dropout: float = 0.5
    activations: Tuple[str, ...] = ()
    dropouts: Tuple[float, ...] = ()
    output_activation: str = "linear"
    names: Tuple[str, ...] = ()  # the FC layers' names (a user's model), for messages
    # The class layer is a cosine layer (owt_tf.layers.NormalizedDense): L2-normalised rows
    # times L2-normalised kernel columns, no bias; the model outputs the cosines.
    cosine: bool = False

    def __post_init__(self):
        n = len(self.hidden)
        for field, values in (("activations", self.activations), ("dropouts", self.dropouts)):
            if values and len(values) != n:
                raise ValueError(f"HeadSpec.{field} needs one entry per hidden layer ({n}), "
                                 f"got {len(values)}")
        for a in self.activations:
            if a not in HIDDEN_ACTIVATIONS:
                raise ValueError(f"hidden FC activation {a!r} is not supported "
                                 f"(one of {', '.join(HIDDEN_ACTIVATIONS)})")
        if self.cosine and self.output_activation != "linear":
            raise ValueError("a cosine class layer outputs its cosines: output_activation "
                             f"must be 'linear', got {self.output_activation!r}")
        if self.output_activation not in OUTPUT_ACTIVATIONS:
            raise ValueError(f"output activation {self.output_activation!r} is not supported "
                             f"(one of {', '.join(OUTPUT_ACTIVATIONS)})")

    @property
    def widths(self) -> Tuple[int, ...]:
        return tuple(self.hidden) + (self.num_classes,)

    def hidden_activation(self, i: int) -> str:
        return self.activations[i] if self.activations else "relu"

    def hidden_dropout(self, i: int) -> float:
        return self.dropouts[i] if self.dropouts else self.dropout


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A named network: `build_trunk()` makes a fresh Keras trunk; `head` describes the FC part."""

    name: str
    input_shape: Tuple[int, int, int]
    build_trunk: Callable[[], "keras.Model"]
    head: HeadSpec
    # A user's model keeps its own weights: () -> (trunk weights, [(kernel, bias), ...]).
    # None: drawn from the seed (initial_trunk_weights / initial_head_weights).
    initial_weights: Optional[Callable[[], Tuple[list, list]]] = None
    # The head's compute dtype where the model fixes it (a user's Keras model, by its Dense
    # layers' dtype policy); None: the run's --precision.
    compute_dtype: Optional[str] = None

    def initial_weights_for(self, trunk: "keras.Model", seed: int):
        """(trunk weights, whole FC layers) to start from: the model's own, or drawn."""
        if self.initial_weights is not None:
            return self.initial_weights()
        return (initial_trunk_weights(trunk, seed),
                initial_head_weights(self.trunk_output_dim(trunk), self.head, seed))

    def trunk_output_dim(self, trunk: "keras.Model") -> int:
        return int(np.prod(trunk.output_shape[1:]))


def fc_param_count(in_dim: int, head: HeadSpec) -> int:
    total, fan_in = 0, in_dim
    for width in head.widths:
        total += fan_in * width + width
        fan_in = width
    return total


def glorot_limit(shape: Tuple[int, ...]) -> float:
    """Keras' glorot_uniform bound for a kernel of `shape` (..., in, out): sqrt(6 / (fan_in +
    fan_out)), both fans counting the receptive field."""
    receptive = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    return float(np.sqrt(6.0 / (receptive * (shape[-2] + shape[-1]))))


# Glorot-uniform, Keras' default, not He-uniform: with He's larger draws alexnet_tiny at
# the default rate for a batch of 128 trained 3-5x worse on a folder of digits, or not at
# all (README, "Data": measured against keras.Model.fit).
def initial_trunk_weights(trunk: "keras.Model", seed: int) -> List[np.ndarray]:
    """Glorot-uniform kernels (Keras' default) drawn in numpy from `seed` alone; every other
    weight (biases, BatchNormalization's gamma, beta and moving statistics, ...) keeps the
    value Keras gave it (zeroing them all made gamma and the moving variance 0: a BatchNorm
    trunk never trained)."""
    rng = np.random.default_rng([seed, 0])
    weights = []
    for w in trunk.weights:
        shape = tuple(w.shape)
        if len(shape) > 1 and w.trainable:
            limit = glorot_limit(shape)
            weights.append(rng.uniform(-limit, limit, size=shape).astype(np.float32))
        else:
            weights.append(np.asarray(w.numpy()))
    return weights


def initial_head_weights(in_dim: int, head: HeadSpec, seed: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Full (unsplit) (kernel, bias) per FC layer: Glorot-uniform kernels, zero biases.

    Drawn whole and only later split, so the same seed gives the same network at any K.
    """
    rng = np.random.default_rng([seed, 1])
    layers, fan_in = [], in_dim
    for width in head.widths:
        limit = glorot_limit((fan_in, width))
        kernel = rng.uniform(-limit, limit, size=(fan_in, width)).astype(np.float32)
        layers.append((kernel, np.zeros((width,), np.float32)))
        fan_in = width
    return layers
