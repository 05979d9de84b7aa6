"""`python -m owt_tf.bench`: schemes measured side by side (owt_tf.experiments.bench);
`--input prepared:DIR`: a prepared set's training input against bare decoding of its
originals, `--input insightface:DIR`: an InsightFace set's against bare decoding of the
same JPEG bytes (owt_tf.experiments.input_bench)."""
import sys

from owt_tf.experiments.bench import build_parser, main
from owt_tf.runtime.startup import start_tensorflow

if __name__ == "__main__":
    args = build_parser().parse_args()  # --help and bad flags answer before TensorFlow loads
    start_tensorflow()  # quiet, as train: TensorFlow's C++ start-up lines are dropped
    if (args.input or "").startswith(("prepared:", "insightface:")):
        from owt_tf.experiments import input_bench

        sys.exit(input_bench.main())
    sys.exit(main())
