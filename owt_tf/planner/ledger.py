"""The byte ledger and the cost of each collective: what one worker sends, in pure Python.

Costs follow the ring algorithms that CollectiveAllReduce (CPU) and NCCL (GPU) use, as
docs/paper.md counts them:

    all-gather of a local block of b bytes over K workers:  (K-1) * b
    all-reduce of a tensor of T bytes:                      2 (K-1)/K * T
    reduce-scatter of a tensor of T bytes:                  (K-1)/K * T
    broadcast of b bytes (average over the K sources):     (K-1)/K * b

except that the engine's reduce-scatter is an all-reduce from K = 12 on
(engine_reduce_scatter_cost). The engine's collectives (owt_tf.parallel.collectives) add
to the ledger being `recording` while a step is traced; the closed form of each scheme
(owt_tf.planner.traffic) and the planner price steps with the same formulas. No
TensorFlow here: the CLI prices plans before TensorFlow loads.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
from fractions import Fraction
from typing import Dict, Iterator, List, Optional

# What a byte was moved for. Purposes are the keys of TrafficLedger.by_purpose.
ACTIVATIONS = "activations"  # last conv activations into the FC layers, and their gradient
FC_EXCHANGE = "fc_exchange"  # between FC layers (gather of slices, or colrow's all-reduce)
LOGITS = "logits"  # logits gathered for the loss, or the sharded loss's reductions
LABELS = "labels"  # labels of the examples the FC layers see
CONV_GRAD = "conv_grad"  # all-reduce of trunk gradients
FC_GRAD = "fc_grad"  # all-reduce of FC gradients (pure data parallelism only)
MOVING_STATS = "moving_stats"  # BatchNormalization's moving statistics: averaged when read, not in a step
PURPOSES = (ACTIVATIONS, FC_EXCHANGE, LOGITS, LABELS, CONV_GRAD, FC_GRAD, MOVING_STATS)


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


class TrafficLedger:
    """Bytes one worker sends per step, by purpose and by collective op."""

    def __init__(self) -> None:
        self.by_purpose: Dict[str, Fraction] = collections.defaultdict(Fraction)
        self.by_op: Dict[str, Fraction] = collections.defaultdict(Fraction)
        self.calls = 0

    def add(self, purpose: str, op: str, nbytes: Fraction, calls: int = 1) -> None:
        """`calls` = 0: bytes that ride in a collective counted under another purpose."""
        if purpose not in PURPOSES:
            raise ValueError(f"unknown traffic purpose {purpose!r}")
        times = getattr(_repeats, "times", 1)
        self.by_purpose[purpose] += nbytes * times
        self.by_op[op] += nbytes * times
        self.calls += calls * times

    @property
    def total(self) -> Fraction:
        return sum(self.by_purpose.values(), Fraction(0))

    def summary(self) -> Dict[str, float]:
        return {p: float(self.by_purpose.get(p, 0)) for p in PURPOSES}


_recording: List[TrafficLedger] = []
# Per thread: how many times what is traced now runs per step (a function traced once and
# called once per round).
_repeats = threading.local()


@contextlib.contextmanager
def repeated(times: int) -> Iterator[None]:
    """Collectives recorded in this thread inside the block run `times` times a step."""
    before = getattr(_repeats, "times", 1)
    _repeats.times = before * times
    try:
        yield
    finally:
        _repeats.times = before


@contextlib.contextmanager
def recording(ledger: TrafficLedger) -> Iterator[TrafficLedger]:
    """Counts into `ledger` every collective traced inside the block."""
    _recording.append(ledger)
    try:
        yield ledger
    finally:
        _recording.pop()


def current() -> Optional[TrafficLedger]:
    """The ledger being recorded into, or None."""
    return _recording[-1] if _recording else None
