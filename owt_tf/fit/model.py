"""`owt_tf.parallelize(model)`: a user's Keras model, trained the Keras way on the hybrid.

    strategy = owt_tf.HybridStrategy(devices=4, scheme="owt-b", fc_batch="worker")
    with strategy.scope():
        model = owt_tf.parallelize(my_keras_model())
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(train_ds, epochs=3, validation_data=val_ds, callbacks=[...])

The model is split (owt_tf.models.split) into its trunk, cloned inside the strategy's scope
(mirrored: data parallel), and its Dense head, placed as FC shards by the strategy. The
result is a `keras.Model` whose `train_step` runs the same replica step as the CLI
(owt_tf.parallel.step) and whose `fit` / `evaluate` / `predict` are Keras' own, fed with
static global batches (owt_tf.fit.data).

Optimizers: the compiled optimizer updates the trunk (Keras all-reduces its gradients);
the FC shards get one clone of it (or of `fc_optimizer`) per shard, on the shard's device,
driven with `update_step`. Shard gradients must never pass through Keras' all-reduce: it
raises no error and gives wrong weights.

Saving: `save_own_variables` writes each FC layer and its optimizer slots as whole tensors,
so Keras' weight files (`save_weights`, `ModelCheckpoint`, `BackupAndRestore`) restore at
any device count; `save` / `export` write the user's own architecture as a plain
one-device model with the trained weights.
"""
from __future__ import annotations

import gc
import json
import warnings
from typing import Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from owt_tf.devices import outside_strategy_scope
from owt_tf.models.split import KerasSplit, UnsupportedModel, split_keras_model
from owt_tf.parallel import collectives as coll
from owt_tf.parallel.head import state as head_state
from owt_tf.fit import callbacks as keras_callbacks
from owt_tf.fit import data as keras_data
from owt_tf.fit import files as keras_files
from owt_tf.fit.compiling import (MEAN_REDUCTIONS, CompileError,  # noqa: F401
                                           GradientClip, KerasShardOptimizer,
                                           inner_optimizer as _inner,
                                           loss_divisor, loss_reduction, per_example_loss,
                                           rate_ratio, refuse_for_fc_batch, refuse_optimizer,
                                           refuse_settings)
from owt_tf.fit.updates import StepUpdates
from owt_tf.fit.view import HeadViewMixin
from owt_tf.planner.plan import AUTO, PlanError, StepRounds
from owt_tf.parallel.schemes import round_weights
from owt_tf.parallel.head.metrics import join_rounds, loss_on_shards, map_rows, metric_inputs
from owt_tf.parallel.step import replica_logit_shard, replica_train_step, shard_index, whole_logits
from owt_tf.parallel.strategy import HybridStrategy, current_strategy

class TrainingCallError(RuntimeError):
    """Training outside Keras' loops, which a parallelized model cannot honour."""


def parallelize(model: keras.Model, strategy: Optional[HybridStrategy] = None,
                seed: Optional[int] = None) -> "ParallelModel":
    """`model` split at its FC stack: trunk mirrored over the strategy's devices, Dense layers
    sharded. The user's weights are kept. `strategy`: default, the HybridStrategy whose
    `scope()` is open. `seed` seeds the head's dropout (default: drawn at random)."""
    hybrid = strategy or current_strategy()
    if hybrid is None:
        raise ValueError("owt_tf.parallelize needs a HybridStrategy: call it inside "
                         "`with strategy.scope():` or pass strategy=")
    # Before the split: the rebuilt model and the split's clone each hold a copy of the head
    # (GBs for a million classes), and only one at a time is alive.
    source = _rebuildable_source(model)
    # Outside the scope: the split works on a throwaway clone, which needs no mirrored copy.
    split = outside_strategy_scope(lambda: split_keras_model(model, allow_float16=True))
    if hybrid.scheme == AUTO:
        print(_choose_scheme(hybrid, split, model.name).line, flush=True)
    if not hybrid.model_parallel:
        raise UnsupportedModel("scheme 'data' shards nothing: train the model with "
                               "tf.distribute.MirroredStrategy and plain Keras instead")
    try:
        hybrid.parallel_plan.check_widths(split.head.hidden, hybrid.num_replicas,
                                          split.dense_names[:-1])
    except PlanError as err:
        raise UnsupportedModel(err.message) from None
    if seed is None:
        seed = int(np.random.default_rng().integers(2**31 - 1))
    # In a cluster every worker takes the chief's: the head's dropout masks and the order of
    # shuffled arrays must be the same on every worker.
    placement = hybrid.placement
    seed = int(placement.sum_over_workers(np.array([seed if placement.is_chief else 0]))[0])
    with hybrid.scope():
        parallel = ParallelModel(hybrid, split, source, seed)
        if keras_files.is_resumable(model):  # a loaded .keras file: its run goes on
            keras_files.read_state(parallel, model)
        return parallel


def _rebuildable_source(model: keras.Model) -> dict:
    """The model's config, refused now if Keras cannot rebuild it (not at the first save
    after training). Keras consumes the dict it deserializes: a copy is used."""
    source = keras.saving.serialize_keras_object(model)
    try:
        outside_strategy_scope(
            lambda: keras.saving.deserialize_keras_object(json.loads(json.dumps(source))))
    except Exception as err:  # noqa: BLE001 -- any failure means save/export would fail
        raise UnsupportedModel(f"model {model.name}: cannot be rebuilt from its config, so it "
                               f"could not be saved ({type(err).__name__}: "
                               f"{str(err).splitlines()[0]}); register custom layers with "
                               "keras.saving.register_keras_serializable") from None
    gc.collect()  # the rebuilt model's layers hold reference cycles
    return source


def _choose_scheme(hybrid: HybridStrategy, split: KerasSplit, name: str):
    """`scheme="auto"` resolved for this model: the planner's fastest of the schemes that
    shard the head (parallelize refuses 'data'); a trunk the cost model cannot count gets
    the fallback, with the reason."""
    from owt_tf.models.cost import Uncountable, trunk_cost

    features = int(np.prod(split.trunk.output_shape[1:]))
    try:
        net, note = trunk_cost(split.trunk, features, split.head), ""
    except Uncountable as err:
        net, note = None, f"the cost model cannot count model {name}: {err}"
    return hybrid.choose_scheme(net, split.head.hidden, ("owt-a", "owt-b", "owt-c"), note)


def _own_share(rows: tf.Tensor) -> tf.Tensor:
    """This replica's 1/K of rows that every replica holds (the gathered batch). Keras sums a
    metric's variables over replicas (they are ON_READ, SUM): fed the whole batch on every
    replica, a count metric (TruePositives, ...) would come out K times too large."""
    k, n = coll.replica_id(), coll.num_replicas()
    per = rows.shape[0] // n
    return rows[k * per:(k + 1) * per]


def _count_batches(data: tf.data.Dataset) -> int:
    count = int(data.cardinality())
    if count >= 0:
        return count
    return int(data.reduce(0, lambda n, _: n + 1))


# Above this many output floats, predict without top_k warns (2**27 floats: 512 MB).
LARGE_OUTPUTS = 2 ** 27


def _warn_if_large(data: tf.data.Dataset, classes: int) -> None:
    batches = int(data.cardinality())
    rows = tf.nest.flatten(data.element_spec)[0].shape[0]
    if batches > 0 and rows is not None and batches * rows * classes > LARGE_OUTPUTS:
        warnings.warn(f"predict returns {batches * rows} x {classes} outputs "
                      f"({batches * rows * classes * 4 / 2**20:.0f} MB); predict(x, top_k=5) "
                      "returns each row's top classes without gathering them", stacklevel=3)


class ParallelModel(HeadViewMixin, keras.Model):
    """A Keras model whose trunk is data parallel and whose Dense head is sharded (see the
    module docstring). Build it with `owt_tf.parallelize`. What summary, get_layer,
    count_params and TensorBoard see of the head: owt_tf.fit.view."""

    def __init__(self, hybrid: HybridStrategy, split: KerasSplit, source: dict, seed: int):
        # A float16 head: the model's policy is mixed_float16, so that Keras' compile adds its
        # LossScaleOptimizer, as for the user's own model.
        policy = "mixed_float16" if split.compute_dtype == "float16" else None
        super().__init__(name=f"{split.trunk.name.removesuffix('_trunk')}_parallel", dtype=policy)
        self._hybrid = hybrid
        self._source_json = json.dumps(source)
        self._dense_names = list(split.dense_names)
        self._seed = int(seed)
        self._step_offset = 0  # optimizer steps taken under earlier compiles (dropout seeds)
        trunk = keras.models.clone_model(split.trunk)  # in the scope: mirrored variables
        trunk.set_weights(split.trunk.get_weights())
        self.trunk = trunk
        split.release_clone()  # its Dense layers: a copy of the head, not needed any more
        self.head = hybrid.placement.place_head(hybrid.parallel_plan, split.head, split.head_weights, split.compute_dtype)
        self._fc_optimizer: Optional[KerasShardOptimizer] = None
        self._pending_fc_slots: Optional[Dict[str, np.ndarray]] = None
        self.built = True

    @property
    def hybrid(self) -> HybridStrategy:
        return self._hybrid

    # -- compile ----------------------------------------------------------------------
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, *, fc_optimizer=None,
                steps_per_execution=1, run_eagerly=False, jit_compile="auto", **kwargs):
        """Keras' compile, plus `fc_optimizer`: the FC shards' optimizer (default: a copy of
        `optimizer`). Its learning rate relative to `optimizer`'s is kept through schedules
        and LearningRateScheduler: the paper's recipe is `optimizer=SGD(lr * K)`,
        `fc_optimizer=SGD(lr)` with fc_batch='worker'."""
        refuse_settings(steps_per_execution, run_eagerly, jit_compile, loss, kwargs)
        on_shards, candidates_k = self._loss_placement(loss, metrics, kwargs.get("weighted_metrics"))
        with self._hybrid.scope():
            optimizer = keras.optimizers.get(optimizer)
        inner = _inner(optimizer)
        fc_template = keras.optimizers.get(fc_optimizer) if fc_optimizer is not None else inner
        for opt in (inner, fc_template):
            refuse_optimizer(opt, _inner(getattr(self, "optimizer", None)))
        previous = getattr(self, "optimizer", None)
        if previous is not None and previous is not optimizer:
            # A recompile: the head's dropout masks go on from where the last optimizer's
            # steps left them instead of repeating the first run's sequence.
            self._step_offset += int(previous.iterations.numpy())
        optimizer = self._in_scope(optimizer)
        with self._hybrid.scope():  # under mixed_float16 Keras wraps it in a LossScaleOptimizer
            super().compile(optimizer=optimizer, loss=loss, metrics=metrics,
                            steps_per_execution=1, run_eagerly=False, jit_compile=False, **kwargs)
            # Built now, not at the first fit: load_weights then restores the trunk's
            # optimizer state together with the shards' (Keras skips an unbuilt optimizer's).
            if not self.optimizer.built:
                self.optimizer.build(self.trunk.trainable_variables)
        trunk_optimizer = _inner(self.optimizer)
        self.head.per_example_loss = per_example_loss(loss)
        self._reduction = loss_reduction(loss)
        self._clip = GradientClip(trunk_optimizer, fc_template)
        refuse_for_fc_batch(self._hybrid.parallel_plan.fc_batch, self._reduction, self._clip,
                            self._loss_scaler() is not None)
        self.head.loss_mode = "gathered" if on_shards is None else "sharded"
        self.head.sharded_loss, self.head.candidates_k = on_shards, candidates_k
        self._fc_optimizer = KerasShardOptimizer(fc_template, self.head, self._hybrid.placement.devices,
                                              trunk_optimizer, rate_ratio(trunk_optimizer, fc_optimizer),
                                              own_schedule=fc_optimizer is not None)
        if self._pending_fc_slots is not None:
            self._restore_fc_slots(self._pending_fc_slots)
            self._pending_fc_slots = None

    def _loss_scaler(self) -> Optional[keras.optimizers.LossScaleOptimizer]:
        opt = getattr(self, "optimizer", None)
        return opt if isinstance(opt, keras.optimizers.LossScaleOptimizer) else None

    def _loss_placement(self, loss, metrics, weighted_metrics):
        """(ShardedLoss, candidates per shard): the loss and metrics computed on the shards,
        never gathering the logits, whenever that is exact (owt_tf.parallel.head.metrics),
        else (None, 0). HybridStrategy(loss='sharded') insists on it, unless the planner
        chose it (scheme='auto': the compiled loss was not known then)."""
        spec = self.head.spec
        on_shards, k, why = loss_on_shards(loss, metrics, weighted_metrics,
                                           spec.output_activation, spec.num_classes)
        rate = self._hybrid.parallel_plan.sample_rate
        if rate < 1 and on_shards is None:
            raise CompileError(f"sample_rate={rate:g} samples classes in the cross-entropy "
                               f"computed on the shards, but {why}")
        if rate < 1 and on_shards.label_smoothing:
            raise CompileError(f"sample_rate={rate:g} with label_smoothing: smoothing spreads "
                               "labels over every class, sampling drops most of them")
        if on_shards is None and self._hybrid.parallel_plan.loss == "sharded":
            if self._hybrid.auto_choice is None:
                raise CompileError(f"HybridStrategy(loss='sharded'): {why}, so the loss cannot "
                                   "be computed on the shards; use loss='gathered'")
            warnings.warn(f"owt_tf: scheme 'auto' chose the sharded loss, but {why}: the logits "
                          "are gathered", stacklevel=3)
        return on_shards, k

    def _in_scope(self, optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
        """The user's own optimizer object (so that `model.optimizer is opt` and callbacks
        holding `opt` act on the run), with its state created inside the strategy's scope.
        Keras' TF optimizer captures the strategy current at construction
        (`_distribution_strategy`); one made outside the scope breaks fit once it has slots
        ("Mixing different tf.distribute.Strategy objects"), so such an unused optimizer is
        initialised again, in place, from its own config inside the scope."""
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            inner = self._in_scope(optimizer.inner_optimizer)
            if getattr(optimizer, "_distribution_strategy", None) is not self._hybrid.strategy:
                with self._hybrid.scope():
                    optimizer.__init__(inner, initial_scale=optimizer.initial_scale,
                                       dynamic_growth_steps=optimizer.dynamic_growth_steps,
                                       name=optimizer.name)
            return optimizer
        if getattr(optimizer, "_distribution_strategy", None) is not self._hybrid.strategy:
            config = optimizer.get_config()
            if isinstance(config["learning_rate"], dict):  # a serialized schedule
                config["learning_rate"] = keras.optimizers.schedules.deserialize(
                    config["learning_rate"])
            with self._hybrid.scope():
                optimizer.__init__(**config)
        return optimizer

    # -- steps (traced by Keras inside strategy.run) --------------------------------------
    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        rows = self._static_rows(x)
        plan = self._hybrid.step_rounds(rows)
        trunk_vars = self.trunk.trainable_variables
        step = tf.cast(self.optimizer.iterations, tf.int64) + self._step_offset
        step_seed = tf.cast(tf.stack([tf.constant(self._seed, tf.int64), step]), tf.int32)
        weights, metric_weights = self._loss_weights(plan, sample_weight, rows)
        scaler = self._loss_scaler()
        updates = StepUpdates(_inner(self.optimizer), trunk_vars, self._fc_optimizer, self._clip,
                           scaler)
        step = replica_train_step(plan, self.head, self._hybrid.engine.trunk_forward(self.trunk, True),
                                  trunk_vars, x, y, step_seed, updates.trunk, updates.fc,
                                  None if scaler is None else scaler.dynamic_scale.value,
                                  weights)
        updates.finish(shard_index(plan))
        rounds = step.rounds
        loss = rounds.loss_sum / rounds.count
        if step.trunk_loss is not None:
            loss += step.trunk_loss
        with self._after_data(loss):
            self._loss_metric().update_state(loss, sample_weight=rounds.count)
            labels = _own_share(tf.concat(rounds.labels, 0))
            outputs = map_rows(_own_share, join_rounds(rounds.outputs))
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

    def _loss_weights(self, plan: StepRounds, sample_weight, rows: int):
        """Per round, each row's weight in the loss (its sample weight times what turns the
        engine's mean into Keras' reduction), and the sample weights themselves for Keras'
        weighted metrics; (None, None) when every weight is 1."""
        if sample_weight is None and self._reduction in MEAN_REDUCTIONS:
            return None, None
        local = (tf.ones([rows]) if sample_weight is None
                 else tf.reshape(tf.cast(sample_weight, tf.float32), [rows]))
        raw = round_weights(plan, local)
        total = rows * plan.num_replicas
        # The rounds together hold every row of the global batch once.
        divisor = loss_divisor(self._reduction, total, tf.add_n([tf.reduce_sum(w) for w in raw]))
        scale = tf.math.divide_no_nan(tf.constant(float(total)), divisor)
        return [w * scale for w in raw], None if sample_weight is None else raw

    def test_step(self, data):
        x, y, weight = keras.utils.unpack_x_y_sample_weight(data)
        weight, valid = weight if isinstance(weight, tuple) else (None, weight)
        logits = replica_logit_shard(True, self.head, self._hybrid.engine.trunk_forward(self.trunk, False), x)
        labels, valid = coll.gather_labels(y), coll.gather_labels(valid)
        weight = valid if weight is None else coll.gather_labels(weight) * valid
        # outputs: whole rows, or under the sharded loss each shard's top candidates
        per_example, _, outputs = self.head.loss_terms(logits, labels, coll.replica_id())
        per_example = tf.cast(per_example, tf.float32)
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

    def predict_step(self, data):
        x, valid = (data[0], data[1]) if isinstance(data, (tuple, list)) and len(data) > 1 else (
            data[0] if isinstance(data, (tuple, list)) else data, None)
        logits = replica_logit_shard(True, self.head, self._hybrid.engine.trunk_forward(self.trunk, False), x)
        rows = self._static_rows(x)
        k = coll.replica_id()
        top_k = getattr(self, "_predict_top_k", None)
        if top_k:  # (scores, class ids) from each shard's candidates: no [rows, classes] gather
            outputs = tuple(self.head.top_k_outputs(logits, k, top_k))
        else:
            outputs = self.head.outputs(whole_logits(self.head, logits))
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
            return self.head.outputs(logits)
        return self.head.outputs(self.head.forward_assembled(features))

    @staticmethod
    def _after_data(value):
        """Orders the metric updates after `value`, which depends on the batch. Static batch
        shapes make the counts constants, and Keras' last call of an epoch over a dataset of
        unknown length fails in `get_next` while such updates, waiting on nothing, still run:
        every metric then counted one batch too many."""
        return tf.control_dependencies([value])

    def _loss_metric(self):
        return next(m for m in self.metrics if m.name == "loss")

    @staticmethod
    def _static_rows(x) -> int:
        rows = x.shape[0]
        if rows is None:
            raise keras_data.DataError("a replica's batch has no static size; feed "
                                       "fit/evaluate/predict through the model itself")
        return int(rows)

    # -- Keras' loops, with static global batches ------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, *, validation_data=None,
            validation_split=0.0, shuffle=True, class_weight=None, sample_weight=None,
            validation_batch_size=None, **kwargs):
        """Keras' fit. Arrays or a tf.data.Dataset of (x, y) or (x, y, sample_weight); a last
        partial global batch is dropped (every replica needs the same number of rows)."""
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = keras_data.validation_split_of(
                x, y, sample_weight, validation_split)
        train, per_replica = keras_data.training_batches(
            x, y, batch_size, shuffle, self._hybrid.num_replicas, sample_weight, class_weight,
            seed=self._seed if self._hybrid.placement.cluster is not None else None)
        self._hybrid.step_rounds(per_replica)  # refuses a batch the scheme cannot split
        self._fresh_function("train_function", train)
        if validation_data is not None:
            validation_data = self._evaluation_data(validation_data, validation_batch_size)
            self._fresh_function("test_function", validation_data)
            validation_data = self._fed(validation_data, kwargs, "validation_steps")
        train = self._fed(train, kwargs, "steps_per_epoch")
        with keras_callbacks.chief_writes_files(kwargs.pop("callbacks", None),
                                                self._hybrid.placement.is_chief) as callbacks:
            return super().fit(train, epochs=epochs, validation_data=validation_data,
                               shuffle=False, callbacks=callbacks, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, sample_weight=None, **kwargs):
        """Keras' evaluate over every row (the last batch padded with rows marked invalid)."""
        if kwargs.get("_use_cached_eval_dataset"):  # fit's validation: already padded
            return super().evaluate(x, y, **kwargs)
        data = keras_data.padded_batches(x, y, batch_size, self._hybrid.num_replicas, True,
                                         sample_weight)
        self._fresh_function("test_function", data)
        return super().evaluate(self._fed(data, kwargs, "steps"), **kwargs)

    def predict(self, x, batch_size=None, *, top_k: Optional[int] = None, **kwargs):
        """Keras' predict; every row, in order (the last batch padded, the padding dropped).
        `top_k`: (scores, class ids), each [rows, top_k], best first: the model's outputs for
        each row's top_k classes, found from each shard's own candidates without gathering
        the [rows, classes] outputs."""
        data = keras_data.padded_batches(x, None, batch_size, self._hybrid.num_replicas, False)
        self._set_predict_top_k(top_k)
        if top_k is None:
            _warn_if_large(data, self.head.spec.num_classes)
        self._fresh_function("predict_function", data)
        out = super().predict(self._fed(data, kwargs, "steps"), **kwargs)
        return tuple(out) if top_k else out

    def _set_predict_top_k(self, top_k: Optional[int]) -> None:
        classes = self.head.spec.num_classes
        if top_k is not None and not (isinstance(top_k, (int, np.integer)) and 1 <= top_k <= classes):
            raise ValueError(f"top_k must be an int from 1 to the {classes} classes, got {top_k!r}")
        if top_k != getattr(self, "_predict_top_k", None):
            self.predict_function = None  # traced for the other output
        self._predict_top_k = None if top_k is None else int(top_k)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """Keras' train_on_batch: one step on the global batch (x, y), each replica taking
        its own rows (Keras' own would hand every replica the whole batch)."""
        data, _ = keras_data.training_batches(x, y, len(x), False, self._hybrid.num_replicas,
                                              sample_weight, class_weight)
        self._hybrid.step_rounds(len(x) // self._hybrid.num_replicas)
        return self._one_batch("train_function", self.make_train_function, data, return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        """Keras' test_on_batch over every row of (x, y), each replica taking its own rows."""
        data = keras_data.padded_batches(x, y, len(x), self._hybrid.num_replicas, True,
                                         sample_weight)
        return self._one_batch("test_function", self.make_test_function, data, return_dict)

    def predict_on_batch(self, x):
        """Keras' predict_on_batch: the outputs of every row of x, in order."""
        return self.predict(x, batch_size=len(x), verbose=0)

    def _one_batch(self, name: str, make, data: tf.data.Dataset, return_dict: bool):
        self._fresh_function(name, data)
        # Keras' loops build the compiled metrics before tracing a step (fit does it from its
        # iterator); one built inside the traced step fails with unfed placeholders.
        self._symbolic_build(data_batch=next(iter(data)))
        make()
        self.reset_metrics()
        fed = self._fed(data, {}, "steps")
        if isinstance(fed, tf.data.Dataset):
            fed = self._hybrid.strategy.experimental_distribute_dataset(fed)
        iterator = iter(fed)
        # The metrics' own results (their variables summed over replicas), as Keras' loops
        # report at the end of an epoch; the step's logs are per-replica values averaged.
        logs = self._get_metrics_result_or_logs(getattr(self, name)(iterator))
        logs = {k: float(np.asarray(v)) for k, v in logs.items()}
        return logs if return_dict else self._flatten_metrics_in_order(logs)

    def _fed(self, data: tf.data.Dataset, kwargs: dict, steps_key: str):
        """The global batches as Keras' loops take them. In one process Keras distributes
        the dataset itself (the same rows per replica). In a cluster each worker keeps only
        its own rows of every global batch (Placement.distribute_batches), so that every
        global batch holds the rows a one-process run at the same K gives; the dataset is
        repeated and its batches counted into `kwargs[steps_key]`, since a finite dataset
        distributed across workers gets an unknown batch dimension (tf.distribute's input
        pipeline must allow for uneven last batches) and the hybrid step needs static ones."""
        placement = self._hybrid.placement
        if placement.cluster is None:
            return data
        self._sample_batch = next(iter(data))  # for _maybe_symbolic_build
        if kwargs.get(steps_key) is None:
            kwargs[steps_key] = _count_batches(data)
        rows = tf.nest.flatten(data.element_spec)[0].shape[0]
        return placement.distribute_batches(data, rows // placement.num_replicas, repeat=True)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """Keras builds the compiled metrics from a batch it reduces over replicas, which
        MultiWorkerMirroredStrategy cannot do for a nested batch ("unsupported type
        PerReplica"): in a cluster the batch is taken before distribution instead."""
        if self._hybrid.placement.cluster is not None and iterator is not None:
            iterator, data_batch = None, self._sample_batch
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _fresh_function(self, name: str, data: tf.data.Dataset) -> None:
        """Drops Keras' compiled step when the batch size changed. Keras traces with
        reduce_retracing, so a second size would get a step with unknown batch dimension,
        and the hybrid step is planned for static per-replica shapes."""
        rows = tf.nest.flatten(data.element_spec)[0].shape[0]
        seen = self.__dict__.setdefault("_traced_rows", {})
        if seen.get(name) != rows:
            setattr(self, name, None)
            seen[name] = rows

    def _evaluation_data(self, data, batch_size):
        if isinstance(data, tf.data.Dataset):
            return keras_data.padded_batches(data, None, batch_size, self._hybrid.num_replicas,
                                             True)
        if isinstance(data, (tuple, list)) and len(data) in (2, 3):
            return keras_data.padded_batches(data[0], data[1], batch_size,
                                             self._hybrid.num_replicas, True,
                                             data[2] if len(data) == 3 else None)
        raise keras_data.DataError("validation_data must be (x, y), (x, y, sample_weight) or "
                                   "a tf.data.Dataset")

    # -- weights, saving, export -------------------------------------------------------------
    def fc_weights(self) -> List:
        """Every Dense layer of the head whole: [(kernel, bias), ...] as numpy arrays."""
        return self.head.full_weights(self._hybrid.placement.read_shards)

    def get_weights(self) -> List[np.ndarray]:
        """The trunk's weights, then each Dense layer's kernel and bias, whole (the order of
        the user's model when its head is last); EarlyStopping's restore_best_weights uses it."""
        return self.trunk.get_weights() + [w for pair in self.fc_weights() for w in pair]

    def set_weights(self, weights) -> None:
        n = len(self.trunk.get_weights())
        self.trunk.set_weights(weights[:n])
        head = weights[n:]
        state = {}
        for i in range(len(self.head.layers)):
            for j, part in enumerate(("kernel", "bias")):
                state[head_state.weight_key(i, part)] = head[2 * i + j]
        self._restore_head(state)

    def to_keras_model(self) -> keras.Model:
        """The user's architecture as a plain one-device Keras model with these weights."""
        source = json.loads(self._source_json)
        plain = outside_strategy_scope(lambda: keras.saving.deserialize_keras_object(source))
        for layer in self.trunk.layers:
            if layer.weights:
                plain.get_layer(layer.name).set_weights(layer.get_weights())
        for name, (kernel, bias) in zip(self._dense_names, self.fc_weights()):
            plain.get_layer(name).set_weights([kernel, bias])
        return plain

    def save(self, filepath, overwrite=True, **kwargs):
        """The model as a plain one-device Keras model (`.keras`): it loads without owt_tf,
        compiled as this one, with the optimizer's state (trunk and every shard, whole;
        owt_tf.fit.files), so that `load_model` + `fit` continues the run, and
        `parallelize` of the loaded model continues it at any K."""
        plain = self.to_keras_model()
        if getattr(self, "compiled", False) and getattr(self, "optimizer", None) is not None:
            keras_files.write_state(self, plain)
        with keras_callbacks.chief_path(filepath, self._hybrid.placement.is_chief) as path:
            return plain.save(path, overwrite=overwrite, **kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Keras' save_weights (each FC layer and its slots whole: save_own_variables); in a
        cluster only the chief's file is kept."""
        with keras_callbacks.chief_path(filepath, self._hybrid.placement.is_chief) as path:
            return super().save_weights(path, overwrite=overwrite, **kwargs)

    def export(self, filepath, format="tf_saved_model", **kwargs):
        """The plain one-device model exported by Keras (a SavedModel by default)."""
        return self.to_keras_model().export(filepath, format=format, **kwargs)

    def save_own_variables(self, store):
        """Each FC layer, and its optimizer slots, as whole tensors: the same file at any K."""
        super().save_own_variables(store)
        for name, value in self._head_state().items():
            store[name] = value

    def load_own_variables(self, store):
        super_keys = [k for k in store.keys() if not k.startswith("fc")]
        if super_keys:
            super().load_own_variables({k: store[k] for k in super_keys})
        state = {k: np.asarray(store[k]) for k in store.keys() if k.startswith("fc")}
        self._restore_head(state)

    def _head_state(self) -> Dict[str, np.ndarray]:
        return head_state.head_arrays(self.head, self._fc_optimizer, self._hybrid.placement.read_shards)

    def _restore_head(self, state: Dict[str, np.ndarray]) -> None:
        head_state.restore_weights(self.head, state, self._dense_names)
        if not any("_slot" in k for k in state):
            return
        if self._fc_optimizer is None:  # loaded before compile: applied by compile
            self._pending_fc_slots = state
        else:
            self._restore_fc_slots(state)

    def _restore_fc_slots(self, state: Dict[str, np.ndarray]) -> None:
        """The FC optimizer's slots and step count, if they were saved by the same kind of
        optimizer with as many slots; else fresh ones are kept with a warning, as Keras does
        for an optimizer whose saved state does not match."""
        opt = self._fc_optimizer
        if not head_state.slots_fit(state, opt):
            warnings.warn(f"Skipping the FC optimizer state: it was saved by "
                          f"{head_state.saved_kind(state) or 'an optimizer'} with "
                          f"{head_state.saved_slots(state)} slot(s) per weight; this model's FC "
                          f"optimizer is {opt.kind} with {opt.num_slots}", stacklevel=2)
            return
        head_state.restore_slots(self.head, state, opt)
        opt.sync_iterations()
