"""Catalogs the compiler checks recipes against: model architectures (`MODELS`) and GPUs (`GPUS`).

Plain frozen dataclasses, no imports beyond the standard library: compiling must stay fast.

Where the numbers come from:
- Dense Qwen3 and Llama rows: the models' published `config.json` files (Hugging Face hub) and model cards.
- Molt's reference recipes (Qwen3.6-35B-A3B, Nemotron-3-Nano-Omni-30B-A3B, GLM-5.2): `reference/molt_rules.md` §5.3
  says what they are (MoE, VLM, GDN/Mamba hybrid, 256 experts, MTP 1) and which backend path they take. Their exact
  shapes are not in our references; values marked `# estimate` are taken from the nearest published sibling
  (Qwen3.5/Qwen3-Next, Nemotron-H, GLM-5 744B-A40B) and are good to ~10 %: enough for a memory estimate, never used
  for an exact divisibility check except `experts`, which the recipe tables state (GLM: 256, EP256).
- GPU memory: the capacity PyTorch reports (`torch.cuda.get_device_properties(0).total_memory`, also the total in
  its out-of-memory messages), which is what vLLM's `gpu_memory_utilization` multiplies; it is ~0.5 GiB below
  `nvidia-smi`'s total. H200: measured on the lent H200 (nvidia-smi 143771 MiB, torch 150109880320 B = 139.8 GiB).
  Others: the totals PyTorch prints in OOM messages on those boards (H100 79.1, A100-80GB 79.15, L40S 44.5 GiB);
  B200 is an estimate. Node profiles: the NVIDIA DGX/HGX reference systems (logical CPUs as Ray counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Backend = Literal["automodel", "hf"]


@dataclass(frozen=True)
class ModelSpec:
    """What the compiler needs to know about a model architecture (one checkpoint family)."""

    key: str
    """Catalog key used in `model.arch`."""
    hf_name: str
    """Hub name of the checkpoint this row describes."""
    architecture: str
    """`architectures[0]` of its config.json."""
    params_total: int
    """All parameters, embeddings included."""
    params_active: int
    """Parameters used per token (= total for dense models)."""
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    """Dense MLP width (for MoE: the per-expert width, `moe_intermediate_size`)."""
    vocab: int
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    experts_per_token: int = 0
    """Routed experts chosen per token (top-k)."""
    is_vlm: bool = False
    """Has a vision encoder (config.json `vision_config`)."""
    has_mtp_head: bool = False
    """Checkpoint ships multi-token-prediction layers (vLLM MTP speculative decoding, F12)."""
    native_automodel: bool = False
    """NVIDIA AutoModel has a custom implementation; False means Molt falls back to HF transformers (H9)."""
    thd_packing: bool = False
    """The custom implementation consumes THD packing kwargs (`qkv_format`, `cu_seqlens`, H4). HF fallback packs
    through flash-attn varlen instead (H5), so this is only meaningful with `native_automodel`."""
    cp_hook: bool = False
    """VLM only: the model has AutoModel's `prepare_model_inputs_for_cp` hook, needed for cp > 1 (H8)."""
    kv_bytes_per_token: int = 0
    """bf16 KV-cache bytes one token takes in vLLM over all layers (hybrid/MLA models: only their cache layers)."""
    tie_embeddings: bool = False
    max_positions: int = 0
    """The longest sequence vLLM accepts for this checkpoint (its config's position keys, RoPE scaling and the
    tokenizer's `model_max_length`, as vLLM derives them); 0: unknown (catalog rows: only a config.json says)."""
    estimated: tuple[str, ...] = ()
    """Fields whose values are estimates (see the module docstring)."""
    source: str = ""
    """Where this row comes from (a catalog key, or the config.json it was read from)."""

    @property
    def is_moe(self) -> bool:
        return self.experts > 1


def gqa_kv_bytes(cache_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """K and V, per layer with a KV cache, per token: 2 × layers × kv_heads × head_dim × bytes."""
    return 2 * cache_layers * kv_heads * head_dim * dtype_bytes


MODELS: dict[str, ModelSpec] = {
    m.key: m
    for m in (
        # Qwen/Qwen3-4B-Instruct-2507 config.json; 4.02 B parameters (model card). Molt runs dense Qwen3 on the HF
        # fallback (slurm/rl_qwen3_4b.sh:34-36, molt_rules.md H9), and packs through HF flash-attn varlen.
        ModelSpec(
            "qwen3-4b",
            "Qwen/Qwen3-4B-Instruct-2507",
            "Qwen3ForCausalLM",
            4_022_468_096,
            4_022_468_096,
            layers=36,
            hidden_size=2560,
            heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate_size=9728,
            vocab=151936,
            tie_embeddings=True,
            kv_bytes_per_token=gqa_kv_bytes(36, 8, 128),
            source="catalog",
        ),
        # Qwen/Qwen3-8B config.json; 8.19 B parameters (model card).
        ModelSpec(
            "qwen3-8b",
            "Qwen/Qwen3-8B",
            "Qwen3ForCausalLM",
            8_190_735_360,
            8_190_735_360,
            layers=36,
            hidden_size=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate_size=12288,
            vocab=151936,
            kv_bytes_per_token=gqa_kv_bytes(36, 8, 128),
            source="catalog",
        ),
        # Qwen/Qwen3-30B-A3B config.json: 128 experts, top-8, moe_intermediate_size 768; 30.5 B total, 3.3 B active
        # (model card). AutoModel has a custom Qwen3-MoE (MoE must take the custom path, F6/F7).
        ModelSpec(
            "qwen3-30b-a3b",
            "Qwen/Qwen3-30B-A3B",
            "Qwen3MoeForCausalLM",
            30_532_122_624,
            3_300_000_000,
            layers=48,
            hidden_size=2048,
            heads=32,
            kv_heads=4,
            head_dim=128,
            intermediate_size=768,
            vocab=151936,
            experts=128,
            experts_per_token=8,
            native_automodel=True,
            thd_packing=True,
            kv_bytes_per_token=gqa_kv_bytes(48, 4, 128),
            estimated=("params_active", "thd_packing"),
            source="catalog",
        ),
        # meta-llama/Llama-3.1-8B config.json; 8.03 B parameters. Backend path: assumed HF fallback like dense Qwen3
        # (our references name no custom dense Llama in Molt's path) — estimate.
        ModelSpec(
            "llama-3.1-8b",
            "meta-llama/Llama-3.1-8B",
            "LlamaForCausalLM",
            8_030_261_248,
            8_030_261_248,
            layers=32,
            hidden_size=4096,
            heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab=128256,
            kv_bytes_per_token=gqa_kv_bytes(32, 8, 128),
            estimated=("native_automodel",),
            source="catalog",
        ),
        # Qwen3.6-35B-A3B: a Qwen3.5-MoE VLM with a GDN (linear attention) hybrid, custom AutoModel path, te attention,
        # CP 8 with images in the reference recipe, so it has the VLM CP hook (molt_rules.md §5.3 Table A). Shapes
        # follow the Qwen3.5 MoE family (every 4th layer full attention, 2 KV heads of 256, vocab 248320) — estimate.
        ModelSpec(
            "qwen3.6-35b-a3b",
            "Qwen/Qwen3.6-35B-A3B",
            "Qwen3_5MoeForConditionalGeneration",
            35_000_000_000,
            3_000_000_000,
            layers=40,
            hidden_size=2048,
            heads=16,
            kv_heads=2,
            head_dim=256,
            intermediate_size=512,
            vocab=248320,
            experts=256,
            experts_per_token=8,
            is_vlm=True,
            native_automodel=True,
            thd_packing=False,
            cp_hook=True,
            kv_bytes_per_token=gqa_kv_bytes(10, 2, 256),
            estimated=(
                "params_total",
                "params_active",
                "layers",
                "hidden_size",
                "heads",
                "head_dim",
                "intermediate_size",
                "experts",
                "experts_per_token",
                "kv_bytes_per_token",
            ),
            source="catalog",
        ),
        # NVIDIA-Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16: hybrid Mamba2/attention MoE VLM, no MTP head (F12),
        # custom path with te attention and CP 8 (Table A). Shapes follow Nemotron-3-Nano-30B-A3B — estimate.
        ModelSpec(
            "nemotron-3-nano-omni-30b-a3b",
            "nvidia/NVIDIA-Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16",
            "NemotronH_Nano_Omni",
            31_600_000_000,
            3_200_000_000,
            layers=52,
            hidden_size=2688,
            heads=32,
            kv_heads=2,
            head_dim=128,
            intermediate_size=1856,
            vocab=131072,
            experts=128,
            experts_per_token=6,
            is_vlm=True,
            has_mtp_head=False,
            native_automodel=True,
            thd_packing=False,
            cp_hook=True,
            kv_bytes_per_token=gqa_kv_bytes(6, 2, 128),
            estimated=(
                "params_total",
                "params_active",
                "layers",
                "hidden_size",
                "heads",
                "intermediate_size",
                "experts",
                "experts_per_token",
                "kv_bytes_per_token",
            ),
            source="catalog",
        ),
        # GLM-5.2 (`glm_moe_dsa`): MLA + DeepSeek sparse attention, 256 routed experts, 1 MTP layer, custom path with
        # tilelang THD packing (Table A: EP256, packing on). 753 B total (recipe); 40 B active, 78 layers, hidden
        # 6144, top-8, moe width 2048, vocab 154880 follow GLM-5 (744B-A40B) — estimate. MLA caches
        # kv_lora_rank 512 + rope 64 values per layer and token.
        ModelSpec(
            "glm-5.2",
            "zai-org/GLM-5.2",
            "GlmMoeDsaForCausalLM",
            753_000_000_000,
            40_000_000_000,
            layers=78,
            hidden_size=6144,
            heads=64,
            kv_heads=1,
            head_dim=576,
            intermediate_size=2048,
            vocab=154880,
            experts=256,
            experts_per_token=8,
            has_mtp_head=True,
            native_automodel=True,
            thd_packing=True,
            kv_bytes_per_token=78 * 576 * 2,
            estimated=(
                "params_active",
                "layers",
                "hidden_size",
                "heads",
                "intermediate_size",
                "vocab",
                "kv_bytes_per_token",
            ),
            source="catalog",
        ),
        # The demo model built offline by runtime/tiny_model.py (reference/environment.md §5: Qwen3Config vocab 1000,
        # hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads, head_dim 32, tied; 423,680 parameters).
        ModelSpec(
            "tiny-qwen3",
            "local/tiny-qwen3",
            "Qwen3ForCausalLM",
            423_680,
            423_680,
            layers=2,
            hidden_size=128,
            heads=4,
            kv_heads=2,
            head_dim=32,
            intermediate_size=256,
            vocab=1000,
            tie_embeddings=True,
            kv_bytes_per_token=gqa_kv_bytes(2, 2, 32),
            source="catalog",
        ),
    )
}
"""Model catalog: `model.arch` keys."""


def model_for_hub_id(name: str) -> ModelSpec | None:
    """The catalog row whose checkpoint is the hub id `name` (`Qwen/Qwen3-8B`), or None. Hub ids are compared
    case-insensitively, as the hub resolves them; a trailing slash is ignored."""
    wanted = name.strip().rstrip("/").casefold()
    if wanted.count("/") != 1:
        return None
    return next((m for m in MODELS.values() if m.hf_name.casefold() == wanted), None)


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator type and the node it usually comes in."""

    key: str
    memory_gib: float
    """Device memory as PyTorch reports it (total_memory / 2**30); vLLM's utilization fraction applies to this."""
    bf16: bool
    gpus_per_node: int
    """GPUs of the reference node (DGX/HGX) — the default node profile."""
    cpus_per_node: int | None
    """Logical CPUs of the reference node (what Ray counts). None: unknown, sized from the recipe."""
    host_memory_gib: float | None = None
    """RAM of the reference node (what CPU offload's host memory is held against, MEM008). None: unknown."""
    source: str = ""
    estimated: tuple[str, ...] = field(default=())


GPUS: dict[str, GpuSpec] = {
    g.key: g
    for g in (
        # H100 SXM 80GB (nvidia-smi 81559 MiB; torch 79.1 GiB); DGX H100: 8 GPUs, 2 × Xeon 8480C = 224 threads,
        # 2 TiB of RAM.
        GpuSpec("h100-80gb", 79.1, True, 8, 224, 2048, source="H100 SXM 80GB; DGX H100"),
        # H200 SXM 141GB: 139.8 GiB measured with torch on the lent H200; HGX H200 nodes: 8 GPUs, 224 threads, 2 TiB
        # of RAM as a DGX H200 (estimates: OEM nodes vary).
        GpuSpec(
            "h200-141gb",
            139.8,
            True,
            8,
            224,
            2048,
            source="H200 SXM 141GB (measured); HGX H200",
            estimated=("cpus_per_node", "host_memory_gib"),
        ),
        # A100 SXM 80GB (nvidia-smi 81920 MiB; torch 79.15 GiB); DGX A100 640GB: 8 GPUs, 2 × EPYC 7742 = 256
        # threads, 2 TiB of RAM.
        GpuSpec("a100-80gb", 79.15, True, 8, 256, 2048, source="A100 SXM 80GB; DGX A100"),
        # B200 180GB HBM3e; DGX B200: 8 GPUs, 2 × Xeon 8570 = 224 threads, 2 TiB of RAM (up to 4). Memory: nominal
        # minus ~1 GiB (estimate).
        GpuSpec("b200-180gb", 178.4, True, 8, 224, 2048, source="B200 180GB; DGX B200", estimated=("memory_gib",)),
        # L40S 48GB (nvidia-smi 46068 MiB; torch 44.5 GiB); PCIe servers vary: 8 GPUs, 128 threads, 1 TiB of RAM is
        # common (estimate).
        GpuSpec(
            "l40s-48gb",
            44.5,
            True,
            8,
            128,
            1024,
            source="L40S 48GB; OEM 8-GPU PCIe server",
            estimated=("gpus_per_node", "cpus_per_node", "host_memory_gib"),
        ),
        # Every role on CPU "device slots" (tests, laptops): no device memory to check, node CPUs from the recipe.
        GpuSpec("cpu", 0.0, False, 0, None, source="CPU device slots; memory is host memory, not checked"),
    )
}
"""GPU catalog: `cluster.gpu` keys."""
