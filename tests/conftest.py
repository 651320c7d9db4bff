"""Settings every test runs under (set before attnlab is imported by any test module)."""

import os

import pytest

# backend="auto" must not depend on a per-machine cache of measured thresholds
# (attnlab.functional.thresholds): the suite always sees the built-in defaults, and subprocesses
# started by tests inherit the setting. tests/test_thresholds.py turns the cache on where it is
# the subject.
os.environ["ATTNLAB_THRESHOLDS"] = "off"

# The command's tables fit the terminal (attnlab.cli._output: COLUMNS, else the terminal;
# piped output is not wrapped). pytest-xdist's workers set COLUMNS=80, a shell may set anything:
# every test, and the subprocesses it starts, sees piped output instead — one line per table row
# and per message, so tests can read them back. Tests of the width set their own COLUMNS.
os.environ.pop("COLUMNS", None)

# Under pytest-xdist (`-n auto`, the README's test command) the workers share the cores: each
# gets its share of intra-op threads (and so do the subprocesses tests start), instead of every
# worker running one thread per core and the workers preempting each other. Tests of the
# kernels' thread-parallel paths set their thread counts themselves.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    import torch

    _threads = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (they gain nothing from threads; on a
    shared machine threads cost up to 5x wall), restored after it. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters empty before and after a test that compiles (files that
    compile use it for every test: ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class _SettingsMonkeyPatch:
    """pytest's ``monkeypatch`` that reads attnlab's settings again after each change.

    attnlab reads its ``ATTNLAB_*`` variables once per process (`attnlab._settings`) and keeps
    what it derives from them (whether its C++ kernels run, the flash options); a test that
    sets a variable or patches the loader (``_ext._STATE``) wants the next call to see it, so
    every ``setenv``/``delenv``/``setattr``/``delattr`` here ends with
    `attnlab._settings.refresh`. Everything else is pytest's own.
    """

    def __init__(self, inner: pytest.MonkeyPatch) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name not in ("setenv", "delenv", "setattr", "delattr"):
            return attr

        def patched(*args, **kwargs):
            result = attr(*args, **kwargs)
            _refresh_settings()
            return result

        return patched


def _refresh_settings() -> None:
    from attnlab import _settings

    _settings.refresh()


@pytest.fixture
def monkeypatch(monkeypatch):
    """`_SettingsMonkeyPatch` around pytest's; its teardown (after pytest's undo) refreshes."""
    yield _SettingsMonkeyPatch(monkeypatch)
    monkeypatch.undo()
    _refresh_settings()
