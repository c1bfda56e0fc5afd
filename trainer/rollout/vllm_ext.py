"""Code that runs *inside* a vLLM server's worker process: the weight-sync endpoint of the sidecar.

`VLLMServerEngine` starts the server with `--worker-extension-cls
trainer.rollout.vllm_ext.WeightSyncExtension`; vLLM then adds these methods to its worker class,
and the dev-mode `POST /collective_rpc` endpoint calls them by name with JSON arguments.

This module does not import vllm (STYLE rule 5 keeps that to trainer/rollout/vllm_engine.py):
it only uses the worker's own `reload_weights`, which exists on every vLLM worker (GPU and CPU).
It must stay importable by a freshly spawned worker, so it imports nothing heavy at top level.
"""

from __future__ import annotations


class WeightSyncExtension:
    """Mixed into vLLM's Worker. Method names carry a prefix so they never clash with vLLM's own."""

    def alignflow_load_weights_file(self, path: str) -> int:
        """Load HF-named tensors from a safetensors file into the running model; returns their count.

        `reload_weights` maps HF names onto vLLM's fused layers (qkv_proj, gate_up_proj) and reruns
        the post-load processing (e.g. CPU weight packing); a direct `model.load_weights` does not.
        """
        from safetensors import safe_open

        from trainer.rollout.vllm_engine import quiet_benign_reload_warning

        quiet_benign_reload_warning()
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in names))
        return len(names)
