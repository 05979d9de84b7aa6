"""What a network costs per example, layer by layer: forward FLOPs, outputs and parameters,
read off the real Keras trunk and the model's HeadSpec (forward 2 FLOPs per multiply-add;
training = forward + input gradient + weight gradient = 3x forward, 2x for the first weight
layer, which needs no input gradient). `NetworkShape` is the part the closed-form traffic
(owt_tf.parallel.traffic) depends on.

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


def network_cost(model: str, num_classes: int, image_size: Optional[int] = None) -> NetworkCost:
    """Per-layer costs read off the real Keras trunk and the model's HeadSpec."""
    spec = build_model(model, num_classes, image_size=image_size)
    trunk = spec.build_trunk()
    layers = []
    for layer in trunk.layers:
        out = [int(d) for d in layer.output.shape[1:]]
        n_out = 1
        for d in out:
            n_out *= d
        params = int(layer.count_params())
        kernel = getattr(layer, "kernel", None)
        if kernel is not None and len(kernel.shape) == 4:  # Conv2D: out_h*out_w*out_c*kh*kw*in_c MACs
            kh, kw, cin, _ = (int(d) for d in kernel.shape)
            layers.append(LayerCost(layer.name, "conv", 2 * n_out * kh * kw * cin, n_out, params))
        elif kernel is not None:  # Dense in a trunk
            layers.append(LayerCost(layer.name, "conv", 2 * int(kernel.shape[0]) * n_out, n_out, params))
        elif layer.name != "flatten" and "pad" not in layer.name:
            layers.append(LayerCost(layer.name, "elementwise", 0, n_out, params))
    features = spec.trunk_output_dim(trunk)
    fan_in = features
    for i, width in enumerate(spec.head.widths):
        layers.append(LayerCost(f"fc{i + 1}", "fc", 2 * fan_in * width, width, fan_in * width + width))
        fan_in = width
    shape = NetworkShape(trunk.count_params(), features, spec.head.hidden, spec.head.num_classes)
    return NetworkCost(layers, shape)
