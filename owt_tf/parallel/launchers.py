"""Shims over TensorFlow internals that the engine's collectives need, in one place.

tf.distribute has no public way to issue a raw collective with a strategy's own group,
instance keys and ordering token, and no reduce-scatter on CPU: these reach into
MirroredStrategy's `CollectiveAllReduce` (its per-replica `CollectiveReplicaLauncher`) and
`collective_ops.all_to_all_v2`. Checked on TF 2.21; a TensorFlow upgrade that moves these
internals breaks here and nowhere else.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.python.ops import collective_ops  # the strategy's own collective layer


def replica_launcher(ctx: tf.distribute.ReplicaContext, local_replica: int):
    """The strategy's per-replica collective launcher: its group, instance keys and ordering
    token. Raw collectives inside strategy.run hang unless ordered with the strategy's own
    per-device token (auto control dependencies chain them across replicas otherwise)."""
    cross_device_ops = ctx.strategy.extended._cross_device_ops  # pylint: disable=protected-access
    launchers = getattr(cross_device_ops, "_launchers", None)
    if launchers is None:
        raise RuntimeError("owt_tf needs MirroredStrategy with collective ops (CollectiveAllReduce); "
                           f"got {type(cross_device_ops).__name__}")
    return launchers[local_replica]


def all_to_all_blocks(launcher, blocks: tf.Tensor) -> tf.Tensor:
    """Sends blocks[j] to replica j; returns [K, ...block]: row i is what replica i sent here."""
    with tf.device(launcher._device):  # pylint: disable=protected-access
        exchanged = collective_ops.all_to_all_v2(
            blocks, launcher._group_size, launcher._group_key,  # pylint: disable=protected-access
            launcher._next_instance_key(),  # pylint: disable=protected-access
            communication_hint=launcher._options.implementation.value,  # pylint: disable=protected-access
            ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access
    exchanged.set_shape(blocks.shape)
    return exchanged


def gather_blocks(launcher, x: tf.Tensor) -> tf.Tensor:
    """Every replica's x concatenated along axis 0: one CollectiveGatherV2 (the launcher's own,
    without ReplicaContext.all_gather's second gather of shapes, pad and K slices)."""
    return launcher._all_gather(x, None)  # pylint: disable=protected-access


def broadcast_ops(launcher):
    """(device, send, recv) of one broadcast: `send(v)` on the source replica,
    `recv(shape, dtype)` on the others, under `device`. Every replica must call this once per
    broadcast, in the same order (each call takes the launcher's next instance key)."""
    keys = dict(group_size=launcher._group_size, group_key=launcher._group_key,  # pylint: disable=protected-access
                instance_key=launcher._next_instance_key(),  # pylint: disable=protected-access
                communication_hint=launcher._options.implementation.value)  # pylint: disable=protected-access

    def send(v):
        return collective_ops.broadcast_send_v2(v, **keys)

    def recv(shape, dtype):
        return collective_ops.broadcast_recv_v2(shape, dtype, **keys)

    return launcher._device, send, recv  # pylint: disable=protected-access
