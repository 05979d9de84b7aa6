"""The Keras front door: how a user's Keras model becomes parallel and trains with `fit`.

    parallelize.py  `owt_tf.parallelize(model)`: split, choose, place, build a ParallelModel
    model.py        ParallelModel: Keras' compile / fit / evaluate / predict on the hybrid
    steps.py        what its train, test and predict steps do on one replica
    saving.py       weights, .keras files, export and Keras' weight files at any K
    compiling.py    what compile accepts, the loss's reduction, clipping
    updates.py      one step's updates: trunk through Keras, shards by their own
                    optimizers (KerasShardOptimizer) on their devices
    files.py        optimizer state in .keras files
    callbacks.py    which worker writes Keras callbacks' files in a cluster
    view.py         what summary, get_layer, count_params and TensorBoard see of the head
    data.py         static global batches from arrays and datasets
    named_datasets.py  `owt_tf.fit_dataset(name, ...)`: any owt_tf dataset for `fit`
"""
