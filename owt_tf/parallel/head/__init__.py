"""The sharded head: the FC layers split over K devices.

    layout.py    which columns live where: ShardedDense, splits, padding, joining shards
    forward.py   the one FC forward pass (training, evaluation, prediction, export)
    loss.py      the loss on the rounds' logits: gathered, or on the shards (softmax,
                 margins), and the top candidates the metrics read
    sampling.py  Partial FC: the sampled columns of a shard
    metrics.py   the numerics of loss and metrics computed on the shards
    state.py     the state of a shard: weights and optimizer slots, saved whole
"""
