"""Closed-form bytes one worker sends per step, per scheme: what the ledger must measure.

Written from the scheme definitions (PAPER.md), not from the engine's code, so that a test
can hold the ledger (owt_tf.parallel.collectives, filled while a real step is traced) to
it exactly; the planner prices schemes with it. Both share only the ring cost of one
collective (collectives.*_cost); which collectives a step issues, on what sizes, is
written out here independently. fp32 activations, int32 labels.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Dict, Sequence

from owt_tf.parallel import collectives as coll
from owt_tf.parallel.shards import COL, ROW, padded, split_plan

F32 = 4
I32 = 4


@dataclasses.dataclass(frozen=True)
class NetworkShape:
    """What traffic depends on: trunk parameters, trunk output width, FC widths, classes."""

    trunk_params: int
    features: int
    hidden: Sequence[int]
    num_classes: int

    @property
    def fc_params(self) -> int:
        total, fan_in = 0, self.features
        for w in list(self.hidden) + [self.num_classes]:
            total += fan_in * w + w
            fan_in = w
        return total


_gather = coll.all_gather_cost
_reduce = coll.all_reduce_cost
_scatter = coll.reduce_scatter_cost


def step_traffic(net: NetworkShape, scheme: str, k: int, batch_size: int,
                 fc_exchange: str = "gather", loss: str = "gathered") -> Dict[str, Fraction]:
    """Bytes per worker per step by purpose (keys of collectives.PURPOSES)."""
    out = {p: Fraction(0) for p in coll.PURPOSES}
    if k == 1:
        return out
    out[coll.CONV_GRAD] = _reduce(net.trunk_params * F32, k)
    if scheme == "data":
        out[coll.FC_GRAD] = _reduce(net.fc_params * F32, k)
        return out
    b, d = batch_size, net.features
    out[coll.LABELS] = _gather(b * I32, k)
    if scheme in ("owt-a", "single"):
        rounds, n = 1, k * b
        # forward: gather every worker's block; backward: reduce-scatter the gradient
        out[coll.ACTIVATIONS] = _gather(b * d * F32, k) + _scatter(k * b * d * F32, k)
    elif scheme == "owt-b":
        rounds, n = k, b
        # each round: worker r's block sent to all (a masked all-reduce), gradient back likewise
        out[coll.ACTIVATIONS] = k * 2 * _reduce(b * d * F32, k)
    elif scheme == "owt-c":
        rounds, n = k, b
        s = b // k
        out[coll.ACTIVATIONS] = k * (_gather(s * d * F32, k) + _scatter(b * d * F32, k))
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    widths = list(net.hidden) + [net.num_classes]
    plan = split_plan(len(widths), fc_exchange)
    fc = Fraction(0)
    for i, width in enumerate(widths[:-1]):
        if plan[i] == ROW:
            fc += 2 * _reduce(n * width * F32, k)  # partial sums forward, gradient backward
        elif plan[i] == COL and plan[i + 1] == COL:
            fc += _gather(n * width // k * F32, k) + _scatter(n * width * F32, k)
    out[coll.FC_EXCHANGE] = rounds * fc
    classes = padded(net.num_classes, k)
    if loss == "sharded":
        # max: gathered without gradient; normalizer and target logit: one all-reduce of
        # [n, 2] each way
        per_round = _gather(n * F32, k) + 2 * _reduce(2 * n * F32, k)
    else:
        per_round = _gather(n * classes // k * F32, k) + _scatter(n * classes * F32, k)
    out[coll.LOGITS] = rounds * per_round
    return out


def total(traffic: Dict[str, Fraction]) -> Fraction:
    return sum(traffic.values(), Fraction(0))
