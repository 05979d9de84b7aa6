"""The CLI's step driver: runs the replica step (owt_tf.parallel.step, shared with Keras'
`fit`) on every replica of a HybridStrategy -- train, evaluate, predict -- merges what the
replicas return, and keeps the ledger of the bytes a traced step moves.

    driver = StepDriver(hybrid)          # hybrid built with the run's batch_size
    metrics = driver.train_step(model, optim, dist_images, dist_labels, dropout_seed)
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

from owt_tf.models.signatures import embedding_outputs
from owt_tf.parallel import collectives as coll

from owt_tf.planner import ledger
from owt_tf.parallel.placement import DistributedModel, Placement
from owt_tf.planner.plan import ParallelPlan, StepRounds
from owt_tf.parallel.head.layout import assemble
from owt_tf.parallel.head.update import whole_shard_gradients
from owt_tf.parallel.precision import finite_flags
from owt_tf.parallel.step import (replica_eval_terms, replica_logit_shard, replica_logits,
                                  replica_train_step, shard_index, whole_logits)
from owt_tf.parallel.strategy import HybridStrategy


class StepDriver:
    """The CLI's steps for `hybrid`'s concrete plan at its fixed batch size (the CLI knows
    it up front; Keras' `fit` plans each batch shape itself)."""

    def __init__(self, hybrid: HybridStrategy):
        if hybrid.batch_size is None:
            raise ValueError("the CLI's steps need HybridStrategy(batch_size=...)")
        self.placement: Placement = hybrid.placement
        self.plan: ParallelPlan = hybrid.parallel_plan
        self.rounds: StepRounds = hybrid.step_rounds(hybrid.batch_size)
        self.ledger = ledger.TrafficLedger()

    def train_step(self, model: DistributedModel, optim, images, labels,
                   seed: Optional[tf.Tensor] = None, with_grads: bool = False,
                   loss_scale: Optional[tf.Tensor] = None,
                   finish_images: Optional[Callable] = None) -> Dict[str, tf.Tensor]:
        """One optimizer step on a distributed batch. Returns loss, error and (optionally) grads.

        `seed` (int32 [2]) seeds dropout; it must differ per step. `loss_scale` (fp16): the
        factor gradients are taken at (owt_tf.parallel.precision.DynamicLossScale). Traffic
        is counted into `self.ledger` while the step is traced. `finish_images`: what each
        replica does to its images first, on its device (a streamed dataset's
        preprocess.finish_images: uint8 crops and their draws -> the float32 input).
        """
        self.ledger = ledger.TrafficLedger()
        with ledger.recording(self.ledger):
            step = functools.partial(self._replica_train_step, model, optim, seed=seed,
                                     with_grads=with_grads, loss_scale=loss_scale,
                                     finish_images=finish_images)
            out = self.placement.run(step, images, labels)
        return self._merge_replica_outputs(out)

    def eval_step(self, model: DistributedModel, images, labels) -> Dict[str, tf.Tensor]:
        """Loss and top-1/top-5 counts on a distributed batch; rows with label < 0 are padding."""
        out = self.placement.run(functools.partial(self._replica_eval_step, model), images, labels)
        return self._merge_replica_outputs(out)

    def assemble_fc_grads(self, model: DistributedModel, out) -> List[List[np.ndarray]]:
        """Per FC update of a train_step(with_grads=True): whole-layer gradients
        [kernel0, bias0, kernel1, ...], shards joined (mirrored layers under 'data': the
        replicas' parts summed)."""
        self.placement.check_one_process("gradients of every shard")
        per_replica = out["fc_grads"]
        updates = []
        for u in range(len(per_replica[0])):
            grads = []
            for li, layer in enumerate(model.head.layers):
                kern = [np.asarray(r[u][2 * li]) for r in per_replica]
                bias = [np.asarray(r[u][2 * li + 1]) for r in per_replica]
                grads += (list(assemble(layer, kern, bias)) if self.plan.model_parallel
                          else [sum(kern), sum(bias)])
            updates.append(grads)
        return updates

    def assemble_grads(self, model: DistributedModel, out) -> Dict[str, np.ndarray]:
        """Whole-model gradients by variable name: trunk parts summed over replicas, and the
        step's last FC update."""
        grads = {f"trunk/{var.path}": sum(np.asarray(g[i]) for g in out["trunk_grads"])
                 for i, var in enumerate(model.trunk.trainable_variables)}
        last = self.assemble_fc_grads(model, out)[-1]
        for li in range(len(model.head.layers)):
            grads[f"fc{li}/kernel"], grads[f"fc{li}/bias"] = last[2 * li], last[2 * li + 1]
        return grads

    def finite_check_names(self, model: DistributedModel) -> List[str]:
        """What each entry of train_step's "finite" flags is about: the loss, then every
        trunk gradient in layer order, then every FC update's gradients in layer order."""
        names = ["loss"] + [f"gradient of {v.path}" for v in model.trunk.trainable_variables]
        updates = self.rounds.num_rounds if self.rounds.updates_fc_every_round else 1
        for u in range(updates):
            suffix = f" (round {u + 1} of {updates})" if updates > 1 else ""
            for li in range(len(model.head.layers)):
                names += [f"gradient of fc{li + 1}/kernel{suffix}", f"gradient of fc{li + 1}/bias{suffix}"]
        return names

    def predict_step(self, model: DistributedModel, images) -> tf.Tensor:
        """Logits [global batch, classes] of a distributed batch, rows in global order."""
        if not self.plan.model_parallel:
            self.placement.check_one_process("predict_step under data parallelism")
        out = self.placement.run(functools.partial(self._replica_logits, model), images)
        local = self.placement.strategy.experimental_local_results(out)
        return local[0] if self.plan.model_parallel else tf.concat(list(local), axis=0)

    def features_step(self, model: DistributedModel, images) -> tf.Tensor:
        """The trunk's outputs [global batch, D] in float32 (a face model's `features`:
        owt_tf.models.signatures.embedding_outputs), rows in global order: each replica runs the trunk
        on its own rows (its output: the class layer's input, when the head has no hidden
        layers); no FC shard is read. The rows are all-gathered, so that every process of a
        cluster holds them all."""
        out = self.placement.run(functools.partial(self._replica_features, model), images)
        return self.placement.strategy.experimental_local_results(out)[0]

    def _replica_features(self, model, images):
        features, _ = model.trunk_runner.forward(False)(images)
        return coll.all_gather(embedding_outputs(features)["features"], 0, ledger.ACTIVATIONS)

    def _replica_train_step(self, model, optim, images, labels, seed, with_grads, loss_scale,
                            finish_images=None):
        trunk_vars = model.trunk.trainable_variables
        if finish_images is not None:
            images = finish_images(images)

        step = replica_train_step(self.rounds, model.head, model.trunk_runner.forward(True),
                                  trunk_vars, images, labels, seed, optim.trunk.apply,
                                  optim.fc.apply, loss_scale)
        rounds, trunk_grads = step.rounds, step.trunk_grads
        # The numerical guard's input: is each of these finite on this replica (names:
        # finite_check_names). Checked here, where every gradient exists, for one pass each.
        # The FC updates' flags come made where their gradients are (in a round's function).
        finite = tf.concat([finite_flags([rounds.loss_sum] + list(trunk_grads))] + rounds.fc_finite, 0)
        out = {"loss_sum": rounds.loss_sum, "correct": rounds.correct,
               "count": tf.constant(rounds.count), "finite": finite}
        if with_grads:
            out["trunk_grads"] = trunk_grads
            out["fc_grads"] = [whole_shard_gradients(model.head, shard_index(self.rounds), g, s)
                               for g, s in zip(rounds.fc_grads, rounds.fc_samples)]
        return out

    def _replica_logits(self, model, images):
        return replica_logits(self.plan.model_parallel, model.head,
                              model.trunk_runner.forward(False), images)

    def _replica_eval_step(self, model, images, labels):
        logit_shard = replica_logit_shard(self.plan.model_parallel, model.head,
                                          model.trunk_runner.forward(False), images)
        if self.plan.model_parallel:
            labels = coll.gather_labels(labels)
        head = model.head
        valid = labels >= 0
        per_example, _ = replica_eval_terms(head, logit_shard, labels, valid)
        logits = whole_logits(head, logit_shard)
        safe = tf.maximum(labels, 0)
        top1 = tf.math.in_top_k(safe, logits, 1) & valid
        top5 = tf.math.in_top_k(safe, logits, min(5, head.spec.num_classes)) & valid
        return {"loss_sum": tf.reduce_sum(per_example),
                "correct": tf.reduce_sum(tf.cast(top1, tf.int32)),
                "correct_top5": tf.reduce_sum(tf.cast(top5, tf.int32)),
                "count": tf.reduce_sum(tf.cast(valid, tf.int32))}

    def _merge_replica_outputs(self, out) -> Dict[str, tf.Tensor]:
        """Model parallel: every replica reports the same rows, take replica 0's numbers.
        Data parallel: each reports its own rows, sum them (over every worker's replicas).
        Gradients stay per replica; finite flags are merged over this process's replicas
        (the loop merges them over workers)."""
        merged = {}
        for key, value in out.items():
            local = self.placement.strategy.experimental_local_results(value)
            if key in ("trunk_grads", "fc_grads"):
                merged[key] = local
            elif key == "finite":
                merged[key] = tf.reduce_all(tf.stack(list(local)), axis=0)
            elif self.plan.model_parallel:
                merged[key] = local[0]
            elif self.placement.cluster is not None:
                merged[key] = self.placement.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
            else:
                merged[key] = tf.add_n(list(local))
        return merged
