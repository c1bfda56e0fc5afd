"""What every case of `parity.py` measures and how it reports it: relative diffs, gradient norms, TRL's side of a
step, the metrics both sides log, batch checks, a result row, TRL's config for one CPU step, the perturbed policy and
the demo rows. Imported by parity.py, parity_grpo.py and parity_ppo.py."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any

import common

DEMO = common.REPO / "trainer" / "demo_data"


def rel_diff(ours: float, theirs: float) -> float:
    """|ours − theirs| / max(|theirs|, 1e-12)."""
    return abs(ours - theirs) / max(abs(theirs), 1e-12)


def grad_norm(model) -> float:
    """Total L2 norm of every parameter's gradient (parameters without one count as zero)."""
    import torch

    norms = [p.grad.detach().double().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


@contextlib.contextmanager
def captured_outputs(model):
    """Record the outputs of every forward of `model` (TRL's per-token log-probs live in them)."""
    outputs: list[Any] = []
    handle = model.register_forward_hook(lambda _module, _args, out: outputs.append(out))
    try:
        yield outputs
    finally:
        handle.remove()


def trl_step(trainer) -> tuple[Any, dict[str, Any], Any]:
    """TRL's side of a case: its prepared train_dataset as one batch through its own collator, then
    `compute_loss` and backward on its model in train mode; returns the loss, the inputs and the last forward's
    output (where TRL keeps its per-token log-probs)."""
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    trainer.model.train()
    with captured_outputs(trainer.model) as outputs:
        loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    return loss, inputs, outputs[-1]


def shared_metrics(ours: dict[str, float], theirs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """The metrics logged under the same name by both sides; TRL's `_metrics` hold one value per step."""
    out = {}
    for name in sorted(set(ours) & set(theirs)):
        if name == "num_tokens" or not theirs[name]:
            continue
        value = float(theirs[name][-1])
        out[name] = {"alignflow": float(ours[name]), "trl": value, "rel_diff": rel_diff(float(ours[name]), value)}
    return out


def same_batch(ours, theirs, attention, our_targets, trl_targets) -> tuple[bool, int]:
    """(same token ids where `attention` [B, T] is set, number of positions where the loss targets [B, T] differ)."""
    if ours.shape != theirs.shape or our_targets.shape != trl_targets.shape:
        return False, -1
    return bool((ours == theirs)[attention.bool()].all()), int((our_targets.bool() != trl_targets.bool()).sum())


def target_difference(tokenizer, ids, ours, theirs) -> str:
    """Which tokens only one side trains on, in a line: `only TRL: '\\n' x4`. All tensors [B, T]."""
    parts = []
    for side, mask in (("only alignflow", ours.bool() & ~theirs.bool()), ("only TRL", theirs.bool() & ~ours.bool())):
        if mask.any():
            tokens: dict[str, int] = {}
            for token in ids[mask].tolist():
                text = repr(tokenizer.decode([token]))
                tokens[text] = tokens.get(text, 0) + 1
            parts.append(f"{side}: " + ", ".join(f"{t} x{n}" for t, n in tokens.items()))
    return "loss targets differ (" + "; ".join(parts) + ")"


def row(stage: str, case: str, same: tuple[bool, int], logprob_diff: float | None, loss: tuple[float, float],
        norms: tuple[float, float], metrics: dict[str, dict[str, float]], shapes: tuple[Any, Any],
        note: str = "") -> dict[str, Any]:
    return {"stage": stage, "case": case, "ids_equal": same[0], "targets_differing": same[1],
            "batch_shape": {"alignflow": list(shapes[0]), "trl": list(shapes[1])},
            "logprob_max_abs_diff": logprob_diff,
            "loss": {"alignflow": loss[0], "trl": loss[1]}, "loss_rel_diff": rel_diff(*loss),
            "grad_norm": {"alignflow": norms[0], "trl": norms[1]}, "grad_norm_rel_diff": rel_diff(*norms),
            "metrics": metrics, "note": note}


def trl_args(config_class, work: Path, **settings):
    """A TRL config for one float32 CPU step that logs nowhere and saves nothing."""
    settings = {"per_device_train_batch_size": 8, **settings}
    return config_class(output_dir=str(work / "trl"), report_to="none", use_cpu=True, bf16=False, fp16=False,
                        gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                        dataloader_num_workers=0, seed=0, **settings)


def perturbed(model, scale: float = 0.02, seed: int = 1):
    """A copy of `model` with seeded Gaussian noise on every weight: a policy that differs from its reference, so
    DPO's log-ratios, rewards and accuracies are not all zero (at the reference, every loss type is trivial)."""
    import torch

    out = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)
    return out


def read_rows(name: str, count: int) -> list[dict]:
    with open(DEMO / name) as f:
        return [json.loads(line) for line, _ in zip(f, range(count))]


def worst_metric(result: dict[str, Any]) -> str:
    metrics = result.get("metrics") or {}
    if not metrics:
        return "-"
    name = max(metrics, key=lambda k: metrics[k]["rel_diff"])
    return f"{name} {metrics[name]['rel_diff']:.1e}"
