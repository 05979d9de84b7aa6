"""The parallelism plan: FC shards, schemes, collectives and HybridStrategy. No training loop."""
from owt_tf.parallel.schemes import SchemePlan
from owt_tf.parallel.strategy import DistributedModel, HybridStrategy

__all__ = ["DistributedModel", "HybridStrategy", "SchemePlan"]
