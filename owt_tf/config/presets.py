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


# arcface_torch's recipes (recognition/arcface_torch/configs/*.py; docs/faces.md has them side
# by side). Their `lr` is what their SGD gets for their global batch (batch_size per GPU on 8
# GPUs, unscaled); here it is the rate for that batch, scaled to yours; `fp16` is
# --precision fp16 (the head and the loss in float32, as theirs under autocast).
ARCFACE_TORCH_GPUS = 8


def _arcface_torch(model: str, dataset: str, objective: str, margin: float, lr: float,
                   weight_decay: float, epochs: float, warmup_epochs: float = 0.0,
                   sample_rate: float = 1.0, batch_size: int = 128) -> RunConfig:
    return RunConfig.from_flags(
        environ={}, model=model, dataset=f"insightface:{dataset}", embedding_dim=512,
        objective=objective, margin=margin, scale=64.0, loss="sharded", scheme="owt-b",
        sample_rate=sample_rate, batch_size=batch_size, dropout=0.0, lr=lr,
        lr_batch=batch_size * ARCFACE_TORCH_GPUS, lr_scaling="linear", momentum=0.9,
        weight_decay=weight_decay, lr_schedule="poly", warmup_epochs=warmup_epochs,
        epochs=epochs, precision="fp16", eval_every=2000, checkpoint_every=2000)


def ms1mv3_r50() -> RunConfig:
    """arcface_torch configs/ms1mv3_r50.py: r50, ArcFace 0.5, lr 0.2, wd 5e-4, 25 epochs,
    2 of warm-up, batch 128 per device, fp16."""
    return _arcface_torch("iresnet50", "/train_tmp/ms1m-retinaface-t1", "arcface", 0.5, 0.2,
                          5e-4, 25.0, warmup_epochs=2.0)


def ms1mv3_r100() -> RunConfig:
    """arcface_torch configs/ms1mv3_r100.py: r100, ArcFace 0.5, lr 0.2, wd 5e-4, 25 epochs."""
    return _arcface_torch("iresnet100", "/train_tmp/ms1m-retinaface-t1", "arcface", 0.5, 0.2,
                          5e-4, 25.0)


def glint360k_r100() -> RunConfig:
    """arcface_torch configs/glint360k_r100.py: r100, CosFace 0.4, lr 0.1, wd 1e-4, 20 epochs."""
    return _arcface_torch("iresnet100", "/train_tmp/glint360k", "cosface", 0.4, 0.1, 1e-4, 20.0)


def wf42m_pfc02_r100() -> RunConfig:
    """arcface_torch configs/wf42m_pfc02_r100.py: r100, CosFace 0.4, Partial FC at 0.2,
    lr 0.1, wd 5e-4, 20 epochs."""
    return _arcface_torch("iresnet100", "/train_tmp/WebFace42M", "cosface", 0.4, 0.1, 5e-4,
                          20.0, sample_rate=0.2)


def ms1mv3_mbf() -> RunConfig:
    """arcface_torch configs/ms1mv3_mbf.py: MobileFaceNet, ArcFace 0.5, lr 0.1, wd 1e-4,
    40 epochs."""
    return _arcface_torch("mobilefacenet", "/train_tmp/ms1m-retinaface-t1", "arcface", 0.5,
                          0.1, 1e-4, 40.0)


PRESETS: Dict[str, Callable[[], RunConfig]] = {
    "demo": demo, "imagenet-paper": imagenet_paper, "faces": faces,
    "ms1mv3-r50": ms1mv3_r50, "ms1mv3-r100": ms1mv3_r100, "glint360k-r100": glint360k_r100,
    "wf42m-pfc0.2-r100": wf42m_pfc02_r100, "ms1mv3-mbf": ms1mv3_mbf}
