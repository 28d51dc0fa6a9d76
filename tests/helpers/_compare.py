"""Tensor comparison helpers shared by every test.

``assert_close`` compares in float64 with an elementwise tolerance
``|got - expected| <= atol + rtol * |expected|`` and requires non-finite values
(NaN, +inf, -inf) to match exactly in position and kind. ``assert_equal``
requires bitwise equality (use it for token ids). Both raise AssertionError with
a diagnostic message and never print. ``assert_close_per_call`` runs ``assert_close``
on each call of two sequences (as the per-call logits of two generates).
"""

from __future__ import annotations

import torch

__all__ = ["assert_close", "assert_close_per_call", "assert_equal"]


def _index(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    """Convert a flat index into a multi-index for ``shape``."""
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    """The multi-index of the first True element of ``mask``."""
    return _index(int(mask.flatten().nonzero()[0]), mask.shape)


def _largest_difference(
    expected: torch.Tensor, got: torch.Tensor, diff: torch.Tensor, finite_expected: torch.Tensor
) -> tuple[str, float, float]:
    """Describe the largest ``diff`` (``|got - expected|``, 0 where not finite): where it is and both values there;
    with the relative RMS error ``||got-expected||/||expected||`` and ``||expected||`` (its finite elements)."""
    flat = int(diff.flatten().argmax())
    where = _index(flat, expected.shape)
    ref_norm = float(torch.linalg.vector_norm(finite_expected))
    err_norm = float(torch.linalg.vector_norm(diff))
    rel_rms = err_norm / ref_norm if ref_norm > 0 else float("inf")
    largest = (
        f"max abs diff {diff.flatten()[flat].item():.6g} at index {where}: "
        f"expected {expected[where].item()!r}, got {got[where].item()!r}"
    )
    return largest, rel_rms, ref_norm


def _check_shapes(name: str, expected: torch.Tensor, got: torch.Tensor) -> None:
    if not isinstance(expected, torch.Tensor) or not isinstance(got, torch.Tensor):
        raise AssertionError(
            f"{name}: expected two tensors, got {type(expected).__name__} (expected) and {type(got).__name__} (got)"
        )
    if expected.shape != got.shape:
        raise AssertionError(
            f"{name}: shape mismatch: expected {tuple(expected.shape)}, got {tuple(got.shape)} "
            f"(dtypes expected={expected.dtype}, got={got.dtype})"
        )


def assert_close(
    name: str,
    expected: torch.Tensor,
    got: torch.Tensor,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Raise AssertionError unless ``got`` matches ``expected`` elementwise.

    Both tensors are detached, moved to CPU and cast to float64 (complex128 for
    complex inputs). Fails when shapes differ, when NaN/inf appear in one tensor
    where the other does not have the same value, or when any finite element has
    ``|got - expected| > atol + rtol * |expected|``.
    """
    _check_shapes(name, expected, got)
    dtypes = f"dtypes expected={expected.dtype}, got={got.dtype}"
    wide = torch.complex128 if (expected.is_complex() or got.is_complex()) else torch.float64
    e = expected.detach().to("cpu", wide)
    g = got.detach().to("cpu", wide)
    if e.numel() == 0:
        return

    # Non-finite values must coincide exactly (NaN with NaN, +inf with +inf, ...).
    e_nan, g_nan = torch.isnan(e), torch.isnan(g)
    e_inf, g_inf = torch.isinf(e), torch.isinf(g)
    nonfinite_mismatch = (e_nan != g_nan) | (e_inf != g_inf) | (e_inf & g_inf & (e != g))
    if bool(nonfinite_mismatch.any()):
        count = int(nonfinite_mismatch.sum())
        first = _first(nonfinite_mismatch)
        raise AssertionError(
            f"{name}: non-finite mismatch at {count}/{e.numel()} elements; first at index {first}: "
            f"expected {e[first].item()!r}, got {g[first].item()!r} "
            f"(expected has {int(e_nan.sum())} NaN / {int(e_inf.sum())} inf, "
            f"got has {int(g_nan.sum())} NaN / {int(g_inf.sum())} inf; {dtypes})"
        )

    finite = torch.isfinite(e)  # equal to isfinite(g) here
    zero = torch.zeros((), dtype=wide)
    e_f = torch.where(finite, e, zero)
    g_f = torch.where(finite, g, zero)
    diff = (g_f - e_f).abs()
    allowed = atol + rtol * e_f.abs()
    bad = diff > allowed
    if not bool(bad.any()):
        return

    largest, rel_rms, ref_norm = _largest_difference(e, g, diff, e_f)
    raise AssertionError(
        f"{name}: {int(bad.sum())}/{e.numel()} elements exceed |got-expected| <= atol + rtol*|expected| "
        f"(rtol={rtol:g}, atol={atol:g}; {dtypes}, shape {tuple(e.shape)})\n  {largest}\n"
        f"  relative RMS error ||got-expected||/||expected|| = {rel_rms:.6g} "
        f"(||expected|| = {ref_norm:.6g}); first violation at index {_first(bad)}"
    )


def assert_close_per_call(name: str, expected, got, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``assert_close`` on each pair of ``zip(expected, got)`` (the per-call logits of two generates, say), the i-th
    named ``f"{name} of call {i}"``; ``zip`` stops at the shorter."""
    for i, (e, g) in enumerate(zip(expected, got)):
        assert_close(f"{name} of call {i}", e, g, rtol=rtol, atol=atol)


def assert_equal(name: str, expected: torch.Tensor, got: torch.Tensor) -> None:
    """Raise AssertionError unless ``got`` and ``expected`` are bitwise identical.

    Shapes and dtypes must match; floating values are compared by their bit
    patterns, so NaN equals the same NaN and 0.0 differs from -0.0.
    """
    _check_shapes(name, expected, got)
    if expected.dtype != got.dtype:
        raise AssertionError(
            f"{name}: dtype mismatch: expected {expected.dtype}, got {got.dtype} (shape {tuple(expected.shape)})"
        )
    e = expected.detach().to("cpu").contiguous()
    g = got.detach().to("cpu").contiguous()
    if e.numel() == 0:
        return
    if e.is_floating_point() or e.is_complex():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[e.element_size()]
        if e.is_complex():
            e_bits, g_bits = torch.view_as_real(e).view(bits), torch.view_as_real(g).view(bits)
        else:
            e_bits, g_bits = e.view(bits), g.view(bits)
        differs = e_bits != g_bits
        if e.is_complex():
            differs = differs.any(dim=-1)
    else:
        differs = e != g
    if not bool(differs.any()):
        return

    where = _first(differs)
    message = (
        f"{name}: {int(differs.sum())}/{e.numel()} elements differ (bitwise; dtype {e.dtype}, "
        f"shape {tuple(e.shape)})\n"
        f"  first difference at index {where}: expected {e[where].item()!r}, got {g[where].item()!r}"
    )
    if e.dtype != torch.bool:
        wide = torch.complex128 if e.is_complex() else torch.float64
        e64, g64 = e.to(wide), g.to(wide)
        finite = torch.isfinite(e64) & torch.isfinite(g64)
        diff = torch.where(finite, (g64 - e64).abs(), torch.zeros((), dtype=torch.float64))
        largest, rel_rms, _ = _largest_difference(e, g, diff, torch.where(finite, e64, torch.zeros((), dtype=wide)))
        message += f"\n  {largest}; relative RMS error {rel_rms:.6g}"
    raise AssertionError(message)
