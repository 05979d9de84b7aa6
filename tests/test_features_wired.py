"""Features that could be stubbed out with every number still right: each must leave a trace
that only the real feature leaves. --jit: the traced step holds functions XLA must compile
(and none without it); --profile-steps: a profiler trace is written for the steps asked."""
from __future__ import annotations

import glob
import os

import numpy as np
import tensorflow as tf

from owt_tf.config import RunConfig
from owt_tf.models import build_model
from owt_tf.parallel import HybridStrategy
from owt_tf.training.driver import StepDriver
from owt_tf.training.loop import Trainer
from owt_tf.training.optim import build_optimizer


def _xla_functions(jit: bool, devices) -> int:
    """How many functions of the traced train step carry _XlaMustCompile=True."""
    spec = build_model("alexnet_tiny", num_classes=10, dropout=0.0)
    hybrid = HybridStrategy(devices[:2], "owt-b", batch_size=4, jit=jit)
    driver = StepDriver(hybrid)
    model = hybrid.placement.build_model(hybrid.parallel_plan, spec, seed=0)
    optim = build_optimizer(hybrid, model, 0.01, 0.01, 0.9, 5e-4)

    @tf.function
    def step(x, y):
        return driver.train_step(model, optim, x, y, None)

    x = np.zeros((8, 32, 32, 3), np.float32)
    y = np.zeros((8,), np.int32)
    concrete = step.get_concrete_function(hybrid.placement.distribute_global_batch(x),
                                          hybrid.placement.distribute_global_batch(y))
    library = concrete.graph.as_graph_def().library.function
    return sum(1 for f in library
               if "_XlaMustCompile" in f.attr and f.attr["_XlaMustCompile"].b)


def test_jit_compiles_the_trunk_with_xla_and_only_with_jit(devices):
    """One XLA-compiled trunk forward per replica with --jit; none without."""
    assert _xla_functions(True, devices) >= 2
    assert _xla_functions(False, devices) == 0


def test_profile_steps_write_a_trace(devices, tmp_path):
    """--profile-steps 2:3 leaves a profiler trace (an .xplane.pb) under the run's logdir;
    without the flag, none."""
    for profile, logdir in (((2, 3), tmp_path / "profiled"), (None, tmp_path / "plain")):
        config = RunConfig.from_flags(scheme="owt-b", devices=2, batch_size=4, steps=4,
                                      eval_every=0, checkpoint_every=0, logdir=str(logdir),
                                      profile_steps=profile)
        Trainer(config, devices=devices[:2]).fit(log=lambda line: None, progress=False)
        traces = glob.glob(os.path.join(str(logdir), "**", "*.xplane.pb"), recursive=True)
        assert bool(traces) == (profile is not None), (profile, traces)
