"""ChatAgentRunner and the loopback chat server, driven by the real `openai` and `anthropic` SDK clients against
the real HF engine running the tiny Qwen3 model (no fakes: tokens come from `model.generate`)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

from runtime.agents import ChatAgent, ChatAgentRunner, ChatContext, Result, SamplingParams, Trajectory

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from runtime.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    from runtime.engines.hf_engine import HfEngine
    from runtime.engines.local import cpu_engines_plan

    return HfEngine(cpu_engines_plan("hf", max_model_len=1024), 0, str(model_dir))


class Recorder:
    """Collects what the agents saw, for assertions outside the episode."""

    replies: list = []


def execute(runner, engine, tokenizer, prompt="What is 2+3?", *, max_tokens=8, max_length=1024, label="5"):
    try:
        return asyncio.run(runner.execute(prompt, label, sampling=SamplingParams(max_tokens=max_tokens),
                                          max_length=max_length, tokenizer=tokenizer, client=engine))
    finally:
        runner.close()


def action_logprobs(traj: Trajectory) -> list[list[float]]:
    return [traj.rollout_log_probs[s:e] for s, e in traj.action_ranges]


# --------------------------------------------------------------------------------------------------- OpenAI
class TwoTurnOpenAI(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        first = await client.chat.completions.create(model=ctx.model_name, messages=messages, logprobs=True)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Are you sure?"}]
        second = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=4)
        Recorder.replies = [first, second]
        return Result(reward=0.5, score=0.25, info={"turns": 2})


def test_openai_two_turns_record_one_exact_segment(engine, tokenizer):
    traj = execute(ChatAgentRunner(TwoTurnOpenAI), engine, tokenizer)
    first, second = Recorder.replies
    assert isinstance(traj, Trajectory) and len(traj.action_ranges) == 2
    assert (traj.reward, traj.score, traj.info) == (0.5, 0.25, {"turns": 2})
    # the prompt is the chat template rendered once by the server
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                           add_generation_prompt=True)
    (s1, e1), (s2, e2) = traj.action_ranges
    assert tokenizer.decode(traj.token_ids[:s1], skip_special_tokens=False) == prompt
    # token-out: the reply text is the decoding of exactly the recorded action tokens, and the logprobs the client
    # received are the ones recorded for training
    assert first.choices[0].message.content == tokenizer.decode(traj.token_ids[s1:e1], skip_special_tokens=True)
    assert [c.logprob for c in first.choices[0].logprobs.content] == pytest.approx(action_logprobs(traj)[0])
    assert [c.logprob for c in second.choices[0].logprobs.content] == pytest.approx(action_logprobs(traj)[1])
    assert e2 - s2 <= 4 and second.usage.completion_tokens == e2 - s2
    # token-in: the second prompt is the first turn's tokens + only the template delta of the new message
    delta = tokenizer.decode(traj.token_ids[e1:s2], skip_special_tokens=False)
    assert delta.endswith("<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n")
    assert second.usage.prompt_tokens == s2
    # observation tokens carry no rollout logprob
    assert set(traj.rollout_log_probs[:s1] + traj.rollout_log_probs[e1:s2]) == {0.0}
    assert traj.rollout_id and traj.turns == 2


def test_score_centering_records_each_turns_top_k_in_the_segment(engine, tokenizer):
    """`top_logprobs` = k: every turn's generated tokens get their engine top-k rows, one pair per action range, and
    the Experience built from the segment puts them on the action positions."""
    from runtime.experience import from_token_lists

    runner = ChatAgentRunner(TwoTurnOpenAI)
    try:
        traj = asyncio.run(runner.execute("What is 2+3?", "5", sampling=SamplingParams(max_tokens=8, top_logprobs=3),
                                          max_length=1024, tokenizer=tokenizer, client=engine))
    finally:
        runner.close()
    assert len(traj.top_logprobs) == len(traj.action_ranges) == 2
    for (start, end), (ids, lps) in zip(traj.action_ranges, traj.top_logprobs, strict=True):
        assert ids.shape == lps.shape == (end - start, 3)
        # processed log-probs at temperature 1: the sampled token is never more likely than the head's first id
        assert (lps[:, 0] >= [lp for lp in traj.rollout_log_probs[start:end]]).all()
    exp = from_token_lists([traj.token_ids], [traj.action_ranges], [traj.rollout_log_probs], pad_id=0,
                           top_logprobs=[traj.top_logprobs])
    assert torch.equal(exp.rollout_top_log_probs[0].ne(0).all(-1), exp.action_mask[0])


class EditsHistory(ChatAgent):
    """Rewrites the conversation between calls, so the second turn cannot continue the first segment."""

    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        await client.chat.completions.create(model=ctx.model_name,
                                             messages=[{"role": "user", "content": "Summary: say 5."}])
        return Result(reward=1.0)


def test_history_rewrite_starts_a_new_segment_with_the_same_rollout_id(engine, tokenizer):
    trajs = execute(ChatAgentRunner(EditsHistory), engine, tokenizer)
    assert isinstance(trajs, list) and len(trajs) == 2
    assert trajs[0].rollout_id == trajs[1].rollout_id
    assert [t.reward for t in trajs] == [1.0, 1.0]
    assert tokenizer.decode(trajs[1].token_ids[:trajs[1].action_ranges[0][0]], skip_special_tokens=False) == \
        "<|im_start|>user\nSummary: say 5.<|im_end|>\n<|im_start|>assistant\n"


class SyncClient(ChatAgent):
    """A blocking SDK client inside `run`: the server runs in its own thread, so this must not deadlock."""

    async def run(self, ctx):
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        return Result(reward=float(bool(reply.choices[0].finish_reason)))


def test_sync_client_does_not_deadlock(engine, tokenizer):
    traj = execute(ChatAgentRunner(SyncClient), engine, tokenizer)
    assert traj.reward == 1.0 and len(traj.action_ranges) == 1


class RetriesAndErrors(ChatAgent):
    """Raw HTTP: an identical retry, an empty request and an unknown session."""

    async def run(self, ctx):
        body = {"model": ctx.model_name, "messages": ctx.messages, "max_tokens": 3}
        async with httpx.AsyncClient(timeout=60) as http:
            a = (await http.post(f"{ctx.base_url}/chat/completions", json=body)).json()
            b = (await http.post(f"{ctx.base_url}/chat/completions", json=body)).json()
            empty = await http.post(f"{ctx.base_url}/chat/completions", json={"model": "policy", "messages": []})
            unknown = await http.post(ctx.base_url.replace(ctx.session_id, "nope") + "/chat/completions", json=body)
            health = (await http.get(ctx.base_url.split("/s/")[0] + "/health")).json()
        Recorder.replies = [a, b, empty.status_code, unknown.status_code, unknown.json(), health]
        return Result(reward=0.0)


def test_retry_is_cached_and_bad_requests_are_400(engine, tokenizer):
    traj = execute(ChatAgentRunner(RetriesAndErrors), engine, tokenizer)
    a, b, empty_status, unknown_status, unknown_body, health = Recorder.replies
    assert a["id"] == b["id"] and len(traj.action_ranges) == 1  # recorded once
    assert empty_status == 400 and unknown_status == 400
    assert "unknown session" in unknown_body["error"]["message"]
    assert health == {"status": "ok", "model": "policy"}


class LongTalker(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        finishes = []
        for _ in range(6):
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=50)
            finishes.append((reply.choices[0].finish_reason, reply.usage.completion_tokens))
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "more"}]
        Recorder.replies = finishes
        return Result(reward=0.0)


@pytest.mark.parametrize("max_tokens", [8, None], ids=["capped", "no-cap"])
def test_generation_is_clamped_to_the_context_budget(engine, tokenizer, max_tokens):
    # no cap (max_new_tokens unset, Molt's default): each completion may take what is left of max_length
    traj = execute(ChatAgentRunner(LongTalker), engine, tokenizer, max_tokens=max_tokens, max_length=40)
    assert len(traj.token_ids) <= 40
    assert traj.truncated
    # once the budget is spent the server answers with an empty "length" completion instead of failing
    assert Recorder.replies[-1] == ("length", 0)


class MinimumLength(ChatAgent):
    """One completion at the session's minimum, one asking its own through vLLM's extra parameter."""

    async def run(self, ctx: ChatContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        first = await client.chat.completions.create(model=ctx.model_name, messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        second = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=5,
                                                      extra_body={"min_tokens": 9})
        Recorder.replies = [first, second]
        return Result(reward=0.0)


class RecordingClient:
    """The real engine, with each call's keywords kept."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, prompt_ids, **kwargs):
        self.calls.append(kwargs)
        return await self.engine.generate(prompt_ids, **kwargs)


def test_a_minimum_length_reaches_the_engine_from_the_session_and_from_extra_body(engine, tokenizer):
    """`rollout.min_new_tokens` is the session's default; a request's `min_tokens` (vLLM's extra parameter) replaces
    it; either is cut to the completion's cap. The engine returns that many tokens."""
    client, runner = RecordingClient(engine), ChatAgentRunner(MinimumLength)
    try:
        asyncio.run(runner.execute("What is 2+3?", "5", sampling=SamplingParams(max_tokens=8, min_tokens=8),
                                   max_length=1024, tokenizer=tokenizer, client=client))
    finally:
        runner.close()
    assert [(c["max_tokens"], c.get("min_tokens")) for c in client.calls] == [(8, 8), (5, 5)]
    assert [r.usage.completion_tokens for r in Recorder.replies] == [8, 5]
    assert [r.choices[0].finish_reason for r in Recorder.replies] == ["length", "length"]


class NotAResult(ChatAgent):
    async def run(self, ctx):
        return {"reward": 1.0}


def test_agent_must_return_a_result(engine, tokenizer):
    with pytest.raises(TypeError, match="must return a runtime.agents.Result"):
        execute(ChatAgentRunner(NotAResult), engine, tokenizer)


class NeverCalls(ChatAgent):
    async def run(self, ctx):
        return Result(reward=1.0)


def test_agent_that_never_calls_the_model_yields_an_empty_sample(engine, tokenizer):
    traj = execute(ChatAgentRunner(NeverCalls), engine, tokenizer)
    assert traj.token_ids == [] and traj.reward == 1.0


def test_runner_rejects_non_agents():
    with pytest.raises(TypeError, match="subclass of runtime.agents.ChatAgent"):
        ChatAgentRunner(object)


# --------------------------------------------------------------------------------------------------- Anthropic
class AnthropicAgent(ChatAgent):
    async def run(self, ctx):
        import anthropic

        client = anthropic.AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        first = await client.messages.create(model=ctx.model_name, max_tokens=2, system="Be brief.",
                                             messages=[{"role": "user", "content": ctx.prompt}])
        second = await client.messages.create(
            model=ctx.model_name, max_tokens=3, system="Be brief.",
            messages=[{"role": "user", "content": ctx.prompt},
                      {"role": "assistant", "content": first.content},
                      {"role": "user", "content": [{"type": "text", "text": "Again."}]}])
        Recorder.replies = [first, second]
        return Result(reward=1.0)


def test_anthropic_client_system_prompt_and_stop_reasons(engine, tokenizer):
    traj = execute(ChatAgentRunner(AnthropicAgent), engine, tokenizer)
    first, second = Recorder.replies
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                           add_generation_prompt=True)
    s1, e1 = traj.action_ranges[0]
    assert tokenizer.decode(traj.token_ids[:s1], skip_special_tokens=False) == prompt
    assert first.content[0].type == "text"
    assert first.content[0].text == tokenizer.decode(traj.token_ids[s1:e1], skip_special_tokens=True)
    assert first.usage.output_tokens == e1 - s1 <= 2
    # 2 tokens is too few to finish a turn unless the model emitted EOS at once
    assert first.stop_reason in ("max_tokens", "end_turn")
    assert (first.stop_reason == "max_tokens") == (traj.finish_reasons[0] == "length")
    assert len(traj.action_ranges) == 2  # the assistant content round-tripped, so the segment continued


def test_tool_calls_are_parsed_into_both_wires():
    from runtime.agents.chat_server import TurnReply, anthropic_reply, openai_reply

    text = 'Let me check. <tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    reply = TurnReply(text, [1, 2], [-0.1, -0.2], "stop", 7)
    o = openai_reply(reply, tools_requested=True)
    assert o["choices"][0]["finish_reason"] == "tool_calls"
    call = o["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "python" and json.loads(call["arguments"]) == {"code": "print(1)"}
    a = anthropic_reply(reply, tools_requested=True)
    assert a["stop_reason"] == "tool_use" and a["content"][1]["input"] == {"code": "print(1)"}
    assert openai_reply(reply, tools_requested=False)["choices"][0]["finish_reason"] == "stop"
    assert anthropic_reply(TurnReply("x", [1], [-1.0], "length", 1), False)["stop_reason"] == "max_tokens"
