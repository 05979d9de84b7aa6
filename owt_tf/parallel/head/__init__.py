"""The sharded head: the FC layers split over K devices.

    layout.py    which columns live where: ShardedDense, splits, padding, joining shards,
                 class-major sampled layers, shards made a block at a time
    rounds.py    a round's product on its own, the rounds' kernel gradient as one
    forward.py   the one FC forward pass (training, evaluation, prediction, export)
    exchange.py  the collectives between the shards
    loss.py      the head's loss: what it is (HeadLoss), which Keras losses map to it,
                 computed gathered or on the shards (softmax, margins)
    candidates.py  each shard's top candidates, which the metrics and predict read
    sampling.py  Partial FC: the sampled classes of a shard
    update.py    a shard's update (both front doors): whole, or the sampled rows only
    state.py     the state of a shard: weights and optimizer slots, saved whole
"""
