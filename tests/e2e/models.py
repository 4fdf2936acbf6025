"""Tiny random models built locally for the end-to-end suite (nothing comes from a hub).

Sizes are the smallest shapes vLLM's CPU backend accepts (block size a
multiple of 32, head_dim 32) while still exercising EAGLE, EAGLE3, MTP and a GDN hybrid.
Weights use a wide init so greedy logits are peaked: near-ties would make the greedy oracle
flaky for reasons that have nothing to do with kvtag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 512
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE = 256
INIT_STD = 0.35
# Qwen3-Next's GDN layer: slow decay and small gate projections, so its state matters (see below).
GDN_A_LOG = -4.0
GDN_DT_BIAS = -4.0
GDN_GATE_STD = 0.02

_WORD_TEXT = (
    "the a of to and in is was for on with as by at from that this it he she they we you "
    "number apples pencils books students train hours minutes costs dollars each total how many "
    "much more less than twice half left gives buys sells has had answer step first then so "
    "question example solve add subtract multiply divide equals one two three four five six seven "
    "eight nine ten hundred thousand percent price store farmer eggs cookies miles speed week day"
)
WORDS = tuple(_WORD_TEXT.split())


def _corpus() -> list[str]:
    """A deterministic arithmetic-word-problem corpus to train the tokenizer on."""
    lines = []
    for i in range(400):
        words = [WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(24)]
        lines.append(" ".join(words) + f" {i} + {i * 3 % 97} = {i + i * 3 % 97}.")
    return lines


def build_tokenizer(out: Path) -> None:
    """Train a byte-level BPE with exactly VOCAB entries and write HF tokenizer files."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 4096,
            }
        )
    )
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * INIT_STD).to(dtype)


def _llama_layer(gen: torch.Generator, prefix: str, input_norm: bool = True) -> dict[str, torch.Tensor]:
    t = {
        f"{prefix}.self_attn.q_proj.weight": _rand(gen, HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": _rand(gen, KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": _rand(gen, KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": _rand(gen, HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": _rand(gen, INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": _rand(gen, INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": _rand(gen, HIDDEN, INTERMEDIATE),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
    }
    if input_norm:
        t[f"{prefix}.input_layernorm.weight"] = torch.ones(HIDDEN)
    return t


def _llama_config(arch: str, layers: int, **extra: Any) -> dict[str, Any]:
    return {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
        **extra,
    }


def _write(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def build_llama(out: Path, seed: int = 0) -> Path:
    """Target: random LlamaForCausalLM, 2 layers, hidden 128, 4 heads, 2 KV heads, vocab 512."""
    gen = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _rand(gen, VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": _rand(gen, VOCAB, HIDDEN),
    }
    for i in range(2):
        t.update(_llama_layer(gen, f"model.layers.{i}"))
    _write(out, _llama_config("LlamaForCausalLM", 2), t)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    build_tokenizer(out)
    return out


def build_eagle(out: Path, seed: int = 1) -> Path:
    """EAGLE drafter: fc [128,256] + one decoder layer without input_layernorm.

    Embedding and lm_head are absent, so vLLM shares the target's.
    """
    gen = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _rand(gen, HIDDEN, 2 * HIDDEN)}
    t.update(_llama_layer(gen, "layers.0", input_norm=False))
    return _write(out, _llama_config("EagleLlamaForCausalLM", 1), t)


def build_eagle3(out: Path, seed: int = 2) -> Path:
    """EAGLE3 drafter reading aux hidden states of target layers 0, 1, 2."""
    gen = torch.Generator().manual_seed(seed)
    t = {
        "fc.weight": _rand(gen, HIDDEN, 3 * HIDDEN),
        "norm.weight": torch.ones(HIDDEN),
        "midlayer.input_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.hidden_norm.weight": torch.ones(HIDDEN),
        "midlayer.post_attention_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.self_attn.q_proj.weight": _rand(gen, HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": _rand(gen, KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": _rand(gen, KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": _rand(gen, HIDDEN, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": _rand(gen, INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": _rand(gen, INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": _rand(gen, HIDDEN, INTERMEDIATE),
        "lm_head.weight": _rand(gen, VOCAB, HIDDEN),
    }
    cfg = _llama_config(
        "Eagle3LlamaForCausalLM", 1, draft_vocab_size=VOCAB, eagle_aux_hidden_state_layer_ids=[0, 1, 2]
    )
    return _write(out, cfg, t)


def build_mimo(out: Path, seed: int = 4) -> Path:
    """MiMo target (Qwen2 layers with q/k/v bias) carrying one MTP layer, for `method="mtp"`."""
    gen = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _rand(gen, VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": _rand(gen, VOCAB, HIDDEN),
    }
    layers = [f"model.layers.{i}" for i in range(2)] + ["model.mtp_layers.0"]
    for prefix in layers:
        t.update(_llama_layer(gen, prefix))
        t[f"{prefix}.self_attn.q_proj.bias"] = torch.zeros(HEADS * HEAD_DIM)
        t[f"{prefix}.self_attn.k_proj.bias"] = torch.zeros(KV_HEADS * HEAD_DIM)
        t[f"{prefix}.self_attn.v_proj.bias"] = torch.zeros(KV_HEADS * HEAD_DIM)
    mtp = "model.mtp_layers.0"
    t[f"{mtp}.token_layernorm.weight"] = torch.ones(HIDDEN)
    t[f"{mtp}.hidden_layernorm.weight"] = torch.ones(HIDDEN)
    t[f"{mtp}.final_layernorm.weight"] = torch.ones(HIDDEN)
    t[f"{mtp}.input_proj.weight"] = _rand(gen, HIDDEN, 2 * HIDDEN)
    cfg = _llama_config("MiMoForCausalLM", 2, num_nextn_predict_layers=1)
    cfg["model_type"] = "qwen2"
    _write(out, cfg, t)
    build_tokenizer(out)
    return out


def build_qwen3_next(out: Path, seed: int = 3) -> Path:
    """Hybrid GDN + attention: 2 layers (linear_attention, full_attention), 4-expert MoE, bf16.

    vLLM's Qwen3Next needs at least one sparse-MoE layer, so the MoE stays (tiny). The GDN layer
    decays slowly so its state carries the prefix: the hybrid oracle must see a wrong state.
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=128,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            gdn = getattr(layer, "linear_attn", None)
            if gdn is None:
                continue
            # A long memory: decay exp(-exp(A_log) * softplus(a + dt_bias)) per token stays near 1
            # (A_log about -4, softplus(-4) about 0.02), so the state carries the whole prefix and a
            # missing or wrong state changes the output. Hub-like init (A_log up to 2.8, dt_bias 1,
            # wide projections) forgets within about a token.
            gdn.A_log.fill_(GDN_A_LOG)
            gdn.dt_bias.fill_(GDN_DT_BIAS)
            gdn.in_proj_ba.weight.normal_(0.0, GDN_GATE_STD)
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    build_tokenizer(out)
    return out


def build_all(root: Path) -> dict[str, Path]:
    """Build every model under root (idempotent: reuses a complete previous build)."""
    builders = {
        "llama": build_llama,
        "eagle": build_eagle,
        "eagle3": build_eagle3,
        "mimo": build_mimo,
        "qwen3_next": build_qwen3_next,
    }
    paths = {}
    for name, build in builders.items():
        path = root / name
        if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
            build(path)
        paths[name] = path
    return paths


if __name__ == "__main__":
    import sys

    print(json.dumps({k: str(v) for k, v in build_all(Path(sys.argv[1])).items()}))
