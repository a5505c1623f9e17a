"""Mixture-of-experts decoders: the router's load-balancing loss, exact block by block.

Hugging Face's sparse-MLP decoders (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral,
OLMoE, GPT-OSS with its attention sinks and clamped SwiGLU experts; DeepSeek-V3, GLM-4.5 and dots.llm1, which balance by a routing bias and have no balancing
term: `BIAS_BALANCED`) are decoders of the Llama layout whose MLP is a router and fused 3-D expert tensors
(`experts.gate_up_proj`, `experts.down_proj`); the blocks run Hugging Face's own layers, so the
experts compute as transformers computes them. What the layered model adds is the router's
balancing term, which Hugging Face computes over every layer at once
(`load_balancing_loss_func`, added to the loss as `router_aux_loss_coef * aux` when the
config's `output_router_logits` is on):

    aux = E * sum_e f_e * P_e,  f_e = C_e / (L * T),  P_e = S_e / (L * T)

with E experts, L routed layers, T the micro-batch's tokens (its attention mask's ones), C_e the
top-k assignments to expert e summed over the layers (no gradient) and S_e the router
probabilities of expert e summed over the layers' tokens. Only P carries a gradient, and P is a
sum over the layers, so with f known the term is a sum of one local term per layer:

    aux = sum_l (E / (L * T)) * sum_e f_e * S^l_e

f is known once the micro-batch's forward has passed every layer, before any backward: each
routed block records its counts in the micro-batch's `RouterTally` (one per micro-batch, in the
blocks' shared context, so a recompute records the same again), and its output passes through
`_Balance`, whose backward adds the gradient of its own local term to the router logits. The
head adds the term's value to the micro-batch's loss through `_Anchor`, whose backward tells the
tally how the loss is scaled (the minibatch's items, an fp16 loss scale): so the strategies
that run the blocks of a micro-batch in one process (the baseline, replicas, FSDP, L2L with its
block-by-block backward and its recompute) train Hugging Face's exact gradient without a change.
A pipeline's stages each hold some of the layers: a stage's tally starts from the sums of the
stages before it (`take_forward_message`, travelling with the activations), so the last stage's
is complete, and hands back the fractions and the loss's scale (`backward_message`, travelling
with the gradients), so every stage's blocks add their shares (`strategies/pipeline/routing.py`).

A minibatch's loss is its cross-entropy, the mean over every item of its micro-batches (every
replica's share), plus the mean over those micro-batches of `coef * aux`, Hugging Face's
`router_aux_loss_coef * aux` of each (`LossTerms.per_microbatch`): a micro-batch's balancing
pressure does not depend on how many labelled tokens it holds (Megatron scales its aux loss by
the micro-batches the same way). Hugging Face's Trainer, which hands a mixture the minibatch's
item count, adds the whole term once per accumulation step instead: its sum over M micro-batches
is M times this mean (`model.router_aux_loss_coef` times M trains as the Trainer does).
"""

from __future__ import annotations

import dataclasses
import weakref
from contextlib import contextmanager

import torch
from omegaconf import OmegaConf
from torch import nn

from relaytrain.utils.errors import ConfigError

ROUTER = "router"  # the shared-context entry holding the micro-batch's RouterTally
# The sparse-MLP types whose whole forward the layered decoder computes as Hugging Face does
# (tests/models/test_moe.py): router logits at output 0 of the router module their model class
# records (`_can_record_outputs["router_logits"]`), Hugging Face's `load_balancing_loss_func`.
PROVEN_MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe", "dots1")
# Mixtures that balance their experts without a loss term: DeepSeek-V3's auxiliary-loss-free routing
# (a per-expert bias added to the selection scores, nudged between steps by the expert loads; GLM-4.5
# and dots.llm1 route the same way). Hugging Face adds no balancing term to their loss and keeps the
# bias as a buffer it never updates, so the layered model trains the same: cross-entropy alone.
BIAS_BALANCED = ("deepseek_v3", "glm4_moe", "dots1")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def expert_count(config) -> int:
    """Experts per routed layer (0: a dense model)."""
    for key in EXPERT_KEYS:
        try:
            count = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - a config that will not say has none
            count = None
        if isinstance(count, int) and count:
            return count
    return 0


# --------------------------------------------------------------------------- the routing


@dataclasses.dataclass(frozen=True)
class Routing:
    """What a model's routed layers share: experts, top-k, the balancing term's coefficient, how
    many layers route (L), and which module is each layer's router."""

    experts: int
    top_k: int
    coef: float
    layers: int
    router_class: type
    balances: bool  # output_router_logits: the aux term is in the loss

    @classmethod
    def of(cls, hf_model: nn.Module) -> Routing | None:
        """The routing of a Hugging Face MoE causal LM (None for a dense one)."""
        config = hf_model.config
        if not expert_count(config):
            return None
        recorder = type(hf_model)._can_record_outputs["router_logits"]
        router_class = recorder.target_class
        layers = sum(1 for layer in hf_model.model.layers if router_path(layer, router_class) is not None)
        return cls(experts=expert_count(config), top_k=config.num_experts_per_tok, coef=aux_coef(config),
                   layers=layers, router_class=router_class,
                   balances=bool(config.output_router_logits) and config.model_type not in BIAS_BALANCED)

    def tally(self, mask: torch.Tensor | None) -> RouterTally:
        return RouterTally(self, None if mask is None else mask.reshape(-1).float())


def aux_coef(config) -> float:
    """The balancing term's coefficient (0: a mixture balanced by its routing bias, which has none)."""
    return float(getattr(config, "router_aux_loss_coef", None) or 0.0)


def router_path(layer: nn.Module, router_class: type) -> str | None:
    """The name of `layer`'s router module (None: a dense layer, e.g. Qwen's `mlp_only_layers`)."""
    return next((name for name, module in layer.named_modules() if isinstance(module, router_class)), None)


class RouterTally:
    """One micro-batch's routing over the model's routed layers: each layer's top-k assignments
    (C^l, masked like Hugging Face's) and probability sums (S^l, values only), and, once the head's
    backward has run, the factor its loss was scaled by."""

    def __init__(self, routing: Routing, mask: torch.Tensor | None):
        self.routing, self.mask = routing, mask
        self.counts: dict[int, torch.Tensor] = {}
        self.prob_sums: dict[int, torch.Tensor] = {}
        self.loss_scale: torch.Tensor | None = None  # d(loss) / d(aux), set by `_Anchor` in the head's backward
        # A pipeline stage's view (`forward_message` / `backward_message`): the sums of the layers
        # earlier stages ran, and the fractions the last stage computed from every layer.
        self.upstream: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (layers, counts, probability sums)
        self.settled: torch.Tensor | None = None

    def record(self, block: int, logits: torch.Tensor) -> None:
        """Block `block`'s router logits [tokens, experts]: its counts and probability sums, as
        `load_balancing_loss_func` makes them (set, not added: a recompute records the same)."""
        r = self.routing
        with torch.no_grad():
            probs = torch.softmax(logits.detach(), dim=-1)
            _, chosen = torch.topk(probs, r.top_k, dim=-1)
            weight = torch.ones(chosen.shape[0], device=logits.device) if self.mask is None else self.mask.to(logits.device)
            counts = torch.zeros(r.experts, dtype=torch.float32, device=logits.device)
            counts.scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(r.top_k))
            self.counts[block] = counts
            self.prob_sums[block] = (probs.float() * weight.unsqueeze(-1)).sum(dim=0)

    def tokens(self, device: torch.device) -> torch.Tensor:
        """T: the micro-batch's tokens the term averages over (its mask's ones)."""
        if self.mask is None:  # every row counts: each assigned top_k times in every layer
            layers, counts, _ = self._totals()
            return counts.sum() / (layers * self.routing.top_k)
        return self.mask.to(device).sum()

    def fractions(self) -> torch.Tensor:
        """f: every layer's top-k assignments over L * T (a constant: no gradient)."""
        if self.settled is not None:
            return self.settled
        self._check_complete()
        _, counts, _ = self._totals()
        return counts / (self.routing.layers * self.tokens(counts.device))

    def aux(self) -> torch.Tensor:
        """Hugging Face's load-balancing loss of the micro-batch (its value)."""
        f = self.fractions()
        _, _, prob_sums = self._totals()
        probs = prob_sums / (self.routing.layers * self.tokens(f.device))
        return self.routing.experts * (f * probs).sum()

    def _totals(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The layers recorded (here and upstream), their summed counts and probability sums."""
        layers, counts, prob_sums = self.upstream or (0, 0.0, 0.0)
        if self.counts:
            counts = counts + torch.stack(list(self.counts.values())).sum(dim=0)
            prob_sums = prob_sums + torch.stack(list(self.prob_sums.values())).sum(dim=0)
        return layers + len(self.counts), counts, prob_sums

    # A pipeline stage's messages: the sums travel forward with the activations to the last stage,
    # the fractions and the loss's scale travel back with the gradients, so that every stage's
    # blocks add their local shares exactly as one process would.
    # (The layer counts do not travel: each stage knows how many routed layers come before its
    # blocks, and no value has to be read back from the device.)
    def forward_message(self, device: torch.device) -> torch.Tensor:
        """[counts (E), probability sums (E)] of this stage's layers and every earlier one's."""
        _, counts, prob_sums = self._totals()
        zeros = torch.zeros(self.routing.experts, dtype=torch.float32, device=device)
        return torch.cat([(zeros + counts).to(device), (zeros + prob_sums).to(device)])

    def take_forward_message(self, message: torch.Tensor, layers: int) -> None:
        """The earlier stages' `forward_message`, from their `layers` routed layers."""
        e = self.routing.experts
        self.upstream = (layers, message[:e], message[e:2 * e])

    def backward_message(self, device: torch.device) -> torch.Tensor:
        """[f (E), d(loss)/d(aux)], once backward has run here (a scale of 0 where the loss did
        not reach the term: every share is then zero, as `local_grad` makes it)."""
        scale = self.loss_scale.reshape(1).to(device) if self.loss_scale is not None else torch.zeros(1, device=device)
        return torch.cat([self.fractions().to(device).float(), scale])

    def take_backward_message(self, message: torch.Tensor) -> None:
        e = self.routing.experts
        self.settled, self.loss_scale = message[:e], message[e]

    def local_grad(self, logits: torch.Tensor) -> torch.Tensor:
        """d(loss)/d(logits) through this layer's share of aux, (E / (L T)) sum_e f_e S^l_e, times
        d(loss)/d(aux): softmax's Jacobian against the constant weights f, per token
        p * (f - p . f), masked tokens none."""
        r = self.routing
        if self.loss_scale is None:  # the head's term was not backpropagated (no loss through it)
            return torch.zeros_like(logits)
        f = self.fractions().to(logits.device)
        probs = torch.softmax(logits.detach().float(), dim=-1)
        grad = probs * (f - (probs * f).sum(dim=-1, keepdim=True))
        if self.mask is not None:
            grad = grad * self.mask.to(logits.device).unsqueeze(-1)
        scale = self.loss_scale.to(logits.device) * r.experts / (r.layers * self.tokens(logits.device))
        return (grad * scale).to(logits.dtype)

    def _check_complete(self) -> None:
        layers = self._totals()[0]
        if layers != self.routing.layers:
            raise ConfigError(f"the router's balancing loss needs every routed layer of a micro-batch recorded "
                              f"({layers} of {self.routing.layers} were); a strategy that splits the blocks over "
                              f"processes must carry the others' routing (RouterTally.forward_message)")



class _Balance(torch.autograd.Function):
    """The block's output unchanged; backward adds the gradient of the block's share of the aux
    term to its router logits (with the micro-batch's fractions, known by then)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, logits: torch.Tensor, tally: RouterTally) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.tally = tally
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (logits,) = ctx.saved_tensors
        grad_logits = ctx.tally.local_grad(logits) if ctx.needs_input_grad[1] else None
        return grad_out, grad_logits, None


class _Anchor(torch.autograd.Function):
    """The aux term's value in the loss, hung on the head's input so that the head's backward reaches
    it: its backward hands the tally the loss's scale and sends nothing on (f carries none)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, weight: float, tally: RouterTally) -> torch.Tensor:
        ctx.tally, ctx.weight = tally, weight
        return aux * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.tally.loss_scale = grad.detach().float() * ctx.weight
        return None, None, None, None


def balanced(out: torch.Tensor, logits: torch.Tensor, tally: RouterTally) -> torch.Tensor:
    """A routed block's output, its backward carrying the block's share of the aux term."""
    if not torch.is_grad_enabled() or not (out.requires_grad or logits.requires_grad):
        return out
    return _Balance.apply(out, logits, tally)


def anchored(hidden: torch.Tensor, tally: RouterTally) -> torch.Tensor:
    """`coef * aux`, the micro-batch's aux term, its backward reporting the scale the loss is
    taken at: hung on the head's input `hidden`, whose gradient every block's backward waits for."""
    aux, weight = tally.aux().to(torch.float32), tally.routing.coef
    if not torch.is_grad_enabled() or not hidden.requires_grad:
        return aux * weight
    return _Anchor.apply(hidden, aux, weight, tally)


@contextmanager
def captured_router(router: nn.Module):
    """The router's logits (output 0, as Hugging Face's OutputRecorder takes them) while the block runs."""
    seen: list[torch.Tensor] = []
    handle = router.register_forward_hook(lambda module, args, output: seen.append(output[0]))
    try:
        yield seen
    finally:
        handle.remove()


class Tallies:
    """The micro-batches' tallies by key, held weakly while training: each lives as long as its
    micro-batch's shared context or the autograd graph that reads it. An evaluation has no graph,
    so its tallies are held until the head takes them (`take`)."""

    def __init__(self):
        self._by_key: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._held: dict = {}

    def put(self, key, tally: RouterTally, hold: bool = False) -> None:
        self._by_key[key] = tally
        if hold:
            self._held[key] = tally

    def get(self, key) -> RouterTally | None:
        return self._by_key.get(key)

    def take(self, key) -> RouterTally | None:
        """An evaluated micro-batch's tally, no longer held."""
        tally = self._held.pop(key, None)
        return self._by_key.pop(key, tally)


def tally_key(mb) -> object:
    """A micro-batch's identity from its forward to its head: its draw key, else (a micro-batch
    made by hand) its token tensor's."""
    return mb.draw if mb.draw is not None else ("ids", id(mb.input_ids))


# --------------------------------------------------------------------------- the model keys

# Each proven type's config attributes for the expert count and one expert's MLP width.
EXPERT_ATTRIBUTES = {"qwen3_moe": ("num_experts", "moe_intermediate_size"),
                     "qwen2_moe": ("num_experts", "moe_intermediate_size"),
                     "mixtral": ("num_local_experts", "intermediate_size"),
                     "olmoe": ("num_experts", "intermediate_size"),
                     "gpt_oss": ("num_local_experts", "intermediate_size"),
                     **dict.fromkeys(BIAS_BALANCED, ("n_routed_experts", "moe_intermediate_size"))}


# What a mixture's config holds that no `model` key names: a bias-balanced type's expert groups,
# shared experts and dense first layers, DeepSeek-V3's latent attention, Qwen's dense layers
# (mlp_only_layers, decoder_sparse_step). A checkpoint's values ride in `model.architecture`
# (`moe_facts`), so that what the cost models and the dry run build from the keys on the meta
# device is the checkpoint's model; a published shape's config file sets them.
_BIAS_ROUTING = ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
                 "norm_topk_prob")
ARCHITECTURE_KEYS = {
    "deepseek_v3": (*_BIAS_ROUTING, "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                    "rope_interleave", "attention_bias"),
    "glm4_moe": (*_BIAS_ROUTING, "use_qk_norm", "attention_bias"),
    "dots1": (*_BIAS_ROUTING, "attention_bias"),
    **dict.fromkeys(("qwen3_moe", "qwen2_moe"), ("mlp_only_layers", "decoder_sparse_step")),
}


def architecture_facts(c) -> dict | None:
    """`model.architecture` of a checkpoint's config (None: its type needs none)."""
    keys = ARCHITECTURE_KEYS.get(c.model_type)
    return None if keys is None else {key: getattr(c, key) for key in keys if hasattr(c, key)}


def _plain(architecture) -> dict:
    """`model.architecture` as the plain values Hugging Face's config classes check (a list, not
    omegaconf's ListConfig); {} for none."""
    if not architecture:
        return {}
    return OmegaConf.to_container(architecture) if OmegaConf.is_config(architecture) else dict(architecture)


def moe_sizes(m) -> dict:
    """A fresh config's mixture attributes from the `model` keys (empty for a dense model), or one
    line where the keys and the model type disagree."""
    model_type = str(m.model_type)
    if model_type not in EXPERT_ATTRIBUTES:
        if m.num_experts:
            raise ConfigError(f"model.num_experts={m.num_experts}: a {model_type} model has no experts; the mixtures "
                              f"are model_type={', '.join(EXPERT_ATTRIBUTES)}")
        return {}
    if m.num_experts < 2 or not 0 < m.experts_per_token <= m.num_experts:
        raise ConfigError(f"model.num_experts={m.num_experts} / model.experts_per_token={m.experts_per_token}: a "
                          f"{model_type} model routes each token to 1..num_experts of at least 2 experts")
    count, width = EXPERT_ATTRIBUTES[model_type]
    sizes = {count: m.num_experts, "num_experts_per_tok": m.experts_per_token,
             width: m.expert_intermediate_size or m.intermediate_size}
    if model_type in BIAS_BALANCED:  # shared experts: model.architecture's n_shared_experts of the experts' width
        if not m.architecture:
            raise ConfigError(f"model.model_type={model_type}: a fresh {model_type} model needs its architecture's own "
                              f"settings (expert groups, shared experts, dense first layers"
                              f"{', latent attention' if model_type == 'deepseek_v3' else ''}), which a checkpoint's "
                              f"config carries: start from one, model.pretrained=DIR")
        return {**sizes, **_plain(m.architecture)}
    sizes.update(_plain(m.architecture))  # Qwen's dense layers, where a checkpoint has them
    if m.shared_expert_intermediate_size:
        if model_type != "qwen2_moe":
            raise ConfigError(f"model.shared_expert_intermediate_size={m.shared_expert_intermediate_size}: a "
                              f"{model_type} model has no shared expert (qwen2_moe has)")
        sizes["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size
    return sizes


def moe_facts(c) -> dict:
    """A checkpoint's mixture as `model` keys (a dense one: no experts, whatever `model=` group the
    run started from)."""
    experts = expert_count(c)
    if not experts:
        return {"num_experts": 0, "experts_per_token": 0, "expert_intermediate_size": None,
                "shared_expert_intermediate_size": 0, "architecture": None}
    width = EXPERT_ATTRIBUTES.get(c.model_type, (None, "intermediate_size"))[1]
    shared = getattr(c, "shared_expert_intermediate_size", 0) or 0
    if c.model_type in BIAS_BALANCED:  # n_shared_experts of the experts' width, in one MLP
        shared = getattr(c, width) * (getattr(c, "n_shared_experts", 0) or 0)
    return {"num_experts": experts, "experts_per_token": c.num_experts_per_tok,
            "expert_intermediate_size": getattr(c, width), "output_router_logits": bool(c.output_router_logits),
            "shared_expert_intermediate_size": int(shared), "router_aux_loss_coef": aux_coef(c),
            "architecture": architecture_facts(c)}


def run_settings(hf_config, m) -> None:
    """`model.output_router_logits` and `model.router_aux_loss_coef` on a mixture's config (None
    keeps the checkpoint's); saved with the model, so Hugging Face continues with the same loss."""
    if not expert_count(hf_config):
        return
    if hf_config.model_type in BIAS_BALANCED and (m.output_router_logits or m.router_aux_loss_coef):
        raise ConfigError(f"model.output_router_logits / model.router_aux_loss_coef: a {hf_config.model_type} model "
                          f"balances its experts by a routing bias, with no balancing term in its loss (Hugging "
                          f"Face adds none); drop them")
    if m.output_router_logits is not None:
        hf_config.output_router_logits = bool(m.output_router_logits)
    if m.router_aux_loss_coef is not None:
        hf_config.router_aux_loss_coef = float(m.router_aux_loss_coef)


# --------------------------------------------------------------------------- a dry run's experts

DRY_EXPERTS = "relaytrain_dry_run"


def dry_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The fused experts on the meta device, with grouped_mm's footprint: torch's meta kernel of
    grouped_mm takes bf16 alone, so a dry run in another dtype multiplies the rows of every
    (token, expert) pair, gathered as grouped_mm gathers them, by one expert's matrices (a view:
    no copy), keeping the same tensors for backward; the weights' gradients are the fused tensors'
    whole size, as a GPU's."""
    tokens, k = top_k_index.shape
    rows = hidden_states.repeat_interleave(k, dim=0)  # (tokens * k, hidden)
    up = self._apply_gate(rows @ _as_in_out(self, self.gate_up_proj[0]) + _bias(self, "gate_up_proj_bias"))
    out = (up @ _as_in_out(self, self.down_proj[0]) + _bias(self, "down_proj_bias")) * top_k_weights.reshape(-1, 1)
    return out.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def _as_in_out(experts, matrix: torch.Tensor) -> torch.Tensor:
    """One expert's matrix as (in, out): stored (out, in) unless the experts say they are
    transposed (GPT-OSS stores (in, out))."""
    return matrix if getattr(experts, "is_transposed", False) else matrix.transpose(0, 1)


def _bias(experts, name: str) -> torch.Tensor | float:
    """One expert's bias where the experts have biases (GPT-OSS), else nothing to add."""
    return getattr(experts, name)[0] if getattr(experts, "has_bias", False) else 0.0


def register_dry_experts() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(DRY_EXPERTS, dry_experts)


register_dry_experts()
