"""Masked statistics over tensors, and the `stats` type every loss returns (TRL's metric name -> detached tensor)."""

from __future__ import annotations

import torch
from torch import Tensor

Stats = dict[str, Tensor]


# Added to the std before dividing, as TRL does: a group whose rewards are all equal gets
# advantage 0/(0 + 1e-4) = 0 instead of 0/0.
STD_EPS = 1e-4


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1), over all elements or along ``dim``.

    The clamp makes an empty mask give 0 rather than NaN (TRL clamps the same way in its GRPO
    losses; its logging helper does not).
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Variance of the masked entries with Bessel's correction (as `masked_whiten` and TRL's `masked_var`)."""
    mask = mask.to(x.dtype)
    count = mask.sum()
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask) * count / (count - 1).clamp(min=1.0)


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """(n, Σx, Σx²) over the masked entries, float64 [3]: summed over ranks, they give `masked_whiten`
    the mean and variance of the whole batch."""
    mask = mask.to(torch.float64)
    x = x.to(torch.float64) * mask
    return torch.stack([mask.sum(), x.sum(), (x * x).sum()])


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, moments: Tensor | None = None) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries; var with Bessel's correction.

    TRL's `masked_whiten`, used on PPO advantages. With ``shift_mean=False`` the mean is added back
    (TRL's option for whitening rewards). Masked-out entries are set to 0. ``moments`` (from
    `masked_moments`, summed over ranks) take mean = Σx/n and var = (Σx² − n·mean²)/(n − 1) from
    the whole batch instead of this tensor.
    """
    mask = mask.to(x.dtype)
    if moments is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        n, total, squares = moments.to(device=x.device, dtype=torch.float64)
        mean64 = total / n.clamp(min=1.0)
        var64 = ((squares - n * mean64 * mean64) / (n - 1).clamp(min=1.0)).clamp(min=0.0)
        mean, var = mean64.to(x.dtype), var64.to(x.dtype)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction; NaN where fewer than 2 values.

    Same definition as `trl.trainer.utils.nanstd` (torch has no nanstd).
    """
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim).to(x.dtype)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim)
    var = torch.where(count > 1, var * count / (count - 1).clamp(min=1.0), torch.nan)
    return var.sqrt()
