"""Face trunks (owt_tf.models.face) against arcface_torch's own definitions, and the
synthetic `faces` set: deterministic, separable but not trivially, pairs balanced and drawn
from identities never trained on."""
import numpy as np
import pytest

from owt_tf.models.registry import FC_WIDTHS, build_model
from owt_tf.models.spec import HeadSpec, initial_trunk_weights


class TorchCount:
    """Parameters, BatchNorm channels and multiply-adds of a network described layer by
    layer with PyTorch's shapes (arcface_torch's backbones/iresnet.py, mobilefacenet.py)."""

    def __init__(self):
        self.params = self.bn_channels = self.macs = 0

    def conv(self, cin, cout, kernel, out_side, groups=1):
        weights = cout * (cin // groups) * kernel * kernel  # nn.Conv2d(bias=False)
        self.params += weights
        self.macs += weights * out_side * out_side

    def bn(self, channels):  # weight and bias are parameters; running stats are buffers
        self.params += 2 * channels
        self.bn_channels += channels

    def prelu(self, channels):  # nn.PReLU(channels)
        self.params += channels

    def linear(self, fan_in, fan_out, bias=True):
        self.params += fan_in * fan_out + (fan_out if bias else 0)
        self.macs += fan_in * fan_out


def torch_iresnet(blocks, features=512, side=112):
    c = TorchCount()
    c.conv(3, 64, 3, side), c.bn(64), c.prelu(64)
    inplanes = 64
    for planes, count in zip((64, 128, 256, 512), blocks):
        for b in range(count):
            out = side // 2 if b == 0 else side
            c.bn(inplanes), c.conv(inplanes, planes, 3, side), c.bn(planes), c.prelu(planes)
            c.conv(planes, planes, 3, out), c.bn(planes)
            if b == 0:
                c.conv(inplanes, planes, 1, out), c.bn(planes)
            inplanes, side = planes, out
    c.bn(512), c.linear(512 * side * side, features), c.bn(features)
    return c


def torch_mobilefacenet(features=512, side=112):
    c = TorchCount()

    def block(cin, cout, kernel, out_side, groups=1, prelu=True):  # ConvBlock / LinearBlock
        c.conv(cin, cout, kernel, out_side, groups), c.bn(cout)
        if prelu:
            c.prelu(cout)

    def depthwise(cin, cout, groups, stride, side):  # their DepthWise
        block(cin, groups, 1, side)
        block(groups, groups, 3, side // stride, groups=groups)
        block(groups, cout, 1, side // stride, prelu=False)
        return side // stride

    side //= 2
    block(3, 128, 3, side), block(128, 128, 3, side, groups=64)
    for cin, cout, groups, stride, count in ((128, 128, 128, 2, 1), (128, 128, 128, 1, 4),
                                             (128, 256, 256, 2, 1), (256, 256, 256, 1, 6),
                                             (256, 256, 512, 2, 1), (256, 256, 256, 1, 2)):
        for _ in range(count):
            side = depthwise(cin, cout, groups, stride, side)
    block(256, 512, 1, side)
    c.conv(512, 512, 7, 1, groups=512), c.bn(512)  # GDC
    c.linear(512, features, bias=False), c.bn(features)
    return c


# name: (reference, frozen torch parameters we do not have, arcface_torch's G "FLOPs")
REFERENCE = {
    "iresnet18": (lambda: torch_iresnet((2, 2, 2, 2)), 512, 2.6),
    "iresnet50": (lambda: torch_iresnet((3, 4, 14, 3)), 512, 6.3),
    "iresnet100": (lambda: torch_iresnet((3, 13, 30, 3)), 512, 12.1),
    "mobilefacenet": (torch_mobilefacenet, 0, 0.45),
}


def keras_macs(trunk):
    """Multiply-adds of the Conv2D (grouped ones included) and Dense layers."""
    import keras

    total = 0
    for layer in trunk.layers:
        if isinstance(layer, keras.layers.Conv2D):
            kh, kw, cin_per_group, _ = layer.kernel.shape
            total += int(np.prod(layer.output.shape[1:])) * kh * kw * cin_per_group
        elif isinstance(layer, keras.layers.Dense):
            total += int(np.prod(layer.kernel.shape))
    return total


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_parameters_and_multiply_adds_match_arcface_torch(name):
    """Exactly, layer shapes counted from the PyTorch definitions: trainable weights are
    torch's parameters less iresnet's embedding BatchNorm scale (frozen at 1 there, absent
    here); Keras also counts the moving mean and variance torch keeps as buffers. PReLU is
    per channel in both. Multiply-adds of convs and FC are torch's exactly and what
    arcface_torch's README lists (ptflops, which adds BN and PReLU: 'mobilefacenet-0.45G')."""
    reference, frozen, published = REFERENCE[name]
    torch = reference()
    trunk = build_model(name, 10).build_trunk()  # built, never run
    trainable = sum(int(np.prod(w.shape)) for w in trunk.trainable_weights)
    assert trainable == torch.params - frozen
    assert trunk.count_params() == trainable + 2 * torch.bn_channels
    assert keras_macs(trunk) == torch.macs
    assert torch.macs / 1e9 == pytest.approx(published, rel=0.03)


def test_published_sizes():
    """The sizes the face papers quote: r50 43.6 M parameters, r18 24.0 M, MobileFaceNet 2.0 M."""
    assert torch_iresnet((3, 4, 14, 3)).params == 43_590_848
    assert round(torch_iresnet((3, 13, 30, 3)).params / 1e6, 1) == 65.2
    assert torch_iresnet((2, 2, 2, 2)).params == 24_025_600
    assert torch_mobilefacenet().params == 2_059_520


def test_registry_specs():
    for name in ("iresnet18", "iresnet50", "mobilefacenet", "face_tiny"):
        spec = build_model(name, 7)
        assert spec.head == HeadSpec(hidden=(), num_classes=7)
        assert FC_WIDTHS[name] == ()
    assert build_model("face_tiny", 7).input_shape == (32, 32, 3)
    assert build_model("iresnet50", 7).input_shape == (112, 112, 3)
    trunk = build_model("face_tiny", 7, embedding_dim=16, image_size=56).build_trunk()
    assert trunk.output_shape == (None, 16) and trunk.input_shape == (None, 56, 56, 3)
    with pytest.raises(KeyError, match="no embedding"):
        build_model("alexnet_tiny", 7, embedding_dim=16)
    with pytest.raises(ValueError, match="multiple of 16"):
        build_model("iresnet18", 7, image_size=100)


@pytest.mark.parametrize("name, side, dim", [("face_tiny", 32, 64), ("face_tiny", 56, 64),
                                             ("iresnet18", 112, 512), ("mobilefacenet", 112, 128)])
def test_embeddings_shape_and_finite(name, side, dim):
    from owt_tf.models import face

    spec = getattr(face, name)(num_classes=3, image_size=side, embedding_dim=dim)
    trunk = spec.build_trunk()
    trunk.set_weights(initial_trunk_weights(trunk, seed=0))
    x = np.random.default_rng(0).standard_normal((2, side, side, 3)).astype(np.float32)
    y = trunk(x, training=False).numpy()
    assert y.shape == (2, dim) and np.isfinite(y).all()
    assert spec.trunk_output_dim(trunk) == dim


def test_grouped_conv_is_keras_grouped_conv_and_prelu_keeps_its_slopes():
    import keras

    from owt_tf.models.face_layers import ChannelPReLU, GroupedConv2D

    x = np.random.default_rng(1).standard_normal((2, 9, 9, 8)).astype(np.float32)
    for groups, stride, padding in ((4, 1, "same"), (2, 2, "valid"), (8, 1, "same")):
        ours = GroupedConv2D(8, 3, strides=stride, padding=padding, groups=groups, use_bias=False)
        theirs = keras.layers.Conv2D(8, 3, strides=stride, padding=padding, groups=groups,
                                     use_bias=False)
        ours.build(x.shape), theirs.build(x.shape)
        ours.set_weights(theirs.get_weights())
        np.testing.assert_allclose(ours(x), theirs(x), atol=1e-5)
    prelu = ChannelPReLU()
    y = prelu(np.array([[-2.0, 3.0]], np.float32)).numpy()
    np.testing.assert_allclose(y, [[-0.5, 3.0]])
    trunk = build_model("face_tiny", 3).build_trunk()
    weights = dict(zip([w.path for w in trunk.weights], initial_trunk_weights(trunk, seed=0)))
    assert np.all(weights["prelu/alpha"] == 0.25)  # not redrawn as a kernel


# ---------------------------------------------------------------------------- faces set


@pytest.fixture(scope="module")
def faces():
    from owt_tf.data.faces import faces_dataset

    return faces_dataset((32, 32, 3))


def test_faces_is_deterministic_and_sized(faces):
    from owt_tf.data.faces import faces_dataset

    small = dict(identities=20, images_per_identity=4, held_out_identities=6, pairs=30)
    a, b = faces_dataset((32, 32, 3), **small), faces_dataset((32, 32, 3), **small)
    for field in ("train_images", "train_labels", "val_images", "val_labels"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    np.testing.assert_array_equal(a.pairs.first, b.pairs.first)
    other = faces_dataset((32, 32, 3), seed=1, **small)
    assert not np.array_equal(a.train_images, other.train_images)
    assert faces.num_classes == 500 and faces.name == "faces"
    assert len(faces.train_labels) + len(faces.val_labels) == 500 * 6
    assert sorted(faces.val_labels) == list(range(500))  # one held out per identity
    assert faces.train_images.shape[1:] == (32, 32, 3) and faces.train_images.dtype == np.uint8


def test_faces_identities_are_separable_but_not_trivially(faces):
    """Raw pixels against each identity's unshifted template: far above chance (1/500),
    far from every image (shifts, mirror images, per-image changes and noise)."""
    from owt_tf.data.faces import nearest_template_accuracy

    accuracy = nearest_template_accuracy(faces)
    assert 0.2 < accuracy < 0.8, accuracy


def test_faces_pairs_are_balanced_and_of_held_out_identities(faces):
    pairs, who = faces.verification_pairs(), faces.pair_identities
    assert len(pairs) == 600 and pairs.first.shape == (600, 32, 32, 3)
    assert pairs.same.sum() == 300
    np.testing.assert_array_equal(pairs.same, np.arange(600) % 2 == 0)  # every fold balanced
    assert who.min() >= faces.num_classes  # never trained on
    np.testing.assert_array_equal(who[:, 0] == who[:, 1], pairs.same)
    assert not np.any(np.all(pairs.first[pairs.same] == pairs.second[pairs.same], axis=(1, 2, 3)))
    trained = {image.tobytes() for image in faces.train_images}
    assert not any(image.tobytes() in trained for image in pairs.first)


def test_load_dataset_faces_trains_in_batches():
    from owt_tf.data.datasets import load_dataset
    from owt_tf.data.faces import FacesDataset

    ds = load_dataset("faces", (32, 32, 3))
    assert isinstance(ds, FacesDataset) and not ds.trains_with_flips
    images, labels, positions = next(iter(ds.train(16, seed=0)))
    assert images.shape == (16, 32, 32, 3) and labels.numpy().max() < 500
    np.testing.assert_array_equal(positions.numpy(), np.arange(16))
