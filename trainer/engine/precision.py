"""Whether this CPU computes fast in the half precision a run asks for, measured before it trains.

Where torch's CPU capability is AVX2 (x86 without AVX-512: AMD before Zen 4, Intel's client CPUs), torch has no
fast bfloat16 matmul kernels. On a 2-core AMD EPYC of that kind a 1024 x 1024 matmul runs at 0.9 GFLOP/s in
bfloat16 against 150 GFLOP/s in float32, and a SmolLM2 SFT step takes 51 s with `--bf16 true` against 2 s without
(benchmarks/NOTES.md, "nineteenth session"). TRL's example commands pass `--bf16`; on such a machine the run was
an order of magnitude slower than in float32, and nothing said why. The probe measures rather than reads the
capability, so CPUs whose half-precision kernels are fast (AVX512-BF16, AMX) get no warning.

So a CPU run in half precision (training: `StageRunner.prepare`; `alignflow eval`; `alignflow chat` with the hf
engine) times one small matmul in that dtype and in float32 (~0.2 s where the half kernels are slow, ~1 ms where
they are fast) and warns, with both rates, when the half one is under half the float32 one. What the run computes
never changes: it runs in the precision it was given.
"""

from __future__ import annotations

import time

import torch

SLOW_RATIO = 0.5  # half-precision matmuls under this fraction of float32's rate are worth a warning
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def matmul_seconds(dtype: torch.dtype, size: int = 256, repeats: int = 3, warmup: int = 1) -> list[float]:
    """Wall seconds of each of `repeats` `size` x `size` matmuls in `dtype`, after `warmup` untimed ones."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        times.append(time.perf_counter() - start)
    return times


def matmul_flops(dtype: torch.dtype, size: int = 256, repeats: int = 3) -> float:
    """FLOP/s of the fastest of `repeats` `size` x `size` matmuls in `dtype` (after one untimed call)."""
    return 2.0 * size**3 / max(min(matmul_seconds(dtype, size, repeats)), 1e-9)


def slow_half_precision(device: torch.device, dtype: torch.dtype, fix: str) -> str | None:
    """A warning when `dtype` (bfloat16 or float16) computes on this CPU at under `SLOW_RATIO` of float32's
    matmul rate, naming both rates and `fix` (the option that trains in float32 instead); None on other devices,
    in float32, or where the half-precision kernels are fast."""
    if device.type != "cpu" or dtype not in _NAMES:
        return None
    half, full = matmul_flops(dtype), matmul_flops(torch.float32)
    if half >= SLOW_RATIO * full:
        return None
    name = _NAMES[dtype]
    return (f"{name} is slow on this CPU: its matmuls run at {half / 1e9:.3g} GFLOP/s against {full / 1e9:.3g} in "
            f"float32 ({full / half:.0f}x; torch's CPU capability is {torch.backends.cpu.get_cpu_capability()}, "
            f"without native {name} kernels), so this run will take many times longer than in float32. Train in "
            f"float32 here ({fix}), or on a CPU with AVX512-BF16 or AMX.")
