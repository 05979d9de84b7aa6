"""The traced step grows linearly in K: what each replica traces does not grow with the
number of rounds. The first step's wait (trace, graph optimisation) follows the step
graph's size; when every replica unrolled every round, the graph grew as K x K and the
first step at K=16 took 10-20x K=4's (docs/benchmarks.md, "The first step's wait by K").
Counted on the traced graph, not timed."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from owt_tf.models import alexnet_tiny
from owt_tf.parallel import HybridStrategy
from owt_tf.parallel.step import step_seed
from owt_tf.training.driver import StepDriver
from owt_tf.training.optim import build_optimizer


def _ops_per_replica(devices, k: int, scheme: str, fc_batch: str) -> float:
    hybrid = HybridStrategy(devices[:k], scheme, batch_size=8, fc_batch=fc_batch)
    model = hybrid.placement.build_model(hybrid.parallel_plan,
                                         alexnet_tiny(num_classes=10, dropout=0.5), seed=0)
    optim = build_optimizer(hybrid, model, 0.01, 0.01, 0.9, 5e-4)
    counter = tf.Variable(0, dtype=tf.int64)  # the seed follows a step, as the CLI's does
    step = tf.function(lambda x, y: StepDriver(hybrid).train_step(
        model, optim, x, y, step_seed(0, counter)))
    rows = 8 * k
    x = hybrid.placement.distribute_global_batch(np.zeros((rows, 32, 32, 3), np.float32))
    y = hybrid.placement.distribute_global_batch(np.zeros((rows,), np.int32))
    graph = step.get_concrete_function(x, y).graph
    ops = len(graph.get_operations()) + sum(len(f.node_def) for f in
                                            graph.as_graph_def().library.function)
    return ops / k


@pytest.mark.parametrize("scheme,fc_batch", [("owt-b", "worker"), ("owt-c", "global")])
def test_each_replica_traces_about_as_much_at_8_rounds_as_at_4(devices, scheme, fc_batch):
    """Ops per replica (the step graph and its functions) at K=8 within 1.2x K=4's: now
    1.11x (owt-b worker) and 1.14x (owt-c global), what stays per replica being the K
    exchanges it takes part in. When every round was unrolled in every replica's trace:
    1.24x and 1.60x (at K=16, 2x and 3.2x K=4's)."""
    four, eight = (_ops_per_replica(devices, k, scheme, fc_batch) for k in (4, 8))
    assert eight <= 1.2 * four, (four, eight)
