"""A run's input normalisation: the dataset's own mean and spread, computed once over a
sample of its training images and stored in the run directory (`input_stats.json`), so
that a resumed run, evaluation and the export normalise exactly as training did."""
from __future__ import annotations

import json
import os
from typing import Optional

STATS_FILE = "input_stats.json"


def read_stats(logdir: str) -> Optional[dict]:
    """The stored statistics of the run in `logdir`, or None."""
    path = os.path.join(logdir, STATS_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_stats(logdir: str, stats: dict) -> None:
    """Stores `stats` in `logdir` atomically."""
    os.makedirs(logdir, exist_ok=True)
    tmp = os.path.join(logdir, STATS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(stats, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(logdir, STATS_FILE))


def settle_normalisation(dataset, logdir: str, started_before: bool, writer: bool) -> dict:
    """Sets `dataset`'s mean and std for the run in `logdir` and returns them as stored:
    the run's stored ones; else, for a run started before datasets had their own
    (`started_before`) or a dataset without its own (ImageNet, arrays), the dataset's
    current ones; else its statistics over a sample. The `writer` stores what it used."""
    if not hasattr(dataset, "use_statistics"):  # in memory: its own, computed when loaded
        return {"dataset": dataset.name, "mean": list(dataset.mean), "std": list(dataset.std)}
    stored = read_stats(logdir)
    if stored is None:
        stored = {"dataset": dataset.name, "mean": list(dataset.mean), "std": list(dataset.std),
                  "source": "fixed"}
        if dataset.has_own_statistics and not started_before:
            mean, std, images = dataset.input_statistics()
            stored.update(mean=list(mean), std=list(std), source="sample", images=images)
        stored["augment"] = dataset.augment
        if writer:
            write_stats(logdir, stored)
    dataset.use_statistics(stored["mean"], stored["std"])
    return stored
