"""The vLLM rollout engine: vLLM's async engine (`AsyncLLM`) in a Ray actor, token ids in and out.

Everything the engine is built from comes from the plan's `EnginesPlan` (dtype, context length, seed, executor,
logprobs mode, prefix caching, the recipe's extra engine args); nothing is defaulted here.

- `generate` sends a `TokensPrompt` and asks for the sampled token's logprob only (`logprobs=0`), final output
  only, no detokenisation: the runners own the tokenizer. Under score centering it asks for `logprobs=k`: with
  the plan's `processed_logprobs` mode vLLM takes the top-k and the sampled token's log-prob from the same
  processed (tempered) log-softmax it samples from (`v1/sample/sampler.py`).
- `pause`/`resume` use vLLM's scheduler pause in `keep` mode: requests in flight are frozen and continue after the
  weight update (partial rollout), new requests queue. Nothing is aborted or drained: `pause_generation(mode="keep",
  clear_cache=False)` sets the scheduler to PAUSED_ALL (no step runs) and returns once the outputs already sampled
  have been sent; `resume_generation` lets the same requests be scheduled again.
- Per-token policy versions: `receive_weights` ends with `finish_weight_update(weight_version=str(version))`, which
  sets the engine core's weight label; the core stamps every step's outputs with it and the output processor keeps,
  per request, the spans of output tokens sampled under each label (`CompletionOutput.weight_versions`, vLLM 0.32).
  `generate` turns them into `GenerateOutput.policy_versions`, one per token.
- Weight sync goes through vLLM's weight-transfer API with the `molt_broadcast` backend (`vllm_worker`):
  `join_weight_sync` makes every worker join the trainer's broadcast group once; `receive_weights` runs one
  start/update/finish round (each worker receives the buckets and loads them as they arrive), then resets the
  prefix cache *including* running requests: they are preempted and their KV recomputed under the new weights, so
  no cached block of the old policy is ever reused. The tokens they had sampled stay (with the old version and the
  old policy's logprobs: what the IS correction needs); only their KV is recomputed when they are rescheduled.
- a VLM prompt (`images`) goes in with each run of image placeholders collapsed to one (`runtime.vlm`).
- Routing replay (R3, `EnginesPlan.routed_experts`): `GenerateOutput.routed_experts` is (prompt + generated - 1,
  MoE layers, top_k) int16, the hf engine's layout. On CPU (`routing_hook`) Molt's worker extension captures it
  (`vllm_routing`: started once before the first request, read back per request by the key in its
  `SamplingParams.extra_args`); elsewhere vLLM returns it (`enable_return_routed_experts`, Model Runner V2) with a
  row per decoder layer, of which the MoE layers' are kept.
- `score` uses `prompt_logprobs=0`: log-softmax of the raw logits, i.e. temperature 1, like the trainer's probe.

vLLM's engine core is a spawned process (multiprocessing `spawn`): inside a Ray actor that is safe; a plain script
that builds this class must guard its entry point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.agents.types import UNKNOWN_VERSION, GenerateOutput
from runtime.engines.weights import image_token_id, image_wrapper_ids, tied_embeddings
from runtime.vlm import collapse_image_runs

if TYPE_CHECKING:
    from runtime.weight_sync import JoinMessage
    from schemas.plan import EnginesPlan

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def _top_k(steps, k: int):
    """(A, k) ids and log-probs of each position's k most likely tokens, most likely first. vLLM's entry of a
    position holds its top-k (ranks 1..k) plus the sampled token when that ranks lower: the k largest values."""
    import numpy as np

    ids = np.zeros((len(steps), k), dtype=np.int64)
    lps = np.zeros((len(steps), k), dtype=np.float32)
    for i, step in enumerate(steps):
        best = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:k]
        if len(best) != k:
            raise RuntimeError(f"vLLM returned {len(best)} top log-probs for k={k} (max_logprobs too small?)")
        ids[i] = [tok for tok, _ in best]
        lps[i] = [lp.logprob for _, lp in best]
    return ids, lps


class VllmEngine:
    def __init__(self, engines: EnginesPlan, index: int, model_path: str):
        if Path(model_path).is_dir():  # a local checkpoint: never let vLLM reach for the hub (set before import)
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from runtime.engines import vllm_worker  # registers the weight-transfer backend in this process too

        self.index = index
        self.model_path = model_path
        self.tied = tied_embeddings(model_path)
        self.image_token_id = image_token_id(model_path) if engines.max_images_per_prompt > 0 else None
        self.image_wrapper = image_wrapper_ids(model_path) if engines.max_images_per_prompt > 0 else None
        args = AsyncEngineArgs(
            model=model_path,
            dtype=engines.dtype,
            max_model_len=engines.max_model_len,
            seed=engines.seeds[index],
            tensor_parallel_size=engines.tp,
            pipeline_parallel_size=engines.pp,
            data_parallel_size=engines.dp,
            distributed_executor_backend=engines.executor,
            enable_expert_parallel=engines.expert_parallel,
            gpu_memory_utilization=engines.gpu_memory_utilization,
            enforce_eager=engines.enforce_eager,
            enable_prefix_caching=engines.prefix_caching,
            logprobs_mode=engines.logprobs_mode,
            worker_extension_cls="runtime.engines.vllm_worker.WeightSyncExtension",
            weight_transfer_config={"backend": vllm_worker.BACKEND},
            **engines.extra_engine_args,
        )
        t0 = time.perf_counter()
        self.engine = AsyncLLM.from_engine_args(args)
        self.init_s = time.perf_counter() - t0
        self._version = 0
        self._request_ids = itertools.count()
        self.routed_experts, self.routing_hook = engines.routed_experts, engines.routing_hook
        self._moe_layers: asyncio.Future | None = None

    def _routing_ready(self) -> asyncio.Future:
        """Once per engine, before the first request: the capture bound in every worker (`routing_hook`), or the
        MoE layers' rows of vLLM's own output; each worker answers the MoE layers' decoder-layer indices."""
        if self._moe_layers is None:
            async def start():
                if self.routing_hook:
                    await self.engine.collective_rpc("molt_routing_start")
                return (await self.engine.collective_rpc("molt_moe_layer_ids"))[0]

            self._moe_layers = asyncio.ensure_future(start())
        return self._moe_layers

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       session_id: str, logprobs: bool, images: list | None = None,
                       top_logprobs: int = 0, min_tokens: int = 0) -> GenerateOutput:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from runtime.engines.vllm_routing import KEY

        request_id = f"{session_id}:{next(self._request_ids)}"
        moe_layers = await self._routing_ready() if self.routed_experts else None
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature,
                                top_p=top_p, logprobs=top_logprobs or (0 if logprobs else None), detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY,
                                extra_args={KEY: request_id} if self.routing_hook else None)
        if images:  # expanded placeholders collapse to one per image; vLLM's processor expands them identically
            collapsed = collapse_image_runs(list(prompt_ids), self.image_token_id, self.image_wrapper)
            prompt = TokensPrompt(prompt_token_ids=collapsed, multi_modal_data={"image": list(images)})
        else:
            prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        final = await self._final(prompt, params, request_id)
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        lps: list[float] = []
        if logprobs and completion.logprobs is not None:
            lps = [step[tok].logprob for tok, step in zip(token_ids, completion.logprobs, strict=True)]
        top_ids = top_lps = None
        if top_logprobs:
            top_ids, top_lps = _top_k(completion.logprobs, top_logprobs)
        routed = None
        if self.routing_hook and completion.finish_reason in ("stop", "length"):  # an aborted one may be partial
            routed = await self._take_routing(request_id, len(prompt_ids) + len(token_ids) - 1)
        elif moe_layers is not None and completion.routed_experts is not None:  # one row per decoder layer
            routed = completion.routed_experts[:, moe_layers].astype("int16")
        return GenerateOutput(token_ids=token_ids, logprobs=lps,
                              finish_reason=_FINISH_REASONS.get(completion.finish_reason, "abort"),
                              routed_experts=routed,
                              top_ids=top_ids, top_logprobs=top_lps,
                              policy_versions=token_versions(completion.weight_versions, len(token_ids)))

    async def _final(self, prompt, params, request_id: str):
        """The request's final output. vLLM raises a bare `EngineGenerateError()` for any failure of the request
        outside the engine core (its prompt's processing, the output handler), with the reason only as its
        `__cause__`, which a Ray error's repr drops: the error raised here says what happened."""
        from vllm.v1.engine.exceptions import EngineGenerateError

        final = None
        try:
            async for out in self.engine.generate(prompt, params, request_id=request_id):
                final = out
        except EngineGenerateError as e:
            cause = e.__cause__
            if e.args or cause is None:
                raise
            raise EngineGenerateError(f"vLLM request {request_id} failed: {type(cause).__name__}: {cause}") from cause
        return final

    async def _take_routing(self, request_id: str, n: int):
        """The routing the workers captured for a finished request (any worker of its data-parallel rank has it)."""
        import numpy as np

        if n <= 0:
            return None
        found = [r for r in await self.engine.collective_rpc("molt_routing_take", args=(request_id, n))
                 if r is not None]
        if not found:
            raise RuntimeError(f"routing replay: no vLLM worker holds the routing of request {request_id}")
        data, shape = found[0]
        rows = np.frombuffer(data, dtype=np.int16).reshape(shape)
        if (rows < 0).any():  # e.g. a router traced into a compiled graph before the capture was bound
            raise RuntimeError(f"routing replay: vLLM captured no routing for {int((rows < 0).any((1, 2)).sum())} "
                               f"of the {n} positions of request {request_id}")
        return rows

    async def score(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = await self._final(TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                  f"score:{next(self._request_ids)}")
        # prompt_logprobs[0] is None (no context); entry i maps the prompt token i to its logprob.
        return [step[tok].logprob for tok, step in zip(token_ids[1:], final.prompt_logprobs[1:], strict=True)]

    async def pause(self) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def join_weight_sync(self, join: JoinMessage) -> None:
        """Every worker joins the weight-sync group (blocks until the trainer's rank 0 and all peers have joined)."""
        from dataclasses import asdict, replace

        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from runtime.weight_sync import tied_aliases

        join = replace(join, aliases=tied_aliases(join.tensor_metas(), self.tied))
        # vLLM carries init info to its workers as a dict; the worker extension rebuilds the JoinMessage
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=asdict(join)))

    async def receive_weights(self, version: int) -> dict[str, Any]:
        """One sync: every worker receives the streamed buckets and loads them; worker 0's numbers are returned."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.start_weight_update()
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
        await self.engine.finish_weight_update()
        # Independent once the weights are in (the engine stays paused until the driver resumes it), so one round
        # trip instead of three: the version labels the tokens sampled from now on; the cache reset preempts running
        # requests so their KV is recomputed with the new weights (see the module docstring); the numbers.
        _, _, stats = await asyncio.gather(self.engine.update_weight_version(str(version)),
                                           self.engine.reset_prefix_cache(reset_running_requests=True),
                                           self.engine.collective_rpc("molt_weight_sync_stats"))
        self._version = version
        return stats[0]

    async def weights_version(self) -> int:
        return self._version

    async def init_seconds(self) -> float:
        return self.init_s

    async def shutdown(self) -> None:
        """Stop the engine core and its workers (they also exit by themselves when this actor dies)."""
        self.engine.shutdown()


def token_versions(spans, n_tokens: int) -> list[int]:
    """Per generated token, the weights version that sampled it, from vLLM's `CompletionOutput.weight_versions`
    (spans `[start, end)` of output tokens per version label; the label is `str(version)` after a sync and
    vLLM's `"default"` before the first one, i.e. version 0, the checkpoint the engine started from)."""
    if spans is None:  # vLLM labels every step's output; only a request aborted before any output has none
        return [UNKNOWN_VERSION] * n_tokens
    out: list[int] = []
    for span in spans:
        out.extend([0 if span.version == "default" else int(span.version)] * (span.end - span.start))
    if len(out) != n_tokens:
        raise RuntimeError(f"vLLM's weight-version spans cover {len(out)} of {n_tokens} generated tokens")
    return out
