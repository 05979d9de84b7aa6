"""Creates 16 logical CPU devices once per test session (before any TensorFlow op runs).

The suite runs on logical CPUs only, on a host with GPUs too: they are hidden from this
process and every process a test starts (which inherit the environment), so that
`devices=K`, `--devices K` and "auto" mean K logical CPUs everywhere."""
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before TensorFlow is imported

import pytest  # noqa: E402

from owt_tf.runtime.startup import keep_freed_heap  # noqa: E402

keep_freed_heap()  # as the entry points do; the suite's processes inherit it (its docstring)

from owt_tf.runtime.devices import setup_devices  # noqa: E402

NUM_TEST_DEVICES = 16
DEVICES = setup_devices(NUM_TEST_DEVICES)


@pytest.fixture(scope="session")
def devices():
    """The session's logical CPU devices; a test that needs K uses devices[:K]."""
    return DEVICES


@pytest.fixture(autouse=True)
def _heap_of_earlier_tests_left_out_of_collections():
    """After each test: collect its garbage, then freeze what survives (gc.freeze), so that
    later collections do not walk it again. Each parallelized Keras fit leaves ~25,000
    objects behind in TensorFlow's caches (a traced step's graph among them; plain Keras
    ~1,400, MirroredStrategy ~4,300), and `parallelize` runs two full collections: without
    this, by a worker's 200th test every collection walked millions of objects and took
    seconds (measured: 0.3 s at 0.5 M objects, 2.4 s at 1.9 M). It was lost once in a merge,
    and nothing failed: tests/test_structure.py checks it is active."""
    yield
    gc.collect()
    gc.freeze()
