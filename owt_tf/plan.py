"""`python -m owt_tf.plan`: price every scheme on given hardware before renting it.

The cost model, from first principles and nothing fitted per scheme or per K:

* compute: per-layer FLOPs of the real Keras trunk and the FC head (forward 2 FLOPs per
  multiply-add; training = forward + input gradient + weight gradient = 3x forward, 2x for
  the first conv, which needs no input gradient) at the device's sustained FLOP/s, plus
  the memory traffic of the element-wise layers (ReLU, pooling, response norm: read and
  write their output forward and backward) and of the SGD update (read weight, gradient,
  momentum; write momentum, weight: 20 bytes per fp32 parameter) at its memory bandwidth;
* communication: the bytes of every collective, from the same closed form the byte ledger
  of real steps is tested against (owt_tf.planner.traffic), over the link bandwidth, plus
  a fixed latency per collective launch. On a `shared` link (a PCIe tree through the host,
  or logical devices in one memory) all K workers' bytes cross one link one after another;
  on a switched fabric (NVSwitch) every worker has its own;
* overlap: in owt-b and owt-c the exchange of round r+1's activations runs while round r's
  FC layers compute (a two-stage pipeline); everything else is serial, as in the engine.

Speedup is against one device running the same global batch (B*K examples) alone.

The seed papers' alternatives are priced with the same primitives: all-model-parallel (every
layer split over the K devices by output channels, AlexNet 2012's two-GPU split taken to K),
asynchronous parameter-server SGD (DistBelief / Downpour; communication hidden behind
compute up to the link's limit; staleness costs accuracy, not time, and is not priced) and
grouped hybrid (Yadan et al. 2013: model parallel in groups of two, data parallel across
groups).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Iterable, List, Optional

from owt_tf.cli import OneLineParser, device_counts
from owt_tf.config import FC_BATCH_MODES, FC_EXCHANGES, LOSS_MODES, PRECISIONS, RunConfig
from owt_tf.models.cost import NetworkCost, network_cost
from owt_tf.models.registry import MODEL_NAMES
from owt_tf.planner.plan import Scheme
from owt_tf.planner.auto import head_reason
from owt_tf.planner.cost_model import (HARDWARE_NAMES, Prediction, paper_rows, preset,
                                        rank, runner_up, table,
                                        train_command)
from owt_tf.runtime.startup import start_tensorflow


def format_table(rows: Iterable[Prediction]) -> str:
    head = (f"{'K':>2} {'scheme':<15} {'FC batch':>12} {'exchange':>8} {'loss':>8} {'step ms':>9} "
            f"{'img/s':>9} {'speedup':>7} {'MB/worker':>10} {'comm ms':>8} {'hidden':>7}")
    lines = [head, "-" * len(head)]
    for p in rows:
        scheme = Scheme(p.scheme) if p.runnable else None
        split = scheme is not None and scheme.exchanges_activations
        rounds = scheme is not None and scheme.has_rounds
        mode = f"{p.fc_batch_mode} {p.fc_batch}" if rounds else str(p.fc_batch)
        lines.append(f"{p.devices:>2} {p.scheme:<15} {mode:>12} {p.fc_exchange if split else '-':>8} "
                     f"{p.loss if split else '-':>8} {p.step_time_s * 1e3:>9.1f} "
                     f"{p.images_per_sec:>9.1f} {p.speedup:>7.2f} {p.bytes_per_step / 1e6:>10.3f} "
                     f"{p.communication_s * 1e3:>8.1f} {p.hidden_s * 1e3:>7.1f}")
    return "\n".join(lines)


def format_recommendation(k: int, ranked: List[Prediction], model: str, dataset: str,
                          why: str = "") -> str:
    """The choice at K with its figures (those of its table row), the runner-up, why (the
    head's share of the parameters, for a model-parallel choice), and the train command
    that runs the choice."""
    best, second = ranked[0], runner_up(ranked)
    line = f"recommend K={k}: {describe(best)}"
    if second is not None:
        line += f"; runner-up {describe(second)}"
    if why:
        line += f"; why: {why}"
    return line + f"\n  {train_command(best, model, dataset)}"


def why_chosen(net: NetworkCost, best: Prediction) -> str:
    """`scheme="auto"`'s reason for a model-parallel choice; empty otherwise."""
    return head_reason(net) if Scheme(best.scheme).exchanges_activations else ""


def _record(p: Optional[Prediction]) -> Optional[dict]:
    return dataclasses.asdict(p) if p is not None else None


def describe(p: Prediction) -> str:
    """A row's configuration and its predicted figures, as in the table."""
    what, scheme = p.scheme, Scheme(p.scheme)
    if scheme.has_rounds:
        what += f" fc-batch {p.fc_batch_mode}"
    if scheme.exchanges_activations:
        what += f" {p.fc_exchange}/{p.loss}"
    return f"{what} ({p.step_time_s * 1e3:.1f} ms/step, {p.speedup:.2f}x)"


def format_layers(net: NetworkCost) -> str:
    lines = [f"{'layer':<10} {'kind':<12} {'fwd MFLOP/ex':>12} {'outputs':>9} {'params':>11}"]
    for l in net.layers:
        lines.append(f"{l.name:<10} {l.kind:<12} {l.flops / 1e6:>12.2f} {l.outputs:>9} {l.params:>11}")
    lines.append(f"conv {net.shape.trunk_params} params, FC {net.shape.fc_params} params, "
                 f"training {net.train_flops / 1e9:.3f} GFLOP per example "
                 f"({100 * net.conv_train_flops / net.train_flops:.1f} % conv)")
    return "\n".join(lines)


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


_TRAIN = RunConfig()  # train's defaults, which plan's shared flags take


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m owt_tf.plan", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODEL_NAMES, default="alexnet")
    p.add_argument("--dataset", default=_TRAIN.data.dataset,
                   help="the dataset --recommend's train command names (priced by --classes)")
    p.add_argument("--classes", type=_positive(int), default=1000)
    p.add_argument("--image-size", type=_positive(int), default=None)
    p.add_argument("--devices", type=device_counts, default=[1, 2, 4, 8], help="K values, e.g. 1,2,4,8")
    p.add_argument("--batch-size", type=_positive(int), default=128, help="examples per replica (device) per step (B)")
    p.add_argument("--hardware", choices=HARDWARE_NAMES, default="k20-pcie",
                   help="a preset; --flops/--link-bandwidth/--latency override its numbers")
    p.add_argument("--flops", type=_positive(float), help="sustained FLOP/s per device")
    p.add_argument("--memory-bandwidth", type=_positive(float), help="bytes/s per device")
    p.add_argument("--link-bandwidth", type=_positive(float), help="bytes/s per link, one way")
    p.add_argument("--latency", type=float, help="seconds per collective launch")
    p.add_argument("--fc-batch", choices=FC_BATCH_MODES, default=_TRAIN.parallel.fc_batch,
                   help="for owt-b/c: update FC after every round (worker) or once per step "
                        "(global; train's default)")
    p.add_argument("--fc-exchange", choices=FC_EXCHANGES, default=_TRAIN.parallel.fc_exchange)
    p.add_argument("--loss", choices=LOSS_MODES, default=_TRAIN.parallel.loss)
    p.add_argument("--precision", choices=tuple(PRECISIONS), default=_TRAIN.parallel.precision,
                   help="compute precision priced: bf16/fp16 compute at the hardware's low-"
                        "precision rate and move 2-byte activations (train's --precision)")
    p.add_argument("--recommend", action="store_true",
                   help="per K: the fastest owt_tf configuration (any FC batch, exchange, loss; "
                        "added to the table when the flags above do not give it), the runner-up, "
                        "and the train command that runs it")
    p.add_argument("--paper", action="store_true", help="compare with the paper's (docs/paper.md) Table 1 speedups")
    p.add_argument("--layers", action="store_true", help="print per-layer FLOPs and parameters")
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of a table")
    p.add_argument("--verbose", action="store_true", help="show TensorFlow's C++ start-up log lines")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.latency is not None and args.latency < 0:
        print("python -m owt_tf.plan: error: --latency must be >= 0", file=sys.stderr)
        return 2
    for k in args.devices:
        if k > 1 and args.batch_size % k:
            print(f"python -m owt_tf.plan: error: --batch-size {args.batch_size} must divide by every "
                  f"--devices value for owt-c (got K={k})", file=sys.stderr)
            return 2
    start_tensorflow(args.verbose)  # TensorFlow loads only now, after the flags were found good
    hw = preset(args.hardware, max(args.devices))  # first: `cpu` sets up logical devices
    net = network_cost(args.model, args.classes, args.image_size)
    overrides = {f: getattr(args, f) for f in ("flops", "memory_bandwidth", "link_bandwidth", "latency")
                 if getattr(args, f) is not None}
    if overrides:
        hw = dataclasses.replace(hw, name=hw.name + "+overrides", **overrides)
    rows = table(net, hw, args.devices, args.batch_size, args.fc_batch, args.fc_exchange, args.loss,
                recommended=args.recommend, precision=args.precision)
    ranked = ({k: rank(net, hw, k, args.batch_size, precision=args.precision) for k in args.devices}
              if args.recommend else {})
    paper = paper_rows(net, hw) if args.paper else []
    if args.json:
        records = [dict(dataclasses.asdict(p), hardware=hw.name) for p in rows]
        payload = {"records": records, "hardware": dataclasses.asdict(hw)}
        if ranked:
            payload["recommend"] = {
                str(k): {"choice": dataclasses.asdict(r[0]),
                         "runner_up": _record(runner_up(r)),
                         "command": train_command(r[0], args.model, args.dataset),
                         "why": why_chosen(net, r[0])}
                for k, r in ranked.items()}
        if paper:
            payload["paper"] = paper
        print(json.dumps(payload if (ranked or paper) else records, indent=1))
        return 0
    print(f"hardware: {hw.name}: {hw.compute_flops(args.precision) / 1e12:.3f} TFLOP/s "
          f"sustained ({args.precision}), memory {hw.memory_bandwidth / 1e9:.0f} GB/s, "
          f"link {hw.link_bandwidth / 1e9:.2f} GB/s ({'shared' if hw.shared_link else 'per device'}), "
          f"latency {hw.latency * 1e6:.1f} us\n  source: {hw.source}")
    if args.layers:
        print(format_layers(net))
    print(format_table(rows))
    for k, r in ranked.items():
        print(format_recommendation(k, r, args.model, args.dataset, why_chosen(net, r[0])))
    for r in paper:
        print(f"paper K={r['devices']} {r['batch']:<12} predicted {r['predicted']:.2f}x, "
              f"paper {r['paper']:.2f}x ({100 * r['error']:+.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
