"""Small helpers shared by the library and the ``attnlab`` command (no CLI imports here).

- `progress`: one progress bar (tqdm on stderr when installed, else a plain fallback).
- `text_table`: one aligned plain-text table.
- `Timer`, `time_call`, `best_times`: one way to time work (``time.perf_counter``).
"""

from .progress import Progress, progress
from .table import text_table
from .timing import Timer, best_times, matmul_rate, time_call

__all__ = [
    "Progress",
    "Timer",
    "best_times",
    "matmul_rate",
    "progress",
    "text_table",
    "time_call",
]
