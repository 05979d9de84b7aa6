"""The engine's collectives at the edges of a step: what happens when a step's input fails."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One good global batch, then an input that takes 2 s to find that it has ended: the second
# step fails in get_next, as Keras' last call of every epoch over a dataset of unknown length
# does. A collective that waits on nothing of the step's input is issued at once and waits
# for a peer that never comes; the failed step then waits for it forever.
_STEP_AFTER_THE_LAST_BATCH = r"""
import os, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
from owt_tf.runtime.devices import make_strategy, setup_devices
from owt_tf.parallel import collectives as coll
from owt_tf.planner import ledger

strategy = make_strategy(setup_devices(2))

def slow_end(i):
    time.sleep(2.0)
    return tf.zeros([3])

rows = tf.data.Dataset.from_tensor_slices(tf.ones([8, 3])).concatenate(
    tf.data.Dataset.range(1).map(lambda i: tf.py_function(slow_end, [i], tf.float32))
    .map(lambda r: tf.ensure_shape(r, [3])).filter(lambda r: False))
iterator = iter(strategy.experimental_distribute_dataset(rows.batch(8, drop_remainder=True)))

@tf.function
def step(iterator):
    x = next(iterator)
    per_replica = strategy.run(lambda v: tf.add_n(coll.broadcast_rounds(v, ledger.ACTIVATIONS)), (x,))
    return strategy.experimental_local_results(per_replica)

print("sum", float(tf.reduce_sum(step(iterator)[0])))
try:
    step(iterator)
except tf.errors.OutOfRangeError:
    print("end of data")
"""


def test_a_step_whose_input_ends_fails_instead_of_hanging():
    """Scheme (b)'s broadcast receive waits for the replica's own input; before, the step
    after the last batch hung in CollectiveBcastRecvV2 (fit, evaluate and predict)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _STEP_AFTER_THE_LAST_BATCH], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("the step after the last batch hung instead of ending") from None
    assert proc.returncode == 0, proc.stderr[-3000:]
    # every replica's 4 rows of 3 ones, both rounds on replica 0: 2 * 4 * 3
    assert proc.stdout.split() == ["sum", "24.0", "end", "of", "data"], proc.stdout
