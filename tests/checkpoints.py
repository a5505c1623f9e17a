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
}
MOE_BALANCING = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


def tiny_moe(directory: Path, model_type: str = "qwen3_moe", *, layers: int = 3, **overrides) -> Path:
    """A random mixture-of-experts checkpoint of `model_type` (see `tiny_decoder`), its router's
    balancing loss on."""
    sizes = {**MOE_ARCHITECTURES[model_type], **MOE_BALANCING, **overrides}
    return tiny_decoder(directory, model_type, layers=layers, **sizes)
