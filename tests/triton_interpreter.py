"""Triton's CPU interpreter for the tests of the FP8 baseline's kernels (``megamoe_cli.baselines.triton_fp8``).

Triton decides when a kernel is decorated whether it is compiled or interpreted, so the variable
is set when this module is imported, before any test imports the kernels; spawned gloo ranks
inherit it.  Without Triton installed (``pip install triton``) the tests that need it skip."""

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"


def kernels():
    """``megamoe_cli.baselines.triton_fp8`` with interpreted kernels, or skip the test."""
    pytest.importorskip("triton")
    from megamoe_cli.baselines import triton_fp8 as baseline_triton

    if not baseline_triton.INTERPRETED:
        pytest.skip("megamoe_cli.baselines.triton_fp8 was imported before TRITON_INTERPRET=1 was set")
    return baseline_triton


def have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
