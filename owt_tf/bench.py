"""`python -m owt_tf.bench`: schemes measured side by side (owt_tf.experiments.bench)."""
import sys

from owt_tf.experiments.bench import main

if __name__ == "__main__":
    sys.exit(main())
