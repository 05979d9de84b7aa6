"""The cost model: a step's time per scheme on given hardware, from first principles and
nothing fitted per scheme or per K.

* compute: the per-layer FLOPs of owt_tf.models.cost at the device's sustained FLOP/s, plus
  the memory traffic of the element-wise layers (ReLU, pooling, response norm: read and
  write their output forward and backward) and of the SGD update (read weight, gradient,
  momentum; write momentum, weight: 20 bytes per fp32 parameter) at its memory bandwidth;
* communication: the bytes of every collective, from the same closed form the byte ledger
  of real steps is tested against (owt_tf.planner.traffic), over the link bandwidth, plus
  a fixed latency per collective launch. On a `shared` link (a PCIe tree through the host,
  or logical devices in one memory) all K workers' bytes cross one link one after another;
  on a switched fabric (NVSwitch) every worker has its own;
* overlap: in owt-b and owt-c the exchange of round r+1's activations runs while round r's
  FC layers compute (a two-stage pipeline; with one FC update per step only the first FC
  layer's product runs per round); everything else is serial, as in the engine.

Also here: the hardware presets (datasheet figures; the K20's sustained FLOP/s from the
paper's 1-GPU row, priced with this model; `cpu` measured on this machine by
owt_tf.planner.hardware, which also defines what a machine is), the seed papers' alternatives priced
with the same primitives, the fastest configuration per K, and the paper's Table 1
speedups predicted. `python -m owt_tf.plan` prints all of it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Optional, Sequence

from owt_tf.models.cost import NetworkCost, network_cost
from owt_tf.planner import ledger
from owt_tf.planner import traffic
from owt_tf.planner.hardware import Hardware, measure_cpu
from owt_tf.planner.plan import (FC_BATCH_MODES, FC_EXCHANGES, LOSS_MODES, PARALLEL_SCHEMES,
                                  SCHEMES, VALUE_BYTES, Scheme, widths_problem)

# Pure Python (TensorFlow loads only to measure the CPU), so that `python -m owt_tf.plan`
# rejects bad flags before TensorFlow loads.

F32 = 4
SGD_BYTES_PER_PARAM = 20  # read w, g, m; write m, w (fp32)
ELEMENTWISE_PASSES = 4  # write forward output, read it back, write and read its gradient
OWT_SCHEMES = tuple(str(s) for s in PARALLEL_SCHEMES)  # what the planner ranks at K > 1
ALTERNATIVES = ("model-parallel", "async-ps", "grouped-hybrid")
GROUP = 2  # Yadan et al.: model parallel within pairs of GPUs

# The paper's 1-GPU row (docs/paper.md): 98.05 h of cuda-convnet2 on a K20 for the 1-worker run of the
# one-tower AlexNet. The epoch count is not in docs/paper.md; 90 epochs of ILSVRC-2012's
# 1,281,167 training images is AlexNet's and torchvision's recipe (an assumption, stated).
PAPER_ONE_GPU_HOURS = 98.05
PAPER_EPOCHS = 90
ILSVRC_TRAIN_IMAGES = 1_281_167
K20_PEAK_FLOPS = 3.52e12  # Tesla K20 board specification (BD-06455): 3.52 TFLOP/s fp32 peak


@functools.lru_cache(maxsize=None)
def _k20_sustained_flops() -> float:
    """FLOP/s at which cuda-convnet2 ran on a K20: the paper's (docs/paper.md) 1-GPU row, priced with this model."""
    net = network_cost("alexnet", 1000)
    steps = PAPER_EPOCHS * ILSVRC_TRAIN_IMAGES / 128
    step_s = PAPER_ONE_GPU_HOURS * 3600 / steps
    memory_s = _memory_seconds(net, 128, 208e9) + _update_seconds(net.params, 208e9)
    return 128 * net.train_flops / (step_s - memory_s)


def _gpu_utilization() -> float:
    """The fraction of peak the paper's run reached; applied to the newer GPUs' peaks too."""
    return _k20_sustained_flops() / K20_PEAK_FLOPS


def preset(name: str, devices: int = 8) -> Hardware:
    """A named machine. Every number is a datasheet figure or derived from docs/paper.md (see README)."""
    if name == "k20-pcie":
        return Hardware(
            name, flops=_k20_sustained_flops(), memory_bandwidth=208e9,
            # The K20's interface is PCIe Gen2 x16 (board spec BD-06455), so in a PCIe 3.0
            # host the link trains at Gen2: 5 GT/s x 16 lanes x 8/10 = 8 GB/s each way.
            link_bandwidth=8e9, latency=10e-6, shared_link=True,
            source="Tesla K20 board spec: 3.52 TFLOP/s peak, 208 GB/s, PCIe Gen2 x16; sustained "
                   "FLOP/s from the paper's (docs/paper.md) 1-GPU row (98.05 h, 90 epochs); ~10 us per transfer")
    if name in ("h100-nvlink", "h200-nvlink"):
        memory = 3.35e12 if name == "h100-nvlink" else 4.8e12
        return Hardware(
            name, flops=67e12 * _gpu_utilization(), memory_bandwidth=memory,
            link_bandwidth=450e9, latency=5e-6, shared_link=False,
            low_precision_flops=989e12 * _gpu_utilization(),
            source=f"{name.split('-')[0].upper()} SXM datasheet: 67 TFLOP/s fp32 (no tensor cores), "
                   "989 TFLOP/s dense bf16/fp16 (tensor cores), both at "
                   f"the K20 run's utilization, {memory / 1e12:.2f} TB/s HBM, NVLink 4 900 GB/s "
                   "both ways through NVSwitch; ~5 us per collective (NCCL small-message latency)")
    if name == "cpu":
        return measure_cpu(devices)  # owt_tf.planner.hardware: imports TensorFlow
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE_NAMES)}")


HARDWARE_NAMES = ("k20-pcie", "h100-nvlink", "h200-nvlink", "cpu")


@dataclasses.dataclass
class Prediction:
    """One priced configuration (a row of the table, a record of --json)."""

    scheme: str
    devices: int
    batch_size: int
    fc_batch: int
    fc_exchange: str
    loss: str
    step_time_s: float
    images_per_sec: float
    speedup: float
    bytes_per_step: float  # sent by one replica
    compute_s: float
    communication_s: float
    hidden_s: float  # communication overlapped with FC compute
    fc_batch_mode: str = "global"  # train's --fc-batch: 'worker' only for owt-b/c
    precision: str = "fp32"  # train's --precision

    @property
    def runnable(self) -> bool:
        """Whether owt_tf trains this configuration (the seed papers' alternatives it only prices)."""
        return self.scheme in SCHEMES

    @property
    def key(self) -> tuple:
        """What tells two rows of one K apart: the flags train would be given."""
        return (self.scheme, self.devices, self.fc_batch_mode, self.fc_exchange, self.loss,
                self.precision)

    @property
    def flags(self) -> str:
        """Train's parallel flags for this row (no model, no dataset)."""
        if not self.runnable:
            return "(not in owt_tf)"
        precision = "" if self.precision == "fp32" else f" --precision {self.precision}"
        scheme = Scheme(self.scheme)
        if scheme is Scheme.SINGLE:
            return (f"--devices 1 --batch-size {self.devices * self.batch_size} --scheme single"
                    + precision)
        flags = f"--devices {self.devices} --batch-size {self.batch_size} --scheme {self.scheme}"
        if scheme.has_rounds:
            flags += f" --fc-batch {self.fc_batch_mode}"
        if scheme.model_parallel:
            flags += f" --fc-exchange {self.fc_exchange} --loss {self.loss}"
        return flags + precision


def _memory_seconds(net: NetworkCost, examples: int, bandwidth: float, value_bytes: int = F32) -> float:
    return ELEMENTWISE_PASSES * value_bytes * net.elementwise_floats * examples / bandwidth


def _first_fc_flops(net: NetworkCost) -> int:
    """Forward FLOPs per example of the first FC layer (a step's share of it per worker: 1/K
    of the layer on K*B rows, as much as all of it on B)."""
    return next(l.flops for l in net.layers if l.kind == "fc")


def _update_seconds(params: float, bandwidth: float) -> float:
    return SGD_BYTES_PER_PARAM * params / bandwidth


def _link_seconds(nbytes: float, calls: int, k: int, hw: Hardware) -> float:
    crossing = k if hw.shared_link else 1
    return float(nbytes) * crossing / hw.link_bandwidth + calls * hw.latency


def _single_seconds(net: NetworkCost, examples: int, hw: Hardware, precision: str = "fp32") -> float:
    value_bytes = VALUE_BYTES[precision]
    return (examples * net.train_flops / hw.compute_flops(precision)
            + _memory_seconds(net, examples, hw.memory_bandwidth, value_bytes)
            + _update_seconds(net.params, hw.memory_bandwidth))


def _result(scheme, k, b, fc_batch, fc_exchange, loss, compute, comm, hidden, nbytes, baseline,
            fc_batch_mode="global", precision="fp32"):
    step = compute + comm - hidden
    return Prediction(str(scheme), k, b, fc_batch, fc_exchange, loss, step, k * b / step, baseline / step,
                      float(nbytes), compute, comm, hidden, fc_batch_mode, precision)


def predict(net: NetworkCost, hw: Hardware, scheme: str, k: int, batch_size: int,
            fc_batch: str = "global", fc_exchange: str = "gather", loss: str = "gathered",
            precision: str = "fp32") -> Prediction:
    """Step time of one owt_tf scheme (or `single`: one device, global batch) at K devices.
    `fc_batch` is train's --fc-batch; it matters only to owt-b and owt-c. `precision`
    (--precision): the compute rate, the bytes of element-wise passes and of every
    activation exchanged (weights and their updates stay float32)."""
    b, scheme = batch_size, Scheme(scheme)
    flops, value_bytes = hw.compute_flops(precision), VALUE_BYTES[precision]
    baseline = _single_seconds(net, k * b, hw, precision)
    if scheme is Scheme.SINGLE or k == 1:
        return _result("single", k, b, k * b, "gather", "gathered", baseline, 0.0, 0.0, 0, baseline,
                       precision=precision)
    if not scheme.has_rounds:
        fc_batch = "global"  # the others update the FC layers once per step whatever is asked
    share = k if hw.shared_compute else 1  # logical devices queue for the same cores
    mem = hw.memory_bandwidth / share
    conv = b * net.conv_train_flops / flops * share + _memory_seconds(net, b, mem, value_bytes)
    fc = b * net.fc_train_flops / flops * share  # 1/K of the FC layers on K*B rows, or all on B
    trunk_update = _update_seconds(net.shape.trunk_params, mem)
    transfers = traffic.step_transfers(net.shape, scheme, k, b, fc_exchange, loss, fc_batch,
                                       precision)
    nbytes = sum(t.nbytes for t in transfers)
    seconds = {t.purpose: _link_seconds(t.nbytes, t.calls, k, hw) for t in transfers}
    comm = sum(seconds.values())
    if not scheme.model_parallel:
        compute = conv + fc + trunk_update + _update_seconds(net.shape.fc_params, mem)
        return _result(str(scheme), k, b, k * b, "gather", "gathered", compute, comm, 0.0, nbytes,
                       baseline, precision=precision)
    rounds = scheme.num_rounds(k)
    per_round_fc = scheme.fc_rows_per_round(k, b)
    fc_updates = rounds if (fc_batch == "worker" and rounds > 1) else 1
    fc_update = fc_updates * _update_seconds(net.shape.fc_params / k, mem)
    compute = conv + fc + trunk_update + fc_update
    hidden = 0.0
    if rounds > 1:
        # two-stage pipeline: exchange of round r+1 under the FC work of round r -- all of it
        # with an FC update per round; with one per step only the first FC layer's forward
        # product runs per round (the rounds' rows go on joined, owt_tf.parallel.schemes)
        a = seconds[ledger.ACTIVATIONS] / rounds
        if fc_updates > 1:
            f = (fc + fc_update + seconds[ledger.FC_EXCHANGE] + seconds[ledger.LOGITS]) / rounds
        else:
            f = b * _first_fc_flops(net) / flops * share / rounds
        hidden = (rounds - 1) * min(a, f)
    return _result(scheme, k, b, b if fc_updates > 1 else per_round_fc * rounds, fc_exchange, loss,
                   compute, comm, hidden, nbytes, baseline, fc_batch if rounds > 1 else "global",
                   precision)


def _model_parallel_exchange(net: NetworkCost, g: int, rows: int, value_bytes: int = F32) -> tuple:
    """Bytes and launches per device to split every layer over g devices by output channels:
    the input of every weight layer after the first is all-gathered forward and its gradient
    reduce-scattered backward (rows examples), and so are the logits for the loss."""
    boundaries = _pooled_boundaries(net) + [l.outputs for l in net.layers if l.kind == "fc"]
    nbytes, calls = 0, 0
    for floats in boundaries:
        block = rows * floats * value_bytes
        nbytes += ledger.all_gather_cost(block // g, g) + ledger.reduce_scatter_cost(block, g)
        calls += 2
    return nbytes, calls


def _pooled_boundaries(net: NetworkCost) -> List[int]:
    """Floats per example entering each weight layer after the first one of the trunk, and the head."""
    sizes, current = [], None
    for l in net.layers:
        if l.kind == "conv":
            if current is not None:
                sizes.append(current)
            current = l.outputs
        elif l.kind == "elementwise" and current is not None:
            current = l.outputs  # pooling / norm after the conv: the next layer reads this
        elif l.kind == "fc":
            break
    sizes.append(net.shape.features)
    return sizes


def predict_alternative(net: NetworkCost, hw: Hardware, scheme: str, k: int, batch_size: int,
                        precision: str = "fp32") -> Prediction:
    """The seed papers' alternatives at K devices and the same global batch B*K, computing
    in `precision` (activations in its bytes; weights and gradients float32)."""
    b = batch_size
    value_bytes = VALUE_BYTES[precision]
    baseline = _single_seconds(net, k * b, hw, precision)
    share = k if hw.shared_compute else 1
    mem = hw.memory_bandwidth / share
    work = (b * net.train_flops / hw.compute_flops(precision) * share
            + _memory_seconds(net, b, mem, value_bytes))
    if scheme == "model-parallel":
        nbytes, calls = _model_parallel_exchange(net, k, k * b, value_bytes)
        compute = work + _update_seconds(net.params / k, mem)
        comm = _link_seconds(nbytes, calls, k, hw)
        return _result(scheme, k, b, k * b, "-", "-", compute, comm, 0.0, nbytes, baseline,
                       precision=precision)
    if scheme == "async-ps":
        # parameters sharded over the K devices: push gradients to, pull weights from each shard
        nbytes = ledger.all_reduce_cost(net.params * F32, k)
        compute = work + _update_seconds(net.params, mem)
        comm = _link_seconds(nbytes, 2, k, hw)
        return _result(scheme, k, b, b, "-", "-", compute, comm, min(comm, compute), nbytes, baseline,
                       precision=precision)
    if scheme == "grouped-hybrid":
        g = min(GROUP, k)
        groups = k // g
        mp_bytes, mp_calls = _model_parallel_exchange(net, g, g * b, value_bytes)
        dp_bytes = ledger.all_reduce_cost(net.params // g * F32, groups) if groups > 1 else 0
        nbytes = mp_bytes + dp_bytes
        compute = work + _update_seconds(net.params / g, mem)
        comm = _link_seconds(nbytes, mp_calls + (1 if groups > 1 else 0), k, hw)
        return _result(scheme, k, b, g * b, "-", "-", compute, comm, 0.0, nbytes, baseline,
                       precision=precision)
    raise ValueError(f"unknown alternative {scheme!r}")


def table(net: NetworkCost, hw: Hardware, devices: Sequence[int], batch_size: int,
         fc_batch: str = "global", fc_exchange: str = "gather", loss: str = "gathered",
         alternatives: bool = True, recommended: bool = False,
         precision: str = "fp32") -> List[Prediction]:
    """Every scheme (and alternative) at every K, in table order. `recommended`: the choice
    and runner-up of `rank` at each K are rows too (after that K's owt_tf rows, where the
    flags asked for do not already give them), so that a recommendation is always one of
    the table's rows."""
    rows = []
    for k in devices:
        own = [predict(net, hw, "single", k, batch_size, precision=precision)]
        if k > 1:
            own += [predict(net, hw, scheme, k, batch_size, fc_batch, fc_exchange, loss, precision)
                    for scheme in OWT_SCHEMES if _fits(scheme, k, batch_size)]
        if recommended:
            keys = {p.key for p in own}
            ranked = rank(net, hw, k, batch_size, precision=precision)
            best = [ranked[0], runner_up(ranked)]
            own += [p for p in best if p is not None and p.key not in keys]
        rows += own
        if alternatives and k > 1:
            rows += [predict_alternative(net, hw, s, k, batch_size, precision) for s in ALTERNATIVES]
    return rows


def _fits(scheme: str, k: int, batch_size: int, hidden: Sequence[int] = ()) -> bool:
    """Whether owt_tf can run `scheme` at K: owt-c splits the batch K ways; every model-parallel
    scheme splits the hidden FC widths K ways."""
    scheme = Scheme(scheme)
    if scheme.batch_problem(k, batch_size):
        return False
    return not scheme.model_parallel or widths_problem(hidden, k) is None


def candidates(net: NetworkCost, hw: Hardware, k: int, batch_size: int,
               fc_batches: Sequence[str] = FC_BATCH_MODES,
               schemes: Sequence[str] = OWT_SCHEMES, precision: str = "fp32") -> List[Prediction]:
    """Every owt_tf configuration that runs at K, priced by `predict` (the function that makes
    `plan`'s rows): `schemes` with every FC exchange and loss, and every FC batch mode of
    `fc_batches` that the scheme has ('worker' only for owt-b/c), in `precision`. At K = 1:
    `single` alone."""
    if k == 1:
        return [predict(net, hw, "single", 1, batch_size, precision=precision)]
    options = []
    for scheme in schemes:
        if not _fits(scheme, k, batch_size, net.shape.hidden):
            continue
        if not Scheme(scheme).model_parallel:
            options.append(predict(net, hw, scheme, k, batch_size, precision=precision))
            continue
        modes = [m for m in fc_batches if m == "global" or Scheme(scheme).has_rounds]
        for mode in modes:
            for exchange in FC_EXCHANGES:
                for loss in LOSS_MODES:
                    options.append(predict(net, hw, scheme, k, batch_size, mode, exchange, loss,
                                           precision))
    return options


def rank(net: NetworkCost, hw: Hardware, k: int, batch_size: int,
         fc_batches: Sequence[str] = FC_BATCH_MODES,
         schemes: Sequence[str] = OWT_SCHEMES, precision: str = "fp32") -> List[Prediction]:
    """`candidates`, fastest first (ties keep the candidates' order: scheme, FC batch,
    exchange, loss). `plan --recommend` and `--scheme auto` both read this list: the first
    is the choice, `runner_up` the next best."""
    return sorted(candidates(net, hw, k, batch_size, fc_batches, schemes, precision),
                  key=lambda p: p.step_time_s)


def runner_up(ranked: Sequence[Prediction]) -> Optional[Prediction]:
    """The fastest row of `rank` under another scheme than the choice (the same scheme with
    another exchange or loss is often a tie, which says nothing), else the second row; None
    when the choice is alone (K = 1)."""
    others = [p for p in ranked[1:] if p.scheme != ranked[0].scheme]
    return others[0] if others else (ranked[1] if len(ranked) > 1 else None)


def recommend(net: NetworkCost, hw: Hardware, k: int, batch_size: int) -> Prediction:
    """The fastest owt_tf configuration at K devices: scheme, FC batch, exchange and loss."""
    return rank(net, hw, k, batch_size)[0]


def train_command(p: Prediction, model: str, dataset: str) -> str:
    """The `python -m owt_tf.train` command line that runs the configuration of row `p`."""
    return f"python -m owt_tf.train --model {model} --dataset {dataset} {p.flags}"


def paper_rows(net: NetworkCost, hw: Hardware) -> List[Dict[str, object]]:
    """The paper's Table 1 multi-GPU rows (docs/paper.md), predicted: (128K, 128K) is owt-a, (128K, 128) owt-c."""
    paper = {(2, "owt-a"): 1.95, (2, "owt-c"): 1.93, (4, "owt-a"): 3.74, (4, "owt-c"): 3.66,
             (8, "owt-a"): 6.25, (8, "owt-c"): 6.16}
    out = []
    for (k, scheme), reported in paper.items():
        p = predict(net, hw, scheme, k, 128, fc_batch="worker")
        out.append({"devices": k, "scheme": scheme, "batch": f"({128 * k}, {p.fc_batch})",
                    "predicted": p.speedup, "paper": reported,
                    "error": p.speedup / reported - 1})
    return out
