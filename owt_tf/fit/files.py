"""What a `.keras` file holds of a parallelized model, and how a compiled plain model's
training state enters one.

`model.save` writes the user's plain one-device model, compiled as the parallelized one was,
with its optimizer's state: the trunk optimizer's slots as they are, every FC layer's slots
joined whole from the shards. A plain optimizer names a weight's slot after the weight's
path (`fc1_kernel_momentum`, Keras' `add_variable_from_reference`), so both sides are
matched by name: `keras.models.load_model` + `fit` continues the run as with any plain file,
and `owt_tf.parallelize` of the loaded (compiled) model continues it at any K.

The file holds one optimizer: the trunk's. The FC shards' state goes in only when it fits
that optimizer (same kind, as many slots per weight); a different `fc_optimizer` kind is
left out with a warning.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Tuple

import keras
import numpy as np

from owt_tf.parallel.head import state as head_state
from owt_tf.fit.compiling import inner_optimizer as _inner


SlotKey = Tuple[str, str]  # (layer name, weight name): the same in the plain and parallel models


def _slot_table(optimizer, layers) -> Tuple[Dict[SlotKey, List], Dict[str, object]]:
    """`optimizer`'s slot variables by the weight they belong to, in slot order, and its
    other variables (iteration, learning rate, a loss scale's) by name. A slot is named
    after its weight's path, which depends on the scope the model was built in (a
    Sequential's weights are `model/layer/kernel`, a functional trunk's `layer/kernel`), so
    both sides are keyed by layer and weight names instead."""
    variables = list(optimizer.variables)
    slots: Dict[SlotKey, List] = {}
    for layer in layers:
        for w in layer.trainable_weights:
            prefix = w.path.replace("/", "_") + "_"
            slots[(layer.name, w.name)] = [v for v in variables if v.name.startswith(prefix)
                                           and tuple(v.shape) == tuple(w.shape)]
    taken = {id(v) for group in slots.values() for v in group}
    return slots, {v.name: v for v in variables if id(v) not in taken}


def _layers(model: keras.Model) -> List:
    """Every layer of `model`, nested models' layers included (their weights' slots are keyed
    by the layer that owns the weight)."""
    return list(model._flatten_layers(include_self=False, recursive=True))  # pylint: disable=protected-access


def _copy(source: Tuple[Dict, Dict], target: Tuple[Dict, Dict]) -> None:
    """Every variable of `target` that `source` has, by key, where the shapes agree."""
    for table_from, table_to in zip(source, target):
        for key, to in table_to.items():
            got = table_from.get(key)
            if got is None:
                continue
            pairs = zip(got, to) if isinstance(to, list) else [(got, to)]
            for a, b in pairs:
                if tuple(a.shape) == tuple(b.shape):
                    b.assign(a.numpy() if hasattr(a, "numpy") else a)


def _head_slots(slots: Dict[SlotKey, List], names: List[str]) -> Dict[str, List]:
    return {f"{name}/{part}": slots.get((name, part), []) for name in names
            for part in ("kernel", "bias")}


def _head_slots_fit(arrays: Dict[str, np.ndarray], slots: Dict[str, List],
                    dense_names: List[str], kind: str) -> bool:
    per_weight = {len(slots[f"{name}/kernel"]) for name in dense_names}
    return (head_state.saved_kind(arrays) == kind and len(per_weight) == 1
            and head_state.saved_slots(arrays) == per_weight.pop())


def write_state(parallel, plain: keras.Model) -> None:
    """Compiles `plain` as `parallel` is and gives its optimizer `parallel`'s state."""
    plain.compile_from_config(parallel.get_compile_config())
    if not plain.optimizer.built:
        plain.optimizer.build(plain.trainable_variables)
    target = _slot_table(plain.optimizer, _layers(plain))
    _copy(_slot_table(parallel.optimizer, _layers(parallel.trunk)), target)
    arrays = parallel.head_state()
    names = parallel.dense_names
    slots = _head_slots(target[0], names)
    kind = type(_inner(plain.optimizer)).__name__
    if not _head_slots_fit(arrays, slots, names, kind):
        warnings.warn(f"the FC optimizer ({head_state.saved_kind(arrays)}) is not the file's "
                      f"optimizer ({kind}): its state is left out of the file", stacklevel=3)
        return
    for i, name in enumerate(names):
        for part in ("kernel", "bias"):
            for s, slot in enumerate(slots[f"{name}/{part}"]):
                slot.assign(arrays[head_state.slot_key(i, part, s)])


def read_state(parallel, plain: keras.Model) -> None:
    """Compiles `parallel` as `plain` was and gives it `plain`'s optimizer state: the trunk's
    slots by layer and weight, the FC layers' split into the shards."""
    config = keras.saving.deserialize_keras_object(plain.get_compile_config())
    parallel.compile(**config)
    source = _slot_table(plain.optimizer, _layers(plain))
    _copy(source, _slot_table(parallel.optimizer, _layers(parallel.trunk)))
    names = parallel.dense_names
    slots = _head_slots(source[0], names)
    arrays = {head_state.KIND_KEY: head_state.encode_kind(type(_inner(plain.optimizer)).__name__),
              head_state.ITERATIONS_KEY: np.asarray(_inner(plain.optimizer).iterations.numpy())}
    for i, name in enumerate(names):
        for s, slot in enumerate(slots[f"{name}/kernel"]):
            arrays[head_state.slot_key(i, "kernel", s)] = slot.numpy()
            bias = slots[f"{name}/bias"]  # none on a cosine layer: its zero bias has zero slots
            arrays[head_state.slot_key(i, "bias", s)] = (
                bias[s].numpy() if bias else np.zeros((slot.shape[-1],), np.float32))
    parallel.restore_fc_slots(arrays)


def is_resumable(model: keras.Model) -> bool:
    """A compiled model whose optimizer holds state (a loaded `.keras` file, a trained model)."""
    optimizer = getattr(model, "optimizer", None)
    return bool(getattr(model, "compiled", False) and optimizer is not None and optimizer.built)
