"""`python -m owt_tf.study`: the paper's Table 1 in miniature (owt_tf.experiments.study)."""
import sys

from owt_tf.experiments.study import main

if __name__ == "__main__":
    sys.exit(main())
