"""Code that runs *inside* a vLLM server's worker process: the weight-sync endpoint of the sidecar.

`alignflow rollout-server` (server.py) starts vLLM with `--worker-extension-cls
trainer.rollout.vllm_ext.WeightSyncExtension`; vLLM then adds these methods to its worker class,
and the server's `/weights/commit` route calls them by name through the engine client's
`collective_rpc` (no dev mode).

This module does not import vllm (STYLE rule 5 keeps that to trainer/rollout/vllm_engine.py):
it only uses the worker's own `reload_weights`, which exists on every vLLM worker (GPU and CPU).
It must stay importable by a freshly spawned worker, so it imports nothing heavy at top level.
"""

from __future__ import annotations


class WeightSyncExtension:
    """Mixed into vLLM's Worker. Method names carry a prefix so they never clash with vLLM's own."""

    def alignflow_load_weights_files(self, paths: list[str]) -> int:
        """Load the HF-named tensors of several safetensors files (one update, in chunks) into the running
        model in one reload; returns their count. One reload, because a fused layer must get all of its
        parts in the same call. The files are read tensor by tensor, so the worker never holds a second
        copy of the whole model.

        `reload_weights` maps HF names onto vLLM's fused layers (qkv_proj, gate_up_proj) and reruns
        the post-load processing (e.g. CPU weight packing); a direct `model.load_weights` does not.
        """
        from safetensors import safe_open

        from trainer.rollout.vllm_engine import quiet_benign_reload_warning

        quiet_benign_reload_warning()
        count = 0

        def tensors():
            nonlocal count
            for path in paths:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        count += 1
                        yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors())
        return count
