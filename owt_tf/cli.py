"""What the `python -m owt_tf.X` entry points share: an argparse parser whose errors are one
line and exit code 2, the list-of-K flag type, and train's flags generated from the field
declarations of `RunConfig`'s sections, one argument group per section (train parses them,
launch checks its workers' flags with them).

Pure Python (no TensorFlow import), so that every entry point rejects a bad flag before
TensorFlow loads.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from typing import Callable, Dict, List, Optional

from owt_tf.config import PRESETS, ConfigError, RunConfig, flag_fields

TRAIN_DESCRIPTION = """`python -m owt_tf.train`: train a CNN with the hybrid scheme. No flags: the demo run.

Every flag is a field of one section of owt_tf.config.RunConfig (the groups below). Bad
flags fail in one line, exit code 2, before anything is built.
"""
class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are a single line and exit code 2, and an unknown flag close to
    a known one is answered with "did you mean"."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def _suggestion(self, message: str) -> str:
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        known = [s for action in self._actions for s in action.option_strings]
        for flag in message[len(prefix):].split():
            close = difflib.get_close_matches(flag.split("=")[0], known, n=1, cutoff=0.75)
            if flag.startswith("--") and close:
                return f" (did you mean {close[0]}?)"
        return ""


def fail(prog: str, message: object) -> int:
    """Prints `PROG: error: MESSAGE` to stderr; returns exit code 2 (bad flags or input)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def device_counts(text: str) -> List[int]:
    """argparse type for a list of K values, e.g. "1,2,4,8" (the plan and study tools)."""
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"device counts must be >= 1, got {text!r}")
    return ks


def build_train_parser(description: str = TRAIN_DESCRIPTION) -> argparse.ArgumentParser:
    """`python -m owt_tf.train`'s parser: one flag per field of RunConfig's sections, in
    one argument group per section, plus --preset."""
    parser = OneLineParser(prog="python -m owt_tf.train", description=description,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = RunConfig()
    groups: Dict[str, argparse._ArgumentGroup] = {}
    for section, field in flag_fields():
        if section not in groups:
            title, _, about = (type(getattr(defaults, section)).__doc__ or section).partition(": ")
            groups[section] = parser.add_argument_group(title, about.strip() or None)
        _add_flag(groups[section], field, getattr(getattr(defaults, section), field.name))
    parser.add_argument("--preset", choices=tuple(PRESETS), default="demo",
                        help="a named recipe; flags given with it override its values")
    return parser


def _add_flag(group, field: dataclasses.Field, default: object) -> None:
    """One field's flag, from its declaration (owt_tf.config._flag)."""
    meta = field.metadata
    flag = "--" + (meta["name"] or field.name).replace("_", "-")
    if isinstance(default, bool):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                           help=meta["help"])
        return
    if meta["parse"]:
        kind = _flag_type(meta["parse"])
        default = meta["show"] if meta["show"] is not None else default  # parsed by argparse
    else:
        kind = meta["kind"] or (type(default) if default is not None else str)
    group.add_argument(flag, type=kind, default=default, help=meta["help"],
                       choices=meta["choices"])


def _flag_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type from a config parser: its ConfigError becomes argparse's one line
    `argument --FLAG: MESSAGE`."""
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(err.message) from None

    convert.__name__ = parse.__name__
    return convert


def parse_config(argv: Optional[List[str]] = None) -> RunConfig:
    """Train's flags over the preset's values over RunConfig's defaults, the cluster
    resolved (not yet validated). Raises ConfigError for a cluster that cannot be resolved."""
    parser = build_train_parser()
    preset = parser.parse_args(argv).preset
    parser.set_defaults(**PRESETS[preset]().to_flags())
    args = vars(parser.parse_args(argv))
    args.pop("preset")
    return RunConfig.from_flags(**args)
