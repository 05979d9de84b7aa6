"""Model-parallel FC layers: where FC shards are placed, how a layer is split, how it runs.

An FC layer of `in x out` weights is split over K devices either by output units ('col':
shard k owns columns k*out/K ... of the kernel, the paper's split) or by input units
('row': shard k owns rows k*in/K ..., Megatron's second half of a column/row pair).
Shard k is a plain tf.Variable created under tf.device(devices[k]) *outside*
strategy.scope(): inside the scope tf.device is ignored for variables
(tensorflow/tensorflow#56416) and the variable would be mirrored.

Class counts that K does not divide are padded with zero columns whose logits are masked
out of the loss, so their gradient is exactly zero and they stay zero; `full_weights`
drops them. Hidden widths must be divisible by K.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from owt_tf.models.spec import HeadSpec
from owt_tf.parallel.head import sampling as class_sampling
from owt_tf.parallel import collectives as coll
from owt_tf.planner.plan import widths_problem
from owt_tf.parallel.head.metrics import (LOWEST, ShardedLoss, TopCandidates, best_of,
                                             shard_top_candidates, unpack_gathered)

COL, ROW = "col", "row"


def layer_splits(num_layers: int, fc_exchange: str) -> List[str]:
    """How each FC layer is split. 'gather': all by output units, their outputs all-gathered.

    'colrow' pairs hidden layers (column split, then row split, one all-reduce per pair);
    the logits layer is always split by classes.
    """
    if fc_exchange == "gather":
        return [COL] * num_layers
    if fc_exchange == "colrow":
        hidden = [COL if i % 2 == 0 else ROW for i in range(num_layers - 1)]
        return hidden + [COL]
    raise ValueError(f"unknown fc_exchange {fc_exchange!r}")


def padded(n: int, k: int) -> int:
    return -(-n // k) * k


class ShardedDense(tf.Module):
    """One FC layer as K kernel/bias shards, shard k on devices[k].

    In a multi-worker run a process holds only the shards of its own devices (`local`):
    the others live in other processes. With devices == [None] (pure data parallelism) it
    is a single unsplit layer whose variables the caller creates under strategy.scope(),
    i.e. mirrored.
    """

    def __init__(self, name: str, kernel: np.ndarray, bias: np.ndarray, split: str,
                 devices: Sequence[Optional[str]], local: Optional[Sequence[int]] = None):
        super().__init__(name=name)
        self.split = split
        self.in_dim, self.out_dim = kernel.shape
        self.num_shards = k = len(devices)
        self.padded_out = padded(self.out_dim, k) if split == COL else self.out_dim
        if split == ROW and (self.in_dim % k or self.out_dim % k):
            raise ValueError(f"{name}: row split needs in ({self.in_dim}) and out "
                             f"({self.out_dim}) divisible by {k}")
        self.local_shards: List[int] = list(range(k) if local is None else local)
        kernel_parts, bias_parts = self.split_full(kernel, bias)
        # Lists by shard index (None: a shard held by another process); a SavedModel can
        # hold lists, not dicts with int keys.
        self.kernels: List[Optional[tf.Variable]] = [None] * k
        self.biases: List[Optional[tf.Variable]] = [None] * k
        for i in self.local_shards:
            with tf.device(devices[i]):
                self.kernels[i] = tf.Variable(kernel_parts[i], name=f"{name}_kernel_{i}")
                self.biases[i] = tf.Variable(bias_parts[i], name=f"{name}_bias_{i}")

    def split_full(self, kernel: np.ndarray, bias: np.ndarray) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        """A whole (kernel, bias) -- weights or momenta -- cut into this layer's shards, padded."""
        pad = self.padded_out - self.out_dim
        if pad:  # np.pad copies even when there is nothing to add: a whole head's worth
            kernel = np.pad(kernel, [(0, 0), (0, pad)])
        return (np.split(kernel, self.num_shards, axis=1 if self.split == COL else 0),
                np.split(np.pad(bias, [(0, pad)]), self.num_shards))

    def shard_variables(self, k: int) -> List[tf.Variable]:
        return [self.kernels[k], self.biases[k]]

    def joined_variables(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """The whole (kernel, bias) as tensors, joined from every shard (all must be local)."""
        if len(self.local_shards) != self.num_shards:
            raise RuntimeError(f"{self.name}: joining shards needs every shard in this process")
        ks = [self.kernels[i] for i in range(self.num_shards)]
        bs = [self.biases[i] for i in range(self.num_shards)]
        kernel = tf.concat(ks, axis=1 if self.split == COL else 0)
        bias = tf.concat(bs, axis=0)
        return kernel[:, :self.out_dim], bias[:self.out_dim]

    def forward_shard_rounds(self, xs: Sequence[tf.Tensor], k: int,
                             rounds: Optional[Sequence[int]] = None,
                             columns: Optional[tf.Tensor] = None) -> List[tf.Tensor]:
        """x @ kernel_k + bias_k for every round's rows x in xs, in x's dtype (float32
        weights are cast, as Keras' mixed precision does: their gradients stay float32).
        Each round's product on its own (under the name scope of round rounds[i] if given:
        it may start as soon as that round's rows arrive), their backward as one product over
        all rounds' rows (`_rounds_matmul`). For ROW, x is this shard's input slice and the
        bias slice lands on its own columns, so the all-reduce that follows adds every bias
        once. `columns` (COL only): the shard's column ids to compute, not all of them."""
        kernel, bias = self.kernels[k], self.biases[k]
        if columns is not None:
            kernel, bias = class_sampling.gather_columns(kernel, bias, columns)
        kernel, bias = (tf.cast(v, xs[0].dtype) for v in (kernel, bias))
        if self.split == ROW:
            width = self.out_dim // self.num_shards
            bias = tf.pad(bias, [[k * width, (self.num_shards - 1 - k) * width]])
        products = _rounds_matmul(list(xs), kernel, rounds)
        return _per_round(lambda y, i: y + bias, products, rounds)


def _rounds_matmul(xs: List[tf.Tensor], kernel: tf.Tensor,
                   rounds: Optional[Sequence[int]]) -> List[tf.Tensor]:
    """[x @ kernel for x in xs], each product under its round's name scope. Backward: the
    kernel's gradient as one product of all rounds' rows joined, not one per round summed:
    a round of B rows reads and writes the whole kernel gradient, so K rounds of a
    9216x1024 shard moved K times its 38 MB (paper AlexNet's first FC layer), the
    memory traffic that made owt-b and owt-c slower than owt-a on a CPU. The same sum,
    in another order."""
    def each_round(kernel, xs):
        return _per_round(lambda x, i: tf.matmul(x, kernel), xs, rounds)

    if len(xs) == 1:
        return each_round(kernel, xs)

    @tf.custom_gradient
    def products(kernel, *xs):
        ys = each_round(kernel, xs)

        def grad(*dys):
            dys = [tf.zeros_like(y) if dy is None else dy for y, dy in zip(ys, dys)]
            dy = tf.concat(dys, axis=0)
            dkernel = tf.matmul(tf.concat(xs, axis=0), dy, transpose_a=True)
            dxs = tf.split(tf.matmul(dy, kernel, transpose_b=True),
                           [int(x.shape[0]) for x in xs], axis=0)
            return [dkernel] + dxs

        return ys, grad

    return products(kernel, *xs)


def assemble(layer: ShardedDense, kernel_parts: Sequence[np.ndarray],
             bias_parts: Sequence[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """Joins per-shard kernel and bias arrays (weights, gradients or momenta) of `layer`."""
    kernel = np.concatenate(kernel_parts, axis=1 if layer.split == COL else 0)
    bias = np.concatenate(bias_parts, axis=0)
    return kernel[:, :layer.out_dim], bias[:layer.out_dim]


# Reads the values of every shard's variables, given this process's own shards' variables
# by shard index: [values of shard 0's variables, ..., of shard K-1's]. In one process a
# plain read; in a cluster a collective gather (Placement.read_shards).
ShardReader = Callable[[Dict[int, List[tf.Variable]]], List[List[np.ndarray]]]


def read_local_shards(per_shard: Dict[int, List[tf.Variable]]) -> List[List[np.ndarray]]:
    """The ShardReader of a process that holds every shard."""
    return [[v.numpy() for v in per_shard[k]] for k in sorted(per_shard)]


class ShardedHead(tf.Module):
    """The FC layers of a HeadSpec, split for K shards, with the FC-to-FC exchange and loss."""

    def __init__(self, spec: HeadSpec, full_weights: Sequence[Tuple[np.ndarray, np.ndarray]],
                 devices: Sequence[Optional[str]], fc_exchange: str = "gather",
                 loss: str = "gathered", local: Optional[Sequence[int]] = None,
                 compute_dtype: str = "float32", sample_rate: float = 1.0):
        super().__init__(name="head")
        k = len(devices)
        problem = widths_problem(spec.hidden, k, spec.names[:-1] or None)
        if problem:
            raise ValueError(problem)
        self.spec = spec
        self.num_shards = k
        self.loss_mode = loss
        # Partial FC: the share of each shard's classes a training update's softmax keeps
        # (owt_tf.parallel.head.sampling); 1: all, the exact loss.
        self.sample_rate = class_sampling.check_sample_rate(sample_rate)
        # What the FC layers compute in and their inputs and outputs travel in; the loss is
        # always float32 (a bfloat16 or float16 softmax loses the small probabilities).
        self.compute_dtype = tf.as_dtype(compute_dtype)
        # (labels, outputs) -> per-example loss; None: cross-entropy on the logits.
        self.per_example_loss: Optional[Callable[[tf.Tensor, tf.Tensor], tf.Tensor]] = None
        # Under the sharded loss: which cross-entropy (a Keras compile's; None: sparse, the
        # CLI's), and how many top candidates per shard the metrics read (0: none, the
        # loss terms' third element is then None).
        self.sharded_loss: Optional[ShardedLoss] = None
        self.candidates_k = 0
        splits = layer_splits(len(spec.widths), fc_exchange)
        self.layers = [
            ShardedDense(f"fc{i}", kern, bias, split, devices, local)
            for i, ((kern, bias), split) in enumerate(zip(full_weights, splits))
        ]
        self.local_shards: List[int] = self.layers[0].local_shards

    def shard_variables(self, k: int) -> List[tf.Variable]:
        return [v for layer in self.layers for v in layer.shard_variables(k)]

    def full_weights(self, read: ShardReader = read_local_shards) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Every layer whole, as (kernel, bias) numpy arrays, padding dropped."""
        values = read({k: self.shard_variables(k) for k in self.local_shards})
        return [assemble(layer, [v[2 * i] for v in values], [v[2 * i + 1] for v in values])
                for i, layer in enumerate(self.layers)]

    def join_groups(self, values: Sequence[Sequence[np.ndarray]],
                    groups: int) -> List[List[Tuple[np.ndarray, np.ndarray]]]:
        """Whole layers from per-shard values laid out as `groups` blocks of
        [W0, b0, W1, b1, ...] (the weights, then each optimizer slot): [group][layer]."""
        n = 2 * len(self.layers)
        return [[assemble(layer, [v[g * n + 2 * i] for v in values],
                          [v[g * n + 2 * i + 1] for v in values])
                 for i, layer in enumerate(self.layers)] for g in range(groups)]

    def assign_whole(self, shard_state: Callable[[int], Sequence[tf.Variable]], group: int,
                     i: int, kernel: np.ndarray, bias: np.ndarray) -> List:
        """Splits layer i's whole (kernel, bias) -- weights or a slot -- into this process's
        shards' variables, block `group` of `shard_state(k)` (the join_groups layout)."""
        n = 2 * len(self.layers)
        kernel_parts, bias_parts = self.layers[i].split_full(kernel, bias)
        ops = []
        for k in self.local_shards:
            state = shard_state(k)
            ops.append(state[group * n + 2 * i].assign(kernel_parts[k]))
            ops.append(state[group * n + 2 * i + 1].assign(bias_parts[k]))
        return ops

    def forward(self, x: tf.Tensor, k: int, training: bool, seed: Optional[tf.Tensor]) -> tf.Tensor:
        """Rows `x` (the same on every replica) through the FC layers; returns shard k's logits.

        Between layers: a column-split layer's output slices are all-gathered, unless the next
        layer is row-split and takes the slice as it is; a row-split layer's partial sums are
        all-reduced. This is the one FC forward pass: training, evaluation and prediction
        run it; `forward_assembled` is the same math with every shard on one device.
        """
        return self.forward_rounds([x], k, training, [seed])[0]

    def forward_rounds(self, xs: Sequence[tf.Tensor], k: int, training: bool,
                       seeds: Sequence[Optional[tf.Tensor]],
                       rounds: Optional[Sequence[int]] = None,
                       sample: Optional[class_sampling.SampledColumns] = None) -> List[tf.Tensor]:
        """`forward` of several rounds' rows, layer by layer: each round's compute on its own
        (xs[i] under the name scope f"fc_round{rounds[i]}" when rounds are given), one
        collective per layer for all of them. With a `sample` (sample_columns) the logits
        are of its columns only: [rows, S]."""
        layers = self.layers
        xs = [tf.cast(x, self.compute_dtype) for x in xs]
        per_round = functools.partial(_per_round, rounds=rounds)
        for i, layer in enumerate(layers[:-1]):
            zs = layer.forward_shard_rounds(xs, k, rounds)
            if layer.split == ROW:
                zs = self._exchange(coll.all_reduce_sum, zs)
            # A ROW layer's output is whole and identical on every replica: same mask for all.
            salt = k if layer.split == COL else 0
            hs = per_round(
                lambda z, r: self._dropout(self._activate(i, z), training, seeds[r], i, salt), zs)
            if layer.split == COL and layers[i + 1].split == COL:
                hs = self._gather(hs)
            xs = hs
        return layers[-1].forward_shard_rounds(xs, k, rounds, None if sample is None else sample.ids)

    def forward_assembled(self, x: tf.Tensor) -> tf.Tensor:
        """Logits [rows, classes] of `x` in inference mode, computed on one device from every
        shard's variables joined (needs all shards in this process): what a one-device model
        with these weights computes. Serves calls outside a replica (Keras' symbolic build,
        a plain `model(x)`)."""
        x = tf.cast(x, self.compute_dtype)
        for i, layer in enumerate(self.layers):
            kernel, bias = (tf.cast(v, x.dtype) for v in layer.joined_variables())
            x = tf.matmul(x, kernel) + bias
            if i < len(self.layers) - 1:
                x = self._activate(i, x)
        return x

    def outputs(self, logits: tf.Tensor) -> tf.Tensor:
        """What the model outputs for these (unpadded) logits: themselves, their softmax or
        their sigmoid. Keras' softmax and sigmoid keep the logits on their result, so Keras'
        cross-entropies on it are computed from the logits, as for the user's own model. Float32, whatever the
        compute dtype (Keras' mixed-precision rule for a model's outputs)."""
        logits = tf.cast(logits, tf.float32)
        if self.spec.output_activation == "softmax":
            return keras.activations.softmax(logits, axis=-1)
        if self.spec.output_activation == "sigmoid":
            return keras.activations.sigmoid(logits)
        return logits

    def _activate(self, i: int, z: tf.Tensor) -> tf.Tensor:
        return tf.nn.relu(z) if self.spec.hidden_activation(i) == "relu" else z

    def _exchange(self, op, ts: Sequence[tf.Tensor], purpose: str = coll.FC_EXCHANGE) -> List[tf.Tensor]:
        """`op(t, purpose)` on every round's t; a gather as one collective on their rows
        joined (coll.joins_rounds)."""
        if self.num_shards == 1:
            return list(ts)
        if op is coll.all_reduce_sum or not coll.joins_rounds(self.num_shards):
            with coll.independent_cuts():
                return [op(t, purpose) for t in ts]
        return _on_joined_rows(lambda t: op(t, purpose), ts)

    def _gather(self, ts: Sequence[tf.Tensor], purpose: str = coll.FC_EXCHANGE) -> List[tf.Tensor]:
        return self._exchange(lambda t, p: coll.all_gather(t, 1, p), ts, purpose)

    def _dropout(self, h, training, seed, layer_index, salt):
        rate = self.spec.hidden_dropout(layer_index)
        if not training or rate == 0.0:
            return h
        layer_seed = tf.random.experimental.stateless_fold_in(seed, layer_index * 1024 + salt)
        return tf.nn.experimental.stateless_dropout(h, rate=rate, seed=layer_seed)

    def loss_terms(self, logits_shard: tf.Tensor, labels: tf.Tensor,
                   k: int) -> Tuple[tf.Tensor, tf.Tensor, Optional[tf.Tensor]]:
        """Per-example loss, top-1 correctness and the model's outputs for rows whose labels
        are `labels`; under the sharded loss, instead of the outputs, the top
        `candidates_k` classes of every shard (TopCandidates), or None.

        The loss is `self.per_example_loss(labels, outputs)` when set (a Keras model's
        compiled loss), else sparse softmax cross-entropy on the logits. 'gathered'
        all-gathers the logits; 'sharded' never does: the softmax normalizer and the target
        logit are summed across shards, the max (which only stabilizes) is gathered without
        gradient, since ReduceOp has no MAX.
        """
        return self.loss_terms_rounds([logits_shard], [labels], k)[0]

    def loss_terms_rounds(self, logits_shards: Sequence[tf.Tensor], labels: Sequence[tf.Tensor],
                          k: int, rounds: Optional[Sequence[int]] = None,
                          sample: Optional[class_sampling.SampledColumns] = None
                          ) -> List[Tuple[tf.Tensor, tf.Tensor, Optional[tf.Tensor]]]:
        """`loss_terms` of several rounds (named as in forward_rounds), each collective once
        for all of them. `sample`: the update's sampled columns (sample_columns), which the
        logits were computed for: the softmax covers its classes. Without it, every class."""
        per_round = functools.partial(_per_round, rounds=rounds)
        if self.loss_mode == "sharded" and (self.num_shards > 1 or sample is not None):
            return self._sharded_cross_entropy(logits_shards, labels, k, per_round, sample)
        logits_all = list(logits_shards)
        if self.num_shards > 1:
            logits_all = self._gather(logits_all, coll.LOGITS)
        return per_round(lambda logits, r: self._round_loss_terms(logits, labels[r]), logits_all)

    def _round_loss_terms(self, logits: tf.Tensor, labels: tf.Tensor):
        logits = tf.cast(logits[:, : self.spec.num_classes], tf.float32)
        outputs = self.outputs(logits)
        if self.per_example_loss is not None:
            ce = self.per_example_loss(labels, outputs)
        else:
            ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        # Top-1 correctness (the CLI's error rate): class ids, or the argmax of one-hot rows.
        sparse = labels.shape.rank == 1
        target = (tf.cast(labels, tf.int64) if sparse
                  else tf.argmax(labels, axis=-1, output_type=tf.int64))
        correct = tf.equal(tf.argmax(logits, axis=1, output_type=tf.int64), target)
        return ce, correct, outputs

    def sample_columns(self, labels: Sequence[tf.Tensor], k: int,
                       update_seed: tf.Tensor) -> class_sampling.SampledColumns:
        """The columns of shard k an FC update with these rows' `labels` (every round of the
        update) keeps under Partial FC, seeded by `update_seed` (int32 [2])."""
        if self.loss_mode != "sharded":
            raise ValueError(f"sample_rate={self.sample_rate:g} needs the class-sharded "
                             "cross-entropy (loss='sharded')")
        sparse = self.sharded_loss is None or self.sharded_loss.sparse
        return class_sampling.shard_sample(labels, k, self._shard_width(), self.spec.num_classes,
                                           self.sample_rate, sparse, update_seed)

    def sampled_mask(self, labels: Sequence[tf.Tensor], k: int, update_seed: tf.Tensor) -> tf.Tensor:
        """bool [width]: `sample_columns` as a mask of shard k's columns."""
        return class_sampling.column_mask(self.sample_columns(labels, k, update_seed))

    def _shard_width(self) -> int:
        return self.layers[-1].padded_out // self.num_shards

    def _class_range(self, k: int) -> Tuple[int, tf.Tensor]:
        """Shard k's first class id and which of its columns are classes (not padding)."""
        width = self._shard_width()
        return k * width, tf.range(k * width, (k + 1) * width) < self.spec.num_classes

    def _top_gathered(self, logits_shards, k: int, per_round, top: int, sample=None):
        """Every shard's `top` best logits of each round's rows (ids too when candidates are
        wanted), all-gathered: per round, (values [n, K*top], ids [n, K*top] or None). The
        best value is the max that stabilizes the softmax (ReduceOp has no MAX)."""
        first, _ = self._class_range(k)
        with_ids = self.candidates_k > 0

        def local_top(logits, r):
            packed = class_sampling.top_candidates(logits, sample, first, self.spec.num_classes, top)
            return packed if with_ids else packed[:, :top]

        gathered = self._gather(per_round(local_top, logits_shards), coll.LOGITS)
        if with_ids:
            return [unpack_gathered(g, self.num_shards, top) for g in gathered]
        return [(g, None) for g in gathered]

    def _sharded_cross_entropy(self, logits_shards, labels, k, per_round, sample=None):
        # float32 from here: sums of exponentials need its precision; what travels is
        # [n, 2 or 3] per round, and [n, 2 * candidates] for the metrics, not [n, classes].
        # Under a sample the logits are its columns; its padding entries are out of the
        # softmax as padding classes are.
        logits_shards = [tf.cast(l, tf.float32) for l in logits_shards]
        width = self._shard_width()
        first, valid = self._class_range(k)
        if sample is not None:
            valid = sample.valid
        loss = self.sharded_loss or ShardedLoss()
        top = min(max(self.candidates_k, 1), logits_shards[0].shape[1])
        tops = self._top_gathered(logits_shards, k, per_round, top, sample)
        global_max = [tf.reduce_max(values, axis=1) for values, _ in tops]

        def local_terms(logits, r):
            shifted = tf.where(valid[None, :], logits - global_max[r][:, None], -np.inf)
            sums = [tf.reduce_sum(tf.exp(shifted), axis=1)]
            if loss.sparse:
                # Keras takes class ids as [n] or [n, 1], of any number type
                local_label = tf.reshape(tf.cast(labels[r], tf.int32), [-1]) - first
                mine = (local_label >= 0) & (local_label < width)
                column = class_sampling.label_positions(local_label, sample, width)
                picked = tf.gather(logits, column, batch_dims=1)
                sums.append(tf.where(mine, picked, tf.zeros_like(picked)))
            else:
                present = tf.where(valid[None, :], logits, 0.0)
                columns = class_sampling.sampled_label_columns(
                    self._label_columns(labels[r], first, width), sample)
                sums.append(tf.reduce_sum(columns * present, 1))
                if loss.label_smoothing:
                    sums.append(tf.reduce_sum(present, axis=1))
            return tf.stack(sums, axis=1)

        # Normalizer and label terms in one all-reduce: separate ones would all be ready at
        # once in the backward pass, in an order that can differ between replicas.
        terms = self._exchange(coll.all_reduce_sum, per_round(local_terms, logits_shards), coll.LOGITS)

        def cross_entropy(t, r):
            log_norm = tf.math.log(t[:, 0]) + global_max[r]
            if loss.sparse:
                return log_norm - t[:, 1], t[:, 1] >= global_max[r], self._candidates(tops[r], t, r, global_max)
            # -sum_c y_c log softmax_c = log_norm * sum(y) - sum(y * logits), y smoothed as
            # Keras smooths it: y (1 - s) + s / classes.
            y = tf.cast(labels[r], tf.float32)
            s = loss.label_smoothing
            label_sum = tf.reduce_sum(y, axis=1) * (1 - s) + s
            label_logits = t[:, 1] * (1 - s) + (t[:, 2] * s / self.spec.num_classes if s else 0.0)
            return (log_norm * label_sum - label_logits, t[:, 1] >= global_max[r],
                    self._candidates(tops[r], t, r, global_max))

        return per_round(cross_entropy, terms)

    def _label_columns(self, labels: tf.Tensor, first: int, width: int) -> tf.Tensor:
        """This shard's columns of [n, classes] labels (zero on padding columns)."""
        labels = tf.cast(labels, tf.float32)
        pad = self.num_shards * width - self.spec.num_classes
        return tf.pad(labels, [[0, 0], [0, pad]])[:, first:first + width]

    def _candidates(self, top, terms, r, global_max) -> Optional[TopCandidates]:
        """The round's candidates, scored as the model's outputs: a softmax's from the
        normalizer already summed for the loss."""
        values, ids = top
        if ids is None:
            return None
        return TopCandidates(self._scores(values, global_max[r], terms[:, 0]), ids)

    def _scores(self, values: tf.Tensor, global_max: tf.Tensor, sum_exp: tf.Tensor) -> tf.Tensor:
        """The model's outputs for logits `values` of rows whose max logit and sum of
        exp(logit - max) are given; padding (LOWEST) stays LOWEST."""
        if self.spec.output_activation == "softmax":
            scores = tf.exp(values - global_max[:, None]) / sum_exp[:, None]
        elif self.spec.output_activation == "sigmoid":
            scores = tf.sigmoid(values)
        else:
            return values
        return tf.where(values > LOWEST, scores, LOWEST)

    def top_k_outputs(self, logits_shard: tf.Tensor, k: int, top_k: int) -> TopCandidates:
        """The `top_k` best classes of every row and the model's outputs for them, from shard
        k's logits of the rows (every replica's rows; inference): each shard's candidates
        gathered ([rows, 2 K top_k]), and a softmax's normalizer all-reduced ([rows])."""
        logits = tf.cast(logits_shard, tf.float32)
        top = min(top_k, logits.shape[1])
        first, valid = self._class_range(k)
        packed = shard_top_candidates(logits, first, self.spec.num_classes, top)
        values, ids = unpack_gathered(self._gather([packed], coll.LOGITS)[0], self.num_shards, top)
        global_max = tf.reduce_max(values, axis=1)
        sum_exp = None
        if self.spec.output_activation == "softmax":
            shifted = tf.where(valid[None, :], logits - global_max[:, None], -np.inf)
            sum_exp = self._exchange(coll.all_reduce_sum, [tf.reduce_sum(tf.exp(shifted), 1)],
                                     coll.LOGITS)[0]
        best = best_of(TopCandidates(values, ids), top_k)
        return TopCandidates(self._scores(best.scores, global_max, sum_exp), best.ids)


def _per_round(fn: Callable[[tf.Tensor, int], object], ts: Sequence[tf.Tensor],
               rounds: Optional[Sequence[int]]) -> list:
    """fn(ts[i], i) for every i, under the name scope of round rounds[i] if given."""
    out = []
    for i, t in enumerate(ts):
        with tf.name_scope(f"fc_round{rounds[i]}") if rounds is not None else contextlib.nullcontext():
            out.append(fn(t, i))
    return out


def _on_joined_rows(op: Callable[[tf.Tensor], tf.Tensor], ts: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """op on the rows of every tensor in `ts` joined, cut back into their rows: one
    collective for several rounds (op must act on each row on its own)."""
    if len(ts) == 1:
        return [op(ts[0])]
    joined = op(tf.concat(list(ts), axis=0))
    return tf.split(joined, [int(t.shape[0]) for t in ts], axis=0)
