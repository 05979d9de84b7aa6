"""`owt_tf.parallelize(model)`: a user's Keras model split at its Dense head, the plan made
concrete for it (scheme="auto" chosen here, where model and K are first both known), the
trunk mirrored and the head placed as FC shards: a ParallelModel.
"""
from __future__ import annotations

import gc
import json
from typing import Optional, Sequence

import keras
import numpy as np

from owt_tf.runtime.devices import outside_strategy_scope
from owt_tf.fit import files as keras_files
from owt_tf.fit.model import ParallelModel
from owt_tf.models.head_weights import claim, drawing_every_kernel, undrawn_large_kernels
from owt_tf.models.split import (KerasSplit, UnsupportedModel, is_unbuilt_sequential,
                                 split_keras_model, split_unbuilt_sequential)
from owt_tf.parallel.strategy import HybridStrategy, current_strategy
from owt_tf.planner.plan import AUTO, PlanError


def parallelize(model: keras.Model, strategy: Optional[HybridStrategy] = None,
                seed: Optional[int] = None, *,
                input_shape: Optional[Sequence[int]] = None) -> "ParallelModel":
    """`model` split at its FC stack: trunk mirrored over the strategy's devices, Dense layers
    sharded. The user's weights are kept. `strategy`: default, the HybridStrategy whose
    `scope()` is open. `seed` seeds the head's dropout (default: drawn at random).

    A head too large for one device: build the model inside `strategy.scope()` (a Dense
    kernel of 64 MB or more made there gets no value), or give a `keras.Sequential` that
    was never built (no `keras.Input`) and `input_shape` (one example's shape). Each FC
    shard is then drawn where it lives from the Dense layer's initializers, with the
    distribution the whole layer would get (seeded by `seed`); the head never exists whole,
    and the model given keeps its class kernel without a value (train, save and export the
    ParallelModel)."""
    hybrid = strategy or current_strategy()
    if hybrid is None:
        raise ValueError("owt_tf.parallelize needs a HybridStrategy: call it inside "
                         "`with strategy.scope():` or pass strategy=")
    unbuilt = is_unbuilt_sequential(model)
    if unbuilt and input_shape is None:
        raise UnsupportedModel(f"model {model.name}: a Sequential that was never built; pass "
                               "input_shape= (its head is then drawn shard by shard) or build "
                               "it on a keras.Input")
    if input_shape is not None and not unbuilt:
        raise UnsupportedModel(f"model {model.name}: input_shape= is for a Sequential that was "
                               "never built; this model is built (its own input shape counts)")
    if seed is None:
        seed = int(np.random.default_rng().integers(2**31 - 1))
    # In a cluster every worker takes the chief's: the head's dropout masks and the order of
    # shuffled arrays must be the same on every worker.
    placement = hybrid.placement
    seed = int(placement.sum_over_workers(np.array([seed if placement.is_chief else 0]))[0])
    # Before the split: the rebuilt model and the split's clone each hold a copy of the head
    # (GBs for a million classes), and only one at a time is alive.
    source = _rebuildable_source(model, input_shape)
    # Outside the scope: the split works on a throwaway clone, which needs no mirrored copy.
    if unbuilt:
        split = outside_strategy_scope(lambda: split_unbuilt_sequential(
            model, tuple(input_shape), seed, allow_float16=True))
    else:
        split = outside_strategy_scope(lambda: split_keras_model(model, allow_float16=True,
                                                                 seed=seed))
    if hybrid.scheme == AUTO:
        _choose_scheme(hybrid, split, model.name)
    if not hybrid.model_parallel:
        raise UnsupportedModel("scheme 'data' shards nothing: train the model with "
                               "tf.distribute.MirroredStrategy and plain Keras instead")
    try:
        hybrid.parallel_plan.check_widths(split.head.hidden, hybrid.num_replicas,
                                          split.dense_names[:-1])
    except PlanError as err:
        raise UnsupportedModel(err.message) from None
    with hybrid.scope(), drawing_every_kernel():  # the trunk's variables: mirrored, drawn
        parallel = ParallelModel(hybrid, split, source, seed)
        if keras_files.is_resumable(model):  # a loaded .keras file: its run goes on
            keras_files.read_state(parallel, model)
    for variable in model.weights:  # its head's shards were drawn: the whole never is
        claim(variable)
    return parallel


def _rebuildable_source(model: keras.Model, input_shape: Optional[Sequence[int]] = None) -> dict:
    """The model's config, refused now if Keras cannot rebuild it (not at the first save
    after training). Keras consumes the dict it deserializes: a copy is used. A Sequential
    never built gets `input_shape` as its build shape after the check, so that what saves
    and exports rebuild is built (the check itself builds nothing)."""
    source = keras.saving.serialize_keras_object(model)

    def rebuild():
        with undrawn_large_kernels():  # a rebuilt head of GBs, thrown away: never drawn
            keras.saving.deserialize_keras_object(json.loads(json.dumps(source)))

    try:
        outside_strategy_scope(rebuild)
    except Exception as err:  # noqa: BLE001 -- any failure means save/export would fail
        raise UnsupportedModel(f"model {model.name}: cannot be rebuilt from its config, so it "
                               f"could not be saved ({type(err).__name__}: "
                               f"{str(err).splitlines()[0]}); register custom layers with "
                               "keras.saving.register_keras_serializable") from None
    gc.collect()  # the rebuilt model's layers hold reference cycles
    if input_shape is not None:
        source["config"]["build_input_shape"] = [None, *[int(d) for d in input_shape]]
    return source


def _choose_scheme(hybrid: HybridStrategy, split: KerasSplit, name: str):
    """`scheme="auto"` resolved for this model: the planner's fastest of the schemes that
    shard the head (parallelize refuses 'data')."""
    from owt_tf.models.cost import trunk_cost

    features = int(np.prod(split.trunk.output_shape[1:]))
    return hybrid.choose_scheme(lambda: trunk_cost(split.trunk, features, split.head),
                                split.head.hidden, name, ("owt-a", "owt-b", "owt-c"))
