"""Closed-form bytes one worker sends per step, per scheme: what the ledger must measure.

Written from the scheme definitions (docs/paper.md), not from the engine's code, so that a test
can hold the ledger (owt_tf.parallel.collectives, filled while a real step is traced) to
it exactly; the planner prices schemes with it. Both share only the ring cost of one
collective (owt_tf.planner.ledger); which collectives a step issues, on what sizes, and
how each FC layer is split, are written out here independently: nothing of the engine
(shards, schemes, collectives) is imported. Int32 labels; activations, their gradients and the
gathered logits in the compute dtype (4 bytes in fp32, 2 in bf16/fp16); weight gradients and
the sharded loss's sums always float32.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Dict, List

from owt_tf.models.cost import NetworkShape
from owt_tf.planner import ledger
from owt_tf.planner.plan import VALUE_BYTES, Scheme

F32 = 4
I32 = 4


_gather = ledger.all_gather_cost
_reduce = ledger.all_reduce_cost
_bcast = ledger.broadcast_cost
_scatter = ledger.engine_reduce_scatter_cost  # an all-reduce from K = 12 on (TF's all-to-all)

BY_OUTPUTS, BY_INPUTS = "by outputs", "by inputs"


def layer_splits(num_layers: int, fc_exchange: str) -> List[str]:
    """How each FC layer is cut over the devices, from the definitions: 'gather' cuts every
    layer by its output units and all-gathers each hidden output; 'colrow' (Megatron's
    pairing) cuts hidden layers alternately by outputs and by inputs, so that each pair needs
    one all-reduce of the second layer's partial sums and no gather between the two; the
    class layer is always cut by classes."""
    if fc_exchange == "gather":
        return [BY_OUTPUTS] * num_layers
    if fc_exchange == "colrow":
        return [BY_INPUTS if i % 2 else BY_OUTPUTS for i in range(num_layers - 1)] + [BY_OUTPUTS]
    raise ValueError(f"unknown fc_exchange {fc_exchange!r}")


@dataclasses.dataclass(frozen=True)
class Transfer:
    """`calls` launches of one collective, `nbytes` sent per replica for all of them together."""

    purpose: str
    nbytes: Fraction
    calls: int


def step_transfers(net: NetworkShape, scheme: str, k: int, batch_size: int,
                   fc_exchange: str = "gather", loss: str = "gathered",
                   fc_batch: str = "global", precision: str = "fp32") -> List[Transfer]:
    """Every collective one worker takes part in during a step, grouped by purpose.

    Conv (and, for `data`, FC) gradients count as one launch each: they are packed into one
    all-reduce. Forward and backward collectives count separately. With one FC update per
    step (fc_batch 'global'), each collective between and after the FC layers runs once for
    all rounds, forward and backward; with 'worker', once per round. Bytes are the same.
    """
    if k == 1:
        return []
    out = [Transfer(ledger.CONV_GRAD, _reduce(net.trunk_params * F32, k), 1)]
    scheme = Scheme(scheme)
    if scheme is Scheme.DATA:
        return out + [Transfer(ledger.FC_GRAD, _reduce(net.fc_params * F32, k), 1)]
    b, d = batch_size, net.features
    value = VALUE_BYTES[precision]
    # in fp32 the labels ride in the activations' collectives, as one more float column: no
    # launch of their own, the bytes of a gather of them; a 2-byte float cannot hold every
    # label exactly, so in bf16/fp16 they are gathered on their own
    out.append(Transfer(ledger.LABELS, _gather(b * I32, k), 0 if value == F32 else 1))
    if scheme in (Scheme.OWT_A, Scheme.SINGLE):
        rounds, n = 1, k * b
        # forward: gather every worker's block; backward: reduce-scatter the gradient
        act, act_calls = _gather(b * d * value, k) + _scatter(k * b * d * value, k), 2
    elif scheme is Scheme.OWT_B:
        rounds, n = k, b
        # K broadcasts, one from each worker; the gradients of all K rounds go back to
        # their owners at once (a reduce-scatter, as in scheme (a))
        act, act_calls = k * _bcast(b * d * value, k) + _scatter(k * b * d * value, k), k + 1
    elif scheme is Scheme.OWT_C:
        rounds, n = k, b
        s = b // k
        # each round: gather B/K rows of every worker; backward: the gradients of all K
        # rounds reduce-scattered back to their owners at once
        act, act_calls = rounds * (_gather(s * d * value, k) + _scatter(b * d * value, k)), rounds + 1
    else:
        raise ValueError(f"unknown scheme {scheme!r}")
    out.append(Transfer(ledger.ACTIVATIONS, act, act_calls))
    # launches of each FC collective, each way: with one FC update per step the rounds' rows
    # go through the FC layers joined after the first product, so once; else once per round
    passes = 1 if fc_batch != "worker" else rounds
    widths = list(net.hidden) + [net.num_classes]
    splits = layer_splits(len(widths), fc_exchange)
    fc, fc_calls = Fraction(0), 0
    for i, width in enumerate(widths[:-1]):
        if splits[i] == BY_INPUTS:
            fc += 2 * _reduce(n * width * value, k)  # partial sums forward, gradient backward
            fc_calls += 2 * passes
        elif splits[i + 1] == BY_OUTPUTS:  # the next layer needs this one's whole output
            fc += _gather(n * width // k * value, k) + _scatter(n * width * value, k)
            fc_calls += 2 * passes
    out.append(Transfer(ledger.FC_EXCHANGE, rounds * fc, fc_calls))
    classes = -(-net.num_classes // k) * k  # the class layer's columns, padded to K shards
    if loss == "sharded":
        # max: gathered without gradient; normalizer and target logit: one all-reduce of
        # [n, 2] each way
        per_round, calls = _gather(n * F32, k) + 2 * _reduce(2 * n * F32, k), 3 * passes
    else:
        per_round = _gather(n * classes // k * value, k) + _scatter(n * classes * value, k)
        calls = 2 * passes
    out.append(Transfer(ledger.LOGITS, rounds * per_round, calls))
    return out


def step_traffic(net: NetworkShape, scheme: str, k: int, batch_size: int,
                 fc_exchange: str = "gather", loss: str = "gathered",
                 precision: str = "fp32") -> Dict[str, Fraction]:
    """Bytes one replica sends per step, by purpose (keys of collectives.PURPOSES)."""
    out = {p: Fraction(0) for p in ledger.PURPOSES}
    for t in step_transfers(net, scheme, k, batch_size, fc_exchange, loss, precision=precision):
        out[t.purpose] += t.nbytes
    return out


def total(traffic: Dict[str, Fraction]) -> Fraction:
    return sum(traffic.values(), Fraction(0))
