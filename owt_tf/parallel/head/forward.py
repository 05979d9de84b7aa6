"""The one FC forward pass of the sharded head: training, evaluation, prediction and export
run it, on a shard inside a replica (collectives between layers) or with every shard
joined on one device.

    logits_k = forward(head, rows, k, training, seed)      shard k's logits of every row
    logits   = forward(head, rows, None, False, None)      every shard joined, one device
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import keras
import tensorflow as tf

from owt_tf.parallel import collectives as coll

from owt_tf.planner import ledger
from owt_tf.parallel.head.layout import COL, ROW, SampledRows, ShardedHead
from owt_tf.parallel.head.rounds import on_joined_rows, per_round


def forward(head: ShardedHead, x: tf.Tensor, k: Optional[int], training: bool, seed: Optional[tf.Tensor]) -> tf.Tensor:
    """Rows `x` (the same on every replica) through the FC layers; returns shard k's logits.

    Between layers: a column-split layer's output slices are all-gathered, unless the next
    layer is row-split and takes the slice as it is; a row-split layer's partial sums are
    all-reduced. This is the one FC forward pass: training, evaluation, prediction and
    export run it; `k` None runs it with every shard joined on one device (a plain
    `model(x)`, Keras' symbolic build).
    """
    return forward_rounds(head, [x], k, training, [seed])[0]


def forward_rounds(head: ShardedHead, xs: Sequence[tf.Tensor], k: Optional[int], training: bool,
                   seeds: Sequence[Optional[tf.Tensor]],
                   rounds: Optional[Sequence[int]] = None,
                   sample: Optional[SampledRows] = None,
                   join_rows: bool = False) -> List[tf.Tensor]:
    """`forward` of several rounds' rows, layer by layer: each round's compute on its own
    (xs[i] under the name scope f"fc_round{rounds[i]}" when rounds are given), one
    collective per layer for all of them. With a `sample` (the class layer's
    sampled_rows) the logits are of its classes only: [rows, S]. `k` None: every shard joined on this
    device, no collective, unpadded logits (inference only; all shards in this process).

    `join_rows` (the rounds of one FC update): each round's first product on its own, as it
    may start when the round's rows arrive; then all rounds' rows as one, dropout seeded by
    seeds[0]: one list of logits of every row, and a graph that holds each later op once,
    not once per round (K x K per step: the first step's wait grew with it)."""
    joined = k is None
    if joined and (training or sample is not None):
        raise ValueError("the joined forward pass is inference only")
    layers = head.layers
    xs = [tf.cast(x, head.compute_dtype) for x in xs]
    for i, layer in enumerate(layers[:-1]):
        if joined:
            zs = layer.joined_rounds(xs, rounds)
        else:
            zs = layer.forward_shard_rounds(xs, k, rounds)
            if join_rows and i == 0:
                zs, seeds, rounds = _rows_joined(zs, seeds)
            if layer.split == ROW:
                zs = exchange(head, coll.all_reduce_sum, zs)
        # A ROW layer's output is whole and identical on every replica: same mask for all.
        salt = k if layer.split == COL and not joined else 0
        hs = per_round(
            lambda z, r: _dropout(head, _activate(head, i, z), training, seeds[r], i, salt), zs,
            rounds)
        if not joined and layer.split == COL and layers[i + 1].split == COL:
            hs = gather(head, hs)
        xs = hs
    if joined:
        return layers[-1].joined_rounds(xs, rounds)
    logits = layers[-1].forward_shard_rounds(xs, k, rounds, sample)
    return _rows_joined(logits, seeds)[0] if join_rows else logits


def _rows_joined(zs: Sequence[tf.Tensor], seeds: Sequence[Optional[tf.Tensor]]):
    """(the rounds' rows as one [z], the first round's seed for all, no round names)."""
    return [tf.concat(list(zs), 0) if len(zs) > 1 else zs[0]], list(seeds[:1]), None


def outputs(head: ShardedHead, logits: tf.Tensor) -> tf.Tensor:
    """What the model outputs for these (unpadded) logits: themselves, their softmax or
    their sigmoid. Keras' softmax and sigmoid keep the logits on their result, so Keras'
    cross-entropies on it are computed from the logits, as for the user's own model. Float32, whatever the
    compute dtype (Keras' mixed-precision rule for a model's outputs)."""
    logits = tf.cast(logits, tf.float32)
    if head.spec.output_activation == "softmax":
        return keras.activations.softmax(logits, axis=-1)
    if head.spec.output_activation == "sigmoid":
        return keras.activations.sigmoid(logits)
    return logits


def _activate(head, i: int, z: tf.Tensor) -> tf.Tensor:
    return tf.nn.relu(z) if head.spec.hidden_activation(i) == "relu" else z


def exchange(head, op, ts: Sequence[tf.Tensor], purpose: str = ledger.FC_EXCHANGE) -> List[tf.Tensor]:
    """`op(t, purpose)` on every round's t; a gather as one collective on their rows
    joined (ledger.joins_rounds)."""
    if head.num_shards == 1:
        return list(ts)
    if op is coll.all_reduce_sum or not ledger.joins_rounds(head.num_shards):
        with coll.independent_cuts():
            return [op(t, purpose) for t in ts]
    return on_joined_rows(lambda t: op(t, purpose), ts)


def gather(head, ts: Sequence[tf.Tensor], purpose: str = ledger.FC_EXCHANGE) -> List[tf.Tensor]:
    return exchange(head, lambda t, p: coll.all_gather(t, 1, p), ts, purpose)


def _dropout(head, h, training, seed, layer_index, salt):
    rate = head.spec.hidden_dropout(layer_index)
    if not training or rate == 0.0:
        return h
    layer_seed = tf.random.experimental.stateless_fold_in(seed, layer_index * 1024 + salt)
    return tf.nn.experimental.stateless_dropout(h, rate=rate, seed=layer_seed)
