"""What the cost model knows of a machine (`Hardware`), and the measurement of this machine's
CPU as one (`measure_cpu`: matmul FLOP/s, copy bandwidth, and an all-reduce over logical
CPU devices for the link). The named presets, calibrated by the cost model itself, are
`owt_tf.planner.cost_model.preset`. TensorFlow is imported only to measure.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

from owt_tf.planner.ledger import all_reduce_cost

F32 = 4


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the cost model needs to know about a machine. Rates per device, bytes/s, seconds."""

    name: str
    flops: float  # sustained fp32 FLOP/s of one device
    memory_bandwidth: float
    link_bandwidth: float  # one direction
    latency: float  # per collective launch
    shared_link: bool  # all workers' traffic crosses one link (PCIe tree via the host)
    shared_compute: bool = False  # devices share the same cores (logical CPU devices)
    source: str = ""
    # bf16/fp16 FLOP/s of one device (tensor cores, AVX512-BF16); None: no faster than fp32
    low_precision_flops: Optional[float] = None

    def compute_flops(self, precision: str = "fp32") -> float:
        """Sustained FLOP/s of one device in `precision` (--precision)."""
        return self.flops if precision == "fp32" else (self.low_precision_flops or self.flops)


def measure_cpu(devices: int) -> Hardware:
    """This machine's CPU, measured now: matmul FLOP/s, copy bandwidth, and an all-reduce
    over `devices` logical CPU devices for the collective bandwidth and per-launch latency
    (none at one device, which exchanges nothing: the logical devices of a run already
    under way cannot be added to)."""
    from owt_tf.runtime.devices import logical_cpu_devices, make_strategy

    import tensorflow as tf

    names = logical_cpu_devices(devices)
    a = tf.random.normal([1024, 1024])
    flops = 2 * 1024 ** 3 / _best_seconds(lambda: tf.matmul(a, a).numpy())
    half = tf.cast(a, tf.bfloat16)
    bf16_flops = 2 * 1024 ** 3 / _best_seconds(lambda: tf.matmul(half, half).numpy())
    big = tf.random.normal([16 * 1024 * 1024])
    memory = 2 * 4 * big.shape[0] / _best_seconds(lambda: (big + 1.0).numpy())
    if devices < 2:
        return Hardware("cpu", flops=flops, memory_bandwidth=memory, link_bandwidth=memory,
                        latency=0.0, shared_link=True, shared_compute=True,
                        source="measured on this machine: 1024^2 matmul, 64 MB add (one "
                               "device: no collective to measure)")
    strategy = make_strategy(names[:devices])
    k = strategy.num_replicas_in_sync

    def all_reduce_seconds(n: int) -> float:
        @tf.function  # strategy.run called eagerly warns of its overhead
        def ones():
            return strategy.run(tf.ones, args=([n],))

        x = ones()

        @tf.function
        def reduce(v):
            return strategy.run(lambda t: tf.distribute.get_replica_context().all_reduce("sum", t),
                                args=(v,))
        return _best_seconds(lambda: strategy.experimental_local_results(reduce(x))[0].numpy())

    latency = all_reduce_seconds(1)
    n = 4 * 1024 * 1024
    bandwidth = float(all_reduce_cost(n * F32, k)) * k / max(all_reduce_seconds(n) - latency, 1e-9)
    return Hardware("cpu", flops=flops, memory_bandwidth=memory, link_bandwidth=bandwidth,
                    latency=latency, shared_link=True, shared_compute=True,
                    low_precision_flops=bf16_flops,
                    source=f"measured on this machine: 1024^2 matmul (fp32 and bf16), 64 MB add, "
                           f"all-reduce of 4 B and 16 MB over {k} logical CPU devices")


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm up (tracing, allocation)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
