"""What the SFT mesh tests (`test_sft_expert_parallel.py`, `test_sft_tensor_parallel.py`) share: a 2-rank gloo job
per plan, the whole model's weights under transformers' names, and the comparison of a mesh run with the plain
FSDP2 run of the same windows."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp
from loop_support import ROOT


def join_ranks(rank: int, port: int) -> None:
    """This spawned process as rank `rank` of 2 (torchrun's variables), in the project root (plan paths are
    relative to it)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.chdir(ROOT)


def run_two_ranks(rank_main, plan, out: str) -> tuple:
    """`rank_main(rank, plan, port, out)` on 2 processes; what rank 0 saved to `out`."""
    from runtime.ranks import free_port

    mp.spawn(rank_main, args=(plan, free_port(), out), nprocs=2, join=True)
    return torch.load(out)


def full_weights(job) -> dict[str, torch.Tensor]:
    """The whole model under transformers' names (shards gathered: a collective, every rank calls it)."""
    state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in job.model.named_parameters()}
    return job.backend.hf_state_dict(state)


def assert_same_training(mesh_run: tuple, dp_run: tuple, trained: list[str] | None = None) -> None:
    """The mesh run ((losses, start, end) weights) equals the FSDP2 run: the same checkpoint placed two ways (exactly),
    the losses and the trained weights to 1e-5, and the FSDP2 run learned and moved `trained` (default: every
    weight) by more than 1e-4."""
    (mesh_losses, mesh_start, mesh_weights), (dp_losses, dp_start, dp_weights) = mesh_run, dp_run
    assert mesh_weights.keys() == dp_weights.keys() == dp_start.keys()
    for name, w in dp_start.items():
        torch.testing.assert_close(mesh_start[name], w, rtol=0, atol=0, msg=name)
    assert dp_losses[-1] < dp_losses[0]  # it learns
    torch.testing.assert_close(torch.tensor(mesh_losses), torch.tensor(dp_losses), rtol=0, atol=1e-5)
    names = list(dp_weights) if trained is None else trained
    assert names and max((dp_weights[n] - dp_start[n]).abs().max().item() for n in names) > 1e-4  # trained
    for name, w in dp_weights.items():
        torch.testing.assert_close(mesh_weights[name], w, rtol=0, atol=1e-5, msg=name)
