"""The one FC forward pass of the sharded head: training, evaluation, prediction and export
run it, on a shard inside a replica (collectives between layers) or with every shard
joined on one device.

    logits_k = forward(head, rows, k, training, seed)      shard k's logits of every row
    logits   = forward(head, rows, None, False, None)      every shard joined, one device
"""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from owt_tf.parallel import collectives as coll
from owt_tf.parallel.head.exchange import exchange, gather
from owt_tf.parallel.head.layout import COL, ROW, SampledRows, ShardedHead


def forward(head: ShardedHead, x: tf.Tensor, k: Optional[int], training: bool, seed: Optional[tf.Tensor]) -> tf.Tensor:
    """Rows `x` (the same on every replica) through the FC layers; returns shard k's logits.

    Between layers: a column-split layer's output slices are all-gathered, unless the next
    layer is row-split and takes the slice as it is; a row-split layer's partial sums are
    all-reduced. This is the one FC forward pass: training, evaluation, prediction and
    export run it; `k` None runs it with every shard joined on one device (a plain
    `model(x)`, Keras' symbolic build).
    """
    return forward_rounds(head, [x], k, training, seed)


def forward_rounds(head: ShardedHead, xs: Sequence[tf.Tensor], k: Optional[int], training: bool,
                   seed: Optional[tf.Tensor], rounds: Optional[Sequence[int]] = None,
                   sample: Optional[SampledRows] = None) -> tf.Tensor:
    """`forward` of the rows of one FC update's rounds: shard k's logits of all of them, in
    order. Each round's first product on its own (xs[i] under the name scope
    f"fc_round{rounds[i]}" when rounds are given: it may start as soon as that round's rows
    arrive), then every round's rows as one, dropout masks drawn from `seed`: joined, a
    step's graph holds each later op once, not once per round (K x K per step, and the
    first step's wait grew with it). With a `sample` (the class layer's sampled_rows) the
    logits are of its classes only: [rows, S]. `k` None: every shard joined on this device,
    no collective, unpadded logits (inference only; all shards in this process)."""
    joined = k is None
    if joined and (training or sample is not None):
        raise ValueError("the joined forward pass is inference only")
    layers = head.layers
    xs = [tf.cast(x, head.compute_dtype) for x in xs]
    for i, layer in enumerate(layers[:-1]):
        z = _product(layer, xs, k, rounds)
        if not joined and layer.split == ROW:
            z = exchange(head, coll.all_reduce_sum, z)
        # A ROW layer's output is whole and identical on every replica: same mask for all.
        salt = k if layer.split == COL and not joined else 0
        h = _dropout(head, _activate(head, i, z), training, seed, i, salt)
        if not joined and layer.split == COL and layers[i + 1].split == COL:
            h = gather(head, h)
        xs, rounds = [h], None
    return _product(layers[-1], xs, k, rounds, sample)


def _product(layer, xs: Sequence[tf.Tensor], k: Optional[int], rounds: Optional[Sequence[int]],
             sample: Optional[SampledRows] = None) -> tf.Tensor:
    """The layer's x @ kernel + bias of every round's rows, each round's product on its own,
    joined along the rows (shard k's, or every shard's when k is None)."""
    if k is None:
        return layer.joined_rounds(xs, rounds)
    return layer.forward_shard_rounds(xs, k, rounds, sample)


def _activate(head, i: int, z: tf.Tensor) -> tf.Tensor:
    return tf.nn.relu(z) if head.spec.hidden_activation(i) == "relu" else z


def _dropout(head, h, training, seed, layer_index, salt):
    rate = head.spec.hidden_dropout(layer_index)
    if not training or rate == 0.0:
        return h
    layer_seed = tf.random.experimental.stateless_fold_in(seed, layer_index * 1024 + salt)
    return tf.nn.experimental.stateless_dropout(h, rate=rate, seed=layer_seed)
