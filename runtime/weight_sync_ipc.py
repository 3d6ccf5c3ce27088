"""The CUDA IPC transport of the weight sync (`runtime.weight_sync.Transport`): sender and receivers on one GPU."""

from __future__ import annotations

import torch


def broadcast_from_rank0(group, tensor: torch.Tensor):
    """`tensor` from group rank 0 to every member of the process group (asynchronous: a work handle)."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


class _Done:
    """A finished work handle (the IPC channel's steps are synchronous)."""

    def wait(self) -> None:
        pass


class IpcChannel:
    """Buckets through CUDA IPC when the sender and every receiver are on one GPU (NCCL refuses a group whose
    members share a device). The sender owns two bucket slots in GPU memory and exports their IPC handles once;
    per bucket it fills slot `k % 2` and says so over gloo (one 8-byte broadcast); a receiver loads straight out of
    the mapped slot and acknowledges bucket k-1 once bucket k is announced, so slot reuse waits for every
    receiver and filling the next bucket overlaps loading this one. Both sides issue the same sequence of gloo
    collectives: ready(0), ready(1), ack(0), ready(2), ack(1), ..., ack(n-1)."""

    def __init__(self, group) -> None:
        self.group = group
        self.slots: list[torch.Tensor] = []
        self.bucket = 0          # index of the next bucket in this sync
        self.acked = 0           # buckets acknowledged so far in this sync
        self.unacked = False     # receiver: the previous bucket's ack is owed

    # ---- shared
    def _ack(self) -> None:
        from torch.distributed import AllreduceOptions

        self.group.allreduce([torch.zeros(1)], AllreduceOptions()).wait()
        self.acked += 1

    def _share_slots(self, capacity: int, device: torch.device) -> None:
        """Sender: allocate the two slots and broadcast their handles; receiver: map them (first sync only)."""
        import pickle

        from torch.multiprocessing.reductions import reduce_tensor

        for _ in range(2):
            if self.group.rank() == 0:
                slot = torch.empty(capacity, dtype=torch.uint8, device=device)
                blob = torch.frombuffer(bytearray(pickle.dumps(reduce_tensor(slot))), dtype=torch.uint8)
                self.slots.append(slot)
                size = torch.tensor([blob.numel()], dtype=torch.int64)
            else:
                size = torch.zeros(1, dtype=torch.int64)
            broadcast_from_rank0(self.group, size).wait()
            if self.group.rank() != 0:
                blob = torch.empty(int(size.item()), dtype=torch.uint8)
            broadcast_from_rank0(self.group, blob).wait()
            if self.group.rank() != 0:
                rebuild, args = pickle.loads(blob.numpy().tobytes())
                self.slots.append(rebuild(*args))

    def start(self, capacity: int, device: torch.device) -> None:
        if not self.slots:
            self._share_slots(capacity, device)
        self.bucket = self.acked = 0
        self.unacked = False

    def finish(self) -> None:
        if self.group.rank() == 0:
            self._finish_send()
        else:
            self._finish_receive()

    # ---- sender
    def buffer(self, size: int, device: torch.device, bucket_bytes: int) -> torch.Tensor:
        """The slot for the next bucket, once every receiver is done with the bucket it held before."""
        if self.bucket >= 2:
            self._ack()
        return self.slots[self.bucket % 2]

    def publish(self, buf: torch.Tensor, base: torch.Tensor) -> _Done:
        torch.cuda.current_stream(buf.device).synchronize()  # the bucket is in memory before anyone reads it
        broadcast_from_rank0(self.group, torch.tensor([self.bucket], dtype=torch.int64)).wait()
        self.bucket += 1
        return _Done()

    def _finish_send(self) -> None:
        while self.acked < self.bucket:
            self._ack()

    # ---- receiver
    def post(self, size: int, device: torch.device, bucket_bytes: int) -> int:
        return size  # nothing to post: the sender's announcement is the receive

    def collect(self, size: int) -> torch.Tensor:
        """Wait for the next bucket's announcement; the slot it is in (a view of the sender's memory)."""
        seq = torch.zeros(1, dtype=torch.int64)
        broadcast_from_rank0(self.group, seq).wait()
        if int(seq.item()) != self.bucket:
            raise RuntimeError(f"weight sync: bucket {int(seq.item())} announced, {self.bucket} expected")
        if self.unacked:  # the previous bucket's loads were issued before this collect: let them finish
            torch.cuda.current_stream().synchronize()
            self._ack()
        self.unacked = True
        slot = self.slots[self.bucket % 2]
        self.bucket += 1
        return slot[:size]

    def release(self, size: int) -> None:
        pass  # the slot is the sender's: acknowledged when the next bucket is announced, or at `finish`

    def _finish_receive(self) -> None:
        torch.cuda.synchronize()  # copies out of the slot are done before the sender may overwrite it
        if self.unacked:
            self._ack()
            self.unacked = False
