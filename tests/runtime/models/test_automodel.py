"""The automodel backend on CPU (runtime/models/automodel.py): nemo-automodel's own Qwen3-MoE, built and FSDP2-sharded
in a one-rank gloo world, against transformers' implementation of the same checkpoint.

- it is nemo-automodel's class (its `Gate` routers and grouped experts), and its logits are transformers';
- frozen routers (Molt F11, matched by type) stay fp32 and unchanged over optimizer steps while the experts move;
- routing replay (R3) through the gates' `router_replay` seam: with perturbed weights the replayed forward selects
  the recorded experts for every recorded token, without replay it does not, and NO_ROUTING rows keep the live
  choice; the gate weight still takes a gradient under replay;
- the aux losses read the gates' logits (nemo-automodel's own aux loss is off: the trainer adds the recipe's once).
"""

from __future__ import annotations

import pytest
import torch

from runtime import fsdp, moe
from runtime.logprobs import token_logprobs
from runtime.models import automodel, hf
from runtime.tiny_model import build_tiny_model
from schemas.plan import ModelPlan, OptimizerPlan


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "model", seed=0, vocab_size=300, experts=4,
                                experts_per_token=2, tie_word_embeddings=False))


def _plan(path: str, backend: str) -> ModelPlan:
    return ModelPlan(path=path, arch=None, backend=backend, dtype="float32", attn="sdpa", gradient_checkpoint="none",
                     compile_layers=False, disable_fast_tokenizer=False, router_dtype="float32",
                     moe_dispatcher="torch")


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, 290, (2, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # a right-padded row
    return ids, mask


def test_builds_nemo_automodels_moe_with_transformers_logits(world, checkpoint):
    model = automodel.build(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"))
    reference = hf.build(_plan(checkpoint, "hf"), checkpoint, world, torch.device("cpu"), trainable=False)
    from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM

    assert isinstance(model, Qwen3MoeForCausalLM)
    assert len(moe.routers(model)) == 2 and all(type(g).__name__ == "FSDPGate" for g in moe.routers(model))
    assert moe.shape_of(model) == (2, 2)
    ids, mask = _batch()
    with torch.no_grad():
        mine, theirs = token_logprobs(model, ids, mask, 1.0)[0], token_logprobs(reference, ids, mask, 1.0)[0]
    real = mask[:, 1:].bool()
    torch.testing.assert_close(mine[real], theirs[real], rtol=1e-4, atol=1e-4)


def test_frozen_gates_stay_fp32_and_unchanged_while_experts_train(world, checkpoint):
    model = automodel.build(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"),
                            freeze_router=True)
    opt = OptimizerPlan(name="adam", lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0, max_norm=1.0,
                        scheduler="constant", warmup_steps=0, total_steps=10, min_lr_ratio=0.1, muon=None)
    optimizer, scheduler = fsdp.build_optimizer(opt, model)
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    ids, mask = _batch()
    for _ in range(3):
        logprobs = token_logprobs(model, ids, mask, 1.0)[0]
        (-logprobs[mask[:, 1:].bool()].mean()).backward()
        fsdp.clipped_step(model, optimizer, scheduler, 1.0)
    after = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    gates = [n for n in after if n.endswith("mlp.gate.weight")]
    assert len(gates) == 2
    for n in gates:
        assert after[n].dtype == torch.float32 and torch.equal(after[n], before[n]), n
    assert all(not torch.equal(after[n], before[n]) for n in after if "experts" in n)


def test_replay_selects_the_recorded_experts_through_the_gate_seam(world, checkpoint):
    model = automodel.build(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"))
    ids, mask = _batch(seed=3)
    with moe.record(model) as captured, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    recorded = torch.stack([c.to(torch.int16) for c in captured], dim=1)  # (tokens, layers, k)
    with torch.no_grad():  # perturb the trained copy: its own top-k now disagrees with the rollout's
        g = torch.Generator().manual_seed(7)
        for gate in moe.routers(model):
            local = gate.weight.to_local()
            local.add_(torch.randn(local.shape, generator=g) * 3.0)
    targets = recorded.clone()
    targets[:4] = moe.NO_ROUTING  # rows the engine did not capture keep the live choice
    with moe.replay(model) as state:
        state.targets = targets
        out = model(input_ids=ids, attention_mask=mask)
        logits = out.logits if hasattr(out, "logits") else out
        logits.float().logsumexp(-1).mean().backward()
    for layer, chosen in enumerate(state.selected):
        assert torch.equal(chosen[4:].sort(-1).values, recorded[4:, layer].long().sort(-1).values)
    assert state.known == 2 * (ids.numel() - 4) and state.agreed < state.known  # without replay they differ
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in moe.routers(model))
    assert all(g.router_replay is None for g in moe.routers(model))  # nothing stays patched after the block


def test_aux_losses_read_the_gate_logits(world, checkpoint):
    model = automodel.build(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"))
    assert all(g.aux_loss_coeff == 0.0 for g in moe.routers(model))
    ids, mask = _batch()
    with moe.collect_logits(model) as sink, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert [tuple(lg.shape) for lg in sink.logits] == [(ids.numel(), 4)] * 2
    real = mask.reshape(-1).bool()
    balance = moe.load_balancing_loss(sink.logits, 2, real)
    assert 1.0 <= balance.item() < 4.0  # E * sum f_e P_e: 1 when perfectly balanced, at most E
    assert moe.z_loss(sink.logits, real).item() > 0


def test_weight_sync_and_export_see_transformers_names_and_layouts(world, checkpoint, tmp_path):
    """What the engines receive from this backend is what they receive from the hf backend: the same names, shapes
    and values (grouped experts transposed to transformers' fused layout; module order differs: nemo-automodel
    registers a layer's gate before its experts); the HF export loads in transformers with the same logits."""
    from transformers import AutoModelForCausalLM

    from runtime import ckpt, weight_sync

    model = automodel.build(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"))
    reference = hf.build(_plan(checkpoint, "hf"), checkpoint, world, torch.device("cpu"), trainable=False)
    mine, theirs = dict(automodel.hf_weights(model)), dict(hf.hf_weights(reference))
    assert {n: tuple(p.shape) for n, p in mine.items()} == {n: tuple(p.shape) for n, p in theirs.items()}
    swapped = [n for n, p in mine.items() if isinstance(p, automodel.TransposedExperts)]
    assert len(swapped) == 4  # gate_up_proj and down_proj of both layers
    for name, p in mine.items():
        local = p.local() if isinstance(p, automodel.TransposedExperts) else p.detach().to_local()
        assert torch.equal(local, theirs[name].detach().to_local()), name
    metas = weight_sync.wire_metas(automodel.hf_weights(model), "float32")
    assert sorted(m.name for m in metas) == sorted(theirs)

    out = ckpt.export_hf(str(tmp_path / "hf"), model, automodel.hf_weights, checkpoint, rank=0)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, original(input_ids=ids).logits)


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("dense") / "model", seed=0, vocab_size=300,
                                tie_word_embeddings=False))


@pytest.mark.parametrize("which", ["moe", "dense"])
def test_full_checkpointing_recomputes_inside_the_layers_hooks_with_unchanged_gradients(world, checkpoint,
                                                                                        dense_checkpoint, which):
    """nemo-automodel's layers (its Qwen3-MoE, which has no transformers checkpointing switch, and its dense Qwen3,
    which has one) run their forward under torch.utils.checkpoint (full mode) inside the layer's module hooks,
    where FSDP2 casts the inputs: the recompute in the backward calls no hook again (transformers' switch would: it
    checkpoints the whole module call, and torch 2.11's FSDP2 then skips the cast, `hf.checkpoint_layers`). The
    gradients are those of the plain run."""
    path = checkpoint if which == "moe" else dense_checkpoint
    grads, recomputed, hooked = {}, {}, {}
    for mode in ("none", "full"):
        plan = _plan(path, "automodel").model_copy(update={"gradient_checkpoint": mode})
        model = automodel.build(plan, path, world, torch.device("cpu"))
        assert any(c.__module__.startswith("nemo_automodel.") for c in type(model).__mro__)  # under FSDP2's class
        calls, hooks = [], []
        layer = automodel.decoder_layers(model)[0]
        layer.self_attn.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        layer.register_forward_pre_hook(lambda *_, hooks=hooks: hooks.append(1))
        ids, mask = _batch()
        loss = token_logprobs(model, ids, mask, 1.0)[0].mean()
        forward_calls, forward_hooks = len(calls), len(hooks)
        loss.backward()
        recomputed[mode] = len(calls) - forward_calls  # attention forwards run again in the backward
        hooked[mode] = len(hooks) - forward_hooks  # the layer's module hooks run again in the backward
        grads[mode] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert recomputed == {"none": 0, "full": 1}
    assert hooked == {"none": 0, "full": 0}
    assert grads["full"].keys() == grads["none"].keys() and grads["none"]
    for name, g in grads["full"].items():
        torch.testing.assert_close(g, grads["none"][name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_deepep_dispatcher_stops_the_job_at_start_where_it_cannot_run():
    """`model.moe_dispatcher` reaches nemo-automodel's `BackendConfig`; a DeepEP one stops the build with its reason
    on CPU ranks and where its package does not import (deep_ep is not installed here), before any MoE forward."""
    automodel.check_dispatcher("torch", torch.device("cpu"), 2)
    automodel.check_dispatcher("hybridep", torch.device("cpu"), 1)  # one rank: nemo-automodel keeps local experts
    with pytest.raises(RuntimeError, match="hybridep runs on CUDA only"):
        automodel.check_dispatcher("hybridep", torch.device("cpu"), 2)
    with pytest.raises(RuntimeError, match="deepep needs the deep_ep package"):
        automodel.check_dispatcher("deepep", torch.device("cuda"), 8)
    with pytest.raises(RuntimeError, match="uccl_ep needs the uccl package"):
        automodel.check_dispatcher("uccl_ep", torch.device("cuda"), 8)
    assert automodel.backend_config(_plan("unused", "automodel")).dispatcher == "torch"


def test_the_critic_is_nemo_automodels_model_with_transformers_values(world, checkpoint):
    """Molt's critic on the custom path (NeMoAutoModelForCausalLM with a scalar head) gives the values and head
    gradients of transformers' token classifier on the same checkpoint and head, padded and packed."""
    from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM

    from runtime.critic import token_values

    mine = automodel.build_value_model(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"))
    theirs = hf.build_value_model(_plan(checkpoint, "hf"), checkpoint, world, torch.device("cpu"))
    assert isinstance(mine, Qwen3MoeForCausalLM) and mine.lm_head.weight.shape == (1, mine.config.hidden_size)
    with torch.no_grad():  # the same head on both (each is initialised at random)
        mine.lm_head.weight.to_local().copy_(theirs.score.weight.to_local())
        mine.lm_head.bias.to_local().copy_(theirs.score.bias.to_local())
    ids, mask = _batch()
    real = mask[:, 1:].bool()
    for packed in (False, True):
        values, reference = token_values(mine, ids, mask, packed), token_values(theirs, ids, mask, packed)
        torch.testing.assert_close(values[real], reference[real], rtol=1e-4, atol=1e-5)
        (values[real] ** 2).sum().backward()
        (reference[real] ** 2).sum().backward()
        torch.testing.assert_close(mine.lm_head.weight.grad.full_tensor(), theirs.score.weight.grad.full_tensor(),
                                   rtol=1e-4, atol=1e-5)
        mine.zero_grad()
        theirs.zero_grad()
    with torch.no_grad():  # packing keeps each row to itself: its values are the padded ones
        torch.testing.assert_close(token_values(mine, ids, mask, True)[real], token_values(mine, ids, mask)[real],
                                   rtol=1e-4, atol=1e-5)


def test_lora_on_automodel_trains_and_merges_as_lora_on_hf(world, checkpoint, tmp_path):
    """nemo-automodel's adapters (its LinearLoRA) on its linear layers: with the same adapter weights the log-probs,
    two optimizer steps and the merged weights a sync streams (transformers' names and layouts, experts transposed
    back) equal peft's LoRA on transformers' implementation of the same checkpoint; only the adapters move, and
    the adapter export names them as peft does."""
    from safetensors.torch import load_file

    from runtime import lora as lora_adapters
    from runtime.models import automodel as am
    from schemas.plan import LoraPlan

    lora = LoraPlan(dim=4, alpha=8, scale=2.0, target_modules=["*.self_attn.q_proj", "*.self_attn.o_proj"])
    plan = _plan(checkpoint, "automodel").model_copy(update={"gradient_checkpoint": "full"})
    mine = am.build(plan, checkpoint, world, torch.device("cpu"), lora=lora)
    theirs = hf.build(plan.model_copy(update={"backend": "hf"}), checkpoint, world, torch.device("cpu"), lora=lora)
    adapters = {n.replace(".default.", "."): p for n, p in theirs.named_parameters() if ".lora_" in n}
    assert adapters and {n for n, p in mine.named_parameters() if p.requires_grad} == set(adapters)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the same adapters on both, B not zero so that they change the model from step 0
        for name, p in mine.named_parameters():
            if ".lora_" in name:
                adapters[name].to_local().copy_(torch.randn(p.shape, generator=g) * 0.1)
                p.to_local().copy_(adapters[name].to_local())
    opt = OptimizerPlan(name="adam", lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0, max_norm=1.0,
                        scheduler="constant", warmup_steps=0, total_steps=10, min_lr_ratio=0.1, muon=None)
    ids, mask = _batch()
    real = mask[:, 1:].bool()
    steps = {}
    for name, model in (("mine", mine), ("theirs", theirs)):
        optimizer, scheduler = fsdp.build_optimizer(opt, model)
        for _ in range(2):
            (-token_logprobs(model, ids, mask, 1.0)[0][real].mean()).backward()
            fsdp.clipped_step(model, optimizer, scheduler, 1.0)
        with torch.no_grad():
            steps[name] = token_logprobs(model, ids, mask, 1.0)[0][real]
    torch.testing.assert_close(steps["mine"], steps["theirs"], rtol=1e-4, atol=1e-4)
    merged = {n: _local(w) for n, w in am.hf_weights(mine)}
    reference = {n: _local(w) for n, w in hf.hf_weights(theirs)}
    assert merged.keys() == reference.keys() and not any(".lora_" in n for n in merged)
    for name in merged:
        torch.testing.assert_close(merged[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)
    exported = [load_file(f"{lora_adapters.export_adapter(str(tmp_path / n), m, checkpoint, 0)}/"
                          "adapter_model.safetensors") for n, m in (("mine", mine), ("theirs", theirs))]
    assert exported[0].keys() == exported[1].keys()
    for name, t in exported[0].items():
        torch.testing.assert_close(t, exported[1][name], rtol=1e-4, atol=1e-5, msg=name)


def _local(weight) -> torch.Tensor:
    """A streamed weight's rows on this rank: a merged or transposed view, a DTensor shard, or a plain tensor."""
    if hasattr(weight, "local"):
        return weight.local()
    return weight.to_local() if hasattr(weight, "to_local") else weight.detach()


@pytest.mark.slow  # inductor compiles nemo-automodel's decoder layer (tens of seconds on two cores when its cache is cold)
def test_compiled_layers_leave_the_gradients_of_nemo_automodels_layers_unchanged(world, checkpoint):
    """`model.compile_layers` on this backend: each of nemo-automodel's decoder layers under torch.compile, its MoE
    block (Gate, grouped experts) eager between the compiled attention and norms, full checkpointing around it
    (hf.compile_layers): graphs were compiled (inside a checkpoint they were not: the layer ran eager), and the
    gradients are eager's."""
    from torch._dynamo.utils import counters

    grads = {}
    for compiled in (False, True):
        counters.clear()
        plan = _plan(checkpoint, "automodel").model_copy(update={"gradient_checkpoint": "full",
                                                                  "compile_layers": compiled})
        model = automodel.build(plan, checkpoint, world, torch.device("cpu"))
        ids, mask = _batch(seed=5)
        (-token_logprobs(model, ids, mask, 1.0)[0][mask[:, 1:].bool()].mean()).backward()
        grads[compiled] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert counters["stats"]["unique_graphs"] >= 6  # the layers' (nemo-automodel compiles its norm itself, eager too)
    assert grads[True].keys() == grads[False].keys() and any("experts" in n for n in grads[True])
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_selective_checkpointing_gives_the_gradients_of_full_checkpointing(world, checkpoint):
    """Selective (per-op) checkpointing on nemo-automodel's layers, whose routers are FSDP2 units inside each
    checkpointed layer: the recompute matches the forward's op stream (FSDP2's hook ops are out of the replay), and
    the gradients are those of full checkpointing."""
    grads = {}
    for mode in ("full", "selective"):
        plan = _plan(checkpoint, "automodel").model_copy(update={"gradient_checkpoint": mode})
        model = automodel.build(plan, checkpoint, world, torch.device("cpu"))
        ids, mask = _batch(seed=6)
        (-token_logprobs(model, ids, mask, 1.0)[0][mask[:, 1:].bool()].mean()).backward()
        grads[mode] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["selective"].keys() == grads["full"].keys() and any("gate" in n for n in grads["full"])
    for name, grad in grads["full"].items():
        torch.testing.assert_close(grads["selective"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
