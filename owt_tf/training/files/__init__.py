"""What a CLI run writes and reads back: checkpoints (checkpoint.py), the run directory's
lock (rundir.py), a run directory read back (runs.py), the SavedModel export (serving.py)
and TensorBoard summaries (summaries.py)."""
