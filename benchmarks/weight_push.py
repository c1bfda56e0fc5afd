"""Weight pushes to `alignflow rollout-server`: through /dev/shm, over a gloo weight group and over HTTP, side by side.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/weight_push.py --model smollm2 --repeats 5 --json weight_push.json

Starts one server on this node (float32, the model's own weights), loads the same model in this process, and
pushes its whole state dict `--repeats` times per channel, alternating the channels: `shared_memory` (each chunk a
safetensors file in this node's /dev/shm that the server moves in: what a job-started server and a pod's sidecar
get), `group` (each tensor broadcast over a torch.distributed gloo group that the server's worker receives straight
into vLLM's reload: what a server on another node gets with `vllm_group_port`) and `http` (each chunk's bytes in
the request body: the fallback). Per push: the trainer's wall seconds (serialising, sending, and the server's load
into vLLM; over the group the load overlaps the sending), the server's seconds (from its answer: the load alone,
or over the group the whole receive-and-load) and the bytes. The table shows medians and MB/s of the whole push;
the last lines the ratios to HTTP. The first group push also forms the group (its seconds are printed apart).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    SMOLLM2,
    clock,
    format_table,
    model_path,
    print_header,
    write_json,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=("tiny", "smollm2"))
    parser.add_argument("--smollm2-dir", type=Path, default=SMOLLM2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/tmp/alignflow-weight-push"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    started, load_before = clock(), os.getloadavg()[0]

    import torch
    from transformers import AutoModelForCausalLM

    from trainer.engine.launch import free_port
    from trainer.rollout import make_engine

    args.work.mkdir(parents=True, exist_ok=True)
    folder = model_path(args.model, args.work, args.smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    runs = []
    channels = ("shared_memory", "group", "http")
    with make_engine("vllm-server", model=model, tokenizer=None, model_path=str(folder), max_model_len=256,
                     server_timeout_s=600, dtype="float32", group_port=free_port(),
                     weight_channel="shared_memory") as engine:
        for repeat in range(args.repeats):
            for channel in channels:
                engine.channel = channel  # each one is available here: /dev/shm is shared, the server offers a group
                engine.sync_weights(model.state_dict().items())
                push = engine.last_push
                assert push["channel"] == channel, push
                runs.append({"repeat": repeat, **push})
                print(f"  {channel}: {push['seconds']:.2f} s, {push['bytes'] / 1e6:.0f} MB", file=sys.stderr)
    rows = []
    medians = {}
    for channel in channels:
        mine = [r for r in runs if r["channel"] == channel]
        seconds = statistics.median(r["seconds"] for r in mine)
        load = statistics.median(r["server_load_seconds"] for r in mine)
        megabytes = mine[0]["bytes"] / 1e6
        medians[channel] = {"seconds": seconds, "server_load_seconds": load, "megabytes": megabytes}
        rows.append([channel, len(mine), megabytes, seconds, load, seconds - load, megabytes / seconds])
    print_header("Weight pushes to the rollout server", f"{args.model}, float32, {args.repeats} pushes per channel, "
                 "medians", started, load_before)
    print(format_table(["channel", "pushes", "MB", "push s", "server s", "push - server s", "MB/s"], rows))
    print()
    for channel in ("shared_memory", "group"):
        print(f"{channel} / http push time: {medians[channel]['seconds'] / medians['http']['seconds']:.2f}")
    first_group = next(r for r in runs if r["channel"] == "group")
    print(f"first group push (forms the group): {first_group['seconds']:.2f} s")
    if args.json:
        write_json(args.json, "weight_push", args, runs, [{"channel": c, **m} for c, m in medians.items()])


if __name__ == "__main__":
    main()
