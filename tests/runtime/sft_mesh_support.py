"""What the SFT mesh tests (`test_sft_expert_parallel.py`, `test_sft_tensor_parallel.py`) share: a gloo job of the
plan's world per plan, the whole model's weights under transformers' names, and the comparison of a mesh run with
the plain FSDP2 run of the same windows."""

from __future__ import annotations

import os
import time

import torch
import torch.multiprocessing as mp
from loop_support import ROOT

TIMEOUT_S = 300
"""A job that has not finished by then hangs (a collective some rank never joins): its ranks are killed."""
PRELOAD = ["runtime.sft", "runtime.models.automodel", "nemo_automodel.components.distributed.parallelizer",
           "nemo_automodel.components.moe.parallelizer", "transformers.models.qwen3.modeling_qwen3"]
"""What every rank imports, imported once by the forkserver the ranks fork from: spawned, each of 8 ranks would
import them itself (seconds of CPU each, on 2 cores)."""


def join_ranks(rank: int, port: int, world: int) -> None:
    """This spawned process as rank `rank` of `world` (torchrun's variables), in the project root (plan paths are
    relative to it)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.chdir(ROOT)


def run_ranks(rank_main, plan, out: str) -> tuple:
    """`rank_main(rank, plan, port, out)` on the plan's SFT world of processes (killed after `TIMEOUT_S`); what
    rank 0 saved to `out`."""
    import multiprocessing

    from runtime.ranks import free_port

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # before the server's first start
    ranks = mp.start_processes(rank_main, args=(plan, free_port(), out), nprocs=plan.sft.trainer.world, join=False,
                               start_method="forkserver")
    deadline = time.monotonic() + TIMEOUT_S
    while not ranks.join(timeout=max(deadline - time.monotonic(), 0.0)):  # raises when a rank failed
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            raise TimeoutError(f"the {len(ranks.processes)}-rank job ran past {TIMEOUT_S} s")
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
