"""Device setup: K logical CPUs, and clear errors when the layout cannot be had."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import NUM_TEST_DEVICES
from owt_tf.devices import DeviceError, make_strategy, setup_devices


def test_session_has_its_logical_cpus(devices):
    assert devices == [f"/device:CPU:{i}" for i in range(NUM_TEST_DEVICES)]
    assert make_strategy(devices[:4]).num_replicas_in_sync == 4


def test_fewer_devices_than_initialized_is_fine(devices):
    assert setup_devices(2) == devices[:2]


def test_more_devices_than_initialized_is_a_clear_error(devices):
    with pytest.raises(DeviceError, match=f"already initialized with {NUM_TEST_DEVICES}"):
        setup_devices(NUM_TEST_DEVICES + 1)


def test_gpus_required_but_absent():
    with pytest.raises(DeviceError, match="GPUs requested"):
        setup_devices(2, allow_cpu_devices=False)


def test_zero_devices():
    with pytest.raises(DeviceError):
        setup_devices(0)


def test_fresh_process_gets_exactly_k_devices():
    code = textwrap.dedent("""
        from owt_tf import setup_devices
        import tensorflow as tf
        print(setup_devices(3), len(tf.config.list_logical_devices("CPU")))
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("3")
