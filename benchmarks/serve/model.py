"""A random-weight Llama whose prefill costs what a production prefill costs relative to a load, and
an EAGLE drafter for it, built locally (nothing comes from a hub).

Why these sizes: on a 2-core CPU a 2,048-token prefill of this model takes over a second, so a hit
saves time an operator would notice; the e2e suite's 128-wide model prefills in milliseconds, where
any store's hop costs more than it saves. The tokenizer is the e2e suite's (512 entries). Weights
are wide-init like the e2e models' so greedy logits are peaked and cold/warm comparisons are exact.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.e2e.models import VOCAB, build_tokenizer


@dataclass(frozen=True)
class Shape:
    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 1536
    init_std: float = 0.06
    lm_head_std: float = 0.5

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V, every layer, every KV head (float32 in this benchmark)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def _rand(gen: torch.Generator, std: float, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _layer(gen: torch.Generator, s: Shape, prefix: str, input_norm: bool = True) -> dict[str, torch.Tensor]:
    std = s.init_std
    t = {
        f"{prefix}.self_attn.q_proj.weight": _rand(gen, std, s.heads * s.head_dim, s.hidden),
        f"{prefix}.self_attn.k_proj.weight": _rand(gen, std, s.kv_heads * s.head_dim, s.hidden),
        f"{prefix}.self_attn.v_proj.weight": _rand(gen, std, s.kv_heads * s.head_dim, s.hidden),
        f"{prefix}.self_attn.o_proj.weight": _rand(gen, std, s.hidden, s.heads * s.head_dim),
        f"{prefix}.mlp.gate_proj.weight": _rand(gen, std, s.intermediate, s.hidden),
        f"{prefix}.mlp.up_proj.weight": _rand(gen, std, s.intermediate, s.hidden),
        f"{prefix}.mlp.down_proj.weight": _rand(gen, std, s.hidden, s.intermediate),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(s.hidden),
    }
    if input_norm:
        t[f"{prefix}.input_layernorm.weight"] = torch.ones(s.hidden)
    return t


def _config(s: Shape, arch: str, layers: int) -> dict[str, object]:
    return {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": VOCAB,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def _write(out: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))  # last: marks a complete build


def build_target(out: Path, s: Shape, seed: int = 0) -> Path:
    gen = torch.Generator().manual_seed(seed)
    t = {
        "model.embed_tokens.weight": _rand(gen, 1.0, VOCAB, s.hidden),
        "model.norm.weight": torch.ones(s.hidden),
        "lm_head.weight": _rand(gen, s.lm_head_std, VOCAB, s.hidden),
    }
    for i in range(s.layers):
        t.update(_layer(gen, s, f"model.layers.{i}"))
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    _write(out, _config(s, "LlamaForCausalLM", s.layers), t)
    return out


def build_eagle(out: Path, s: Shape, seed: int = 1) -> Path:
    """EAGLE drafter: fc [hidden, 2*hidden] and one decoder layer without input_layernorm; it shares
    the target's embedding and lm_head."""
    gen = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _rand(gen, s.init_std, s.hidden, 2 * s.hidden)}
    t.update(_layer(gen, s, "layers.0", input_norm=False))
    _write(out, _config(s, "EagleLlamaForCausalLM", 1), t)
    return out


def build(root: Path, s: Shape = Shape()) -> dict[str, Path]:
    """Builds target and drafter under root/<shape key>, reusing a complete earlier build."""
    key = "llama-" + "-".join(str(v) for v in asdict(s).values())
    paths = {"target": root / key / "target", "eagle": root / key / "eagle"}
    if not (paths["target"] / "config.json").exists():
        build_target(paths["target"], s)
    if not (paths["eagle"] / "config.json").exists():
        build_eagle(paths["eagle"], s)
    return paths
