"""Code that runs *inside* a vLLM server's worker process: the weight-sync endpoint of the sidecar.

`alignflow rollout-server` (server.py) starts vLLM with `--worker-extension-cls
trainer.rollout.vllm_ext.WeightSyncExtension`; vLLM then adds these methods to its worker class,
and the server's `/weights/commit` and `/weights/group/*` routes call them by name through the engine
client's `collective_rpc` (no dev mode). The group methods keep the worker's weight group (weight_group.py)
on the worker between calls.

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

    # -- the process-group channel (weight_group.py) -----------------------------------------------

    def alignflow_group_init(self, port: int, group_id: str, peer: str, timeout_s: float) -> int:
        """Join weight group `group_id` with the trainer at `peer`, dropping any earlier group (a restarted or
        resumed trainer forms a new one). Worker 0 serves the groups' store at `port` from the first group on
        (the other workers, on the same node, connect to it). Returns the group's size. Blocks until the trainer
        has joined, or raises after `timeout_s`."""
        import torch

        from trainer.rollout.weight_group import WeightGroup, open_store

        self.alignflow_group_close()
        store_port, store = getattr(self, "_alignflow_store", (None, None))
        if store_port != port:
            store = open_store("127.0.0.1", port, serve=self.rank == 0, timeout_s=timeout_s)
            self._alignflow_store = (port, store)
        workers = self.vllm_config.parallel_config.world_size
        cuda = self.device is not None and self.device.type == "cuda"
        self._alignflow_group = WeightGroup(
            store, group_id=group_id, rank=self.rank, world_size=workers + 1, timeout_s=timeout_s,
            backend="nccl" if cuda else "gloo", peer=peer, device=self.device or torch.device("cpu"))
        return workers + 1

    def alignflow_group_receive(self) -> dict:
        """Load one update that the trainer broadcasts over the weight group, in one reload (as above), each tensor
        received as the reload asks for the next. Returns the count, bytes and names received. If the reload
        fails, the rest of the stream is still received (so the trainer is not left blocked), then the error is
        raised and the group dropped."""
        from trainer.rollout.vllm_engine import quiet_benign_reload_warning

        group = getattr(self, "_alignflow_group", None)
        if group is None:
            raise RuntimeError("no weight group: POST /weights/group/init first")
        quiet_benign_reload_warning()
        names: list[str] = []
        size = 0

        def tensors():
            nonlocal size
            for name, tensor in stream:
                names.append(name)
                size += tensor.numel() * tensor.element_size()
                yield name, tensor

        stream = group.receive()
        try:
            self.reload_weights(weights_iterator=tensors())
            for _ in stream:  # a reload that stopped early: keep the stream in step with the trainer
                pass
        except BaseException:
            try:
                for _ in stream:
                    pass
            finally:
                self.alignflow_group_close()
            raise
        return {"tensors": len(names), "bytes": size, "names": names}

    def alignflow_group_close(self) -> None:
        group, self._alignflow_group = getattr(self, "_alignflow_group", None), None
        if group is not None:
            group.close()
