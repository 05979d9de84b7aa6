"""`python -m owt_tf.study`: the paper's Table 1 in miniature (owt_tf.experiments.study)."""
import sys

from owt_tf.experiments.study import build_parser, main
from owt_tf.runtime.startup import start_tensorflow

if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad flags answer before TensorFlow loads
    start_tensorflow()  # quiet, as train: TensorFlow's C++ start-up lines are dropped
    sys.exit(main())
