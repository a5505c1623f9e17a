"""Tiny, real Hugging Face checkpoints made here: what a user passes as `model.pretrained=DIR`.

`save_pretrained` of a random tiny config is a checkpoint like any on the hub, and the
`tokenizers` library builds a real byte-level BPE tokenizer with a ChatML chat template, so the
tests exercise the same loading code as a downloaded Llama, Qwen, Mistral, Gemma or Phi model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

VOCAB = 320
# What each architecture's tiny checkpoint must show: Mistral's window shorter than the test
# sequences, Gemma 2's tied embeddings and alternating sliding/full layers, GQA everywhere.
ARCHITECTURES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 6},
    "gemma2": {"sliding_window": 6, "tie_word_embeddings": True, "final_logit_softcapping": 30.0},
    "phi3": {},
}
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris is.",
    "user assistant system: hello there, how can I help you today?", "Two plus two is four; three times three is nine.",
]


def chat_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML special tokens and chat template (at most vocab_size tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   bos_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def bos_adding_tokenizer(directory: Path, chat_template: str | None = None) -> Path:
    """The chat tokenizer (with `chat_template` when given), saved in `directory`, with a bos that
    tokenizing text adds and the chat template's tokenizing does not: TRL's trainers tokenize
    text and conversations each way, and a test tells them apart by it."""
    from tokenizers import processors

    tok = chat_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    bos = tok.bos_token
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.bos_token_id)])
    tok.save_pretrained(directory)
    return Path(directory)


def tiny_decoder(directory: Path, model_type: str = "llama", *, layers: int = 3, dtype: torch.dtype = torch.float32,
                 seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """A random decoder checkpoint of `model_type` (and, unless told otherwise, its chat
    tokenizer) saved with save_pretrained under `directory`; returns the directory."""
    tok = chat_tokenizer()
    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128,
                 pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                 **ARCHITECTURES.get(model_type, {}))
    if model_type == "phi3":  # Phi-3's heads are hidden / heads wide, always
        sizes.pop("head_dim")
    sizes.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes))
    model.to(dtype).save_pretrained(directory)
    if tokenizer:
        tok.save_pretrained(directory)
    return Path(directory)


# Tiny mixtures of experts (4 experts, top 2, every layer routed), the balancing loss on
# (`output_router_logits`) with a coefficient far from the published ~1e-3, so that a wrong aux
# gradient shows; Qwen2-MoE with its shared expert, Qwen3-MoE with one dense layer
# (`mlp_only_layers`): L counts the routed layers only.
MOE_ARCHITECTURES = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True,
                  "mlp_only_layers": [1]},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "shared_expert_intermediate_size": 40},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    # GPT-OSS: attention sinks, biased and clamped SwiGLU experts, sliding layers (a window of 4) among full ones
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
}
MOE_BALANCING = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


# Tiny mixtures balanced by a routing bias instead of a loss term (DeepSeek-V3's auxiliary-loss-free
# routing; GLM-4.5 and dots.llm1 route the same way): 4 experts in 2 groups, the tokens' top 2 from
# the best group, a shared expert, the first layer dense. DeepSeek-V3 with its multi-head latent
# attention: low-rank queries and keys/values, a rotary slice of 4 of each head's 12 query dims.
_ROUTED_BY_BIAS = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "n_shared_experts": 1,
                   "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1}
BIAS_BALANCED_ARCHITECTURES = {
    "deepseek_v3": {**_ROUTED_BY_BIAS, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "head_dim": 4,
                    "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4, "routed_scaling_factor": 2.5},
    "glm4_moe": dict(_ROUTED_BY_BIAS),
    "dots1": dict(_ROUTED_BY_BIAS),
}


def tiny_bias_balanced(directory: Path, model_type: str = "deepseek_v3", *, layers: int = 3) -> Path:
    """A random checkpoint of a mixture balanced by a routing bias (see above), its bias drawn too
    (a checkpoint's is trained; zeros would not show a strategy that lost it)."""
    tiny_decoder(directory, model_type, layers=layers, **BIAS_BALANCED_ARCHITECTURES[model_type])
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.copy_(torch.randn_like(bias) * 0.5)
    model.save_pretrained(directory)
    return Path(directory)


def tiny_gpt_oss_mxfp4(directory: Path) -> Path:
    """A tiny GPT-OSS checkpoint stored as OpenAI publishes GPT-OSS: its experts in MXFP4 (per
    fused tensor, `_blocks` of packed FP4 pairs, 32 values a block, and `_scales`, one power-of-two
    exponent a block), the rest in the checkpoint's dtype, a `quantization_config` naming mxfp4.
    The codes and exponents are drawn (any bytes are a valid MXFP4 tensor), the exponents small as
    published experts' weights are: where GPT-OSS's SwiGLU clamp binds, a rounding's worth of
    difference in a value changes its gradient from whole to none."""
    import json

    from safetensors.torch import load_file, save_file

    tiny_moe(directory, "gpt_oss")
    [weights] = list(Path(directory).glob("*.safetensors"))
    tensors = load_file(weights)
    draws = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, columns, rows = tensors.pop(name).shape  # stored transposed: (experts, in, out)
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=draws,
                                                  dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(117, 122, (experts, rows, columns // 32), generator=draws,
                                                  dtype=torch.uint8)  # 2^-10 .. 2^-6: weights up to 0.09
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((Path(directory) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (Path(directory) / "config.json").write_text(json.dumps(config))
    return Path(directory)


def tiny_moe(directory: Path, model_type: str = "qwen3_moe", *, layers: int = 3, **overrides) -> Path:
    """A random mixture-of-experts checkpoint of `model_type` (see `tiny_decoder`), its router's
    balancing loss on."""
    sizes = {**MOE_ARCHITECTURES[model_type], **MOE_BALANCING, **overrides}
    return tiny_decoder(directory, model_type, layers=layers, **sizes)
