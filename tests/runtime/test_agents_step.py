"""StepEnvRunner and load_agent_runner: single and multi-turn episodes against a scripted engine."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import torch
from agents_fakes import ByteTokenizer, ScriptedEngine, fake_logprob

from runtime.agents import (
    AgentLoadError,
    Env,
    GenerateOutput,
    GenerationAborted,
    Result,
    Runner,
    SamplingParams,
    StepEnvRunner,
    Trajectory,
    load_agent_runner,
)

TOK = ByteTokenizer()


def run(coro):
    return asyncio.run(coro)


def execute(runner, engine, prompt="Q: 6*7?\nA: ", label="42", *, max_tokens=16, max_length=256, logprobs=True):
    return run(runner.execute(prompt, label, sampling=SamplingParams(max_tokens=max_tokens, logprobs=logprobs),
                              max_length=max_length, tokenizer=TOK, client=engine))


class AnswerEnv(Env):
    """Single turn: reward 1 when the label appears in the action."""

    async def step(self, state):
        hit = state["label"] in state["action_text"]
        return Result(reward=float(hit), info={"hit": int(hit)})


class ToolEnv(Env):
    """Multi-turn: the first two turns get an observation back, the third ends the episode."""

    closed = 0

    async def step(self, state):
        if state["turn"] < 2:
            return Result(reward=0.25, observation=f"<obs{state['turn']}>", terminated=False, score=-1.0)
        return Result(reward=1.0, score=0.5, info={"turns": state["turn"] + 1})

    async def close(self):
        ToolEnv.closed += 1


def expected_logprobs(traj: Trajectory) -> list[float]:
    """0.0 off the action ranges, the engine's logprob of each generated token inside them."""
    out = [0.0] * len(traj.token_ids)
    for start, end in traj.action_ranges:
        for i in range(start, end):
            out[i] = fake_logprob(i, traj.token_ids[i])
    return out


# --------------------------------------------------------------------------------------------------- single turn
def test_single_turn_tokens_logprobs_reward():
    engine = ScriptedEngine(["It is 42"])
    traj = execute(StepEnvRunner(AnswerEnv), engine)
    prompt_ids = TOK.encode("Q: 6*7?\nA: ")
    assert traj.token_ids == prompt_ids + TOK.encode("It is 42")
    assert traj.action_ranges == [(len(prompt_ids), len(prompt_ids) + 8)]
    assert traj.rollout_log_probs == expected_logprobs(traj)
    assert traj.rollout_log_probs[: len(prompt_ids)] == [0.0] * len(prompt_ids)
    assert (traj.reward, traj.score, traj.truncated, traj.turns) == (1.0, 1.0, False, 1)
    assert traj.info == {"hit": 1}
    assert traj.observation_text == "Q: 6*7?\nA: It is 42"
    assert traj.rollout_id is not None and traj.group_id is None
    assert traj.action_mask() == [False] * len(prompt_ids) + [True] * 8
    # the engine saw exactly the prompt ids and the per-turn cap
    assert engine.calls[0][0] == prompt_ids
    assert engine.calls[0][1]["max_tokens"] == 16 and engine.calls[0][1]["logprobs"] is True


def test_wrong_answer_gets_zero_and_logprobs_off_gives_none():
    engine = ScriptedEngine(["It is 41"])
    traj = execute(StepEnvRunner(AnswerEnv), engine, logprobs=False)
    assert traj.reward == 0.0
    assert traj.rollout_log_probs is None
    assert engine.calls[0][1]["logprobs"] is False


def test_reset_rewrites_first_observation():
    class Hinted(AnswerEnv):
        async def reset(self, state):
            return {"observation": "HINT " + state["observation"], "label": state["label"]}

    engine = ScriptedEngine(["42"])
    traj = execute(StepEnvRunner(Hinted), engine, prompt="P:")
    assert engine.calls[0][0] == TOK.encode("HINT P:")
    assert traj.prompt == "P:" and traj.observation_text == "HINT P:42"


# --------------------------------------------------------------------------------------------------- multi turn
def test_multi_turn_feeds_observation_back_and_sums_rewards():
    ToolEnv.closed = 0
    engine = ScriptedEngine(["a1", "bb2", "ccc3"])
    traj = execute(StepEnvRunner(ToolEnv), engine, prompt="P>")
    p = TOK.encode("P>")
    stream = p + TOK.encode("a1") + TOK.encode("<obs0>") + TOK.encode("bb2") + TOK.encode("<obs1>") + TOK.encode("ccc3")
    assert traj.token_ids == stream
    # each turn's prompt is the whole stream so far, token for token
    assert [call[0] for call in engine.calls] == [stream[:2], stream[:2 + 2 + 6], stream[:2 + 2 + 6 + 3 + 6]]
    assert traj.action_ranges == [(2, 4), (10, 13), (19, 23)]
    assert traj.rollout_log_probs == expected_logprobs(traj)
    # 0.25 + 0.25 + 1.0 summed; score is the last step's, not the sum
    assert traj.reward == pytest.approx(1.5)
    assert traj.score == 0.5
    assert traj.turns == 3 and traj.truncated is False
    assert traj.info == {"turns": 3}
    assert traj.observation_text == "P>a1<obs0>bb2<obs1>ccc3"
    # one session id for every turn of the episode
    assert len({call[1]["session_id"] for call in engine.calls}) == 1
    assert ToolEnv.closed == 1


def test_concurrent_episodes_get_distinct_sessions():
    engine = ScriptedEngine(["a1", "bb2", "ccc3"])
    runner = StepEnvRunner(ToolEnv)

    async def group():
        return await asyncio.gather(*[
            runner.execute("P>", "x", sampling=SamplingParams(max_tokens=8), max_length=100, tokenizer=TOK,
                           client=engine) for _ in range(4)])

    trajs = run(group())
    assert len({t.rollout_id for t in trajs}) == 4
    assert all(t.token_ids == trajs[0].token_ids for t in trajs)
    assert len(engine.calls) == 12


def test_terminated_false_with_truncated_true_stops_and_flags():
    class Cut(Env):
        async def step(self, state):
            return Result(reward=0.0, observation="more", terminated=False, truncated=True)

    engine = ScriptedEngine(["x"])
    traj = execute(StepEnvRunner(Cut), engine)
    assert traj.turns == 1 and traj.truncated is True


def test_result_sampling_params_replace_the_cap_next_turn():
    class Shrink(Env):
        async def step(self, state):
            if state["turn"] == 0:
                return Result(observation="|", terminated=False,
                              sampling_params=SamplingParams(max_tokens=3, logprobs=False))
            return Result()

    engine = ScriptedEngine(["abcdef", "abcdef"])
    traj = execute(StepEnvRunner(Shrink), engine, max_tokens=10)
    assert [c[1]["max_tokens"] for c in engine.calls] == [10, 3]
    assert traj.finish_reasons == ["stop", "length"] and traj.truncated is True
    # the new params asked for no logprobs, but the episode's logprob column stays complete and aligned
    assert [c[1]["logprobs"] for c in engine.calls] == [True, True]
    assert traj.rollout_log_probs == expected_logprobs(traj)


# --------------------------------------------------------------------------------------------------- budget
def test_per_turn_budget_is_min_of_cap_and_remaining_context():
    class Forever(Env):
        async def step(self, state):
            return Result(observation="ob", terminated=False)

    engine = ScriptedEngine(["0123456789"])
    # max_length 30, prompt 4 tokens: turn 1 cap min(8, 26)=8 -> 8 tokens (length) + 2 feedback = 14;
    # turn 2 remaining 16 -> 8 + 2 = 24; turn 3 remaining 6 -> min(8, 6)=6 tokens + 2 feedback would be 32 > 30,
    # so the feedback is cut to 0 tokens; turn 4 has no room -> truncated.
    traj = execute(StepEnvRunner(Forever), engine, prompt="PPPP", max_tokens=8, max_length=30)
    assert [c[1]["max_tokens"] for c in engine.calls] == [8, 8, 6]
    assert len(traj.token_ids) == 30
    assert traj.action_ranges == [(4, 12), (14, 22), (24, 30)]
    assert traj.truncated is True and traj.turns == 3
    assert len(traj.rollout_log_probs) == len(traj.token_ids)


def test_a_minimum_length_reaches_the_engine_cut_to_each_turns_budget():
    """`rollout.min_new_tokens`: each turn asks for it, never above the turn's own budget (the last turn here has 6
    tokens of context left); without it the engine never sees the keyword (clients written before it keep working)."""
    class Forever(Env):
        async def step(self, state):
            return Result(observation="ob", terminated=False)

    engine = ScriptedEngine(["0123456789"])
    run(StepEnvRunner(Forever).execute("PPPP", "x", sampling=SamplingParams(max_tokens=8, min_tokens=8),
                                       max_length=30, tokenizer=TOK, client=engine))
    assert [(c[1]["max_tokens"], c[1]["min_tokens"]) for c in engine.calls] == [(8, 8), (8, 8), (6, 6)]

    class WrittenBefore(ScriptedEngine):  # a client without the keyword: passing it would raise TypeError
        async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, session_id, logprobs):
            return await super().generate(prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                          session_id=session_id, logprobs=logprobs)

    plain = WrittenBefore(["0123456789"])
    traj = execute(StepEnvRunner(Forever), plain, prompt="PPPP", max_tokens=8, max_length=30)
    assert len(plain.calls) == 3 and traj.turns == 3


def test_no_cap_lets_a_turn_use_the_remaining_context():
    """`max_new_tokens` unset (Molt's default in every launch script): each turn's budget is what is left."""
    class Forever(Env):
        async def step(self, state):
            return Result(observation="ob", terminated=False)

    engine = ScriptedEngine(["0123456789"])
    traj = execute(StepEnvRunner(Forever), engine, prompt="PPPP", max_tokens=None, max_length=100)
    # 100 - 4 prompt tokens, then 10 generated + 2 feedback per turn
    assert [c[1]["max_tokens"] for c in engine.calls][:3] == [96, 84, 72]
    assert len(traj.token_ids) == 100 and traj.truncated is True


def test_length_finish_marks_truncated_but_still_scores():
    engine = ScriptedEngine(["It is 42 indeed"])
    traj = execute(StepEnvRunner(AnswerEnv), engine, max_tokens=8)
    assert traj.finish_reasons == ["length"]
    assert traj.truncated is True
    assert traj.reward == 1.0  # "It is 42" fits in 8 tokens and the env still grades it


def test_long_prompt_is_cut_from_the_left():
    engine = ScriptedEngine(["42"])
    prompt = "x" * 50 + "END"
    # max_length 40, cap 8 -> prompt keeps its last 32 tokens
    traj = execute(StepEnvRunner(AnswerEnv), engine, prompt=prompt, max_tokens=8, max_length=40)
    assert engine.calls[0][0] == TOK.encode(prompt)[-32:]
    assert traj.observation_text.endswith("END42")
    assert len(traj.token_ids) == 34


def test_empty_turns_do_not_loop_forever():
    class Silent(Env):
        async def step(self, state):
            return Result(terminated=False)

    engine = ScriptedEngine([""])
    traj = execute(StepEnvRunner(Silent), engine)
    assert traj.turns == 1 and traj.truncated is True


# --------------------------------------------------------------------------------------------------- errors
def test_step_exception_propagates_and_env_is_closed():
    closed = []

    class Boom(Env):
        async def step(self, state):
            raise RuntimeError("tool crashed")

        async def close(self):
            closed.append(True)

    with pytest.raises(RuntimeError, match="tool crashed"):
        execute(StepEnvRunner(Boom), ScriptedEngine(["x"]))
    assert closed == [True]


def test_close_failure_does_not_mask_the_result():
    class BadClose(AnswerEnv):
        async def close(self):
            raise OSError("already gone")

    traj = execute(StepEnvRunner(BadClose), ScriptedEngine(["42"]))
    assert traj.reward == 1.0


@pytest.mark.parametrize("returned", [None, 1.0, {"reward": 1.0}, (1.0, "obs")])
def test_non_result_return_is_a_type_error(returned):
    class Bad(Env):
        async def step(self, state):
            return returned

    with pytest.raises(TypeError, match="must return a runtime.agents.Result"):
        execute(StepEnvRunner(Bad), ScriptedEngine(["x"]))


@pytest.mark.parametrize("reward", [[1.0], torch.tensor([1.0, 2.0]), "1.0", None, float("nan"), float("inf")])
def test_non_scalar_or_non_finite_reward_is_a_value_error(reward):
    class Bad(Env):
        async def step(self, state):
            return Result(reward=reward)

    with pytest.raises(ValueError, match="reward must be"):
        execute(StepEnvRunner(Bad), ScriptedEngine(["x"]))


def test_scalar_tensor_and_int_rewards_are_accepted():
    rewards = iter([torch.tensor(0.5), torch.tensor([2.0]), 3])

    class T(Env):
        async def step(self, state):
            r = next(rewards)
            return Result(reward=r, observation="o", terminated=isinstance(r, int))

    traj = execute(StepEnvRunner(T), ScriptedEngine(["x"]))
    assert traj.reward == 5.5 and isinstance(traj.reward, float)


def test_misaligned_engine_logprobs_raise():
    with pytest.raises(RuntimeError, match="must align 1:1"):
        execute(StepEnvRunner(AnswerEnv), ScriptedEngine(["42"], drop_logprob=True))


def test_abort_raises_generation_aborted():
    with pytest.raises(GenerationAborted):
        execute(StepEnvRunner(AnswerEnv), ScriptedEngine(["42"], finish_reason="abort"))


def test_engine_returning_a_non_output_is_a_type_error():
    class Broken:
        async def generate(self, prompt_ids, **kw):
            return {"token_ids": [1]}

    with pytest.raises(TypeError, match="expected GenerateOutput"):
        execute(StepEnvRunner(AnswerEnv), Broken())


def test_step_env_runner_rejects_non_env():
    with pytest.raises(TypeError, match="subclass of runtime.agents.Env"):
        StepEnvRunner(object)


# --------------------------------------------------------------------------------------------------- loader
def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_load_instance_form(tmp_path):
    path = write(tmp_path, "a.py", """
        from runtime.agents import Env, Result, StepEnvRunner
        class E(Env):
            async def step(self, state):
                return Result(reward=1.0)
        AgentRunner = StepEnvRunner(E)
    """)
    runner = load_agent_runner(path)
    assert isinstance(runner, StepEnvRunner)
    traj = execute(runner, ScriptedEngine(["hi"]))
    assert traj.reward == 1.0


def test_the_builtin_distill_agent_is_one_turn_at_reward_0():
    # the agent the compiler names for on_policy_distill without an agent (Molt B2): no file, a step runner
    from molt_compile.derive import DISTILL_AGENT_PATH

    runner = load_agent_runner(DISTILL_AGENT_PATH)
    assert isinstance(runner, StepEnvRunner)
    traj = execute(runner, ScriptedEngine(["x = 42", "never asked"]))
    assert traj.reward == 0.0 and traj.turns == 1 and len(traj.action_ranges) == 1


def test_load_class_form(tmp_path):
    path = write(tmp_path, "b.py", """
        from runtime.agents import Env, Result, StepEnvRunner
        class E(Env):
            async def step(self, state):
                return Result(reward=2.0)
        class AgentRunner(StepEnvRunner):
            def __init__(self):
                super().__init__(E)
    """)
    runner = load_agent_runner(str(path))
    assert isinstance(runner, Runner) and runner.env_cls.__name__ == "E"


@pytest.mark.parametrize(
    ("name", "body", "message"),
    [
        ("agent.txt", "AgentRunner = 1\n", "must be a Python file ending in .py"),
        ("syntax.py", "def broken(:\n", "importing the agent failed: SyntaxError"),
        ("raises.py", "raise ImportError('no sympy here')\n", "importing the agent failed: ImportError: no sympy"),
        ("none.py", "x = 1\n", "defines no `AgentRunner`"),
        ("wrongtype.py", "AgentRunner = 42\n", "must be a runtime.agents.Runner"),
        ("wrongcls.py", "class AgentRunner: pass\n", "must subclass runtime.agents.Runner"),
        ("args.py", "from runtime.agents import StepEnvRunner\nclass AgentRunner(StepEnvRunner): pass\n",
         "constructible with no arguments"),
    ],
)
def test_loader_errors_name_the_file_and_the_fix(tmp_path, name, body, message):
    path = write(tmp_path, name, body)
    with pytest.raises(AgentLoadError, match=message) as info:
        load_agent_runner(path)
    assert str(path) in str(info.value)


def test_loader_missing_file(tmp_path):
    with pytest.raises(AgentLoadError, match="no such file"):
        load_agent_runner(tmp_path / "missing.py")


def test_generate_output_defaults():
    out = GenerateOutput(token_ids=[1, 2])
    assert out.logprobs == [] and out.finish_reason == "stop"
