"""Methods mixed into every vLLM worker (`worker_extension_cls`), reached with `AsyncLLM.collective_rpc(name, ...)`.

Kept free of Ray and of the rest of the runtime: vLLM imports this module inside its own worker processes.
"""

from __future__ import annotations


class WeightSyncExtension:
    def molt_reload_weights(self, path: str) -> int:
        """Load a safetensors state dict (HF names) into the running model in place; return the tensor count.

        `model_runner.reload_weights` re-runs the loader's post-processing, which the CPU backend needs: it repacks
        linear weights after loading, so a plain `model.load_weights` after init fails there (environment.md §3).
        The file is read in the worker rather than sent through `collective_rpc`, whose shared-memory broadcast to the
        workers cannot pickle tensors ("cannot pickle memoryview objects").
        """
        from safetensors.torch import load_file

        state = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        return len(state)
