"""The sharded head's own math against independent statements of it: FC dropout is applied
in training (inverted: its mean is the evaluation output), and the class-sharded
cross-entropy stays exact where a softmax without its max shift overflows; a cosine class
layer's product and gradient equal the normalised kernel's, with one kernel-sized tensor."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from owt_tf.models.spec import HeadSpec
from owt_tf.parallel import HybridStrategy
from owt_tf.parallel import collectives as coll
from owt_tf.parallel.head.forward import forward
from owt_tf.parallel.head.layout import COL, ShardedDense, ShardedHead
from owt_tf.losses import ArcFace, CosFace
from owt_tf.parallel.head.loss import loss_terms, margin_sums
from owt_tf.parallel.head.rounds import cosine_rounds_matmul


def _weights(rng, widths):
    dims = list(widths)
    return [(rng.normal(size=(a, b)).astype(np.float32) * 0.3,
             rng.normal(size=b).astype(np.float32) * 0.1) for a, b in zip(dims[:-1], dims[1:])]


def test_fc_dropout_masks_in_training_and_averages_to_the_evaluation_output(devices):
    """Dropout 0.5 after a ReLU layer: training logits differ from evaluation logits, the
    same seed gives the same mask, and (the next layer being linear) the mean over many seeds
    is the evaluation output, as inverted dropout promises. Skipped dropout fails the first."""
    rng = np.random.default_rng(0)
    spec = HeadSpec(hidden=(64,), num_classes=5, dropout=0.5)
    head = ShardedHead(spec, _weights(rng, (16, 64, 5)), [devices[0]])
    x = tf.constant(rng.normal(size=(4, 16)), tf.float32)
    evaluation = forward(head, x, 0, False, None).numpy()

    def trained(seed):
        return forward(head, x, 0, True, tf.constant([seed, 7], tf.int32)).numpy()

    first = trained(1)
    assert np.abs(first - evaluation).max() > 1e-3
    np.testing.assert_array_equal(first, trained(1))
    assert np.abs(first - trained(2)).max() > 1e-3
    mean = np.mean([trained(s) for s in range(400)], axis=0)
    spread = np.std([trained(s) for s in range(400)], axis=0) / np.sqrt(400)
    assert np.all(np.abs(mean - evaluation) < 5 * spread + 1e-6)


def test_class_sharded_cross_entropy_is_exact_for_large_logits(devices):
    """Logits around 1000 (exp overflows float32 without the max shift), classes split over
    two shards: each row's loss equals TF's own sparse softmax cross-entropy on the whole row."""
    rng = np.random.default_rng(1)
    hybrid = HybridStrategy(devices[:2], "owt-a", loss="sharded")
    spec = HeadSpec(hidden=(), num_classes=6, dropout=0.0)
    head = hybrid.placement.place_head(hybrid.parallel_plan, spec, _weights(rng, (4, 6)))
    logits = (rng.normal(size=(5, 6)) * 30 + 1000).astype(np.float32)
    labels = np.array([0, 5, 2, 3, 1], np.int32)

    @tf.function
    def run():
        def replica():
            k = coll.replica_id()
            ce, _, _ = loss_terms(head, tf.constant(logits[:, 3 * k:3 * (k + 1)]),
                                       tf.constant(labels), k)
            return ce

        return hybrid.strategy.run(replica)

    want = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.constant(logits)).numpy()
    assert np.all(np.isfinite(want))
    for got in hybrid.strategy.experimental_local_results(run()):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)


def _cosine_reference(xs, kernel, transposed):
    """The cosines as NormalizedDense states them, by tf.math.l2_normalize (its own
    autodiff for the gradient): the kernel's classes normalised, then the product."""
    unit = tf.math.l2_normalize(kernel, axis=1 if transposed else 0)
    return [tf.matmul(tf.math.l2_normalize(x, axis=-1), unit, transpose_b=transposed) for x in xs]


@pytest.mark.parametrize("transposed", [False, True], ids=["in-by-classes", "class-major"])
@pytest.mark.parametrize("rounds", [None, [0, 1]], ids=["one round", "two rounds"])
def test_cosine_product_and_its_gradients_equal_the_normalised_kernel_s(transposed, rounds):
    """cosine_rounds_matmul's values and gradients (of the kernel and of each round's rows)
    equal autodiff of l2_normalize(kernel) -- one class centre all zeros, where the norm's
    floor holds -- under an upstream gradient that weighs every logit differently."""
    rng = np.random.default_rng(3)
    kernel = rng.normal(size=(8, 12)).astype(np.float32)
    kernel[:, 5] = 0.0
    kernel = tf.constant(kernel.T if transposed else kernel)
    xs = [tf.constant(rng.normal(size=(4, 8)), tf.float32) for _ in range(1 if rounds is None else 2)]
    upstream = [tf.constant(rng.normal(size=(4, 12)), tf.float32) for _ in xs]

    def values_and_gradients(product):
        with tf.GradientTape() as tape:
            tape.watch([kernel] + xs)
            ys = product()
            loss = tf.add_n([tf.reduce_sum(y * g) for y, g in zip(ys, upstream)])
        return [y.numpy() for y in ys], [g.numpy() for g in tape.gradient(loss, [kernel] + xs)]

    want_ys, want_grads = values_and_gradients(lambda: _cosine_reference(xs, kernel, transposed))
    got_ys, got_grads = values_and_gradients(lambda: tf.split(cosine_rounds_matmul(
        [tf.math.l2_normalize(x, axis=-1) for x in xs], kernel, rounds, transposed), len(xs)))
    for got, want in zip(got_ys, want_ys):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(got_grads, want_grads):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_cosine_product_s_backward_makes_one_kernel_sized_tensor():
    """The traced gradient of a cosine class layer's product computes one tensor of the
    kernel's size, the gradient itself (a 1M x 512 head: 2 GB; normalising the kernel and
    differentiating that computed nine: the normalised copy, its square and seven in the
    backward). Counted over the traced step's ops that compute (not views: reads,
    identities) and whose result is used; an XLA call counts as its one output."""
    kernel = tf.Variable(tf.random.normal([16, 300]))
    x = tf.random.normal([4, 16])

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            y = cosine_rounds_matmul([tf.math.l2_normalize(x, axis=-1)], kernel.read_value(),
                                     None)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, kernel)

    graph = step.get_concrete_function().graph
    views = ("ReadVariableOp", "Identity", "IdentityN")
    sized = [(op.type, op.name) for op in graph.get_operations() if op.type not in views
             for out in op.outputs if out.shape.is_fully_defined() and out.consumers()
             and out.shape.num_elements() == 16 * 300]
    assert len(sized) == 1, sized


def _margin_sums_reference(margin, cosines, target_column, valid, shift):
    """margin_sums stated as the loss states it: margin.logits over the columns, the
    invalid ones out of the exponential sum, the label's logit gathered (autodiff for the
    gradient)."""
    logits = margin.logits(cosines, target_column)
    shifted = tf.where(valid[None, :], logits - shift[:, None], -np.inf)
    picked = tf.gather(logits, tf.maximum(target_column, 0), batch_dims=1)
    return [tf.reduce_sum(tf.exp(shifted), axis=1),
            tf.where(target_column >= 0, picked, tf.zeros_like(picked))]


@pytest.mark.parametrize("threshold", [0.0, 0.3], ids=["no filter", "inter-class filter 0.3"])
@pytest.mark.parametrize("make_margin", [ArcFace, CosFace], ids=["ArcFace", "CosFace"])
def test_margin_sums_and_their_gradient_equal_autodiff_of_the_margin_logits(make_margin,
                                                                            threshold):
    """The shard's margin-softmax terms and their gradient in the cosines equal autodiff of
    margin.logits, with cosines beyond [-1, 1] (clamped: no gradient), a padding column
    (out of the sum), a row whose label is another shard's (-1: no margin, no label term)
    and the filter on."""
    rng = np.random.default_rng(5)
    margin = make_margin(interclass_filtering_threshold=threshold)
    cosines = rng.uniform(-0.9, 0.9, size=(5, 9)).astype(np.float32)
    cosines[0, 2], cosines[1, 4] = 1.2, -1.3
    cosines = tf.constant(cosines)
    target_column = tf.constant([3, -1, 0, 8, 5], tf.int32)
    valid = tf.constant([True] * 7 + [False, True])
    shift = tf.reduce_max(margin.scale * tf.clip_by_value(cosines, -1.0, 1.0), axis=1)
    weights = [tf.constant(rng.normal(size=5), tf.float32) for _ in range(2)]

    def terms_and_gradient(terms):
        with tf.GradientTape() as tape:
            tape.watch(cosines)
            out = terms(margin, cosines, target_column, valid, shift)[:2]
            total = tf.add_n([tf.reduce_sum(t * w) for t, w in zip(out, weights)])
        return [t.numpy() for t in out], tape.gradient(total, cosines).numpy()

    want, want_grad = terms_and_gradient(_margin_sums_reference)
    got, got_grad = terms_and_gradient(margin_sums)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-5)
    assert got_grad[0, 2] == 0.0 and got_grad[1, 4] == 0.0 and np.all(got_grad[:, 7] == 0.0)


def test_margin_sums_backward_makes_one_logits_sized_tensor():
    """The shard's margin softmax, forward and backward, computes one [rows, columns]
    tensor, the cosines' gradient (autodiff of margin.logits: the clamped cosines, the
    margin logits, their shifted exponentials, masks and their gradients, each the logits'
    size: 0.5 GB apiece on a 1M-class head)."""
    margin = ArcFace()
    cosines = tf.random.uniform([4, 300], -0.9, 0.9)

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            tape.watch(cosines)
            exp_sum, label, _ = margin_sums(margin, cosines, tf.constant([3, -1, 0, 299]),
                                            tf.ones([300], tf.bool), tf.fill([4], 64.0))
            loss = tf.reduce_sum(tf.math.log(exp_sum) - label)
        return tape.gradient(loss, cosines)

    graph = step.get_concrete_function().graph
    views = ("Identity", "IdentityN", "Const", "Placeholder")
    sized = [(op.type, op.name) for op in graph.get_operations() if op.type not in views
             for out in op.outputs if out.shape.is_fully_defined() and out.consumers()
             and out.shape.as_list() == [4, 300] and out.dtype.is_floating]
    assert len(sized) == 1, sized


@pytest.mark.parametrize("cosine", [False, True], ids=["dense", "cosine"])
def test_a_class_layer_s_rounds_are_joined_once_and_their_gradient_never_split(cosine):
    """The class layer's products of several rounds come out joined, and their gradient
    reaches the layer's backward whole: nothing in the traced backward has one round's
    logits' shape (splitting the joined logits' gradient per round and joining it again
    cost two more copies of the logits: 0.5 GB each for 1M classes at K = 4)."""
    rng = np.random.default_rng(5)
    layer = ShardedDense("classes", rng.normal(size=(8, 30)).astype(np.float32),
                         np.zeros(30, np.float32), COL, ["/cpu:0"] * 2, cosine=cosine)
    xs = [tf.constant(rng.normal(size=(3, 8)), tf.float32) for _ in range(4)]
    shard = layer.shard_variables(0)

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            tape.watch(xs)
            logits = layer.forward_shard_rounds(xs, 0, rounds=range(4))
            loss = tf.reduce_sum(logits * logits)
        return tape.gradient(loss, shard + xs)

    graph = step.get_concrete_function().graph
    assert graph.outputs  # traced
    one_round = [(op.type, op.name) for op in graph.get_operations()
                 if op.name.startswith("gradient_tape/")
                 for out in op.outputs if out.shape.as_list() == [3, 15]]
    assert one_round == []


SQUARES_PEAK = """
import json, sys
import numpy as np, tensorflow as tf
from owt_tf.parallel.head import rounds
rounds.SQUARES_BLOCK_BYTES = 4 << 20
kernel = tf.Variable(tf.random.normal([64, 131072] if sys.argv[1] == "0" else [131072, 64]))
axis = int(sys.argv[1])
run = tf.function(lambda: rounds._column_square_sums(tf.convert_to_tensor(kernel), axis),
                  autograph=False)
run()
before = tf.config.experimental.get_memory_info("CPU:0")["current"]
tf.config.experimental.reset_memory_stats("CPU:0")
got = run().numpy()
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
want = tf.reduce_sum(tf.square(kernel), axis).numpy()
print(json.dumps({"peak": int(peak), "error": float(np.max(np.abs(got - want) / want))}))
"""


@pytest.mark.parametrize("axis", [0, 1], ids=["in-by-classes", "class-major"])
def test_class_norms_are_summed_a_block_at_a_time(axis):
    """The cosine layer's squared class norms of a 32 MiB kernel, 4 MiB blocks: equal to
    the whole reduction, and the call's peak of live tensors (TensorFlow's BFC allocator,
    in a process of its own) stays near a block: reducing the whole kernel at once held a
    kernel-sized temporary (1 GB of a [512, 524,288] shard)."""
    proc = subprocess.run([sys.executable, "-c", SQUARES_PEAK, str(axis)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
                                   TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["error"] < 1e-5
    assert seen["peak"] < 12 << 20, seen  # the kernel: 32 MiB
