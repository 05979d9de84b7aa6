"""ParallelModel: a user's Keras model, trained the Keras way on the hybrid (made by
`owt_tf.parallelize`, owt_tf.fit.parallelize).

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

import functools
import json
import warnings
from typing import Dict, Optional

import keras
import numpy as np
import tensorflow as tf

from owt_tf.fit import callbacks as keras_callbacks
from owt_tf.fit import data as keras_data
from owt_tf.fit.compiling import (CompileError, GradientClip, inner_optimizer as _inner,
                                  loss_reduction, per_example_loss, rate_ratio,
                                  refuse_for_fc_batch, refuse_optimizer, refuse_settings)
from owt_tf.data.verification import l2_normalize_rows
from owt_tf.fit.metrics import loss_on_shards
from owt_tf.fit.updates import KerasShardOptimizer
from owt_tf.fit.saving import SavingMixin
from owt_tf.fit.steps import StepsMixin
from owt_tf.fit.view import HeadViewMixin
from owt_tf.losses import MarginSoftmax
from owt_tf.models.split import KerasSplit
from owt_tf.parallel.gradients import TracedGradients
from owt_tf.parallel.head.loss import HeadLoss
from owt_tf.parallel.step import TrunkRunner
from owt_tf.parallel.strategy import HybridStrategy
from owt_tf.planner.plan import sampling_problem


def _releasing_traced_gradients(loop):
    """A Keras loop (fit, evaluate, ...) that, when it returns, drops from TensorFlow's
    registry the custom gradients its steps' traces registered (owt_tf.parallel.gradients):
    else every traced step graph lives as long as the process."""
    @functools.wraps(loop)
    def run(self, *args, **kwargs):
        try:
            return loop(self, *args, **kwargs)
        finally:
            self._traced_gradients.release()

    return run


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


class ParallelModel(StepsMixin, SavingMixin, HeadViewMixin, keras.Model):
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
        plan = hybrid.parallel_plan
        # Until compile names the loss: the plan's sample rate, on the shards when it samples.
        provisional = HeadLoss("sharded" if plan.sample_rate < 1 else "gathered",
                               sample_rate=plan.sample_rate)
        self.head = hybrid.placement.place_head(plan, split.head, split.head_weights,
                                                split.compute_dtype, provisional)
        self._trunk_runner = TrunkRunner(self.trunk, plan.jit)
        # Outside Keras' attribute tracking: bookkeeping, not state of the model.
        self.__dict__["_traced_gradients"] = TracedGradients(self)
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
        self._reduction = loss_reduction(loss)
        self._clip = GradientClip(trunk_optimizer, fc_template)
        refuse_for_fc_batch(self._hybrid.parallel_plan.fc_batch, self._reduction, self._clip,
                            self._loss_scaler() is not None)
        self.head.use_loss(HeadLoss("gathered" if on_shards is None else "sharded", on_shards,
                                    candidates_k, per_example_loss(loss),
                                    self._hybrid.parallel_plan.sample_rate))
        self._fc_optimizer = KerasShardOptimizer(fc_template, self.head, self._hybrid.placement.devices,
                                              trunk_optimizer, rate_ratio(trunk_optimizer, fc_optimizer),
                                              own_schedule=fc_optimizer is not None)
        if self._pending_fc_slots is not None:
            self.restore_fc_slots(self._pending_fc_slots)
            self._pending_fc_slots = None

    def _loss_scaler(self) -> Optional[keras.optimizers.LossScaleOptimizer]:
        opt = getattr(self, "optimizer", None)
        return opt if isinstance(opt, keras.optimizers.LossScaleOptimizer) else None

    def _loss_placement(self, loss, metrics, weighted_metrics):
        """(ShardedLoss, candidates per shard): the loss and metrics computed on the shards,
        never gathering the logits, whenever that is exact (owt_tf.parallel.head.loss),
        else (None, 0). HybridStrategy(loss='sharded') insists on it, unless the planner
        chose it (scheme='auto': the compiled loss was not known then)."""
        spec = self.head.spec
        if isinstance(loss, MarginSoftmax) and not spec.cosine:
            raise CompileError(f"loss {loss.name!r} is a margin softmax: it reads cosines, so the "
                               "model's class layer must be owt_tf.layers.NormalizedDense")
        on_shards, k, why = loss_on_shards(loss, metrics, weighted_metrics,
                                           spec.output_activation, spec.num_classes, spec.cosine)
        rate = self._hybrid.parallel_plan.sample_rate
        problem = sampling_problem(rate, on_shards is not None)
        if problem:
            raise CompileError(f"sample_rate={rate:g} {problem}, but {why}")
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










    # -- Keras' loops, with static global batches ------------------------------------------
    @_releasing_traced_gradients
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
            history = super().fit(train, epochs=epochs, validation_data=validation_data,
                                  shuffle=False, callbacks=callbacks, **kwargs)
        self._average_statistics()
        return history

    def _average_statistics(self) -> None:
        """One set of BatchNormalization moving statistics on every replica (their mean),
        before anything reads them: evaluate, predict, get_weights, a save, an export, the
        end of fit (owt_tf.parallel.step.TrunkRunner.average_statistics says why not in
        the step)."""
        self._trunk_runner.average_statistics(self._hybrid.placement.run)

    @_releasing_traced_gradients
    def evaluate(self, x=None, y=None, batch_size=None, sample_weight=None, **kwargs):
        """Keras' evaluate over every row (the last batch padded with rows marked invalid)."""
        self._average_statistics()
        if kwargs.get("_use_cached_eval_dataset"):  # fit's validation: already padded
            return super().evaluate(x, y, **kwargs)
        data = keras_data.padded_batches(x, y, batch_size, self._hybrid.num_replicas, True,
                                         sample_weight)
        self._fresh_function("test_function", data)
        return super().evaluate(self._fed(data, kwargs, "steps"), **kwargs)

    @_releasing_traced_gradients
    def predict(self, x, batch_size=None, *, top_k: Optional[int] = None,
                embeddings: bool = False, **kwargs):
        """Keras' predict; every row, in order (the last batch padded, the padding dropped).
        `top_k`: (scores, class ids), each [rows, top_k], best first: the model's outputs for
        each row's top_k classes, found from each shard's own candidates without gathering
        the [rows, classes] outputs. `embeddings`: each row's L2-normalised input of the
        class layer (what a face model keeps), computed data-parallel: no shard is read."""
        self._average_statistics()
        data = keras_data.padded_batches(x, None, batch_size, self._hybrid.num_replicas, False)
        if embeddings and top_k is not None:
            raise ValueError("predict: top_k or embeddings, not both")
        if embeddings and self.head.spec.hidden:
            raise ValueError("predict(embeddings=True): the embedding is the class layer's "
                             "input, which hidden FC layers compute on the shards; this head "
                             f"has {len(self.head.spec.hidden)}")
        self._set_predict_top_k(top_k)
        if embeddings != getattr(self, "_predict_embeddings", False):
            self.predict_function = None  # traced for the other output
        self._predict_embeddings = bool(embeddings)
        if top_k is None and not embeddings:
            _warn_if_large(data, self.head.spec.num_classes)
        self._fresh_function("predict_function", data)
        out = super().predict(self._fed(data, kwargs, "steps"), **kwargs)
        if embeddings and not getattr(self, "_raw_features", False):
            # the step returns the trunk's float32 outputs (`features`)
            return l2_normalize_rows(out).astype(np.float32)
        return tuple(out) if top_k else out

    def features(self, images, batch_size=None) -> np.ndarray:
        """The class layer's input for `images`, float32 and not normalised (a face model's
        backbone outputs): what owt_tf.callbacks.Verification reads, as InsightFace's
        verification sums an image's and its mirror's outputs before normalising."""
        self._raw_features = True
        try:
            return self.predict(images, batch_size, embeddings=True, verbose=0)
        finally:
            self._raw_features = False

    def embed(self, images, batch_size=None) -> np.ndarray:
        """L2-normalised embeddings of `images` (predict(images, embeddings=True))."""
        return self.predict(images, batch_size, embeddings=True, verbose=0)

    def _set_predict_top_k(self, top_k: Optional[int]) -> None:
        classes = self.head.spec.num_classes
        if top_k is not None and not (isinstance(top_k, (int, np.integer)) and 1 <= top_k <= classes):
            raise ValueError(f"top_k must be an int from 1 to the {classes} classes, got {top_k!r}")
        if top_k != getattr(self, "_predict_top_k", None):
            self.predict_function = None  # traced for the other output
        self._predict_top_k = None if top_k is None else int(top_k)

    @_releasing_traced_gradients
    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """Keras' train_on_batch: one step on the global batch (x, y), each replica taking
        its own rows (Keras' own would hand every replica the whole batch)."""
        data, _ = keras_data.training_batches(x, y, len(x), False, self._hybrid.num_replicas,
                                              sample_weight, class_weight)
        self._hybrid.step_rounds(len(x) // self._hybrid.num_replicas)
        return self._one_batch("train_function", self.make_train_function, data, return_dict)

    @_releasing_traced_gradients
    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        """Keras' test_on_batch over every row of (x, y), each replica taking its own rows."""
        self._average_statistics()
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












