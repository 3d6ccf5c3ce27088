"""CPU offload (`actor.offload`, runtime/fsdp.py) trains exactly like no offload: fp32, 2 real gloo FSDP2 ranks.

Each rank builds, for each level (none, optimizer, full) in turn and from the same weights: the RL policy
(`PolicyWorker`, hf backend), the critic (`CriticWorker`) and the SFT job (`SftJob` on the SFT demo's plan),
trains each on the same rows (RL: one optimizer step of
2 micro-batches per rank; SFT: two steps), and keeps the full weights after them. The offloaded runs must
equal the plain one to 1e-6. The policy also saves a DCP checkpoint after its step, takes a second one, and a fresh
rank loaded from the checkpoint must take the same second step (the optimizer states restored, and stepped on the
host again under `optimizer`).

What this verifies on CPUs: `optimizer` really steps on host copies (`HostAdamW`: chunk after chunk of parameter
and gradient shards copied into reused buffers, stepped by the fused CPU AdamW, the optimizer's states made next to them, the updated shards
copied back into the tensors FSDP2 all-gathers from; a small chunk size here, so a step takes many chunks); `full` runs FSDP2's `CPUOffloadPolicy` code path (every FSDP parameter has `offload_to_cpu`:
the non-foreach all-gather copy-in, the gradient's copy to the host after the reduce-scatter, the AdamW step on
the host shards). What it cannot: the device<->host transfers, pinned buffers and the NCCL+gloo process group of a
GPU run (host and device are one memory here); the capability table says so for cuda.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.multiprocessing as mp
from loop_support import ROOT, compile_plan, trainer_rl

from runtime.experience import from_token_lists

LEVELS = ("none", "optimizer", "full")


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = [6, 14, 9, 11, 8, 12, 7, 10]
    tokens = [torch.randint(5, 200, (n,), generator=g).tolist() for n in lengths]
    batch = from_token_lists(tokens, [[(3, n)] for n in lengths], [[] for _ in tokens], pad_id=0)
    mask = batch.action_mask
    g = torch.Generator().manual_seed(1)
    return replace(batch, advantages=torch.randn(mask.shape, generator=g) * mask,
                   rollout_log_probs=-torch.rand(mask.shape, generator=g) * mask,
                   values=torch.randn(mask.shape, generator=g) * mask, returns=torch.randn(mask.shape, generator=g) * mask)


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def offload_checks(worker, level: str) -> dict:
    """What the level changed in the built rank (asserted by the test)."""
    from runtime.fsdp import HostAdamW

    states = [fp.offload_to_cpu for m in worker.model.modules() if hasattr(m, "_get_fsdp_state")
              for fp in (m._get_fsdp_state()._fsdp_param_group.fsdp_params
                         if m._get_fsdp_state()._fsdp_param_group else [])]
    host = worker.optimizer if isinstance(worker.optimizer, HostAdamW) else None
    out = {"offload_to_cpu": states, "host_steps": int(host is not None)}
    if host is not None:
        params = [p for p in worker.model.parameters() if p.requires_grad]
        buffers = [range(b.data_ptr(), b.data_ptr() + host.capacity) for slot in host.buffers for b in slot]
        state_ptrs = {v._local_tensor.data_ptr() for s in host.state.values() for v in s.values()
                      if hasattr(v, "_local_tensor")}
        out.update(chunks=host.chunks_last_step,
                   restored=all(p._local_tensor.data_ptr() not in b for p in params for b in buffers),
                   states_apart=not state_ptrs & {p._local_tensor.data_ptr() for p in params},
                   states_on_host=all(v._local_tensor.device.type == "cpu" for s in host.state.values()
                                      for v in s.values() if hasattr(v, "_local_tensor")),
                   stepped=all(p in host.state for p in params),
                   fused=all(g["fused"] for g in host.param_groups))
    return out


def _rank_main(rank: int, ports: list[int], out_dir: str, rl, sft_plan) -> None:
    torch.set_num_threads(1)
    from runtime import fsdp

    fsdp.HOST_STEP_CHUNK_BYTES = 1 << 16  # many chunks on the tiny model: each step streams chunk after chunk
    from runtime.critic import CriticWorker
    from runtime.sft import SftJob
    from runtime.trainer import PolicyWorker

    batch = _batch()
    results: dict = {}
    ports = iter(ports)  # a fresh world (and port) per build
    for level in LEVELS:
        t = rl.trainer.model_copy(update={"offload": level})
        policy = PolicyWorker(t, rl.model, None, rl.algo, "cpu", "gloo", rank, "127.0.0.1", next(ports))
        results.setdefault(("policy", "start"), _full(policy.model))
        stats = policy.train(batch, kl_coef=0.0)
        results[("policy", level)] = (_full(policy.model), stats["optimizer_steps"], offload_checks(policy, level))
        # a DCP checkpoint after the first step resumes exactly: the second step after a load equals the second
        # step of the rank that kept going (the optimizer states come back and step on the host again)
        ckpt = os.path.join(out_dir, f"ckpt-{level}")
        policy.save_checkpoint(ckpt)
        policy.train(batch, kl_coef=0.0)
        kept_going = _full(policy.model)
        policy.shutdown()
        resumed = PolicyWorker(t, rl.model, None, rl.algo, "cpu", "gloo", rank, "127.0.0.1", next(ports))
        resumed.load_checkpoint(ckpt)
        resumed.train(batch, kl_coef=0.0)
        results[("policy-resume", level)] = (_full(resumed.model), kept_going, offload_checks(resumed, level))
        resumed.shutdown()
        critic = CriticWorker(rl.critic, t, rl.model, "cpu", "gloo", rank, "127.0.0.1", next(ports))
        results.setdefault(("critic", "start"), _full(critic.model))
        stats = critic.train(batch)
        results[("critic", level)] = (_full(critic.model), stats["optimizer_steps"], offload_checks(critic, level))
        critic.shutdown()
        plan = sft_plan.model_copy(update={"sft": sft_plan.sft.model_copy(update={
            "trainer": sft_plan.sft.trainer.model_copy(update={"offload": level})})})
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(next(ports)))
        sft = SftJob(plan)
        sft._init_process_group()
        sft.device = torch.device("cpu")
        from runtime import fsdp, models

        s = plan.sft
        backend = models.backend(s.model)
        meshes = backend.device_mesh("cpu", 2, s.trainer.mesh)
        # what `SftJob.setup` sets from the meshes (no context or tensor parallelism here)
        sft.cp_mesh, sft.dp, sft.cp, sft.dp_rank = meshes.cp, s.trainer.dp, 1, rank
        sft.tp_world, sft.replicas = None, 1
        sft._load_data()
        torch.manual_seed(0)
        sft.model = backend.build(s.model, s.model.path, meshes, sft.device, offload=s.trainer.offload)
        sft.optimizer, sft.scheduler = fsdp.build_optimizer(s.trainer.optimizer, sft.model, s.trainer.offload)
        results.setdefault(("sft", "start"), _full(sft.model))
        losses = [sft.train_step(sft.data.examples[w * sft.window:(w + 1) * sft.window], 0)[0]["train/loss"]
                  for w in range(2)]
        results[("sft", level)] = (_full(sft.model), losses, offload_checks(sft, level))
        torch.distributed.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_offloaded_steps_equal_plain_steps(tmp_path):
    from runtime.ranks import free_port

    model = str(ROOT / "recipes/data/demo_math/model")
    gae = compile_plan("recipes/demo_math_gae.yaml").rl
    rl = trainer_rl(2, ref=False, trainer={"micro_batch_size": 2, "grad_accum": 2, "max_epochs": 1, "seed": 0},
                    optimizer=dict(lr=1e-2, max_norm=1.0, scheduler="constant", warmup_steps=0, total_steps=10),
                    is_correction=dict(level="off"))
    rl = rl.model_copy(update={"critic": gae.critic.model_copy(update={
        "path": model, "world": 2, "dp": 2, "grad_accum": 2, "max_epochs": 1})})
    sft_plan = compile_plan("recipes/demo_sft.yaml")  # paths relative to the project root
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        mp.spawn(_rank_main, args=([free_port() for _ in range(4 * len(LEVELS))], str(tmp_path), rl, sft_plan),
                 nprocs=2, join=True)
    finally:
        os.chdir(cwd)
    results = torch.load(tmp_path / "rank0.pt")
    for role in ("policy", "critic", "sft"):
        plain, steps, checks = results[(role, "none")]
        assert steps == 1.0 or len(steps) == 2, (role, steps)  # optimizer steps (SFT: the two steps' losses)
        assert not any(checks["offload_to_cpu"]) and checks["host_steps"] == 0
        start = results[(role, "start")]
        assert max((plain[n] - start[n]).abs().max().item() for n in plain) > 1e-4, role  # the steps moved it
        for level in ("optimizer", "full"):
            weights, steps_l, checks = results[(role, level)]
            assert steps_l == steps, (role, level)
            assert all(checks["offload_to_cpu"]) == (level == "full") and checks["offload_to_cpu"], (role, level)
            if level == "optimizer":
                assert checks["host_steps"] == 1 and checks["chunks"] > 2 and checks["restored"], (role, checks)
                assert checks["states_apart"] and checks["states_on_host"] and checks["stepped"], (role, checks)
                assert checks["fused"], role
            worst = max((weights[n] - plain[n]).abs().max().item() for n in plain)
            assert worst <= 1e-6, (role, level, worst)
    for level in LEVELS:
        resumed, kept_going, checks = results[("policy-resume", level)]
        assert max((resumed[n] - kept_going[n]).abs().max().item() for n in resumed) <= 1e-7, level
        assert max((kept_going[n] - results[("policy", level)][0][n]).abs().max().item() for n in resumed) > 1e-4
        if level == "optimizer":  # the loaded states went back to the host and stepped there
            assert checks["states_on_host"] and checks["restored"] and checks["stepped"], checks
