"""Rule documentation pages, rendered from the catalog (`molt-compile rules [CODE]`, REFERENCE.md).

`python -m molt_compile.rules.docs > molt_compile/rules/REFERENCE.md` regenerates the committed reference page;
a test fails when it is stale.
"""

from __future__ import annotations

from molt_compile.codes import CAPABILITY, Code
from molt_compile.rules import ALL_RULES

SECTIONS = ("## What it checks", "## Why it matters", "## Example", "## Use instead", "## References")


def rule_page(rule: Code) -> str:
    """One rule's page: heading, severity, kinds, then its docstring."""
    kinds = " and ".join(rule.kinds)
    body = rule.doc.replace("## ", "### ")
    return f"## {rule.code} {rule.name}\n\nSeverity: **{rule.severity}** · applies to: {kinds} recipes\n\n{body}\n"


def reference() -> str:
    """The whole catalog as one Markdown page."""
    head = [
        "# Rule reference",
        "",
        "Generated from `molt_compile/rules/` by `python -m molt_compile.rules.docs`; do not edit by hand.",
        "",
        "| code | name | severity | kinds |",
        "|---|---|---|---|",
    ]
    head += [
        f"| [{r.code}](#{r.code.lower()}-{r.name}) | {r.name} | {r.severity} | {', '.join(r.kinds)} |"
        for r in ALL_RULES
    ]
    cap = CAPABILITY
    head.append(f"| [{cap.code}](#{cap.code.lower()}-{cap.name}) | {cap.name} | {cap.severity} | rl, sft |")
    cap_page = (
        f"## {cap.code} {cap.name}\n\nSeverity: **{cap.severity}** · applies to: rl and sft recipes "
        f"(checked on the lowered plan)\n\n{cap.text.replace('## ', '### ')}\n"
        f"{(cap.appendix() if cap.appendix else '').replace('## ', '### ')}\n"
    )
    return "\n".join(head) + "\n\n" + "\n".join(rule_page(r) for r in ALL_RULES) + "\n" + cap_page


if __name__ == "__main__":
    print(reference(), end="")
