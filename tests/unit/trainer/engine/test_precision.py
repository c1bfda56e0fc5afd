import math

import pytest
import torch

from trainer.engine import precision


def rates(monkeypatch, **gflops):
    """Fake matmul rates by dtype name (this test runs on CPUs with and without fast bf16 kernels)."""
    monkeypatch.setattr(precision, "matmul_flops", lambda dtype, **_: gflops[str(dtype).split(".")[1]] * 1e9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_slow_half_precision_names_both_rates_the_ratio_and_the_fix(monkeypatch, dtype):
    rates(monkeypatch, bfloat16=0.9, float16=0.9, float32=150.0)
    warning = precision.slow_half_precision(torch.device("cpu"), dtype, "`--bf16 false`")
    name = str(dtype).split(".")[1]
    assert warning.startswith(f"{name} is slow on this CPU")
    assert "0.9 GFLOP/s against 150 in float32 (167x" in warning and "(`--bf16 false`)" in warning
    assert torch.backends.cpu.get_cpu_capability() in warning


def test_fast_half_precision_float32_and_other_devices_get_no_warning(monkeypatch):
    rates(monkeypatch, bfloat16=80.0, float32=150.0)  # over SLOW_RATIO of float32's rate
    assert precision.slow_half_precision(torch.device("cpu"), torch.bfloat16, "x") is None
    rates(monkeypatch, bfloat16=0.9, float32=150.0)
    assert precision.slow_half_precision(torch.device("cpu"), torch.float32, "x") is None
    assert precision.slow_half_precision(torch.device("cuda", 0), torch.bfloat16, "x") is None
    assert precision.slow_half_precision(torch.device("cpu"), torch.bfloat16, "x") is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_flops_measures_a_positive_finite_rate(dtype):
    flops = precision.matmul_flops(dtype, size=64, repeats=2)
    assert math.isfinite(flops) and flops > 1e6  # even reference kernels do a 64 x 64 matmul in well under 0.5 s
