"""The user's own Keras model as a ModelSpec, for the CLI: `--model PATH.keras` or
`--model package.module:function` (called as `function(num_classes)`; it returns a Keras
model, whose input shape the data is resized to).

The model is split by owt_tf.models.split and keeps its own weights (a `.keras` file's
trained weights, or whatever the function initialised): nothing is redrawn from --seed.
"""
from __future__ import annotations

import importlib
import os
import re
from typing import Optional

from owt_tf.models.spec import ModelSpec

_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class UserModelError(ValueError):
    """A --model that names no loadable Keras model (the message says why)."""


def is_user_model(name: str) -> bool:
    """Whether --model names the user's model (a .keras file or module:function), not a
    registry name."""
    return name.endswith(".keras") or bool(_FUNCTION.match(name))


def check_user_model_name(name: str) -> None:
    """Cheap checks, before TensorFlow loads."""
    if name.endswith(".keras") and not os.path.isfile(name):
        raise UserModelError(f"{name}: no such file")


def _load(name: str, num_classes: Optional[int], seed: Optional[int]):
    import keras

    if name.endswith(".keras"):
        return keras.models.load_model(name, compile=False)
    module_name, function_name = name.split(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise UserModelError(f"{name}: {err}") from None
    if seed is not None:
        # Every worker of a cluster must start from the same weights: seeded, the function
        # draws the same ones in every process.
        keras.utils.set_random_seed(seed)
    # The class count does not change the input shape, which is all a probe (None) needs.
    model = function(num_classes if num_classes is not None else 10)
    if not isinstance(model, keras.Model):
        raise UserModelError(f"{name}: returned {type(model).__name__}, not a keras.Model")
    return model


def user_model_spec(name: str, num_classes: Optional[int] = None,
                    seed: Optional[int] = None) -> ModelSpec:
    """The ModelSpec of the user's model; `num_classes` None: whatever it has. `seed` seeds
    Keras' initializers before a `module:function` is called (a file's weights are its own)."""
    import keras

    from owt_tf.runtime.devices import outside_strategy_scope
    from owt_tf.models.split import split_keras_model

    model = outside_strategy_scope(lambda: _load(name, num_classes, seed))
    split = split_keras_model(model)
    if num_classes is not None and split.head.num_classes != num_classes:
        raise UserModelError(f"{name}: the model has {split.head.num_classes} classes, the "
                             f"data has {num_classes}")
    trunk_weights = [w.copy() for w in split.trunk.get_weights()]
    head_weights = [(k.copy(), b.copy()) for k, b in split.head_weights]

    def build_trunk():
        trunk = keras.models.clone_model(split.trunk)
        trunk.set_weights(trunk_weights)
        return trunk

    label = os.path.basename(name) if name.endswith(".keras") else name
    return ModelSpec(name=label, input_shape=tuple(int(d) for d in split.input_shape),
                     build_trunk=build_trunk, head=split.head,
                     initial_weights=lambda: (trunk_weights, head_weights),
                     compute_dtype=split.compute_dtype)
