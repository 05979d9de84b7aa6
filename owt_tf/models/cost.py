"""What a network costs per example, layer by layer: forward FLOPs, outputs and parameters,
read off the real Keras trunk and the model's HeadSpec (forward 2 FLOPs per multiply-add;
training = forward + input gradient + weight gradient = 3x forward, 2x for the first weight
layer, which needs no input gradient). `NetworkShape` is the part the closed-form traffic
(owt_tf.planner.traffic) depends on.

Building the trunk imports TensorFlow; importing this module does not.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

from owt_tf.models.registry import build_model


@dataclasses.dataclass(frozen=True)
class NetworkShape:
    """What traffic depends on: trunk parameters, trunk output width, FC widths, classes."""

    trunk_params: int
    features: int
    hidden: Sequence[int]
    num_classes: int

    @property
    def fc_params(self) -> int:
        total, fan_in = 0, self.features
        for w in list(self.hidden) + [self.num_classes]:
            total += fan_in * w + w
            fan_in = w
        return total


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer of the network: forward FLOPs and output floats per example, parameters."""

    name: str
    kind: str  # "conv" (data parallel trunk), "fc" (sharded head), "elementwise"
    flops: int
    outputs: int
    params: int


@dataclasses.dataclass(frozen=True)
class NetworkCost:
    layers: List[LayerCost]
    shape: NetworkShape

    def _sum(self, kind: str, attr: str) -> int:
        return sum(getattr(l, attr) for l in self.layers if l.kind == kind)

    @property
    def conv_train_flops(self) -> int:
        """Training FLOPs per example of the trunk: 3x forward, 2x for the first weight layer."""
        weighted = [l for l in self.layers if l.kind == "conv"]
        return 3 * sum(l.flops for l in weighted) - (weighted[0].flops if weighted else 0)

    @property
    def fc_train_flops(self) -> int:
        return 3 * self._sum("fc", "flops")

    @property
    def train_flops(self) -> int:
        return self.conv_train_flops + self.fc_train_flops

    @property
    def elementwise_floats(self) -> int:
        """Per example: outputs of every layer that is not a matmul, plus the FC activations."""
        return self._sum("elementwise", "outputs") + sum(
            l.outputs for l in self.layers if l.kind == "fc")

    @property
    def params(self) -> int:
        return self.shape.trunk_params + self.shape.fc_params


class Uncountable(ValueError):
    """A trunk with a layer whose FLOPs this module cannot count (the message names it)."""


def network_cost(model: str, num_classes: int, image_size: Optional[int] = None) -> NetworkCost:
    """Per-layer costs read off the real Keras trunk and the model's HeadSpec."""
    return spec_cost(build_model(model, num_classes, image_size=image_size))


def spec_cost(spec) -> NetworkCost:
    """Per-layer costs of a ModelSpec (a registry model's or a user's Keras model): its trunk
    built, its head read off the HeadSpec. Raises Uncountable for a trunk layer with weights
    that is not a Conv2D, a Dense or a normalization."""
    trunk = spec.build_trunk()
    return trunk_cost(trunk, spec.trunk_output_dim(trunk), spec.head)


def trunk_cost(trunk, features: int, head) -> NetworkCost:
    """Per-layer costs of a built Keras trunk of `features` outputs and the FC head `head`
    (a HeadSpec)."""
    layers = [c for c in (_layer_cost(layer) for layer in trunk.layers) if c is not None]
    fan_in = features
    for i, width in enumerate(head.widths):
        layers.append(LayerCost(f"fc{i + 1}", "fc", 2 * fan_in * width, width, fan_in * width + width))
        fan_in = width
    shape = NetworkShape(trunk.count_params(), features, tuple(head.hidden), head.num_classes)
    return NetworkCost(layers, shape)


# Layers with weights whose cost is their output's memory traffic (a per-channel scale and shift).
_NORMALIZATIONS = ("BatchNormalization", "LayerNormalization", "GroupNormalization")
# Layers that only reshape: no compute, no memory pass of their own.
_RESHAPES = ("Flatten", "Reshape", "ZeroPadding2D", "InputLayer")


def _layer_cost(layer) -> Optional[LayerCost]:
    import keras

    try:
        out = [int(d) for d in layer.output.shape[1:]]
    except (AttributeError, ValueError, TypeError) as err:  # a layer used twice, unknown sizes
        raise Uncountable(f"layer {layer.name}: no single output shape ({err})") from None
    n_out = 1
    for d in out:
        n_out *= d
    params = int(layer.count_params())
    kind = type(layer).__name__
    if isinstance(layer, keras.layers.Conv2D) and not isinstance(layer, keras.layers.Conv2DTranspose):
        # out_h*out_w*out_c*kh*kw*in_c/groups MACs: the kernel is (kh, kw, in_c/groups, out_c)
        kh, kw, cin, _ = (int(d) for d in layer.kernel.shape)
        return LayerCost(layer.name, "conv", 2 * n_out * kh * kw * cin, n_out, params)
    if isinstance(layer, keras.layers.Dense):  # a Dense in a trunk
        return LayerCost(layer.name, "conv", 2 * int(layer.kernel.shape[0]) * n_out, n_out, params)
    if kind in _RESHAPES or layer.name == "flatten" or "pad" in layer.name:
        return None
    if params and kind not in _NORMALIZATIONS:
        raise Uncountable(f"layer {layer.name} ({kind}) has weights but is not a Conv2D, Dense "
                          "or normalization layer")
    return LayerCost(layer.name, "elementwise", 0, n_out, params)
