"""How many examples a fuzz test draws: its CI count, or a campaign's count under MOLT_HYPOTHESIS=explore.

`MOLT_HYPOTHESIS=explore` (fresh random examples, see conftest.py) draws MOLT_FUZZ_EXAMPLES examples per fuzz test,
10,000 unless set: the campaign of issue 13 ("no traceback from any input"). CI draws the small fixed count."""

from __future__ import annotations

import os

CAMPAIGN_EXAMPLES = 10_000


def examples(ci: int) -> int:
    if os.environ.get("MOLT_HYPOTHESIS") == "explore":
        return int(os.environ.get("MOLT_FUZZ_EXAMPLES", CAMPAIGN_EXAMPLES))
    return ci
