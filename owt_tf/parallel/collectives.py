"""Every collective op the engine issues, with its gradient.

Each wrapper issues one of the strategy's collective ops in replica context, through the
strategy's own per-replica launcher (its group, instance keys and ordering token), and,
while a `TrafficLedger` is recording (owt_tf.planner.ledger, which also holds the cost of
each collective and the purposes re-exported here for the engine's calls), adds the bytes
one worker sends for it (it receives as many: all of these collectives are symmetric).

Shapes are static, so the ledger is filled once, while a step function is traced; the
backward collectives are counted as their gradient functions are traced. Only each
process's first replica records: the count is per worker (replica), the same for all.

The raw collective ops have no gradient (tensorflow/tensorflow#53517): the wrappers define
their own with tf.custom_gradient, so that the backward collective is issued (and counted)
here too; inside `deferred_backward` they issue the forward only and leave the backward
to the caller (backward_of_cut), which sends several rounds' gradients in one launch.
Labels can ride in the activations' collectives as extra columns (pack_riders).
ReplicaContext's methods are not used in a step: each all-gather costs two launches and
O(K) ops there, each all-reduce a merge_call that stops every replica thread
(_all_gather_counted, _all_reduce_sum_counted).

Why one module over 450 lines: the wrappers, their custom gradients, the deferred-backward
cuts and the label riders share the launcher and the counting of every byte; split, each
part would reach into the others' private helpers.
"""
from __future__ import annotations


import contextlib
import dataclasses
from fractions import Fraction
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from owt_tf.parallel import launchers
from owt_tf.planner import ledger
from owt_tf.planner.ledger import (LABELS, all_gather_cost, all_reduce_cost,
                                   all_to_all_keys_collide, broadcast_cost,
                                   engine_reduce_scatter_cost)

def tensor_bytes(x) -> int:
    shape = x.shape.as_list() if hasattr(x.shape, "as_list") else list(x.shape)
    if any(d is None for d in shape):
        raise ValueError(f"byte accounting needs static shapes, got {shape}")
    n = 1
    for d in shape:
        n *= int(d)
    return n * x.dtype.size


def record_gradient_all_reduce(purpose: str, grads: Sequence[tf.Tensor]) -> None:
    """Counts the all-reduce Keras' optimizer issues itself on `grads` (the trunk's, and
    the FC layers' under data parallelism): one packed launch."""
    if grads:
        k = num_replicas()
        record(purpose, "all_reduce", sum(all_reduce_cost(tensor_bytes(g), k) for g in grads))


def record(purpose: str, op: str, nbytes: Fraction, calls: int = 1) -> None:
    """Adds bytes for a collective issued elsewhere (Keras' gradient all-reduce); counted by
    this process's first replica only. One replica issues no collective: nothing counted."""
    book = ledger.current()
    if book is not None and _local_replica_id() == 0 and num_replicas() > 1:
        book.add(purpose, op, nbytes, calls)


def _ctx() -> tf.distribute.ReplicaContext:
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError("owt_tf collectives must run in replica context (inside strategy.run)")
    return ctx


def _replica_id() -> Optional[int]:
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        return None
    rid = tf.get_static_value(ctx.replica_id_in_sync_group)
    if rid is None:
        raise RuntimeError("owt_tf needs a static replica id (MirroredStrategy traces per replica)")
    return int(rid)


def _local_replica_id() -> Optional[int]:
    """The replica's index among this process's replicas (a cluster numbers them task by task)."""
    rid = _replica_id()
    if rid is None:
        return None
    return rid % len(_ctx().strategy.extended.worker_devices)


def num_replicas() -> int:
    return _ctx().num_replicas_in_sync


def replica_id() -> int:
    """This replica's index as a Python int (MirroredStrategy traces once per device)."""
    rid = _replica_id()
    if rid is None:
        raise RuntimeError("replica_id() needs replica context")
    return rid


def _all_reduce_sum_counted(x: tf.Tensor, purpose: str) -> tf.Tensor:
    """Sum of every replica's `x`: one CollectiveReduceV2 through the strategy's launcher.

    ReplicaContext.all_reduce goes through merge_call: every call stops all K replica
    threads until the last arrives, which dominates tracing when a step issues hundreds.
    """
    record(purpose, "all_reduce", all_reduce_cost(tensor_bytes(x), num_replicas()))
    return _launcher().all_reduce(x)


def _record_with_riders(purpose: str, op: str, cost, x: tf.Tensor, riders: int) -> None:
    """One launch of `op` on x: its last `riders` columns (labels riding along) counted as
    LABELS bytes, with no launch of their own."""
    k = num_replicas()
    rider_bytes = int(x.shape[0]) * riders * x.dtype.size
    record(purpose, op, cost(tensor_bytes(x) - rider_bytes, k))
    if riders:
        record(LABELS, op, cost(rider_bytes, k), calls=0)


def _all_gather_counted(x: tf.Tensor, axis: int, purpose: str, riders: int = 0) -> tf.Tensor:
    """Every replica's `x` (the same static shape everywhere), concatenated along `axis`.

    One CollectiveGatherV2 through the strategy's launcher. ReplicaContext.all_gather allows
    uneven blocks, and pays for it: a second gather of every replica's shape, a pad, and K
    slices and a concat per call (tensorflow/python/distribute/cross_device_utils.py,
    CollectiveReplicaLauncher.all_gather): twice the launches, and O(K) ops per gather on
    every replica, so O(K^3) ops per scheme (b) step (46k graph nodes and 38 s of tracing at
    K = 8; minutes at K = 16).
    """
    k = num_replicas()
    _record_with_riders(purpose, "all_gather", all_gather_cost, x, riders)
    rank = len(x.shape)
    to_front = [axis] + [i for i in range(rank) if i != axis]
    launcher = _launcher()
    gathered = _carried_as_float16(x, lambda v: launchers.gather_blocks(
        launcher, tf.transpose(v, to_front) if axis else v))
    if axis:
        gathered = tf.transpose(gathered, [to_front.index(i) for i in range(rank)])
    shape = x.shape.as_list()
    shape[axis] *= k
    gathered.set_shape(shape)
    return gathered


def _launcher():
    """This replica's launcher of the strategy's collectives (owt_tf.parallel.launchers)."""
    return launchers.replica_launcher(_ctx(), _local_replica_id())


def _reduce_scatter_counted(x: tf.Tensor, axis: int, purpose: str) -> tf.Tensor:
    """Sum over replicas of `x`, keeping only this replica's 1/K block along `axis`.

    CollectiveReduceScatterV2 has only an NCCL kernel (tensorflow/tensorflow#59101; on CPU:
    "CollectiveRegistry::Lookup did not find collective implementation"), and ReplicaContext
    has no reduce-scatter, so: an all-to-all that sends block j to replica j, then a local
    sum. Per worker that sends (K-1)/K of x, as a ring reduce-scatter does. Where TF's
    all-to-all cannot run (K >= 12, all_to_all_keys_collide), an all-reduce and this
    replica's block of it: correct at twice the bytes, and counted as such.
    """
    k = num_replicas()
    record(purpose, "reduce_scatter", engine_reduce_scatter_cost(tensor_bytes(x), k))
    if all_to_all_keys_collide(k):
        return tf.split(_launcher().all_reduce(x), k, axis=axis)[replica_id()]
    return tf.reduce_sum(launchers.all_to_all_blocks(_launcher(), tf.stack(tf.split(x, k, axis=axis), axis=0)), axis=0)


def all_gather(x: tf.Tensor, axis: int, purpose: str) -> tf.Tensor:
    """Concatenates every replica's `x` along `axis`, in replica order. Differentiable.

    Backward: a reduce-scatter; each replica receives only the sum of the gradients for its
    own block, half the bytes of ReplicaContext.all_gather's built-in all-reduce gradient.
    """
    if num_replicas() == 1:
        return x
    if _deferring_for(x):
        return _defer(x, _all_gather_counted(tf.stop_gradient(x), axis, purpose), GATHER, axis, purpose)

    @tf.custom_gradient
    def gather(v):
        def grad(dy):
            return _reduce_scatter_counted(dy, axis, purpose)

        return _all_gather_counted(v, axis, purpose), grad

    return gather(x)


def sum_of_values(x: tf.Tensor, purpose: str) -> tf.Tensor:
    """Sum of every replica's `x`, for values no gradient flows through (BatchNormalization's
    moving statistics): no custom gradient is registered (owt_tf.parallel.gradients)."""
    return x if num_replicas() == 1 else _all_reduce_sum_counted(tf.stop_gradient(x), purpose)


def all_reduce_sum(x: tf.Tensor, purpose: str) -> tf.Tensor:
    """Sum of every replica's `x`. Differentiable: the gradient is the summed upstream gradient."""
    if num_replicas() == 1:
        return x
    if _deferring_for(x):
        return _defer(x, _all_reduce_sum_counted(tf.stop_gradient(x), purpose), SUM, 0, purpose)

    @tf.custom_gradient
    def reduce(v):
        def grad(dy):
            return _all_reduce_sum_counted(dy, purpose)

        return _all_reduce_sum_counted(v, purpose), grad

    return reduce(x)


GATHER, SUM = "gather", "sum"


@dataclasses.dataclass(frozen=True)
class Cut:
    """A differentiable collective issued forward only, its backward left to
    `backward_of_cut`: `received` is watched on the tape, cut off from `local`."""

    local: tf.Tensor  # what this replica contributed
    received: tf.Tensor  # what the collective returned
    kind: str  # GATHER (backward: reduce-scatter along `axis`) or SUM (backward: all-reduce)
    axis: int
    purpose: str


_deferring: list = []  # (tape, cuts) of each open deferred_backward block


@contextlib.contextmanager
def deferred_backward(tape: tf.GradientTape) -> Iterator[List[Cut]]:
    """Inside the block, all_gather and all_reduce_sum of tensors `tape` differentiates
    issue their forward collective only and list it as a Cut, in program order: the caller
    issues their backward collectives itself (backward_of_cut), in an order of its choosing
    that is the same on every replica."""
    cuts: List[Cut] = []
    _deferring.append((tape, cuts))
    try:
        yield cuts
    finally:
        _deferring.pop()


def _deferring_for(x: tf.Tensor) -> bool:
    from tensorflow.python.eager import record as tape_record  # what tf.custom_gradient asks too

    # A tensor no tape differentiates (the sharded loss's max) takes the ordinary path,
    # which issues no backward collective for it either.
    return bool(_deferring) and tape_record.should_record_backprop([x])


def _defer(local: tf.Tensor, received: tf.Tensor, kind: str, axis: int, purpose: str) -> tf.Tensor:
    tape, cuts = _deferring[-1]
    tape.watch(received)
    cuts.append(Cut(local, received, kind, axis, purpose))
    return received


def backward_of_cut(cut: Cut, grad: tf.Tensor) -> tf.Tensor:
    """The gradient for `cut.local`, given the one for `cut.received`: the backward
    collective all_gather or all_reduce_sum would have issued."""
    if cut.kind == GATHER:
        return _reduce_scatter_counted(grad, cut.axis, cut.purpose)
    return _all_reduce_sum_counted(grad, cut.purpose)


# Labels ride in the activations' collectives as float columns: exact for integers up to
# 2^24 in magnitude, and TF's CPU gather takes no mix of dtypes.
MAX_RIDING_CLASSES = 2 ** 24


def pack_riders(x: tf.Tensor, labels: tf.Tensor, num_classes: int) -> Optional[tf.Tensor]:
    """x [rows, d] with the labels appended as float columns, for one collective that moves
    both; None where that would not be exact or possible (unpack_riders undoes it)."""
    if x.dtype != tf.float32 or x.shape.rank != 2 or labels.shape.rank is None:
        return None
    if labels.dtype == tf.int32 and labels.shape.rank == 1 and num_classes <= MAX_RIDING_CLASSES:
        columns = tf.cast(labels, tf.float32)[:, None]
    elif labels.dtype == tf.float32 and labels.shape.is_fully_defined():
        columns = tf.reshape(labels, [labels.shape[0], -1])
    else:
        return None
    return tf.concat([x, columns], axis=1)


def rider_columns(labels: tf.Tensor) -> int:
    """How many columns pack_riders appends for `labels`."""
    return 1 if labels.shape.rank == 1 else int(np.prod(labels.shape.as_list()[1:]))


def unpack_riders(packed: tf.Tensor, like: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """(x, labels) from rows packed by pack_riders; `like`: this replica's own labels."""
    riders = rider_columns(like)
    # one Split, not slices: it runs once per round on every replica (K x K per step)
    x, columns = tf.split(packed, [int(packed.shape[1]) - riders, riders], axis=1)
    if like.dtype == tf.int32:
        return x, tf.cast(tf.reshape(columns, [-1]), tf.int32)
    return x, tf.reshape(columns, [-1] + like.shape.as_list()[1:])


def _drop_riders(dy: tf.Tensor, riders: int) -> tf.Tensor:
    return dy[:, :int(dy.shape[1]) - riders] if riders else dy


def _without_riders_back(collective, dy: tf.Tensor, riders: int, purpose: str) -> tf.Tensor:
    """`collective(dy, 0, purpose)` on the gradient without the rider columns, which carry
    none, and zeros in their place so that the shape is the packed input's."""
    out = collective(dy, 0, purpose)
    if not riders:
        return out
    return tf.concat([out, tf.zeros([out.shape[0], riders], out.dtype)], axis=1)


def broadcast_rounds(x: tf.Tensor, purpose: str, riders: int = 0,
                     scope: str = "exchange_round") -> List[tf.Tensor]:
    """Every replica's `x`, on every replica: K broadcasts, round r's from replica r (each
    under the name scope f"{scope}{r}"). Differentiable.

    Backward: one reduce-scatter of the K rounds' gradients, so that each replica receives
    the sum of the gradients for its own rows only: the paper's "back to the worker that
    owns those examples", (K-1)/K of the K rounds' gradient bytes, as scheme (a)'s backward.
    The last `riders` columns of x (labels: pack_riders) travel forward only.
    """
    k = num_replicas()
    if k == 1:
        return [x]

    @tf.custom_gradient
    def bcast(v):
        received = []
        for r in range(k):
            with tf.name_scope(f"{scope}{r}"):
                after = received[-1:]  # this replica's broadcasts in round order (NCCL needs one order)
                with tf.control_dependencies(after):
                    received.append(_broadcast_counted(v, r, purpose, riders))

        def grad(*dys):
            return _without_riders_back(_reduce_scatter_counted, _drop_riders(tf.concat(dys, 0), riders),
                                        riders, purpose)

        return received, grad

    return bcast(x)


def gather_rounds(x: tf.Tensor, rounds: int, purpose: str, riders: int = 0,
                  scope: str = "exchange_round") -> List[tf.Tensor]:
    """Round r: rows r*s ... (r+1)*s-1 of every replica's `x` (s = rows / rounds), gathered
    in replica order, each round under the name scope f"{scope}{r}". Differentiable.

    Backward: one reduce-scatter of all rounds' gradients, each replica's rows put back in
    its own order, instead of one per round: the same sums, `rounds` times fewer launches.
    The last `riders` columns of x (labels: pack_riders) travel forward only.
    """
    k = num_replicas()
    s = int(x.shape[0]) // rounds
    if k == 1:
        return [x[r * s:(r + 1) * s] for r in range(rounds)]

    @tf.custom_gradient
    def gather(v):
        received = []
        for r in range(rounds):
            with tf.name_scope(f"{scope}{r}"):
                received.append(_all_gather_counted(v[r * s:(r + 1) * s], 0, purpose, riders))

        def grad(*dys):
            # replica j's rows of every round, in round order: its own x's row order (one
            # transpose, not K x rounds slices: at K=16 those were most of the traced ops)
            by_round = tf.reshape(tf.stack(dys), [rounds, k, s, -1])
            by_owner = tf.reshape(tf.transpose(by_round, [1, 0, 2, 3]), [k * rounds * s, -1])
            return _without_riders_back(_reduce_scatter_counted, _drop_riders(by_owner, riders),
                                        riders, purpose)

        return received, grad

    return gather(x)


def _broadcast_counted(x: tf.Tensor, source: int, purpose: str, riders: int = 0) -> tf.Tensor:
    """Replica `source`'s `x` on every replica: one CollectiveBcastSendV2 / RecvV2 pair.

    TF's broadcast ops take no ordering token; auto control dependencies leave them
    unordered on purpose (tensorflow/python/framework/auto_control_deps.py,
    ASYNC_STATEFUL_OPS), so unlike the all-to-all they need none to avoid a hang.
    """
    _record_with_riders(purpose, "broadcast", broadcast_cost, x, riders)
    device, send, recv = launchers.broadcast_ops(_launcher())
    with tf.device(device):
        if replica_id() == source:
            return _carried_as_float16(x, send)
        # A receive needs only x's static shape, so nothing would hold it back: when the
        # step's input fails (Keras' last call of an epoch ends in get_next's OutOfRange),
        # it would already be waiting for a send that never comes, and the failed step
        # waits for it forever. It waits for this replica's own x instead.
        with tf.control_dependencies([x]):
            received = _carried_as_float16(x, lambda v: recv(tf.shape(v), v.dtype))
    received.set_shape(x.shape)
    return received


def _carried_as_float16(x: tf.Tensor, move) -> tf.Tensor:
    """move(x), a collective that only moves x's bytes; a bfloat16 x travels bit-cast to
    float16 and comes back bfloat16: CollectiveGatherV2 and CollectiveBcastSend/RecvV2 accept
    no bfloat16 (their kernels are registered for float16 and not for bfloat16), while
    CollectiveReduceV2 and CollectiveAllToAllV2 do. Exact: no arithmetic touches the bits."""
    if x.dtype != tf.bfloat16:
        return move(x)
    return tf.bitcast(move(tf.bitcast(x, tf.float16)), tf.bfloat16)


def gather_labels(y: tf.Tensor) -> tf.Tensor:
    """All replicas' labels, concatenated in replica order (no gradient)."""
    if num_replicas() == 1:
        return y
    return _all_gather_counted(y, 0, LABELS)


def gather_shard_values(values: list) -> list:
    """Every replica's `values` (a list of tensors, the same shapes on every replica), each
    stacked over replicas in replica order: [K, ...]. Not differentiable, not counted in the
    step's ledger: it serves checkpoints and exports, between steps."""
    ctx = _ctx()
    return [ctx.all_gather(tf.expand_dims(v, 0), axis=0) for v in values]
