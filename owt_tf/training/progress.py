"""The run's terminal view: Keras' Progbar and the loop's log lines, one below the other."""
from __future__ import annotations

import sys
from typing import Callable

import keras


class ProgressLines:
    """Keras' Progbar and the run's log lines on one terminal. The live bar redraws its line
    with a carriage return and no newline until the last step, so a log line written
    meanwhile would be glued to it: it starts a new line first."""

    def __init__(self, steps: int, verbose: int, log: Callable[[str], None]):
        self.bar = keras.utils.Progbar(steps, stateful_metrics=["loss", "error", "img/s"],
                                       verbose=verbose)
        self._log = log
        self._line_open = False

    def update(self, step: int, values) -> None:
        self.bar.update(step, values)
        self._line_open = bool(self.bar.verbose) and step < self.bar.target

    def log(self, text: str) -> None:
        if self._line_open:
            sys.stdout.write("\n")
            self._line_open = False
        self._log(text)
