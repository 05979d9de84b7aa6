"""HybridStrategy: conv trunk data-parallel under MirroredStrategy, FC layers model-parallel.

It wraps a tf.distribute.MirroredStrategy (the trunk's variables are MirroredVariables,
its gradients all-reduced) and adds what tf.distribute has no notion of: FC layers whose
shards live one per device (owt_tf.parallel.shards), activations moved between replicas
by a scheme (owt_tf.parallel.schemes), and the byte ledger of everything exchanged.

Across processes (a `Cluster`) the wrapped strategy is MultiWorkerMirroredStrategy: the
same replica function runs on every worker's devices, K = W * D replicas in all; FC shard
j lives on global replica j's device, so each process creates and updates only its own
shards, and reads the others' (checkpoints, exports) with a collective gather.

Usage (train_step inside a tf.function):

    hybrid = HybridStrategy(devices, "owt-b", batch_size=128, fc_batch="worker")
    model = hybrid.build_model(spec, seed)
    optim = owt_tf.training.optim.build_optimizer(hybrid, model, conv_lr, fc_lr, momentum,
                                                  weight_decay)
    metrics = hybrid.train_step(model, optim, dist_images, dist_labels, dropout_seed)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
import tensorflow as tf

from owt_tf.cluster import Cluster
from owt_tf.devices import (make_multiworker_strategy, make_strategy, outside_strategy_scope,
                            replica_devices)
from owt_tf.models.spec import ModelSpec
from owt_tf.parallel import collectives as coll
from owt_tf.models.cost import NetworkCost
from owt_tf.parallel.auto import DEFAULT_BATCH, AutoChoice, choose, run_hardware
from owt_tf.parallel.cost_model import OWT_SCHEMES
from owt_tf.parallel.plan import (AUTO, ParallelPlan, PlanError, Scheme, StepRounds,
                                  check_auto_processes)
from owt_tf.parallel.precision import keras_policy
from owt_tf.parallel.shards import ShardedHead, ShardReader, assemble, read_local_shards
from owt_tf.parallel.step import replica_logits, replica_train_step


@dataclasses.dataclass
class DistributedModel:
    """A ModelSpec placed by a HybridStrategy: mirrored trunk + sharded (or mirrored) head."""

    spec: ModelSpec
    trunk: keras.Model
    head: ShardedHead
    # How this process reads every FC shard (a collective gather in a cluster: every
    # worker must then call full_weights / named_weights at the same point).
    read_shards: ShardReader = read_local_shards

    def full_weights(self) -> Dict[str, List[np.ndarray]]:
        """All weights as one device would hold them: trunk list and [(kernel, bias), ...]."""
        return {"trunk": [np.asarray(w) for w in self.trunk.get_weights()],
                "head": self.head.full_weights(self.read_shards)}

    def named_weights(self) -> Dict[str, np.ndarray]:
        named = {f"trunk/{v.path}": np.asarray(v.numpy()) for v in self.trunk.weights}
        for i, (kernel, bias) in enumerate(self.head.full_weights(self.read_shards)):
            named[f"fc{i}/kernel"], named[f"fc{i}/bias"] = kernel, bias
        return named


_ACTIVE: List["HybridStrategy"] = []  # entered HybridStrategy scopes, innermost last


def current_strategy() -> Optional["HybridStrategy"]:
    """The HybridStrategy whose `scope()` is innermost on this thread, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


class HybridStrategy:
    """The custom distribution strategy of owt_tf (wraps a MirroredStrategy).

        strategy = owt_tf.HybridStrategy(devices=4, scheme="owt-b", fc_batch="worker")
        with strategy.scope():
            model = owt_tf.parallelize(keras_model)

    `devices`: a count K (K GPUs when there are that many, else K logical CPUs) or this
    process's device names. With a `cluster` of several workers, every worker passes its
    own D devices and the run has W * D replicas. `batch_size` (per replica) is needed only
    by the CLI's loop, which knows it up front; Keras' `fit` takes it from the data.

    `scheme="auto"`: the scheme, `fc_exchange` and `loss` are left to the planner
    (owt_tf.parallel.auto) and chosen by `choose_scheme` when the model is known: by
    `owt_tf.parallelize(model)`, the first place where both the model and K are known (the
    strategy is built before the model, inside whose scope the model is made), and by the
    CLI's Trainer once its model is built. `fc_exchange` and `loss` given with it are then
    ignored; `fc_batch` and `jit` are kept. One process only: the workers of a cluster
    could measure different hardware and pick different schemes.
    """

    def __init__(self, devices: Union[int, Sequence[str]] = 2, scheme: str = "owt-b",
                 batch_size: Optional[int] = None, fc_batch: str = "global",
                 fc_exchange: str = "gather", loss: str = "gathered", jit: bool = False,
                 cluster: Optional[Cluster] = None, precision: str = "fp32"):
        auto = str(scheme) == AUTO
        check_auto_processes(scheme, cluster.num_workers if cluster is not None else 1)
        # Until choose_scheme: owt-b's plan checks the flags auto keeps (fc_batch, jit).
        self.parallel_plan = ParallelPlan("owt-b" if auto else scheme, fc_batch, fc_exchange,
                                          loss, jit, precision)
        self.auto_choice: Optional[AutoChoice] = None
        self._pending_auto = auto
        self._batch_size = batch_size
        if isinstance(devices, int):
            self.parallel_plan.check_devices(devices)
            from owt_tf.devices import setup_devices

            devices = setup_devices(devices)
        self.local_devices = list(devices)
        self.cluster = cluster if cluster is not None and cluster.num_workers > 1 else None
        num_replicas = len(self.local_devices) * (self.cluster.num_workers if self.cluster else 1)
        self.parallel_plan.check_devices(num_replicas)
        if batch_size is not None:
            self.parallel_plan.check_batch(num_replicas, batch_size)
        if self.cluster is None:
            self.strategy = make_strategy(self.local_devices)
            self.devices, self.worker_id = list(self.local_devices), 0
        else:
            self.strategy = make_multiworker_strategy(self.cluster, self.local_devices)
            self.devices = replica_devices(self.cluster, self.local_devices)
            self.worker_id = self.cluster.worker_id
        # The rounds of a step at the CLI's fixed batch size (Keras: per batch shape).
        self.plan: Optional[StepRounds] = (
            self.parallel_plan.rounds(num_replicas, batch_size) if batch_size and not auto else None)
        self.fc_exchange = fc_exchange
        self.loss = loss
        self.jit = jit
        self._compiled_trunks: Dict[tuple, tf.types.experimental.GenericFunction] = {}
        self._compiled_gathers: Dict[tuple, tf.types.experimental.GenericFunction] = {}
        self._compiled_sums: Dict[int, tf.types.experimental.GenericFunction] = {}
        self.ledger = coll.TrafficLedger()

    def choose_scheme(self, net: Optional[NetworkCost], hidden: Sequence[int] = (),
                      schemes: Sequence[str] = OWT_SCHEMES, note: str = "") -> AutoChoice:
        """Resolves `scheme="auto"` for a model of cost `net` (None: one the cost model
        cannot count, `note` says why; `hidden`: its hidden FC widths) on this process's
        hardware: the planner's fastest of `schemes` at this K and batch (DEFAULT_BATCH per
        replica when none was given). Sets the strategy's plan and returns the choice."""
        if not self._pending_auto:
            raise PlanError("scheme", f"already {self.scheme}: choose_scheme resolves 'auto' once")
        hw = run_hardware(self.local_devices)
        batch = self._batch_size or DEFAULT_BATCH
        choice = choose(net, hw, self.num_replicas, batch, self.parallel_plan.fc_batch,
                        schemes, hidden, note, self.parallel_plan.precision)
        fc_batch = self.parallel_plan.fc_batch if Scheme(choice.scheme).has_rounds else "global"
        self.parallel_plan = ParallelPlan(choice.scheme, fc_batch, choice.fc_exchange,
                                          choice.loss, self.jit, self.parallel_plan.precision)
        self.parallel_plan.check_devices(self.num_replicas)
        if self._batch_size is not None:
            self.parallel_plan.check_batch(self.num_replicas, self._batch_size)
            self.plan = self.parallel_plan.rounds(self.num_replicas, self._batch_size)
        self.fc_exchange, self.loss = choice.fc_exchange, choice.loss
        self._pending_auto = False
        self.auto_choice = choice
        return choice

    def _check_chosen(self) -> None:
        if self._pending_auto:
            raise PlanError("scheme", "'auto' is chosen once the model is known: call "
                            "owt_tf.parallelize(model) (or choose_scheme) first")

    @contextlib.contextmanager
    def scope(self) -> Iterator["HybridStrategy"]:
        """The wrapped strategy's scope (variables created in it are mirrored: the trunk),
        and the strategy `owt_tf.parallelize` uses when none is passed."""
        _ACTIVE.append(self)
        try:
            with self.strategy.scope():
                yield self
        finally:
            _ACTIVE.pop()

    @property
    def scheme(self) -> str:
        return AUTO if self._pending_auto else str(self.parallel_plan.scheme)

    @property
    def model_parallel(self) -> bool:
        self._check_chosen()
        return self.parallel_plan.model_parallel

    def step_rounds(self, batch_size: int) -> StepRounds:
        """The rounds of a step whose replicas hold `batch_size` rows each."""
        self._check_chosen()
        return self.parallel_plan.rounds(self.num_replicas, batch_size)

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    @property
    def num_workers(self) -> int:
        return 1 if self.cluster is None else self.cluster.num_workers

    @property
    def is_chief(self) -> bool:
        """Whether this process writes the run's files (checkpoints, TensorBoard, exports)."""
        return self.worker_id == 0

    @property
    def local_replicas(self) -> List[int]:
        """Global indices of this process's replicas (and of the FC shards it holds)."""
        d = len(self.local_devices)
        return list(range(self.worker_id * d, (self.worker_id + 1) * d))

    # -- placement ---------------------------------------------------------------------
    def build_model(self, spec: ModelSpec, seed: int) -> DistributedModel:
        """Trunk mirrored on every device; FC shard k on devices[k] (or mirrored for 'data').
        Both compute in the plan's precision (a user's model: in its own dtype policy), with
        float32 weights."""
        with self.strategy.scope(), keras_policy(self.parallel_plan.compute_dtype):
            trunk = spec.build_trunk()
        trunk_weights, full = spec.initial_weights_for(trunk, seed)
        trunk.set_weights(trunk_weights)
        head = self.place_head(spec.head, full, spec.compute_dtype)
        return DistributedModel(spec, trunk, head, self.read_shards)

    def place_head(self, spec, full_weights, compute_dtype: Optional[str] = None) -> ShardedHead:
        """Where FC shards are placed: shard k on replica k's device (each process creates only
        its own); under pure data parallelism one mirrored copy. They compute in
        `compute_dtype` (default: the plan's precision)."""
        dtype = compute_dtype or self.parallel_plan.compute_dtype
        if self.model_parallel:
            # Outside strategy.scope(): tf.device is ignored for variables created inside it
            # (tensorflow/tensorflow#56416).
            # A thread of its own: the caller may be inside a strategy scope.
            return outside_strategy_scope(lambda: ShardedHead(
                spec, full_weights, self.devices, self.fc_exchange, self.loss,
                local=self.local_replicas, compute_dtype=dtype))
        with self.strategy.scope():
            return ShardedHead(spec, full_weights, [None], "gather", "gathered",
                               compute_dtype=dtype)

    def read_shards(self, per_shard: Dict[int, List[tf.Variable]]) -> List[List[np.ndarray]]:
        """Values of every FC shard's variables (the ShardReader of this strategy's models):
        read directly in one process; in a cluster gathered from all workers by a
        collective, so every worker must call it at the same point."""
        if self.cluster is None or not self.model_parallel:
            return read_local_shards(per_shard)
        key = tuple(id(v) for k in sorted(per_shard) for v in per_shard[k])
        if key not in self._compiled_gathers:
            def replica_fn():
                return coll.gather_shard_values(per_shard[coll.replica_id()])

            self._compiled_gathers[key] = tf.function(lambda: self._run(replica_fn))
        stacked = [self.strategy.experimental_local_results(t)[0].numpy()
                   for t in self._compiled_gathers[key]()]
        return [[s[k] for s in stacked] for k in range(self.num_replicas)]

    def sum_over_workers(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum over the cluster's workers of each worker's int64 vector (one small
        all-reduce, outside any step's ledger); `values` itself in one process. How workers
        agree between steps: any non-finite flag, any stop request."""
        values = np.asarray(values, np.int64)
        if self.cluster is None:
            return values
        n = values.shape[0]
        if n not in self._compiled_sums:
            d = len(self.local_devices)

            def total(v):
                per_replica = self.strategy.experimental_distribute_values_from_function(
                    lambda ctx: v if ctx.replica_id_in_sync_group % d == 0 else tf.zeros_like(v))
                return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

            self._compiled_sums[n] = tf.function(total)
        return self._compiled_sums[n](tf.constant(values)).numpy()

    def wait_for_workers(self, name: str, timeout_s: float = 600.0) -> None:
        """Returns once every worker of the cluster has called it with this `name` (the
        coordination service's barrier); at once in one process."""
        if self.cluster is None:
            return
        from tensorflow.python.eager import context

        self._barriers = getattr(self, "_barriers", 0) + 1
        context.context().wait_at_barrier(f"owt_tf/{name}/{self._barriers}",
                                          int(timeout_s * 1000))

    def distribute_batches(self, dataset: tf.data.Dataset) -> tf.distribute.DistributedDataset:
        """A dataset of global batches (tuples whose first dimension is B*K) as per-replica
        batches: replica k gets rows k*B ... (k+1)*B-1 (the run contract, docs/design.md). Each
        process keeps only its own replicas' rows, before anything else is done to them."""
        first, count = self.own_rows

        def own_rows(*batch):
            return tuple(t[first:first + count] for t in batch)

        return self.distribute_own_rows(dataset.map(own_rows))

    @property
    def own_rows(self) -> Tuple[int, int]:
        """(first, count): the rows of each global batch this process's replicas take."""
        b, d = self.plan.batch_size, len(self.local_devices)
        return self.worker_id * d * b, d * b

    def distribute_own_rows(self, dataset: tf.data.Dataset) -> tf.distribute.DistributedDataset:
        """A dataset of this process's own rows of each global batch (`own_rows`, e.g. a
        streamed dataset's `train_rows`) as per-replica batches: local replica i gets rows
        i*B ... (i+1)*B-1 of them."""
        # Consecutive elements go to consecutive local replicas.
        local = dataset.rebatch(self.plan.batch_size, drop_remainder=True)
        return self.strategy.distribute_datasets_from_function(lambda ctx: local)

    def distribute_global_batch(self, array) -> "tf.distribute.DistributedValues":
        """A global batch (numpy or tensor) split by rows: replica k gets rows k*B ... (k+1)*B-1,
        B = rows / K (the run contract, docs/design.md; experimental_distribute_dataset does the same)."""
        rows = int(array.shape[0]) // self.num_replicas

        def local(ctx):
            k = ctx.replica_id_in_sync_group
            return tf.convert_to_tensor(array[k * rows:(k + 1) * rows])

        return self.strategy.experimental_distribute_values_from_function(local)

    def _run(self, fn, *args):
        """strategy.run, with each replica's inputs and ops pinned to its device.
        MultiWorkerMirrored with one device per worker hands the replica function inputs
        without a device, and ReplicaContext.all_gather of such a tensor fails
        ("destinations can not be empty", cross_device_ops.validate_destinations); with
        several devices per worker the inputs and replica threads carry the same device."""
        def placed(*replica_args):
            with tf.device(self.devices[coll.replica_id()]):
                return fn(*tf.nest.map_structure(tf.identity, replica_args))

        return self.strategy.run(placed, args=args)

    # -- steps (call inside a tf.function) ------------------------------------------------
    def train_step(self, model: DistributedModel, optim, images, labels,
                   seed: Optional[tf.Tensor] = None, with_grads: bool = False,
                   loss_scale: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        """One optimizer step on a distributed batch. Returns loss, error and (optionally) grads.

        `seed` (int32 [2]) seeds dropout; it must differ per step. `loss_scale` (fp16): the
        factor gradients are taken at (owt_tf.parallel.precision.DynamicLossScale). Traffic
        is counted into `self.ledger` while the step is traced.
        """
        self.ledger = coll.TrafficLedger()
        with coll.recording(self.ledger):
            step = functools.partial(self._replica_train_step, model, optim, seed=seed,
                                     with_grads=with_grads, loss_scale=loss_scale)
            out = self._run(step, images, labels)
        return self._merge_replica_outputs(out)

    def eval_step(self, model: DistributedModel, images, labels) -> Dict[str, tf.Tensor]:
        """Loss and top-1/top-5 counts on a distributed batch; rows with label < 0 are padding."""
        out = self._run(functools.partial(self._replica_eval_step, model), images, labels)
        return self._merge_replica_outputs(out)

    def assemble_fc_grads(self, model: DistributedModel, out) -> List[List[np.ndarray]]:
        """Per FC update of a train_step(with_grads=True): whole-layer gradients
        [kernel0, bias0, kernel1, ...], shards joined (mirrored layers under 'data': the
        replicas' parts summed)."""
        self._check_one_process("gradients of every shard")
        per_replica = out["fc_grads"]
        updates = []
        for u in range(len(per_replica[0])):
            grads = []
            for li, layer in enumerate(model.head.layers):
                kern = [np.asarray(r[u][2 * li]) for r in per_replica]
                bias = [np.asarray(r[u][2 * li + 1]) for r in per_replica]
                grads += (list(assemble(layer, kern, bias)) if self.model_parallel
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
        updates = self.plan.num_rounds if self.plan.updates_fc_every_round else 1
        for u in range(updates):
            suffix = f" (round {u + 1} of {updates})" if updates > 1 else ""
            for li in range(len(model.head.layers)):
                names += [f"gradient of fc{li + 1}/kernel{suffix}", f"gradient of fc{li + 1}/bias{suffix}"]
        return names

    def _check_one_process(self, what: str) -> None:
        if self.cluster is not None:
            raise NotImplementedError(f"{what}: not available in a multi-worker run (each "
                                      "process holds only its own replicas' results)")

    def predict_step(self, model: DistributedModel, images) -> tf.Tensor:
        """Logits [global batch, classes] of a distributed batch, rows in global order."""
        if not self.model_parallel:
            self._check_one_process("predict_step under data parallelism")
        out = self._run(functools.partial(self._replica_logits, model), images)
        local = self.strategy.experimental_local_results(out)
        return local[0] if self.model_parallel else tf.concat(list(local), axis=0)

    def trunk_forward(self, trunk: keras.Model, training: bool):
        """The trunk's forward pass as a step.TrunkForward; with jit, an XLA-compiled function
        per replica.

        Only this pure compute block is compiled: jit_compile on the whole step or replica
        function fails ("Trying to access resource ... located in device CPU:1 from device
        CPU:0": MirroredStrategy wraps one XLA cluster around all replicas unless every device
        is a GPU; CollectiveGatherV2 has no XLA kernel, keras-team/keras#18110). One function
        per replica, so that each captures its own replica's variables.
        """
        def forward(images):
            return trunk(images, training=training)

        compiled = forward
        if self.jit:
            key = (id(trunk), training, coll.replica_id())
            if key not in self._compiled_trunks:
                self._compiled_trunks[key] = tf.function(forward, jit_compile=True)
            compiled = self._compiled_trunks[key]

        def with_regularization(images):
            activations = compiled(images)
            losses = trunk.losses if training else []
            return activations, (tf.add_n(losses) if losses else None)

        return with_regularization

    def _replica_train_step(self, model, optim, images, labels, seed, with_grads, loss_scale):
        plan = self.plan
        trunk_vars = model.trunk.trainable_variables

        step = replica_train_step(plan, model.head, self.trunk_forward(model.trunk, True),
                                  trunk_vars, images, labels, seed, optim.trunk.apply,
                                  optim.fc.apply, loss_scale)
        rounds, trunk_grads = step.rounds, step.trunk_grads
        # The numerical guard's input: is each of these finite on this replica (names:
        # finite_check_names). Checked here, where every gradient exists, for one pass each.
        checks = [rounds.loss_sum] + list(trunk_grads) + [g for u in rounds.fc_grads for g in u]
        out = {"loss_sum": rounds.loss_sum, "correct": rounds.correct,
               "count": tf.constant(rounds.count),
               "finite": tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in checks])}
        if with_grads:
            out["trunk_grads"] = trunk_grads
            out["fc_grads"] = rounds.fc_grads
        return out

    def _replica_logits(self, model, images):
        return replica_logits(self.model_parallel, model.head,
                              self.trunk_forward(model.trunk, False), images)

    def _replica_eval_step(self, model, images, labels):
        logits = self._replica_logits(model, images)
        if self.model_parallel:
            labels = coll.gather_labels(labels)
        head = model.head
        valid = labels >= 0
        safe = tf.maximum(labels, 0)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=safe, logits=logits)
        top1 = tf.math.in_top_k(safe, logits, 1) & valid
        top5 = tf.math.in_top_k(safe, logits, min(5, head.spec.num_classes)) & valid
        return {"loss_sum": tf.reduce_sum(tf.where(valid, ce, 0.0)),
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
            local = self.strategy.experimental_local_results(value)
            if key in ("trunk_grads", "fc_grads"):
                merged[key] = local
            elif key == "finite":
                merged[key] = tf.reduce_all(tf.stack(list(local)), axis=0)
            elif self.model_parallel:
                merged[key] = local[0]
            elif self.cluster is not None:
                merged[key] = self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
            else:
                merged[key] = tf.add_n(list(local))
        return merged
