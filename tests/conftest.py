"""Creates 16 logical CPU devices once per test session (before any TensorFlow op runs).

The suite runs on logical CPUs only, on a host with GPUs too: they are hidden from this
process and every process a test starts (which inherit the environment), so that
`devices=K`, `--devices K` and "auto" mean K logical CPUs everywhere."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before TensorFlow is imported

import pytest  # noqa: E402

from owt_tf.runtime.devices import setup_devices  # noqa: E402

NUM_TEST_DEVICES = 16
DEVICES = setup_devices(NUM_TEST_DEVICES)


@pytest.fixture(scope="session")
def devices():
    """The session's logical CPU devices; a test that needs K uses devices[:K]."""
    return DEVICES
