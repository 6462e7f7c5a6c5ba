"""Phase timing of a step that does not synchronise the GPU.

On CUDA, host clocks only measure kernel launches; the timer records CUDA events between the
phases instead and reads their elapsed times after the step's one wait, when they have all
completed. On CPU it uses time.perf_counter.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Marks phase boundaries; `seconds()` -> per-phase durations (call after the step's wait)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list = []
        self.mark()

    def mark(self) -> None:
        """End the current phase (and start the next) now, in stream order on CUDA."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Durations in seconds between consecutive marks (len = number of marks - 1).

        On CUDA every recorded event must have completed (after the step's output fetch has waited).
        """
        pairs = zip(self._marks, self._marks[1:])
        if self._cuda:
            return [a.elapsed_time(b) / 1000.0 for a, b in pairs]
        return [b - a for a, b in pairs]
