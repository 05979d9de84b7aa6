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
"""
from __future__ import annotations

from typing import Optional, Tuple

import keras
import numpy as np

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
