"""Scheme (b)/(c) overlap: no round's activation exchange waits on an earlier round's FC work.

Checked on the traced step graph: the ancestors (data and control inputs) of every
exchange collective of round r contain no op of any round's FC compute, so TensorFlow's
executor is free to run round r's transfer while round r-1's FC layers compute.
"""
import pytest
import tensorflow as tf

from engine_harness import random_batches
from owt_tf.models import alexnet_tiny
from owt_tf.parallel import HybridStrategy
from owt_tf.training.driver import StepDriver
from owt_tf.training.optim import build_optimizer


def _graph_ops(hybrid, model, optim, batch):
    (x, y), = random_batches(1, hybrid.num_replicas * batch, 10)

    @tf.function
    def step(x, y):
        return StepDriver(hybrid).train_step(model, optim, x, y, None)

    concrete = step.get_concrete_function(hybrid.placement.distribute_global_batch(x),
                                          hybrid.placement.distribute_global_batch(y))
    return {op.name: op for op in concrete.graph.get_operations()}


def _ancestors(op):
    seen, stack = set(), [op]
    while stack:
        node = stack.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return seen


@pytest.mark.parametrize("scheme,fc_batch", [("owt-b", "global"), ("owt-c", "worker")])
def test_exchanges_do_not_wait_on_fc_compute(devices, scheme, fc_batch):
    hybrid = HybridStrategy(devices[:4], scheme, batch_size=8, fc_batch=fc_batch)
    model = hybrid.placement.build_model(hybrid.parallel_plan, alexnet_tiny(num_classes=10, dropout=0.0), seed=0)
    optim = build_optimizer(hybrid, model, 0.01, 0.01, 0.9, 5e-4)
    ops = _graph_ops(hybrid, model, optim, 8)
    exchanges = [op for name, op in ops.items()
                 if "exchange_round" in name and op.type.startswith("Collective")]
    rounds = {name.split("exchange_round")[1].split("/")[0] for name in
              (op.name for op in exchanges)}
    assert rounds == {"0", "1", "2", "3"}, sorted(op.name for op in exchanges)
    fc_ops = {name for name in ops if "fc_round" in name}
    assert fc_ops, "no FC compute found in the graph"
    for op in exchanges:
        waits_on = _ancestors(op) & fc_ops
        assert not waits_on, f"{op.name} waits on {sorted(waits_on)[:3]}"
    # and the FC work of a later round does depend on its own exchange (with fc_batch worker
    # a round's FC work is one call of the round's function, traced once per replica)
    work = next(op for name, op in ops.items() if "fc_round3" in name
                and op.type in ("MatMul", "StatefulPartitionedCall", "PartitionedCall"))
    assert any("exchange_round3" in name for name in _ancestors(work))


def test_worker_rounds_are_one_traced_function_per_replica(devices):
    """fc_batch='worker': each replica traces one round's FC work once and calls it once per
    round, so the step's graph does not grow as K x rounds (the first step's wait did)."""
    hybrid = HybridStrategy(devices[:4], "owt-b", batch_size=8, fc_batch="worker")
    model = hybrid.placement.build_model(hybrid.parallel_plan, alexnet_tiny(num_classes=10, dropout=0.0), seed=0)
    optim = build_optimizer(hybrid, model, 0.01, 0.01, 0.9, 5e-4)
    ops = _graph_ops(hybrid, model, optim, 8)
    calls = [op for name, op in ops.items() if "fc_round" in name
             and op.type in ("StatefulPartitionedCall", "PartitionedCall")]
    assert len(calls) == 4 * 4, sorted(op.name for op in calls)  # K replicas x K rounds
    assert not [name for name, op in ops.items() if "fc_round" in name and op.type == "MatMul"]
    assert len({op.get_attr("f").name for op in calls}) == 4  # one function per replica
