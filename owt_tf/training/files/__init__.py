"""What a CLI run writes and reads back: checkpoints (checkpoint.py), the run directory's
lock (rundir.py), the SavedModel export (serving.py) and TensorBoard summaries
(summaries.py). A whole run read back is owt_tf.training.runs."""
