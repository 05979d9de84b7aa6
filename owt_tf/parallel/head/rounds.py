"""Each FC round's product, and the rounds' backward as one: how a shard multiplies the rows
of several rounds (scheme (b)'s rounds, owt_tf.parallel.schemes) without paying the kernel
gradient once per round; and a cosine class layer's product, whose gradient holds no
normalised copy of the kernel (`cosine_rounds_matmul`).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from owt_tf.layers import NORM_EPSILON


def per_round(fn: Callable[[tf.Tensor, int], object], ts: Sequence[tf.Tensor],
               rounds: Optional[Sequence[int]]) -> list:
    """fn(ts[i], i) for every i, under the name scope of round rounds[i] if given."""
    out = []
    for i, t in enumerate(ts):
        with tf.name_scope(f"fc_round{rounds[i]}") if rounds is not None else contextlib.nullcontext():
            out.append(fn(t, i))
    return out


def joined_rows(ts: Sequence[tf.Tensor]) -> tf.Tensor:
    """The rounds' rows as one tensor, in round order (one round: itself, no copy)."""
    return ts[0] if len(ts) == 1 else tf.concat(list(ts), 0)


def rounds_matmul(xs: List[tf.Tensor], kernel: tf.Tensor,
                   rounds: Optional[Sequence[int]], transposed: bool = False) -> tf.Tensor:
    """x @ kernel for the rows of every round in xs, joined in round order (`transposed`:
    kernel is [out, in], x @ kernel^T); each round's product on its own, under its round's
    name scope. Backward: the kernel's gradient as one product of all rounds' rows joined,
    not one per round summed: a round of B rows reads and writes the whole kernel gradient,
    so K rounds of a 9216x1024 shard moved K times its 38 MB (paper AlexNet's first FC
    layer), the memory traffic that made owt-b and owt-c slower than owt-a on a CPU. The
    same sum, in another order. The join is inside the gradient: the joined products'
    gradient arrives whole, never split per round and joined again (a million-class
    layer's logits: 0.5 GB a copy)."""
    def each_round(kernel, xs):
        return joined_rows(per_round(lambda x, i: tf.matmul(x, kernel, transpose_b=transposed),
                                     xs, rounds))

    if len(xs) == 1:
        return each_round(kernel, xs)

    @tf.custom_gradient
    def products(kernel, *xs):
        def grad(dy):
            x = tf.concat(xs, axis=0)
            if transposed:
                dkernel = tf.matmul(dy, x, transpose_a=True)
                dx = tf.matmul(dy, kernel)
            else:
                dkernel = tf.matmul(x, dy, transpose_a=True)
                dx = tf.matmul(dy, kernel, transpose_b=True)
            return [dkernel] + tf.split(dx, [int(x.shape[0]) for x in xs], axis=0)

        return each_round(kernel, xs), grad

    return products(kernel, *xs)


def cosine_rounds_matmul(xs: List[tf.Tensor], kernel: tf.Tensor,
                         rounds: Optional[Sequence[int]],
                         transposed: bool = False) -> tf.Tensor:
    """rounds_matmul of the rows `xs` (already unit rows) by the kernel's classes normalised
    to unit length (a cosine class layer, owt_tf.layers.NormalizedDense: x̂ @ (W / ||W||)),
    computed as (x̂ @ W) / ||W||, the norms floored as owt_tf.layers.l2_normalize floors them.

    Why not l2_normalize(kernel) and autodiff: that computes nine kernel-sized tensors (a
    normalised copy, its square, seven in the backward; a 1M x 512 head: 2 GB each on the
    shards together), for what is a per-class scale. Here the forward pass makes the
    [rows, classes] products only, and the backward one kernel-sized tensor, the gradient:
    (x̂ᵀ dy) / ||W|| - W * c, c_j = Σ_rows(dy_j y_j) / ||W_j||², in one XLA fusion that
    writes the product's buffer in place (`_kernel_gradient`)."""
    axis = 1 if transposed else 0

    @tf.custom_gradient
    def products(kernel, *xs):
        squares = _column_square_sums(kernel, axis)
        inverse = tf.math.rsqrt(tf.maximum(squares, NORM_EPSILON))
        y = joined_rows(per_round(
            lambda x, i: tf.matmul(x, kernel, transpose_b=transposed) * inverse, xs, rounds))

        def grad(dy):
            # the norm's part; nothing where the floor holds the norm (l2_normalize's too)
            c = inverse * inverse * tf.reduce_sum(dy * y, 0)
            c = tf.where(squares > NORM_EPSILON, c, tf.zeros_like(c))
            dkernel = _kernel_gradient(joined_rows(xs), dy, inverse, kernel, c, transposed)
            dx = _rows_gradient(dy, inverse, kernel, transposed)
            return [dkernel] + tf.split(dx, [int(t.shape[0]) for t in xs], axis=0)

        return y, grad

    return products(kernel, *xs)


# The squared norms are summed a block of this many bytes of the kernel at a time.
SQUARES_BLOCK_BYTES = 64 << 20


def _column_square_sums(kernel: tf.Tensor, axis: int) -> tf.Tensor:
    """Σ kernel² over `axis` (each class centre's squared norm), a block of the summed axis
    at a time, one block after the other: a reduction of the whole kernel holds a
    kernel-sized temporary, by XLA as by TensorFlow (measured with TF's BFC allocator on a
    [512, 524,288] shard: 1,058 MiB for a 2 MiB result; by blocks: 4 MiB, 94 MiB
    class-major), and the shards' reductions run at once (at 1M x 512, K = 2: 2 GB of a
    step's peak)."""
    n = int(kernel.shape[axis])
    nbytes = kernel.shape.num_elements() * kernel.dtype.size
    step = max(1, n * SQUARES_BLOCK_BYTES // max(1, nbytes))
    if step >= n:
        return _square_sums(kernel, axis)
    total = None
    for start in range(0, n, step):
        with tf.control_dependencies([] if total is None else [total]):
            block = kernel[start:start + step] if axis == 0 else kernel[:, start:start + step]
            part = _square_sums(block, axis)
        total = part if total is None else total + part
    return total


@tf.function(jit_compile=True, autograph=False)
def _square_sums(kernel: tf.Tensor, axis: int) -> tf.Tensor:
    # XLA: the square never leaves the call (plain TF makes it a tensor of the block's size)
    return tf.reduce_sum(tf.square(kernel), axis=axis)


@tf.function(jit_compile=True, autograph=False)
def _kernel_gradient(x: tf.Tensor, dy: tf.Tensor, inverse: tf.Tensor, kernel: tf.Tensor,
                     c: tf.Tensor, transposed: bool) -> tf.Tensor:
    # XLA: the product's buffer is the result's (an elementwise consumer shares it); plain
    # TF would hold the product, W * c and their difference at once
    if transposed:
        return tf.matmul(dy, x, transpose_a=True) * inverse[:, None] - kernel * c[:, None]
    return tf.matmul(x, dy, transpose_a=True) * inverse[None, :] - kernel * c[None, :]


@tf.function(jit_compile=True, autograph=False)
def _rows_gradient(dy: tf.Tensor, inverse: tf.Tensor, kernel: tf.Tensor,
                   transposed: bool) -> tf.Tensor:
    # XLA: dy / ||W|| lives inside this call only, not beside the kernel's gradient
    return tf.matmul(dy * inverse, kernel, transpose_b=not transposed)
