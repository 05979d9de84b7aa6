"""FC shard compute of several rounds (parallel.shards): each round's product on its own
forward, the kernel's gradient as one product over all rounds' rows backward."""
import numpy as np
import tensorflow as tf

from owt_tf.parallel.head.layout import COL, ROW, ShardedDense


def _layer(split, rng):
    return ShardedDense("fc", rng.normal(size=(12, 8)).astype(np.float32),
                        rng.normal(size=8).astype(np.float32), split, ["/cpu:0"] * 2)


def test_rounds_forward_and_gradients_equal_one_product_over_all_rows():
    rng = np.random.default_rng(0)
    for split in (COL, ROW):
        layer = _layer(split, rng)
        width = 12 if split == COL else 6  # a ROW shard takes its slice of the inputs
        xs = [tf.constant(rng.normal(size=(3, width)), tf.float32) for _ in range(4)]
        upstream = [tf.constant(rng.normal(size=(3, 8 if split == ROW else 4)), tf.float32)
                    for _ in range(4)]
        shard = layer.shard_variables(1)

        def run(rounds_at_once):
            with tf.GradientTape() as tape:
                tape.watch(xs)
                if rounds_at_once:
                    ys = tf.split(layer.forward_shard_rounds(xs, 1, rounds=range(4)), 4)
                else:
                    ys = [layer.forward_shard_rounds([x], 1) for x in xs]
            return ys, tape.gradient(ys, xs + shard, output_gradients=upstream)

        (ys, grads), (want_ys, want_grads) = run(True), run(False)
        for got, want in zip(ys + grads, want_ys + want_grads, strict=True):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_the_kernel_gradient_of_k_rounds_is_one_matmul():
    """K rounds of B rows each read and write the whole kernel gradient if it is taken per
    round: the traced backward has one kernel-shaped product, not K and an AddN."""
    layer = _layer(COL, np.random.default_rng(1))
    shard = layer.shard_variables(0)

    @tf.function
    def grads(xs):
        with tf.GradientTape() as tape:
            ys = layer.forward_shard_rounds(xs, 0, rounds=range(4))
            loss = tf.reduce_sum(ys * ys)
        return tape.gradient(loss, shard)

    xs = [tf.ones([3, 12]) for _ in range(4)]
    graph = grads.get_concrete_function(xs).graph
    kernel_products = [op for op in graph.get_operations() if op.type == "MatMul"
                       and op.outputs[0].shape.as_list() == [12, 4]]
    assert len(kernel_products) == 1, [op.name for op in kernel_products]
