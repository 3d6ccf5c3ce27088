"""A separate reference / teacher rank (`runtime/reference.py`) in one process (a real gloo world of one rank): it
scores rows with the teacher's weights, not the policy's, exactly as the policy ranks score them; and every batch is
padded to rows every FSDP group can split evenly."""

from __future__ import annotations

import torch
from loop_support import ROOT, compile_plan

from runtime.experience import from_token_lists
from runtime.logprobs import token_logprobs
from runtime.ranks import free_port
from runtime.reference import ReferenceWorker

STUDENT, TEACHER = (str(ROOT / "recipes/data/demo_math" / d) for d in ("model", "teacher"))



def make_batch():
    g = torch.Generator().manual_seed(0)
    lengths = [6, 14, 9, 11]
    tokens = [torch.randint(5, 200, (n,), generator=g).tolist() for n in lengths]
    return from_token_lists(tokens, [[(3, n)] for n in lengths], [[] for _ in tokens], pad_id=0)


def test_reference_rank_scores_with_the_teachers_weights():
    from transformers import AutoModelForCausalLM

    rl = compile_plan("recipes/demo_math_distill.yaml").rl
    ref = rl.ref.model_copy(update={"path": TEACHER})
    trainer = rl.trainer.model_copy(update={"micro_batch_size": 3})  # 4 rows: micro-batches of 3 and 1
    worker = ReferenceWorker(ref, trainer, rl.model, "cpu", "gloo", 0, "127.0.0.1", free_port())
    try:
        batch = make_batch()
        rows, lp = worker.forward_logprobs(batch)
    finally:
        worker.shutdown()
    assert torch.equal(rows, torch.arange(4))
    mask = batch.attention_mask[:, 1:]
    for path, same in ((TEACHER, True), (STUDENT, False)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        with torch.no_grad():
            expected, _ = token_logprobs(model, batch.sequences, batch.attention_mask, trainer.temperature)
        assert torch.allclose(lp * mask, expected * mask, atol=1e-5) == same, path


def test_batches_are_padded_for_every_fsdp_group():
    distill = "recipes/demo_math_distill.yaml"
    assert compile_plan(distill, "cluster.gpus_per_node=4", "actor.gpus_per_node=2").rl.trainer.row_multiple == 2
    assert compile_plan(distill, "cluster.gpus_per_node=6", "actor.gpus_per_node=2", "ref.gpus_per_node=3",
                        "rollout.batch_size=6", "train.batch_size=96").rl.trainer.row_multiple == 6
    assert compile_plan("recipes/demo_math.yaml").rl.trainer.row_multiple == 2
