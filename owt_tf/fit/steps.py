"""What a parallelized Keras model's steps do on one replica: Keras' `fit`, `evaluate` and
`predict` trace these inside `strategy.run` (keras/src/backend/tensorflow/trainer.py). The
training step is the same replica step as the CLI's (owt_tf.parallel.step); the loss, its
reduction and the metrics are Keras' compiled ones.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from owt_tf.fit.compiling import MEAN_REDUCTIONS, inner_optimizer as _inner, loss_divisor
from owt_tf.fit.data import DataError
from owt_tf.fit.metrics import join_rounds, map_rows, metric_inputs
from owt_tf.fit.updates import StepUpdates
from owt_tf.models.signatures import embedding_outputs
from owt_tf.parallel import collectives as coll
from owt_tf.parallel.head.forward import forward
from owt_tf.parallel.head.loss import outputs as head_outputs
from owt_tf.parallel.head.loss import top_k_outputs
from owt_tf.parallel.schemes import round_weights
from owt_tf.parallel.step import (replica_eval_terms, replica_logit_shard, replica_train_step,
                                  shard_index, step_seed, whole_logits)
from owt_tf.planner.plan import StepRounds


class TrainingCallError(RuntimeError):
    """Training outside Keras' loops, which a parallelized model cannot honour."""


def _own_share(rows: tf.Tensor) -> tf.Tensor:
    """This replica's 1/K of rows that every replica holds (the gathered batch). Keras sums a
    metric's variables over replicas (they are ON_READ, SUM): fed the whole batch on every
    replica, a count metric (TruePositives, ...) would come out K times too large."""
    k, n = coll.replica_id(), coll.num_replicas()
    per = rows.shape[0] // n
    return rows[k * per:(k + 1) * per]


class StepsMixin:
    """ParallelModel's train_step, test_step, predict_step and call."""

    # -- steps (traced by Keras inside strategy.run) --------------------------------------
    # Each notes the custom gradients its trace registers, released when the Keras loop
    # that traced it returns (owt_tf.parallel.gradients).
    def train_step(self, data):
        with self._traced_gradients.recording():
            return self._train_step(data)

    def test_step(self, data):
        with self._traced_gradients.recording():
            return self._test_step(data)

    def predict_step(self, data):
        with self._traced_gradients.recording():
            return self._predict_step(data)

    def _train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        rows = self._static_rows(x)
        rounds = self._hybrid.step_rounds(rows)
        trunk_vars = self.trunk.trainable_variables
        step = tf.cast(self.optimizer.iterations, tf.int64) + self._step_offset
        seed = step_seed(self._seed, step)
        weights, metric_weights = self._loss_weights(rounds, sample_weight, rows)
        scaler = self._loss_scaler()
        updates = StepUpdates(_inner(self.optimizer), trunk_vars, self._fc_optimizer, self._clip,
                           scaler)
        # Every update waits for the batch: weight decay and the optimizers' step counts
        # depend on nothing else, and would run once more in the call that finds no batch.
        with self._after_data(data):
            step = replica_train_step(rounds, self.head, self._trunk_runner.forward(True),
                                      trunk_vars, x, y, seed, updates.trunk, updates.fc,
                                      None if scaler is None else scaler.dynamic_scale.value,
                                      weights)
            updates.finish(shard_index(rounds))
        result = step.rounds
        loss = result.loss_sum / result.count
        if step.trunk_loss is not None:
            loss += step.trunk_loss
        with self._after_data(loss):
            self._loss_metric().update_state(loss, sample_weight=result.count)
            labels = _own_share(tf.concat(result.labels, 0))
            outputs = map_rows(_own_share, join_rounds(result.outputs))
            weights = None if metric_weights is None else _own_share(tf.concat(metric_weights, 0))
            return self._logs(self.compute_metrics(x, *metric_inputs(labels, outputs), weights))

    def _logs(self, logs: dict) -> dict:
        """A step's logs as Keras' loops can reduce them. Across workers Keras reduces each
        value with MultiWorkerMirroredStrategy.reduce(MEAN, axis=0), which fails on a scalar
        (tensorflow/tensorflow#72388): there each becomes [1] (the values are the same on
        every replica, so their mean is the value)."""
        if self._hybrid.placement.cluster is None:
            return logs
        return {name: tf.reshape(value, [1]) for name, value in logs.items()}

    def _loss_weights(self, rounds: StepRounds, sample_weight, rows: int):
        """Per round, each row's weight in the loss (its sample weight times what turns the
        engine's mean into Keras' reduction), and the sample weights themselves for Keras'
        weighted metrics; (None, None) when every weight is 1."""
        if sample_weight is None and self._reduction in MEAN_REDUCTIONS:
            return None, None
        local = (tf.ones([rows]) if sample_weight is None
                 else tf.reshape(tf.cast(sample_weight, tf.float32), [rows]))
        raw = round_weights(rounds, local)
        total = rows * rounds.num_replicas
        # The rounds together hold every row of the global batch once.
        divisor = loss_divisor(self._reduction, total, tf.add_n([tf.reduce_sum(w) for w in raw]))
        scale = tf.math.divide_no_nan(tf.constant(float(total)), divisor)
        return [w * scale for w in raw], None if sample_weight is None else raw

    def _test_step(self, data):
        x, y, weight = keras.utils.unpack_x_y_sample_weight(data)
        weight, valid = weight if isinstance(weight, tuple) else (None, weight)
        logits = replica_logit_shard(True, self.head, self._trunk_runner.forward(False), x)
        labels, valid = coll.gather_labels(y), coll.gather_labels(valid)
        weight = valid if weight is None else coll.gather_labels(weight) * valid
        # outputs: whole rows, or under the sharded loss each shard's top candidates
        per_example, outputs = replica_eval_terms(self.head, logits, labels, valid > 0)
        count = tf.reduce_sum(valid)
        loss = tf.math.divide_no_nan(tf.reduce_sum(per_example * weight),
                                     loss_divisor(self._reduction, count, tf.reduce_sum(weight)))
        if self.trunk.losses:
            loss += tf.add_n(self.trunk.losses)
        # Keras' `metrics` ignore sample weights (only `weighted_metrics` use them): the
        # padding rows are dropped instead.
        labels, weight, real = (_own_share(t) for t in (labels, weight, valid > 0))
        outputs = map_rows(lambda t: tf.boolean_mask(t, real), map_rows(_own_share, outputs))
        labels, weight = tf.boolean_mask(labels, real), tf.boolean_mask(weight, real)
        with self._after_data(loss):
            self._loss_metric().update_state(loss, sample_weight=count)
            return self._logs(self.compute_metrics(x, *metric_inputs(labels, outputs), weight))

    def _predict_step(self, data):
        x, valid = (data[0], data[1]) if isinstance(data, (tuple, list)) and len(data) > 1 else (
            data[0] if isinstance(data, (tuple, list)) else data, None)
        if getattr(self, "_predict_embeddings", False):  # this replica's own rows, no shard
            features, _ = self._trunk_runner.forward(False)(x)
            outputs = embedding_outputs(features)["features"]
            return outputs if valid is None else tf.boolean_mask(outputs, valid > 0)
        logits = replica_logit_shard(True, self.head, self._trunk_runner.forward(False), x)
        rows = self._static_rows(x)
        k = coll.replica_id()
        top_k = getattr(self, "_predict_top_k", None)
        if top_k:  # (scores, class ids) from each shard's candidates: no [rows, classes] gather
            outputs = tuple(top_k_outputs(self.head, logits, k, top_k))
        else:
            outputs = head_outputs(self.head, whole_logits(self.head, logits))
        outputs = tf.nest.map_structure(lambda t: t[k * rows:(k + 1) * rows], outputs)
        if valid is None:
            return outputs
        return tf.nest.map_structure(lambda t: tf.boolean_mask(t, valid > 0), outputs)

    def call(self, inputs, training=False):
        """One-device forward pass in inference mode (every shard joined): Keras' symbolic
        build and direct calls. fit / evaluate / predict run the distributed steps above."""
        if training:
            raise TrainingCallError(
                "model(x, training=True) is not supported on a parallelized model: train with "
                "fit or train_on_batch (a GradientTape over model.trainable_variables would "
                "see the trunk only, not the FC shards)")
        features = self.trunk(inputs, training=False)
        if len(self.head.local_shards) < self.head.num_shards:  # a worker of a cluster
            if tf.executing_eagerly():
                raise TrainingCallError("model(x) in a multi-worker run: each worker holds only "
                                        "its own FC shards; use predict")
            # Keras' symbolic build traces a call for the outputs' shape only.
            logits = tf.zeros([tf.shape(features)[0], self.head.spec.num_classes])
            return head_outputs(self.head, logits)
        return head_outputs(self.head, forward(self.head, features, None, False, None))

    @staticmethod
    def _after_data(value):
        """Orders the state changes made in its context after `value` (tensors that depend
        on the batch). Keras' last call of an epoch over a dataset of unknown length fails
        in `get_next` while ops waiting on nothing still run: without it every metric
        counted one batch too many (static batch shapes make the counts constants), and the
        optimizers took one step more of weight decay and step count."""
        return tf.control_dependencies(tf.nest.flatten(value))

    def _loss_metric(self):
        return next(m for m in self.metrics if m.name == "loss")

    @staticmethod
    def _static_rows(x) -> int:
        rows = x.shape[0]
        if rows is None:
            raise DataError("a replica's batch has no static size; feed "
                            "fit/evaluate/predict through the model itself")
        return int(rows)
