"""Device setup: K logical CPUs, and clear errors when the layout cannot be had."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import NUM_TEST_DEVICES
from owt_tf.runtime.devices import DeviceError, device_layout, make_strategy, setup_devices


def test_session_has_its_logical_cpus(devices):
    assert devices == [f"/device:CPU:{i}" for i in range(NUM_TEST_DEVICES)]
    assert make_strategy(devices[:4]).num_replicas_in_sync == 4


def test_fewer_devices_than_initialized_is_fine(devices):
    assert setup_devices(2) == devices[:2]


def test_more_devices_than_initialized_is_a_clear_error(devices):
    with pytest.raises(DeviceError, match=f"already initialized with {NUM_TEST_DEVICES}"):
        setup_devices(NUM_TEST_DEVICES + 1)


def test_gpus_required_but_absent():
    with pytest.raises(DeviceError, match="GPUs requested but none found"):
        setup_devices(2, "gpu")


@pytest.mark.parametrize("k,gpus,device_type,kind,per_gpu", [
    (4, 8, "auto", "gpu", 1), (4, 4, "gpu", "gpu", 1),
    (4, 1, "auto", "logical_gpu", 4), (8, 2, "gpu", "logical_gpu", 4),  # no GPU left idle
    (4, 0, "auto", "cpu", 1), (4, 8, "cpu", "cpu", 1),
])
def test_device_layout(k, gpus, device_type, kind, per_gpu):
    layout = device_layout(k, gpus, device_type)
    assert (layout.kind, layout.per_gpu) == (kind, per_gpu)
    assert (layout.note(k, gpus) is not None) == (kind == "logical_gpu")


@pytest.mark.parametrize("k,gpus,device_type,message", [
    (6, 4, "auto", "multiple of the GPU count"), (2, 0, "gpu", "none found"),
    (2, 1, "tpu", "expected one of auto, gpu, cpu"), (0, 1, "auto", "at least 1"),
])
def test_device_layouts_that_cannot_be_had(k, gpus, device_type, message):
    with pytest.raises(DeviceError, match=message):
        device_layout(k, gpus, device_type)


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
