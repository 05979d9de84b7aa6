"""Assembling a CLI run's parts from its config: the model's spec (a registry model or the
user's, refusals as flag errors), the head's loss (--objective: a margin softmax on a
cosine class layer, computed on the shards) and the plan --scheme auto chooses."""
from __future__ import annotations

import dataclasses
from typing import Optional

from owt_tf.config import ConfigError, RunConfig
from owt_tf.models import build_model
from owt_tf.parallel.head.loss import HeadLoss, margin_head_loss


def model_spec(config: RunConfig, num_classes: Optional[int]):
    """--model's spec: a registry model, or the user's Keras model (refusals as flag errors).
    Under a margin objective the class layer is cosine: a face model's becomes so, a user's
    must be (owt_tf.layers.NormalizedDense)."""
    from owt_tf.models.split import UnsupportedModel
    from owt_tf.models.user import UserModelError, is_user_model

    m = config.model
    try:
        spec = build_model(m.model, num_classes, m.dropout, seed=config.run.seed,
                           embedding_dim=m.embedding_dim)
    except (UnsupportedModel, UserModelError) as err:
        raise ConfigError("--model", str(err)) from None
    if config.run.embeddings_only and not (spec.head.cosine or m.margin_value is not None):
        raise ConfigError("--embeddings-only", f"model {spec.name}'s class layer is not cosine "
                          "(owt_tf.layers.NormalizedDense): it has no embedding to export")
    if m.margin_value is None or spec.head.cosine:
        return spec
    if is_user_model(m.model):
        last = (spec.head.names or ("its class layer",))[-1]
        raise ConfigError("--objective", f"{m.objective} needs a cosine class layer: model "
                          f"{spec.name} ends in the Dense {last!r}; end it in "
                          "owt_tf.layers.NormalizedDense")
    return dataclasses.replace(spec, head=dataclasses.replace(spec.head, cosine=True))


def margin_loss(config: RunConfig):
    """--objective's margin softmax (owt_tf.losses.ArcFace or CosFace at --scale and the
    margin), or None under softmax."""
    from owt_tf.losses import ArcFace, CosFace

    m = config.model
    if m.margin_value is None:
        return None
    kind = {"arcface": ArcFace, "cosface": CosFace}[m.objective]
    return kind(scale=m.scale, margin=m.margin_value,
                interclass_filtering_threshold=m.interclass_filtering_threshold)


def head_loss(config: RunConfig) -> Optional[HeadLoss]:
    """The head's loss under a margin objective: on the shards, the margin on the shard
    holding the label (and, on one shard, the same loss per example); None: the plan's
    softmax cross-entropy."""
    margin = margin_loss(config)
    if margin is None:
        return None
    return margin_head_loss(margin, config.parallel.loss, config.parallel.sample_rate)


def choose_scheme(hybrid, spec, config: RunConfig) -> RunConfig:
    """--scheme auto: the planner's choice for this model, K, batch and hardware; the config
    from here on, run_config.json included, names the scheme chosen, so that a resumed or
    evaluated run sees a concrete one."""
    from owt_tf.models.cost import spec_cost

    choice = hybrid.choose_scheme(lambda: spec_cost(spec), spec.head.hidden, config.model.model)
    return config.replace(scheme=choice.scheme, fc_exchange=choice.fc_exchange,
                          loss=choice.loss, fc_batch=hybrid.parallel_plan.fc_batch).validate()
