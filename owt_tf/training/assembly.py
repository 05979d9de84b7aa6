"""Assembling a CLI run's parts from its config: the model's spec (a registry model or the
user's, refusals as flag errors)."""
from __future__ import annotations

from typing import Optional

from owt_tf.config import ConfigError, RunConfig
from owt_tf.models import build_model


def model_spec(config: RunConfig, num_classes: Optional[int]):
    """--model's spec: a registry model, or the user's Keras model (refusals as flag errors)."""
    from owt_tf.models.split import UnsupportedModel
    from owt_tf.models.user import UserModelError

    try:
        return build_model(config.model.model, num_classes, config.model.dropout,
                           seed=config.run.seed)
    except (UnsupportedModel, UserModelError) as err:
        raise ConfigError("--model", str(err)) from None
