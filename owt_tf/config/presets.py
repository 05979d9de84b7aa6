"""Named recipes for `python -m owt_tf.train --preset NAME`: RunConfigs whose flags a user's
own flags override."""
from __future__ import annotations

from typing import Callable, Dict

from owt_tf.config.run import RunConfig


def demo() -> RunConfig:
    """The no-flag run: RunConfig's own defaults."""
    return RunConfig()


def imagenet_paper() -> RunConfig:
    """Krizhevsky 2014 / cuda-convnet2: 128 per replica, FC batch 128 (K FC updates per conv
    update), 0.01 for a batch of 128: the conv rate (batch 128K) scaled by K, the FC rate
    (batch 128) unscaled; momentum 0.9, weight decay 5e-4, 90 epochs, rates / 10 at epochs
    30, 60 and 80."""
    return RunConfig.from_flags(
        environ={}, model="alexnet", dataset="imagenet2012", batch_size=128, scheme="owt-b",
        fc_batch="worker", lr_scaling="linear", lr=0.01, lr_batch=128, momentum=0.9,
        weight_decay=5e-4, dropout=0.5, epochs=90.0, lr_schedule="step",
        lr_decay_epochs=(30.0, 60.0, 80.0), eval_every=5000, checkpoint_every=5000,
        log_every=100, histogram_every=5000)


def faces() -> RunConfig:
    """A first face-recognition run on a 2-core CPU: face_tiny (32x32, D=64) on the embedded
    `faces` identities, ArcFace (s=64, m=0.5) on the class layer's shards (owt-b, K=2),
    no dropout (arcface_torch trains without), verified on the held-out identities' pairs
    at every validation."""
    return RunConfig.from_flags(
        environ={}, model="face_tiny", dataset="faces", objective="arcface", loss="sharded",
        scheme="owt-b", devices=2, batch_size=64, dropout=0.0, lr=0.025, lr_batch=128,
        momentum=0.9, weight_decay=5e-4, steps=300, eval_every=100, checkpoint_every=100)


PRESETS: Dict[str, Callable[[], RunConfig]] = {"demo": demo, "imagenet-paper": imagenet_paper,
                                               "faces": faces}
