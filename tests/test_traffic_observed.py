"""The byte ledger against what the traced step really contains: every collective op on one
replica's device, its launch counted and its bytes priced from its own tensor's size. The
ledger is filled by hand as the engine issues collectives (Keras' gradient all-reduce is
recorded, not observed); this holds both to the graph TensorFlow will run."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import tensorflow as tf

from owt_tf.models import build_model
from owt_tf.parallel import HybridStrategy
from owt_tf.training.driver import StepDriver
from owt_tf.training.optim import build_optimizer

CASES = [("data", 2, "gather", "gathered"), ("owt-a", 2, "gather", "gathered"),
         ("owt-b", 4, "colrow", "gathered"), ("owt-c", 4, "gather", "sharded")]


def _ring_bytes(op, k: int) -> Fraction:
    """What one replica sends for one collective op, from the tensor it moves (the ring
    costs of docs/paper.md; a broadcast averaged over its K sources, as the ledger does)."""
    moved = op.outputs[0] if op.type == "CollectiveBcastRecvV2" else op.inputs[0]
    nbytes = moved.shape.num_elements() * moved.dtype.size
    if op.type == "CollectiveReduceV2":
        return Fraction(2 * (k - 1) * nbytes, k)
    if op.type == "CollectiveGatherV2":
        return Fraction((k - 1) * nbytes)
    if op.type in ("CollectiveAllToAllV2", "CollectiveBcastSendV2", "CollectiveBcastRecvV2"):
        return Fraction((k - 1) * nbytes, k)
    raise AssertionError(f"unpriced collective {op.type}")


@pytest.mark.parametrize("scheme,k,fc_exchange,loss", CASES)
def test_ledger_equals_the_collectives_of_the_traced_step(devices, scheme, k, fc_exchange, loss):
    spec = build_model("alexnet_tiny", num_classes=10, dropout=0.0)
    hybrid = HybridStrategy(devices[:k], scheme, batch_size=4, fc_batch="global",
                            fc_exchange=fc_exchange, loss=loss)
    driver = StepDriver(hybrid)
    model = hybrid.placement.build_model(hybrid.parallel_plan, spec, seed=0)
    optim = build_optimizer(hybrid, model, 0.01, 0.01, 0.9, 5e-4)

    @tf.function
    def step(x, y):
        return driver.train_step(model, optim, x, y, None)

    x = np.zeros((4 * k, 32, 32, 3), np.float32)
    y = np.zeros((4 * k,), np.int32)
    graph = step.get_concrete_function(hybrid.placement.distribute_global_batch(x),
                                       hybrid.placement.distribute_global_batch(y)).graph
    first = tf.DeviceSpec.from_string(hybrid.placement.devices[0])

    def on_first_replica(op) -> bool:
        where = tf.DeviceSpec.from_string(op.device)
        return (where.device_type, where.device_index) == (first.device_type, first.device_index)

    ops = [op for op in graph.get_operations()
           if op.type.startswith("Collective") and on_first_replica(op)]
    types = {op.type for op in ops}
    expected = {"data": "CollectiveReduceV2", "owt-a": "CollectiveGatherV2",
                "owt-b": "CollectiveBcastSendV2", "owt-c": "CollectiveGatherV2"}[scheme]
    assert expected in types, types  # the scheme's own exchange is there to be counted
    ledger = driver.ledger
    assert len(ops) == ledger.calls, sorted(op.type for op in ops)
    assert sum(_ring_bytes(op, k) for op in ops) == ledger.total
