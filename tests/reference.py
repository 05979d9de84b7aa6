"""An independent single-device reference: a plain Keras model, tf.GradientTape, numpy SGD.

It shares with owt_tf only the initial weights (the premise of every comparison) and the
row sets of each round (which examples an FC update sees). Everything else, the
loss, the gradients and the update rule, is written here separately.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import keras
import numpy as np
import tensorflow as tf

from owt_tf.models.spec import ModelSpec


class ReferenceModel:
    def __init__(self, spec: ModelSpec, seed: int, device: str = "/device:CPU:0"):
        self.device = device
        with tf.device(device):
            self.trunk = spec.build_trunk()
            trunk_weights, weights = spec.initial_weights_for(self.trunk, seed)
            self.trunk.set_weights(trunk_weights)
            self.fc = []
            for i, (kernel, bias) in enumerate(weights):
                last = i == len(weights) - 1
                layer = keras.layers.Dense(kernel.shape[1], activation=None if last else "relu")
                layer.build((None, kernel.shape[0]))
                layer.set_weights([kernel, bias])
                self.fc.append(layer)
        self.trunk_vars = list(self.trunk.trainable_variables)
        self.fc_vars = [v for layer in self.fc for v in layer.trainable_variables]
        self.velocity = {id(v): np.zeros(v.shape, np.float32) for v in self.trunk_vars + self.fc_vars}

    def head(self, a):
        for layer in self.fc:
            a = layer(a)
        return a

    def sgd(self, variables, grads, lr, momentum, weight_decay):
        for v, g in zip(variables, grads):
            w = v.numpy()
            vel = momentum * self.velocity[id(v)] - lr * (np.asarray(g) + weight_decay * w)
            self.velocity[id(v)] = vel
            v.assign(w + vel)

    def step(self, x, y, rounds: Sequence[np.ndarray], fc_batch: str, conv_lr, fc_lr,
             momentum, weight_decay) -> Dict[str, object]:
        """One step. `rounds`: row indices of each FC round (one round = all rows).

        fc_batch 'global': FC gradient of the mean loss over all rows, one update.
        fc_batch 'worker': one FC update per round on that round's mean loss, in order.
        The trunk always gets the gradient of the mean loss over all rows (each round's
        activation gradient taken with the FC weights of that round), one update.
        """
        with tf.device(self.device):
            x, y = tf.constant(x), tf.constant(y)
            with tf.GradientTape() as trunk_tape:
                a = self.trunk(x, training=True)
            da = tf.zeros_like(a)
            fc_grads, losses = [], []
            if fc_batch == "global":
                with tf.GradientTape() as tape:
                    tape.watch(a)
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                        labels=y, logits=self.head(a)))
                g = tape.gradient(loss, [a] + self.fc_vars)
                da, fc_grads, losses = g[0], [g[1:]], [loss]
                self.sgd(self.fc_vars, g[1:], fc_lr, momentum, weight_decay)
            else:
                for rows in rounds:
                    with tf.GradientTape() as tape:
                        tape.watch(a)
                        sub = tf.gather(a, rows)
                        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                            labels=tf.gather(y, rows), logits=self.head(sub)))
                    g = tape.gradient(loss, [a] + self.fc_vars)
                    da += tf.convert_to_tensor(g[0]) / len(rounds)
                    fc_grads.append(g[1:])
                    losses.append(loss)
                    self.sgd(self.fc_vars, g[1:], fc_lr, momentum, weight_decay)
            trunk_grads = trunk_tape.gradient(a, self.trunk_vars, output_gradients=da)
            self.sgd(self.trunk_vars, trunk_grads, conv_lr, momentum, weight_decay)
        return {"loss": float(np.mean([l.numpy() for l in losses])),
                "trunk_grads": [g.numpy() for g in trunk_grads],
                "fc_grads": [[g.numpy() for g in gs] for gs in fc_grads]}

    def weights(self) -> Dict[str, List[np.ndarray]]:
        fc = [(layer.kernel.numpy(), layer.bias.numpy()) for layer in self.fc]
        return {"trunk": [v.numpy() for v in self.trunk.weights], "head": fc}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def update_err(got, want, start) -> float:
    """The update `got - start` against the reference's `want - start`, per tensor: the norm
    of their difference over the norm of the reference's update (0 when neither moved)."""
    got, want, start = (np.asarray(t, np.float64) for t in (got, want, start))
    want_update = want - start
    if not np.any(want_update) and not np.any(got - start):
        return 0.0
    return rel_err(got - start, want_update)
