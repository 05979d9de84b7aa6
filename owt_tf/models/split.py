"""Splits a user's Keras model into a convolutional trunk and a fully connected head.

The split rule: the trunk is everything up to the tensor that feeds the first `Dense` of
the model's final chain of `Dense` / `Dropout` / `Activation` / `ReLU` / `Softmax` layers
(a rank-2 tensor: after `Flatten`, `GlobalAveragePooling2D`, ...). The head is that chain:
each `Dense` with its activation (ReLU or linear; softmax, sigmoid or linear on the last) and the
dropout rate after it. The trunk may be anything Keras builds; the head must be a plain
chain, because owt_tf splits its layers over devices. Anything else is refused with one
line naming the layer and the reason (`UnsupportedModel`).

No parallelism here: this only reads the model. The weights are the user's, never redrawn.
"""
from __future__ import annotations

import dataclasses
import gc
from typing import List, Optional, Tuple, Union

import keras
import numpy as np

from owt_tf.layers import NormalizedDense
from owt_tf.models.head_weights import (InitializerWeights, UndrawableInitializer,
                                        WholeWeights, draw_whole, is_undrawn,
                                        undrawn_large_kernels)
from owt_tf.models.spec import OUTPUT_ACTIVATIONS, HeadSpec


class UnsupportedModel(ValueError):
    """A model (or one of its layers) that owt_tf cannot split; the message names it."""


@dataclasses.dataclass
class KerasSplit:
    """A Keras model as trunk + head: the trunk shares the original's layers (clone it to
    place it); `head_weights` are the Dense layers' (kernel, bias), whole, or what draws
    them a part at a time (a model never built: split_unbuilt_sequential)."""

    trunk: Optional[keras.Model]  # None once released (release_clone)
    head: HeadSpec
    head_weights: List[Union[Tuple[np.ndarray, np.ndarray], WholeWeights]]
    dense_names: List[str]
    input_shape: Tuple[int, ...]
    # The head's compute dtype: its first Dense layer's (Keras' mixed-precision policy). The
    # loss and the outputs are float32 whatever it is.
    compute_dtype: str = "float32"

    def release_clone(self) -> None:
        """Frees the clone of the user's model the trunk was cut from (once the trunk is
        copied): its Dense layers hold a copy of the head, GBs for a million classes. The
        trunk is gone after."""
        self.trunk = None
        gc.collect()  # Keras layers hold reference cycles


# The layers the head's FC layers are: Dense, and a cosine class layer last.
_FC_TYPES = (keras.layers.Dense, NormalizedDense)
_HEAD_TYPES = _FC_TYPES + (keras.layers.Dropout, keras.layers.Activation, keras.layers.ReLU,
                           keras.layers.Softmax)


def _activation_name(layer) -> str:
    """'relu', 'linear', 'softmax' or what else the layer applies (refused later)."""
    if isinstance(layer, keras.layers.ReLU):
        plain = (layer.max_value is None and not layer.negative_slope and not layer.threshold)
        return "relu" if plain else f"ReLU(max_value={layer.max_value}, ...)"
    if isinstance(layer, keras.layers.Softmax):
        return "softmax" if tuple(np.atleast_1d(layer.axis)) in ((-1,), (1,)) else "softmax(axis)"
    if isinstance(layer, NormalizedDense):
        return "linear"
    fn = layer.activation
    return getattr(fn, "__name__", str(fn))


def _producers(model: keras.Model) -> dict:
    """id(output tensor) -> the model's layer that made it."""
    found = {}
    for layer in model.layers:
        try:
            found[id(layer.output)] = layer
        except (AttributeError, ValueError):  # a layer used more than once: not in the head
            continue
    return found


def _head_chain(model: keras.Model) -> Tuple[List, object]:
    """The model's final chain of head-type layers (input side first) and the tensor that
    feeds it."""
    if len(model.outputs) != 1:
        raise UnsupportedModel(f"model {model.name}: {len(model.outputs)} outputs; owt_tf "
                               "needs one (the class scores)")
    producers = _producers(model)
    chain, tensor = [], model.outputs[0]
    while id(tensor) in producers and isinstance(producers[id(tensor)], _HEAD_TYPES):
        layer = producers[id(tensor)]
        chain.insert(0, layer)
        tensor = layer.input
        if isinstance(tensor, (list, tuple)):
            raise UnsupportedModel(f"layer {layer.name}: takes several inputs")
    chain = _trimmed_head(chain)
    if not chain:
        raise UnsupportedModel(f"model {model.name}: its output is not made by a Dense layer "
                               "(owt_tf shards the Dense layers at the end of a model)")
    return chain, chain[0].input


def _trimmed_head(chain: List) -> List:
    """The head of a model's final chain of head-type layers: Dropout / Activation before
    the first Dense belong to the trunk (they see the features, not an FC layer's output),
    and a cosine class layer is the whole head (what feeds it is the embedding, which face
    models keep and compute data-parallel: an FC to D, BatchNormalization, ...)."""
    start = 0
    while start < len(chain) and not isinstance(chain[start], _FC_TYPES):
        start += 1
    if start < len(chain) and isinstance(chain[-1], NormalizedDense):
        start = len(chain) - 1
    return chain[start:]


def _check_rank2_features(chain: List, features) -> None:
    if len(features.shape) != 2:
        raise UnsupportedModel(f"layer {chain[0].name}: its input has shape "
                               f"{tuple(features.shape)}; the first Dense of the head needs a "
                               "rank-2 input (put Flatten or GlobalAveragePooling2D before it)")


def _check_dense(layer, last: bool) -> None:
    reasons = []
    if not layer.trainable:
        reasons.append("a frozen (trainable=False) head layer is not supported")
    if isinstance(layer, NormalizedDense) and not last:
        reasons.append("a NormalizedDense (cosine) layer is supported as the class layer only")
    if not getattr(layer, "use_bias", True):
        reasons.append("use_bias=False is not supported")
    for attr in ("kernel_regularizer", "bias_regularizer", "activity_regularizer",
                 "kernel_constraint", "bias_constraint"):
        if getattr(layer, attr, None) is not None:
            reasons.append(f"{attr} is not honoured by the sharded head")
    if getattr(layer, "lora_rank", None):
        reasons.append("LoRA is not supported")
    if layer.dtype_policy.variable_dtype != "float32":
        reasons.append(f"dtype policy {layer.dtype_policy.name} is not supported (float32 "
                       "weights only: float32, mixed_bfloat16 or mixed_float16)")
    act = _activation_name(layer)
    allowed = OUTPUT_ACTIVATIONS if last else ("relu", "linear")
    if act not in allowed:
        reasons.append(f"activation {act!r} is not supported here (one of {', '.join(allowed)})")
    if reasons:
        raise UnsupportedModel(f"layer {layer.name}: {reasons[0]}")


def _bias_of(layer) -> np.ndarray:
    """A layer's bias; a cosine layer has none: zeros, which its shards keep (never read)."""
    if isinstance(layer, NormalizedDense):
        return np.zeros((layer.units,), np.float32)
    return np.asarray(layer.bias.numpy())


def _head_spec(chain: List) -> Tuple[HeadSpec, List[str]]:
    """Dense widths, each hidden layer's activation and dropout, and the output activation."""
    dense: List = []
    activations: List[str] = []
    dropouts: List[float] = []
    for layer in chain:
        if isinstance(layer, _FC_TYPES):
            dense.append(layer)
            activations.append(_activation_name(layer))
            dropouts.append(0.0)
        elif isinstance(layer, keras.layers.Dropout):
            if layer is chain[-1] or dropouts[-1]:
                raise UnsupportedModel(f"layer {layer.name}: dropout only between Dense layers, "
                                       "one per layer")
            if layer.noise_shape is not None:
                raise UnsupportedModel(f"layer {layer.name}: noise_shape is not supported")
            dropouts[-1] = float(layer.rate)
        else:  # an activation layer: the Dense before it must be linear
            if activations[-1] != "linear" or dropouts[-1]:
                raise UnsupportedModel(f"layer {layer.name}: an activation after a non-linear "
                                       "Dense or after dropout is not supported")
            activations[-1] = _activation_name(layer)
    for i, layer in enumerate(dense):
        last = i == len(dense) - 1
        _check_dense(layer, last)
        act = activations[i]
        allowed = OUTPUT_ACTIVATIONS if last else ("relu", "linear")
        if act not in allowed:
            raise UnsupportedModel(f"layer {layer.name}: activation {act!r} is not supported "
                                   f"here (one of {', '.join(allowed)})")
    spec = HeadSpec(hidden=tuple(int(d.units) for d in dense[:-1]),
                    num_classes=int(dense[-1].units), dropout=0.0,
                    activations=tuple(activations[:-1]), dropouts=tuple(dropouts[:-1]),
                    output_activation=activations[-1], names=tuple(d.name for d in dense),
                    cosine=isinstance(dense[-1], NormalizedDense))
    return spec, [d.name for d in dense]


def _check_head_starts_at_first_dense(model: keras.Model, chain: List, features) -> None:
    """The head begins at the model's first Dense on a rank-2 input: a layer between it and
    the final chain (BatchNormalization, a merge, ...) sits inside the head: refused. A
    cosine class layer alone is the whole head: the Dense layers before it are the trunk's
    (a face model's embedding block: FC to D, BatchNormalization)."""
    if isinstance(chain[0], NormalizedDense):
        return
    for layer in model.layers:
        if not isinstance(layer, keras.layers.Dense):
            continue
        try:
            rank = len(layer.input.shape)
        except (AttributeError, ValueError):
            continue
        if rank != 2:
            continue
        if layer is chain[0]:
            return
        inside = _producers(model).get(id(features))
        what = inside.name if inside is not None else "a layer"
        kind = type(inside).__name__ if inside is not None else "layer"
        raise UnsupportedModel(f"layer {what}: a {kind} inside the FC head (after {layer.name}); "
                               "the head must be a chain of Dense, Activation and Dropout layers")


def _check_chain_is_private(model: keras.Model, chain: List, features) -> None:
    """No other layer may read a tensor inside the head (a skip connection into it)."""
    inside = {id(layer.output) for layer in chain[:-1]}
    for layer in model.layers:
        if any(layer is c for c in chain):
            continue
        try:
            inputs = keras.tree.flatten(layer.input)
        except (AttributeError, ValueError):
            continue
        if any(id(t) in inside for t in inputs):
            raise UnsupportedModel(f"layer {layer.name}: reads an output inside the FC head "
                                   "(a skip connection into the head is not supported)")


def _check_no_float16(model: keras.Model) -> None:
    """float16 compute needs a loss scale: the Keras path takes Keras' LossScaleOptimizer,
    the CLI applies its own to registry models (--precision fp16) only."""
    for layer in model.layers:
        if layer.dtype_policy.compute_dtype == "float16":
            raise UnsupportedModel(
                f"layer {layer.name}: dtype policy {layer.dtype_policy.name} is not supported "
                "by the CLI (float16 needs a loss scale: train it with owt_tf.parallelize and "
                "Keras' fit, or use mixed_bfloat16)")


def split_keras_model(model: keras.Model, allow_float16: bool = False,
                      seed: int = 0) -> KerasSplit:
    """The trunk (a functional model over the original layers) and the head of `model`.
    `allow_float16`: the caller applies a loss scale (Keras' LossScaleOptimizer). A head
    kernel built without a value (head_weights.undrawn_large_kernels) is drawn shard by shard
    from its layer's initializers, seeded by `seed`; the clone made here holds none."""
    if not isinstance(model, keras.Model):
        raise UnsupportedModel(f"expected a keras.Model, got {type(model).__name__}")
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not inputs:
        raise UnsupportedModel(f"model {model.name}: not built on a keras.Input (a subclassed "
                               "model, or a Sequential without an input shape); build it with "
                               "keras.Input first")
    if len(inputs) != 1:
        raise UnsupportedModel(f"model {model.name}: {len(inputs)} inputs; owt_tf needs one")
    # A fresh graph: a loaded (or reused) model's layers can have several call sites, and
    # `layer.output` then names only one of them.
    original = model
    with undrawn_large_kernels():
        model = keras.models.clone_model(original)
    _copy_drawn_weights(original, model)
    inputs = model.inputs
    chain, features = _head_chain(model)
    _check_head_starts_at_first_dense(model, chain, features)
    _check_rank2_features(chain, features)
    _check_chain_is_private(model, chain, features)
    if not allow_float16:
        _check_no_float16(model)
    spec, names = _head_spec(chain)
    dense = [layer for layer in chain if isinstance(layer, _FC_TYPES)]
    widths = [int(features.shape[-1])] + [int(d.units) for d in dense]
    weights = [_head_layer_weights(d, widths[i], seed + i) for i, d in enumerate(dense)]
    trunk = keras.Model(inputs[0], features, name=f"{model.name}_trunk")
    for variable in trunk.weights:  # an undrawn trunk kernel: the trunk is copied whole
        draw_whole(variable)
    return KerasSplit(trunk, spec, weights, names, tuple(inputs[0].shape[1:]),
                      dense[0].dtype_policy.compute_dtype)


def _copy_drawn_weights(original: keras.Model, clone: keras.Model) -> None:
    """The original's weights into its clone (Keras' set_weights, one variable at a time:
    no second copy of a large head in memory), but for undrawn kernels: the clone's stay
    undrawn too."""
    for mine, theirs in zip(clone.weights, original.weights, strict=True):
        if not is_undrawn(theirs):
            mine.assign(theirs)


def _head_layer_weights(layer, in_dim: int, seed: int):
    """A head layer's (kernel, bias) as arrays; an undrawn kernel as what draws it shard by
    shard (one whose initializer cannot be drawn in parts is drawn whole here)."""
    if is_undrawn(layer.kernel):
        try:
            return InitializerWeights(layer, in_dim, seed)
        except UndrawableInitializer:
            draw_whole(layer.kernel)
    return np.asarray(layer.kernel.numpy()), _bias_of(layer)


def split_unbuilt_sequential(model: keras.Sequential, input_shape: Tuple[int, ...],
                             seed: int, allow_float16: bool = False) -> KerasSplit:
    """A Sequential never built (no keras.Input: none of its layers holds weights) split for
    inputs of `input_shape`: the trunk is built from fresh copies of its layers, the head's
    weights are drawn shard by shard from each Dense's initializers (head_weights), never
    whole. The way to a head too large for one device (10M classes)."""
    layers = list(model.layers)
    tail = len(layers)
    while tail and isinstance(layers[tail - 1], _HEAD_TYPES):
        tail -= 1
    chain = _trimmed_head(layers[tail:])
    if not chain:
        raise UnsupportedModel(f"model {model.name}: its last layer is not a Dense layer "
                               "(owt_tf shards the Dense layers at the end of a model)")
    cut = len(layers) - len(chain)
    trunk_layers = [type(layer).from_config(layer.get_config()) for layer in layers[:cut]]
    trunk = keras.Sequential([keras.Input(tuple(input_shape))] + trunk_layers,
                             name=f"{model.name}_trunk")
    features = trunk.outputs[0]
    _check_head_starts_at_first_dense(trunk, chain, features)
    _check_rank2_features(chain, features)
    if not allow_float16:
        _check_no_float16(trunk)
    spec, names = _head_spec(chain)
    dense = [layer for layer in chain if isinstance(layer, _FC_TYPES)]
    widths = [int(features.shape[-1])] + [int(d.units) for d in dense]
    weights = [InitializerWeights(d, widths[i], seed + i) for i, d in enumerate(dense)]
    return KerasSplit(trunk, spec, weights, names, tuple(input_shape),
                      dense[0].dtype_policy.compute_dtype)


def is_unbuilt_sequential(model) -> bool:
    """A Sequential that was never built (no keras.Input, never called): no weights yet."""
    return isinstance(model, keras.Sequential) and not model.built
