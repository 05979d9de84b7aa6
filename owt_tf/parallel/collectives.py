"""Every collective op the engine issues, with its gradient, and the one ledger of bytes moved.

Each wrapper issues one of the strategy's collective ops in replica context, through the
strategy's own per-replica launcher (its group, instance keys and ordering token), and,
while a `TrafficLedger` is recording, adds the bytes one worker sends for it (it receives as many:
all of these collectives are symmetric). Costs follow the ring algorithms that
CollectiveAllReduce (CPU) and NCCL (GPU) use, as docs/paper.md counts them:

    all-gather of a local block of b bytes over K workers:  (K-1) * b
    all-reduce of a tensor of T bytes:                      2 (K-1)/K * T
    reduce-scatter of a tensor of T bytes:                  (K-1)/K * T
    broadcast of b bytes (average over the K sources):     (K-1)/K * b

except that this module's reduce-scatter is an all-reduce from K = 12 on
(engine_reduce_scatter_cost, _reduce_scatter_counted).

Shapes are static, so the ledger is filled once, while a step function is traced; the
backward collectives are counted as their gradient functions are traced. Only each
process's first replica records: the count is per worker (replica), the same for all.

The raw collective ops have no gradient (tensorflow/tensorflow#53517): the wrappers define
their own with tf.custom_gradient, so that the backward collective is issued (and counted)
here too. ReplicaContext's methods are not used in a step: each all-gather costs two
launches and O(K) ops there, each all-reduce a merge_call that stops every replica thread
(_all_gather_counted, _all_reduce_sum_counted).
"""
from __future__ import annotations

import collections
import contextlib
import functools
from fractions import Fraction
from typing import Dict, Iterator, List, Optional

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


def broadcast_cost(nbytes: int, k: int) -> Fraction:
    """(K-1)/K * b per worker for one broadcast of b bytes: every other replica receives it
    once, (K-1) * b in all, whatever tree TF relays it along (CPU: a binary tree). Scheme (b)
    broadcasts once from every replica per step, so over a step each worker sends (K-1) * b
    per round's block on average, as many as when the source sends K-1 copies itself."""
    return Fraction((k - 1) * nbytes, k)


def engine_reduce_scatter_cost(total_bytes: int, k: int) -> Fraction:
    """What this module's reduce-scatter sends per worker: an all-to-all's (K-1)/K * T, or
    where TF's all-to-all cannot run (all_to_all_keys_collide), the all-reduce it falls back to."""
    if all_to_all_keys_collide(k):
        return all_reduce_cost(total_bytes, k)
    return reduce_scatter_cost(total_bytes, k)


@functools.lru_cache(maxsize=None)
def all_to_all_keys_collide(k: int) -> bool:
    """Whether TF's all-to-all over K replicas gives two of its blocks the same rendezvous key.

    TF names the block that replica i sends to replica j `exec_key + str(i) + str(j)`, with no
    separator (tensorflow/core/common_runtime/all_to_all.cc, AllToAll::DispatchSend; TF 2.21).
    From K = 12 on, two blocks share a key ((1, 10) and (11, 0) are both "110"): the op fails
    with "Second consumer arrived for key ..." or "BufRendezvous::ProvideBuf already called",
    or could hand a block to the wrong replica.
    """
    keys = {f"{i}{j}" for i in range(k) for j in range(k)}
    return len(keys) < k * k


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
    """Sum of every replica's `x`: one CollectiveReduceV2 through the strategy's launcher.

    ReplicaContext.all_reduce goes through merge_call: every call stops all K replica
    threads until the last arrives, which dominates tracing when a step issues hundreds.
    """
    record(purpose, "all_reduce", all_reduce_cost(tensor_bytes(x), num_replicas()))
    return _launcher().all_reduce(x)


def _all_gather_counted(x: tf.Tensor, axis: int, purpose: str) -> tf.Tensor:
    """Every replica's `x` (the same static shape everywhere), concatenated along `axis`.

    One CollectiveGatherV2 through the strategy's launcher. ReplicaContext.all_gather allows
    uneven blocks, and pays for it: a second gather of every replica's shape, a pad, and K
    slices and a concat per call (tensorflow/python/distribute/cross_device_utils.py,
    CollectiveReplicaLauncher.all_gather): twice the launches, and O(K) ops per gather on
    every replica, so O(K^3) ops per scheme (b) step (46k graph nodes and 38 s of tracing at
    K = 8; minutes at K = 16).
    """
    k = num_replicas()
    record(purpose, "all_gather", all_gather_cost(tensor_bytes(x), k))
    rank = len(x.shape)
    to_front = [axis] + [i for i in range(rank) if i != axis]
    launcher = _launcher()
    gathered = launcher._all_gather(  # pylint: disable=protected-access
        tf.transpose(x, to_front) if axis else x, None)
    if axis:
        gathered = tf.transpose(gathered, [to_front.index(i) for i in range(rank)])
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
    sum. Per worker that sends (K-1)/K of x, as a ring reduce-scatter does. Where TF's
    all-to-all cannot run (K >= 12, all_to_all_keys_collide), an all-reduce and this
    replica's block of it: correct at twice the bytes, and counted as such.
    """
    k = num_replicas()
    record(purpose, "reduce_scatter", engine_reduce_scatter_cost(tensor_bytes(x), k))
    if all_to_all_keys_collide(k):
        return tf.split(_launcher().all_reduce(x), k, axis=axis)[replica_id()]
    return tf.reduce_sum(_all_to_all_blocks(tf.stack(tf.split(x, k, axis=axis), axis=0)), axis=0)


def _all_to_all_blocks(blocks: tf.Tensor) -> tf.Tensor:
    """Sends blocks[j] to replica j; returns [K, ...block]: row i is what replica i sent here."""
    from tensorflow.python.ops import collective_ops  # the strategy's own collective layer

    launcher = _launcher()
    with tf.device(launcher._device):  # pylint: disable=protected-access
        exchanged = collective_ops.all_to_all_v2(
            blocks, launcher._group_size, launcher._group_key,  # pylint: disable=protected-access
            launcher._next_instance_key(),  # pylint: disable=protected-access
            communication_hint=launcher._options.implementation.value,  # pylint: disable=protected-access
            ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access
    exchanged.set_shape(blocks.shape)
    return exchanged


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


def broadcast_rounds(x: tf.Tensor, purpose: str, scope: str = "exchange_round") -> List[tf.Tensor]:
    """Every replica's `x`, on every replica: K broadcasts, round r's from replica r (each
    under the name scope f"{scope}{r}"). Differentiable.

    Backward: one reduce-scatter of the K rounds' gradients, so that each replica receives
    the sum of the gradients for its own rows only: the paper's "back to the worker that
    owns those examples", (K-1)/K of the K rounds' gradient bytes, as scheme (a)'s backward.
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
                    received.append(_broadcast_counted(v, r, purpose))

        def grad(*dys):
            return _reduce_scatter_counted(tf.concat(dys, 0), 0, purpose)

        return received, grad

    return bcast(x)


def _broadcast_counted(x: tf.Tensor, source: int, purpose: str) -> tf.Tensor:
    """Replica `source`'s `x` on every replica: one CollectiveBcastSendV2 / RecvV2 pair.

    TF's broadcast ops take no ordering token; auto control dependencies leave them
    unordered on purpose (tensorflow/python/framework/auto_control_deps.py,
    ASYNC_STATEFUL_OPS), so unlike the all-to-all they need none to avoid a hang.
    """
    from tensorflow.python.ops import collective_ops  # the strategy's own collective layer

    k = num_replicas()
    record(purpose, "broadcast", broadcast_cost(tensor_bytes(x), k))
    launcher = _launcher()
    keys = dict(group_size=launcher._group_size, group_key=launcher._group_key,  # pylint: disable=protected-access
                instance_key=launcher._next_instance_key(),  # pylint: disable=protected-access
                communication_hint=launcher._options.implementation.value)  # pylint: disable=protected-access
    with tf.device(launcher._device):  # pylint: disable=protected-access
        if replica_id() == source:
            return collective_ops.broadcast_send_v2(x, **keys)
        # A receive needs only x's static shape, so nothing would hold it back: when the
        # step's input fails (Keras' last call of an epoch ends in get_next's OutOfRange),
        # it would already be waiting for a send that never comes, and the failed step
        # waits for it forever. It waits for this replica's own x instead.
        with tf.control_dependencies([x]):
            received = collective_ops.broadcast_recv_v2(tf.shape(x), x.dtype, **keys)
    received.set_shape(x.shape)
    return received


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
