"""What Keras' inspection tools see of a parallelized model's sharded head: read-only whole
views of its Dense layers, under the user's layer names.

The head's FC shards (owt_tf.parallel.head.layout) are plain tf.Variables that Keras does not
track, on purpose: Keras' optimizer would all-reduce their gradients and give wrong weights
without an error. `HeadViewMixin` (a base of ParallelModel) shows them to the tools that read
a model's layers without training it:

- `summary()` lists the trunk's layers and each head Dense by the user's names, with whole
  parameter counts; its totals are the plain model's;
- `count_params()` counts every weight whole: the plain model's count;
- `get_layer(name)` finds trunk layers and head Dense layers (a `DenseView`);
- `layers` is [trunk, *head views], so `keras.callbacks.TensorBoard(histogram_freq=1)` writes
  a histogram of every head kernel and bias, tagged as in the plain model (`fc1/kernel`).

A view's weights (`WholeWeight`) are joined from the shards at each read (in a cluster that
is a collective: every worker reads, as TensorBoard on every worker does). They are not Keras
variables and the model does not track the views, so `model.weights`,
`model.trainable_variables` (what Keras' optimizer updates) and Keras' weight files are what
they were. The views are read-only: set the head's weights with `model.set_weights` or
`load_weights`.
"""
from __future__ import annotations

import collections
import dataclasses
import json
from typing import Callable, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils import summary_utils

from owt_tf.parallel.head.layout import ShardedDense, ShardReader, assemble


class ReadOnlyView(RuntimeError):
    """A write to a head view: the shards are set through the model."""


_READ_ONLY = ("{what} is a read-only view of the FC shards: set the head's weights with "
              "model.set_weights or model.load_weights")


def _whole_layer(layer: ShardedDense, read: ShardReader) -> Tuple[np.ndarray, np.ndarray]:
    values = read({k: layer.shard_variables(k) for k in layer.local_shards})
    return assemble(layer, [v[0] for v in values], [v[1] for v in values])


class WholeWeight:
    """One whole kernel or bias of a head Dense layer: the attributes Keras' tools read of a
    weight (`name`, `path`, `shape`, `dtype`, its value) with the value joined from the
    shards at each read."""

    trainable = True

    def __init__(self, layer: ShardedDense, part: str, layer_name: str, read: ShardReader):
        self._layer, self._read = layer, read
        self._index = ("kernel", "bias").index(part)
        self.name = part
        self.path = f"{layer_name}/{part}"
        self.shape = (layer.in_dim, layer.out_dim) if part == "kernel" else (layer.out_dim,)
        self.dtype = layer.kernels[layer.local_shards[0]].dtype.name

    def numpy(self) -> np.ndarray:
        return _whole_layer(self._layer, self._read)[self._index]

    @property
    def value(self) -> tf.Tensor:
        return tf.constant(self.numpy())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def assign(self, value) -> None:
        raise ReadOnlyView(_READ_ONLY.format(what=f"weight {self.path}"))

    assign_add = assign_sub = assign

    def __repr__(self) -> str:
        return f"<WholeWeight path={self.path} shape={self.shape} dtype={self.dtype}>"


def _to_tensor(weight: WholeWeight, dtype=None, name=None, as_ref=False) -> tf.Tensor:
    return tf.convert_to_tensor(weight.numpy(), dtype=dtype, name=name)


# tf.summary.histogram (Keras' TensorBoard) and other TF ops take a WholeWeight as a tensor.
tf.register_tensor_conversion_function(WholeWeight, _to_tensor)


class DenseView:
    """A head Dense layer as Keras' tools see a layer: its user's name, whole weights and
    parameter count, output shape. Not a keras.layers.Layer: a Layer would be saved by Keras'
    weight files (another file layout) and its weights would be Keras variables."""

    built = True

    def __init__(self, name: str, layer: ShardedDense, read: ShardReader):
        self.name = name
        self.units = layer.out_dim
        self._layer, self._read = layer, read
        parts = ("kernel", "bias") if layer.use_bias else ("kernel",)
        self.weights: List[WholeWeight] = [WholeWeight(layer, part, name, read)
                                           for part in parts]
        self.input_shape = (None, layer.in_dim)
        self.output_shape = (None, layer.out_dim)
        # What keras' summary reads to print a layer's output shape.
        self._inbound_nodes: list = []
        self._build_shapes_dict = {"input_shape": self.input_shape}

    @property
    def trainable(self) -> bool:
        return True

    @trainable.setter
    def trainable(self, value) -> None:
        raise ReadOnlyView(f"layer {self.name}: a head Dense layer cannot be frozen after "
                           "parallelize (freeze layers of the trunk, or of your model before)")

    @property
    def trainable_weights(self) -> List[WholeWeight]:
        return list(self.weights)

    @property
    def non_trainable_weights(self) -> List[WholeWeight]:
        return []

    variables = trainable_variables = trainable_weights

    def get_weights(self) -> List[np.ndarray]:
        """[kernel, bias] ([kernel] for a cosine layer), whole, as the user's layer holds them."""
        return list(_whole_layer(self._layer, self._read))[:len(self.weights)]

    def set_weights(self, weights) -> None:
        raise ReadOnlyView(_READ_ONLY.format(what=f"layer {self.name}"))

    def count_params(self) -> int:
        return int(sum(np.prod(w.shape) for w in self.weights))

    def __repr__(self) -> str:
        return f"<DenseView name={self.name} units={self.units}>"


_Slot = collections.namedtuple("_Slot", "shape dtype")


@dataclasses.dataclass
class _SummaryOptimizer:
    variables: list
    built: bool = True


@dataclasses.dataclass
class _SummaryModel:
    """What keras' print_summary reads of a model, for the model as the user built it."""

    name: str
    layers: list
    trainable_weights: list
    non_trainable_weights: list
    compiled: bool
    optimizer: Optional[_SummaryOptimizer]


@dataclasses.dataclass
class _Views:
    dense: List[DenseView]
    drop_input_layer: bool  # the user's model is a Sequential: its `layers` has no InputLayer


class HeadViewMixin:
    """Keras' layer inspection (`layers`, `get_layer`, `summary`, `count_params`) over the
    trunk and the head's whole views. Needs the model's `trunk`, `head`, `_dense_names`,
    `_source_json`, `_hybrid` and `_fc_optimizer` (ParallelModel's)."""

    def _views(self) -> _Views:
        # Kept out of Keras' and TF's attribute tracking: the views are no state of the model.
        views = self.__dict__.get("_head_views")
        if views is None:
            read = self._hybrid.placement.read_shards
            dense = [DenseView(name, layer, read)
                     for name, layer in zip(self._dense_names, self.head.layers)]
            sequential = json.loads(self._source_json).get("class_name") == "Sequential"
            views = self.__dict__["_head_views"] = _Views(dense, sequential)
        return views

    @property
    def layers(self) -> list:
        """[trunk, *head Dense views]. The trunk stays one layer here because Keras' weight
        files are laid out by this list; `own_layers()` lists the trunk's layers."""
        return [self.trunk] + self._views().dense

    def own_layers(self) -> List[Union[keras.layers.Layer, DenseView]]:
        """The user's layers: the trunk's, then each head Dense (a DenseView). A Dropout or
        Activation layer of the head is not listed (it holds no weights)."""
        views = self._views()
        trunk = [layer for layer in self.trunk.layers
                 if not (views.drop_input_layer and isinstance(layer, keras.layers.InputLayer))]
        return trunk + views.dense

    def get_layer(self, name: Optional[str] = None,
                  index: Optional[int] = None) -> Union[keras.layers.Layer, DenseView]:
        """Keras' get_layer over `own_layers()` (and the trunk, by its name)."""
        if index is not None and name is not None:
            raise ValueError(f"Provide only a layer name or a layer index. Received: "
                             f"index={index}, name={name}.")
        layers = self.own_layers()
        if index is not None:
            if index >= len(layers):
                raise ValueError(f"Was asked to retrieve layer at index {index} but model "
                                 f"only has {len(layers)} layers.")
            return layers[index]
        if name is None:
            raise ValueError("Provide either a layer name or layer index at `get_layer`.")
        for layer in layers + [self.trunk]:
            if layer.name == name:
                return layer
        raise ValueError(f"No such layer: {name}. Existing layers are: "
                         f"{[layer.name for layer in layers]}.")

    def count_params(self) -> int:
        """Every weight, the head's whole (padding not counted): the plain model's count."""
        return self.trunk.count_params() + sum(v.count_params() for v in self._views().dense)

    def summary(self, line_length: Optional[int] = None,
                positions: Optional[Sequence[float]] = None,
                print_fn: Optional[Callable[..., None]] = None, expand_nested: bool = False,
                show_trainable: bool = False,
                layer_range: Optional[Sequence[str]] = None) -> None:
        """Keras' summary of the user's layers (`own_layers()`), head weights whole; the
        optimizer's parameters include the FC optimizer's slots, whole."""
        summary_utils.print_summary(self._summary_model(), line_length=line_length,
                                    positions=positions, print_fn=print_fn,
                                    expand_nested=expand_nested,
                                    show_trainable=show_trainable, layer_range=layer_range)

    def _summary_model(self) -> _SummaryModel:
        head = [w for view in self._views().dense for w in view.weights]
        optimizer = getattr(self, "optimizer", None)
        summary_optimizer = None
        if self.compiled and optimizer is not None and optimizer.built:
            slots = self._fc_optimizer.num_slots if self._fc_optimizer is not None else 0
            fc_slots = [_Slot(w.shape, w.dtype) for w in head for _ in range(slots)]
            summary_optimizer = _SummaryOptimizer(list(optimizer.variables) + fc_slots)
        return _SummaryModel(self.name, self.own_layers(),
                             list(self.trunk.trainable_weights) + head,
                             list(self.trunk.non_trainable_weights), self.compiled,
                             summary_optimizer)

