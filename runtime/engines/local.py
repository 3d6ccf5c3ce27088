"""Engine plan slices for running engines outside a compiled recipe: the engine tests and `tests/bench_engines.py`.

A compiled plan gets these from `molt_compile.lower`; here they are spelled out for a single CPU host, with the
values the demo recipe compiles to (fp32, eager, prefix caching, processed logprobs, 1 GiB KV cache on CPU; the hf
engine decodes up to 64 sequences at once).
"""

from __future__ import annotations

from typing import Literal

from schemas.plan import EnginesPlan, InstancePlan, RayOptions, RolePlan


def cpu_engines_plan(kind: Literal["vllm", "hf"], count: int = 1, *, seed: int = 0, max_model_len: int = 512,
                     max_num_seqs: int = 64,
                     logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "processed_logprobs",
                     router_policy: str = "consistent_hash", routed_experts: bool = False) -> EnginesPlan:
    return EnginesPlan(
        kind=kind, device="cpu", count=count, tp=1, pp=1, dp=1, gpus_per_engine=1, executor="mp",
        expert_parallel=False, dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        gpu_memory_utilization=0.5, enforce_eager=True,
        prefix_caching=True, seeds=[seed + i for i in range(count)], router_policy=router_policy,
        router_balance_abs=10, router_balance_rel=1.2,
        logprobs_mode=logprobs_mode, max_images_per_prompt=0,
        extra_engine_args={}, routed_experts=routed_experts, routing_hook=routed_experts and kind == "vllm",
    )


def cpu_engine_role(kind: Literal["vllm", "hf"], count: int = 1, *, num_cpus: float = 0.0) -> RolePlan:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"} if kind == "vllm" else {}
    return RolePlan(
        name="rollout.engine", actor_class="RolloutEngine", count=count, num_gpus=0, num_cpus=num_cpus,
        placement_group=None, scheduling="DEFAULT", ray_options=RayOptions(num_cpus=num_cpus, num_gpus=0),
        instances=[InstancePlan(index=i, label=f"rollout.engine[{i}]", node=0, bundle_indices=[i], devices=[])
                   for i in range(count)],
        env=env,
    )
