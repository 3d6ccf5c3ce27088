"""Vision-language rollouts without Ray: processor, runner, experience alignment, data columns, VLM log-probs.

Uses the committed tiny Qwen2.5-VL of the VLM demo (recipes/data/make_demo_vlm.py) and a scripted engine client.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from runtime import vlm
from runtime.agents import Env, Result, SamplingParams, StepEnvRunner
from runtime.agents.types import GenerateOutput
from runtime.datasource import read_images
from runtime.experience import check_image_alignment, concat, from_token_lists
from runtime.runners import AgentRunnerActor, GroupRequest, _drop_reason

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "data" / "demo_vlm"
MODEL = DEMO / "model"


@pytest.fixture(scope="module")
def processor():
    return vlm.load_processor(str(MODEL))


@pytest.fixture(scope="module")
def digit():
    return vlm.load_image("images/1.png", DEMO)


class ScriptedClient:
    """Answers every turn with `reply` token ids; records the prompts and images each call got."""

    def __init__(self, reply: list[int]):
        self.reply, self.calls = reply, []

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, session_id, logprobs, images=None):
        self.calls.append((list(prompt_ids), list(images or [])))
        return GenerateOutput(token_ids=self.reply[:max_tokens], logprobs=[-0.5] * min(len(self.reply), max_tokens))


class LookAgain(Env):
    """Turn 0 sends the image back as feedback (Result.images); turn 1 ends."""

    async def step(self, state):
        if state["turn"] == 0:
            return Result(reward=0.0, observation="look again:", terminated=False, images=[str(DEMO / "images" / "2.png")])
        return Result(reward=1.0)


class OneTurn(Env):
    async def step(self, state):
        return Result(reward=1.0)


def _run(runner, processor, prompt_text, images, max_length=64, reply=(5, 6)):
    client = ScriptedClient(list(reply))
    prompt = vlm.render(processor, prompt_text, len(images))
    sampling = SamplingParams(max_tokens=4)
    out = asyncio.run(runner.execute(prompt, "2", sampling=sampling, max_length=max_length,
                                     tokenizer=processor.tokenizer, client=client, images=images,
                                     processor=processor))
    return out, client


def test_processor_loads_without_torchvision_and_expands_placeholders(processor, digit):
    text = vlm.render(processor, "<image>+1=", 1)
    assert text.count(processor.image_token) == 1
    ids, mm = vlm.encode(processor, text, [digit])
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4]]           # 56x56 px = 4x4 patches of 14
    assert ids.count(processor.image_token_id) == 4                # 16 patches / 2x2 merge
    assert mm["pixel_values"].shape[0] == 16
    collapsed = vlm.collapse_image_runs(ids, processor.image_token_id)
    assert collapsed.count(processor.image_token_id) == 1 and len(collapsed) == len(ids) - 3


def test_a_chat_prompt_gets_its_image_at_the_marker_of_its_first_user_turn(processor, digit):
    # geo3k's rows: chat messages whose user turn is text with a `<image>` marker (vLLM fails on a prompt whose
    # image has no placeholder: "Failed to apply prompt replacement")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>\nFind x."},
            {"role": "user", "content": "<image> stays text here"}]
    text = vlm.render(processor, chat, 1)
    assert text.count(processor.image_token) == 1 and text.index(processor.image_token) < text.index("Find x.")
    assert vlm.encode(processor, text, [digit])[0].count(processor.image_token_id) == 4
    parts = [{"role": "user", "content": "Look."}, {"role": "user", "content": [{"type": "image"}]}]
    assert vlm.messages_with_images(parts, 1) is parts  # image parts of their own: kept as they are
    with pytest.raises(ValueError, match="0 image placeholders for its 1 images"):
        vlm.encode(processor, "no placeholder", [digit])


def test_step_runner_sends_images_and_keeps_features_aligned(processor, digit):
    traj, client = _run(StepEnvRunner(OneTurn), processor, "<image>+1=", [digit])
    assert len(client.calls) == 1 and len(client.calls[0][1]) == 1
    assert traj.mm_inputs["image_grid_thw"].shape == (1, 3)
    exp = from_token_lists([traj.token_ids], [traj.action_ranges], [traj.rollout_log_probs], 0,
                           mm_inputs=[traj.mm_inputs])
    check_image_alignment(exp, processor.image_token_id, vlm.merge_size(processor))


def test_result_images_join_the_next_turn(processor, digit):
    traj, client = _run(StepEnvRunner(LookAgain), processor, "<image>+1=", [digit])
    assert [len(images) for _, images in client.calls] == [1, 2]   # turn 1 sees both images
    second_prompt = client.calls[1][0]
    assert second_prompt.count(processor.image_token_id) == 8
    assert traj.mm_inputs["image_grid_thw"].shape == (2, 3) and traj.reward == 1.0
    exp = from_token_lists([traj.token_ids], [traj.action_ranges], [traj.rollout_log_probs], 0,
                           mm_inputs=[traj.mm_inputs])
    check_image_alignment(exp, processor.image_token_id, vlm.merge_size(processor))


def test_prompt_cut_through_an_image_is_dropped_as_vlm_truncation(processor, digit):
    runner = StepEnvRunner(OneTurn)
    with pytest.raises(vlm.VlmTruncation) as err:
        _run(runner, processor, "<image>+1=" * 1, [digit], max_length=12)
    assert _drop_reason(err.value) == "vlm_truncation"


def test_too_many_images_drop_the_group(processor, digit, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text("from runtime.agents import Env, Result, StepEnvRunner\n"
                     "class E(Env):\n    async def step(self, state):\n        return Result(reward=1.0)\n"
                     "AgentRunner = StepEnvRunner(E)\n")
    actor = AgentRunnerActor(str(agent), str(MODEL), ScriptedClient([5]), 64, {}, True, max_images_per_prompt=1,
                             step_timeout_s=60.0, episode_timeout_s=120.0)
    req = GroupRequest(0, "<image><image>+1=", "2", 2, SamplingParams(max_tokens=2), images=[digit, digit])
    res = asyncio.run(actor.run_group(req))
    assert res.experience is None and res.dropped["too_many_images"] == 2
    ok = asyncio.run(actor.run_group(GroupRequest(1, "<image>+1=", "2", 2, SamplingParams(max_tokens=2),
                                                  images=["images/1.png"], image_dir=str(DEMO))))
    assert ok.experience.batch_size == 2 and len(ok.experience.mm_inputs) == 2
    actor.client = ScriptedClient([processor.image_token_id, 5])  # the policy samples a placeholder
    bad = asyncio.run(actor.run_group(GroupRequest(2, "<image>+1=", "2", 2, SamplingParams(max_tokens=2),
                                                   images=[digit])))
    assert bad.experience is None and bad.dropped["image_token_generated"] == 2


def test_experience_keeps_each_rows_images_with_its_tokens(processor, digit):
    a, _ = _run(StepEnvRunner(OneTurn), processor, "<image>+1=", [digit])
    b, _ = _run(StepEnvRunner(LookAgain), processor, "<image>+2=", [digit])
    parts = [from_token_lists([t.token_ids], [t.action_ranges], [t.rollout_log_probs], 0, mm_inputs=[t.mm_inputs])
             for t in (a, b)]
    text = from_token_lists([[1, 2, 3]], [[(1, 3)]], [[0.0, -1.0, -1.0]], 0)
    exp = concat([parts[0], text, parts[1]], pad_id=0)
    check_image_alignment(exp, processor.image_token_id, 2)
    picked = exp.select(torch.tensor([2, 0]))
    assert picked.mm_inputs[0]["image_grid_thw"].shape[0] == 2 and picked.mm_inputs[1]["image_grid_thw"].shape[0] == 1
    check_image_alignment(picked, processor.image_token_id, 2)
    check_image_alignment(exp.select(slice(1, 2)), processor.image_token_id, 2)
    swapped = exp.select(torch.tensor([0, 2]))
    swapped.mm_inputs.reverse()
    with pytest.raises(ValueError, match="placeholder"):
        check_image_alignment(swapped, processor.image_token_id, 2)


def test_vlm_logprobs_match_the_full_model(processor, digit):
    from transformers import AutoModelForImageTextToText

    from runtime.logprobs import token_logprobs, vision_inputs

    model = AutoModelForImageTextToText.from_pretrained(MODEL, dtype=torch.float32).eval()
    a, _ = _run(StepEnvRunner(OneTurn), processor, "<image>+1=", [digit])
    b, _ = _run(StepEnvRunner(LookAgain), processor, "<image>+2=", [digit])
    exp = concat([from_token_lists([t.token_ids], [t.action_ranges], [t.rollout_log_probs], 0,
                                   mm_inputs=[t.mm_inputs]) for t in (a, b)], pad_id=0)
    with torch.no_grad():
        vision = vision_inputs(exp.mm_inputs, exp.sequences, processor.image_token_id, "cpu")
        lp, _ = token_logprobs(model, exp.sequences, exp.attention_mask, 1.0, vision=vision)
        for i, t in enumerate((a, b)):
            ids = torch.tensor([t.token_ids])
            logits = model(input_ids=ids, mm_token_type_ids=(ids == processor.image_token_id).int(),
                           **t.mm_inputs).logits[0, :-1]
            want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(lp[i, :len(t.token_ids) - 1], want, rtol=1e-4, atol=1e-4)
        blind, _ = token_logprobs(model, exp.sequences, exp.attention_mask, 1.0,
                                  vision=vision_inputs([None, None], exp.sequences, -1, "cpu"))
    assert not torch.allclose(blind, lp)  # the images do change the answer's log-probs


def test_image_column_in_jsonl_and_hf_image_features(tmp_path, digit):
    import datasets

    rows = read_images(str(DEMO / "eval.jsonl"), "train", "image", 3)
    assert rows == [["images/0.png"], ["images/0.png"], ["images/0.png"]]
    ds = datasets.Dataset.from_dict({"prompt": ["<image>+1="], "images": [[digit]]},
                                    features=datasets.Features({"prompt": datasets.Value("string"),
                                                                "images": [datasets.Image()]}))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    (loaded,) = read_images(str(tmp_path / "d.parquet"), "train", "images", 5)
    img = vlm.load_image(vlm.as_image_list(loaded)[0])
    assert img.size == (56, 56) and img.tobytes() == digit.tobytes()
    assert json.loads((DEMO / "train.jsonl").read_text().splitlines()[0])["image"][0].startswith("images/")


def test_tied_lm_head_of_a_vlm_is_aliased_for_the_engine():
    from runtime.weight_sync import LM_HEAD, VLM_EMBED, TensorMeta, tied_aliases

    metas = [TensorMeta(VLM_EMBED, "float32", (10, 4)), TensorMeta("model.visual.merger.mlp.0.weight", "float32", (4, 4))]
    assert tied_aliases(metas, tied=True) == {LM_HEAD: VLM_EMBED}


def test_hf_engine_generates_from_images_as_the_full_model_scores(processor):
    """The hf engine (rollout.engine: hf) batches two image prompts with a text prompt and decodes several tokens:
    its log-probs are those of the full model forward with the images (features in the placeholders, 3-D rope
    positions in the prompt, the rope delta after it); the same ids without the features score differently."""
    from transformers import AutoModelForImageTextToText

    from runtime.engines.hf_engine import HfEngine
    from runtime.engines.local import cpu_engines_plan

    engine = HfEngine(cpu_engines_plan("hf", max_model_len=128).model_copy(update={"max_images_per_prompt": 1}),
                      0, str(MODEL))
    engine.core.eos_ids = set()  # decode every step up to max_tokens, past the answer
    model = AutoModelForImageTextToText.from_pretrained(MODEL, dtype=torch.float32).eval()
    images = [vlm.load_image(f"images/{d}.png", DEMO) for d in (0, 2)]
    prompts = [vlm.encode(processor, vlm.render(processor, f"<image>+{d}=", 1), [img])[0]
               for d, img in zip((1, 0), images, strict=True)]
    text = processor.tokenizer.encode(processor.apply_chat_template([{"role": "user", "content": "1+1="}],
                                                                    tokenize=False, add_generation_prompt=True))

    async def generate():
        calls = [engine.generate(ids, max_tokens=5, temperature=1.0, top_p=1.0, session_id=str(i), logprobs=True,
                                 images=[img]) for i, (ids, img) in enumerate(zip(prompts, images, strict=True))]
        calls.append(engine.generate(text, max_tokens=5, temperature=1.0, top_p=1.0, session_id="t", logprobs=True))
        try:
            return await asyncio.gather(*calls)
        finally:
            await engine.shutdown()

    outs = asyncio.run(generate())
    with torch.no_grad():
        for ids, img, out in zip([*prompts, text], [*images, None], outs, strict=True):
            assert len(out.token_ids) == 5
            seq = torch.tensor([ids + out.token_ids])
            inputs = {} if img is None else {"mm_token_type_ids": (seq == processor.image_token_id).int(),
                                             **vlm.encode(processor, vlm.render(processor, "<image>", 1), [img])[1]}
            logits = model(input_ids=seq, **inputs).logits[0, len(ids) - 1:-1]
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(out.logprobs), want, rtol=1e-4, atol=1e-4)
            if img is not None:
                blind = torch.log_softmax(model(input_ids=seq).logits[0, len(ids) - 1:-1], -1)
                assert (blind.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0] - want).abs().max() > 1e-3
