"""Experiment drivers, run as `python -m owt_tf.bench` (schemes timed side by side) and
`python -m owt_tf.study` (the paper's Table 1 in miniature). They use the library; nothing
in the library uses them.
"""
