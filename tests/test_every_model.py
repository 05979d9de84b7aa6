"""Every registry model under every scheme at its real size: built, its head holding the
drawn weights on every device, and one step taken (traced only where a step on 2 CPU cores
would cost the suite more than it tells).

K = 2 is where the paper's FC layers are made a 64 MB block at a time (alexnet's fc6 is
9216 x 4096: 75 MB per shard at K = 2, 151 MB whole under `data`): the path no small model
reaches, which crashed under `data` (a mirrored variable's slice is a tensor)."""
import numpy as np
import pytest
import tensorflow as tf

from owt_tf.models import build_model
from owt_tf.models.registry import EMBEDDING_MODELS, MODEL_NAMES
from owt_tf.parallel import HybridStrategy
from owt_tf.parallel.head.layout import BLOCK_BYTES
from owt_tf.training.driver import StepDriver
from owt_tf.training.optim import build_optimizer

SCHEMES = ("single", "data", "owt-a", "owt-b", "owt-c")
K = 2
# Models whose one step on 2 cores costs tens of seconds (a 224 or 112 image through
# VGG-16 or an iResNet): built under every scheme (the head's fill is what a scheme
# changes), their step traced, not run, under these schemes only. A face trunk runs
# data-parallel under every scheme, on a head of one class layer: one trace tells what five
# would (all five cost ~120 s for IResNet-50). VGG-16's FC layers are made in blocks, as
# alexnet's (whose step runs under all five): traced under `data` and a sharded scheme.
TRACED_UNDER = {"vgg16": ("data", "owt-b"), "iresnet18": ("owt-b",), "iresnet50": ("owt-b",),
                "iresnet100": ("owt-b",), "mobilefacenet": ("owt-b",)}
CLASSES = 10


def _head_kernels_on_every_device(model, strategy):
    """Each FC layer's kernel as every device holds it: one array per shard, or per replica
    of a mirrored (data-parallel) layer."""
    out = []
    for layer in model.head.layers:
        copies = []
        for kernel in layer.kernels:
            copies.extend(np.asarray(v) for v in strategy.experimental_local_results(kernel))
        out.append(copies)
    return out


def _step(hybrid, model, spec, scheme, batch):
    optim = build_optimizer(hybrid, model, 0.001, 0.001, 0.9, 5e-4)
    driver = StepDriver(hybrid)
    rng = np.random.default_rng(0)
    global_batch = batch * (1 if scheme == "single" else K)
    images = rng.normal(size=(global_batch,) + tuple(spec.input_shape)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=(global_batch,)).astype(np.int32)
    inputs = [hybrid.placement.distribute_global_batch(images),
              hybrid.placement.distribute_global_batch(labels)]
    seed = tf.constant([0, 1], tf.int32)

    @tf.function
    def step(x, y):
        return driver.train_step(model, optim, x, y, seed)

    return step, inputs


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_builds_and_steps_under_every_scheme(name, devices):
    spec = build_model(name, CLASSES)
    whole = None
    reaches_blocks = False
    for scheme in SCHEMES:
        run_devices = devices[:1] if scheme == "single" else devices[:K]
        batch = 4 if scheme == "single" else 2
        hybrid = HybridStrategy(run_devices, scheme, batch_size=batch)
        model = hybrid.placement.build_model(hybrid.parallel_plan, spec, seed=0)
        head = model.head.full_weights(model.read_shards)
        if whole is None:
            whole = head
        # every scheme holds the same drawn head, whole again from its shards
        for (kernel, bias), (want_kernel, want_bias) in zip(head, whole, strict=True):
            np.testing.assert_array_equal(kernel, want_kernel)
            np.testing.assert_array_equal(bias, want_bias)
        # and every device's copy of it is written: a replica of a mirrored layer the
        # block fill missed would hold zeros
        for layer, copies in zip(model.head.layers,
                                 _head_kernels_on_every_device(model, hybrid.strategy)):
            for copy in copies:
                assert np.abs(copy).sum() > 0, f"{name} {scheme}: a device's kernel is empty"
            if scheme == "data":
                for copy in copies[1:]:
                    np.testing.assert_array_equal(copy, copies[0])
            reaches_blocks |= copies[0].nbytes > BLOCK_BYTES
        if name in TRACED_UNDER and scheme not in TRACED_UNDER[name]:
            continue
        step, inputs = _step(hybrid, model, spec, scheme, batch)
        if name in TRACED_UNDER:
            step.get_concrete_function(*inputs)
        else:
            out = step(*inputs)
            assert np.isfinite(float(out["loss_sum"])), f"{name} {scheme}"
        del model, hybrid, step
    if name in ("alexnet", "vgg16"):
        assert reaches_blocks, f"{name} at K={K} should be made in {BLOCK_BYTES >> 20} MB blocks"
    if name in EMBEDDING_MODELS:
        assert whole[-1][0].shape[1] == CLASSES
