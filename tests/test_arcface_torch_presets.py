"""arcface_torch's recipes as presets: the poly schedule against PolynomialLRWarmup's own
(chained) form written here, each preset's values against arcface_torch's configs, and each
preset training a few steps on a small synthetic InsightFace set (on face_tiny: a 2-core
CPU cannot trace five IResNet-100s in a suite's time; the recipe is everything else): the
ArcFace-with-warm-up and the CosFace-with-Partial-FC recipes."""
import math

import numpy as np
import pytest

from owt_tf.config.presets import PRESETS
from owt_tf.training.schedule import poly_factor

# arcface_torch configs/<name>.py: network, margin_list, lr, weight_decay, num_epoch,
# warmup_epoch, sample_rate (read at the commits docs/faces.md names)
ARCFACE_TORCH = {
    "ms1mv3-r50": ("iresnet50", ("arcface", 0.5), 0.2, 5e-4, 25, 2, 1.0),
    "ms1mv3-r100": ("iresnet100", ("arcface", 0.5), 0.2, 5e-4, 25, 0, 1.0),
    "glint360k-r100": ("iresnet100", ("cosface", 0.4), 0.1, 1e-4, 20, 0, 1.0),
    "wf42m-pfc0.2-r100": ("iresnet100", ("cosface", 0.4), 0.1, 5e-4, 20, 0, 0.2),
    "ms1mv3-mbf": ("mobilefacenet", ("arcface", 0.5), 0.1, 1e-4, 40, 0, 1.0),
}


def chained_poly(base, warmup, total, steps, power=2.0):
    """PolynomialLRWarmup as torch steps it: each step's rate from the previous one's."""
    rates, lr = [], base
    for last_epoch in range(steps):
        if last_epoch < warmup:
            lr = base * last_epoch / warmup
        elif last_epoch == warmup:
            lr = base
        elif last_epoch <= total:
            w, t = warmup, total
            lr = lr * ((1.0 - (last_epoch - w) / (t - w))
                       / (1.0 - (last_epoch - 1 - w) / (t - w))) ** power
        rates.append(lr)
    return rates


@pytest.mark.parametrize("warmup,total", [(0, 50), (10, 50), (7, 23)])
def test_poly_schedule_is_arcface_torchs(warmup, total):
    want = chained_poly(0.1, warmup, total, total)
    got = [0.1 * poly_factor(done, warmup, total) for done in range(total)]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", sorted(ARCFACE_TORCH))
def test_preset_values_are_arcface_torchs(name):
    model, (objective, margin), lr, wd, epochs, warmup, rate = ARCFACE_TORCH[name]
    c = PRESETS[name]()
    c.replace(dataset="faces").validate()  # its insightface: path is arcface_torch's
    assert (c.model.model, c.model.objective, c.model.margin_value, c.model.scale,
            c.model.embedding_dim) == (model, objective, margin, 64.0, 512)
    o = c.optimizer
    assert (o.lr, o.lr_batch, o.momentum, o.weight_decay, o.lr_schedule, o.warmup_epochs) == (
        lr, 128 * 8, 0.9, wd, "poly", warmup)
    assert c.run.epochs == epochs and c.parallel.sample_rate == rate
    assert c.parallel.precision == "fp16" and c.data.dataset.startswith("insightface:")


@pytest.fixture(scope="module")
def insightface_dir(tmp_path_factory):
    from owt_tf.data.faces import faces_dataset

    directory = tmp_path_factory.mktemp("insightface")
    faces_dataset((32, 32, 3), identities=16, images_per_identity=4, held_out_identities=4,
                  pairs=20).write_insightface(str(directory))
    return directory


@pytest.mark.slow
# The two kinds of recipe: ArcFace with a warm-up, CosFace with Partial FC (the other three
# differ from these in values only, held above; 30 s of the suite each).
@pytest.mark.parametrize("name", ["ms1mv3-r50", "wf42m-pfc0.2-r100"])
def test_presets_train_on_an_insightface_set(name, insightface_dir, devices, tmp_path):
    from owt_tf.training.loop import Trainer

    config = PRESETS[name]().replace(
        model="face_tiny", embedding_dim=64, dataset=f"insightface:{insightface_dir}",
        devices=2, batch_size=8, epochs=None, steps=3, eval_every=3, checkpoint_every=0,
        logdir=str(tmp_path))
    summary = Trainer(config, devices=devices[:2]).fit(log=lambda line: None, progress=False)
    assert math.isfinite(summary["train_loss"]), summary
    assert set(summary["verification"]) == {"faces"}
