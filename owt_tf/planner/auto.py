"""`scheme="auto"`: the planner's choice of scheme, FC exchange and loss for the hardware this
process has and the model and K at hand.

The choice is the first row of owt_tf.planner.cost_model.rank, the function behind
`python -m owt_tf.plan --recommend`, so what a run picks is what `plan` recommends for the
same hardware, model, K and batch. The hardware is the run's own: a GPU's preset found
from its name (H200, H100, K20; another GPU is priced as DEFAULT_GPU_PRESET, and the line
says so), logical GPUs split from fewer physical ones as sharing their compute; no GPU:
this CPU measured as `plan --hardware cpu` measures it, over the run's own logical devices.

The FC batch mode is the user's (it changes what is learned, not only how fast), so with
`fc_batch="worker"` only owt-b and owt-c are candidates. A model whose trunk the cost model
cannot count falls back to FALLBACK_SCHEME (data when its FC widths do not split K ways) with
the exchange and loss train defaults to, and the line says why.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

from owt_tf.models.cost import NetworkCost
from owt_tf.planner.plan import ParallelPlan, Scheme, widths_problem
from owt_tf.planner.cost_model import (OWT_SCHEMES, Hardware, Prediction, preset, rank,
                                        runner_up)
# Which preset prices a GPU, by a part of its name (tf.config.experimental.get_device_details).
GPU_PRESETS = (("H200", "h200-nvlink"), ("H100", "h100-nvlink"), ("K20", "k20-pcie"))
DEFAULT_GPU_PRESET = "h100-nvlink"
FALLBACK_SCHEME = "owt-b"  # train's default scheme
# The per-replica batch priced when none is known (the Keras API: `fit` brings its batch
# later): train's default --batch-size.
DEFAULT_BATCH = 32


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What `scheme="auto"` resolved to, and why."""

    scheme: str
    fc_exchange: str
    loss: str
    hardware: str  # the hardware priced (a preset's name, or "cpu" measured)
    choice: Optional[Prediction] = None  # None: the cost model could not count the model
    runner_up: Optional[Prediction] = None
    note: str = ""  # why the fallback was taken
    reason: str = ""  # a model-parallel choice: the head's share of the parameters

    @property
    def line(self) -> str:
        """The one line a run prints: the choice, its predicted step time, the runner-up's."""
        what = f"owt_tf: --scheme auto chose {_describe_flags(self.scheme, self.fc_exchange, self.loss)}"
        if self.choice is None:
            return f"{what} (the fallback: {self.note})"
        line = f"{what}: predicted {self.choice.step_time_s * 1e3:.1f} ms/step on {self.hardware}"
        if self.runner_up is None:
            return line + "; no runner-up at one device"
        r = self.runner_up
        line += (f"; runner-up {_describe_flags(r.scheme, r.fc_exchange, r.loss)} "
                 f"{r.step_time_s * 1e3:.1f} ms/step" + (f" ({self.note})" if self.note else ""))
        return line + (f"; why: {self.reason}" if self.reason else "")


def head_reason(net: NetworkCost) -> str:
    """What a model-parallel head saves, in parameters: the head's share of the model (data
    parallelism holds and all-reduces all of them on every device), and the class layer's
    when it is most of the head."""
    shape = net.shape
    fan_in = shape.hidden[-1] if shape.hidden else shape.features
    class_layer = fan_in * shape.num_classes + shape.num_classes
    text = (f"the head holds {_millions(shape.fc_params)} of {_millions(net.params)} parameters "
            f"({100 * shape.fc_params / net.params:.1f} %")
    if class_layer * 2 > shape.fc_params:
        text += f"; the {shape.num_classes:,}-class layer {_millions(class_layer)}"
    return text + "), sharded over the devices instead of copied and all-reduced"


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f} M"


def _describe_flags(scheme: str, fc_exchange: str, loss: str) -> str:
    if not Scheme(scheme).exchanges_activations:
        return scheme
    return f"{scheme} (--fc-exchange {fc_exchange} --loss {loss})"


def choose(net: Optional[NetworkCost], hw: Hardware, k: int, batch_size: int,
           fc_batch: str = "global", schemes: Sequence[str] = OWT_SCHEMES,
           hidden: Sequence[int] = (), note: str = "", precision: str = "fp32") -> AutoChoice:
    """The fastest of `schemes` at K for `net` on `hw` under the FC batch mode `fc_batch`
    and `precision` (`rank`'s first row), with the runner-up. `net` None (a model the cost
    model cannot count; `note` says why): FALLBACK_SCHEME, or data when the hidden FC widths
    `hidden` do not split K ways, or single at K = 1."""
    if net is not None:
        ranked = rank(net, hw, k, batch_size, fc_batches=(fc_batch,), schemes=schemes,
                      precision=precision)
        if ranked:
            best = ranked[0]
            reason = head_reason(net) if Scheme(best.scheme).exchanges_activations else ""
            return AutoChoice(best.scheme, best.fc_exchange, best.loss, hw.name, best,
                              runner_up(ranked), note, reason)
        note = note or f"no scheme of {', '.join(schemes)} runs at K={k} with this model"
    if k == 1:
        scheme = str(Scheme.SINGLE)
    elif widths_problem(hidden, k) and Scheme.DATA in schemes:
        scheme = str(Scheme.DATA)
    else:
        scheme = FALLBACK_SCHEME
    return AutoChoice(scheme, "gather", "gathered", hw.name, note=note)


def resolve_auto(requested: ParallelPlan, net: Optional[NetworkCost], devices: Sequence[str],
                 num_replicas: int, batch_size: Optional[int], hidden: Sequence[int] = (),
                 schemes: Sequence[str] = OWT_SCHEMES,
                 note: str = "") -> Tuple[ParallelPlan, AutoChoice]:
    """`--scheme auto` made concrete: the planner's choice (`choose`) for a model of cost
    `net` on the hardware of `devices` (this process's) at K = `num_replicas` and
    `batch_size` rows per replica (DEFAULT_BATCH when not known up front), as a ParallelPlan
    that keeps `requested`'s FC batch mode (where the chosen scheme has rounds), XLA and
    precision. Called by the Trainer and by parallelize, before any step is built."""
    hw = run_hardware(devices)
    choice = choose(net, hw, num_replicas, batch_size or DEFAULT_BATCH, requested.fc_batch,
                    schemes, hidden, note, requested.precision)
    fc_batch = requested.fc_batch if Scheme(choice.scheme).has_rounds else "global"
    plan = ParallelPlan(choice.scheme, fc_batch, choice.fc_exchange, choice.loss, requested.jit,
                        requested.precision, requested.sample_rate)
    if batch_size is not None:
        plan.check_batch(num_replicas, batch_size)
    return plan, choice


def run_hardware(devices: Sequence[str]) -> Hardware:
    """The hardware the replicas on `devices` (this process's) run on, for the cost model."""
    import tensorflow as tf

    k = len(devices)
    if not any("GPU" in d.upper() for d in devices):
        from owt_tf.runtime.devices import outside_strategy_scope
        from owt_tf.planner.hardware import measure_cpu

        # Measured with a strategy of its own, which cannot run inside the caller's scope
        # (parallelize is called in one).
        measured = outside_strategy_scope(lambda: measure_cpu(k))
        return dataclasses.replace(measured, name=f"this CPU (measured now, K={k} logical devices)")
    gpus = tf.config.list_physical_devices("GPU")
    name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "") if gpus else ""
    matched = gpu_preset(name)
    hw = preset(matched or DEFAULT_GPU_PRESET)
    label = (f"{hw.name} (the preset for {name})" if matched else
             f"{hw.name} (no preset for {name or 'this GPU'}: priced as {DEFAULT_GPU_PRESET})")
    physical = max(len(gpus), 1)
    if physical < k:
        # K/G logical GPUs share each GPU: the cost model divides a shared device's compute
        # by K, so give it the G GPUs' total; their exchanges queue on one path.
        hw = dataclasses.replace(hw, flops=hw.flops * physical,
                                 memory_bandwidth=hw.memory_bandwidth * physical,
                                 shared_compute=True, shared_link=True)
        label += f", split into {k} logical GPUs"
    return dataclasses.replace(hw, name=label)


def gpu_preset(device_name: str) -> Optional[str]:
    """The preset that prices a GPU called `device_name`, or None when none matches."""
    for part, name in GPU_PRESETS:
        if part in device_name.upper():
            return name
    return None
