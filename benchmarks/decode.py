"""Decode per token step: the trainer's vLLM engine against what this machine's GEMMs and memory allow.

    flock /tmp/alignflow-bench.lock python benchmarks/decode.py --json benchmarks/results/decode.json

GRPO's rollout decodes `--prompts` prompts x `--generations` samples (16 sequences by default:
issue 16's G = 8 setting) for `--new-tokens` tokens, every sample forced to full length. Each
row below runs in its own child process with the training runs' threads and environment; times
are the median of `--repeats` timed passes after a warm-up one (the fastest is shown too; a pass of
the hand-written loops counts the median of its T token steps):

- vllm: the trainer's in-process engine (`trainer.rollout.make_engine("vllm")`, bfloat16, the
  settings GRPO uses), `generate` with an empty stop list. Per token step = (time for T tokens -
  time for 1 token) / (T - 1), so prefill and the call's own overhead cancel.
- hf eager: a decode loop written out on the transformers model (bfloat16, sdpa, DynamicCache,
  greedy): prefill once, then T token steps, each timed.
- hf compiled (`--compile`, ~1 min of compilation): the same loop with a StaticCache and
  `torch.compile` (inductor) of the forward.
- GEMMs: `common.decode_gemm_rate`: every nn.Linear weight of the model, its own tensor, times a
  [sequences x in_features] bfloat16 activation, one after another: a token step's matmuls and
  nothing else (no attention, norms, sampling or scheduling).
- GEMMs prepacked: the same with oneDNN's prepacked weights (`torch.ops.mkldnn._reorder_linear_weight`
  and `_linear_pointwise`, what inductor's weight freezing uses on CPU).
- copy bound: the model's weight bytes over `common.copy_peak` (bytes read + written per second):
  what a token step costs if reading every weight once were all it did.

Columns: ms per token step, the weight bytes per second that implies, its share of the copy
bound's rate, and how many times the GEMM-only pass it takes. The prompts are random token ids
(`--prompt-tokens` each, seeded): with forced lengths the content does not change the work.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import common

ROWS = ("vllm", "hf-eager", "hf-compiled", "gemm", "gemm-prepacked", "copy")


# ----------------------------------------------------------------------------------------------
# Child side: one row each


def _prompts(spec: dict) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(spec["seed"])
    return torch.randint(100, 10_000, (spec["prompts"], spec["prompt_tokens"]), generator=generator).tolist()


def child_vllm(spec: dict, started: float) -> dict:
    from trainer.rollout import SamplingConfig, make_engine

    T = spec["new_tokens"]
    engine = make_engine("vllm", model=None, tokenizer=None, model_path=spec["model_path"],
                         max_model_len=spec["prompt_tokens"] + T + 8, dtype="bfloat16", seed=spec["seed"])
    prompts = _prompts(spec)

    def call(tokens: int) -> None:
        engine.generate(prompts, SamplingConfig(max_new_tokens=tokens, n=spec["generations"], stop_token_ids=[]))

    def seconds(tokens: int) -> float:
        start = common.clock()
        call(tokens)
        return common.clock() - start

    call(T)  # warm-up
    return {"step_s": [(seconds(T) - seconds(1)) / (T - 1) for _ in range(spec["repeats"])]}


def _decode_loop(forward, make_cache, ids, new_tokens: int) -> list[float]:
    """Prefill `ids`, then `new_tokens` greedy token steps; seconds of each step."""
    import torch

    P = ids.shape[1]
    cache = make_cache()
    with torch.no_grad():
        logits = forward(ids, cache, torch.arange(P))
        times = []
        for step in range(new_tokens):
            start = common.clock()
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits = forward(token, cache, torch.tensor([P + step]))
            times.append(common.clock() - start)
    return times


def child_hf(spec: dict, started: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    rows = [p for p in _prompts(spec) for _ in range(spec["generations"])]
    ids, T = torch.tensor(rows), spec["new_tokens"]
    if spec["trainer"] == "hf-compiled":
        compiled = torch.compile(model.forward, dynamic=False)
        length = ids.shape[1] + T + 8

        def forward(x, cache, positions):
            return compiled(input_ids=x, past_key_values=cache, use_cache=True, cache_position=positions).logits

        def make_cache():
            return StaticCache(config=model.config, max_cache_len=length)
    else:
        def forward(x, cache, positions):
            return model(input_ids=x, past_key_values=cache, use_cache=True, cache_position=positions).logits

        def make_cache():
            return DynamicCache(config=model.config)
    compile_start = common.clock()
    _decode_loop(forward, make_cache, ids, T)  # warm-up (and compilation)
    warmup_s = common.clock() - compile_start
    steps = [common.median(_decode_loop(forward, make_cache, ids, T)) for _ in range(spec["repeats"])]
    return {"step_s": steps, "warmup_s": warmup_s}


def child_gemm(spec: dict, started: float) -> dict:
    sequences = spec["prompts"] * spec["generations"]
    rate = common.decode_gemm_rate(spec["model_path"], [sequences], ("bfloat16",), repeats=spec["repeats"],
                                   prepacked=spec["trainer"] == "gemm-prepacked")
    return {"step_s": rate["bfloat16"][str(sequences)]["all"]}


def child_copy(spec: dict, started: float) -> dict:
    return {"copy": common.copy_peak()}


# ----------------------------------------------------------------------------------------------
# Parent side


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    common.add_run_flags(parser, "-", warmup=None, repeats=False, timeout=900)
    parser.add_argument("--model", type=Path, default=common.SMOLLM2, help="A causal LM as an HF folder.")
    parser.add_argument("--prompts", type=int, default=2, help="Prompts per generate call.")
    parser.add_argument("--generations", type=int, default=8, help="Samples per prompt (G).")
    parser.add_argument("--prompt-tokens", type=int, default=92, help="Tokens per prompt (GSM8K chat prompts: ~92).")
    parser.add_argument("--new-tokens", type=int, default=64, help="Tokens decoded per sample.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed passes per row (median and fastest shown).")
    parser.add_argument("--compile", action="store_true", help="Add the torch.compile row (~1 min to compile).")
    args = parser.parse_args(argv)
    if args.child:
        return common.child_main(json.loads(args.child), {
            "vllm": child_vllm, "hf-eager": child_hf, "hf-compiled": child_hf, "gemm": child_gemm,
            "gemm-prepacked": child_gemm, "copy": child_copy})
    if not (args.model / "config.json").exists():
        sys.exit(f"No model at {args.model}; make SmolLM2 with scripts/get_smollm2.sh or pass --model.")
    if args.new_tokens < 2 or args.repeats < 1:
        sys.exit("--new-tokens must be >= 2 and --repeats >= 1.")
    rows = [r for r in ROWS if args.compile or r != "hf-compiled"]
    weight_bytes = 2.0 * common.matmul_parameters(args.model)["matmul_params"]
    spec = dict(model_path=str(args.model), prompts=args.prompts, generations=args.generations,
                prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats, seed=args.seed,
                threads=args.threads)
    load_before, started = os.getloadavg()[0], common.clock()
    work = Path(tempfile.mkdtemp(prefix="alignflow-bench-decode-"))
    try:
        runs = common.run_trainers(__file__, [(row, {"row": row}, {**spec, "trainer": row}) for row in rows], work,
                                   args.threads, args.timeout, vllm=True, show=lambda r: (
            f"copy {r['copy']['peak'] / 1e9:.1f} GB/s" if "copy" in r
            else f"{1e3 * common.median(r['step_s']):.1f} ms per token step ({r['wall_s']:.0f} s wall)"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by_row = {r["row"]: r for r in runs}
    if "copy" not in by_row or "gemm" not in by_row:
        sys.exit("The copy or GEMM probe failed (output above).")
    copy_rate = by_row["copy"]["copy"]["peak"]
    for r in runs:
        if "copy" in r:
            r["step_s"] = [weight_bytes / copy_rate]
        r["ms_per_step"], r["best_ms_per_step"] = 1e3 * common.median(r["step_s"]), 1e3 * min(r["step_s"])
    gemm_ms = by_row["gemm"]["ms_per_step"]
    table = common.format_table(
        ["row", "ms / token step", "fastest ms", "weight GB/s", "% of copy bound", "x GEMMs"],
        [[r["row"], r["ms_per_step"], r["best_ms_per_step"], weight_bytes / r["ms_per_step"] / 1e6,
          100 * (weight_bytes / copy_rate) / (r["ms_per_step"] / 1e3), r["ms_per_step"] / gemm_ms] for r in runs])
    common.print_header("Decode", f"{args.prompts} prompts x {args.generations} samples = "
                        f"{args.prompts * args.generations} sequences, {args.prompt_tokens}-token prompts, "
                        f"{args.new_tokens} forced tokens, bfloat16, {args.threads} threads, {args.repeats} timed "
                        f"passes; weights {weight_bytes / 1e6:.0f} MB, copy {copy_rate / 1e9:.1f} GB/s",
                        started, load_before)
    print(table)
    if args.json:
        common.write_json(args.json, "decode", args, runs, [], weight_bytes=weight_bytes, copy_bytes_per_s=copy_rate)


if __name__ == "__main__":
    main()
