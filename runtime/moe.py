"""MoE routers of a transformers or nemo-automodel model: find them, freeze them, record and replay their choices,
and their aux losses.

A router here is one of two kinds of module, each holding a `weight` of (experts, hidden) for the flattened tokens of
one MoE layer:
- transformers' top-k router (`Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`, `MixtralTopKRouter`, ...), whose forward
  returns `(logits, top-k weights, top-k indices)`;
- nemo-automodel's `Gate` (its own MoE implementations, the `automodel` backend), whose forward takes
  `(x, token_mask, cp_mesh)` and returns `(weights, indices, aux_loss)`, and which routes its top-k through its
  `router_replay` handle (nemo-automodel's R3 seam: `replay_selection`).
Everything here is a forward hook on those modules (or, for a `Gate`, its `router_replay` handle) inside a `with`
block, so no model class is forked and nothing stays patched after the block.

- `record(model)`: the experts every token was routed to, per MoE layer, as the engine saw them (the hf engine).
- `replay(model, targets)`: R3 (`reference/molt_rules.md` F13): each router's top-k indices are replaced by the
  recorded ones and its top-k weights recomputed from its own logits at those experts (softmax, renormalised when
  the router normalises), so the gradient still reaches the router weight. A token whose recorded row holds a -1
  (no routing captured, e.g. the last token of an episode or padding) keeps its live routing.
- `aux_losses(model)`: collects the router logits of one forward and returns the Switch load-balancing loss and the
  router z-loss over the real tokens.

Routing tensors are (tokens, layers, top_k) int16 with -1 for "not captured", tokens in the order the forward
flattens them (row-major over the (b, w) input, or the packed row).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

NO_ROUTING = -1
"""Sentinel of a token with no captured routing: the trainer keeps its live top-k there."""


def _is_gate(module: nn.Module) -> bool:
    """nemo-automodel's MoE `Gate`, FSDP2-wrapped or not (matched by class name and its replay seam, so that
    nemo_automodel stays an optional import)."""
    return hasattr(module, "router_replay") and any(c.__name__ == "Gate" for c in type(module).__mro__)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k router modules, in layer order (one per MoE layer)."""
    return [m for m in model.modules()
            if (type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")) or _is_gate(m)]


def blocks(module: nn.Module) -> list[nn.Module]:
    """The MoE blocks in `module`: the modules whose forward calls a router (each router's parent)."""
    found = {id(r) for r in routers(module)}
    return [m for m in module.modules() if any(id(c) in found for c in m.children())]


def _top_k(router: nn.Module) -> int:
    return router.topk if _is_gate(router) else router.top_k


def _logits_site(router: nn.Module) -> nn.Module:
    """The module whose forward sees a router's logits: a `Gate` returns only weights and indices, and hands its
    logits to its parameterless `routing_core` child (the automodel backend routes every gate through it)."""
    return router.routing_core if _is_gate(router) else router


def is_moe(model: nn.Module) -> bool:
    return bool(routers(model))


def router_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for r in routers(model) for p in r.parameters()]


def freeze_routers(model: nn.Module) -> int:
    """`requires_grad=False` on every router parameter (Molt F11: matched by type, not by name); returns how many."""
    params = router_parameters(model)
    if not params:
        raise RuntimeError("actor.freeze.moe_router is on but the model has no MoE router")
    for p in params:
        p.requires_grad_(False)
    return len(params)


def shape_of(model: nn.Module) -> tuple[int, int]:
    """(MoE layers, top_k) of the model's routers."""
    rs = routers(model)
    return len(rs), (_top_k(rs[0]) if rs else 0)


@contextlib.contextmanager
def record(model: nn.Module, into: Tensor | None = None) -> Iterator[list[Tensor | None]]:
    """Within the block, `captured[layer]` is the last forward's (tokens, top_k) indices of that layer.

    With `into` (a preallocated (layers, max_tokens, top_k) buffer), each router also copies its indices into
    `into[layer, :tokens]` in place: a CUDA graph captured inside the block replays that copy.
    """
    captured: list[Tensor | None] = [None] * len(routers(model))

    def hook_for(layer: int):
        def hook(module, args, output):
            indices = output[1] if _is_gate(module) else output[2]
            captured[layer] = indices
            if into is not None:
                into[layer, :indices.shape[0]].copy_(indices)
        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers(model))]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


class Replay:
    """The targets of one forward (and its recompute in backward): set `targets` before each forward."""

    def __init__(self, layers: int):
        self.layers = layers
        self.targets: Tensor | None = None     # (tokens, layers, top_k), NO_ROUTING where not captured
        self.known = 0      # (token, layer) routing rows replayed
        self.agreed = 0     # of those, the ones whose live top-k (as a set) was the recorded one
        self.selected: list[Tensor | None] = [None] * layers   # what each router finally used, last forward

    def choose(self, layer: int, live: Tensor) -> Tensor:
        """The experts layer `layer` uses: the recorded ones where a row was captured, its live top-k elsewhere."""
        if self.targets is None:
            self.selected[layer] = live
            return live
        target = self.targets[:, layer].to(device=live.device, dtype=live.dtype)
        if target.shape != live.shape:
            raise ValueError(f"routing replay: layer {layer} routes {tuple(live.shape)} tokens x top-k, the "
                             f"recorded routing has {tuple(target.shape)}")
        missing = (target < 0).any(-1, keepdim=True)
        chosen = torch.where(missing, live, target)
        with torch.no_grad():
            same = (live.sort(-1).values == target.sort(-1).values).all(-1)
            self.known += int((~missing[:, 0]).sum())
            self.agreed += int((same & ~missing[:, 0]).sum())
        self.selected[layer] = chosen
        return chosen

    def hook_for(self, layer: int):
        def hook(module, args, output):
            logits, _, live = output
            chosen = self.choose(layer, live)
            if self.targets is None:
                return output
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return hook


class _GateReplay:
    """A `Gate`'s `router_replay` handle: the gate passes its live top-k through `apply` and weighs the experts it
    gets back with its own scores (nemo-automodel's `replay_selection`; unlike its own handle, rows recorded as
    NO_ROUTING keep the live choice, Molt's sentinel replay, F13)."""

    def __init__(self, state: Replay, layer: int):
        self.state, self.layer = state, layer

    def apply(self, indices: Tensor) -> Tensor:
        return self.state.choose(self.layer, indices)


@contextlib.contextmanager
def replay(model: nn.Module) -> Iterator[Replay]:
    """Within the block, every router uses `state.targets` (set per forward) instead of its own top-k."""
    rs = routers(model)
    if not rs:
        raise RuntimeError("routing_replay is on but the model has no MoE router")
    state = Replay(len(rs))
    handles, gates = [], []
    for i, r in enumerate(rs):
        if _is_gate(r):
            gates.append((r, r.router_replay))
            r.router_replay = _GateReplay(state, i)
        else:
            handles.append(r.register_forward_hook(state.hook_for(i)))
    try:
        yield state
    finally:
        for h in handles:
            h.remove()
        for gate, handle in gates:
            gate.router_replay = handle


def flat_targets(routed: Tensor, attention_mask: Tensor, packed: bool) -> Tensor:
    """(b, w, layers, k) routing of padded rows -> the (tokens, layers, k) order the forward flattens them in."""
    if packed:
        return routed[attention_mask.bool()]
    return routed.reshape(-1, *routed.shape[2:])


# ------------------------------------------------------------------------------------------------- aux losses
class RouterLogits:
    """Collects each router's logits of one forward (the tokens it routed, flattened)."""

    def __init__(self):
        self.logits: list[Tensor] = []

    def hook(self, module, args, output):
        self.logits.append(args[0] if type(module).__name__ == "_GateRoutingCore" else output[0])


@contextlib.contextmanager
def collect_logits(model: nn.Module) -> Iterator[RouterLogits]:
    sink = RouterLogits()
    handles = [_logits_site(r).register_forward_hook(sink.hook) for r in routers(model)]
    try:
        yield sink
    finally:
        for h in handles:
            h.remove()


def load_balancing_loss(logits: list[Tensor], top_k: int, token_mask: Tensor) -> Tensor:
    """Switch-Transformer balance loss, mean over layers: E * sum_e f_e * P_e over the real tokens, where f_e is the
    share of top-k assignments to expert e and P_e its mean router probability (1 when perfectly balanced)."""
    losses = []
    weight = token_mask.float()
    n = weight.sum().clamp(min=1)
    for layer_logits in logits:
        probs = torch.softmax(layer_logits.float(), dim=-1)
        experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices
        assigned = torch.zeros_like(probs).scatter_(-1, chosen, 1.0)
        share = (assigned * weight[:, None]).sum(0) / (n * top_k)
        mean_prob = (probs * weight[:, None]).sum(0) / n
        losses.append(experts * (share * mean_prob).sum())
    return torch.stack(losses).mean()


def z_loss(logits: list[Tensor], token_mask: Tensor) -> Tensor:
    """Router z-loss (ST-MoE): mean over real tokens and layers of logsumexp(router logits)^2."""
    weight = token_mask.float()
    n = weight.sum().clamp(min=1)
    return torch.stack([((torch.logsumexp(lg.float(), dim=-1) ** 2) * weight).sum() / n for lg in logits]).mean()
