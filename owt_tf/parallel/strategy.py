"""HybridStrategy: conv trunk data-parallel under MirroredStrategy, FC layers model-parallel.

The public front of owt_tf's distribution: a thin front over a ParallelPlan. It holds where
the run executes (`placement`: devices, cluster, the wrapped MirroredStrategy, own rows,
shard placement) and the plan (`parallel_plan`: scheme, FC batch and exchange, loss,
precision, XLA, sample rate). What tf.distribute has no notion of -- FC layers whose shards
live one per device, activations moved between replicas by a scheme -- lives in
owt_tf.parallel.head, .schemes and .step; the CLI's steps are owt_tf.training.driver.

    hybrid = HybridStrategy(4, ParallelPlan("owt-b", fc_batch="worker"))
    hybrid = HybridStrategy(4, "owt-b", fc_batch="worker")          # the same, as keywords
    with hybrid.scope():
        model = owt_tf.parallelize(keras_model)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, List, Optional, Sequence, Union

import tensorflow as tf

from owt_tf.runtime.cluster import Cluster, resolve_cluster
from owt_tf.models.cost import NetworkCost
from owt_tf.models.head_weights import draw_whole, undrawn_large_kernels
from owt_tf.planner.auto import AutoChoice, resolve_auto
from owt_tf.planner.cost_model import OWT_SCHEMES
from owt_tf.parallel.placement import DistributedModel, Placement  # noqa: F401 (public)
from owt_tf.planner.plan import (AUTO, ParallelPlan, PlanError, StepRounds,
                                  check_auto_processes)

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
    own D devices and the run has W * D replicas. Without `cluster=`, the cluster is read
    from TF_CONFIG, as MultiWorkerMirroredStrategy reads it (the same script on every host). `batch_size` (per replica) is needed only
    by the CLI's loop, which knows it up front; Keras' `fit` takes it from the data.

    `scheme="auto"`: the scheme, `fc_exchange` and `loss` are left to the planner
    (owt_tf.planner.auto) and chosen by `choose_scheme` when the model is known: by
    `owt_tf.parallelize(model)`, the first place where both the model and K are known (the
    strategy is built before the model, inside whose scope the model is made), and by the
    CLI's Trainer once its model is built. `fc_exchange` and `loss` given with it are then
    ignored; `fc_batch` and `jit` are kept. One process only: the workers of a cluster
    could measure different hardware and pick different schemes.

    `sample_rate` r in (0, 1]: Partial FC class sampling (owt_tf.parallel.head.sampling).
    Each training update's softmax covers, on every shard, the classes labelled in the
    update's rows plus random others, ceil(r x the shard's classes) in all; 1 (default) is
    the exact loss. r < 1 needs the class-sharded cross-entropy: the CLI's loss='sharded',
    or a Keras compile whose loss and metrics the shards compute (docs/keras.md, "Large
    heads"). Evaluation and prediction always use every class.
    """

    def __init__(self, devices: Union[int, Sequence[str]] = 2,
                 plan: Union[ParallelPlan, str, None] = None, *,
                 batch_size: Optional[int] = None, cluster: Optional[Cluster] = None,
                 **plan_fields):
        if isinstance(plan, ParallelPlan):
            if plan_fields:
                raise TypeError("HybridStrategy takes a ParallelPlan or its fields as keywords, "
                                f"not both (got {', '.join(plan_fields)})")
            plan_fields = dataclasses.asdict(plan)
        elif plan is not None:  # a scheme's name, the sugar HybridStrategy(4, "owt-b", ...)
            if "scheme" in plan_fields:
                raise TypeError("HybridStrategy: the scheme given twice")
            plan_fields = {**plan_fields, "scheme": str(plan)}
        plan_fields.setdefault("scheme", "owt-b")
        scheme = str(plan_fields["scheme"])
        auto = scheme == AUTO
        if cluster is None:
            cluster = resolve_cluster()  # TF_CONFIG; None in a one-process run
        check_auto_processes(scheme, cluster.num_workers if cluster is not None else 1)
        # Until choose_scheme: owt-b's plan checks the flags auto keeps (fc_batch, jit).
        requested = ParallelPlan(**{**plan_fields, "scheme": "owt-b" if auto else scheme})
        if isinstance(devices, int):
            requested.check_devices(devices)
            from owt_tf.runtime.devices import setup_devices

            devices = setup_devices(devices)
        self.placement = Placement(devices, cluster)
        self._batch_size = batch_size
        self.auto_choice: Optional[AutoChoice] = None
        self._requested = requested
        self.parallel_plan: Optional[ParallelPlan] = None
        if auto:
            requested.check_devices(self.num_replicas)
            if batch_size is not None:
                requested.check_batch(self.num_replicas, batch_size)
        else:
            self._settle(requested)

    def _settle(self, plan: ParallelPlan) -> None:
        """The plan is concrete from here on: checked against K and the batch."""
        plan.check_devices(self.num_replicas)
        if self._batch_size is not None:
            plan.rounds(self.num_replicas, self._batch_size)
        self.parallel_plan = plan

    @property
    def batch_size(self) -> Optional[int]:
        """Rows per replica when fixed up front (the CLI's loop), else None (Keras' fit)."""
        return self._batch_size

    def choose_scheme(self, count_cost: Callable[[], NetworkCost], hidden: Sequence[int] = (),
                      model_name: str = "the model",
                      schemes: Sequence[str] = OWT_SCHEMES) -> AutoChoice:
        """Resolves `scheme="auto"` for a model whose cost `count_cost()` counts (a model the
        cost model cannot count, Uncountable, gets the planner's fallback with the reason;
        `hidden`: its hidden FC widths) on this process's hardware
        (owt_tf.planner.auto.resolve_auto). Sets the plan, prints one line saying what was
        chosen and why, and returns the choice. The CLI's Trainer and `parallelize` both
        call this: one automatic choice."""
        from owt_tf.models.cost import Uncountable

        if self.parallel_plan is not None:
            raise PlanError("scheme", f"already {self.scheme}: choose_scheme resolves 'auto' once")
        try:
            net, note = count_cost(), ""
        except Uncountable as err:
            net, note = None, f"the cost model cannot count model {model_name}: {err}"
        plan, choice = resolve_auto(self._requested, net, self.placement.local_devices,
                                    self.num_replicas, self._batch_size, hidden, schemes, note)
        self._settle(plan)
        self.auto_choice = choice
        print(choice.line, flush=True)
        return choice

    @contextlib.contextmanager
    def scope(self) -> Iterator["HybridStrategy"]:
        """The wrapped strategy's scope (variables created in it are mirrored: the trunk),
        and the strategy `owt_tf.parallelize` uses when none is passed. A Dense kernel of
        64 MB or more built in it (owt_tf.models.head_weights.undrawn_large_kernels) gets
        no value until `owt_tf.parallelize` draws its shards where they live; one that no
        parallelize took is drawn whole when the outermost scope closes."""
        undrawn = undrawn_large_kernels() if not _ACTIVE else contextlib.nullcontext([])
        _ACTIVE.append(self)
        try:
            with self.placement.strategy.scope(), undrawn as made:
                yield self
        finally:
            _ACTIVE.pop()
        for ref in made:
            if ref() is not None:
                draw_whole(ref())

    @property
    def strategy(self) -> tf.distribute.Strategy:
        """The wrapped MirroredStrategy (MultiWorkerMirroredStrategy in a cluster)."""
        return self.placement.strategy

    @property
    def scheme(self) -> str:
        return AUTO if self.parallel_plan is None else str(self.parallel_plan.scheme)

    @property
    def model_parallel(self) -> bool:
        return self._chosen().model_parallel

    @property
    def num_replicas(self) -> int:
        return self.placement.num_replicas

    def step_rounds(self, batch_size: int) -> StepRounds:
        """The rounds of a step whose replicas hold `batch_size` rows each."""
        return self._chosen().rounds(self.num_replicas, batch_size)

    def _chosen(self) -> ParallelPlan:
        if self.parallel_plan is None:
            raise PlanError("scheme", "'auto' is chosen once the model is known: call "
                            "owt_tf.parallelize(model) (or choose_scheme) first")
        return self.parallel_plan
