"""The progress bar `selector tune` and `selector.tune_model` draw: tqdm where installed, else a line per step."""

from __future__ import annotations

import sys
from typing import Any


class ProgressBar:
    """A tqdm bar when tqdm is installed, else one stderr line per step (`unit`: what a step is); `line` prints
    beside either."""

    def __init__(self, unit: str = "cell") -> None:
        self.bar: Any = None
        self.unit = unit

    def __call__(self, what: str, done: int, total: int) -> None:
        if self.bar is None:
            try:
                from tqdm import tqdm
            except ImportError:
                self.bar = False
            else:
                self.bar = tqdm(total=total, unit=self.unit, file=sys.stderr)
        if self.bar is False:
            print(f"[{done}/{total}] {what}", file=sys.stderr, flush=True)
        else:
            self.bar.set_description(what)
            self.bar.update(1)

    def line(self, text: str) -> None:
        if self.bar:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
