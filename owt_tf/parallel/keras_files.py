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
from typing import Dict, List

import keras
import numpy as np

from owt_tf.parallel import head_state
from owt_tf.parallel.keras_compile import inner_optimizer as _inner


def _slots_by_weight(optimizer, weights) -> Dict[str, List]:
    """Each weight's slot variables of `optimizer`, in creation (slot) order."""
    named = list(optimizer.variables)
    slots = {}
    for w in weights:
        prefix = w.path.replace("/", "_") + "_"
        slots[w.path] = [v for v in named if v.name.startswith(prefix)
                         and tuple(v.shape) == tuple(w.shape)]
    return slots


def _head_slots_fit(arrays: Dict[str, np.ndarray], slots: Dict[str, List],
                    dense_names: List[str], kind: str) -> bool:
    per_weight = {len(slots.get(f"{name}/kernel", [])) for name in dense_names}
    return (head_state.saved_kind(arrays) == kind and len(per_weight) == 1
            and head_state.saved_slots(arrays) == per_weight.pop())


def write_state(parallel, plain: keras.Model) -> None:
    """Compiles `plain` as `parallel` is and gives its optimizer `parallel`'s state."""
    plain.compile_from_config(parallel.get_compile_config())
    if not plain.optimizer.built:
        plain.optimizer.build(plain.trainable_variables)
    values = {v.name: v.numpy() for v in parallel.optimizer.variables}
    for v in plain.optimizer.variables:
        if v.name in values and np.shape(values[v.name]) == tuple(v.shape):
            v.assign(values[v.name])
    arrays = parallel._head_state()  # pylint: disable=protected-access
    slots = _slots_by_weight(plain.optimizer, plain.trainable_variables)
    names = parallel._dense_names  # pylint: disable=protected-access
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
    slots by name, the FC layers' split into the shards."""
    config = keras.saving.deserialize_keras_object(plain.get_compile_config())
    parallel.compile(**config)
    values = {v.name: v.numpy() for v in plain.optimizer.variables}
    for v in parallel.optimizer.variables:
        if v.name in values and np.shape(values[v.name]) == tuple(v.shape):
            v.assign(values[v.name])
    slots = _slots_by_weight(plain.optimizer, plain.trainable_variables)
    arrays = {head_state.KIND_KEY: head_state.encode_kind(type(_inner(plain.optimizer)).__name__),
              head_state.ITERATIONS_KEY: np.asarray(_inner(plain.optimizer).iterations.numpy())}
    for i, name in enumerate(parallel._dense_names):  # pylint: disable=protected-access
        for part in ("kernel", "bias"):
            for s, slot in enumerate(slots[f"{name}/{part}"]):
                arrays[head_state.slot_key(i, part, s)] = slot.numpy()
    parallel._restore_fc_slots(arrays)  # pylint: disable=protected-access


def is_resumable(model: keras.Model) -> bool:
    """A compiled model whose optimizer holds state (a loaded `.keras` file, a trained model)."""
    optimizer = getattr(model, "optimizer", None)
    return bool(getattr(model, "compiled", False) and optimizer is not None and optimizer.built)
