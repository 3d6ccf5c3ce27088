"""molt-compile: checks a recipe for every illegal combination and lowers it to a fingerprinted Ray job plan.

Never imports torch, ray, vllm or transformers (Ray's job client is imported lazily inside `--submit`).
"""
