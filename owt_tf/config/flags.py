"""How a CLI flag is declared and how its text is read: the `flag` field helper, the
parsers of values typed as text, and ConfigError, the one-line error naming the flag.

Pure Python: the CLI rejects a bad flag before TensorFlow loads.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional, Tuple

from owt_tf.planner.plan import PlanError


class ConfigError(ValueError):
    """A bad flag or flag combination. `flag` names the CLI flag at fault."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


def flag(default: Any, help: str, *, choices: Optional[Tuple[str, ...]] = None,
         parse: Optional[Callable[[str], Any]] = None, kind: Optional[type] = None,
         show: Optional[str] = None, name: Optional[str] = None) -> Any:
    """A field that is a CLI flag. `help` and `choices` become its --help line; `parse`
    turns the command line's text into the field's value (and `show` is the default as
    typed); `kind` is the value's type when the default (None) does not tell; `name`
    the flag's name when it is not the field's."""
    metadata = {"help": help, "choices": choices, "parse": parse, "kind": kind, "show": show,
                "name": name}
    return dataclasses.field(default=default, metadata=metadata)


def flag_text(flag_name: str) -> str:
    """--flag-name of a field name."""
    return "--" + flag_name.replace("_", "-")


# -- values given as text on the command line, parsed once -------------------------------
def parse_decay_epochs(text: str) -> Tuple[float, ...]:
    """--lr-decay-epochs "30,60,80" as increasing epochs (30.0, 60.0, 80.0)."""
    try:
        epochs = tuple(float(e) for e in text.split(",") if e.strip())
    except ValueError:
        raise ConfigError("--lr-decay-epochs", f"expected comma-separated epochs, got "
                          f"{text!r}") from None
    check_decay_epochs(epochs)
    return epochs


def check_decay_epochs(epochs: Tuple[float, ...]) -> None:
    if list(epochs) != sorted(epochs) or any(not e > 0 for e in epochs):
        raise ConfigError("--lr-decay-epochs", f"must be increasing and > 0, got "
                          f"{','.join(f'{e:g}' for e in epochs)!r}")


def parse_profile_steps(text: str) -> Tuple[int, int]:
    """--profile-steps "A:B" as (A, B), 1 <= A <= B."""
    try:
        a, b = (int(part) for part in text.split(":"))
    except ValueError:
        raise ConfigError("--profile-steps", f"expected A:B (step numbers), got "
                          f"{text!r}") from None
    check_profile_steps((a, b))
    return a, b


def check_profile_steps(steps: Tuple[int, int]) -> None:
    a, b = steps
    if not 1 <= a <= b:
        raise ConfigError("--profile-steps", f"need 1 <= A <= B, got '{a}:{b}'")


# PlanError's field -> the flag that sets it.
_PLAN_FLAGS = {"devices": "--devices", "batch_size": "--batch-size"}


@contextlib.contextmanager
def as_flag_error() -> Iterator[None]:
    """A PlanError as the ConfigError of the flag it is about."""
    try:
        yield
    except PlanError as err:
        raise ConfigError(_PLAN_FLAGS.get(err.field, flag_text(err.field)), err.message) from None


def check_choice(flag_name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(flag_name, f"unknown value {value!r}; allowed: {', '.join(allowed)}")


def check_positive_int(flag_name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(flag_name, f"must be an integer >= 1, got {value!r}")
