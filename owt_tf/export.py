"""`python -m owt_tf.export --logdir RUN --out BASE`: a run's latest checkpoint as a SavedModel
in `BASE/<version>/` (TF Serving's model base path layout; `--version N`, default one past
the newest; `--embeddings-only`: a face model's embedding alone, without its class layer).

The SavedModel is a single-device graph (FC shards assembled into whole layers) whose
`serving_default` takes `images`, uint8 [N, H, W, C], does the eval preprocessing inside,
and returns `probabilities` [N, classes] and `top5` [N, 5] int64. It loads with plain
`tf.saved_model.load`, without owt_tf, and in TF Serving, TFLite and ONNX. It is written to
a temporary directory under BASE (a name TF Serving ignores) and renamed into place, so a
crash never leaves half a model; an existing version is replaced only with `--overwrite`.
A model whose class layer is cosine (--objective arcface or cosface) also has an
`embeddings` signature: the same `images` to L2-normalised `embeddings` [N, D].
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from owt_tf.cli import OneLineParser, fail
from owt_tf.runtime.startup import start_tensorflow

PROG = "python -m owt_tf.export"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--logdir", required=True, help="the run directory to export")
    parser.add_argument("--out", required=True,
                        help="the model base path: the SavedModel goes to OUT/<version>/")
    parser.add_argument("--version", type=int, default=None,
                        help="the version number (default: one past the newest under --out)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --version")
    parser.add_argument("--embeddings-only", action="store_true",
                        help="a cosine (face) model: export the embedding alone, without the "
                             "class layer (serving_default is then the embeddings signature)")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorFlow's C++ start-up log lines")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    start_tensorflow(args.verbose)  # TensorFlow loads only now, after the flags were found good
    from owt_tf.training.files.checkpoint import NoReadableCheckpoint
    from owt_tf.training.runs import export_run
    from owt_tf.training.files.serving import ExportError, version_path

    try:
        version_path(args.out, args.version, args.overwrite)  # refused before any work
        checkpoint, path = export_run(args.logdir, args.out, args.version, args.overwrite,
                                      args.embeddings_only)
    except (ExportError, NoReadableCheckpoint) as err:
        return fail(PROG, err)
    print(f"exported {checkpoint} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
