"""The sharded head: the FC layers split over K devices.

    layout.py    which columns live where: ShardedDense, splits, padding, joining shards,
                 class-major sampled layers, shards made a block at a time
    rounds.py    a round's product on its own, the rounds' kernel gradient as one
    forward.py   the one FC forward pass (training, evaluation, prediction, export)
    loss.py      the loss on the rounds' logits: gathered, or on the shards (softmax,
                 margins), and the top candidates the metrics read
    sampling.py  Partial FC: the sampled classes of a shard
    sparse.py    Partial FC's update: only the sampled classes move, in place
    metrics.py   the numerics of loss and metrics computed on the shards
    state.py     the state of a shard: weights and optimizer slots, saved whole
"""
