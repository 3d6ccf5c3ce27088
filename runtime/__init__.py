"""Molt's runtime: executes a compiled plan on Ray (`python -m runtime PLAN.json`). Reads `schemas`, never
`molt_compile`; every number comes from the plan."""
