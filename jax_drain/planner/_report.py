"""What the planner's modules share for reporting: progress lines, plots, bucket counts."""

from __future__ import annotations

import sys
import time

from jax_drain.chain import ChainedSync


def mib(num_bytes: float) -> str:
    """``num_bytes`` in MiB, as the planner's tables and progress lines print them."""
    return f"{num_bytes / 2**20:,.1f} MiB"


class Progress:
    """One line per strategy on stderr while the planner compiles::

        planning plan_my_model: 67.6M params (...) on 8x h100 (1x1x8), 5 strategies
          [1/5] gspmd ... 234.5 MiB temp, compiled in 14.2 s
          [2/5] no_comm ... 186.5 MiB temp, compiled in 11.0 s

    A strategy's line starts when its compile starts and ends when it is done. Nothing is written
    before the first compile (or unavailable strategy), so an error in the inputs stays the only
    line. ``enabled=False`` writes nothing. ``header``: the first line instead of "planning
    WHAT, N strategies" (a search, whose count is an upper bound).
    """

    def __init__(self, enabled: bool, total: int, what: str, header: str | None = None):
        self.enabled, self.total, self.what, self.header = enabled, total, what, header
        self._headed = self._open = False
        self._t0 = 0.0

    def _write(self, text: str) -> None:
        if self.enabled:
            if not self._headed:
                self._headed = True
                head = self.header or f"planning {self.what}, {self.total} strateg{'y' if self.total == 1 else 'ies'}"
                text = f"{head}\n{text}"
            sys.stderr.write(text)  # looked up on use: pytest and notebooks replace sys.stderr
            sys.stderr.flush()

    def compiling(self, index: int, name: str) -> None:
        """Starts strategy ``index``'s line (0-based) as its compile starts."""
        self._t0 = time.perf_counter()
        self._write(f"  [{index + 1}/{self.total}] {name} ... ")
        self._open = True

    def compiled(self, temp_bytes: int, detail: str | None = None) -> None:
        """Ends the line with the compiled program's temp bytes (or ``detail``) and the compile's time."""
        self._open = False
        what = detail if detail is not None else f"{mib(temp_bytes)} temp"
        self._write(f"{what}, compiled in {time.perf_counter() - self._t0:.1f} s\n")

    def unavailable(self, index: int, name: str) -> None:
        self._write(f"  [{index + 1}/{self.total}] {name}: not available (see its row)\n")

    def failed(self, why: str = "failed") -> None:
        """Ends an open line: the compile raised."""
        if self._open:
            self._open = False
            self._write(f"{why}\n")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files, no display); says what to install without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("plotting needs matplotlib: pip install 'jax_drain[plot]'") from e
    return plt


def total_buckets(sync: ChainedSync | None) -> int | None:
    """Every bucket ``sync`` reduces, each layer's buckets of a scanned stack counted as their own
    (None without a sync)."""
    return None if sync is None else sum(chain.num_buckets * (chain.num_layers or 1) for chain in sync.chains)
