"""Which columns live where: an FC layer split over K devices, the head's layers, and how
shards are joined and split again.

An FC layer of `in x out` weights is split over K devices either by output units ('col':
shard k owns columns k*out/K ... of the kernel, the paper's split) or by input units
('row': shard k owns rows k*in/K ..., Megatron's second half of a column/row pair).
Shard k is a plain tf.Variable created under tf.device(devices[k]) *outside*
strategy.scope(): inside the scope tf.device is ignored for variables
(tensorflow/tensorflow#56416) and the variable would be mirrored. Which device holds
shard k is decided by the caller (owt_tf.parallel.placement), never here.

Class counts that K does not divide are padded with zero columns whose logits are masked
out of the loss, so their gradient is exactly zero and they stay zero; `full_weights`
drops them. Hidden widths must be divisible by K.

A head that samples its classes (Partial FC) keeps its class layer class-major: shard k's
kernel is stored transposed, [its classes, in], so that a sampled update reads and writes
whole rows (`sampled_rows`; owt_tf.parallel.head.update). Everything that leaves the shards
(`assemble`, `copy_shards_into`, files) sees the usual [in, out]. Shards are made from a
WholeWeights a block at a time (`fill`): the whole layer never exists in memory.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from owt_tf.layers import l2_normalize
from owt_tf.models.head_weights import ArrayWeights, WholeWeights
from owt_tf.parallel.head.rounds import (cosine_rounds_matmul, joined_rows, per_round,
                                         rounds_matmul)
from owt_tf.models.spec import HeadSpec
from owt_tf.parallel.head import sampling
from owt_tf.parallel.head.loss import HeadLoss
from owt_tf.planner.plan import widths_problem

COL, ROW = "col", "row"
# A shard larger than this is made a block of columns at a time (ShardedDense._make_shard).
BLOCK_BYTES = 64 << 20


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


def variable_copies(variable: tf.Variable) -> Sequence[tf.Variable]:
    """The plain variables that hold `variable`: each replica's copy of a mirrored one (the
    unsplit layer of pure data parallelism), else the variable itself. A slice of a
    MirroredVariable reads a tensor, which has no `assign`; its copies' slices assign."""
    if isinstance(variable, tf.distribute.DistributedValues):
        return variable.values
    return (variable,)


def padded(n: int, k: int) -> int:
    return -(-n // k) * k


class ShardedDense(tf.Module):
    """One FC layer as K kernel/bias shards, shard k on devices[k].

    In a multi-worker run a process holds only the shards of its own devices (`local`):
    the others live in other processes. With devices == [None] (pure data parallelism) it
    is a single unsplit layer whose variables the caller creates under strategy.scope(),
    i.e. mirrored.
    """

    def __init__(self, name: str, kernel: Union[np.ndarray, "WholeWeights"],
                 bias: Optional[np.ndarray], split: str,
                 devices: Sequence[Optional[str]], local: Optional[Sequence[int]] = None,
                 cosine: bool = False, class_major: bool = False):
        super().__init__(name=name)
        if cosine and split != COL:
            raise ValueError(f"{name}: a cosine layer is split by columns (classes)")
        if class_major and split != COL:
            raise ValueError(f"{name}: only a class (column-split) layer is kept class-major")
        self.split = split
        # A cosine layer (owt_tf.layers.NormalizedDense): each shard normalises its own
        # columns (a column's norm is local to its shard) and the rows, which every replica
        # holds whole; no bias (its variables stay zero and are never read).
        self.cosine = cosine
        self.use_bias = not cosine
        # Class-major: shard k's kernel is stored [classes of the shard, in] (its transpose),
        # so that a sampled update's classes are rows: gathered and scattered whole, in
        # place (Partial FC's sparse update; a column scatter of [in, width] costs more than
        # the dense update). Files and views see the usual [in, out] (`assemble`).
        self.class_major = class_major
        source = kernel if isinstance(kernel, WholeWeights) else ArrayWeights(kernel, bias)
        self.in_dim, self.out_dim = source.shape
        self.num_shards = k = len(devices)
        self.padded_out = padded(self.out_dim, k) if split == COL else self.out_dim
        if split == ROW and (self.in_dim % k or self.out_dim % k):
            raise ValueError(f"{name}: row split needs in ({self.in_dim}) and out "
                             f"({self.out_dim}) divisible by {k}")
        self.local_shards: List[int] = list(range(k) if local is None else local)
        # Lists by shard index (None: a shard held by another process); a SavedModel can
        # hold lists, not dicts with int keys.
        self.kernels: List[Optional[tf.Variable]] = [None] * k
        self.biases: List[Optional[tf.Variable]] = [None] * k
        for i in self.local_shards:
            with tf.device(devices[i]):
                self.kernels[i], self.biases[i] = self._make_shard(source, i)

    def _make_shard(self, source: "WholeWeights", k: int) -> Tuple[tf.Variable, tf.Variable]:
        """Shard k's variables, drawn or read a block of columns at a time into the variable
        itself: no whole-layer temporary (a 10M-class head is 5 GB a copy), nor a whole
        shard's (1.3 GB at K=4), beyond the variable."""
        name = self.name
        width = self.shard_columns()
        if self.split == ROW or self.in_dim * width * 4 <= BLOCK_BYTES:
            kernel, bias = self.shard_part(source, k)
            return (tf.Variable(kernel, name=f"{name}_kernel_{k}"),
                    tf.Variable(bias, name=f"{name}_bias_{k}"))
        shape = (width, self.in_dim) if self.class_major else (self.in_dim, width)
        kernel = tf.Variable(tf.zeros(shape, source.dtype), name=f"{name}_kernel_{k}")
        return kernel, tf.Variable(self.fill(kernel, source, k), name=f"{name}_bias_{k}")

    def fill(self, kernel: tf.Variable, source: "WholeWeights", k: int) -> np.ndarray:
        """Assigns shard k's part of `source` into its `kernel` variable, a block of columns
        (64 MB) at a time; returns the shard's bias values."""
        if self.split == ROW:
            part, bias = self.shard_part(source, k)
            kernel.assign(part)
            return bias
        width = self.shard_columns()
        step = max(1, BLOCK_BYTES // (4 * self.in_dim))
        biases = []
        copies = variable_copies(kernel)
        for lo in range(0, width, step):
            hi = min(width, lo + step)
            block, bias = self.shard_part(source, k, lo, hi)
            for copy in copies:
                (copy[lo:hi] if self.class_major else copy[:, lo:hi]).assign(block)
            biases.append(bias)
            del block
        return np.concatenate(biases)

    def read_block(self, variable: tf.Variable, lo: int, hi: int) -> tf.Tensor:
        """Columns lo ... hi-1 of a shard's kernel-shaped `variable` (weights or a slot), as
        stored. A class-major shard's rows are gathered: a sampled update leaves its
        variables in TensorFlow's copy-on-read mode, where a slice would first copy the
        whole shard."""
        if self.class_major:
            return tf.gather(variable, tf.range(lo, hi))
        return variable[:, lo:hi]

    def shard_columns(self) -> int:
        """Columns of each shard's kernel (COL: its classes or units; ROW: all of them)."""
        return self.padded_out // self.num_shards if self.split == COL else self.out_dim

    def shard_part(self, source: "WholeWeights", k: int, lo: int = 0,
                   hi: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Shard k's (kernel, bias) of a whole layer's values -- weights or momenta -- as
        its variables hold them: padded, class-major where the layer is. `lo`, `hi` (COL):
        only the shard's columns lo ... hi-1."""
        if self.split == ROW:
            rows = self.in_dim // self.num_shards
            bias = source.bias(0, self.out_dim)
            return (source.kernel_rows(k * rows, (k + 1) * rows),
                    np.split(bias, self.num_shards)[k])
        width = self.shard_columns()
        start, stop = k * width + lo, k * width + (width if hi is None else hi)
        real = min(stop, self.out_dim)
        kernel = source.kernel_columns(start, real) if real > start else None
        bias = source.bias(start, real) if real > start else None
        if real < stop:  # the padded columns of the last shard(s)
            dtype = source.dtype
            pad = np.zeros((self.in_dim, stop - max(start, real)), dtype)
            kernel = pad if kernel is None else np.concatenate([kernel, pad], axis=1)
            bias_pad = np.zeros((stop - max(start, real),), dtype)
            bias = bias_pad if bias is None else np.concatenate([bias, bias_pad])
        return (np.ascontiguousarray(kernel.T) if self.class_major else kernel), bias

    def shard_variables(self, k: int) -> List[tf.Variable]:
        return [self.kernels[k], self.biases[k]]

    def joined_variables(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """The whole (kernel [in, out], bias) as tensors, joined from every shard (all must be
        local; a class-major layer is never joined: joined_rounds multiplies its shards)."""
        self._check_all_local()
        ks = [self.kernels[i] for i in range(self.num_shards)]
        bs = [self.biases[i] for i in range(self.num_shards)]
        kernel = tf.concat(ks, axis=1 if self.split == COL else 0)
        bias = tf.concat(bs, axis=0)
        return kernel[:, :self.out_dim], bias[:self.out_dim]

    def _check_all_local(self) -> None:
        if len(self.local_shards) != self.num_shards:
            raise RuntimeError(f"{self.name}: joining shards needs every shard in this process")

    def joined_rounds(self, xs: Sequence[tf.Tensor],
                      rounds: Optional[Sequence[int]] = None) -> tf.Tensor:
        """x @ kernel + bias for every round's rows x, joined in round order, with every shard
        joined on this device (unpadded): what a one-device Dense layer with these weights
        computes. A class-major layer's shards are multiplied one by one and their logits
        joined: its kernel is never joined (5 GB for 10M classes of 128)."""
        if self.class_major:
            self._check_all_local()

            def logits(x, i):
                parts = [self._products([x], k, None, None) for k in range(self.num_shards)]
                return tf.concat(parts, axis=1)[:, :self.out_dim]

            return joined_rows(per_round(logits, xs, rounds))
        kernel, bias = (tf.cast(v, xs[0].dtype) for v in self.joined_variables())
        if self.cosine:
            kernel = l2_normalize(kernel, axis=0)
            return joined_rows(per_round(
                lambda x, i: tf.matmul(l2_normalize(x, axis=-1), kernel), xs, rounds))
        return joined_rows(per_round(lambda x, i: tf.matmul(x, kernel) + bias, xs, rounds))

    def sampled_rows(self, k: int, sample: sampling.SampledColumns) -> "SampledRows":
        """Shard k's sampled classes: their kernel rows and biases, read from the variables
        (a class-major layer's rows: one gather each). Taken inside the step's tape, they are
        what the update differentiates: its gradient is [S, in], never the shard's width."""
        if not self.class_major:
            raise ValueError(f"{self.name}: a sampled update needs the class-major layout")
        return SampledRows(sample, tf.gather(self.kernels[k], sample.ids),
                           tf.gather(self.biases[k], sample.ids))

    def forward_shard_rounds(self, xs: Sequence[tf.Tensor], k: int,
                             rounds: Optional[Sequence[int]] = None,
                             sampled: Optional["SampledRows"] = None) -> tf.Tensor:
        """x @ kernel_k + bias_k for every round's rows x in xs, joined in round order, in
        x's dtype (float32 weights are cast, as Keras' mixed precision does: their gradients
        stay float32). Each round's product on its own (under the name scope of round
        rounds[i] if given: it may start as soon as that round's rows arrive), their backward
        as one product over all rounds' rows (`rounds_matmul`). For ROW, x is this shard's input slice and the
        bias slice lands on its own columns, so the all-reduce that follows adds every bias
        once. `sampled` (sampled_rows): compute the sampled classes only, [rows, S]."""
        return self._products(xs, k, rounds, sampled)

    def _products(self, xs, k, rounds, sampled):
        if sampled is not None:
            kernel, bias = sampled.kernel, sampled.bias
        else:
            kernel, bias = self.kernels[k], self.biases[k]
        kernel, bias = (tf.cast(v, xs[0].dtype) for v in (kernel, bias))
        transposed = self.class_major
        if self.cosine:
            return cosine_rounds_matmul([l2_normalize(x, axis=-1) for x in xs], kernel, rounds,
                                        transposed)
        if self.split == ROW:
            width = self.out_dim // self.num_shards
            bias = tf.pad(bias, [[k * width, (self.num_shards - 1 - k) * width]])
        return rounds_matmul(list(xs), kernel, rounds, transposed) + bias


class SampledRows(NamedTuple):
    """A sampled update's part of a class-major shard: `sample` (its class ids), and
    `kernel` [S, in], `bias` [S] gathered from the shard's variables."""

    sample: sampling.SampledColumns
    kernel: tf.Tensor
    bias: tf.Tensor


def assemble(layer: ShardedDense, kernel_parts: Sequence[np.ndarray],
             bias_parts: Sequence[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """Joins per-shard kernel and bias arrays (weights, gradients or momenta, as the
    shards' variables hold them) of `layer` into the whole [in, out] and [out]."""
    if layer.class_major:
        kernel_parts = [np.transpose(p) for p in kernel_parts]
    kernel = np.concatenate(kernel_parts, axis=1 if layer.split == COL else 0)
    bias = np.concatenate(bias_parts, axis=0)
    return kernel[:, :layer.out_dim], bias[:layer.out_dim]


def whole_kernel_blocks(layer: ShardedDense, variable_of: Callable[[int], tf.Variable]):
    """(index into the whole [in, out] kernel, value) of every shard's kernel-shaped state
    (`variable_of(k)`: weights or a slot), 64 MB at a time, the padding left out: how the
    whole leaves the shards (files, a one-device model) without existing whole."""
    width = layer.shard_columns()
    step = max(1, BLOCK_BYTES // (4 * layer.in_dim))
    for k in range(layer.num_shards):
        value = variable_of(k)
        if layer.split == ROW:
            rows = layer.in_dim // layer.num_shards
            yield (slice(k * rows, (k + 1) * rows), slice(None)), tf.convert_to_tensor(value)
            continue
        real = min(width, layer.out_dim - k * width)
        for lo in range(0, max(0, real), step):
            hi = min(real, lo + step)
            block = layer.read_block(value, lo, hi)
            yield ((slice(None), slice(k * width + lo, k * width + hi)),
                   tf.transpose(block) if layer.class_major else block)


def copy_shards_into(layer: ShardedDense, kernel, bias=None) -> None:
    """Assigns every shard of `layer` (all in this process) into a whole [in, out] `kernel`
    variable and [out] `bias` (a one-device Keras layer's), 64 MB at a time: no whole copy
    besides the target."""
    layer._check_all_local()
    kernel = getattr(kernel, "value", kernel)  # a Keras variable: its tf.Variable
    for index, block in whole_kernel_blocks(layer, lambda k: layer.kernels[k]):
        kernel[index].assign(block)
    if bias is not None:
        bias = getattr(bias, "value", bias)
        bias.assign(tf.concat([layer.biases[k] for k in range(layer.num_shards)], 0)[:layer.out_dim])


# Reads the values of every shard's variables, given this process's own shards' variables
# by shard index: [values of shard 0's variables, ..., of shard K-1's]. In one process a
# plain read; in a cluster a collective gather (Placement.read_shards).
ShardReader = Callable[[Dict[int, List[tf.Variable]]], List[List[np.ndarray]]]


def read_local_shards(per_shard: Dict[int, List[tf.Variable]]) -> List[List[np.ndarray]]:
    """The ShardReader of a process that holds every shard."""
    return [[v.numpy() for v in per_shard[k]] for k in sorted(per_shard)]


def _kernel_and_bias(weights) -> Tuple[object, Optional[np.ndarray]]:
    """A layer's initial values as ShardedDense takes them: a WholeWeights, or whole arrays."""
    if isinstance(weights, WholeWeights):
        return weights, None
    kernel, bias = weights
    return kernel, bias


class ShardedHead(tf.Module):
    """The FC layers of a HeadSpec, split for K shards: the state of the head. Its forward
    pass is owt_tf.parallel.head.forward, its loss owt_tf.parallel.head.loss."""

    def __init__(self, spec: HeadSpec,
                 full_weights: Sequence[Union[Tuple[np.ndarray, np.ndarray], WholeWeights]],
                 devices: Sequence[Optional[str]], fc_exchange: str = "gather",
                 loss: Optional[HeadLoss] = None, local: Optional[Sequence[int]] = None,
                 compute_dtype: str = "float32"):
        super().__init__(name="head")
        k = len(devices)
        problem = widths_problem(spec.hidden, k, spec.names[:-1] or None)
        if problem:
            raise ValueError(problem)
        self.spec = spec
        self.num_shards = k
        self.loss = loss or HeadLoss()
        # What the FC layers compute in and their inputs and outputs travel in; the loss is
        # always float32 (a bfloat16 or float16 softmax loses the small probabilities).
        self.compute_dtype = tf.as_dtype(compute_dtype)
        splits = layer_splits(len(spec.widths), fc_exchange)
        last = len(spec.widths) - 1
        # A sampled head keeps its class layer class-major (ShardedDense): a Partial FC
        # update then reads and writes its sampled classes as whole rows.
        sampled = self.loss.sample_rate < 1.0
        self.layers = [
            ShardedDense(f"fc{i}", *_kernel_and_bias(weights), split, devices, local,
                         cosine=spec.cosine and i == last, class_major=sampled and i == last)
            for i, (weights, split) in enumerate(zip(full_weights, splits))
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
        whole = ArrayWeights(kernel, bias)
        ops = []
        for k in self.local_shards:
            state = shard_state(k)
            bias_part = self.layers[i].fill(state[group * n + 2 * i], whole, k)
            ops.append(state[group * n + 2 * i + 1].assign(bias_part))
        return ops

    def shard_width(self) -> int:
        return self.layers[-1].padded_out // self.num_shards

    def class_range(self, k: int) -> Tuple[int, tf.Tensor]:
        """Shard k's first class id and which of its columns are classes (not padding)."""
        width = self.shard_width()
        return k * width, tf.range(k * width, (k + 1) * width) < self.spec.num_classes

    def use_loss(self, loss: HeadLoss) -> None:
        """Computes `loss` from now on (Keras' compile knows the loss only after the head's
        weights exist); the sample rate is the plan's and cannot change here."""
        if loss.sample_rate != self.loss.sample_rate:
            raise ValueError(f"the head samples at {self.loss.sample_rate:g}, the plan's rate; "
                             f"got {loss.sample_rate:g}")
        self.loss = loss

    @property
    def loss_mode(self) -> str:
        """'gathered' (the logits are all-gathered) or 'sharded' (never gathered)."""
        return self.loss.mode

    @property
    def sample_rate(self) -> float:
        return self.loss.sample_rate

