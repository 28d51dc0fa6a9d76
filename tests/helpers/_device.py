"""The device the suite runs its models on (`pytest --device cuda`; the CPU by default), for tests/conftest.py.

`resolve(name)` turns the option into the device `_models.DEVICE` holds, or refuses it with a `pytest.UsageError`
that names it (a machine without CUDA refuses `--device cuda` before anything is collected). `skip_cpu_only`
skips, with the marker's reason shown, the tests marked `@pytest.mark.cpu_only(reason=...)` when the device is not
the CPU. Everything else follows from `_models.build` and `_models.random_ids` putting what they make on the
device: references stay float64 on the CPU, and `_compare.assert_close` moves both sides there.
"""

from __future__ import annotations

import pytest
import torch

CPU_ONLY = "cpu_only(reason): a test that means something on the CPU only; skipped, with its reason, under --device"


def resolve(name: str) -> torch.device:
    """The device `name` names, as a tensor made there reports it ("cuda" -> cuda:0); a `pytest.UsageError`
    naming it if torch cannot parse it or this machine cannot make a tensor there."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise pytest.UsageError(f"--device {name}: not a device torch knows ({error})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda and f"built for CUDA {torch.version.cuda}" or "built without CUDA"
        raise pytest.UsageError(
            f"--device {name}: this machine has no CUDA device (torch {torch.__version__},"
            f" {built}); run without --device, or with --device cpu, here"
        )
    try:
        return torch.empty(0, device=device).device
    except Exception as error:  # noqa: BLE001 -- whatever the backend raises, the option is what is wrong
        raise pytest.UsageError(
            f"--device {name}: cannot make a tensor there ({type(error).__name__}: {error})"
        ) from None


def skip_cpu_only(items, device: torch.device) -> None:
    """Off the CPU, skip every test marked `cpu_only`, its reason in the skip's (pytest -ra shows it). A mark
    without a reason is refused on every device, so that a CPU run finds it before a GPU run does."""
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is None:
            continue
        reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else None)
        if not reason:
            raise pytest.UsageError(
                f"{item.nodeid} is marked cpu_only without a reason: say why it means nothing"
                " off the CPU (@pytest.mark.cpu_only(reason=...))"
            )
        if device.type != "cpu":
            item.add_marker(pytest.mark.skip(reason=f"CPU only, not run on {device}: {reason}"))
