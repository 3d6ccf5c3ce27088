"""`python -m runtime`'s exit status for a run that finished: a failure when every consumed prompt was dropped."""

from __future__ import annotations

from runtime.__main__ import nothing_trained


def test_a_finished_run_that_dropped_every_prompt_failed():
    books = {"prompts/consumed": 16, "prompts/trained": 0, "prompts/dropped/runner_error": 16}
    why = nothing_trained("finished", books)
    assert why is not None and "16 prompts consumed" in why and "runner_error" in why


def test_a_run_that_trained_or_consumed_nothing_or_stopped_is_not_that_failure():
    assert nothing_trained("finished", {"prompts/consumed": 16, "prompts/trained": 8,
                                        "prompts/dropped/runner_error": 8}) is None
    assert nothing_trained("finished", {"prompts/consumed": 0, "prompts/trained": 0}) is None  # eval only
    assert nothing_trained("stopped", {"prompts/consumed": 8, "prompts/trained": 0,
                                       "prompts/dropped/run_ended": 8}) is None
