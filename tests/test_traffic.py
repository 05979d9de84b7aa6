"""The traffic formula against the paper's (docs/paper.md) figures for the paper's AlexNet (B=128, fp32)."""
from fractions import Fraction

import pytest

from owt_tf.models.cost import NetworkShape
from owt_tf.planner import ledger
from owt_tf.planner import traffic

ALEXNET = traffic.NetworkShape(trunk_params=2_469_696, features=9216, hidden=(4096, 4096),
                               num_classes=1000)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_data_parallel_all_reduces_every_parameter(k):
    t = traffic.step_traffic(ALEXNET, "data", k, 128)
    params = 2_469_696 + 58_631_144
    assert traffic.total(t) == ledger.all_reduce_cost(params * 4, k)
    # docs/paper.md: each worker sends 2 (K-1)/K * 244 MB
    assert float(traffic.total(t)) / 1e6 == pytest.approx(2 * (k - 1) / k * 244.4, rel=1e-3)


def test_data_parallel_at_k8_moves_427_7_mb():
    assert float(traffic.total(traffic.step_traffic(ALEXNET, "data", 8, 128))) / 1e6 == pytest.approx(427.7, abs=0.05)


@pytest.mark.parametrize("scheme", ["owt-a", "owt-b", "owt-c"])
def test_hybrid_moves_a_fraction_of_data_parallel_bytes(scheme):
    data = traffic.total(traffic.step_traffic(ALEXNET, "data", 8, 128))
    hybrid = traffic.total(traffic.step_traffic(ALEXNET, scheme, 8, 128))
    conv_only = ledger.all_reduce_cost(2_469_696 * 4, 8)
    assert conv_only < hybrid < data / 1.5


def test_one_worker_moves_nothing():
    for scheme in ("single", "data", "owt-a", "owt-b", "owt-c"):
        assert traffic.total(traffic.step_traffic(ALEXNET, scheme, 1, 128)) == 0


def test_colrow_moves_what_gather_moves_and_sharded_loss_moves_less():
    """With a reduce-scatter backward, two gathers (fwd) + two reduce-scatters (bwd) move what
    colrow's all-reduce does each way; colrow issues half the collectives. The class-sharded
    loss never moves the logits."""
    base = traffic.step_traffic(ALEXNET, "owt-a", 4, 128)
    colrow = traffic.step_traffic(ALEXNET, "owt-a", 4, 128, fc_exchange="colrow")
    sharded = traffic.step_traffic(ALEXNET, "owt-a", 4, 128, loss="sharded")
    assert colrow[ledger.FC_EXCHANGE] == base[ledger.FC_EXCHANGE]
    assert sharded[ledger.LOGITS] < base[ledger.LOGITS] / 100


@pytest.mark.parametrize("k,ratio", [(8, 0.349), (4, 0.195)])
def test_paper_hybrid_at_most_a_third_of_data_parallel(k, ratio):
    """Issue 4's figures: 149.2 MB vs 427.7 MB at K=8 (0.349x), 0.195x at K=4, for scheme (a)
    with a reduce-scatter backward and gathered logits."""
    data = traffic.total(traffic.step_traffic(ALEXNET, "data", k, 128))
    hybrid = traffic.total(traffic.step_traffic(ALEXNET, "owt-a", k, 128))
    if k == 8:
        assert float(hybrid) / 1e6 == pytest.approx(149.2, abs=0.05)
    assert float(hybrid / data) == pytest.approx(ratio, abs=0.001)


def test_rounds_share_each_fc_collective_under_one_fc_update_per_step():
    """alexnet_tiny at K=4: with fc_batch 'global' every FC collective runs once for all K
    rounds, each way; with 'worker' once per round. The labels ride with the activations."""
    tiny = traffic.NetworkShape(51_024, 288, (256, 256), 10)

    def launches(scheme, fc_batch):
        return sum(t.calls for t in traffic.step_transfers(tiny, scheme, 4, 32, fc_batch=fc_batch))

    assert launches("owt-a", "global") == 1 + 2 + 4 + 2  # conv, activations, FC, logits
    assert launches("owt-b", "global") == 1 + 5 + 4 + 2  # 4 broadcasts + 1 reduce-scatter
    assert launches("owt-c", "global") == 1 + 5 + 4 + 2  # 4 gathers + 1 reduce-scatter
    assert launches("owt-b", "worker") == 1 + 5 + 4 * (4 + 2)
    assert launches("data", "global") == 2


def test_colrow_is_a_column_row_pair_with_one_all_reduce_each_way():
    """colrow, stated independently: hidden layers cut by outputs then by inputs, the pair
    joined by one all-reduce forward and one backward, and no gather between FC layers (so
    colrow degraded to gather fails here); gather: one gather and its reduce-scatter per
    hidden layer. The engine's own layout equals this statement."""
    from owt_tf.parallel.head.layout import COL, ROW
    from owt_tf.parallel.head.layout import layer_splits as engine_splits

    assert traffic.layer_splits(3, "colrow") == [traffic.BY_OUTPUTS, traffic.BY_INPUTS,
                                                 traffic.BY_OUTPUTS]
    assert traffic.layer_splits(3, "gather") == [traffic.BY_OUTPUTS] * 3
    as_engine = {traffic.BY_OUTPUTS: COL, traffic.BY_INPUTS: ROW}
    for layers in (1, 2, 3, 4, 5):
        for exchange in ("gather", "colrow"):
            assert engine_splits(layers, exchange) == [
                as_engine[s] for s in traffic.layer_splits(layers, exchange)], (layers, exchange)
    net = NetworkShape(1000, 64, (32, 32), 10)
    k, b = 4, 8

    def fc_exchange(exchange, scheme):
        (t,) = [t for t in traffic.step_transfers(net, scheme, k, b, exchange)
                if t.purpose == "fc_exchange"]
        return t

    for scheme, rounds in (("owt-a", 1), ("owt-b", k)):
        colrow = fc_exchange("colrow", scheme)
        rows = k * b if scheme == "owt-a" else b
        # one all-reduce forward, one backward: the rounds of one FC update go through the
        # FC layers joined after their first product
        assert colrow.calls == 2
        assert colrow.nbytes == rounds * 2 * Fraction(2 * (k - 1), k) * rows * 32 * 4
        gather = fc_exchange("gather", scheme)
        assert gather.calls == 4  # after each hidden layer: a gather and its reduce-scatter
