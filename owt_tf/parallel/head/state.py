"""The state of the FC shards: what drives them (one shard-optimizer interface) and how their
weights and optimizer slots are saved (whole tensors, one key scheme), for both front doors.

A sharded head is saved whole, never per shard: per-shard variables would not restore at
another K ("Received incompatible tensor with shape (256, 16) ... (256, 32)"). The CLI's
checkpoints (owt_tf.training.files.checkpoint.FcState) and Keras' weight files
(ParallelModel.save_own_variables) both write `head_arrays` and read `restore_head`:

    fc{i}_kernel, fc{i}_bias                 layer i, whole and unpadded
    fc{i}_kernel_slot{s}, fc{i}_bias_slot{s}  the FC optimizer's slot s for them
    fc_optimizer_kind                        the optimizer's class name (uint8 text)
    fc_iterations                            its update count (where it keeps one)

Checkpoints written before this scheme named SGD's momentum `fc{i}_kernel_momentum`: they
load as slot 0 of an SGD (`LEGACY_SGD_SLOT`). Slots restore only into the same kind of
optimizer with as many slots (Keras' rule for optimizer state that does not match).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.parallel.head.layout import (ShardedHead, ShardReader, read_local_shards,
                                         whole_kernel_blocks)
from owt_tf.parallel.head.sampling import SampledColumns

KIND_KEY = "fc_optimizer_kind"
ITERATIONS_KEY = "fc_iterations"
LEGACY_SGD_SLOT = "_momentum"  # slot 0 of the CLI's SGD in checkpoints before this scheme


class HeadStateMismatch(ValueError):
    """Saved FC state that does not fit this head (another width or class count)."""


class ShardOptimizer(Protocol):
    """What updates the FC shards of one process: the CLI's SGD (owt_tf.training.optim) and
    Keras optimizers cloned per shard (owt_tf.fit.model) implement it."""

    kind: str  # the optimizer's class name: slots restore only into the same kind
    num_slots: int  # state tensors per weight (SGD with momentum: 1, Adam: 2)

    def apply(self, shard: int, grads: Sequence[tf.Tensor],
              sample: Optional[SampledColumns] = None) -> None:
        """One update of shard `shard` with its gradients (in head.shard_variables order;
        under a class `sample`, the class layer's of its sampled rows: only they move,
        owt_tf.parallel.head.update)."""

    def slots(self, shard: int) -> List[tf.Variable]:
        """Shard `shard`'s state, slot by slot, each in head.shard_variables order."""

    @property
    def iterations(self) -> Optional[tf.Variable]:
        """Its update count, or None where the run's step counts for it."""


def weight_key(i: int, part: str) -> str:
    return f"fc{i}_{part}"


def slot_key(i: int, part: str, slot: int) -> str:
    # Names without "/": TF escapes "/" differently when saving and restoring these tensors.
    return f"fc{i}_{part}_slot{slot}"


def encode_kind(kind: str) -> np.ndarray:
    return np.frombuffer(kind.encode(), np.uint8)


def decode_kind(value) -> str:
    return bytes(np.asarray(value, np.uint8)).decode()


def head_arrays(head: ShardedHead, optimizer: Optional[ShardOptimizer] = None,
                read: ShardReader = read_local_shards) -> Dict[str, np.ndarray]:
    """Every FC layer whole, and (with `optimizer`) its slots, under the keys above. `read`:
    how this process reads every shard (in a cluster a collective: every worker calls it)."""
    slots = optimizer.num_slots if optimizer is not None else 0

    def state(k):
        return head.shard_variables(k) + (list(optimizer.slots(k)) if slots else [])

    values = read({k: state(k) for k in head.local_shards})
    arrays = {}
    for group, layers in enumerate(head.join_groups(values, 1 + slots)):
        for i, (kernel, bias) in enumerate(layers):
            for part, value in (("kernel", kernel), ("bias", bias)):
                arrays[weight_key(i, part) if group == 0 else slot_key(i, part, group - 1)] = value
    if optimizer is not None:
        arrays[KIND_KEY] = encode_kind(optimizer.kind)
        if optimizer.iterations is not None:
            arrays[ITERATIONS_KEY] = np.asarray(optimizer.iterations.numpy())
    return arrays


# Writes one whole tensor of the head a part at a time: (key, whole shape, dtype, parts), the
# parts as (index into the whole, value) pairs.
PartWriter = Callable[[str, Tuple[int, ...], np.dtype, Iterable[Tuple[tuple, np.ndarray]]], None]


def write_head_parts(head: ShardedHead, optimizer: Optional[ShardOptimizer],
                     write: PartWriter) -> Dict[str, np.ndarray]:
    """head_arrays' tensors, each written shard by shard through `write` (a file that takes
    a tensor a part at a time: no whole copy in memory; every shard must be in this
    process). Returns the small entries (optimizer kind, update count) for the caller to
    store as they are."""
    slots = optimizer.num_slots if optimizer is not None else 0
    n = 2 * len(head.layers)
    for group in range(1 + slots):
        for i, layer in enumerate(head.layers):
            def state(k, j):
                variables = head.shard_variables(k) + (list(optimizer.slots(k)) if slots else [])
                return variables[group * n + 2 * i + j]

            def name(part):
                return weight_key(i, part) if group == 0 else slot_key(i, part, group - 1)

            write(name("kernel"), (layer.in_dim, layer.out_dim), np.dtype("float32"),
                  ((index, np.asarray(block)) for index, block in
                   whole_kernel_blocks(layer, lambda k: state(k, 0))))
            bias = np.concatenate([np.asarray(state(k, 1)) for k in range(layer.num_shards)])
            write(name("bias"), (layer.out_dim,), np.dtype("float32"),
                  [((slice(None),), bias[:layer.out_dim])])
    small = {}
    if optimizer is not None:
        small[KIND_KEY] = encode_kind(optimizer.kind)
        if optimizer.iterations is not None:
            small[ITERATIONS_KEY] = np.asarray(optimizer.iterations.numpy())
    return small


def saved_slots(arrays: Dict[str, np.ndarray]) -> int:
    """How many slots per weight `arrays` hold (legacy SGD momentum counts as one)."""
    if weight_key(0, "kernel") + LEGACY_SGD_SLOT in arrays:
        return 1
    return len({k.rsplit("_slot", 1)[1] for k in arrays if "_slot" in k})


def saved_kind(arrays: Dict[str, np.ndarray]) -> Optional[str]:
    if KIND_KEY in arrays:
        return decode_kind(arrays[KIND_KEY])
    if weight_key(0, "kernel") + LEGACY_SGD_SLOT in arrays:
        return "SGD"
    return None  # a Keras file written before the kind was kept


def slots_fit(arrays: Dict[str, np.ndarray], optimizer: ShardOptimizer) -> bool:
    """Whether `arrays` hold slots this optimizer can take: same kind, as many slots."""
    return ((saved_kind(arrays) or optimizer.kind) == optimizer.kind
            and saved_slots(arrays) == optimizer.num_slots)


def _slot_array(arrays, i: int, part: str, slot: int) -> np.ndarray:
    legacy = weight_key(i, part) + LEGACY_SGD_SLOT
    return _lazy(arrays[legacy] if legacy in arrays else arrays[slot_key(i, part, slot)])


def _lazy(value):
    """An array, or an array-like read in slices (h5py's Dataset) left unread."""
    return value if hasattr(value, "shape") and hasattr(value, "dtype") else np.asarray(value)


def restore_weights(head: ShardedHead, arrays: Dict[str, np.ndarray],
                    names: Optional[Sequence[str]] = None) -> List:
    """Assigns every FC layer from its whole (kernel, bias) to this process's shards; the
    assign ops (eager: already run). `names`: the layers' names for the error message."""
    ops = []
    for i, layer in enumerate(head.layers):
        # Read a shard at a time where the store allows it (an HDF5 dataset): whole arrays
        # of a 10M-class head would not fit next to the shards.
        kernel = _lazy(arrays[weight_key(i, "kernel")])
        bias = np.asarray(arrays[weight_key(i, "bias")])
        if tuple(kernel.shape) != (layer.in_dim, layer.out_dim):
            name = names[i] if names else f"FC layer {i}"
            raise HeadStateMismatch(f"{name}: saved as {kernel.shape}, this model has "
                                    f"{(layer.in_dim, layer.out_dim)}")
        ops += head.assign_whole(head.shard_variables, 0, i, kernel, bias)
    return ops


def restore_slots(head: ShardedHead, arrays: Dict[str, np.ndarray],
                  optimizer: ShardOptimizer) -> List:
    """Assigns the optimizer's slots (and update count) from `arrays`; call after
    `slots_fit` said they fit."""
    ops = []
    for s in range(optimizer.num_slots):
        for i in range(len(head.layers)):
            ops += head.assign_whole(lambda k: head.shard_variables(k) + list(optimizer.slots(k)),
                                     1 + s, i, _slot_array(arrays, i, "kernel", s),
                                     _slot_array(arrays, i, "bias", s))
    if optimizer.iterations is not None and ITERATIONS_KEY in arrays:
        ops.append(optimizer.iterations.assign(int(np.asarray(arrays[ITERATIONS_KEY]))))
    return ops
