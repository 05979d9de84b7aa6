"""A process that parallelizes and fits one model after another stays lean: each cycle keeps
no more Python objects alive than twice what the same cycle keeps under MirroredStrategy
(before owt_tf released the custom gradients its traces register in TensorFlow's registry,
owt_tf.parallel.gradients, a cycle kept ~26,000 objects against MirroredStrategy's ~3,700),
measured in one fresh process against MirroredStrategy."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_a_fit_cycle_keeps_at_most_twice_what_mirrored_strategy_keeps():
    out = subprocess.run([sys.executable, str(HERE / "lean_cycles.py"), "4"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    owt, mirrored = found["owt_tf"], found["mirrored"]
    # the steady cycles (the first is warm-up: Keras' and TF's own one-time caches)
    assert max(owt) <= 2 * max(min(mirrored), 1), found
    assert sum(found["registry"]) == 0, found  # no custom gradient left registered
