"""Starting the plan's roles on the Ray cluster, as the plan says: placement groups, the `.options()` of each
role's actors, the rollout engines and their router, the agent runners, and the weight-sync probe. Shared by the RL
loop (runtime/loop.py) and the eval-only run (runtime/eval_only.py). The generator takes `plan.rl` as it is."""

from __future__ import annotations

from pathlib import Path

import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from runtime import env_refs
from runtime.runners import AgentRunnerActor
from runtime.supervisor import RunAborted, Supervisor
from schemas.plan import Plan


def create_placement_groups(plan: Plan, sup: Supervisor) -> dict[str, object]:
    pgs = {p.name: placement_group(p.bundles, strategy=p.strategy, name=f"{plan.name}-{p.name}")
           for p in plan.placement_groups}
    try:
        sup.get([pg.ready() for pg in pgs.values()])
    except RunAborted:
        for pg in pgs.values():
            ray.util.remove_placement_group(pg)
        raise
    return pgs


def role_options(plan: Plan, role_name: str) -> dict:
    role = plan.role(role_name)
    opts = {"num_cpus": role.ray_options.num_cpus, "num_gpus": role.ray_options.num_gpus}
    if role.ray_options.resources:
        opts["resources"] = dict(role.ray_options.resources)
    if role.env:
        opts["runtime_env"] = {"env_vars": env_refs.for_actors(role.env)}
    if role.scheduling == "SPREAD":
        opts["scheduling_strategy"] = "SPREAD"
    return opts


def actor_options(plan: Plan, role_name: str, index: int, pgs: dict) -> dict:
    """`.options()` of instance `index`: the role's resources, in its bundle of the placement group.

    FSDP rank r goes to the r-th bundle in node-sorted order (Ray PACK does not promise bundle order = node order).
    """
    role = plan.role(role_name)
    opts = role_options(plan, role_name)
    pg = pgs[role.placement_group]
    bundle = role.instances[index].bundle_indices[0]
    if role_name in ("actor", "ref", "critic"):
        bundle = _node_sorted_bundles(pg)[bundle]
    opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                   placement_group_bundle_index=bundle)
    return opts


def start_fsdp_group(start, plan: Plan, role_name: str, world: int, what: str, pgs: dict, sup: Supervisor,
                     started) -> object:
    """One FSDP role's ranks (`start`: the trainer's, critic's or separate reference's group starter) in their
    start-up phase, on the run's tear-down list, each rank watched by name (`what`: trainer, critic, reference)."""
    with sup.phase(f"{what} start-up", role_name, role_name):
        group = start(plan.rl, [actor_options(plan, role_name, r, pgs) | {"name": f"{plan.name}.{role_name}[{r}]"}
                                for r in range(world)], get=sup.get)
    started.groups.append(group)
    for r, w in enumerate(group.workers):
        sup.watch(f"{role_name}[{r}] ({what} rank {r})", w, w.ready.remote, role_name)
    return group


def _node_sorted_bundles(pg) -> list[int]:
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    return sorted(nodes, key=lambda b: (nodes[b], b))


def start_rollout(plan: Plan, pgs: dict, sup: Supervisor, wait: bool = True) -> tuple[list, object]:
    """The engines (one actor per engine, in its bundle) and the router the runners call them through. Without
    `wait` the engines are still loading their model (the caller waits on `engines_ready`)."""
    from runtime.engines import create_engines, engines_ready
    from runtime.engines.router import Router

    rl = plan.rl
    role = plan.role("rollout.engine")
    engines = create_engines(rl.engines, role, rl.model.path, pgs[role.placement_group],
                             log_dir=Path(rl.logging.out_dir) / "logs",
                             names=[f"{plan.name}.engine[{i}]" for i in range(len(role.instances))])
    if wait:
        sup.get(engines_ready(engines))  # init errors surface here, not at a generate
    return engines, Router(engines, rl.engines.router_policy)


def start_runners(plan: Plan, router) -> list:
    rl = plan.rl
    cls = ray.remote(AgentRunnerActor)
    # Named, so that operators (and the runner-kill test) can find a runner: `ray.get_actor("<job>.runner[i]")`.
    # Ray restarts a dead runner without limit: the generator budgets restarts per time window
    # (agent.max_restarts per agent.restart_window_s) and gives up a runner past it (runtime/generator.py).
    return [cls.options(**role_options(plan, "runner"), max_restarts=-1,
                        name=runner_name(plan, i)).remote(
        rl.agent.path, rl.model.path, router, rl.data.max_len, env_refs.for_actors(rl.agent.env), rl.data.apply_chat_template,
        rl.data.max_images_per_prompt, step_timeout_s=rl.agent.step_timeout_s, episode_timeout_s=rl.agent.episode_timeout_s)
        for i in range(rl.agent.runners)]


def runner_name(plan: Plan, index: int) -> str:
    return f"{plan.name}.runner[{index}]"


def probe_sequence(plan: Plan) -> list[int]:
    """A fixed token sequence for the post-sync check: the first prompt of the dataset, rendered, plus its label."""
    from transformers import AutoTokenizer

    from runtime.datasource import read_prompts
    from runtime.runners import render

    rl = plan.rl
    tok = AutoTokenizer.from_pretrained(rl.model.path)
    prompt, label, tools = read_prompts(rl.data.prompts[0], rl.data.split, rl.data.input_key, rl.data.label_key,
                                        rl.data.tools_key, 1)[0]
    text = render(tok, prompt, rl.data.apply_chat_template, tools) + ("" if label is None else str(label))
    return tok.encode(text, add_special_tokens=False)[-rl.data.max_len:]
