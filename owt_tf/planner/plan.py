"""The parallel plan: how a model is split and how its activations move, as one value.

`ParallelPlan` holds the choices (scheme, FC batch, FC-to-FC exchange, loss, XLA) and every
rule that ties them to a device count and a batch size. The strategy, the run config, the
traffic model and the benchmarks all take one of these instead of the loose strings.
Pure Python: the CLI checks a plan before TensorFlow loads.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import List, Optional, Sequence


class Scheme(str, enum.Enum):
    """single: one device; data: plain data parallelism (FC layers mirrored); owt-a/b/c: the
    paper's schemes (a) all-gather, (b) one worker's batch per round, (c) 1/K of every
    worker's batch per round.

    What a scheme means is asked of it (`model_parallel`, `has_rounds`, `num_rounds`,
    `round_rows`, ...), never re-derived by comparing its name with a string."""

    SINGLE = "single"
    DATA = "data"
    OWT_A = "owt-a"
    OWT_B = "owt-b"
    OWT_C = "owt-c"

    def __str__(self) -> str:
        return self.value

    @property
    def model_parallel(self) -> bool:
        """The FC layers are sharded (one shard per device; one shard in all on one device);
        under data parallelism they are mirrored."""
        return self is not Scheme.DATA

    @property
    def exchanges_activations(self) -> bool:
        """The last conv activations travel between devices: the paper's schemes (a)-(c)."""
        return self in (Scheme.OWT_A, Scheme.OWT_B, Scheme.OWT_C)

    @property
    def has_rounds(self) -> bool:
        """K rounds a step, each on 1/K of the global batch (schemes (b) and (c))."""
        return self in (Scheme.OWT_B, Scheme.OWT_C)

    @property
    def round_from_one_worker(self) -> bool:
        """Each round's rows all come from one worker (scheme (b)): sent by a broadcast; the
        other schemes gather a part from every worker."""
        return self is Scheme.OWT_B

    @property
    def allows_worker_fc_batch(self) -> bool:
        """fc_batch='worker' (an FC update after every round) needs rounds of one worker's
        batch; on one device it is the global batch."""
        return self.has_rounds or self is Scheme.SINGLE

    def num_rounds(self, num_replicas: int) -> int:
        return num_replicas if self.has_rounds else 1

    def fc_rows_per_round(self, num_replicas: int, batch_size: int) -> int:
        """Rows each FC shard processes in one round: the global batch under (a), one worker's
        batch under (b) and (c), a device's own rows under data and single."""
        return num_replicas * batch_size if self is Scheme.OWT_A else batch_size

    def round_rows(self, r: int, num_replicas: int, batch_size: int) -> List[int]:
        """Global-batch row indices of round r (replica k owns rows kB ... kB+B-1): (b) worker
        r's rows; (c) rows rB/K ... (r+1)B/K-1 of every worker; else every row."""
        k, b = num_replicas, batch_size
        if self is Scheme.OWT_B:
            return list(range(r * b, (r + 1) * b))
        if self is Scheme.OWT_C:
            s = b // k
            return [j * b + r * s + i for j in range(k) for i in range(s)]
        return list(range(k * b))

    def batch_problem(self, num_replicas: int, batch_size: int) -> Optional[str]:
        """Why `batch_size` rows per replica cannot be split into this scheme's rounds."""
        if self is Scheme.OWT_C and batch_size % num_replicas:
            return (f"owt-c sends batch_size/K examples per round: {batch_size} is not "
                    f"divisible by K = {num_replicas}")
        return None

    def devices_problem(self, num_replicas: int) -> Optional[str]:
        if self is Scheme.SINGLE and num_replicas != 1:
            return f"scheme 'single' runs on 1 device, got {num_replicas}"
        return None


# The schemes that split a model over several devices, for the planner to rank.
PARALLEL_SCHEMES = tuple(s for s in Scheme if s is not Scheme.SINGLE)


SCHEMES = tuple(s.value for s in Scheme)
# Not a scheme but a request for one: the planner picks scheme, FC exchange and loss once the
# model and the hardware are known (owt_tf.planner.auto).
AUTO = "auto"
FC_BATCH_MODES = ("global", "worker")
FC_EXCHANGES = ("gather", "colrow")
LOSS_MODES = ("gathered", "sharded")
# --precision: the compute dtype of the trunk and the FC shards, and of the activations and
# their gradients between them. Weights, their gradients and optimizer state stay float32.
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes of one activation in each


def check_auto_processes(scheme: str, num_workers: int) -> None:
    """'auto' is chosen per process, from the hardware it measures: the workers of a cluster
    could choose differently, so it needs one process."""
    if str(scheme) == AUTO and num_workers > 1:
        raise PlanError("scheme", "'auto' needs one process: each worker of a cluster would "
                        "price its own hardware; give the scheme (python -m owt_tf.plan "
                        "--recommend suggests one)")


def widths_problem(hidden_widths: Sequence[int], num_replicas: int,
                   names: Optional[Sequence[str]] = None) -> Optional[str]:
    """Why hidden FC widths cannot be split evenly over K shards (the one check of this rule;
    class counts are padded instead). `names`: how to call each layer in the message."""
    for i, width in enumerate(hidden_widths):
        if width % num_replicas:
            name = names[i] if names else f"FC layer {i}"
            return f"{name}: width {width} is not divisible by {num_replicas} devices"
    return None


def sample_rate_problem(rate) -> Optional[str]:
    """Why `rate` is not a Partial FC sample rate: a number in (0, 1] (1: every class)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < rate <= 1.0:
        return f"must be a number in (0, 1], got {rate!r}"
    return None


def sampling_problem(sample_rate: float, loss_on_shards: bool) -> Optional[str]:
    """Why a Partial FC rate cannot be used: r < 1 samples classes inside the class-sharded
    cross-entropy, so the loss must be computed on the shards (None: fine). The one
    statement of this rule; the CLI, the strategy and Keras' compile each ask it."""
    if sample_rate < 1 and not loss_on_shards:
        return "< 1 samples classes in the cross-entropy computed on the shards"
    return None


class PlanError(ValueError):
    """A plan that cannot work; `field` names the ParallelPlan field (or 'devices',
    'batch_size', 'model') at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _choice(field: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise PlanError(field, f"expected one of {', '.join(choices)}; got {value!r}")


def plan_field(default, help: str, choices: Optional[Sequence[str]] = None):
    """A field of ParallelPlan with the text of its command-line flag: the run config's
    parallel section and the CLI take the plan's fields from these declarations."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """What is split, how it moves and in which precision: the one place the plan's fields
    are spelled. `fc_batch='worker'` updates the FC layers after every round on one worker's
    rows (the paper's (128K, 128) recipe); 'global' once per step."""

    scheme: Scheme = plan_field(
        "owt-b", "single | data (pure data parallel) | owt-a | owt-b | owt-c (docs/paper.md) | "
                 "auto: the planner (python -m owt_tf.plan --recommend) picks scheme, "
                 "--fc-exchange and --loss for this machine, model, K and batch (--fc-batch is "
                 "kept); one process", SCHEMES + (AUTO,))
    fc_batch: str = plan_field(
        "global", "global: FC updated once per step on B*K; worker: after every round on B "
                  "(b, c)", FC_BATCH_MODES)
    fc_exchange: str = plan_field(
        "gather", "gather (paper: all-gather FC outputs) or colrow (Megatron column/row pairs)",
        FC_EXCHANGES)
    loss: str = plan_field(
        "gathered", "gathered (all-gather logits) or sharded (class-sharded softmax "
                    "cross-entropy)", LOSS_MODES)
    jit: bool = plan_field(False, "XLA-compile the conv trunk's forward and backward on each "
                                  "device")
    precision: str = plan_field(
        "fp32", "compute dtype of the trunk and the FC shards, and of the activations they "
                "exchange: fp32, bf16 or fp16 (float32 weights, optimizer state and loss; fp16 "
                "with a dynamic loss scale)", tuple(PRECISIONS))
    # Partial FC (owt_tf.parallel.head.sampling): the share of each shard's classes a
    # training update's softmax keeps; 1: all (the exact loss).
    sample_rate: float = plan_field(
        1.0, "Partial FC class sampling, with --loss sharded: each FC update's softmax keeps, "
             "on every shard, the classes labelled in its rows plus random others, this share "
             "of the shard's classes in all (0 < R <= 1; 1: every class, the exact loss); "
             "evaluation uses every class")

    def __post_init__(self):
        _choice("scheme", str(getattr(self.scheme, "value", self.scheme)), SCHEMES)
        object.__setattr__(self, "scheme", Scheme(getattr(self.scheme, "value", self.scheme)))
        _choice("fc_batch", self.fc_batch, FC_BATCH_MODES)
        _choice("fc_exchange", self.fc_exchange, FC_EXCHANGES)
        _choice("loss", self.loss, LOSS_MODES)
        _choice("precision", self.precision, tuple(PRECISIONS))
        problem = sample_rate_problem(self.sample_rate)
        if problem:
            raise PlanError("sample_rate", problem)
        if self.sample_rate < 1 and not self.scheme.model_parallel:
            raise PlanError("sample_rate", "< 1 samples the classes of a sharded head; scheme "
                            "'data' mirrors it")
        if self.fc_batch == "worker" and not self.scheme.allows_worker_fc_batch:
            raise PlanError("fc_batch", "'worker' needs scheme owt-b or owt-c (rounds of one "
                            f"worker's batch), got {self.scheme}")

    @property
    def model_parallel(self) -> bool:
        return self.scheme.model_parallel

    @property
    def compute_dtype(self) -> str:
        """The dtype layers compute in and activations travel in: float32, bfloat16, float16."""
        return PRECISIONS[self.precision]

    def check_devices(self, num_replicas: int) -> "ParallelPlan":
        if num_replicas < 1:
            raise PlanError("devices", f"need at least 1 device, got {num_replicas}")
        problem = self.scheme.devices_problem(num_replicas)
        if problem:
            raise PlanError("devices", problem)
        return self

    def check_batch(self, num_replicas: int, batch_size: int) -> "ParallelPlan":
        """`batch_size` is per replica (the global batch is batch_size * K)."""
        if batch_size < 1:
            raise PlanError("batch_size", f"must be >= 1, got {batch_size}")
        problem = self.scheme.batch_problem(num_replicas, batch_size)
        if problem:
            raise PlanError("batch_size", problem)
        return self

    def check_widths(self, hidden_widths: Sequence[int], num_replicas: int,
                     names: Optional[Sequence[str]] = None) -> "ParallelPlan":
        """Hidden FC widths must split evenly over the shards (class counts are padded)."""
        problem = self.model_parallel and widths_problem(hidden_widths, num_replicas, names)
        if problem:
            raise PlanError("devices", problem)
        return self

    def rounds(self, num_replicas: int, batch_size: int) -> "StepRounds":
        """The rounds of one step at K replicas of `batch_size` rows."""
        self.check_devices(num_replicas).check_batch(num_replicas, batch_size)
        return StepRounds(self.scheme, num_replicas, batch_size, self.fc_batch)


@dataclasses.dataclass(frozen=True)
class StepRounds:
    """The rounds of one step: `scheme` at K replicas of `batch_size` rows each."""

    scheme: Scheme
    num_replicas: int
    batch_size: int
    fc_batch: str = "global"

    def __post_init__(self):
        object.__setattr__(self, "scheme", Scheme(self.scheme))

    @property
    def model_parallel(self) -> bool:
        return self.scheme.model_parallel

    @property
    def num_rounds(self) -> int:
        return self.scheme.num_rounds(self.num_replicas)

    @property
    def updates_fc_every_round(self) -> bool:
        return self.fc_batch == "worker"

    def round_rows(self, r: int) -> List[int]:
        """Global-batch row indices that round r processes (replica k owns rows kB..kB+B-1)."""
        return self.scheme.round_rows(r, self.num_replicas, self.batch_size)
