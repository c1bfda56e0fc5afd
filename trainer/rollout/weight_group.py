"""The process-group weight channel between one trainer rank and `alignflow rollout-server`'s workers (TRL's
`vllm_group_port`): the trainer broadcasts each tensor, the workers receive it as vLLM's reload iterates.

Both sides import this module (the trainer in server_client.py, the workers in vllm_ext.py); it imports
torch only, so a freshly spawned vLLM worker can import it and the trainer needs no vllm.

The group: the server's N workers are ranks 0..N-1, the pushing trainer rank is rank N (the root of every
broadcast). Worker 0 hosts the group's `TCPStore` at `vllm_group_port` on the server's host, so the trainer
only needs to reach the server's host (as in TRL's `vllm_mode: server`). The store outlives its groups: a
restarted or resumed trainer forms a new group under a new id (a key prefix in the store) with the same
workers, which drop their old group. Gloo on the CPU; NCCL when the
workers are on CUDA devices. The NCCL path is written to the same protocol but has never run: this project
tests on CPUs only.

The stream: per tensor, two broadcasts from the trainer, a fixed-size header (JSON: name, dtype, shape,
zero-padded to HEADER_BYTES) then the tensor itself; a `null` header ends the update. The names travel in
the stream, not in the HTTP request, so the trainer can gather its model module by module (ZeRO-3) while it
sends: neither side ever holds a second copy of the whole model.
"""

from __future__ import annotations

import datetime
import json
import socket
from collections.abc import Iterator

import torch

DEFAULT_PORT = 51216  # TRL's `vllm_group_port`
HEADER_BYTES = 1024
STORE_PREFIX = "alignflow-weights"


def local_address(peer: str) -> str:
    """This host's address on the route to `peer`: the interface gloo must listen on for `peer` to reach it
    (a name that resolves to a loopback address would not do across hosts). IPv4 first, as both sides must use the
    same family ("localhost" may resolve to ::1 first). No packet is sent."""
    for family in (socket.AF_INET, socket.AF_UNSPEC):
        try:
            family, kind, _, _, address = socket.getaddrinfo(peer, 9, family=family, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, kind) as probe:
                probe.connect(address)
                return probe.getsockname()[0]
        except OSError:
            continue
    return peer


def open_store(host: str, port: int, *, serve: bool, timeout_s: float):
    """The groups' `TCPStore` at host:port: served (on every interface) by the server's worker 0, which keeps it for
    the life of the server; everyone else connects to it, retrying until `timeout_s`."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=serve, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class WeightGroup:
    """One side's membership of the weight group `group_id` (keys under that prefix in `store`). `rank ==
    world_size - 1` is the trainer, the sender."""

    def __init__(self, store, *, group_id: str, rank: int, world_size: int, timeout_s: float, backend: str,
                 peer: str, device: torch.device | None = None):
        import torch.distributed as dist

        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.root = world_size - 1
        self.device = device or torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore(f"{STORE_PREFIX}/{group_id}", store)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(peer))]
            self.group = dist.ProcessGroupGloo(store, rank, world_size, options)
        elif backend == "nccl":  # untested (no GPU here): same protocol, tensors on this rank's CUDA device
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            raise ValueError(f"weight group backend {backend!r}: choose gloo or nccl")

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, self.root).wait()

    # -- the trainer's side ------------------------------------------------------------------------

    def send(self, name: str, tensor: torch.Tensor) -> int:
        """Broadcast one tensor (already in the server's dtype) with its header; returns its size in bytes."""
        tensor = tensor.to(self.device).contiguous()
        self._broadcast(_header({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                                 "shape": list(tensor.shape)}, self.device))
        self._broadcast(tensor)
        return tensor.numel() * tensor.element_size()

    def end(self) -> None:
        """Tell the workers that the update is complete."""
        self._broadcast(_header(None, self.device))

    # -- a worker's side ---------------------------------------------------------------------------

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of one update, each received when the caller asks for it, until the trainer's end."""
        while True:
            header = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=self.device)
            self._broadcast(header)
            meta = json.loads(header.cpu().numpy().tobytes().rstrip(b"\0"))
            if meta is None:
                return
            tensor = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]), device=self.device)
            self._broadcast(tensor)
            yield meta["name"], tensor

    def close(self) -> None:
        """Leave the group: its connections close; the peers' next broadcast in it fails."""
        group, self.group = getattr(self, "group", None), None
        if group is not None and self.backend == "nccl":  # untested; abort: the peer may be gone mid-collective
            try:
                group.abort()
            except RuntimeError:
                pass


def _header(meta: dict | None, device: torch.device) -> torch.Tensor:
    data = json.dumps(meta).encode()
    if len(data) > HEADER_BYTES:
        raise ValueError(f"a tensor name too long for the weight group's header ({len(data)} > {HEADER_BYTES} "
                         f"bytes): {meta}")
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    header[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return header.to(device)
