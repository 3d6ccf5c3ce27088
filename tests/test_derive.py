"""derive(): values and reasons, checked against hand-computed numbers and Molt's ground-truth tables (§5.3 A-C).

The table rows are transcribed from reference/molt_rules.md §5.3; tests/data/plan/*.yaml mirror the launch scripts'
topologies. Every expected number below was computed by hand from the row, not by calling derive.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plan_support import PLAN_DATA, ROOT, from_file, rl, sft

from molt_compile.derive import DISTILL_AGENT_PATH, Derived, derive

# ------------------------------------------------------------------------------ tables A and B (RL), hand values
# file: (actor world, dp, grad_accum, ref exists, colocate, executor, gpus/engine, rollout gpus, fsdp gpus,
#        used, total, weight-sync world, vLLM EP per engine)
TABLE_AB = {
    "rl_qwen3_4b_slurm": (8, 8, 16, True, True, "mp", 1, 8, 8, 16, 16, 9, 1),
    "rl_qwen3_4b_quick": (4, 4, 32, True, True, "mp", 4, 4, 4, 8, 8, 5, 1),
    "rl_qwen3_6_35b_slurm": (8, 1, 64, False, False, "mp", 2, 8, 8, 16, 16, 9, 2),
    "rl_qwen3_6_35b_quick": (4, 2, 16, False, False, "mp", 4, 4, 4, 8, 8, 5, 4),
    "rl_omni3_30b": (16, 2, 32, False, False, "mp", 2, 8, 16, 24, 32, 9, 2),
    "rl_distill_omni3_30b": (16, 2, 32, True, True, "mp", 8, 16, 16, 32, 32, 17, 8),
    "rl_glm5_ep256": (256, 16, 4, False, False, "ray", 32, 32, 256, 288, 288, 33, 32),
}


@pytest.mark.parametrize("name", sorted(TABLE_AB))
def test_rl_table_rows(name: str) -> None:
    world, dp, accum, ref, colocate, executor, per_engine, vllm, fsdp, used, total, sync, ep = TABLE_AB[name]
    _, d, _ = from_file(PLAN_DATA / f"{name}.yaml")
    assert d.value("actor.world") == world
    assert d.value("actor.dp") == dp
    assert d.value("actor.grad_accum") == accum
    assert d.value("ref.exists") is ref
    assert d.value("critic.exists") is False
    assert d.value("fsdp.colocate") is colocate
    assert d.value("rollout.executor") == executor
    assert d.value("rollout.gpus_per_engine") == per_engine
    assert d.value("rollout.total_gpus") == vllm
    assert d.value("fsdp.total_gpus") == fsdp
    assert d.value("cluster.used_gpus") == used
    assert d.value("cluster.total_gpus") == total
    assert d.value("cluster.idle_gpus") == total - used
    assert d.value("weight_sync.world_size") == sync
    assert d.value("rollout.expert_parallel_size") == ep
    if ref:  # G4 holds for the ref too; colocated means the same world (J2)
        assert d.value("ref.world") == world and d.value("ref.grad_accum") == accum


# table B: (samples per step, gen batch, optimizer steps per step, episodes)
TABLE_B = {
    "rl_qwen3_4b_slurm": (128, 8, 1, 1),
    "rl_qwen3_4b_quick": (128, 8, 1, 1),
    "rl_qwen3_6_35b_slurm": (64, 8, 1, 1),
    "rl_qwen3_6_35b_quick": (32, 8, 1, 1),
    "rl_omni3_30b": (64, 8, 1, 5),
    "rl_distill_omni3_30b": (64, 8, 1, 5),
    "rl_glm5_ep256": (64, 8, 1, 1),
}


@pytest.mark.parametrize("name", sorted(TABLE_B))
def test_rl_table_b_batching(name: str) -> None:
    samples, gen_batch, opt_per_step, episodes = TABLE_B[name]
    recipe, d, _ = from_file(PLAN_DATA / f"{name}.yaml")
    assert d.value("rollout.samples_per_step") == samples
    assert d.value("rollout.generate_batch_size") == gen_batch
    assert d.value("train.optimizer_steps_per_step") == opt_per_step
    # 100 prompts in prompts_100.jsonl, below every row's max_samples
    assert d.value("data.prompt_count") == 100
    per_episode = 100 // recipe.rollout.batch_size
    assert d.value("train.steps_per_episode") == per_episode
    assert d.value("train.total_steps") == per_episode * episodes


# table C (SFT): (world, dp, accum)
TABLE_C = {
    "sft_qwen3_4b": (16, 16, 4),
    "sft_qwen3_6_35b": (16, 16, 8),
    "sft_omni3_30b": (16, 2, 4),
    "sft_qwen3_4b_quick": (8, 8, 4),
    "sft_qwen3_6_35b_quick": (8, 8, 8),
}


@pytest.mark.parametrize("name", sorted(TABLE_C))
def test_sft_table_rows(name: str) -> None:
    world, dp, accum = TABLE_C[name]
    recipe, d, _ = from_file(PLAN_DATA / f"{name}.yaml")
    assert (d.value("actor.world"), d.value("actor.dp"), d.value("actor.grad_accum")) == (world, dp, accum)
    assert d.value("sft.nnodes") == recipe.actor.nodes and d.value("sft.nproc_per_node") == 8
    assert d.value("sft.master_port") == 29500
    assert d.value("cluster.used_gpus") == world
    assert d.value("data.sample_count") == 100
    assert d.value("train.steps_per_epoch") == 100 // recipe.train.batch_size
    assert d.value("eval.every") == 20 and d.value("ckpt.every") == 50


def test_distill_row_forces_kl_and_builtin_agent() -> None:
    _, d, _ = from_file(PLAN_DATA / "rl_distill_omni3_30b.yaml")
    assert d.value("algo.kl.coef") == 1.0  # B2: defaults to 1.0 under on_policy_distill
    assert d.value("algo.kl.estimator") == "k1" and d.value("algo.kl.use_loss") is False
    assert d.value("agent.path") == DISTILL_AGENT_PATH
    assert d.value("ref.path") == "/models/teacher"


# ------------------------------------------------------------------------------ reasons carry the numbers
def test_reasons_name_the_numbers() -> None:
    d = derive(rl(actor={"nodes": 2, "gpus_per_node": 8, "mesh": {"cp": 2}}, train={"batch_size": 64, "micro_batch_size": 2},
                  cluster={"nodes": 4}))
    assert d["actor.world"].reason == "actor.nodes 2 × actor.gpus_per_node 8"
    assert d["actor.dp"].value == 8 and "world 16 / (tp × cp = 2)" in d["actor.dp"].reason
    assert d["actor.grad_accum"].value == 4
    assert d["actor.grad_accum"].reason == "batch_size 64 / (micro_batch_size 2 × dp 8)"
    assert d["actor.grad_accum"].inputs == ("train.batch_size", "train.micro_batch_size", "actor.dp")


def test_non_integral_grad_accum_is_none_with_reason() -> None:
    d = derive(rl(train={"batch_size": 100}))
    assert d.value("actor.dp") == 8
    assert d.value("actor.grad_accum") is None
    assert "100 is not a multiple of micro_batch_size 1 × dp 8 = 8 (G4)" in d["actor.grad_accum"].reason


def test_world_not_divisible_by_tp_cp() -> None:
    d = derive(rl(actor={"gpus_per_node": 6, "mesh": {"cp": 4}}))
    assert d.value("actor.dp") is None and "not divisible by tp × cp = 4" in d["actor.dp"].reason
    assert d.value("actor.grad_accum") is None


def test_dynamic_batching_accum_one_and_token_cap() -> None:
    d = derive(rl(actor={"mesh": {"tp": 2, "cp": 2}}, train={"batch_size": 7, "dynamic_batch": {"max_tokens_per_gpu": 1000}}))
    assert d.value("actor.grad_accum") == 1  # B25
    assert d.value("actor.dynamic_batch_max_tokens") == 4000  # G9: x cp x tp
    assert d.value("actor.local_batch_size") == 7 // 2
    assert d.value("actor.shuffle_microbatches") is False
    assert d.value("actor.micro_batches_by_length") is False  # Molt keeps the order: so does the runtime


def test_micro_batches_by_length_where_shuffled_and_padded() -> None:
    d = derive(rl())
    assert d.value("actor.shuffle_microbatches") is True and d.value("actor.micro_batches_by_length") is True
    assert "pads least" in d["actor.micro_batches_by_length"].reason
    packed = derive(rl(actor={"packing": True}))
    assert packed.value("actor.shuffle_microbatches") is True
    assert packed.value("actor.micro_batches_by_length") is False
    assert "compute no padding" in packed["actor.micro_batches_by_length"].reason


# ------------------------------------------------------------------------------ ref / critic / colocation
def test_no_ref_section_means_no_ref() -> None:
    d = derive(rl(algo={"kl": {"coef": 0.01}}))
    assert d.value("ref.exists") is False and "ref.world" not in d
    assert d.value("fsdp.colocate") is False and d.value("actor.num_gpus") == 1


def test_separate_ref_adds_its_gpus() -> None:
    d = derive(rl(cluster={"nodes": 3}, ref={"placement": "separate", "nodes": 1, "gpus_per_node": 4},
                  rollout={"engines": 2}))
    assert d.value("ref.world") == 4 and d.value("ref.num_gpus") == 1
    assert d.value("fsdp.total_gpus") == 8 + 4
    assert d.value("cluster.used_gpus") == 8 + 4 + 2


def test_gae_builds_critic_with_actor_size_and_colocates() -> None:
    d = derive(rl(algo={"estimator": "gae"}, actor={"freeze": {"moe_router": True}}, train={"max_epochs": 2}))
    assert d.value("critic.exists") is True
    assert d.value("critic.world") == 8 and d.value("critic.colocated") is True
    assert d.value("fsdp.colocate") is True
    assert d.value("actor.num_gpus") == 0.2 and d.value("critic.num_gpus") == 0.2  # B33
    assert d.value("fsdp.total_gpus") == 8
    assert d.value("critic.max_epochs") == 2  # B9
    assert d.value("critic.freeze_moe_router") is True  # B9


def test_critic_section_without_gae_builds_nothing() -> None:
    d = derive(rl(critic={"placement": "separate"}))
    assert d.value("critic.exists") is False and "needs no value model" in d["critic.exists"].reason


def test_eval_only_uses_no_fsdp_gpus() -> None:
    d = derive(rl(eval={"dataset": "/e.jsonl", "only": True}, rollout={"engines": 3}))
    assert d.value("fsdp.total_gpus") == 0 and "J4" in d["fsdp.total_gpus"].reason
    assert d.value("cluster.used_gpus") == 3


# ------------------------------------------------------------------------------ rollout (B4, B14, B15, B27)
@pytest.mark.parametrize(("mesh", "executor", "engine_gpus", "bundles"), [
    ({"tp": 1}, "uni", 1, 2),
    ({"tp": 2, "dp": 2}, "mp", 4, 2),
    ({"tp": 4}, "ray", 0, 8),
    ({"tp": 2, "pp": 2}, "ray", 0, 8),
])
def test_executor_derivation(mesh: dict, executor: str, engine_gpus: int, bundles: int) -> None:
    d = derive(rl(cluster={"nodes": 4}, rollout={"engines": 2, "mesh": mesh}))
    assert d.value("rollout.executor") == executor
    assert "B15" in d["rollout.executor"].reason
    assert d.value("rollout.engine_num_gpus") == engine_gpus
    assert d.value("rollout.bundles") == bundles


def test_hf_engine_and_explicit_executor() -> None:
    assert derive(rl(rollout={"engine": "hf"})).value("rollout.executor") == "uni"
    d = derive(rl(rollout={"executor": "mp", "mesh": {"tp": 2}}))
    assert d.value("rollout.executor") == "mp" and d["rollout.executor"].reason == "set in the recipe"


def test_rollout_fallbacks() -> None:
    d = derive(rl(rollout={"batch_size": 16, "n_samples_per_prompt": 4, "temperature": 0.7, "max_new_tokens": 64},
                  eval={"dataset": "/e.jsonl", "every": 3, "temperature": 0.0001}))
    assert d.value("rollout.generate_batch_size") == 16  # B4
    assert d.value("rollout.runners") == 2  # B27
    assert d.value("eval.batch_size") == 16 and "B13" in d["eval.batch_size"].reason
    assert d.value("eval.n_samples_per_prompt") == 4
    assert d.value("eval.temperature") == 0.0001 and d["eval.temperature"].reason == "set in the recipe"
    assert d.value("eval.max_new_tokens") == 64
    assert d.value("eval.every") == 3
    assert d.value("actor.temperature") == 0.7  # B17


def test_logprobs_follow_is_correction() -> None:
    on = derive(rl(algo={"is_correction": {"level": "token"}}))
    off = derive(rl())
    assert on.value("rollout.logprobs_mode") == "processed_logprobs" and on.value("rollout.logprobs") is True
    assert off.value("rollout.logprobs_mode") == "raw_logprobs" and off.value("rollout.logprobs") is False


def test_vlm_packing_is_one_truth_the_rule() -> None:
    """Issue 31: derive no longer unpacks a VLM run behind the rule's back; the recipe is DATA002's error."""
    from molt_compile.rules import run_rules

    recipe = rl(actor={"packing": True}, data={"max_images_per_prompt": 1})
    d = derive(recipe)
    assert d.value("actor.packing") is True and d["actor.packing"].forced is False
    assert "DATA002" in {x.code for x in run_rules(recipe, d, None) if x.severity == "error"}


def test_lowering_reads_row_multiple_and_value_clip_from_derive() -> None:
    """Issue 31: the lcm of the FSDP worlds and the critic's value clip are derived values with reasons."""
    d = derive(rl(actor={"nodes": 1, "gpus_per_node": 4}, ref={"path": "/t", "nodes": 1, "gpus_per_node": 6},
                  algo={"estimator": "gae"}))
    assert d.value("fsdp.row_multiple") == 12 and "actor 4, ref 6, critic 4" in d["fsdp.row_multiple"].reason
    assert d.value("critic.value_clip") == 0.2 and "default" in d["critic.value_clip"].reason


# ------------------------------------------------------------------------------ KL (B2)
def test_distill_explicit_coef_is_kept_and_forcing_is_marked() -> None:
    d = derive(rl(algo={"estimator": "on_policy_distill", "kl": {"coef": 0.5, "estimator": "k3", "use_loss": True}},
                  ref={"path": "/t"}))
    assert d.value("algo.kl.coef") == 0.5
    assert d["algo.kl.estimator"].forced is True and d.value("algo.kl.estimator") == "k1"
    assert d["algo.kl.use_loss"].forced is True and d.value("algo.kl.use_loss") is False


def test_plain_kl_passthrough() -> None:
    d = derive(rl(algo={"kl": {"coef": 0.001, "estimator": "k2", "use_loss": True, "target": 0.1}}, ref={}))
    assert (d.value("algo.kl.coef"), d.value("algo.kl.estimator"), d.value("algo.kl.use_loss")) == (0.001, "k2", True)
    assert d.value("algo.kl.adaptive") is True
    assert not any(dv.forced for dv in d.values())


# ------------------------------------------------------------------------------ steps, schedule (B7, B10, B11, B12)
def _prompts(tmp_path, n: int, name: str = "p.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(n)) + "\n\n")
    return str(path)


def test_steps_without_force_on_policy(tmp_path) -> None:
    p = _prompts(tmp_path, 103)
    d = derive(rl(data={"prompts": p}, rollout={"batch_size": 10, "n_samples_per_prompt": 4},
                  train={"batch_size": 20, "episodes": 3, "max_epochs": 2},
                  actor={"optimizer": {"warmup_ratio": 0.1}}))
    assert d.value("data.prompt_count") == 103  # blank lines are not prompts
    assert d.value("train.steps_per_episode") == 10
    assert d.value("train.total_steps") == 30
    assert d.value("train.optimizer_steps") == 103 * 4 // 20 * 3 * 2  # B11 = 120
    assert d.value("train.optimizer_steps_per_step") == 40 // 20 * 2
    assert d.value("actor.scheduler_steps") == 120
    assert d.value("actor.warmup_steps") == 12  # ceil(120 * 0.1)


def test_steps_with_force_on_policy_and_caps(tmp_path) -> None:
    a = _prompts(tmp_path, 50, "a.jsonl")
    b = tmp_path / "b.json"
    b.write_text(json.dumps([{"prompt": "x"}] * 30))
    d = derive(rl(data={"prompts": f"{a},{b}", "max_samples": 40}, rollout={"batch_size": 8},
                  train={"force_on_policy": True, "episodes": 2}))
    assert d.value("data.prompt_count") == 40  # per-source caps: 40 + 30 = 70, then the blend cap: 40
    assert "capped at max_samples 40" in d["data.prompt_count"].reason
    assert d.value("train.optimizer_steps") == 40 // 8 * 2 * 1
    assert d.value("train.optimizer_steps_per_step") == 1


@pytest.mark.parametrize(("force", "kl", "ref", "expected"), [
    (False, 0.0, None, True),  # π_old from the no-grad forward, as always
    (True, 0.0, None, False),  # B28: the training forward's detached log-probs are π_old
    (True, 0.01, None, True),  # KL to the rollout policy is taken against π_old
    (True, 0.0, {"placement": "colocate"}, True),  # a reference model's KL needs π_old too
])
def test_old_logprob_pass_is_skipped_only_under_force_on_policy_without_kl(force, kl, ref, expected) -> None:
    extra = {} if ref is None else {"ref": ref}
    d = derive(rl(train={"force_on_policy": force}, algo={"kl": {"coef": kl}}, **extra))
    assert d.value("actor.old_logprob_pass") is expected
    assert ("B28" in d["actor.old_logprob_pass"].reason) is force


@pytest.mark.parametrize(("train", "kl", "expected"), [
    ({"batch_size": 64, "max_epochs": 1}, 0.0, False),  # one optimizer step per rollout batch: π_old = π
    ({"batch_size": 64, "max_epochs": 2}, 0.0, True),  # the second epoch sees moved weights
    ({"batch_size": 32, "max_epochs": 1}, 0.0, True),  # two windows: the second sees moved weights
    ({"batch_size": 64, "max_epochs": 1}, 0.01, True),  # KL in the reward is taken against π_old
])
def test_old_logprob_pass_is_skipped_when_a_rollout_batch_makes_one_optimizer_step(train, kl, expected) -> None:
    d = derive(rl(rollout={"batch_size": 8, "n_samples_per_prompt": 8}, train=train, algo={"kl": {"coef": kl}}))
    assert d.value("rollout.samples_per_step") == 64
    assert d.value("actor.old_logprob_pass") is expected
    assert ("one optimizer step per rollout batch" in d["actor.old_logprob_pass"].reason) is (train["batch_size"] == 64
                                                                                         and train["max_epochs"] == 1)


def test_gae_freezing_steps_shorten_actor_schedule(tmp_path) -> None:
    p = _prompts(tmp_path, 64)
    d = derive(rl(data={"prompts": p}, algo={"estimator": "gae"}, actor={"freezing_steps": 3},
                  rollout={"batch_size": 8, "n_samples_per_prompt": 2}, train={"batch_size": 16}))
    assert d.value("train.optimizer_steps") == 8
    assert d.value("actor.scheduler_steps") == 5 and d.value("critic.scheduler_steps") == 8  # B10
    assert d.value("critic.warmup_steps") == 1  # ceil(8 * 0.03)


def test_json_split_dict_counts(tmp_path) -> None:
    p = tmp_path / "d.json"
    p.write_text(json.dumps({"train": [1, 2, 3], "test": [1]}))
    assert derive(rl(data={"prompts": str(p)})).value("data.prompt_count") == 3
    assert derive(rl(data={"prompts": str(p), "split": "test"})).value("data.prompt_count") == 1


@pytest.mark.parametrize(("prompts", "why"), [
    ("/nonexistent/x.jsonl", "not on this machine"),
    ("/data/x.parquet", "not on this machine"),
    ("hub-org/some-dataset", "not on this machine"),
])
def test_uncountable_datasets_give_none_with_reason(prompts: str, why: str) -> None:
    d = derive(rl(data={"prompts": prompts}))
    assert d.value("data.prompt_count") is None and why in d["data.prompt_count"].reason
    assert d.value("train.total_steps") is None and d.value("actor.warmup_steps") is None


def test_interleaved_prompts_are_counted_with_the_seed_and_steps_follow(tmp_path) -> None:
    # Molt's blend (all_exhausted: the short source wraps until the long one is drawn through) is longer than either
    # source and depends on train.seed; the step counts follow it (runtime test: the generator yields the same rows).
    p, q = _prompts(tmp_path, 40), _prompts(tmp_path, 10, "q.jsonl")
    counts = {}
    for seed in (1, 2):
        d = derive(rl(data={"prompts": f"{p},{q}", "prompt_probs": [0.5, 0.5]}, train={"seed": seed}))
        counts[seed] = d.value("data.prompt_count")
        assert "train.seed" in d["data.prompt_count"].inputs and "interleaved" in d["data.prompt_count"].reason
        assert d.value("train.total_steps") is not None and "data.count_at_start" not in d
    assert all(n > 50 for n in counts.values()) and counts[1] != counts[2]


def test_relative_dataset_resolves_against_recipe_file() -> None:
    # tests/data/plan/rl_omni3_30b.yaml names prompts_100.jsonl next to itself; cwd is wherever pytest runs
    _, d, _ = from_file(PLAN_DATA / "rl_omni3_30b.yaml")
    assert d.value("data.prompt_count") == 100
    assert "prompts_100.jsonl 100" in d["data.prompt_count"].reason


def test_cadences_and_retention() -> None:
    d = derive(rl(ckpt={"every": -1, "keep": 5}))
    assert d.value("ckpt.every") is None and "never" in d["ckpt.every"].reason
    assert d.value("ckpt.dcp_keep") == 5  # B7
    assert derive(rl(ckpt={"dcp_keep": 2})).value("ckpt.dcp_keep") == 2
    assert derive(rl(eval={"dataset": "/e.jsonl"})).value("eval.every") is None  # -1: never in RL


def test_sft_eval_minus_one_is_once_per_epoch(tmp_path) -> None:
    p = _prompts(tmp_path, 90)
    d = derive(sft(data={"dataset": p}, train={"batch_size": 16, "micro_batch_size": 2, "max_epochs": 3},
                   eval={"dataset": p}))
    assert d.value("train.steps_per_epoch") == 5 and d.value("train.total_steps") == 15
    assert d.value("eval.every") == 5 and "once per epoch" in d["eval.every"].reason
    assert d.value("actor.grad_accum") == 1


# ------------------------------------------------------------------------------ cluster and backend
def test_cpu_cluster() -> None:
    d = derive(rl(cluster={"gpu": "cpu", "gpus_per_node": 4}, actor={"gpus_per_node": 2}))
    assert d.value("cluster.device") == "cpu" and d.value("cluster.device_resource") == "device_slot"
    assert d.value("dist.backend") == "gloo" and d.value("weight_sync.method") == "gloo_broadcast"
    assert d.value("cluster.cpus_per_node") is None


def test_gpu_backend_and_catalog_cpus() -> None:
    d = derive(rl(actor={"offload": "full"}))
    assert d.value("dist.backend") == "cuda:nccl,cpu:gloo"  # B26
    assert d.value("cluster.cpus_per_node") == 224  # DGX H100 node profile in the GPU catalog
    assert derive(rl(cluster={"cpus_per_node": 64})).value("cluster.cpus_per_node") == 64


# ------------------------------------------------------------------------------ the Derived API
def test_derived_api() -> None:
    d = derive(rl())
    assert isinstance(d, Derived) and len(d) == len(list(d.values())) == len(d.names())
    assert d["actor.dp"].value == d.value("actor.dp") == 8
    with pytest.raises(KeyError, match="did you mean 'actor.dp'"):
        d.value("actor.dpp")
    assert d.value("nope", default=3) == 3
    assert d.get("nope") is None and "actor.dp" in d
    assert all(dv.reason for dv in d.values()), "every derived value has a reason"
    json.dumps(d.to_list())  # JSON-serializable values


def test_every_documented_name_is_derived_for_some_recipe() -> None:
    """The module docstring's table and what derive() produces agree (names are an interface)."""
    import re

    import molt_compile.derive as mod

    documented = set()
    for row in mod.__doc__.splitlines():
        if row.startswith("| `"):
            documented |= set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)`", row.split("|")[1]))
    produced = set()
    moe = {"path": "Qwen/Qwen3-30B-A3B", "arch": "qwen3-30b-a3b"}  # an AutoModel custom model: B20's model.attn
    for recipe in (rl(), rl(algo={"estimator": "gae"}, ref={}), sft(), sft(model=moe)):
        produced |= set(derive(recipe).names())
    assert documented - produced == set(), "documented but never derived"
    assert produced - documented == set(), "derived but not documented"


def test_derive_imports_nothing_heavy() -> None:
    code = ("import sys, molt_compile.derive, molt_compile.lower, molt_compile.render_plan, molt_compile.diff, "
            "schemas.plan; print([m for m in ('torch','ray','vllm','transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_default_attention_on_an_automodel_custom_model_runs_as_sdpa() -> None:
    """B20: without packing, the default flash_attention_2 runs as sdpa on an AutoModel custom model (the plan's
    model.attn, which the capability table accepts); te stays te, and the HF path keeps the recipe's value."""
    moe = {"path": "Qwen/Qwen3-30B-A3B", "arch": "qwen3-30b-a3b"}
    assert derive(sft(model=moe)).value("model.attn") == "sdpa"
    assert "B20" in derive(sft(model=moe))["model.attn"].reason
    assert "model.attn" not in derive(sft(model={**moe, "attn": "te"}))
    assert "model.attn" not in derive(sft(model={**moe, "backend": "hf"}))
    assert "model.attn" not in derive(rl())


# ------------------------------------------------------------------------------ model.compile_layers (issue 29)
@pytest.mark.parametrize(
    "recipe, sets, expected, why",
    [
        ("recipes/qwen3_4b_math.yaml", (), True, "on (a dense text model on the hf backend on GPUs)"),
        ("recipes/sft_qwen3_4b.yaml", (), True, "on (a dense text model"),
        ("recipes/qwen3_4b_math.yaml", ("model.compile_layers=false",), False, "set in the recipe"),
        ("recipes/qwen3_4b_math.yaml", ("actor.lora.dim=8",), False, "LoRA layers are not measured"),
        ("recipes/demo_math.yaml", (), False, "CPU cluster"),
        ("recipes/demo_math.yaml", ("model.compile_layers=true",), True, "set in the recipe"),
        ("recipes/qwen3_6_35b_geo3k.yaml", (), False, "automodel backend"),
        ("recipes/qwen3_6_35b_geo3k.yaml", ("model.backend=hf",), False, "MoE / VLM layers are not measured"),
    ],
)
def test_compiled_layers_default_on_where_measured(recipe, sets, expected, why) -> None:
    _, d, _ = from_file(ROOT / recipe, sets)
    assert d.value("model.compile_layers") is expected
    assert why in d["model.compile_layers"].reason
