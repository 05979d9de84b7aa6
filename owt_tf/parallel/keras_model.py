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
static global batches (owt_tf.parallel.keras_data).

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

import json
import warnings
from typing import Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from owt_tf.devices import outside_strategy_scope
from owt_tf.models.split import KerasSplit, UnsupportedModel, split_keras_model
from owt_tf.parallel import collectives as coll
from owt_tf.parallel import keras_data
from owt_tf.parallel.plan import AUTO, PlanError
from owt_tf.parallel.shards import ShardedHead
from owt_tf.parallel.step import replica_logits, replica_train_step
from owt_tf.parallel.strategy import HybridStrategy, current_strategy

# Optimizers whose update of each weight depends only on that weight's own gradient and
# state, so that updating a shard equals updating its part of the whole layer.
# The key under which a file names the kind of optimizer whose slots it holds.
FC_OPTIMIZER_KIND = "fc_optimizer_kind"
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta",
                          "Adamax", "Lion", "Ftrl")


class CompileError(ValueError):
    """A compile setting a parallelized model cannot honour (the message says why)."""


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
    # Outside the scope: the split works on a throwaway clone, which needs no mirrored copy.
    split = outside_strategy_scope(lambda: split_keras_model(model))
    if hybrid.scheme == AUTO:
        print(_choose_scheme(hybrid, split, model.name).line, flush=True)
    if not hybrid.model_parallel:
        raise UnsupportedModel("scheme 'data' shards nothing: train the model with "
                               "tf.distribute.MirroredStrategy and plain Keras instead")
    source = keras.saving.serialize_keras_object(model)
    try:  # refused now, not at the first save after training (Keras consumes the dict: a copy)
        outside_strategy_scope(
            lambda: keras.saving.deserialize_keras_object(json.loads(json.dumps(source))))
    except Exception as err:  # noqa: BLE001 -- any failure means save/export would fail
        raise UnsupportedModel(f"model {model.name}: cannot be rebuilt from its config, so it "
                               f"could not be saved ({type(err).__name__}: "
                               f"{str(err).splitlines()[0]}); register custom layers with "
                               "keras.saving.register_keras_serializable") from None
    try:
        hybrid.parallel_plan.check_widths(split.head.hidden, hybrid.num_replicas,
                                          split.dense_names[:-1])
    except PlanError as err:
        raise UnsupportedModel(str(err).split(": ", 1)[1]) from None
    if seed is None:
        seed = int(np.random.default_rng().integers(2**31 - 1))
    with hybrid.scope():
        return ParallelModel(hybrid, split, source, seed)


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


class _ShardOptimizers:
    """One clone of a Keras optimizer per local FC shard, built on that shard's variables on
    its device, outside the strategy's scope. A plain object, so that Keras' saver does not
    walk the clones (their number depends on K); the model saves their slots whole."""

    def __init__(self, template: keras.optimizers.Optimizer, head: ShardedHead,
                 devices: List[str], trunk_optimizer, lr_ratio: float,
                 own_schedule: bool = False):
        name = type(template).__name__
        if name not in ELEMENTWISE_OPTIMIZERS:
            raise CompileError(f"optimizer {name}: its update is not element-wise, so a shard's "
                               f"update would differ from the whole layer's (supported: "
                               f"{', '.join(ELEMENTWISE_OPTIMIZERS)})")
        config = template.get_config()
        self.head = head
        self.trunk_optimizer = trunk_optimizer
        self.lr_ratio = lr_ratio
        self.weight_decay = template.weight_decay
        self.kind = type(template).__name__
        # An fc_optimizer with a rate schedule follows it, on its own step count (one per FC
        # update: K a step with fc_batch='worker', as K plain Keras updates would advance it).
        self.own_schedule = own_schedule and isinstance(
            template.get_config()["learning_rate"], dict)

        def build():
            clones = {}
            for k in head.local_shards:
                with tf.device(devices[k]):
                    clone = type(template).from_config(config)
                    clone.build(head.shard_variables(k))
                clones[k] = clone
            return clones

        self.clones: Dict[int, keras.optimizers.Optimizer] = outside_strategy_scope(build)
        self.num_slots = self._check_slots()

    def _state(self, k: int) -> List:
        """The clone's per-variable state (iteration and rate left out), variable by variable:
        Keras builds each variable's slots together ([m0, v0, m1, v1, ...] for Adam)."""
        return [v for v in self.clones[k].variables if v.name not in ("iteration", "learning_rate")]

    def _check_slots(self) -> int:
        k = self.head.local_shards[0]
        variables, state = self.head.shard_variables(k), self._state(k)
        n = len(variables)
        per_variable = len(state) // n
        if len(state) % n or any(tuple(s.shape) != tuple(variables[i // per_variable].shape)
                                 for i, s in enumerate(state)):
            raise CompileError(f"optimizer {type(self.clones[k]).__name__} with these settings: "
                               "its state is not a fixed number of tensors shaped like each "
                               "weight, so it cannot be split with the weights")
        return len(state) // n

    def slots(self, k: int) -> List[List]:
        """[slot s][variable i] of shard k, variables in head.shard_variables order."""
        state, n = self._state(k), len(self.head.shard_variables(k))
        state = [v.value if hasattr(v, "value") else v for v in state]
        return [[state[i * self.num_slots + s] for i in range(n)] for s in range(self.num_slots)]

    def flat_slots(self, k: int) -> List:
        """Shard k's slots, slot by slot, each in head.shard_variables order."""
        return [v for slot in self.slots(k) for v in slot]

    def learning_rate(self, shard: int) -> tf.Tensor:
        """Shard `shard`'s current rate: the fc_optimizer's own schedule, if it has one; else
        the trunk optimizer's current rate (its schedule, LearningRateScheduler) times the
        ratio set at compile."""
        if self.own_schedule:
            return tf.cast(self.clones[shard].learning_rate, tf.float32)
        return tf.cast(self.trunk_optimizer.learning_rate, tf.float32) * self.lr_ratio

    def apply(self, shard: int, grads: List[tf.Tensor]) -> None:
        """Keras' own update on this shard: decoupled weight decay (as Keras applies it,
        before the step, at the current rate), then the optimizer's update_step."""
        clone = self.clones[shard]
        lr = self.learning_rate(shard)
        for g, v in zip(grads, self.head.shard_variables(shard)):
            if self.weight_decay:
                v.assign_sub(v * tf.cast(self.weight_decay * lr, v.dtype))
            clone.update_step(g, v, lr)
        with tf.control_dependencies(grads):  # see ParallelModel._after_data
            clone.iterations.assign_add(1)


def _initial_rate(optimizer: keras.optimizers.Optimizer) -> float:
    lr = optimizer.get_config()["learning_rate"]
    if isinstance(lr, dict):  # a serialized schedule: its rate at step 0
        lr = keras.optimizers.schedules.deserialize(lr)(0)
    return float(lr)


def _rate_ratio(optimizer, fc_optimizer) -> float:
    """FC rate / trunk rate, fixed at compile (1 without an fc_optimizer)."""
    if fc_optimizer is None:
        return 1.0
    trunk_rate = _initial_rate(optimizer)
    if trunk_rate <= 0:
        raise CompileError("with fc_optimizer, the trunk optimizer's rate at step 0 must be > 0 "
                           "(the FC rate follows it in the ratio of the two)")
    return _initial_rate(keras.optimizers.get(fc_optimizer)) / trunk_rate


def _same_rank(labels: tf.Tensor, outputs: tf.Tensor):
    """Keras' rank rule for a loss function (`squeeze_or_expand_to_same_rank`, applied by its
    `LossFunctionWrapper`): when the ranks differ by one and the longer has a last axis of 1,
    rank-1 labels gain that axis, else the longer loses it."""
    lr, orank = labels.shape.rank, outputs.shape.rank
    if lr == orank + 1 and labels.shape[-1] == 1:
        return (labels, outputs[:, None]) if orank == 1 else (tf.squeeze(labels, -1), outputs)
    if orank == lr + 1 and outputs.shape[-1] == 1:
        return (labels[:, None], outputs) if lr == 1 else (labels, tf.squeeze(outputs, -1))
    return labels, outputs


class _FunctionLoss(keras.losses.Loss):
    """A string or plain-function loss as Keras' compile wraps it (ranks aligned first)."""

    def __init__(self, fn):
        super().__init__(name=getattr(fn, "__name__", None))
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(*_same_rank(y_true, y_pred))


def _per_example_loss(loss):
    """(labels, outputs) -> per-example values of the compiled loss (a mean over each
    round's rows is taken by the engine, as Keras' default reduction does).

    A string or plain function is wrapped in `LossFunctionWrapper` as Keras' compile does, so
    that labels and outputs are brought to the same rank first ([B] labels against a [B, 1]
    head); labels are converted to the loss's dtype as `Loss.__call__` does."""
    if loss is None:
        raise CompileError("loss is required")
    fn = keras.losses.get(loss)
    if not isinstance(fn, keras.losses.Loss):
        fn = _FunctionLoss(fn)
    config = fn.get_config()
    if config.get("reduction") not in ("sum_over_batch_size", "mean"):
        raise CompileError(f"loss reduction {config.get('reduction')!r} is not supported "
                           "(the loss is averaged over each round's rows)")
    if config.get("ignore_class") is not None:
        raise CompileError("ignore_class is not supported (the loss is averaged over "
                           "every row of a round)")
    dtype = tf.as_dtype(fn.dtype or "float32")

    def per_example(labels, outputs):
        values = fn.call(tf.cast(labels, dtype), outputs)
        if values.shape.rank != 1:
            raise CompileError(f"the loss must give one value per example; it gave shape "
                               f"{values.shape}")
        return values

    return per_example


def _refuse_weights(sample_weight, class_weight) -> None:
    if class_weight is not None or sample_weight is not None:
        raise keras_data.DataError("class and sample weights are not supported by a "
                                   "parallelized model")


def _own_share(rows: tf.Tensor) -> tf.Tensor:
    """This replica's 1/K of rows that every replica holds (the gathered batch). Keras sums a
    metric's variables over replicas (they are ON_READ, SUM): fed the whole batch on every
    replica, a count metric (TruePositives, ...) would come out K times too large."""
    k, n = coll.replica_id(), coll.num_replicas()
    per = rows.shape[0] // n
    return rows[k * per:(k + 1) * per]


class ParallelModel(keras.Model):
    """A Keras model whose trunk is data parallel and whose Dense head is sharded (see the
    module docstring). Build it with `owt_tf.parallelize`."""

    def __init__(self, hybrid: HybridStrategy, split: KerasSplit, source: dict, seed: int):
        super().__init__(name=f"{split.trunk.name.removesuffix('_trunk')}_parallel")
        self._hybrid = hybrid
        self._source_json = json.dumps(source)
        self._dense_names = list(split.dense_names)
        self._seed = int(seed)
        self._step_offset = 0  # optimizer steps taken under earlier compiles (dropout seeds)
        trunk = keras.models.clone_model(split.trunk)  # in the scope: mirrored variables
        trunk.set_weights(split.trunk.get_weights())
        self.trunk = trunk
        self.head = hybrid.place_head(split.head, split.head_weights, split.compute_dtype)
        self._fc_optimizer: Optional[_ShardOptimizers] = None
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
        self._refuse_settings(steps_per_execution, run_eagerly, jit_compile, loss, kwargs)
        with self._hybrid.scope():
            optimizer = keras.optimizers.get(optimizer)
        fc_template = keras.optimizers.get(fc_optimizer) if fc_optimizer is not None else optimizer
        for opt in (optimizer, fc_template):
            self._refuse_optimizer(opt)
        previous = getattr(self, "optimizer", None)
        if previous is not None and previous is not optimizer:
            # A recompile: the head's dropout masks go on from where the last optimizer's
            # steps left them instead of repeating the first run's sequence.
            self._step_offset += int(previous.iterations.numpy())
        trunk_optimizer = self._in_scope(optimizer)
        super().compile(optimizer=trunk_optimizer, loss=loss, metrics=metrics,
                        steps_per_execution=1, run_eagerly=False, jit_compile=False, **kwargs)
        # Built now, not at the first fit: load_weights then restores the trunk's optimizer
        # state together with the shards' (Keras skips an unbuilt optimizer's state).
        if not trunk_optimizer.built:
            with self._hybrid.scope():
                trunk_optimizer.build(self.trunk.trainable_variables)
        self.head.per_example_loss = _per_example_loss(loss)
        self._fc_optimizer = _ShardOptimizers(fc_template, self.head, self._hybrid.devices,
                                              trunk_optimizer, _rate_ratio(optimizer, fc_optimizer),
                                              own_schedule=fc_optimizer is not None)
        if self._pending_fc_slots is not None:
            self._restore_fc_slots(self._pending_fc_slots)
            self._pending_fc_slots = None

    def _in_scope(self, optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
        """The user's own optimizer object (so that `model.optimizer is opt` and callbacks
        holding `opt` act on the run), with its state created inside the strategy's scope.
        Keras' TF optimizer captures the strategy current at construction
        (`_distribution_strategy`); one made outside the scope breaks fit once it has slots
        ("Mixing different tf.distribute.Strategy objects"), so such an unused optimizer is
        initialised again, in place, from its own config inside the scope."""
        if getattr(optimizer, "_distribution_strategy", None) is not self._hybrid.strategy:
            config = optimizer.get_config()
            if isinstance(config["learning_rate"], dict):  # a serialized schedule
                config["learning_rate"] = keras.optimizers.schedules.deserialize(
                    config["learning_rate"])
            with self._hybrid.scope():
                optimizer.__init__(**config)
        return optimizer

    def _refuse_settings(self, steps_per_execution, run_eagerly, jit_compile, loss, kwargs):
        if steps_per_execution != 1:
            raise CompileError(f"steps_per_execution={steps_per_execution!r} is not supported "
                               "(1 only): Keras fails with more under MirroredStrategy "
                               "(keras-team/keras#19246)")
        if kwargs.get("loss_scale_factor") is not None:
            raise CompileError("loss_scale_factor is not supported (the shards' updates would "
                               "not be scaled like the trunk's)")
        if run_eagerly:
            raise CompileError("run_eagerly=True is not supported: the forward gather and the "
                               "backward all-to-all of different replicas deadlock when run op "
                               "by op")
        if jit_compile is True:
            raise CompileError("jit_compile=True on the whole step is not supported: XLA cannot "
                               "hold variables of several devices in one cluster; use "
                               "HybridStrategy(jit=True), which compiles each trunk")
        if isinstance(loss, (dict, list, tuple)) or kwargs.get("loss_weights"):
            raise CompileError("one loss for one output only (the model has one output)")
        if self._hybrid.loss == "sharded":
            raise CompileError("HybridStrategy(loss='sharded') computes its own cross-entropy; "
                               "use loss='gathered' with a compiled loss")

    def _refuse_optimizer(self, opt):
        if isinstance(opt, keras.optimizers.LossScaleOptimizer):
            raise CompileError("LossScaleOptimizer is not supported (float32 only)")
        for attr, why in (("clipvalue", "Keras clips each replica's part of a trunk "
                                        "gradient, not the sum"),
                          ("clipnorm", "a norm over a whole FC layer spans its shards"),
                          ("global_clipnorm", "a norm over all weights spans the shards"),
                          ("use_ema", "EMA weights are not kept for shards"),
                          ("gradient_accumulation_steps", "accumulation is not supported")):
            if getattr(opt, attr, None):
                raise CompileError(f"optimizer {attr}: not supported ({why})")
        if opt.built and opt is not getattr(self, "optimizer", None):
            raise CompileError("pass an optimizer that has not been used yet (it is rebuilt "
                               "inside the strategy's scope)")
        # Exclusions are not in the optimizer's config, so its copies would decay every weight.
        if getattr(opt, "_exclude_from_weight_decay", None) or getattr(
                opt, "_exclude_from_weight_decay_pattern", None):
            raise CompileError("exclude_from_weight_decay is not supported")

    # -- steps (traced by Keras inside strategy.run) --------------------------------------
    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)  # fit refused sample weights
        plan = self._hybrid.step_rounds(self._static_rows(x))
        trunk_vars = self.trunk.trainable_variables
        step = tf.cast(self.optimizer.iterations, tf.int64) + self._step_offset
        step_seed = tf.cast(tf.stack([tf.constant(self._seed, tf.int64), step]), tf.int32)

        def apply_trunk(grads):
            if not grads:  # a frozen trunk: the step still counts (schedules, dropout seeds)
                self.optimizer.iterations.assign_add(1)
                return
            k = coll.num_replicas()
            coll.record(coll.CONV_GRAD, "all_reduce",
                        sum(coll.all_reduce_cost(coll.tensor_bytes(g), k) for g in grads))
            self.optimizer.apply_gradients(zip(grads, trunk_vars))

        step = replica_train_step(plan, self.head, self._hybrid.trunk_forward(self.trunk, True),
                                  trunk_vars, x, y, step_seed, apply_trunk,
                                  self._fc_optimizer.apply)
        rounds = step.rounds
        loss = rounds.loss_sum / rounds.count
        if step.trunk_loss is not None:
            loss += step.trunk_loss
        with self._after_data(loss):
            self._loss_metric().update_state(loss, sample_weight=rounds.count)
            return self.compute_metrics(x, _own_share(tf.concat(rounds.labels, 0)),
                                        _own_share(tf.concat(rounds.outputs, 0)))

    def test_step(self, data):
        x, y, weight = keras.utils.unpack_x_y_sample_weight(data)
        logits = replica_logits(True, self.head, self._hybrid.trunk_forward(self.trunk, False), x)
        labels = coll.gather_labels(y)
        weight = tf.ones([tf.shape(logits)[0]]) if weight is None else coll.gather_labels(weight)
        outputs = self.head.outputs(logits)
        per_example = tf.cast(self.head.per_example_loss(labels, outputs), tf.float32)
        count = tf.reduce_sum(weight)
        loss = tf.reduce_sum(per_example * weight) / tf.maximum(count, 1.0)
        if self.trunk.losses:
            loss += tf.add_n(self.trunk.losses)
        # Keras' `metrics` ignore sample weights (only `weighted_metrics` use them): drop the
        # padding rows instead.
        labels, outputs, real = (_own_share(t) for t in (labels, outputs, weight > 0))
        with self._after_data(loss):
            self._loss_metric().update_state(loss, sample_weight=count)
            return self.compute_metrics(x, tf.boolean_mask(labels, real),
                                        tf.boolean_mask(outputs, real))

    def predict_step(self, data):
        x, valid = (data[0], data[1]) if isinstance(data, (tuple, list)) and len(data) > 1 else (
            data[0] if isinstance(data, (tuple, list)) else data, None)
        logits = replica_logits(True, self.head, self._hybrid.trunk_forward(self.trunk, False), x)
        rows = self._static_rows(x)
        k = coll.replica_id()
        outputs = self.head.outputs(logits[k * rows:(k + 1) * rows])
        return outputs if valid is None else tf.boolean_mask(outputs, valid > 0)

    def call(self, inputs, training=False):
        """One-device forward pass in inference mode (every shard joined): Keras' symbolic
        build and direct calls. fit / evaluate / predict run the distributed steps above."""
        if training:
            raise TrainingCallError(
                "model(x, training=True) is not supported on a parallelized model: train with "
                "fit or train_on_batch (a GradientTape over model.trainable_variables would "
                "see the trunk only, not the FC shards)")
        features = self.trunk(inputs, training=False)
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
        """Keras' fit. Arrays or a tf.data.Dataset of (x, y); a last partial global batch is
        dropped (every replica needs the same number of rows)."""
        if validation_split:
            raise keras_data.DataError("validation_split is not supported: pass validation_data")
        _refuse_weights(sample_weight, class_weight)
        train, per_replica = keras_data.training_batches(x, y, batch_size, shuffle,
                                                         self._hybrid.num_replicas)
        self._hybrid.step_rounds(per_replica)  # refuses a batch the scheme cannot split
        self._fresh_function("train_function", train)
        if validation_data is not None:
            validation_data = self._evaluation_data(validation_data, validation_batch_size)
            self._fresh_function("test_function", validation_data)
        return super().fit(train, epochs=epochs, validation_data=validation_data,
                           shuffle=False, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, **kwargs):
        """Keras' evaluate over every row (the last batch padded with rows of weight 0)."""
        if kwargs.get("sample_weight") is not None:
            raise keras_data.DataError("sample weights are not supported by a parallelized model")
        kwargs.pop("sample_weight", None)
        if kwargs.get("_use_cached_eval_dataset"):  # fit's validation: already padded
            return super().evaluate(x, y, **kwargs)
        data = keras_data.padded_batches(x, y, batch_size, self._hybrid.num_replicas, True)
        self._fresh_function("test_function", data)
        return super().evaluate(data, **kwargs)

    def predict(self, x, batch_size=None, **kwargs):
        """Keras' predict; every row, in order (the last batch padded, the padding dropped)."""
        data = keras_data.padded_batches(x, None, batch_size, self._hybrid.num_replicas, False)
        self._fresh_function("predict_function", data)
        return super().predict(data, **kwargs)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """Keras' train_on_batch: one step on the global batch (x, y), each replica taking
        its own rows (Keras' own would hand every replica the whole batch)."""
        _refuse_weights(sample_weight, class_weight)
        data, _ = keras_data.training_batches(x, y, len(x), False, self._hybrid.num_replicas)
        self._hybrid.step_rounds(len(x) // self._hybrid.num_replicas)
        return self._one_batch("train_function", self.make_train_function, data, return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        """Keras' test_on_batch over every row of (x, y), each replica taking its own rows."""
        _refuse_weights(sample_weight, None)
        data = keras_data.padded_batches(x, y, len(x), self._hybrid.num_replicas, True)
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
        iterator = iter(self._hybrid.strategy.experimental_distribute_dataset(data))
        # The metrics' own results (their variables summed over replicas), as Keras' loops
        # report at the end of an epoch; the step's logs are per-replica values averaged.
        logs = self._get_metrics_result_or_logs(getattr(self, name)(iterator))
        logs = {k: float(np.asarray(v)) for k, v in logs.items()}
        return logs if return_dict else self._flatten_metrics_in_order(logs)

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
        if isinstance(data, (tuple, list)) and len(data) == 2:
            return keras_data.padded_batches(data[0], data[1], batch_size,
                                             self._hybrid.num_replicas, True)
        raise keras_data.DataError("validation_data must be (x, y) or a tf.data.Dataset")

    # -- weights, saving, export -------------------------------------------------------------
    def fc_weights(self) -> List:
        """Every Dense layer of the head whole: [(kernel, bias), ...] as numpy arrays."""
        return self.head.full_weights(self._hybrid.read_shards)

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
            state[f"fc{i}_kernel"], state[f"fc{i}_bias"] = head[2 * i], head[2 * i + 1]
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
        """The model as a plain one-device Keras model (`.keras`): it loads without owt_tf.
        Optimizer state is not in it; resume training from save_weights / BackupAndRestore."""
        return self.to_keras_model().save(filepath, overwrite=overwrite, **kwargs)

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
        head = self.head
        state = {}
        for i, (kernel, bias) in enumerate(self.fc_weights()):
            state[f"fc{i}_kernel"], state[f"fc{i}_bias"] = kernel, bias
        if self._fc_optimizer is not None:
            opt = self._fc_optimizer
            per_shard = self._hybrid.read_shards({k: opt.flat_slots(k) for k in head.local_shards})
            for s, layers in enumerate(head.join_groups(per_shard, opt.num_slots)):
                for i, (kernel, bias) in enumerate(layers):
                    state[f"fc{i}_kernel_slot{s}"], state[f"fc{i}_bias_slot{s}"] = kernel, bias
            first = opt.clones[head.local_shards[0]]
            state["fc_iterations"] = np.asarray(first.iterations.numpy())
            state[FC_OPTIMIZER_KIND] = np.frombuffer(opt.kind.encode(), np.uint8)
        return state

    def _restore_head(self, state: Dict[str, np.ndarray]) -> None:
        head = self.head
        for i, layer in enumerate(head.layers):
            kernel, bias = state[f"fc{i}_kernel"], state[f"fc{i}_bias"]
            if kernel.shape != (layer.in_dim, layer.out_dim):
                raise ValueError(f"{self._dense_names[i]}: saved as {kernel.shape}, this model "
                                 f"has {(layer.in_dim, layer.out_dim)}")
            head.assign_whole(head.shard_variables, 0, i, kernel, bias)
        slots = {k: v for k, v in state.items()
                 if "_slot" in k or k in ("fc_iterations", FC_OPTIMIZER_KIND)}
        if not slots:
            return
        if self._fc_optimizer is None:  # loaded before compile: applied by compile
            self._pending_fc_slots = slots
        else:
            self._restore_fc_slots(slots)

    def _restore_fc_slots(self, state: Dict[str, np.ndarray]) -> None:
        """The FC optimizer's slots and step count, if they were saved by the same kind of
        optimizer with as many slots; else fresh ones are kept with a warning, as Keras does
        for an optimizer whose saved state does not match."""
        head, opt = self.head, self._fc_optimizer
        saved_kind = (bytes(np.asarray(state[FC_OPTIMIZER_KIND], np.uint8)).decode()
                      if FC_OPTIMIZER_KIND in state else None)  # files before the kind was kept
        saved_slots = len({k.rsplit("_slot", 1)[1] for k in state if "_slot" in k})
        if (saved_kind or opt.kind) != opt.kind or saved_slots != opt.num_slots:
            warnings.warn(f"Skipping the FC optimizer state: it was saved by "
                          f"{saved_kind or 'an optimizer'} with {saved_slots} slot(s) per weight; "
                          f"this model's FC optimizer is {opt.kind} with {opt.num_slots}",
                          stacklevel=2)
            return
        for s in range(opt.num_slots):
            for i in range(len(head.layers)):
                head.assign_whole(opt.flat_slots, s, i, state[f"fc{i}_kernel_slot{s}"],
                                  state[f"fc{i}_bias_slot{s}"])
        for clone in opt.clones.values():
            clone.iterations.assign(int(state.get("fc_iterations", 0)))
