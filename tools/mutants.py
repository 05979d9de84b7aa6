"""Mutation check: small deliberate bugs, each applied to a fresh copy of the tree, and the
tests that must catch it. A mutant is killed when its tests fail; every one must be.

    python tools/mutants.py              # all mutants (about 5 minutes on 2 cores)
    python tools/mutants.py --list
    python tools/mutants.py --only "rates swapped,colrow as gather"

Each mutant is a text replacement in one file (it must match exactly once, or the check
itself fails: a refactor that moves the code must move the mutant too). Not part of CI: it
runs the named tests once per mutant.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: Sequence[str]  # pytest node ids or "file -k expr"


MUTANTS: List[Mutant] = [
    Mutant("rates swapped", "owt_tf/training/optim.py",
           "trunk = MirroredSGD(hybrid.strategy, model.trunk.trainable_variables, conv_lr,",
           "trunk = MirroredSGD(hybrid.strategy, model.trunk.trainable_variables, fc_lr,",
           ["tests/test_equivalence.py -k distinct_conv_and_fc_rates"]),
    Mutant("CLI rates swapped", "owt_tf/training/optim.py",
           "self.trunk.learning_rate.assign(conv_lr)\n        self.fc_learning_rate.assign(fc_lr)",
           "self.trunk.learning_rate.assign(fc_lr)\n        self.fc_learning_rate.assign(conv_lr)",
           ["tests/test_training.py -k rates_follow"]),
    Mutant("CLI FC rate scaled from the global batch", "owt_tf/config/run.py",
           "return o.lr * lr_scale(o.lr_scaling, self.fc_batch_size / o.lr_batch)",
           "return o.lr * lr_scale(o.lr_scaling, self.global_batch_size / o.lr_batch)",
           ["tests/test_training.py -k rates_follow"]),
    Mutant("colrow as gather", "owt_tf/parallel/head/layout.py",
           "hidden = [COL if i % 2 == 0 else ROW for i in range(num_layers - 1)]",
           "hidden = [COL for i in range(num_layers - 1)]",
           ["tests/test_traffic.py -k colrow", "tests/test_equivalence.py -k owt-a-2-8-global-colrow"]),
    Mutant("FC weight decay 10 % low", "owt_tf/parallel/head/update.py",
           "grad = grad + rule.weight_decay * variable",
           "grad = grad + 0.9 * rule.weight_decay * variable",
           ["tests/test_equivalence.py -k owt-b-2-8-worker-gather-gathered"]),
    Mutant("FC dropout skipped", "owt_tf/parallel/head/forward.py",
           "if not training or rate == 0.0:", "if True:",
           ["tests/test_head_math.py -k dropout"]),
    Mutant("trunk regularization loss dropped", "owt_tf/parallel/step.py",
           "losses = trunk.losses if training else []", "losses = []",
           ["tests/test_keras_recipes.py -k regularization"]),
    Mutant("scheme (b) round order reversed", "owt_tf/parallel/collectives.py",
           "received.append(_broadcast_counted(v, r, purpose, riders))",
           "received.append(_broadcast_counted(v, k - 1 - r, purpose, riders))",
           ["tests/test_equivalence.py -k owt-b-2-8-worker-gather-gathered",
            "tests/test_keras_fit.py -k worker_equals_sequential"]),
    Mutant("sharded loss without its max subtraction", "owt_tf/parallel/head/loss.py",
           "log_norm = tf.math.log(t[:, 0]) + global_max",
           "log_norm = tf.math.log(t[:, 0])",
           ["tests/test_head_math.py -k sharded"]),
    Mutant("Partial FC candidates as positions in the sample", "owt_tf/parallel/head/sampling.py",
           "ids = tf.gather(sample.ids, position) + first_class",
           "ids = position + first_class",
           ["tests/test_partial_fc.py -k numpys_metrics"]),
    Mutant("every worker writes the Keras callbacks' shared files", "owt_tf/fit/callbacks.py",
           "    if is_chief or not callbacks",
           "    if True or not callbacks",
           ["tests/test_keras_cluster.py -k backup_and_restore"]),
    Mutant("every worker moves damaged checkpoints aside", "owt_tf/training/files/checkpoint.py",
           "self.moves_damaged = is_chief and not read_only",
           "self.moves_damaged = not read_only",
           ["tests/test_multiworker.py -k faults_while"]),
    Mutant("count metrics fed the whole batch on every replica", "owt_tf/fit/steps.py",
           "    return rows[k * per:(k + 1) * per]", "    return rows",
           ["tests/test_keras_recipes.py -k count_metrics"]),
    Mutant("undo snapshot misses the FC momentum", "owt_tf/training/loop.py",
           "return (list(self.model.trunk.variables) + self.optimizer.state_variables()",
           "return (list(self.model.trunk.variables) + self.optimizer.trunk.state_variables()",
           ["tests/test_reliability.py -k skip_nonfinite_undoes"]),
    Mutant("sample weights left out of the loss", "owt_tf/parallel/schemes.py",
           "            ce = ce * joined_rows(weights)",
           "            ce = ce",
           ["tests/test_keras_weights.py -k sample_weights_equal and owt-b"]),
    Mutant("FC clipnorm taken per shard", "owt_tf/fit/compiling.py",
           "lambda squares: coll.all_reduce_sum(squares, ledger.FC_GRAD))",
           "lambda squares: squares)",
           ["tests/test_keras_weights.py -k clipping_equals and owt-b and clip0"]),
    Mutant("float16 overflow step applied anyway", "owt_tf/fit/updates.py",
           "tf.cond(finite, apply_everywhere, self.loss_scaler._stateful_handle_non_finite_grads)",
           "apply_everywhere()",
           ["tests/test_keras_precision.py -k overflow"]),
    Mutant(".keras file without the FC optimizer slots", "owt_tf/fit/files.py",
           "slot.assign(arrays[head_state.slot_key(i, part, s)])",
           "slot.assign(0 * arrays[head_state.slot_key(i, part, s)])",
           ["tests/test_keras_files.py -k holds"]),
]
# A mutant's further edits: the FC rate swapped too; the sharded loss also without the shift
# where its exponentials are taken.
EXTRA_EDITS = {
    "rates swapped": [("owt_tf/training/optim.py",
                       "return HybridOptimizer(trunk, ShardSGD(shards, fc_lr,",
                       "return HybridOptimizer(trunk, ShardSGD(shards, conv_lr,")],
    "sharded loss without its max subtraction": [(
        "owt_tf/parallel/head/loss.py",
        "shifted = tf.where(valid[None, :], logits - global_max[r][:, None], -np.inf)",
        "shifted = tf.where(valid[None, :], logits, -np.inf)")],
}


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, target)


def _apply(tree: Path, path: str, old: str, new: str) -> None:
    file = tree / path
    text = file.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"mutant text found {text.count(old)} times in {path}: {old!r}")
    file.write_text(text.replace(old, new))


def _run_tests(tree: Path, tests: Sequence[str]) -> bool:
    """Whether every test selection passed (a killed mutant makes one fail)."""
    env = dict(os.environ, PYTHONPATH=str(tree), TF_CPP_MIN_LOG_LEVEL="3")
    for selection in tests:
        args = selection.split(" -k ")
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", args[0]]
        if len(args) > 1:
            command += ["-k", args[1]]
        proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode == 5:
            raise SystemExit(f"no test selected by {selection!r}")
        if proc.returncode != 0:
            return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", default="", help="comma-separated mutant names to run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}; tests: {', '.join(m.tests)}")
        return 0
    survivors = []
    with tempfile.TemporaryDirectory(prefix="owt_tf_mutants_") as tmp:
        base = Path(tmp) / "base"
        _copy_tree(base)
        if not _run_tests(base, [t for m in chosen for t in m.tests]):
            print("the unmutated tree fails these tests: fix that first")
            return 2
        for m in chosen:
            tree = Path(tmp) / "mutant"
            shutil.rmtree(tree, ignore_errors=True)
            shutil.copytree(base, tree)
            _apply(tree, m.path, m.old, m.new)
            for path, old, new in EXTRA_EDITS.get(m.name, []):
                _apply(tree, path, old, new)
            start = time.perf_counter()
            killed = not _run_tests(tree, m.tests)
            print(f"{'killed ' if killed else 'SURVIVED'}  {m.name}  "
                  f"({time.perf_counter() - start:.0f} s; {', '.join(m.tests)})", flush=True)
            if not killed:
                survivors.append(m.name)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
