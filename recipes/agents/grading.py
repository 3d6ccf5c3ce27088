"""Final-answer grading shared by the math and geo3k agents.

    grade_answer(response, label) -> bool        # sync, in-process
    await GRADER.grade(response, label) -> Grade # async, in a worker process with a hard timeout

The answer is the content of the *last* `\\boxed{...}` (or `\\fbox{...}`) or `<answer>...</answer>` in the response,
whichever comes last; a response with neither form scores 0 (the format is part of the task). The label is the
ground truth as text or a number (a list means "any of these"; a `{"ground_truth": ...}` dict is unwrapped). Both
sides are compared by math-verify (HuggingFace), a symbolic equivalence checker: `\\frac{1}{2}` = `0.5` = `1/2`,
`1.5\\times10^{3}` = `1500`, `x=3` = `3`. Plain scientific notation (`6.02e23`), which LaTeX parsing reads as
`6.02`, is rewritten to `6.02\\times10^{23}` first.

Why a worker process: sympy can spin for minutes on adversarial answers (`\\boxed{9^{9^{9^9}}}`), partly inside C
code that no signal interrupts, and math-verify's own timeout uses SIGALRM, which only works in a main thread. Agent
runners call `step` from an event loop thread, so `Grader` sends each case to a child process (this file run with
`--serve`), waits at most `timeout_s`, and kills and restarts the child when it does not answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import select
import subprocess
import sys
import threading
from dataclasses import dataclass

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# 6.02e23, 1.5E-3, 2e+5 -> mantissa \times10^{exponent}; not inside identifiers (`x2e3`) or longer numbers
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d+)(?![\w.])")
MAX_ANSWER_CHARS = 1000  # longer "answers" are not answers; parsing them only costs time


def _boxed_contents(text: str) -> list[tuple[int, str]]:
    """(start, content) of every `\\boxed{...}` with balanced braces; an unclosed box is ignored."""
    out = []
    for match in _BOXED.finditer(text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append((match.start(), text[match.end():i - 1]))
    return out


def extract_answer(response: str) -> str | None:
    """The last boxed or <answer> content of `response`, stripped; None when there is none."""
    candidates = _boxed_contents(response) + [(m.start(), m.group(1)) for m in _ANSWER_TAG.finditer(response)]
    if not candidates:
        return None
    answer = max(candidates, key=lambda c: c[0])[1].strip()
    inner = _boxed_contents(answer)  # <answer>\boxed{x}</answer>
    return inner[-1][1].strip() if inner else answer


def normalize_scientific(text: str) -> str:
    return _SCIENTIFIC.sub(r"\1\\times10^{\2}", text)


def _as_latex(text: str) -> str:
    text = normalize_scientific(text.strip())
    return text if "$" in text else f"${text}$"


def grade_answer(response: str, label) -> bool:
    """True when the response's final answer is equivalent to `label` (or to any item of a list label)."""
    from math_verify import parse, verify

    answer = extract_answer(response)
    if answer is None or not answer or len(answer) > MAX_ANSWER_CHARS:
        return False
    # math-verify's timeouts use SIGALRM, which Python allows only in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    predicted = parse(_as_latex(answer), parsing_timeout=timeout)
    if not predicted:
        return False
    for gold_text in _gold_answers(label):
        gold = parse(_as_latex(str(gold_text)), parsing_timeout=timeout)
        if gold and verify(gold, predicted, timeout_seconds=timeout):
            return True
    return False


def _gold_answers(label) -> list:
    """The acceptable answers of a label: a value, a list of values, or a dataset `reward_model` dict such as
    `{"ground_truth": "3", "style": "rule"}` (the geo3k / verl layout)."""
    if isinstance(label, dict):
        label = label.get("ground_truth", label.get("answer"))
    if label is None:
        return []
    return list(label) if isinstance(label, (list, tuple)) else [label]


# --------------------------------------------------------------------------------------------------- worker process
@dataclass(frozen=True)
class Grade:
    correct: bool
    has_answer: bool  # the response contained a boxed or <answer> form
    timed_out: bool = False


class Grader:
    """Grades in a child process with a hard per-case timeout; one child per process, started lazily.

    The child is driven with blocking pipe I/O from one dedicated thread, so cases are serialised (grading takes
    milliseconds; episodes take seconds) and the grader works from any event loop, or none.
    """

    def __init__(self, timeout_s: float = 10.0, startup_timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grader")

    async def grade(self, response: str, label) -> Grade:
        if extract_answer(response) is None:
            return Grade(correct=False, has_answer=False)
        loop = asyncio.get_running_loop()
        correct = await loop.run_in_executor(self._thread, self._grade_blocking, response, label)
        return Grade(correct=bool(correct), has_answer=True, timed_out=correct is None)

    def _grade_blocking(self, response: str, label) -> bool | None:
        """True/False, or None when the worker did not answer in time (it is then killed)."""
        try:
            proc = self._worker()
            proc.stdin.write((json.dumps({"response": response, "label": label}) + "\n").encode())
            proc.stdin.flush()
            line = self._read_line(proc, self.timeout_s)
            return bool(json.loads(line)["correct"])
        except (TimeoutError, OSError, ValueError):
            self._discard()
            return None

    def _worker(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # -I: the script directory (which holds an agent named math.py) must not shadow the stdlib.
            self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "--serve"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL)
            if self._read_line(self._proc, self.startup_timeout_s).strip() != b"ready":
                raise OSError("grading worker failed to start")
        return self._proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, timeout_s: float) -> bytes:
        # The worker writes each answer as one short line with one flush, so once the pipe is readable the whole
        # line is there.
        readable, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not readable:
            raise TimeoutError
        line = proc.stdout.readline()
        if not line:
            raise OSError("grading worker exited")
        return line

    def _discard(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __del__(self):
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


def _serve() -> None:
    """Worker loop: one JSON case per stdin line, one {"correct": bool} per stdout line; exits when stdin closes."""
    import math_verify  # noqa: F401  (imported before "ready" so the first case does not pay for it)

    print("ready", flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        try:
            correct = grade_answer(case["response"], case["label"])
        except Exception:
            correct = False
        print(json.dumps({"correct": correct}), flush=True)


GRADER = Grader(timeout_s=float(os.environ.get("MOLT_GRADE_TIMEOUT_S", "10")))

if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
