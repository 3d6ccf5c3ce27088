"""The contract between the compiler and the runtime: Recipe v1, Plan v1, catalogs.

Imports nothing of ours and nothing heavy (only pydantic and the standard library).
"""
