"""`python -m owt_tf.bench`: schemes measured side by side (owt_tf.experiments.bench)."""
import sys

from owt_tf.experiments.bench import build_parser, main
from owt_tf.startup import start_tensorflow

if __name__ == "__main__":
    build_parser().parse_args()  # --help and bad flags answer before TensorFlow loads
    start_tensorflow()  # quiet, as train: TensorFlow's C++ start-up lines are dropped
    sys.exit(main())
