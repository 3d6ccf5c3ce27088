"""Each shipped recipe against its row of Molt's ground-truth tables (reference/molt_rules.md §5.3, tables A-C).

The rows below are transcribed by hand from §5.3, not computed: a recipe or a derivation that drifts from the
launch script it mirrors fails here. Derived columns (DP, accumulation, GPUs used/total, idle GPUs, executor,
vLLM EP, effective KL) are compared with `derive()` as run by `compile_recipe`; the topology is also compared
with the lowered plan (its GPU map and engine/trainer sections), so the two cannot disagree with the table.
"""

from __future__ import annotations

import pytest
from recipe_files import compiled

# ------------------------------------------------------------------------------------------ table A + B (RL)
# ref: "colocated" or None. vllm_ep: expert-parallel size per engine (1 = off). kl: (use_loss, estimator, coef),
# the *effective* values (on_policy_distill forces no/k1/1.0). eval_every None = eval off (-1).
# dataset: the directory name under .tmp/ the prompts come from. eval_n None: no eval data set, so the script
# passes no --eval.n_samples_per_prompt (only --eval.steps -1).
RL_TABLE: dict[str, dict] = {
    "qwen3_4b_math.yaml": dict(
        script="slurm/rl_qwen3_4b.sh", arch="qwen3-4b", model="Qwen3-4B-Instruct-2507",
        nodes=2, gpus_per_node=8, actor_nodes=1, actor_gpus=8, ref="colocated", tp=1, ep=1, cp=1, dp=8,
        attn="flash_attention_2", packing=True, offload="none",
        engines=8, vtp=1, vpp=1, vdp=1, executor="mp", vllm_ep=1, mem=0.8, eager=False,
        vllm_attn="TRITON_ATTN", ssm_dtype=None, used=16, total=16,
        max_len=16384, rollout_batch=16, gen_batch=8, n=8, train_batch=128, micro=1, accum=16, episodes=1,
        queue=1, force_on_policy=False, partial=False, r3=False, is_band=(0.99, 1.01), kl=(True, "k2", 0.001),
        clip=(0.2, 0.27), lr=2e-6, betas=(0.9, 0.95), reward_clip=(-10, 10), dyn_filter=(0.01, 0.99),
        agent="math.py", turns=1, eval_every=5, eval_n=1, save_every=5, final_save=True, max_samples=4800,
        dataset="proRL_text_rl", runners=2, freeze_visual=False, freeze_router=False, max_images=0,
    ),
    "qwen3_4b_math_quickstart.yaml": dict(
        script="quick_start/rl_qwen3_4b.sh", arch="qwen3-4b", model="Qwen3-4B",
        nodes=1, gpus_per_node=8, actor_nodes=1, actor_gpus=4, ref="colocated", tp=1, ep=1, cp=1, dp=4,
        attn="flash_attention_2", packing=True, offload="none",
        engines=1, vtp=4, vpp=1, vdp=1, executor="mp", vllm_ep=1, mem=0.8, eager=False,
        vllm_attn=None, ssm_dtype=None, used=8, total=8,
        max_len=16384, rollout_batch=16, gen_batch=8, n=8, train_batch=128, micro=1, accum=32, episodes=1,
        queue=2, force_on_policy=False, partial=False, r3=False, is_band=(0.99, 1.01), kl=(True, "k2", 0.001),
        clip=(0.2, 0.27), lr=1e-6, betas=(0.9, 0.95), reward_clip=(-10, 10), dyn_filter=(0.01, 0.99),
        agent="math.py", turns=1, eval_every=5, eval_n=1, save_every=5, final_save=True, max_samples=4800,
        dataset="proRL_text_rl", runners=2, freeze_visual=False, freeze_router=False, max_images=0,
    ),
    "qwen3_6_35b_geo3k.yaml": dict(
        script="slurm/rl_qwen3_6_35b.sh", arch="qwen3.6-35b-a3b", model="Qwen3.6-35B-A3B",
        nodes=2, gpus_per_node=8, actor_nodes=1, actor_gpus=8, ref=None, tp=1, ep=8, cp=8, dp=1,
        attn="te", packing=False, offload="none",
        engines=4, vtp=2, vpp=1, vdp=1, executor="mp", vllm_ep=2, mem=0.85, eager=True,
        vllm_attn=None, ssm_dtype="float32", used=16, total=16,
        max_len=32768, rollout_batch=8, gen_batch=8, n=8, train_batch=64, micro=1, accum=64, episodes=1,
        queue=1, force_on_policy=True, partial=False, r3=True, is_band=(0.99, 1.01), kl=(True, "k2", 0.0),
        clip=(0.2, 0.28), lr=2e-6, betas=(0.9, 0.98), reward_clip=(-10, 10), dyn_filter=None,
        agent="geo3k.py", turns=10, eval_every=5, eval_n=1, save_every=5, keep=50, final_save=True,
        max_samples=65536, dataset="geo3k", runners=2, freeze_visual=True, freeze_router=False, max_images=1,
    ),
    "qwen3_6_35b_geo3k_quickstart.yaml": dict(
        script="quick_start/rl_qwen3_6_35b.sh", arch="qwen3.6-35b-a3b", model="Qwen3.6-35B-A3B",
        nodes=1, gpus_per_node=8, actor_nodes=1, actor_gpus=4, ref=None, tp=1, ep=4, cp=2, dp=2,
        attn="te", packing=False, offload="none",
        engines=1, vtp=4, vpp=1, vdp=1, executor="mp", vllm_ep=4, mem=0.7, eager=False,
        vllm_attn=None, ssm_dtype="float32", used=8, total=8,
        max_len=16384, rollout_batch=8, gen_batch=8, n=4, train_batch=32, micro=1, accum=16, episodes=1,
        queue=2, force_on_policy=False, partial=False, r3=True, is_band=(0.99, 1.01), kl=(True, "k2", 0.0),
        clip=(0.2, 0.28), lr=2e-6, betas=(0.9, 0.95), reward_clip=(-10, 10), dyn_filter=None,
        agent="geo3k.py", turns=4, eval_every=5, eval_n=1, save_every=5, final_save=True, max_samples=4096,
        dataset="geo3k", runners=2, freeze_visual=True, freeze_router=False, max_images=1,
    ),
    "omni3_30b_geo3k.yaml": dict(
        script="slurm/rl_omni3_30b.sh", arch="nemotron-3-nano-omni-30b-a3b",
        model="NVIDIA-Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16",
        nodes=4, gpus_per_node=8, actor_nodes=2, actor_gpus=8, ref=None, tp=1, ep=8, cp=8, dp=2,
        attn="te", packing=False, offload="none",
        engines=4, vtp=2, vpp=1, vdp=1, executor="mp", vllm_ep=2, mem=0.95, eager=True,
        vllm_attn="TRITON_ATTN", ssm_dtype="float32", used=24, total=32,
        max_len=32000, rollout_batch=8, gen_batch=8, n=8, train_batch=64, micro=1, accum=32, episodes=5,
        queue=1, force_on_policy=True, partial=False, r3=True, is_band=(0.95, 1.05), kl=(True, "k2", 0.0),
        clip=(0.2, 0.28), lr=2e-6, betas=(0.9, 0.98), reward_clip=(-1, 1), dyn_filter=None,
        agent="geo3k.py", turns=10, eval_every=10, eval_n=1, save_every=2, keep=50, final_save=True,
        max_samples=65536, dataset="geo3k_answer", runners=8, freeze_visual=True, freeze_router=False,
        max_images=1,
    ),
    "omni3_30b_distill.yaml": dict(
        script="slurm/rl_distill_omni3_30b.sh", arch="nemotron-3-nano-omni-30b-a3b",
        model="nemotron_omni_v3_shim/iter_0001926_mcore_to_hf",
        nodes=4, gpus_per_node=8, actor_nodes=2, actor_gpus=8, ref="colocated", tp=1, ep=8, cp=8, dp=2,
        attn="te", packing=False, offload="none",
        engines=2, vtp=8, vpp=1, vdp=1, executor="mp", vllm_ep=8, mem=0.95, eager=True,
        vllm_attn="TRITON_ATTN", ssm_dtype="float32", used=32, total=32,
        max_len=16384, rollout_batch=8, gen_batch=8, n=8, train_batch=64, micro=1, accum=32, episodes=5,
        queue=1, force_on_policy=True, partial=False, r3=True, is_band=(0.5, 2.0), kl=(False, "k1", 1.0),
        clip=(0.2, 0.28), lr=2e-6, betas=(0.9, 0.98), reward_clip=(-1, 1), dyn_filter=None,
        agent="distill", turns=1, eval_every=None, eval_n=None, save_every=2, keep=50, final_save=True,
        max_samples=65536, dataset="geo3k_answer", runners=2, freeze_visual=True, freeze_router=False,
        max_images=1, estimator="on_policy_distill",
    ),
    "glm5_ep256.yaml": dict(
        script="slurm/rl_glm5_2_753b.sh", arch="glm-5.2", model="GLM-5.2",
        nodes=36, gpus_per_node=8, actor_nodes=32, actor_gpus=8, ref=None, tp=1, ep=256, cp=16, dp=16,
        attn="tilelang", packing=True, offload="optimizer",
        engines=1, vtp=32, vpp=1, vdp=1, executor="ray", vllm_ep=32, mem=0.85, eager=True,
        vllm_attn=None, ssm_dtype="float32", used=288, total=288,
        max_len=16384, rollout_batch=8, gen_batch=8, n=8, train_batch=64, micro=1, accum=4, episodes=1,
        queue=1, force_on_policy=True, partial=False, r3=True, is_band=(0.99, 1.01), kl=(True, "k2", 0.0),
        clip=(0.2, 0.28), lr=2e-6, betas=(0.9, 0.98), reward_clip=(-10, 10), dyn_filter=None,
        agent="math.py", turns=10, eval_every=25, eval_n=1, save_every=1000, final_save=False,
        max_samples=1600, dataset="geo3k", runners=2, freeze_visual=False, freeze_router=False, max_images=0,
    ),
}

# ------------------------------------------------------------------------------------------ table C (SFT)
SFT_TABLE: dict[str, dict] = {
    "sft_qwen3_4b.yaml": dict(
        script="slurm/sft_qwen3_4b.sh", arch="qwen3-4b", nodes=1 * 2, gpus_per_node=8, tp=1, ep=1, cp=1, dp=16,
        attn="flash_attention_2", max_len=4096, batch=128, micro=2, accum=4, epochs=1, lr=1e-6, aux=0.0,
        ac="full", vlm=False, eval_every=20, save_every=50, max_samples=8192, dataset="proRL_text_rl",
        wall_time="02:00:00", port=29500,
    ),
    "sft_qwen3_6_35b.yaml": dict(
        script="slurm/sft_qwen3_6_35b.sh", arch="qwen3.6-35b-a3b", nodes=2, gpus_per_node=8, tp=1, ep=8, cp=1,
        dp=16, attn="flash_attention_2", max_len=4096, batch=128, micro=1, accum=8, epochs=1, lr=1e-6, aux=0.001,
        ac="full", vlm=True, eval_every=20, save_every=50, max_samples=8192, dataset="geo3k",
        wall_time="02:00:00", port=29500,
    ),
    "sft_omni3_30b.yaml": dict(
        script="slurm/sft_omni3_30b.sh", arch="nemotron-3-nano-omni-30b-a3b", nodes=2, gpus_per_node=8, tp=1,
        ep=8, cp=8, dp=2, attn="te", max_len=32768, batch=8, micro=1, accum=4, epochs=1, lr=5e-6, aux=0.001,
        ac="full", vlm=True, eval_every=20, save_every=50, max_samples=8192, dataset="geo3k",
        wall_time="04:00:00", port=29511,
    ),
    "sft_qwen3_4b_quickstart.yaml": dict(
        script="quick_start/sft_qwen3_4b.sh", arch="qwen3-4b", nodes=1, gpus_per_node=8, tp=1, ep=1, cp=1, dp=8,
        attn="flash_attention_2", max_len=4096, batch=64, micro=2, accum=4, epochs=1, lr=1e-6, aux=0.0,
        ac="full", vlm=False, eval_every=20, save_every=50, max_samples=4096, dataset="proRL_text_rl",
        wall_time=None,
    ),
    "sft_qwen3_6_35b_quickstart.yaml": dict(
        script="quick_start/sft_qwen3_6_35b.sh", arch="qwen3.6-35b-a3b", nodes=1, gpus_per_node=8, tp=1, ep=8,
        cp=1, dp=8, attn="flash_attention_2", max_len=4096, batch=64, micro=1, accum=8, epochs=1, lr=1e-6,
        aux=0.001, ac="full", vlm=True, eval_every=20, save_every=50, max_samples=4096, dataset="geo3k",
        wall_time=None,
    ),
}


def test_the_tables_cover_twelve_scripts():
    """Seven RL scripts (tables A and B) and five SFT scripts (table C), each mirrored by its own recipe."""
    assert len(RL_TABLE) == 7 and len(SFT_TABLE) == 5
    assert len({row["script"] for row in [*RL_TABLE.values(), *SFT_TABLE.values()]}) == 12


def _result(name: str):
    result = compiled(name)
    errors = [d for d in result.diagnostics if d.severity == "error"]
    assert result.recipe is not None and not errors, f"{name} does not compile: {errors}"
    return result


# ------------------------------------------------------------------------------------------ RL: recipe values
@pytest.mark.parametrize("name", sorted(RL_TABLE))
def test_rl_recipe_values_match_table(name):
    row, r = RL_TABLE[name], _result(name).recipe
    assert r.kind == "rl"
    assert r.model.arch == row["arch"] and r.model.path.endswith(row["model"])
    assert (r.cluster.nodes, r.cluster.gpus_per_node, r.cluster.gpu) == (row["nodes"], row["gpus_per_node"], "h100-80gb")
    assert (r.actor.nodes, r.actor.gpus_per_node) == (row["actor_nodes"], row["actor_gpus"])
    assert (r.actor.mesh.tp, r.actor.mesh.ep, r.actor.mesh.cp, r.actor.mesh.pp) == (row["tp"], row["ep"], row["cp"], 1)
    assert r.model.attn == row["attn"]
    assert r.actor.packing is row["packing"] and r.actor.offload == row["offload"]
    assert r.model.param_dtype == "bf16" and r.model.gradient_checkpoint == "full"
    if row["ref"] == "colocated":
        assert r.ref is not None and r.ref.placement == "colocate"
    else:
        assert r.ref is None
    assert r.critic is None

    ro = r.rollout
    assert (ro.engines, ro.mesh.tp, ro.mesh.pp, ro.mesh.dp) == (row["engines"], row["vtp"], row["vpp"], row["vdp"])
    assert ro.executor == row["executor"]
    assert ro.expert_parallel is (row["vllm_ep"] > 1)
    assert ro.gpu_memory_utilization == pytest.approx(row["mem"])
    assert ro.enforce_eager is row["eager"]
    assert ro.attention_backend == row["vllm_attn"]
    assert ro.mamba_ssm_cache_dtype == row["ssm_dtype"]
    assert (ro.batch_size, ro.generate_batch_size, ro.n_samples_per_prompt) == (
        row["rollout_batch"], row["gen_batch"], row["n"])
    assert (ro.temperature, ro.top_p, ro.max_new_tokens) == (1.0, 1.0, None)
    assert ro.runners == row["runners"]
    slurm_script = row["script"].startswith("slurm/")
    assert ro.mm_encoder_attn_backend == ("TORCH_SDPA" if slurm_script else None)
    assert ro.gdn_prefill_backend == ("triton" if slurm_script else None)

    t = r.train
    assert (t.batch_size, t.micro_batch_size, t.max_epochs, t.episodes) == (
        row["train_batch"], row["micro"], 1, row["episodes"])
    assert t.async_.queue_size == row["queue"] and t.async_.partial_rollout is row["partial"]
    assert t.force_on_policy is row["force_on_policy"] and t.routing_replay is row["r3"]

    a = r.algo
    assert a.estimator == row.get("estimator", "reinforce_baseline")
    assert (a.is_correction.level, a.is_correction.mode) == ("geo", "mask")
    assert tuple(a.is_correction.threshold) == pytest.approx(row["is_band"])
    assert tuple(a.reward_clip) == pytest.approx(row["reward_clip"])
    if row["dyn_filter"] is None:
        assert a.dynamic_filtering is None
    else:
        assert tuple(a.dynamic_filtering.range) == pytest.approx(row["dyn_filter"])

    loss, opt = r.actor.loss, r.actor.optimizer
    assert tuple(loss.clip) == pytest.approx(row["clip"])
    assert (loss.dual_clip, loss.entropy_coef, loss.aux_loss_coef, loss.mode) == (10.0, 0.0, 0.0, "ppo")
    assert opt.name == "adam" and opt.lr == pytest.approx(row["lr"])
    assert tuple(opt.betas) == pytest.approx(row["betas"])
    assert (r.actor.freeze.visual_encoder, r.actor.freeze.moe_router) == (row["freeze_visual"], row["freeze_router"])

    if row["agent"] == "distill":
        assert r.agent is None  # on_policy_distill's built-in generator
    else:
        assert r.agent.path == f"agents/{row['agent']}" and r.agent.max_turns == row["turns"]

    d = r.data
    assert (d.input_key, d.label_key, d.image_key, d.apply_chat_template) == ("prompt", "reward_model", "images", True)
    assert (d.max_len, d.max_samples, d.max_images_per_prompt) == (row["max_len"], row["max_samples"], row["max_images"])
    assert d.prompts.rstrip("/").split("/")[-2:] == [row["dataset"], "train"]

    assert r.eval.n_samples_per_prompt == row["eval_n"]
    assert r.eval.every == (row["eval_every"] if row["eval_every"] is not None else -1)
    if row["eval_every"] is not None:
        assert r.eval.dataset.rstrip("/").split("/")[-2:] == [row["dataset"], "eval"]
    assert r.ckpt.every == row["save_every"] and r.ckpt.final_save is row["final_save"]
    if "keep" in row:  # the table notes "(max_num 50)" for three scripts; it says nothing for the others
        assert r.ckpt.keep == row["keep"]
    assert r.logging.every == 1
    if slurm_script:
        assert r.launch.slurm.time == "04:00:00"


# ------------------------------------------------------------------------------------------ RL: derived values
@pytest.mark.parametrize("name", sorted(RL_TABLE))
def test_rl_derived_values_match_table(name):
    row, result = RL_TABLE[name], _result(name)
    dv = result.derived.value
    world = row["actor_nodes"] * row["actor_gpus"]
    assert dv("actor.world") == world
    assert dv("actor.dp") == row["dp"] == world // (row["tp"] * row["cp"])
    assert dv("actor.grad_accum") == row["accum"] == row["train_batch"] // (row["micro"] * row["dp"])
    assert dv("ref.exists") is (row["ref"] is not None)
    if row["ref"] is not None:
        assert dv("ref.colocated") is True and dv("ref.world") == world and dv("ref.dp") == row["dp"]
    assert dv("critic.exists") is False
    assert dv("fsdp.colocate") is (row["ref"] == "colocated")
    assert dv("fsdp.total_gpus") == world  # a colocated ref shares the actor's GPUs
    assert dv("rollout.executor") == row["executor"]
    assert dv("rollout.gpus_per_engine") == row["vtp"] * row["vpp"] * row["vdp"]
    assert dv("rollout.total_gpus") == row["engines"] * row["vtp"] * row["vpp"] * row["vdp"]
    assert dv("rollout.expert_parallel_size") == row["vllm_ep"]
    assert dv("rollout.generate_batch_size") == row["gen_batch"]
    assert dv("rollout.runners") == row["runners"]
    assert dv("rollout.max_model_len") == row["max_len"]
    assert dv("actor.packing") is row["packing"]
    assert dv("cluster.total_gpus") == row["total"]
    assert dv("cluster.used_gpus") == row["used"]
    assert dv("cluster.idle_gpus") == row["total"] - row["used"]
    assert dv("weight_sync.world_size") == dv("rollout.total_gpus") + 1
    use_loss, kl_estimator, kl_coef = row["kl"]
    assert dv("algo.kl.use_loss") is use_loss and dv("algo.kl.estimator") == kl_estimator
    assert dv("algo.kl.coef") == pytest.approx(kl_coef)
    assert dv("algo.is_correction.enabled") is True
    assert dv("agent.max_turns") == row["turns"]
    if row["agent"] == "distill":
        assert "distill" in dv("agent.path")
    assert dv("eval.every") == row["eval_every"]
    assert dv("eval.enabled") is (row["eval_every"] is not None)
    assert dv("ckpt.every") == row["save_every"]


# ------------------------------------------------------------------------------------------ SFT
@pytest.mark.parametrize("name", sorted(SFT_TABLE))
def test_sft_recipe_and_derived_values_match_table(name):
    row, result = SFT_TABLE[name], _result(name)
    r, dv = result.recipe, result.derived.value
    assert r.kind == "sft" and r.model.arch == row["arch"]
    assert (r.cluster.nodes, r.cluster.gpus_per_node) == (row["nodes"], row["gpus_per_node"])
    assert (r.actor.nodes, r.actor.gpus_per_node) == (row["nodes"], row["gpus_per_node"])
    assert (r.actor.mesh.tp, r.actor.mesh.ep, r.actor.mesh.cp) == (row["tp"], row["ep"], row["cp"])
    assert r.model.attn == row["attn"] and r.model.gradient_checkpoint == row["ac"]
    assert r.model.param_dtype == "bf16"
    assert (r.data.input_key, r.data.output_key) == ("prompt", "response")
    assert (r.data.max_len, r.data.max_samples) == (row["max_len"], row["max_samples"])
    assert r.data.dataset.rstrip("/").split("/")[-2:] == [row["dataset"], "train"]
    assert r.eval.dataset.rstrip("/").split("/")[-2:] == [row["dataset"], "eval"]
    if row["vlm"]:
        assert (r.data.image_key, r.data.max_images_per_prompt) == ("images", 1)
    else:
        assert r.data.image_key is None
    assert (r.train.batch_size, r.train.micro_batch_size, r.train.max_epochs) == (
        row["batch"], row["micro"], row["epochs"])
    assert r.actor.optimizer.lr == pytest.approx(row["lr"])
    assert r.actor.aux_loss_coef == pytest.approx(row["aux"])
    assert (r.eval.every, r.ckpt.every, r.logging.every) == (row["eval_every"], row["save_every"], 1)
    if row["wall_time"] is not None:
        assert r.launch.slurm.time == row["wall_time"]

    world = row["nodes"] * row["gpus_per_node"]
    assert dv("actor.world") == world
    assert dv("actor.dp") == row["dp"] == world // (row["tp"] * row["cp"])
    assert dv("actor.grad_accum") == row["accum"] == row["batch"] // (row["micro"] * row["dp"])
    assert dv("cluster.used_gpus") == world and dv("cluster.idle_gpus") == 0
    assert (dv("sft.nnodes"), dv("sft.nproc_per_node")) == (row["nodes"], row["gpus_per_node"])
    if "port" in row:  # Slurm scripts: srun + torchrun on the head node's port (quick starts use --standalone)
        assert dv("sft.master_port") == row["port"]


# ------------------------------------------------------------------------------------------ the lowered plan
def _devices(plan):
    """(node, gpu, labels) for every device slot of the plan's GPU map."""
    return [(n, g, labels) for n, node in enumerate(plan.gpu_map) for g, labels in enumerate(node)]


def _check_gpu_map(plan, *, nodes, gpus_per_node, used, total):
    assert (plan.cluster.nodes, plan.cluster.gpus_per_node, plan.cluster.gpu) == (nodes, gpus_per_node, "h100-80gb")
    assert (plan.cluster.total_gpus, plan.cluster.used_gpus) == (total, used)
    assert len(plan.gpu_map) == nodes and all(len(node) == gpus_per_node for node in plan.gpu_map)
    devices = _devices(plan)
    assert sum(1 for _, _, labels in devices if labels) == used
    idle_nodes = [n for n, node in enumerate(plan.gpu_map) if not any(node)]
    assert len(idle_nodes) == (total - used) // gpus_per_node  # the idle GPUs are whole nodes in these tables
    return devices


@pytest.mark.parametrize("name", sorted(RL_TABLE))
def test_rl_plan_matches_table(name):
    row, plan = RL_TABLE[name], _result(name).plan
    assert plan is not None and plan.kind == "rl" and plan.rl is not None
    devices = _check_gpu_map(plan, nodes=row["nodes"], gpus_per_node=row["gpus_per_node"], used=row["used"],
                             total=row["total"])
    world = row["actor_nodes"] * row["actor_gpus"]
    engine_gpus = row["engines"] * row["vtp"] * row["vpp"] * row["vdp"]

    def on(prefix):
        return [(n, g, labels) for n, g, labels in devices if any(lab.startswith(prefix) for lab in labels)]

    assert len(on("rollout.engine[")) == engine_gpus
    assert {lab for *_, labels in on("rollout.engine[") for lab in labels} == {
        f"rollout.engine[{i}]" for i in range(row["engines"])}
    assert len(on("actor.rank[")) == world
    assert not [d for d in on("actor.rank[") if any(lab.startswith("rollout.") for lab in d[2])]
    if row["ref"] == "colocated":  # rank r of the ref shares rank r's GPU with the actor
        assert len(on("ref.rank[")) == world
        assert all(f"ref.rank[{lab[len('actor.rank['):-1]}]" in labels
                   for *_, labels in on("actor.rank[") for lab in labels if lab.startswith("actor.rank["))
    else:
        assert on("ref.rank[") == [] and plan.rl.ref is None
    assert on("critic.") == [] and plan.rl.critic is None

    e = plan.rl.engines
    assert (e.count, e.tp, e.pp, e.dp, e.gpus_per_engine) == (
        row["engines"], row["vtp"], row["vpp"], row["vdp"], row["vtp"] * row["vpp"] * row["vdp"])
    assert (e.executor, e.expert_parallel, e.enforce_eager) == (row["executor"], row["vllm_ep"] > 1, row["eager"])
    assert e.gpu_memory_utilization == pytest.approx(row["mem"]) and e.max_model_len == row["max_len"]
    assert e.max_images_per_prompt == row["max_images"] and len(e.seeds) == row["engines"]
    assert e.logprobs_mode == "processed_logprobs"  # IS correction (geo) is on in every script

    t = plan.rl.trainer
    assert (t.world, t.dp, t.grad_accum, t.batch_size, t.micro_batch_size) == (
        world, row["dp"], row["accum"], row["train_batch"], row["micro"])
    assert (t.mesh.tp, t.mesh.cp, t.mesh.ep, t.mesh.pp) == (row["tp"], row["cp"], row["ep"], 1)
    assert (t.packing, t.offload, t.force_on_policy, t.routing_replay) == (
        row["packing"], row["offload"], row["force_on_policy"], row["r3"])
    assert (t.freeze_visual_encoder, t.freeze_moe_router) == (row["freeze_visual"], row["freeze_router"])
    assert (t.loss.clip_low, t.loss.clip_high) == pytest.approx(row["clip"])
    assert t.optimizer.lr == pytest.approx(row["lr"]) and tuple(t.optimizer.betas) == pytest.approx(row["betas"])
    if row["ref"] == "colocated":
        ref = plan.rl.ref
        assert (ref.colocated, ref.world, ref.dp, ref.grad_accum) == (True, world, row["dp"], row["accum"])

    a = plan.rl.algo
    use_loss, kl_estimator, kl_coef = row["kl"]
    assert (a.kl.use_loss, a.kl.estimator) == (use_loss, kl_estimator) and a.kl.coef == pytest.approx(kl_coef)
    assert (a.is_correction.level, a.is_correction.mode) == ("geo", "mask")
    assert (a.is_correction.low, a.is_correction.high) == pytest.approx(row["is_band"])
    assert tuple(a.reward_clip) == pytest.approx(row["reward_clip"])
    g, q = plan.rl.generator, plan.rl.queue
    assert (g.batch_size, g.generate_batch_size, g.episodes) == (row["rollout_batch"], row["gen_batch"], row["episodes"])
    assert (g.dynamic_filtering is None) == (row["dyn_filter"] is None)
    assert (q.size, q.partial_rollout) == (row["queue"], row["partial"])
    assert plan.rl.sampling.n_samples_per_prompt == row["n"]
    assert (plan.rl.agent.max_turns, plan.rl.agent.runners) == (row["turns"], row["runners"])
    assert (plan.rl.schedule.eval_every, plan.rl.schedule.ckpt_every) == (row["eval_every"], row["save_every"])
    assert plan.rl.eval.enabled is (row["eval_every"] is not None)
    assert plan.rl.ckpt.final_save is row["final_save"]
    assert plan.rl.data.max_samples == row["max_samples"]
    assert plan.rl.data.prompts == [f".tmp/{row['dataset']}/train"]  # relative to the project root
    assert plan.rl.weight_sync.world_size == engine_gpus + 1


@pytest.mark.parametrize("name", sorted(SFT_TABLE))
def test_sft_plan_matches_table(name):
    row, plan = SFT_TABLE[name], _result(name).plan
    assert plan is not None and plan.kind == "sft" and plan.sft is not None and plan.rl is None
    world = row["nodes"] * row["gpus_per_node"]
    devices = _check_gpu_map(plan, nodes=row["nodes"], gpus_per_node=row["gpus_per_node"], used=world, total=world)
    assert sorted(lab for *_, labels in devices for lab in labels) == sorted(f"sft.rank[{i}]" for i in range(world))
    t = plan.sft.trainer
    assert (t.world, t.dp, t.grad_accum, t.batch_size, t.micro_batch_size, t.max_epochs) == (
        world, row["dp"], row["accum"], row["batch"], row["micro"], row["epochs"])
    assert (t.mesh.tp, t.mesh.cp, t.mesh.ep) == (row["tp"], row["cp"], row["ep"])
    assert t.optimizer.lr == pytest.approx(row["lr"]) and t.aux_loss_coef == pytest.approx(row["aux"])
    assert plan.sft.data.dataset == [f".tmp/{row['dataset']}/train"]
    if "port" in row:
        assert plan.sft.master_port == row["port"]
