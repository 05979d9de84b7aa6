"""Every collective op the engine issues, with its gradient, and the one ledger of bytes moved.

Each wrapper issues a tf.distribute collective in replica context and, while a
`TrafficLedger` is recording, adds the bytes one worker sends for it (it receives as many:
all of these collectives are symmetric). Costs follow the ring algorithms that
CollectiveAllReduce (CPU) and NCCL (GPU) use, as docs/paper.md counts them:

    all-gather of a local block of b bytes over K workers:  (K-1) * b
    all-reduce of a tensor of T bytes:                      2 (K-1)/K * T
    reduce-scatter of a tensor of T bytes:                  (K-1)/K * T

Shapes are static, so the ledger is filled once, while a step function is traced; the
backward collectives are counted as their gradient functions are traced. Only each
process's first replica records: the count is per worker (replica), the same for all.

The wrappers define their own gradients with tf.custom_gradient so that the backward
collective is issued (and counted) here too; ReplicaContext.all_gather's built-in gradient
would hide it. The raw collective_ops.all_gather has no gradient at all
(tensorflow/tensorflow#53517), which is why the ReplicaContext methods are used.
"""
from __future__ import annotations

import collections
import contextlib
from fractions import Fraction
from typing import Dict, Iterator, Optional

import tensorflow as tf

# What a byte was moved for. Purposes are the keys of TrafficLedger.by_purpose.
ACTIVATIONS = "activations"  # last conv activations into the FC layers, and their gradient
FC_EXCHANGE = "fc_exchange"  # between FC layers (gather of slices, or colrow's all-reduce)
LOGITS = "logits"  # logits gathered for the loss, or the sharded loss's reductions
LABELS = "labels"  # labels of the examples the FC layers see
CONV_GRAD = "conv_grad"  # all-reduce of trunk gradients
FC_GRAD = "fc_grad"  # all-reduce of FC gradients (pure data parallelism only)
PURPOSES = (ACTIVATIONS, FC_EXCHANGE, LOGITS, LABELS, CONV_GRAD, FC_GRAD)


def all_gather_cost(local_bytes: int, k: int) -> Fraction:
    return Fraction((k - 1) * local_bytes)


def all_reduce_cost(total_bytes: int, k: int) -> Fraction:
    return Fraction(2 * (k - 1) * total_bytes, k)


def reduce_scatter_cost(total_bytes: int, k: int) -> Fraction:
    return Fraction((k - 1) * total_bytes, k)


def tensor_bytes(x) -> int:
    shape = x.shape.as_list() if hasattr(x.shape, "as_list") else list(x.shape)
    if any(d is None for d in shape):
        raise ValueError(f"byte accounting needs static shapes, got {shape}")
    n = 1
    for d in shape:
        n *= int(d)
    return n * x.dtype.size


class TrafficLedger:
    """Bytes one worker sends per step, by purpose and by collective op."""

    def __init__(self) -> None:
        self.by_purpose: Dict[str, Fraction] = collections.defaultdict(Fraction)
        self.by_op: Dict[str, Fraction] = collections.defaultdict(Fraction)
        self.calls = 0

    def add(self, purpose: str, op: str, nbytes: Fraction) -> None:
        if purpose not in PURPOSES:
            raise ValueError(f"unknown traffic purpose {purpose!r}")
        self.by_purpose[purpose] += nbytes
        self.by_op[op] += nbytes
        self.calls += 1

    @property
    def total(self) -> Fraction:
        return sum(self.by_purpose.values(), Fraction(0))

    def summary(self) -> Dict[str, float]:
        return {p: float(self.by_purpose.get(p, 0)) for p in PURPOSES}


_recording: list = []


@contextlib.contextmanager
def recording(ledger: TrafficLedger) -> Iterator[TrafficLedger]:
    """Counts into `ledger` every collective traced inside the block."""
    _recording.append(ledger)
    try:
        yield ledger
    finally:
        _recording.pop()


def record(purpose: str, op: str, nbytes: Fraction) -> None:
    """Adds bytes for a collective issued elsewhere (Keras' gradient all-reduce); counted by
    this process's first replica only."""
    if _recording and _local_replica_id() == 0:
        _recording[-1].add(purpose, op, nbytes)


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
    ctx = _ctx()
    record(purpose, "all_reduce", all_reduce_cost(tensor_bytes(x), ctx.num_replicas_in_sync))
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)


def _all_gather_counted(x: tf.Tensor, axis: int, purpose: str) -> tf.Tensor:
    ctx = _ctx()
    k = ctx.num_replicas_in_sync
    record(purpose, "all_gather", all_gather_cost(tensor_bytes(x), k))
    gathered = ctx.all_gather(x, axis=axis)
    # The strategy's gather allows uneven blocks and so loses the static size of `axis`;
    # every block here is the same size, and later byte counts need the static shape.
    shape = x.shape.as_list()
    shape[axis] *= k
    gathered.set_shape(shape)
    return gathered


def _launcher():
    """The strategy's per-replica collective launcher: its group, instance keys and ordering
    token. Raw collectives inside strategy.run hang unless ordered with the strategy's own
    per-device token (auto control dependencies chain them across replicas otherwise)."""
    ctx = _ctx()
    cross_device_ops = ctx.strategy.extended._cross_device_ops  # pylint: disable=protected-access
    launchers = getattr(cross_device_ops, "_launchers", None)
    if launchers is None:
        raise RuntimeError("owt_tf needs MirroredStrategy with collective ops (CollectiveAllReduce); "
                           f"got {type(cross_device_ops).__name__}")
    return launchers[_local_replica_id()]


def _reduce_scatter_counted(x: tf.Tensor, axis: int, purpose: str) -> tf.Tensor:
    """Sum over replicas of `x`, keeping only this replica's 1/K block along `axis`.

    CollectiveReduceScatterV2 has only an NCCL kernel (tensorflow/tensorflow#59101; on CPU:
    "CollectiveRegistry::Lookup did not find collective implementation"), and ReplicaContext
    has no reduce-scatter, so: an all-to-all that sends block j to replica j, then a local
    sum. Per worker that sends (K-1)/K of x, as a ring reduce-scatter does.
    """
    from tensorflow.python.ops import collective_ops  # the strategy's own collective layer

    k = num_replicas()
    record(purpose, "reduce_scatter", reduce_scatter_cost(tensor_bytes(x), k))
    blocks = tf.stack(tf.split(x, k, axis=axis), axis=0)  # [K, ...block]
    launcher = _launcher()
    with tf.device(launcher._device):  # pylint: disable=protected-access
        exchanged = collective_ops.all_to_all_v2(
            blocks, launcher._group_size, launcher._group_key,  # pylint: disable=protected-access
            launcher._next_instance_key(),  # pylint: disable=protected-access
            ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access
    exchanged.set_shape(blocks.shape)
    return tf.reduce_sum(exchanged, axis=0)


def all_gather(x: tf.Tensor, axis: int, purpose: str) -> tf.Tensor:
    """Concatenates every replica's `x` along `axis`, in replica order. Differentiable.

    Backward: a reduce-scatter; each replica receives only the sum of the gradients for its
    own block, half the bytes of ReplicaContext.all_gather's built-in all-reduce gradient.
    """
    if num_replicas() == 1:
        return x

    @tf.custom_gradient
    def gather(v):
        def grad(dy):
            return _reduce_scatter_counted(dy, axis, purpose)

        return _all_gather_counted(v, axis, purpose), grad

    return gather(x)


def all_reduce_sum(x: tf.Tensor, purpose: str) -> tf.Tensor:
    """Sum of every replica's `x`. Differentiable: the gradient is the summed upstream gradient."""
    if num_replicas() == 1:
        return x

    @tf.custom_gradient
    def reduce(v):
        def grad(dy):
            return _all_reduce_sum_counted(dy, purpose)

        return _all_reduce_sum_counted(v, purpose), grad

    return reduce(x)


def broadcast_from(x: tf.Tensor, source: int, purpose: str) -> tf.Tensor:
    """Replica `source`'s `x` on every replica. Differentiable: `source` gets the summed gradient.

    Issued as an all-reduce of `x` masked to zero off the source. Every replica feeds its own
    `x` into the custom gradient so that all of them take part in the backward reduce
    (docs/design.md: with tf.zeros_like off-tape, backward collectives pair up wrongly).
    """
    k, me = num_replicas(), replica_id()
    if k == 1:
        return x

    @tf.custom_gradient
    def bcast(v):
        contribution = v if me == source else tf.zeros_like(v)

        def grad(dy):
            total = _all_reduce_sum_counted(dy, purpose)
            return total if me == source else tf.zeros_like(total)

        return _all_reduce_sum_counted(contribution, purpose), grad

    return bcast(x)


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
