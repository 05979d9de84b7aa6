"""Creates 16 logical CPU devices once per test session (before any TensorFlow op runs).

The suite runs on logical CPUs only, on a host with GPUs too: they are hidden from this
process and every process a test starts (which inherit the environment), so that
`devices=K`, `--devices K` and "auto" mean K logical CPUs everywhere."""
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before TensorFlow is imported

import pytest  # noqa: E402

from owt_tf.devices import setup_devices  # noqa: E402

NUM_TEST_DEVICES = 16
DEVICES = setup_devices(NUM_TEST_DEVICES)


@pytest.fixture(scope="session")
def devices():
    """The session's logical CPU devices; a test that needs K uses devices[:K]."""
    return DEVICES


@pytest.fixture(autouse=True)
def _heap_of_earlier_tests_left_out_of_collections():
    """After each test: collect its garbage, then freeze what survives (gc.freeze), so that
    later collections do not walk it again. Each parallelize + fit leaves ~25,000 objects
    alive, a traced step's graph among them (a plain Keras fit ~1,400, one under
    MirroredStrategy ~4,300; what holds them is not traced yet), and `parallelize` runs two
    full collections: without this, by a worker's 200th test every collection walked
    millions of objects and took seconds (measured: 0.3 s at 0.5 M objects, 2.4 s at 1.9 M)."""
    yield
    gc.collect()
    gc.freeze()
