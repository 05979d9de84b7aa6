"""What a CLI run reports: a step's and an evaluation's metrics, and the run's closing
summary and line."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import numpy as np


@dataclasses.dataclass
class StepMetrics:
    loss: float
    top1_error: float
    images_per_sec: float
    bytes_per_step: float
    grads: Optional[Dict[str, np.ndarray]] = None
    nonfinite: Optional[str] = None  # what was not finite, when this step was undone
    overflowed: bool = False  # fp16: the scaled gradients overflowed; undone, the scale halved
    stop: bool = False  # a stop was requested (by any worker of a cluster) by this step's end


@dataclasses.dataclass
class EvalMetrics:
    loss: float
    top1_error: float
    top5_error: float
    examples: int


def run_summary(history: List[StepMetrics], ev: EvalMetrics, steps: int, wall: float,
                val_history: List[List[float]],
                verification: Optional[Dict[str, Any]] = None) -> Dict[str, object]:
    """The run's numbers, as fit() returns them: the last step's loss and traffic, the
    final validation, the median rate of the steps after the first (its trace excluded);
    with pair sets (`verification`: VerificationResult by set name) their mean 10-fold
    accuracy (`verification_accuracy`) and each set's numbers (`verification`)."""
    steady = [m.images_per_sec for m in history[1:]] or [history[0].images_per_sec]
    summary = {"steps": steps, "train_loss": history[-1].loss, "val_loss": ev.loss,
               "val_top1_error": ev.top1_error, "val_top5_error": ev.top5_error,
               "images_per_sec": float(np.median(steady)), "wall_s": wall,
               "bytes_per_step": history[-1].bytes_per_step, "val_history": val_history}
    if verification:
        summary["verification_accuracy"] = float(np.mean([r.accuracy for r in
                                                          verification.values()]))
        summary["verification"] = {name: dataclasses.asdict(r)
                                   for name, r in verification.items()}
    return summary


def done_line(summary: Dict[str, object], first: int, scheme: str, replicas: int, workers: str,
              saved: str) -> str:
    """The closing line of a run."""
    steps = summary["steps"]
    ran = steps - first + 1
    done = (f"{steps} steps" if first == 1 else
            f"steps {first}-{steps} ({ran} this run, {steps} in all)")
    return (f"done: {done} in {summary['wall_s']:.1f}s | {scheme} on {replicas} devices{workers} "
            f"| val top-1 error {summary['val_top1_error']:.2%} top-5 "
            f"{summary['val_top5_error']:.2%} loss {summary['val_loss']:.4f} | "
            f"{_verification_part(summary)}"
            f"{summary['images_per_sec']:.0f} img/s | "
            f"{summary['bytes_per_step'] / 1e6:.3f} MB/step/replica | checkpoint {saved}")


def _verification_part(summary: Dict[str, object]) -> str:
    """'verification 93.17% (faces) | ' when the run verified pair sets, else ''."""
    if "verification" not in summary:
        return ""
    names = ", ".join(summary["verification"])
    return f"verification {summary['verification_accuracy']:.2%} ({names}) | "
