"""sdpa's finite-input route (`functional.sdpa._finite`): no copy, no poison pass.

A call without gradient, bias, float mask or dropout whose q, k and v hold no NaN/±inf runs
torch's kernel on the inputs with the bool mask: that is the rule's answer only because torch's
CPU kernels return zeros for a row that may attend nothing when its q is finite — pinned here
for the installed torch. With a non-finite entry anywhere the call takes the cleaning path (a
NaN in a masked key never reaches a row).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab import _ext, masks
from attnlab.functional import sdpa
from helpers import check_against_reference, reference_for, seeded


@pytest.fixture(scope="module")
def ext() -> None:
    if _ext.mode() == "off" or not _ext.load("flash_rule"):
        pytest.skip(f"C++ extension unavailable: {_ext.status('flash_rule')}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("Dv", [16, 24])  # D == Dv: torch's flash kernel; else its math path
def test_torch_gives_zeros_for_rows_with_no_key(dtype, Dv) -> None:
    """The torch behaviour the route relies on: a fully masked row of a bool mask is zeros."""
    q, k = seeded(2, 4, 5, 16, dtype=dtype, seed=1), seeded(2, 2, 7, 16, dtype=dtype, seed=2)
    v = seeded(2, 2, 7, Dv, dtype=dtype, seed=3)
    keep = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    keep[0, :, 1] = False  # one row of item 0
    keep[1] = False  # every row of item 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    assert not out[0, :, 1].any() and not out[1].any()
    assert torch.isfinite(out).all()


def _spy(monkeypatch) -> list[bool]:
    taken: list[bool] = []
    real = sdpa._finite

    def spy(req, is_causal):
        out = real(req, is_causal)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(sdpa, "_finite", spy)
    return taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_finite_inputs_take_the_route_and_equal_the_reference(ext, monkeypatch, dtype) -> None:
    """transformers' prefill mask (causal & a left-padding key mask, an item with no key) on
    finite inputs runs without copies and equals the float64 reference by the tolerance rule."""
    taken = _spy(monkeypatch)
    B, L = 3, 37
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, :20] = False
    keep[2] = False
    mask = masks.causal() & masks.from_tensor(keep[:, None, None, :])
    q, k, v = (seeded(B, h, L, 24, dtype=dtype, seed=s) for h, s in ((4, 1), (2, 2), (2, 3)))

    def run(q, k, v):
        with torch.no_grad():
            return attnlab.attention(q, k, v, mask=mask, backend="sdpa")

    check_against_reference(run, reference_for(mask), [q, k, v], grads=False)
    assert taken and all(taken)
    assert not run(q, k, v)[2].any()  # no key: zeros


def test_a_non_finite_entry_takes_the_cleaning_path(ext, monkeypatch) -> None:
    """A NaN in a masked key (left padding) must not reach any row: the route is not taken and
    the output equals the call on clean inputs; a NaN in an attended value poisons its column."""
    taken = _spy(monkeypatch)
    B, L = 2, 20
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, :8] = False
    mask = masks.causal() & masks.from_tensor(keep[:, None, None, :])
    q, k, v = (seeded(B, 2, L, 8, seed=s) for s in (1, 2, 3))
    with torch.no_grad():
        clean = attnlab.attention(q, k, v, mask=mask, backend="sdpa")
        k[1, :, 3] = v[1, :, 3] = float("nan")  # masked for every row of item 1
        out = attnlab.attention(q, k, v, mask=mask, backend="sdpa")
        assert taken == [True, False]
        assert torch.equal(out, clean)
        v[0, 0, 5, 2] = float("nan")  # attended by rows >= 5 of item 0, head 0
        out = attnlab.attention(q, k, v, mask=mask, backend="sdpa")
    want = torch.zeros_like(out, dtype=torch.bool)
    want[0, 0, 5:, 2] = True
    assert torch.equal(out.isnan(), want)
