"""A head layer's initial values, read or drawn a part at a time: what the FC shards are made
from (owt_tf.parallel.head.layout), so that no whole-layer temporary exists. A 10M-class
head of 128 is 5 GB a copy; its shards are drawn where they live.

`InitializerWeights` draws each part from the Keras layer's own initializers with the
distribution the whole layer would get: Keras' variance-scaling initializers (Glorot, He,
LeCun) scale by the whole kernel's fans, so a part's draw takes the scale that gives the
same variance and bound on its smaller shape; initializers that do not look at the shape
(zeros, constants, plain random normal/uniform) draw the part as it is. Each part has its
own seed (a seeded initializer would repeat the same numbers in every part). Anything else
(Orthogonal, Identity, a custom class) is refused in one line: it cannot be drawn in parts.

`undrawn_large_kernels()` is the way a model built whole (keras.Input, a built Sequential,
a layer's `build`) gets there: while it is open, a Dense-like kernel of at least
UNDRAWN_KERNEL_BYTES is made as a variable with no value, its initializer kept, so that
owt_tf.parallelize draws its shards instead (HybridStrategy.scope() opens it while a user
builds). A kernel nobody claims is drawn whole when the scope closes (`draw_whole`).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Iterator, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf
# No public way to make a tf.Variable without a value (tf.Variable always runs its initial
# value); this one has a handle, a shape and a dtype, and its first assign gives it a value.
from tensorflow.python.ops.resource_variable_ops import UninitializedVariable

class WholeWeights:
    """A whole FC layer's (kernel [in, out], bias [out]) -- weights or optimizer slots --
    read a part at a time, so that a shard is made without the whole in memory: whole
    arrays (ArrayWeights), or a Keras layer's initializers drawn part by part
    (InitializerWeights)."""

    shape: Tuple[int, int]
    dtype: np.dtype

    def kernel_columns(self, start: int, stop: int) -> np.ndarray:
        """kernel[:, start:stop] (stop <= out)."""
        raise NotImplementedError

    def kernel_rows(self, start: int, stop: int) -> np.ndarray:
        """kernel[start:stop, :]."""
        raise NotImplementedError

    def bias(self, start: int, stop: int) -> np.ndarray:
        """bias[start:stop]."""
        raise NotImplementedError


class ArrayWeights(WholeWeights):
    """Whole arrays (a cosine layer's missing bias: zeros). An array-like that reads slices
    (an HDF5 dataset of a weights file) is read a part at a time, never whole."""

    def __init__(self, kernel, bias: Optional[np.ndarray]):
        lazy = hasattr(kernel, "shape") and hasattr(kernel, "dtype")
        self._kernel = kernel if lazy else np.asarray(kernel)
        self.shape = tuple(int(d) for d in self._kernel.shape)
        self.dtype = np.dtype(self._kernel.dtype)
        self._bias = np.zeros((self.shape[1],), self.dtype) if bias is None else np.asarray(bias)

    def kernel_columns(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self._kernel[:, start:stop])

    def kernel_rows(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self._kernel[start:stop])

    def bias(self, start: int, stop: int) -> np.ndarray:
        return self._bias[start:stop]


# Keras initializers that read the shape only through the fans (keras.initializers).
_SCALED = keras.initializers.VarianceScaling
_SHAPE_FREE = (keras.initializers.Zeros, keras.initializers.Ones, keras.initializers.Constant,
               keras.initializers.RandomNormal, keras.initializers.RandomUniform,
               keras.initializers.TruncatedNormal)


class UndrawableInitializer(ValueError):
    """An initializer that cannot be drawn a part at a time."""


def _fan(mode: str, fan_in: int, fan_out: int) -> float:
    return {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[mode]


def draw_part(initializer, whole: Tuple[int, int], part: Tuple[int, ...], seed: int,
              dtype: str = "float32") -> np.ndarray:
    """A part of shape `part` of what `initializer` would draw for a `whole` [in, out]
    kernel (or [out] bias, whole=(out,)): the same distribution, its own random numbers
    (`seed`)."""
    initializer = keras.initializers.get(initializer)
    if isinstance(initializer, _SCALED):
        # Glorot & co. keep scale, mode and distribution as attributes (their configs hold
        # the seed only)
        mode = initializer.mode
        whole_fan = max(1.0, _fan(mode, *_fans(whole)))
        part_fan = max(1.0, _fan(mode, *_fans(part)))
        drawn = keras.initializers.VarianceScaling(
            scale=initializer.scale * part_fan / whole_fan, mode=mode,
            distribution=initializer.distribution, seed=seed)(part, dtype=dtype)
    elif isinstance(initializer, _SHAPE_FREE):
        config = initializer.get_config()
        if "seed" in config:
            config["seed"] = seed
        drawn = type(initializer).from_config(config)(part, dtype=dtype)
    else:
        raise UndrawableInitializer(
            f"initializer {type(initializer).__name__} cannot be drawn a shard at a time; use a "
            "Glorot/He/LeCun, random normal/uniform or constant initializer, or build the model "
            "(keras.Input) so that its weights exist before it is split")
    return np.asarray(keras.ops.convert_to_numpy(drawn))


def _fans(shape: Tuple[int, ...]) -> Tuple[int, int]:
    return (shape[0], shape[0]) if len(shape) == 1 else (shape[0], shape[1])


class InitializerWeights(WholeWeights):
    """A Dense-like Keras layer never built: its kernel [in, units] and bias drawn part by
    part from its `kernel_initializer` and `bias_initializer` (no bias: zeros). `seed`:
    where the parts' seeds start (each part a seed of its own)."""

    def __init__(self, layer, in_dim: int, seed: int):
        self.shape = (int(in_dim), int(layer.units))
        self.dtype = np.dtype(layer.dtype_policy.variable_dtype)
        self._kernel_init = layer.kernel_initializer
        self._bias_init = getattr(layer, "bias_initializer", None)
        self._seed = int(seed)
        # checked now: refused at parallelize, not half-way through drawing the shards
        draw_part(self._kernel_init, self.shape, (1, 1), self._seed)

    def _part_seed(self, what: int, start: int) -> int:
        return (self._seed * 1_000_003 + what * 7_919 + start) % (2 ** 31 - 1)

    def kernel_columns(self, start: int, stop: int) -> np.ndarray:
        return draw_part(self._kernel_init, self.shape, (self.shape[0], stop - start),
                         self._part_seed(0, start), self.dtype.name)

    def kernel_rows(self, start: int, stop: int) -> np.ndarray:
        return draw_part(self._kernel_init, self.shape, (stop - start, self.shape[1]),
                         self._part_seed(1, start), self.dtype.name)

    def bias(self, start: int, stop: int) -> np.ndarray:
        if self._bias_init is None:
            return np.zeros((stop - start,), self.dtype)
        return draw_part(self._bias_init, (self.shape[1],), (stop - start,),
                         self._part_seed(2, start), self.dtype.name)


# Dense kernels of at least this many bytes are left undrawn while undrawn_large_kernels() is
# open: one such kernel, drawn whole and then split, costs a second copy of the head.
UNDRAWN_KERNEL_BYTES = 64 << 20
_INITIAL_VALUE = "_owt_tf_initial_value"  # an undrawn kernel's own initializer, kept on it
_PAUSED = threading.local()


def _traced_shape(initial_value: Callable) -> Optional[tf.TensorShape]:
    """The shape `initial_value()` would have, from tracing it into a throwaway graph (no
    numbers drawn); None when it cannot be traced there."""
    try:
        with tf.Graph().as_default():
            return tf.convert_to_tensor(initial_value()).shape
    except Exception:  # noqa: BLE001 -- an initializer that needs eager state: drawn as usual
        return None


def _large_dense_kernel(kwargs: dict) -> Optional[tf.TensorShape]:
    """The shape of the variable about to be made, when it is a Dense-like kernel (Keras'
    `add_weight(name="kernel")`, rank 2) of at least UNDRAWN_KERNEL_BYTES; else None."""
    initial_value = kwargs.get("initial_value")
    if not callable(initial_value) or kwargs.get("name") != "kernel":
        return None
    shape = _traced_shape(initial_value)
    if shape is None or shape.rank != 2 or not shape.is_fully_defined():
        return None
    nbytes = shape.num_elements() * tf.as_dtype(kwargs.get("dtype") or tf.float32).size
    return shape if nbytes >= UNDRAWN_KERNEL_BYTES else None


@contextlib.contextmanager
def undrawn_large_kernels() -> Iterator[List[weakref.ref]]:
    """Large Dense-like kernels made in this thread meanwhile have no value yet (see the
    module's docstring); yields the list of (weak references to) those made, filled as they
    are. Other variables are made as usual, by the creators outside."""
    made: List[weakref.ref] = []

    def creator(next_creator, **kwargs):
        shape = None if getattr(_PAUSED, "depth", 0) else _large_dense_kernel(kwargs)
        if shape is None:
            return next_creator(**kwargs)
        variable = UninitializedVariable(shape=shape, dtype=kwargs.get("dtype") or tf.float32,
                                         name=kwargs["name"],
                                         trainable=kwargs.get("trainable", True))
        setattr(variable, _INITIAL_VALUE, kwargs["initial_value"])
        made.append(weakref.ref(variable))
        return variable

    with tf.variable_creator_scope(creator):
        yield made


@contextlib.contextmanager
def drawing_every_kernel() -> Iterator[None]:
    """Within undrawn_large_kernels(), variables made meanwhile are made as usual (owt_tf's
    own: the parallel model's mirrored trunk)."""
    _PAUSED.depth = getattr(_PAUSED, "depth", 0) + 1
    try:
        yield
    finally:
        _PAUSED.depth -= 1


def _tf_variable(variable):
    """The tf.Variable behind a Keras variable (or the tf.Variable itself)."""
    return getattr(variable, "value", variable) if isinstance(variable, keras.Variable) \
        else variable


def is_undrawn(variable) -> bool:
    """A kernel made by undrawn_large_kernels() that has no value yet (a Keras variable or
    its tf.Variable). One given a value since (`assign`, `load_weights`) is drawn."""
    variable = _tf_variable(variable)
    return (getattr(variable, _INITIAL_VALUE, None) is not None
            and not bool(variable.is_initialized()))


def draw_whole(variable) -> None:
    """An undrawn kernel given its value, drawn whole by its own initializer."""
    variable = _tf_variable(variable)
    if is_undrawn(variable):
        variable.assign(getattr(variable, _INITIAL_VALUE)())


def claim(variable) -> None:
    """An undrawn kernel that stays without a value (its shards were drawn instead): nothing
    draws it whole later; reading it is TensorFlow's error for an uninitialized variable."""
    variable = _tf_variable(variable)
    if getattr(variable, _INITIAL_VALUE, None) is not None:
        setattr(variable, _INITIAL_VALUE, None)
