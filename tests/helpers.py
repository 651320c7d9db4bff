"""Test helpers: the tolerance rule (RELIABILITY.md section c) and seeded inputs.

The rule is implemented once in `attnlab.testing` (so `attnlab check` applies the very same rule)
and used by every numeric test through this module.
"""

from attnlab.testing import (
    FIXED_TABLE,
    HEAD_DIMS,
    ODD_SIZES,
    assert_close_rule,
    check_against_reference,
    mean_factor_for,
    reference_for,
    seeded,
)

__all__ = [
    "FIXED_TABLE",
    "HEAD_DIMS",
    "ODD_SIZES",
    "assert_close_rule",
    "check_against_reference",
    "mean_factor_for",
    "reference_for",
    "seeded",
]
