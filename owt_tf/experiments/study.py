"""`python -m owt_tf.study`: the paper's Table 1 in miniature, on real data.

Trains one model on one dataset for every K in --devices with the paper's two batch rules,
(B*K, B*K) -- FC layers see the whole global batch, owt-a -- and (B*K, B) -- FC updated
after every B-example round, owt-c with --fc-batch worker -- under each conv learning-rate
scaling rule, for the same number of epochs and several seeds. B plays the role of the
paper's 128 (scaled down with --batch-size for small data). K=1 is the plain single-device
run the others are compared with.

Writes into --out: results.json (every run, with its validation error after every epoch),
study.md (a table like the paper's: final validation error, mean and spread over seeds, the
difference from K=1, wall time) and study.png (validation error against epochs, one line per
configuration, mean over seeds). Every run is an ordinary owt_tf run with its own logdir
under --out/runs/, so TensorBoard shows them all.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

from owt_tf.cli import OneLineParser, device_counts
from owt_tf.config import LR_SCALINGS, ConfigError, RunConfig
from owt_tf.models.registry import MODEL_NAMES

GLOBAL_FC = "global"  # (B*K, B*K)
WORKER_FC = "worker"  # (B*K, B)
WITHIN_PP = 0.5  # the bound: error within 0.5 percentage points of K=1


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """One cell of the table: K devices, the FC batch rule and the conv LR scaling rule."""

    devices: int
    fc_rule: str
    scaling: str

    @property
    def scheme(self) -> str:
        if self.devices == 1:
            return "single"
        return "owt-a" if self.fc_rule == GLOBAL_FC else "owt-c"

    def label(self, batch: int) -> str:
        fc = batch * self.devices if self.fc_rule == GLOBAL_FC else batch
        if self.devices == 1:
            return f"K=1 ({batch}, {batch})"
        return f"K={self.devices} ({batch * self.devices}, {fc}) {self.scaling}"


def study_configs(devices: Sequence[int], scalings: Sequence[str]) -> List[StudyConfig]:
    """K=1 once (no scaling applies), then both batch rules under every scaling rule."""
    out = []
    for k in devices:
        if k == 1:
            out.append(StudyConfig(1, WORKER_FC, "none"))
            continue
        for scaling in scalings:
            for rule in (GLOBAL_FC, WORKER_FC):
                out.append(StudyConfig(k, rule, scaling))
    return out


def run_config(args: argparse.Namespace, cell: StudyConfig, seed: int, logdir: str,
               num_train: int = 0) -> RunConfig:
    """The run behind one cell and seed; validates once per epoch when num_train is known."""
    eval_every = max(1, round(num_train / (args.batch_size * cell.devices))) if num_train else 0
    return RunConfig.from_flags(
        model=args.model, dataset=args.dataset, data_dir=args.data_dir, manual_dir=args.manual_dir,
        devices=cell.devices, scheme=cell.scheme,
        fc_batch=cell.fc_rule if cell.devices > 1 else "global",
        batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, lr_batch=args.batch_size,
        lr_scaling=cell.scaling, momentum=0.9, weight_decay=5e-4, dropout=args.dropout,
        seed=seed, eval_every=eval_every, logdir=logdir, checkpoint_every=0,
        log_every=10, histogram_every=0, jit=False)


def train_one(config: RunConfig, num_train: int) -> Dict[str, object]:
    """One run, start to end, in the calling process (a fresh one: see run_study)."""
    from owt_tf.runtime.devices import setup_devices
    from owt_tf.training.guard import NonFiniteError
    from owt_tf.training.loop import Trainer

    trainer = Trainer(config, setup_devices(config.parallel.devices, config.parallel.device_type))
    started = time.perf_counter()
    try:
        return trainer.fit(log=lambda _: None, progress=False)
    except NonFiniteError as err:  # a diverged configuration is a result, not a crash
        epoch = err.step / (num_train / config.global_batch_size)
        return {"steps": err.step, "train_loss": float("nan"), "val_top1_error": 1.0,
                "wall_s": time.perf_counter() - started, "val_history": [[epoch, 1.0]],
                "diverged": str(err)}


def run_study(args: argparse.Namespace, log=print) -> List[Dict[str, object]]:
    """Trains every configuration for every seed; returns one record per run.

    Each run gets a fresh process, so runs stay independent: strategies and their collective
    thread pools outlive a run inside one process, and one process running all 39 default
    runs stalled for ~270 s inside a training step in three of them.
    """
    import concurrent.futures
    import multiprocessing

    from owt_tf.data.datasets import load_dataset
    from owt_tf.models import build_model

    shape = build_model(args.model, num_classes=10).input_shape
    num_train = load_dataset(args.dataset, shape, data_dir=args.data_dir,
                             manual_dir=args.manual_dir).num_train
    cells = study_configs(args.devices, args.scalings)
    runs, total = [], len(cells) * args.seeds
    started = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    for cell in cells:
        for seed in range(args.seeds):
            name = f"k{cell.devices}-{cell.fc_rule}-{cell.scaling}-seed{seed}"
            logdir = os.path.join(args.out, "runs", name)
            config = run_config(args, cell, seed, logdir, num_train)
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
                summary = pool.submit(train_one, config, num_train).result()
            record = dict(dataclasses.asdict(cell), seed=seed, label=cell.label(args.batch_size),
                          scheme=cell.scheme, logdir=logdir, **summary)
            runs.append(record)
            save_results(args, runs)
            done = len(runs)
            eta = (time.perf_counter() - started) / done * (total - done)
            log(f"[{done}/{total}] {record['label']} seed {seed}: val top-1 error "
                f"{summary['val_top1_error']:.2%} in {summary['wall_s']:.1f}s (about {eta / 60:.0f} min left)")
    return runs


def save_results(args: argparse.Namespace, runs: List[Dict[str, object]],
                 rows: Optional[List[Dict[str, object]]] = None) -> None:
    """results.json, replaced atomically: written after every run so a crash loses none."""
    path = os.path.join(args.out, "results.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"args": vars(args), "runs": runs, "rows": rows or []}, f, indent=1, default=float)
    os.replace(path + ".tmp", path)


def _groups(runs: List[Dict[str, object]]) -> Dict[str, List[Dict[str, object]]]:
    groups: Dict[str, List[Dict[str, object]]] = {}
    for r in runs:
        groups.setdefault(str(r["label"]), []).append(r)
    return groups


def _errors_pp(runs) -> List[float]:
    return [100 * float(r["val_top1_error"]) for r in runs]


def summarize(runs: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """One row per configuration: mean, sample std and range of the final error over seeds."""
    groups = _groups(runs)
    base = next((v for k, v in groups.items() if k.startswith("K=1 ")), None)
    base_mean = statistics.mean(_errors_pp(base)) if base else None
    rows = []
    for label, rs in groups.items():
        errs = _errors_pp(rs)
        mean = statistics.mean(errs)
        rows.append({
            "label": label, "devices": rs[0]["devices"], "fc_rule": rs[0]["fc_rule"],
            "scaling": rs[0]["scaling"], "seeds": len(rs), "error_pp": mean,
            "std_pp": statistics.stdev(errs) if len(errs) > 1 else 0.0,
            "min_pp": min(errs), "max_pp": max(errs),
            "delta_pp": None if base_mean is None else mean - base_mean,
            "wall_s": statistics.mean(float(r["wall_s"]) for r in rs),
            "diverged": sum(1 for r in rs if r.get("diverged")),
        })
    return rows


def verdicts(rows: List[Dict[str, object]]) -> List[str]:
    """The two questions of the study, answered from the table."""
    lines = []
    for r in rows:
        if r["devices"] > 1 and r["fc_rule"] == WORKER_FC and r["delta_pp"] is not None:
            if abs(r["delta_pp"]) <= WITHIN_PP:
                verdict = f"within {WITHIN_PP} pp"
            elif r["delta_pp"] > 0:
                verdict = f"NOT within {WITHIN_PP} pp (worse)"
            else:
                verdict = f"better than K=1 by more than {WITHIN_PP} pp"
            lines.append(f"{r['label']}: {r['delta_pp']:+.2f} pp vs K=1, {verdict}")
    top = max((r["devices"] for r in rows), default=1)
    for scaling in sorted({r["scaling"] for r in rows if r["devices"] == top and top > 1}):
        pair = {r["fc_rule"]: r for r in rows if r["devices"] == top and r["scaling"] == scaling}
        if len(pair) == 2:
            g, w = pair[GLOBAL_FC], pair[WORKER_FC]
            winner = w if w["error_pp"] < g["error_pp"] else g
            lines.append(f"K={top}, {scaling} scaling: {winner['label']} wins "
                         f"({w['error_pp']:.2f} % with FC batch B vs {g['error_pp']:.2f} % with B*K)")
    return lines


def markdown(rows: List[Dict[str, object]], args: argparse.Namespace) -> str:
    lines = [
        f"Model `{args.model}`, dataset `{args.dataset}`, {args.epochs:g} epochs, B = {args.batch_size} per "
        f"worker, base LR {args.lr:g}, {args.seeds} seeds. Validation top-1 error: mean ± sample "
        "std over seeds [min, max]; Δ: difference of the means from K=1. Batch is (conv, FC).",
        "",
        "| K | batch (conv, FC) | conv LR scaling | top-1 error % | Δ vs K=1 (pp) | wall s / run |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        k, b = r["devices"], args.batch_size
        fc = b * k if r["fc_rule"] == GLOBAL_FC else b
        delta = "—" if r["delta_pp"] is None or k == 1 else f"{r['delta_pp']:+.2f}"
        diverged = f" ({r['diverged']} diverged: counted as 100 %)" if r.get("diverged") else ""
        lines.append(f"| {k} | ({b * k}, {fc}) | {r['scaling'] if k > 1 else '—'} | "
                     f"{r['error_pp']:.2f} ± {r['std_pp']:.2f} [{r['min_pp']:.2f}, {r['max_pp']:.2f}]"
                     f"{diverged} | {delta} | {r['wall_s']:.1f} |")
    lines += ["", *[f"- {v}" for v in verdicts(rows)]]
    return "\n".join(lines) + "\n"


def plot(runs: List[Dict[str, object]], path: str, scalings: Sequence[str]) -> None:
    """Validation error against epochs, mean over seeds, one panel per scaling rule."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("python -m owt_tf.study: error: the plot needs matplotlib: "
                         "pip install -e .[study]") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(scalings), figsize=(6 * len(scalings), 4.5), sharey=True,
                             squeeze=False)
    for ax, scaling in zip(axes[0], scalings):
        for label, rs in _groups(runs).items():
            if rs[0]["devices"] > 1 and rs[0]["scaling"] != scaling:
                continue
            curves = [r["val_history"] for r in rs]
            n = min(len(c) for c in curves)
            epochs = [c[0] for c in curves[0][:n]]
            mean = [100 * statistics.mean(c[i][1] for c in curves) for i in range(n)]
            style = "-" if rs[0]["fc_rule"] == WORKER_FC or rs[0]["devices"] == 1 else "--"
            ax.plot(epochs, mean, style, marker="o", markersize=3,
                    label=label.replace(f" {scaling}", ""), linewidth=2 if rs[0]["devices"] == 1 else 1.2)
        ax.set_title(f"conv LR scaling: {scaling}")
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("validation top-1 error % (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _devices_with_one(text: str) -> List[int]:
    """--devices, sorted, with K=1 added: every other row is compared with it."""
    return sorted(set(device_counts(text)) | {1})


def _scalings(text: str) -> List[str]:
    rules = [x.strip() for x in text.split(",") if x.strip()]
    bad = [r for r in rules if r not in LR_SCALINGS]
    if not rules or bad:
        raise argparse.ArgumentTypeError(f"allowed: {', '.join(LR_SCALINGS)}; got {text!r}")
    return rules


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m owt_tf.study", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODEL_NAMES, default="alexnet_tiny")
    p.add_argument("--dataset", default="digits", help="as for train: digits, folder:PATH, tfds:NAME, imagenet2012")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--manual-dir", default=None)
    p.add_argument("--devices", type=_devices_with_one, default=[1, 2, 4, 8], help="K values (1 is always added)")
    p.add_argument("--batch-size", type=int, default=16, help="B, the paper's 128 scaled to the data")
    p.add_argument("--epochs", type=float, default=10.0)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--scalings", type=_scalings, default=["linear", "sqrt"], help="conv LR scaling rules")
    p.add_argument("--lr", type=float, default=0.01, help="base learning rate for batch B")
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--out", default=None, help="output folder (default runs/study-<timestamp>); must not exist")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.out = args.out or os.path.join("runs", time.strftime("study-%Y%m%d-%H%M%S"))
    try:
        if args.seeds < 1:
            raise ConfigError("--seeds", f"must be >= 1, got {args.seeds}")
        if os.path.exists(args.out) and os.listdir(args.out):
            raise ConfigError("--out", f"{args.out} exists and is not empty")
        for cell in study_configs(args.devices, args.scalings):  # every run's flags, up front
            run_config(args, cell, 0, os.path.join(args.out, "runs", "check")).validate()
    except ConfigError as err:
        print(f"python -m owt_tf.study: error: {err}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    n = len(study_configs(args.devices, args.scalings)) * args.seeds
    print(f"study: {n} runs of {args.model} on {args.dataset} for {args.epochs:g} epochs into {args.out}")
    runs = run_study(args)
    rows = summarize(runs)
    save_results(args, runs, rows)
    table = markdown(rows, args)
    with open(os.path.join(args.out, "study.md"), "w") as f:
        f.write(table)
    plot(runs, os.path.join(args.out, "study.png"), args.scalings)
    print(table)
    print(f"wrote {args.out}/study.md, study.png and results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
