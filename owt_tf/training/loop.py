"""The custom training loop: builds a run from a RunConfig and drives it step by step.

The step is one tf.function around the step driver's train_step (the distribution lives in
owt_tf.parallel); this module owns the order of things: assembly of the run, data, steps,
validation, checkpoints, export and the final summary. What becomes of a step once it ran
(undo, loss-scale overflow, agreement across workers) is owt_tf.training.step_policy. Its
parts: the model's spec (assembly), this process's input rows (input), the step driver
(driver), what a run reports (report).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from owt_tf.config import ConfigError, RunConfig, new_run_dir
from owt_tf.data.datasets import load_dataset
from owt_tf.data.preprocess import finish_images
from owt_tf.data.stats import settle_normalisation
from owt_tf.runtime.devices import DeviceError, setup_devices
from owt_tf.planner.plan import AUTO, PlanError
from owt_tf.parallel.gradients import TracedGradients
from owt_tf.parallel.precision import DynamicLossScale
from owt_tf.parallel.step import step_seed
from owt_tf.parallel.strategy import HybridStrategy
from owt_tf.training.driver import StepDriver
from owt_tf.training.files.checkpoint import CONFIG_FILE, RunCheckpoints
from owt_tf.training.optim import build_optimizer
from owt_tf.training.files.rundir import RunDirLock, RunDirUnusable, check_writable
from owt_tf.training.files.serving import export_trainer
from owt_tf.training.schedule import lr_factor
from owt_tf.training.guard import (Interrupted, SignalStop, StepSnapshot, WorkerLost,
                                   is_peer_failure)
from owt_tf.training.assembly import choose_scheme, head_loss, model_spec
from owt_tf.training.evaluation import (by_global_batches, dataset_pair_sets,
                                        verification_text, verify_sets)
from owt_tf.training.input import failed_decodes, own_input, stream_end
from owt_tf.training.progress import ProgressLines
from owt_tf.training.report import EvalMetrics, StepMetrics, done_line, run_summary
from owt_tf.training.step_policy import StepPolicy
from owt_tf.training.files.summaries import RunSummaries


class Trainer:
    """One run: data, the distributed model, its optimizer and the compiled step."""

    def __init__(self, config: RunConfig, devices: Optional[Sequence[str]] = None,
                 read_only: bool = False):
        """`read_only`: only restore and run the model (evaluate, export): no lock, and
        damaged checkpoints are skipped but not moved aside."""
        self.logdir = config.run.logdir or new_run_dir()
        # run_config.json and TensorBoard's config text record the directory resolved.
        self.config = config.validate().replace(logdir=self.logdir)
        config = self.config
        self.read_only = read_only
        if not read_only:
            try:
                check_writable(self.logdir)
            except RunDirUnusable as err:
                raise ConfigError("--logdir", str(err)) from None
        # The run's writer (the chief of a cluster) locks the logdir before anything else,
        # so a second run on it stops at once; the lock dies with the process.
        cluster = config.cluster.resolved
        writer = not read_only and (cluster is None or cluster.is_chief)
        self.rundir = RunDirLock.take(self.logdir) if writer else None
        try:
            self._build(config, devices)
        except BaseException:
            if self.rundir is not None:
                self.rundir.abandon()
            raise

    def _build(self, config: RunConfig, devices: Optional[Sequence[str]]) -> None:
        if config.run.deterministic:
            # Process-wide, and before any kernel is built: ops without a deterministic
            # implementation then raise instead of silently varying.
            tf.config.experimental.enable_op_determinism()
        p = config.parallel
        k = p.devices  # this process's; K = k * workers
        try:
            self.devices = list(devices or setup_devices(k, p.device_type))[:k]
        except DeviceError as err:
            raise ConfigError("--devices", str(err)) from None
        # First: a cluster's strategy configures collectives, which must precede any op.
        # Under --scheme auto the plan is chosen below, once the model is known.
        try:
            self.hybrid = HybridStrategy(self.devices, batch_size=p.batch_size,
                                         cluster=config.cluster.resolved, **p.plan_fields())
        except PlanError as err:
            raise ConfigError("--" + err.field.replace("_", "-"), err.message) from None
        probe = model_spec(config, None)
        data = config.data
        self.dataset = load_dataset(data.dataset, probe.input_shape, data.classes,
                                    seed=config.run.seed,
                                    data_dir=data.data_dir, download=data.download,
                                    manual_dir=data.manual_dir, augment=data.augment)
        self.input_stats = settle_normalisation(
            self.dataset, self.logdir, writer=self.rundir is not None,
            started_before=os.path.exists(os.path.join(self.logdir, CONFIG_FILE)))
        self.spec = model_spec(config, self.dataset.num_classes)
        if self.hybrid.scheme == AUTO:
            self.config = config = choose_scheme(self.hybrid, self.spec, config)
        try:
            self.hybrid.parallel_plan.check_widths(self.spec.head.hidden, self.hybrid.num_replicas,
                                                   self.spec.head.names[:-1] or None)
        except PlanError as err:
            raise ConfigError("--devices", f"model {config.model.model}: "
                              f"{str(err).split(': ', 1)[1]}") from None
        self.model = self.hybrid.placement.build_model(self.hybrid.parallel_plan, self.spec,
                                                       config.run.seed, head_loss(config))
        self.driver = StepDriver(self.hybrid)
        self.optimizer = build_optimizer(self.hybrid, self.model, config.conv_lr, config.fc_lr,
                                         config.optimizer.momentum, config.optimizer.weight_decay)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        # Where the input stream continues (examples read, unreadable ones included) and
        # the run's counts of skipped inputs and steps: checkpointed with the weights.
        self.data_position = tf.Variable(0, dtype=tf.int64, trainable=False, name="data_position")
        self.skipped_images = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_images")
        self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_nonfinite")
        self.loss_scale = DynamicLossScale() if p.precision == "fp16" else None
        counters = {"data_position": self.data_position, "skipped_images": self.skipped_images,
                    "skipped_nonfinite": self.skipped_steps}
        scale_state = ({} if self.loss_scale is None else
                       {"loss_scale": self.loss_scale.scale,
                        "loss_scale_good_steps": self.loss_scale.good_steps})
        identity = {"model": config.model.model, "dataset": config.data.dataset,
                    "num_classes": self.dataset.num_classes}
        self.checkpoints = RunCheckpoints(
            self.logdir, self.model, self.optimizer, self.step, identity,
            counters=counters, optional_counters=scale_state,
            read_shards=self.model.read_shards, is_chief=self.hybrid.placement.is_chief,
            read_only=self.read_only)
        self.checkpoints.check_identity(self.logdir)
        self.resumed_from = self.checkpoints.restore_latest()
        # A checkpoint from another K or scheme carries its own rates; this run's config rules.
        self.optimizer.set_learning_rates(config.conv_lr, config.fc_lr)
        self._lr_factor = 1.0
        strategy = self.hybrid.strategy
        if self.resumed_from and int(self.data_position) == 0:  # saved before positions were
            self.data_position.assign(int(self.step) * config.global_batch_size)
        # The input order is fixed by the seed: continuing at the saved stream position
        # restores it (streamed datasets drop those examples before reading them).
        self._train_batches = iter(self._train_input(int(self.data_position)))
        # Training images this process decoded (its own rows, and the candidates tried for
        # unreadable ones) and the global batches' images, since this Trainer started.
        self.decoded_images, self.batch_images = 0, 0
        # The custom gradients the traces below register, dropped from TensorFlow's registry
        # once traced (owt_tf.parallel.gradients): the functions keep their graphs.
        self._traced_gradients = TracedGradients(self)
        self._train_fn = tf.function(self._traced(self._train_step))
        self._eval_fn = tf.function(self._traced(
            lambda images, labels: self.driver.eval_step(self.model, images, labels)))
        self._predict_fn = tf.function(self._traced(
            lambda images: self.driver.predict_step(self.model, images)))
        self._features_fn = tf.function(self._traced(
            lambda images: self.driver.features_step(self.model, images)))
        self._pair_sets = None  # the dataset's verification pairs, read when first needed
        # Each pair set's highest accuracy so far ("Accuracy-Highest"), by set name.
        self.highest_verification: Dict[str, float] = {}
        # fp16 undoes every step whose scaled gradients overflowed, as does --skip-nonfinite.
        snapshot = (StepSnapshot(self._state_variables(), strategy)
                    if config.run.skip_nonfinite or self.loss_scale is not None else None)
        self.policy = StepPolicy(self.hybrid.placement, snapshot, self.loss_scale,
                                 self.skipped_steps, config.run.skip_nonfinite,
                                 self.driver.finite_check_names(self.model),
                                 lambda: self.checkpoints.latest)

    def _train_input(self, start: int):
        """This process's replicas' rows of the global batches from stream position `start`
        (a streamed dataset's as uint8 crops and draws: finished on each device, _finish_images)."""
        batch, seed = self.config.global_batch_size, self.config.run.seed
        return self._own_input(
            lambda rows: self.dataset.train_rows(batch, seed, start, rows=rows, on_device=True),
            lambda: self.dataset.train(batch, seed, start=start))

    def _validation_input(self):
        """This process's replicas' rows of the validation global batches."""
        batch = self.config.global_batch_size
        return self._own_input(lambda rows: self.dataset.validation_rows(batch, rows=rows),
                               lambda: self.dataset.validation(batch))

    def _own_input(self, stream_rows, whole_batches):
        return own_input(self.hybrid.placement, self.dataset, self.config.parallel.batch_size,
                         stream_rows, whole_batches)

    def _state_variables(self) -> List[tf.Variable]:
        """Every variable a step changes except the step counter: weights and optimizer state."""
        head = self.model.head
        return (list(self.model.trunk.variables) + self.optimizer.state_variables()
                + [v for k in head.local_shards for v in head.shard_variables(k)])

    def _traced(self, body: Callable) -> Callable:
        """`body`, noting the custom gradients its trace registers; released after the
        trace, when the call that traced it returns (no other trace is under way then)."""
        def traced(*args, **kwargs):
            with self._traced_gradients.recording():
                return body(*args, **kwargs)

        return traced

    def _train_step(self, images, labels, with_grads=False):
        out = self.driver.train_step(self.model, self.optimizer, images, labels,
                                     step_seed(self.config.run.seed, self.step),
                                     with_grads=with_grads,
                                     loss_scale=None if self.loss_scale is None else self.loss_scale.scale,
                                     finish_images=self._finish_images)
        self.step.assign_add(1)
        return out

    def _finish_images(self, images):  # on a replica's device (a streamed batch: DeviceBatch)
        return finish_images(images, self.dataset.mean, self.dataset.std)

    def train_step(self, with_grads: bool = False) -> StepMetrics:
        """Runs one step on the next global batch (with whole-model gradients if asked)."""
        start = time.perf_counter()
        batch = next(self._train_batches)
        images, labels, positions = batch[:3]
        unreadable = self._count_decodes(batch[3]) if len(batch) > 3 else 0
        self.policy.before_step()
        out = self._train_fn(images, labels, with_grads)
        self._traced_gradients.release()
        outcome = self.policy.after_step(int(self.step), out["finite"].numpy(),
                                         stream_end(self.hybrid.placement, positions), unreadable)
        self.skipped_images.assign_add(outcome.unreadable)
        self.data_position.assign(outcome.end)
        count = int(out["count"])
        loss = float(out["loss_sum"]) / count
        seconds = time.perf_counter() - start
        grads = self.driver.assemble_grads(self.model, out) if with_grads else None
        return StepMetrics(loss, 1.0 - int(out["correct"]) / count,
                           self.config.global_batch_size / seconds,
                           float(self.driver.ledger.total), grads, outcome.nonfinite,
                           outcome.overflowed, outcome.stop)

    def _count_decodes(self, failed) -> int:
        """Adds this process's rows' decodes to `decoded_images`; returns how many of its rows'
        own images were unreadable."""
        batch = self.config.global_batch_size
        failed = failed_decodes(self.hybrid.placement, failed, batch, int(self.step) + 1)
        self.decoded_images += int(np.sum(failed + 1))
        self.batch_images += batch
        return int(np.count_nonzero(failed))

    def average_moving_statistics(self) -> None:
        """BatchNormalization's moving statistics made one set (TrunkRunner.average_statistics):
        before evaluation, features, a checkpoint or an export reads them."""
        self.model.trunk_runner.average_statistics(self.hybrid.placement.run)

    def _save_checkpoint(self, step: int):
        self.average_moving_statistics()
        return self.checkpoints.save(step)

    def evaluate(self) -> EvalMetrics:
        """Loss and top-1/top-5 error over the whole validation split."""
        self.average_moving_statistics()
        totals = {"loss_sum": 0.0, "correct": 0, "correct_top5": 0, "count": 0}
        for images, labels in self._validation_input():
            out = self._eval_fn(images, labels)
            self._traced_gradients.release()
            for key in totals:
                totals[key] += out[key].numpy()
        n = int(totals["count"])
        return EvalMetrics(totals["loss_sum"] / n, 1 - totals["correct"] / n,
                           1 - totals["correct_top5"] / n, n)

    def predict_logits(self, images: np.ndarray) -> np.ndarray:
        """Logits of uint8 images [N, H, W, C] through the distributed model (eval mode)."""
        return self._by_global_batches(self._predict_fn, images)

    def features(self, images: np.ndarray) -> np.ndarray:
        """The trunk's float32 outputs (the class layer's input, not normalised) for uint8
        images [N, H, W, C], each replica running its own rows (eval mode)."""
        if self.spec.head.hidden:
            raise ValueError(f"model {self.spec.name}: the class layer's input is computed by "
                             "hidden FC layers on the shards; only a trunk's output embeds")
        return self._by_global_batches(self._features_fn, images)

    def _by_global_batches(self, fn, images: np.ndarray) -> np.ndarray:
        """`fn` of distributed global batches of `images`, eval-preprocessed (the last batch
        padded, the padding dropped)."""
        self.average_moving_statistics()
        return by_global_batches(fn, images, self.config.global_batch_size,
                                 self.spec.input_shape[:2], self.dataset,
                                 self.hybrid.placement.distribute_global_batch,
                                 self._traced_gradients.release)

    def verify(self) -> Dict[str, object]:
        """VerificationResult by set name of the dataset's pair sets (faces, insightface's
        *.bin) under InsightFace's protocol on `features`; none without pairs or without a
        trunk embedding."""
        if self.spec.head.hidden:
            return {}
        if self._pair_sets is None:
            self._pair_sets = dataset_pair_sets(self.dataset)
        batch = self.config.global_batch_size * max(1, 256 // self.config.global_batch_size)
        return verify_sets(self.features, self._pair_sets, batch)

    def fit(self, steps: Optional[int] = None, log: Callable[[str], None] = print,
            progress: bool = True) -> Dict[str, float]:
        """Trains up to step `steps` (default: --steps, or --epochs in steps) from wherever
        the run is.

        Validates every --eval-every steps, writes TensorBoard summaries to the logdir
        and checkpoints every --checkpoint-every steps and at the end. SIGINT / SIGTERM
        end it after the current step with a checkpoint (`Interrupted`); a non-finite step
        ends it without one (`NonFiniteError`), unless --skip-nonfinite lets it be undone.
        """
        config = self.config
        steps = steps or config.total_steps(self.dataset.num_train)
        first = int(self.step) + 1
        chief = self.hybrid.placement.is_chief  # in a cluster only the chief writes files
        if chief and self.rundir is None and not self.read_only:  # a second fit() of this Trainer
            self.rundir = RunDirLock.take(self.logdir)
        if chief:
            self.checkpoints.write_identity(self.logdir, config.to_dict())
        if self.resumed_from:
            log(f"resumed from {self.resumed_from} at step {first - 1}")
        if first > steps:
            log(f"nothing to do: the run in {self.logdir} is already at step {first - 1}")
            self._release_rundir()
            return {"steps": first - 1}
        summaries = RunSummaries(self.logdir if chief else None, config.run.profile_steps)
        summaries.config(config.to_flags())
        summaries.sample_images(self.dataset.sample_images(), first)
        # A live bar on a terminal; in a log file only the periodic lines below.
        verbose = (1 if sys.stdout.isatty() else 0) if progress else 0
        bar = ProgressLines(steps, verbose, log)
        log = bar.log
        val_history: List[List[float]] = []  # [epoch, val top-1 error] at every validation
        started = time.perf_counter()
        with SignalStop() as stop:
            self.policy.signals = stop
            try:
                history = self._train_steps(first, steps, summaries, bar, val_history, log)
                wall = time.perf_counter() - started
                saved = self._save_checkpoint(steps)
                ev, verified = self._validate(steps, summaries, val_history)
                self._export(log)
                self.hybrid.placement.wait_for_workers("fit_end")
            except tf.errors.OpError as err:
                if self.hybrid.placement.num_workers == 1 or not is_peer_failure(err):
                    raise
                raise WorkerLost(int(self.step), err, self.checkpoints.latest) from None
            finally:
                self.policy.signals = None
                summaries.close()
                self.checkpoints.close()
                self._release_rundir()
        summary = run_summary(history, ev, steps, wall, val_history, verified)
        skipped = int(self.skipped_images)
        if skipped or int(self.skipped_steps):
            log(f"skipped {skipped} unreadable training images and {int(self.skipped_steps)} "
                "non-finite steps")
        workers = (f" ({self.hybrid.placement.num_workers} workers x {len(self.devices)})"
                   if self.hybrid.placement.num_workers > 1 else "")
        if workers and self.batch_images:
            first_row, rows = self.hybrid.placement.own_rows(config.parallel.batch_size)
            log(f"input: this worker decoded {self.decoded_images} of the {self.batch_images} "
                f"training images of its steps (rows {first_row}-{first_row + rows - 1} of each "
                f"global batch of {config.global_batch_size})")
        log(done_line(summary, first, config.parallel.scheme, self.hybrid.num_replicas, workers,
                      saved))
        return summary

    def _release_rundir(self) -> None:
        """Gives up the logdir's lock once fit() has written everything (another Trainer of
        this process, or another process, may then take it)."""
        if self.rundir is not None:
            self.rundir.release()
            self.rundir = None

    def _export(self, log) -> None:
        """--export-dir: the chief writes the SavedModel (the others join its gather of the
        FC shards)."""
        if not self.config.run.export_dir:
            return
        self.average_moving_statistics()
        if not self.hybrid.placement.is_chief:
            self.model.full_weights()
            return
        path = export_trainer(self, self.config.run.export_dir)
        log(f"exported SavedModel to {path}")

    def _train_steps(self, first: int, steps: int, summaries: RunSummaries, bar, val_history,
                     log) -> List[StepMetrics]:
        """Steps first..steps with periodic checkpoints and validation; stops on a signal."""
        config = self.config
        history: List[StepMetrics] = []
        for i in range(first, steps + 1):
            m = self._run_logged_step(i, steps, summaries)
            history.append(m)
            if m.nonfinite:
                log(f"step {i}: non-finite {m.nonfinite}; step undone "
                    f"({int(self.skipped_steps)} of {config.run.skip_nonfinite} skips used)")
            bar.update(i, [("loss", m.loss), ("error", m.top1_error), ("img/s", m.images_per_sec)])
            if m.stop:
                saved = self._save_checkpoint(i)
                # In a cluster a worker may stop for another worker's signal (signum None).
                raise Interrupted(self.policy.signals.signum, i, saved, self.logdir)
            if config.run.checkpoint_every and i % config.run.checkpoint_every == 0 and i < steps:
                self._save_checkpoint(i)
            if config.run.eval_every and i % config.run.eval_every == 0 and i < steps:
                ev, verified = self._validate(i, summaries, val_history)
                pairs = (f" | verification {verification_text(verified, self.highest_verification)}"
                         if verified else "")
                log(f"step {i}/{steps}: train loss {m.loss:.4f} | val loss {ev.loss:.4f} "
                    f"val top-1 error {ev.top1_error:.2%}{pairs} | {m.images_per_sec:.0f} img/s")
        return history

    def _validate(self, step: int, summaries: RunSummaries, val_history) -> tuple:
        """(EvalMetrics, verification results) at `step`, written to TensorBoard."""
        ev = self.evaluate()
        summaries.validation(step, ev.loss, ev.top1_error, ev.top5_error)
        verified = self.verify()
        for name, result in verified.items():
            self.highest_verification[name] = max(result.accuracy,
                                                  self.highest_verification.get(name, 0.0))
        summaries.verification(step, verified, self.highest_verification)
        epochs = step * self.config.global_batch_size / self.dataset.num_train
        val_history.append([epochs, ev.top1_error])
        return ev, verified

    def _run_logged_step(self, i: int, steps: int, summaries: RunSummaries) -> StepMetrics:
        config = self.config
        every = config.run.histogram_every
        histograms = bool(every) and i % every == 0
        steps_per_epoch = self.dataset.num_train / config.global_batch_size
        factor = lr_factor(config, i, steps_per_epoch, steps)
        if factor != self._lr_factor:  # no variable writes per step under a constant rate
            self.optimizer.set_learning_rates(config.conv_lr * factor, config.fc_lr * factor)
            self._lr_factor = factor
        summaries.before_step(i)
        # Whole-model gradients exist only in one process (each worker holds its own shards').
        m = self.train_step(with_grads=histograms and self.hybrid.placement.num_workers == 1)
        summaries.after_step(i)
        if (config.run.log_every and i % config.run.log_every == 0) or i == steps:
            summaries.train(i, m.loss, m.top1_error, m.images_per_sec, m.bytes_per_step,
                            float(self.optimizer.trunk.learning_rate.numpy()),
                            float(self.optimizer.fc_learning_rate.numpy()))
            summaries.counters(i, int(self.skipped_images), int(self.skipped_steps),
                               None if self.loss_scale is None else float(self.loss_scale.scale.numpy()))
        if histograms:
            summaries.histograms(i, "weights", self.model.named_weights().items())
            if m.grads is not None:
                summaries.histograms(i, "gradients", m.grads.items())
        return m
