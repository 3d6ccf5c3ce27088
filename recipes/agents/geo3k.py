"""Multi-turn geometry agent with a Python tool: the model may run code before it commits a final answer.

Turn protocol (the dataset's prompt is already chat-templated, ChatML as in Qwen):

- A tool call is the last of these in the model's turn:
      ```python            <tool_call>                                <tool_call>
      print(2 ** 0.5)      {"name": "python",                         <function=python>
      ```                   "arguments": {"code": "print(1)"}}        <parameter=code>
                           </tool_call>                               print(1)
                                                                      </parameter></function></tool_call>
  The code runs in a sandbox (`sandbox.py`: no network, read-only filesystem except a private temp dir, CPU, memory,
  process and output limits, wall-clock timeout) and its output comes back as a user turn
  `<tool_response>...</tool_response>`, after which the assistant continues.
- A final answer is `\\boxed{...}` or `<answer>...</answer>`; the episode ends and the answer is graded against the
  label with math-verify (`grading.py`): reward 1 or 0. A committed answer ends the episode even when the same turn
  also calls the tool (no reward for post-answer "verification" loops).
- A turn with neither ends the episode with reward 0. Reaching MAX_AGENT_TURNS with a tool call still pending ends it
  as truncated with reward 0 (the pending call is not run).

Environment (set through the recipe's `agent.env`; `agent.max_turns` exports MAX_AGENT_TURNS):
  MAX_AGENT_TURNS            default 5
  PYTHON_EXECUTOR_TIMEOUT    default 10   wall-clock seconds per tool call (RLIMIT_CPU gets the same)
  PYTHON_EXECUTOR_MEMORY_MB  default 1024 address-space limit of the tool process
  PYTHON_EXECUTOR_MAX_OUTPUT default 2048 bytes of tool output fed back
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from grading import GRADER, extract_answer
from sandbox import SandboxLimits, run_python

from runtime.agents import Env, Result, StepEnvRunner

_FENCED = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML_CODE = re.compile(r"<parameter=code>\n?(.*?)\n?</parameter>", re.DOTALL)
END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class Settings:
    max_turns: int
    limits: SandboxLimits

    @classmethod
    def from_env(cls) -> Settings:
        timeout_s = float(os.environ.get("PYTHON_EXECUTOR_TIMEOUT", "10"))
        return cls(
            max_turns=int(os.environ.get("MAX_AGENT_TURNS", "5")),
            limits=SandboxLimits(
                timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)),
                memory_bytes=int(os.environ.get("PYTHON_EXECUTOR_MEMORY_MB", "1024")) << 20,
                max_output_bytes=int(os.environ.get("PYTHON_EXECUTOR_MAX_OUTPUT", "2048")),
            ),
        )


def extract_tool_code(text: str) -> str | None:
    """The code of the last tool call in `text` (fenced block or <tool_call>), or None."""
    calls: list[tuple[int, str]] = [(m.start(), m.group(1)) for m in _FENCED.finditer(text)]
    for match in _TOOL_CALL.finditer(text):
        body = match.group(1).strip()
        code = None
        xml = _XML_CODE.search(body)
        if xml:
            code = xml.group(1)
        else:
            try:
                call = json.loads(body)
                code = call.get("arguments", {}).get("code") if isinstance(call, dict) else None
            except (json.JSONDecodeError, AttributeError):
                code = None
        calls.append((match.start(), code if isinstance(code, str) else ""))
    if not calls:
        return None
    return max(calls, key=lambda c: c[0])[1]


def _close(action: str) -> str:
    """End the assistant turn unless the generated tokens already did (vLLM keeps the stop token in the ids)."""
    return "" if action.rstrip().endswith(END_OF_TURN) else END_OF_TURN


def tool_observation(action: str, output: str) -> str:
    return (f"{_close(action)}\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response>{END_OF_TURN}\n"
            "<|im_start|>assistant\n")


class Geo3kEnv(Env):
    def __init__(self):
        self.settings = Settings.from_env()
        self.turn = 0
        self.tool_calls = 0
        self.tool_failures = 0  # timeouts, limit kills, non-zero exits, sandbox unavailable

    async def step(self, state: dict) -> Result:
        action = state["action_text"]
        self.turn += 1
        if extract_answer(action) is not None:
            grade = await GRADER.grade(action, state["label"])
            return self._end(1.0 if grade.correct else 0.0, answered=True, grade_timeout=grade.timed_out)
        code = extract_tool_code(action)
        if code is None:
            return self._end(0.0, answered=False)
        if self.turn >= self.settings.max_turns:
            return self._end(0.0, answered=False, truncated=True)

        self.tool_calls += 1
        if code.strip():
            result = await run_python(code, self.settings.limits)
            failed = result.timed_out or result.setup_failed or result.exit_code != 0
            output = result.observation()
        else:
            failed, output = True, "error: empty tool call (put Python code in a ```python block)"
        self.tool_failures += int(failed)
        return Result(reward=0.0, observation=tool_observation(action, output), terminated=False, info=self._info())

    def _end(self, reward: float, *, answered: bool, truncated: bool = False, grade_timeout: bool = False) -> Result:
        info = self._info() | {"correct": reward, "has_answer": float(answered), "grade_timeout": float(grade_timeout)}
        return Result(reward=reward, terminated=not truncated, truncated=truncated, info=info)

    def _info(self) -> dict:
        return {"tool_calls": float(self.tool_calls), "tool_failures": float(self.tool_failures),
                "turns": float(self.turn)}


AgentRunner = StepEnvRunner(Geo3kEnv)
