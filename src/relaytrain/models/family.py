"""Model families: what relaytrain knows of a kind of model, registered by name and asked,
never branched on.

A family is one module under `models/` that holds its layered class and registers a `Family`
spec: how the `model` config keys become a Hugging Face config and how a checkpoint's config
becomes `model` keys, which config attributes carry dropout, which objectives (heads) it has, what
kind of tokenizer a run trains for it when none is given, and whether it takes a given
checkpoint. Everything outside `models/` asks the spec (`family_spec(name)`,
`family_of(hf_config)`); a name no family registered is one line naming those that exist.

Adding a family: a module here with its `LayeredModel` subclass and a `register_family(...)`
call, imported by `models/__init__.py`; a config under `configs/model/`; its tests (the
conformance suite picks it up from `families()`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from relaytrain.utils.errors import ConfigError


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek-V3's multi-head latent attention (MLA), as its config gives it: queries through a
    rank `q_rank` bottleneck (0: projected directly), keys and values from one shared latent of
    `kv_rank` (plus a rotary key of `rope` shared by the heads), each head's query and key
    `nope + rope` wide and its value `value` wide."""

    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    value: int

    @classmethod
    def of(cls, architecture) -> LatentAttention | None:
        """The latent attention a checkpoint's architecture keys describe (None: it has none)."""
        if not architecture or not architecture.get("kv_lora_rank"):
            return None
        a = architecture
        return cls(a.get("q_lora_rank") or 0, a["kv_lora_rank"], a["qk_nope_head_dim"], a["qk_rope_head_dim"],
                   a["v_head_dim"])


@dataclass(frozen=True)
class BlockShape:
    """What the cost model needs of one block: its widths and whether its MLP is gated."""

    hidden: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention: fewer key/value heads than query heads
    head_dim: int
    intermediate: int
    gated_mlp: bool  # SwiGLU/GeGLU: gate and up projections, their product feeds the down projection
    # A mixture of experts: `intermediate` is what one token's MLP work spans (its top-k experts'
    # widths and a shared expert's), and the router scores this many outputs per token (its
    # experts, and Qwen2-MoE's shared-expert gate); 0: a dense block.
    router_outputs: int = 0
    latent: LatentAttention | None = None  # DeepSeek-V3's latent attention: its widths replace head_dim's
    experts: int = 0  # a mixture's routed experts a block (0: dense), each an MLP of `expert_width`
    expert_width: int = 0

    @classmethod
    def multi_head(cls, m) -> BlockShape:
        """A block of BERT's and GPT-2's kind: as many key/value heads as query heads, each
        hidden / heads wide, and a plain two-matrix MLP."""
        return cls(m.hidden_size, m.num_heads, m.num_heads, m.hidden_size // m.num_heads, m.intermediate_size,
                   gated_mlp=False)

    @classmethod
    def decoder(cls, m) -> BlockShape:
        """A block of the Llama layout (family=decoder): a gated MLP, grouped-query or latent
        attention; a mixture's MLP as one token's work: its top-k experts and shared experts
        (Qwen2-MoE's one of its own width, with a gate of its own; the bias-balanced types'
        n_shared_experts of the experts' width, which a checkpoint's keys carry as one width and
        a published shape's config in model.architecture). Their dense first layers count as
        expert layers: the block the cost models scale by the layer count is the largest one."""
        mlp, router, expert = m.intermediate_size, 0, 0
        architecture = m.architecture or {}
        if m.num_experts:
            expert = m.expert_intermediate_size or m.intermediate_size
            shared = m.shared_expert_intermediate_size or (architecture.get("n_shared_experts") or 0) * expert
            mlp = m.experts_per_token * expert + shared
            gate = str(m.model_type) == "qwen2_moe" and m.shared_expert_intermediate_size
            router = m.num_experts + (1 if gate else 0)
        return cls(m.hidden_size, m.num_heads, m.num_kv_heads or m.num_heads, m.head_dim or m.hidden_size // m.num_heads,
                   mlp, gated_mlp=True, router_outputs=router, latent=LatentAttention.of(architecture),
                   experts=m.num_experts or 0, expert_width=expert)


@dataclass(frozen=True)
class Family:
    name: str
    layered: type  # the LayeredModel subclass: layered(hf_model, task)
    # The objectives whose heads it has (`relaytrain.objectives` classes: an objective derived
    # from one of them trains on the same head); the first is what a bare body gets.
    objectives: tuple[type, ...]
    tokenizer: str  # what a run trains when no tokenizer is given: "wordpiece" or "byte_bpe"
    hf_config: Callable  # model keys -> Hugging Face config (no weights)
    facts: Callable  # a checkpoint's Hugging Face config -> model keys
    block_shape: Callable  # model keys -> BlockShape
    # Why this family cannot take a checkpoint's Hugging Face config, or None when it can.
    refuses: Callable
    dropout_keys: tuple[str, ...] = ()  # Hugging Face config attributes that model.dropout sets
    description: str = ""  # a few words for errors and the help: what checkpoints it takes
    # The attention kernel a checkpoint's config runs with when model.attn_implementation asks
    # for one (eager where the architecture has no sdpa kernel).
    attention: Callable = staticmethod(lambda hf_config, wanted: wanted)
    # The `model` keys a checkpoint's config takes from the run beside dropout (a mixture's
    # balancing loss: `output_router_logits`, `router_aux_loss_coef`), set in place.
    run_settings: Callable = staticmethod(lambda hf_config, m: None)
    # Positions rotary, not a learned table: a sequence longer than model.max_seq_len computes
    # as Hugging Face's model computes it (only past the length the checkpoint was trained on), so
    # raising model.max_seq_len is the user's to choose; a learned table has no row to give.
    rotary_positions: bool = False
    # A block's tensor-parallel plan (`placement/tensor_parallel.py`): each linear layer, by its
    # path inside a block's Hugging Face layer, split "colwise" or "rowwise" over the tensor ranks,
    # or a norm "replicated_with_grad_allreduce" (transformers' names); None: the family has none.
    tp_plan: Callable = staticmethod(lambda hf_config: None)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The names (`model.task`) of its objectives, the bare body's first."""
        return tuple(cls.name for cls in self.objectives)

    def past_positions_remedy(self, seq_len: int, pretrained: bool) -> str:
        """What a user can do about a sequence of `seq_len` tokens, longer than the model's
        positions (`pretrained`: a checkpoint's model, whose config decides them)."""
        if pretrained:  # the checkpoint's config decides them (models.pretrained.resolve)
            return ("lower data.seq_len (the checkpoint's config says how many positions it has; a longer "
                    "context needs a checkpoint configured for it)")
        if self.rotary_positions:  # rotary: the positions extend, as in Hugging Face's model
            return (f"lower data.seq_len, or raise model.max_seq_len={seq_len} to train past the length the "
                    f"model was trained on (rotary positions extend; long-context fine-tunes usually set "
                    f"model.rope_scaling too)")
        return "lower data.seq_len or raise model.max_seq_len (its learned position table grows with it)"

    def trains(self, objective) -> bool:
        """Whether it has the head `objective` (a `relaytrain.objectives` instance) trains."""
        return isinstance(objective, self.objectives)

    def set_dropout(self, hf_config, p: float) -> None:
        """The run's dropout on every dropout attribute the config has (a checkpoint's included)."""
        for key in self.dropout_keys:
            if hasattr(hf_config, key):
                setattr(hf_config, key, p)


def transformers_block_plan(hf_config) -> dict[str, str] | None:
    """A block's tensor-parallel plan as transformers gives it (`base_model_tp_plan` of the config,
    e.g. Llama's {"layers.*.self_attn.q_proj": "colwise", ...}): its entries under `layers.*.`,
    keyed by their path inside the layer; the embeddings' entries left out (they stay whole). None
    where the config carries no plan for its layers."""
    prefix = "layers.*."
    plan = getattr(hf_config, "base_model_tp_plan", None) or {}
    block = {key.removeprefix(prefix): style for key, style in plan.items() if key.startswith(prefix)}
    return block or None


_FAMILIES: dict[str, Family] = {}


def register_family(spec: Family) -> Family:
    if spec.name in _FAMILIES:
        raise ValueError(f"model family {spec.name!r} is registered twice")
    _FAMILIES[spec.name] = spec
    return spec


def families() -> dict[str, Family]:
    return dict(_FAMILIES)


def family_spec(name: str) -> Family:
    """The family called `name`, or one line naming the families there are."""
    try:
        return _FAMILIES[str(name)]
    except KeyError:
        raise ConfigError(f"model.family={name} is not a model family; choose one of "
                          f"{', '.join(sorted(_FAMILIES))}") from None


def family_of(hf_config) -> Family:
    """The family that takes a checkpoint's config: the first that does not refuse it, else one
    line naming the architecture, why each family refused and what is supported."""
    reasons = []
    for spec in _FAMILIES.values():
        why = spec.refuses(hf_config)
        if why is None:
            return spec
        reasons.append(why)
    architecture = ", ".join(getattr(hf_config, "architectures", None) or []) or hf_config.model_type
    supported = "; ".join(spec.description for spec in _FAMILIES.values() if spec.description)
    specific = [r for r in reasons if r and not r.startswith("not ")]
    why = f" ({specific[0]})" if specific else ""
    raise ConfigError(f"the checkpoint is a {hf_config.model_type!r} model ({architecture}) that relaytrain cannot "
                      f"train{why}; supported: {supported}")
