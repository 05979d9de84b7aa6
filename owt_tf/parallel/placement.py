"""Where a run executes: its devices, its cluster, the wrapped tf.distribute strategy, which
rows of a global batch each process and replica take, where the FC shards are placed, and
how processes agree (cross-worker sums, barriers, reading every shard). owt_tf's
counterpart of torchtitan's ParallelDims; nothing here knows what a step computes.

Across processes (a `Cluster`) the wrapped strategy is MultiWorkerMirroredStrategy: the
same replica function runs on every worker's devices, K = W * D replicas in all; FC shard
j lives on global replica j's device, so each process creates and updates only its own
shards, and reads the others' (checkpoints, exports) with a collective gather.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from owt_tf.runtime.cluster import Cluster
from owt_tf.runtime.devices import (make_multiworker_strategy, make_strategy, outside_strategy_scope,
                            replica_devices)
from owt_tf.models.spec import ModelSpec
from owt_tf.parallel import collectives as coll
from owt_tf.planner.plan import ParallelPlan, PlanError, sampling_problem
from owt_tf.parallel.precision import keras_policy
from owt_tf.parallel.step import TrunkRunner
from owt_tf.parallel.head.layout import ShardedHead, ShardReader, read_local_shards
from owt_tf.parallel.head.loss import HeadLoss


@dataclasses.dataclass
class DistributedModel:
    """A ModelSpec placed by a HybridStrategy: mirrored trunk + sharded (or mirrored) head."""

    spec: ModelSpec
    trunk: keras.Model
    head: ShardedHead
    # How this process reads every FC shard (a collective gather in a cluster: every
    # worker must then call full_weights / named_weights at the same point).
    read_shards: ShardReader = read_local_shards
    # The trunk's forward pass (XLA-compiled per replica with the plan's jit).
    trunk_runner: Optional[TrunkRunner] = None

    def __post_init__(self):
        if self.trunk_runner is None:
            self.trunk_runner = TrunkRunner(self.trunk)

    def full_weights(self) -> Dict[str, List[np.ndarray]]:
        """All weights as one device would hold them: trunk list and [(kernel, bias), ...]."""
        return {"trunk": [np.asarray(w) for w in self.trunk.get_weights()],
                "head": self.head.full_weights(self.read_shards)}

    def named_weights(self) -> Dict[str, np.ndarray]:
        named = {f"trunk/{v.path}": np.asarray(v.numpy()) for v in self.trunk.weights}
        for i, (kernel, bias) in enumerate(self.head.full_weights(self.read_shards)):
            named[f"fc{i}/kernel"], named[f"fc{i}/bias"] = kernel, bias
        return named


class Placement:
    """This process's devices (`local_devices`) and, with a cluster of several workers, every
    replica's (`devices`, K = W * D); the wrapped strategy over them."""

    def __init__(self, local_devices: Sequence[str], cluster: Optional[Cluster] = None):
        self.local_devices = list(local_devices)
        self.cluster = cluster if cluster is not None and cluster.num_workers > 1 else None
        if self.cluster is None:
            self.strategy = make_strategy(self.local_devices)
            self.devices, self.worker_id = list(self.local_devices), 0
        else:
            self.strategy = make_multiworker_strategy(self.cluster, self.local_devices)
            self.devices = replica_devices(self.cluster, self.local_devices)
            self.worker_id = self.cluster.worker_id
        self._compiled_gathers: Dict[tuple, tf.types.experimental.GenericFunction] = {}
        self._compiled_sums: Dict[int, tf.types.experimental.GenericFunction] = {}

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

    def check_one_process(self, what: str) -> None:
        if self.cluster is not None:
            raise NotImplementedError(f"{what}: not available in a multi-worker run (each "
                                      "process holds only its own replicas' results)")

    def build_model(self, plan: ParallelPlan, spec: ModelSpec, seed: int,
                    loss: Optional[HeadLoss] = None) -> DistributedModel:
        """Trunk mirrored on every device; FC shard k on devices[k] (or mirrored for 'data').
        Both compute in the plan's precision (a user's model: in its own dtype policy), with
        float32 weights. The head computes `loss` (default: the plan's, place_head)."""
        problem = sampling_problem(plan.sample_rate, plan.loss == "sharded")
        if problem:
            raise PlanError("sample_rate", f"{problem}: needs loss='sharded'")
        with self.strategy.scope(), keras_policy(plan.compute_dtype):
            trunk = spec.build_trunk()
        trunk_weights, full = spec.initial_weights_for(trunk, seed)
        trunk.set_weights(trunk_weights)
        head = self.place_head(plan, spec.head, full, spec.compute_dtype, loss)
        read = self.read_shards if plan.model_parallel else read_local_shards
        return DistributedModel(spec, trunk, head, read, TrunkRunner(trunk, plan.jit))

    def place_head(self, plan: ParallelPlan, spec, full_weights,
                   compute_dtype: Optional[str] = None,
                   loss: Optional[HeadLoss] = None) -> ShardedHead:
        """Where FC shards are placed: shard k on replica k's device (each process creates only
        its own); under pure data parallelism one mirrored copy. They compute in
        `compute_dtype` (default: the plan's precision) and compute `loss` (default: the
        plan's, HeadLoss)."""
        if loss is None:
            loss = HeadLoss(plan.loss, sample_rate=plan.sample_rate)
        dtype = compute_dtype or plan.compute_dtype
        if plan.model_parallel:
            # Outside strategy.scope(): tf.device is ignored for variables created inside it
            # (tensorflow/tensorflow#56416).
            # A thread of its own: the caller may be inside a strategy scope.
            return outside_strategy_scope(lambda: ShardedHead(
                spec, full_weights, self.devices, plan.fc_exchange, loss,
                local=self.local_replicas, compute_dtype=dtype))
        with self.strategy.scope():
            return ShardedHead(spec, full_weights, [None], "gather", loss, compute_dtype=dtype)

    def read_shards(self, per_shard: Dict[int, List[tf.Variable]]) -> List[List[np.ndarray]]:
        """Values of every FC shard's variables (the ShardReader of this strategy's models):
        read directly in one process; in a cluster gathered from all workers by a
        collective, so every worker must call it at the same point. Sharded heads only (a
        mirrored head is whole in every process)."""
        if self.cluster is None:
            return read_local_shards(per_shard)
        key = tuple(id(v) for k in sorted(per_shard) for v in per_shard[k])
        if key not in self._compiled_gathers:
            def replica_fn():
                return coll.gather_shard_values(per_shard[coll.replica_id()])

            self._compiled_gathers[key] = tf.function(lambda: self.run(replica_fn))
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

    def distribute_batches(self, dataset: tf.data.Dataset, batch_size: int,
                           repeat: bool = False) -> tf.distribute.DistributedDataset:
        """A dataset of global batches (tuples whose first dimension is B*K) as per-replica
        batches: replica k gets rows k*B ... (k+1)*B-1 (the run contract, docs/design.md). Each
        process keeps only its own replicas' rows, before anything else is done to them.
        `repeat`: endlessly (see distribute_own_rows)."""
        first, count = self.own_rows(batch_size)

        def own_rows(*batch):
            return tf.nest.map_structure(lambda t: t[first:first + count], batch)

        return self.distribute_own_rows(dataset.map(own_rows), batch_size, repeat)

    def own_rows(self, batch_size: int) -> Tuple[int, int]:
        """(first, count): the rows of each global batch this process's replicas take, at
        `batch_size` rows per replica."""
        d = len(self.local_devices)
        return self.worker_id * d * batch_size, d * batch_size

    def distribute_own_rows(self, dataset: tf.data.Dataset, batch_size: int,
                            repeat: bool = False) -> tf.distribute.DistributedDataset:
        """A dataset of this process's own rows of each global batch (`own_rows`, e.g. a
        streamed dataset's `train_rows`) as per-replica batches: local replica i gets rows
        i*B ... (i+1)*B-1 of them. `repeat`: endlessly -- across workers, tf.distribute gives
        a finite dataset an unknown batch dimension (it must allow for uneven last batches),
        an endless one keeps its static shape."""
        # Consecutive elements go to consecutive local replicas.
        local = dataset.rebatch(batch_size, drop_remainder=True)
        if repeat:
            local = local.repeat()
        return self.strategy.distribute_datasets_from_function(lambda ctx: local)

    def distribute_global_batch(self, array) -> "tf.distribute.DistributedValues":
        """A global batch (numpy or tensor) split by rows: replica k gets rows k*B ... (k+1)*B-1,
        B = rows / K (the run contract, docs/design.md; experimental_distribute_dataset does the same)."""
        rows = int(array.shape[0]) // self.num_replicas

        def local(ctx):
            k = ctx.replica_id_in_sync_group
            return tf.convert_to_tensor(array[k * rows:(k + 1) * rows])

        return self.strategy.experimental_distribute_values_from_function(local)

    def run(self, fn, *args):
        """strategy.run, with each replica's inputs and ops pinned to its device.
        MultiWorkerMirrored with one device per worker hands the replica function inputs
        without a device, and ReplicaContext.all_gather of such a tensor fails
        ("destinations can not be empty", cross_device_ops.validate_destinations); with
        several devices per worker the inputs and replica threads carry the same device."""
        def placed(*replica_args):
            with tf.device(self.devices[coll.replica_id()]):
                return fn(*tf.nest.map_structure(tf.identity, replica_args))

        return self.strategy.run(placed, args=args)
