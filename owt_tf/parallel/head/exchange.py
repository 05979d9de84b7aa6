"""The collectives between a head's shards: a column-split layer's slices gathered, partial
sums or loss terms all-reduced; nothing at all when the head is one shard."""
from __future__ import annotations

import tensorflow as tf

from owt_tf.parallel import collectives as coll
from owt_tf.planner import ledger


def exchange(head, op, t: tf.Tensor, purpose: str = ledger.FC_EXCHANGE) -> tf.Tensor:
    """`op(t, purpose)`, a collective between the shards; t itself with one shard."""
    return t if head.num_shards == 1 else op(t, purpose)


def gather(head, t: tf.Tensor, purpose: str = ledger.FC_EXCHANGE) -> tf.Tensor:
    """Every shard's columns of these rows, all-gathered (t itself with one shard)."""
    return exchange(head, lambda v, p: coll.all_gather(v, 1, p), t, purpose)
