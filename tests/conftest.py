"""Settings every test runs under (set before attnlab is imported by any test module)."""

import os

# backend="auto" must not depend on a per-machine cache of measured thresholds
# (attnlab.functional.thresholds): the suite always sees the built-in defaults, and subprocesses
# started by tests inherit the setting. tests/test_thresholds.py turns the cache on where it is
# the subject.
os.environ["ATTNLAB_THRESHOLDS"] = "off"
