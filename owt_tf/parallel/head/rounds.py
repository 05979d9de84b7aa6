"""Each FC round's product, and the rounds' backward as one: how a shard multiplies the rows
of several rounds (scheme (b)'s rounds, owt_tf.parallel.schemes) without paying the kernel
gradient once per round.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence

import tensorflow as tf


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
                   rounds: Optional[Sequence[int]], transposed: bool = False) -> List[tf.Tensor]:
    """[x @ kernel for x in xs] (`transposed`: kernel is [out, in], x @ kernel^T), each
    product under its round's name scope. Backward: the
    kernel's gradient as one product of all rounds' rows joined, not one per round summed:
    a round of B rows reads and writes the whole kernel gradient, so K rounds of a
    9216x1024 shard moved K times its 38 MB (paper AlexNet's first FC layer), the
    memory traffic that made owt-b and owt-c slower than owt-a on a CPU. The same sum,
    in another order."""
    def each_round(kernel, xs):
        return per_round(lambda x, i: tf.matmul(x, kernel, transpose_b=transposed), xs, rounds)

    if len(xs) == 1:
        return each_round(kernel, xs)

    @tf.custom_gradient
    def products(kernel, *xs):
        ys = each_round(kernel, xs)

        def grad(*dys):
            dys = [tf.zeros_like(y) if dy is None else dy for y, dy in zip(ys, dys)]
            dy = tf.concat(dys, axis=0)
            x = tf.concat(xs, axis=0)
            if transposed:
                dkernel = tf.matmul(dy, x, transpose_a=True)
                dx = tf.matmul(dy, kernel)
            else:
                dkernel = tf.matmul(x, dy, transpose_a=True)
                dx = tf.matmul(dy, kernel, transpose_b=True)
            return [dkernel] + tf.split(dx, [int(x.shape[0]) for x in xs], axis=0)

        return ys, grad

    return products(kernel, *xs)
