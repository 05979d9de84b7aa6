"""The networks: the paper's parameter counts and shapes, and response normalization's formula."""
import numpy as np
import pytest
import tensorflow as tf

from owt_tf.models import (CrossMapNorm, alexnet, alexnet_tiny, build_model, fc_param_count, vgg16, vgg_tiny,
                           initial_head_weights, initial_trunk_weights)


def test_alexnet_parameter_counts_match_the_paper():
    spec = alexnet(num_classes=1000)
    trunk = spec.build_trunk()
    assert trunk.output_shape == (None, 9216)  # 6 x 6 x 256
    assert trunk.count_params() == 2_469_696
    assert fc_param_count(spec.trunk_output_dim(trunk), spec.head) == 58_631_144
    assert spec.head.hidden == (4096, 4096) and spec.head.dropout == 0.5


def test_alexnet_layer_shapes():
    trunk = alexnet().build_trunk()
    shapes = {layer.name: layer.output.shape[1:] for layer in trunk.layers}
    assert shapes["conv1"] == (55, 55, 64)
    assert shapes["pool1"] == (27, 27, 64)
    assert shapes["conv2"] == (27, 27, 192)
    assert shapes["pool2"] == (13, 13, 192)
    assert shapes["conv4"] == (13, 13, 256)
    assert shapes["pool5"] == (6, 6, 256)


def test_alexnet_tiny_is_the_same_shape_of_network():
    spec = alexnet_tiny()
    trunk = spec.build_trunk()
    names = [layer.name for layer in trunk.layers]
    for name in ("conv1", "norm1", "pool1", "conv2", "norm2", "pool2", "conv3", "conv4", "conv5", "pool5"):
        assert name in names
    assert trunk.output_shape == (None, 288)
    assert spec.head.hidden == (256, 256)


def test_response_norm_is_switchable():
    names = [layer.name for layer in alexnet(response_norm=False).build_trunk().layers]
    assert "norm1" not in names and "norm2" not in names


def test_cross_map_norm_matches_the_2012_formula():
    x = np.random.default_rng(0).normal(size=(2, 3, 3, 12)).astype(np.float32) * 10
    got = CrossMapNorm()(tf.constant(x)).numpy()
    want = np.empty_like(x)
    n, k, alpha, beta = 5, 2.0, 1e-4, 0.75
    for c in range(12):
        lo, hi = max(0, c - n // 2), min(12, c + n // 2 + 1)
        want[..., c] = x[..., c] / (k + alpha * (x[..., lo:hi] ** 2).sum(-1)) ** beta
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_initial_weights_depend_on_the_seed_only():
    spec = alexnet_tiny()
    a = initial_trunk_weights(spec.build_trunk(), 3)
    b = initial_trunk_weights(spec.build_trunk(), 3)
    c = initial_trunk_weights(spec.build_trunk(), 4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    h1, h2 = initial_head_weights(288, spec.head, 3), initial_head_weights(288, spec.head, 3)
    assert all(np.array_equal(k1, k2) for (k1, _), (k2, _) in zip(h1, h2, strict=True))
    assert [k.shape for k, _ in h1] == [(288, 256), (256, 256), (256, 10)]


def test_initial_trunk_weights_draw_kernels_only():
    """BatchNormalization keeps gamma = 1 and moving variance = 1 (zeroing every 1-D weight
    made a BatchNorm trunk that never trained)."""
    import keras

    trunk = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, name="conv"),
                              keras.layers.BatchNormalization(name="bn")])
    drawn = dict(zip([w.path.split("/", 1)[1] for w in trunk.weights],
                     initial_trunk_weights(trunk, 0)))
    np.testing.assert_array_equal(drawn["bn/gamma"], np.ones(4))
    np.testing.assert_array_equal(drawn["bn/moving_variance"], np.ones(4))
    np.testing.assert_array_equal(drawn["conv/bias"], np.zeros(4))
    assert not np.array_equal(drawn["conv/kernel"], trunk.get_layer("conv").kernel.numpy())


def test_unknown_model_is_refused():
    with pytest.raises(KeyError, match="unknown model"):
        build_model("resnet", 10)


def test_image_size_builds_the_trunk_at_that_size():
    spec = build_model("alexnet_tiny", 10, image_size=48)
    trunk = spec.build_trunk()
    assert spec.input_shape == (48, 48, 3) and trunk.input_shape == (None, 48, 48, 3)
    assert trunk.output_shape == (None, 5 * 5 * 32)  # pools: 48 -> 23 -> 11 -> 5


def test_vgg16_parameter_counts():
    """Simonyan & Zisserman's configuration D: 138,357,544 parameters at 1000 classes."""
    spec = vgg16(num_classes=1000)
    trunk = spec.build_trunk()
    convs = [layer for layer in trunk.layers if layer.name.startswith("conv")]
    assert len(convs) == 13
    assert trunk.output_shape == (None, 25088)  # 7 x 7 x 512
    conv_params = trunk.count_params()
    fc_params = fc_param_count(spec.trunk_output_dim(trunk), spec.head)
    want_conv = 0
    fan_in = 3
    for width in (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512):
        want_conv += 3 * 3 * fan_in * width + width
        fan_in = width
    assert conv_params == want_conv == 14_714_688
    assert fc_params == 25088 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 1000 + 1000 == 123_642_856
    assert conv_params + fc_params == 138_357_544
    assert 0.89 < fc_params / (conv_params + fc_params) < 0.90


def test_vgg_tiny_is_vgg16s_shape_on_32px():
    spec = vgg_tiny()
    trunk = spec.build_trunk()
    convs = [layer for layer in trunk.layers if layer.name.startswith("conv")]
    pools = [layer for layer in trunk.layers if layer.name.startswith("pool")]
    assert len(convs) == 13 and len(pools) == 5
    assert all(tuple(layer.kernel.shape[:2]) == (3, 3) for layer in convs)
    assert trunk.output_shape == (None, 64)  # 32 / 2^5 = 1
    want, fan_in = 0, 3
    for width in (16, 16, 32, 32, 64, 64, 64, 64, 64, 64, 64, 64, 64):
        want += 3 * 3 * fan_in * width + width
        fan_in = width
    assert trunk.count_params() == want == 330_576
    assert spec.head.hidden == (256, 256)


def test_initial_kernels_are_glorot_uniform():
    """Keras' glorot_uniform bound sqrt(6 / (fan_in + fan_out)), the receptive field counted:
    the draws fill it (variance limit^2 / 3) and never pass it."""
    spec = alexnet_tiny()
    trunk = spec.build_trunk()
    kernels = [w for w in initial_trunk_weights(trunk, 0) if w.ndim > 1]
    kernels += [k for k, _ in initial_head_weights(288, spec.head, 0)]
    for kernel in kernels:
        receptive = int(np.prod(kernel.shape[:-2])) if kernel.ndim > 2 else 1
        limit = np.sqrt(6.0 / (receptive * (kernel.shape[-2] + kernel.shape[-1])))
        assert np.abs(kernel).max() <= limit
        assert kernel.var() == pytest.approx(limit ** 2 / 3, rel=0.15)
