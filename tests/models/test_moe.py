"""Mixtures of experts train as Hugging Face computes them, the router's balancing loss included.

Tiny Qwen3-MoE (a dense layer among routed ones), Qwen2-MoE (a shared expert), Mixtral and OLMoE
checkpoints written by `save_pretrained`, `output_router_logits` on with a coefficient of 0.5: the
layered model's loss and every gradient equal Hugging Face's own `model(..., labels=).loss`
(cross-entropy plus `router_aux_loss_coef * aux`), and a run from `model.pretrained=DIR` alone
ends with the weights of a plain Hugging Face loop whose loss is Hugging Face's cross-entropy
over the minibatch's items plus the mean over micro-batches (each replica's share one of them) of
Hugging Face's `router_aux_loss_coef * aux` of each, with torch's AdamW, weight decay and warm-up;
with chat data, whose micro-batches hold unequal numbers of labelled tokens, too. The pipelines train a mixture without the balancing loss exactly here (with it:
tests/strategies/pipeline/test_moe_pipelines.py); the mixture types not proven are refused.
Around them: Mixtral's router jitter and dropout drawn under the micro-batch's key (every
strategy equals the plain loop), LoRA on the fused experts (peft's `target_parameters`)
continued or fresh as plain peft / Hugging Face loops, resume, the dry run, and the published
configs counted as their model cards count them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from relaytrain.cost.work import block_matmul_flops, block_shape
from relaytrain.data import build_datasets, eval_batches
from relaytrain.models import build_model, count_parameters, part_parameters
from relaytrain.models.family import family_of
from relaytrain.models.pretrained import resolve
from relaytrain.records import checkpoint
from relaytrain.records.runlog import read_metrics
from relaytrain.run.compose import compose_config, validate
from relaytrain.run.train import run
from relaytrain.step.optim import lr_at
from relaytrain.strategies import strategy_class
from relaytrain.strategies.base import replica_rows
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import MOE_ARCHITECTURES, tiny_moe
from tests.conformance.references import (
    adapters_of,
    assert_same_weights,
    decay_groups,
    minibatches,
    plain_loop,
    random_adapter,
)
from tests.conformance.references import hf_saved as saved
from tests.models.equality import assert_layered_equals_hf, padded_batch

RUN_KEYS = [
    "data.seq_len=16", "data.num_samples=64", "optim=adamw", "optim.lr=0.02", "optim.eps=1e-4",
    "optim.weight_decay=0.1", "optim.warmup_steps=1", "optim.schedule=linear", "train.steps=2",
    "train.untimed_steps=0", "strategy.num_microbatches=2", "strategy.microbatch_size=2", "train.save_model=true",
    "model.dropout=0.0",
]
VARIANTS = {
    "baseline": ["strategy=baseline"], "baseline_recompute": ["strategy=baseline", "strategy.recompute=block"],
    "baseline_replicas": ["strategy=baseline", "strategy.replicas=2"], "l2l": ["strategy=l2l"],
    "l2l_stash_cpu": ["strategy=l2l_stash_cpu"], "l2l_replicas": ["strategy=l2l", "strategy.replicas=2"],
    "fsdp": ["strategy=fsdp"],
}
# The default suite's cover: every type once, every one-process variant and fsdp once; the rest is `slow`.
# (Spawned replicas, baseline's and l2l's, cost ~15 s a cell: `slow`; fsdp's two processes stay.)
# fsdp's (14 s on 2 cores) runs in the slow step, beside the preference objectives' MoE x fsdp cases.
DEFAULT = {("qwen3_moe", "baseline"), ("mixtral", "l2l"), ("qwen2_moe", "l2l_stash_cpu"), ("olmoe", "baseline_recompute")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, Path] = {}

    def of(arch: str) -> Path:
        if arch not in made:
            layers = 4 if arch == "olmoe" else 3  # two stages of two chunks (pipe_interleaved) need four blocks
            made[arch] = tiny_moe(tmp_path_factory.mktemp(arch) / "checkpoint", arch, layers=layers)
        return made[arch]

    return of


@pytest.mark.parametrize("arch", list(MOE_ARCHITECTURES))
def test_the_layered_loss_and_every_gradient_are_hugging_faces_with_the_balancing_term(arch, checkpoints):
    pretrained = checkpoints(arch)
    model = build_model(resolve(compose_config([f"model.pretrained={pretrained}", "model.dropout=0.0"])).model)
    reference = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    ids, mask, labels = padded_batch()
    out = reference(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.aux_loss > 1.0 and model.routing.coef == 0.5  # the term is a third of the loss: a wrong one shows
    assert_layered_equals_hf(model, reference, ids, mask, labels, arch)


def hf_moe_reference(pretrained: Path, cfg, balancing: bool = True, **config) -> tuple:
    """A plain Hugging Face loop (`moe_loop`) from the checkpoint, torch's AdamW with decay on all
    but norms and biases. Returns the model, each step's loss and each step's
    `router_aux_loss_coef * aux`."""
    o = cfg.optim
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32, output_router_logits=balancing,
                                                 **config)
    optimizer = torch.optim.AdamW(decay_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return model, *moe_loop(model, optimizer, cfg)


def moe_loop(model: torch.nn.Module, optimizer, cfg) -> tuple[list[float], list[float]]:
    """The run's minibatches through `model` (Hugging Face's or peft's): Hugging Face's loss of
    each micro-batch (each replica's share) given the minibatch's item count, so its cross-entropy
    is a share of the minibatch's mean, with its `router_aux_loss_coef * aux` (where the config
    has it on) counted once over the micro-batches: their mean. Each step's loss and term."""
    replicas = strategy_class(cfg.strategy.name).replicas(cfg)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    coef = getattr(base.config, "router_aux_loss_coef", None) or 0.0  # a mixture balanced by a routing bias has none
    model.train()
    losses, terms = [], []
    for step, minibatch in enumerate(minibatches(cfg)):
        shares = [mb for r in range(replicas) for mb in replica_rows(minibatch, r, replicas)]
        items = sum(int((mb.labels[:, 1:] != -100).sum()) for mb in shares)
        total = mean_aux = 0.0
        for mb in shares:
            mask = torch.ones_like(mb.input_ids) if mb.attention_mask is None else mb.attention_mask
            out = model(input_ids=mb.input_ids, attention_mask=mask, labels=mb.labels, num_items_in_batch=items,
                        use_cache=False)
            aux = coef * out.aux_loss if out.aux_loss is not None else torch.zeros(())
            loss = out.loss - aux + aux / len(shares)
            loss.backward()
            total += float(loss.detach())
            mean_aux += float(aux.detach()) / len(shares)
        losses.append(total)
        terms.append(mean_aux)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optim, cfg.train.steps)
        optimizer.step()
        optimizer.zero_grad()
    return losses, terms


def matrix() -> list:
    return [pytest.param(arch, variant, id=f"{arch}-{variant}", marks=() if (arch, variant) in DEFAULT else pytest.mark.slow)
            for arch in MOE_ARCHITECTURES for variant in VARIANTS]


def trains_as_hugging_face(pretrained: Path, cfg, run_dir: Path, what: str, rel: float = 1e-5) -> tuple:
    """`cfg` run into `run_dir` ends on the weights of the plain Hugging Face loop from
    `pretrained` and reports its losses and balancing term (within `rel`, the term beside the
    loss). Returns the results, the saved model and the loop's terms."""
    results = run(cfg, run_dir, table=False)
    reference, losses, terms = hf_moe_reference(pretrained, cfg)
    ours = saved(run_dir)
    assert_same_weights(ours, reference, what)
    assert results["loss"] == pytest.approx(losses, rel=rel, abs=1e-5)
    assert results["loss_terms"]["router_aux"] == pytest.approx(terms, rel=rel)
    return results, ours, terms


@pytest.mark.parametrize(("arch", "variant"), matrix())
def test_a_strategy_trains_the_mixture_as_a_plain_hugging_face_loop(arch, variant, checkpoints, tmp_path):
    pretrained = checkpoints(arch)
    cfg = compose_config([f"model.pretrained={pretrained}", *VARIANTS[variant], *RUN_KEYS])
    _, ours, terms = trains_as_hugging_face(pretrained, cfg, tmp_path / "run", f"{arch} under {variant}")
    start = dict(AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).named_parameters())
    moved = {key for key, p in ours.named_parameters() if (p - start[key]).abs().max() > 1e-3}
    assert {key for key in start if "experts" in key or "gate" in key} <= moved, "an expert or a router did not train"
    logged = [row["router_aux"] for row in read_metrics(tmp_path / "run")]  # and in metrics.csv, step by step
    assert logged == pytest.approx(terms, rel=1e-5)


def unequal_chat(path: Path) -> Path:
    """Chat records whose replies range from two words to twenty: micro-batches of them hold very
    different numbers of labelled tokens."""
    path.write_text("".join(
        f'{{"messages": [{{"role": "user", "content": "say {i}"}}, '
        f'{{"role": "assistant", "content": "{" ".join(["ok"] * (2 + 18 * (i // 2 % 2)))}"}}]}}\n' for i in range(16)))
    return path


@pytest.mark.parametrize("variant", ["baseline", pytest.param("l2l", marks=pytest.mark.slow),
                                     pytest.param("pipe_flush", marks=pytest.mark.slow)])
def test_the_balancing_term_is_the_mean_over_micro_batches_of_unequal_replies(variant, checkpoints, tmp_path):
    """A micro-batch's balancing term counts once, whatever number of reply tokens it holds: the
    minibatch's loss is the cross-entropy over its items plus the mean of the micro-batches' terms."""
    pretrained = checkpoints("qwen3_moe")
    keys = [f"model.pretrained={pretrained}", f"strategy={variant}", "data=chat",
            f"data.path={unequal_chat(tmp_path / 'chat.jsonl')}", "data.seq_len=48", "data.shuffle=false",
            *(key for key in RUN_KEYS if not key.startswith("data."))]
    cfg = compose_config(keys)
    items = [int((mb.labels[:, 1:] != -100).sum()) for mb in minibatches(cfg)[0]]
    assert max(items) > 2 * min(items)  # the micro-batches' items differ: token weighting would show
    trains_as_hugging_face(pretrained, cfg, tmp_path / "run", f"qwen3_moe under {variant} on chat data")


@pytest.mark.parametrize("variant", ["baseline", pytest.param("l2l", marks=pytest.mark.slow),
                                     pytest.param("pipe_flush", marks=pytest.mark.slow)])
def test_the_evaluation_reports_the_balancing_term_beside_the_cross_entropy(variant, checkpoints, tmp_path):
    """Hugging Face's eval-mode loss of a mixture is its cross-entropy plus `coef * aux`: the
    evaluation reports the cross-entropy over every held-out item as `loss` (its perplexity
    beside) and the micro-batches' mean term as `router_aux`, each equal to Hugging Face's on the
    saved model."""
    pretrained = checkpoints("qwen3_moe")
    cfg = resolve(compose_config([f"model.pretrained={pretrained}", f"strategy={variant}", "data.eval_fraction=0.25",
                                  *RUN_KEYS]))
    (figures,) = run(cfg, tmp_path / "run", table=False)["eval"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model", dtype=torch.float32).eval()
    s = cfg.strategy
    held_out = build_datasets(cfg)[1]
    assert len(held_out) % s.microbatch_size == 0  # no micro-batch filled up with copies
    cross_entropy, items, terms = 0.0, 0, []
    for mb in (mb for batch in eval_batches(held_out, s.microbatch_size, s.num_microbatches) for mb in batch):
        with torch.no_grad():
            out = model(input_ids=mb.input_ids, labels=mb.labels)
        count = int((mb.labels[:, 1:] != -100).sum())
        term = model.config.router_aux_loss_coef * float(out.aux_loss)
        cross_entropy, items = cross_entropy + (float(out.loss) - term) * count, items + count
        terms.append(term)
    assert figures["items"] == items
    assert figures["loss"] == pytest.approx(cross_entropy / items, rel=1e-5)
    assert figures["router_aux"] == pytest.approx(sum(terms) / len(terms), rel=1e-5) and figures["router_aux"] > 0.1
    assert read_metrics(tmp_path / "run")[-1]["eval_router_aux"] == pytest.approx(figures["router_aux"])


def test_gpt_oss_as_published_loads_its_mxfp4_experts_dequantized_and_trains_as_hugging_face(tmp_path, capsys):
    """OpenAI's GPT-OSS checkpoints store the experts in MXFP4: they load dequantized, as
    transformers' `Mxfp4Config(dequantize=True)` makes them, say so, and train as a plain Hugging
    Face loop over that dequantized model; the saved model is dense (no quantization_config)."""
    from transformers import Mxfp4Config

    from tests.checkpoints import tiny_gpt_oss_mxfp4

    pretrained = tiny_gpt_oss_mxfp4(tmp_path / "gpt_oss")
    cfg = compose_config([f"model.pretrained={pretrained}", "strategy=l2l", *RUN_KEYS])
    results = run(cfg, tmp_path / "run", table=False)
    assert "its experts are stored in MXFP4; loaded dequantized" in capsys.readouterr().out
    o = cfg.optim
    reference = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32,
                                                     quantization_config=Mxfp4Config(dequantize=True))
    assert reference.model.layers[0].mlp.experts.gate_up_proj.abs().max() > 0.03  # the drawn codes, not zeros
    optimizer = torch.optim.AdamW(decay_groups(reference, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    losses, terms = moe_loop(reference, optimizer, cfg)
    ours = saved(tmp_path / "run")
    assert_same_weights(ours, reference, "gpt_oss from MXFP4 under l2l")
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    assert results["loss_terms"]["router_aux"] == pytest.approx(terms, rel=1e-5)
    assert getattr(ours.config, "quantization_config", None) is None


@pytest.mark.parametrize("model_type", ["phimoe", "granitemoe"])
def test_mixture_types_not_proven_are_refused_in_one_line(model_type):
    config = AutoConfig.for_model(model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=320)
    with pytest.raises(ConfigError) as refused:
        family_of(config)
    message = str(refused.value)
    assert "\n" not in message and "mixture-of-experts" in message and "qwen3_moe" in message


@pytest.mark.parametrize("pipeline", [pytest.param("pipe_flush"), pytest.param("pipe_2bw", marks=pytest.mark.slow),
                                      pytest.param("pipe_gpipe", marks=pytest.mark.slow),
                                      pytest.param("pipe_interleaved", marks=pytest.mark.slow)])
def test_a_pipeline_trains_the_mixture_without_the_balancing_loss_as_hugging_face(pipeline, checkpoints, tmp_path):
    pretrained = checkpoints("olmoe" if pipeline == "pipe_interleaved" else "qwen2_moe")  # interleaved: 4 blocks
    off = "model.output_router_logits=false"
    cfg = compose_config([f"model.pretrained={pretrained}", f"strategy={pipeline}", *RUN_KEYS, off])
    results = run(cfg, tmp_path / "run", table=False, overrides=[off])
    model, losses, _ = hf_moe_reference(pretrained, cfg, balancing=False) if pipeline != "pipe_2bw" else (None,) * 3
    if model is not None:
        assert_same_weights(saved(tmp_path / "run"), model, f"{pipeline} without the balancing loss")
        assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    assert not AutoConfig.from_pretrained(tmp_path / "run" / "model").output_router_logits  # saved as trained


def test_the_run_keys_override_the_checkpoints_balancing_loss_and_are_saved(checkpoints, tmp_path):
    pretrained = checkpoints("mixtral")
    cfg = resolve(compose_config([f"model.pretrained={pretrained}", "model.router_aux_loss_coef=0.25", *RUN_KEYS]),
                  ["model.router_aux_loss_coef=0.25"])
    assert (cfg.model.num_experts, cfg.model.experts_per_token, cfg.model.output_router_logits) == (4, 2, True)
    model = build_model(cfg.model)
    assert model.routing.coef == 0.25 and model.hf_model.config.router_aux_loss_coef == 0.25
    off = resolve(compose_config([f"model.pretrained={pretrained}", "model.output_router_logits=false", *RUN_KEYS]),
                  ["model.output_router_logits=false"])
    assert off.model.output_router_logits is False
    assert not build_model(off.model).routing.balances


@pytest.mark.parametrize("variant", ["l2l", pytest.param("baseline_recompute", marks=pytest.mark.slow),
                                     pytest.param("fsdp", marks=pytest.mark.slow)])
def test_dropout_and_mixtrals_router_jitter_are_drawn_under_the_micro_batch_key(variant, tmp_path):
    pretrained = tiny_moe(tmp_path / "checkpoint", "mixtral", router_jitter_noise=0.2)
    keys = [f"model.pretrained={pretrained}", *VARIANTS[variant], *RUN_KEYS, "model.dropout=0.1"]
    cfg = resolve(compose_config(keys), ["model.dropout=0.1"])
    run(cfg, tmp_path / "run", table=False)
    plain = plain_loop(cfg)  # each replica's rows with that replica's masks (fsdp runs two)
    assert_same_weights(saved(tmp_path / "run"), plain, f"mixtral with jitter and dropout under {variant}")
    still = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    reference, _, _ = hf_moe_reference(pretrained, cfg, router_jitter_noise=0.0)  # no jitter, no dropout
    assert still.config.router_jitter_noise == 0.2
    differ = max((p - q).abs().max() for p, q in zip(plain.parameters(), reference.parameters(), strict=True))
    assert differ > 1e-3, "the jitter and dropout drew nothing"


# ------------------------------------------------------------------ LoRA on the experts (peft's target_parameters)

EXPERT_TENSORS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def expert_adapter(base: Path, directory: Path) -> Path:
    """A peft LoRA adapter on attention and on the fused 3-D expert tensors (`target_parameters`),
    every matrix random (non-zero), saved by peft."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0,
                        target_parameters=EXPERT_TENSORS)
    return random_adapter(model, config, directory)


# LoRA on the experts under every kind of strategy: the relay, a pipeline, one process, FSDP.
LORA_VARIANTS = {**VARIANTS, "pipe_flush": ["strategy=pipe_flush"]}


@pytest.mark.parametrize(("arch", "variant"), [("qwen3_moe", "l2l"),
                                               pytest.param("qwen3_moe", "pipe_flush", marks=pytest.mark.slow),  # ~5 s
                                               pytest.param("qwen3_moe", "baseline", marks=pytest.mark.slow),
                                               pytest.param("mixtral", "l2l", marks=pytest.mark.slow),
                                               pytest.param("mixtral", "fsdp", marks=pytest.mark.slow)])
def test_lora_on_the_experts_continues_a_peft_adapter_as_a_plain_peft_loop(arch, variant, checkpoints, tmp_path):
    base = checkpoints(arch)
    adapter = expert_adapter(base, tmp_path / "adapter")
    cfg = compose_config([f"model.pretrained={base}", "adapter=lora", f"adapter.pretrained={adapter}",
                          *LORA_VARIANTS[variant], *RUN_KEYS])
    results = run(cfg, tmp_path / "run", table=False)
    o = cfg.optim
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter,
                                          is_trainable=True)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    losses, terms = moe_loop(reference, optimizer, cfg)
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                     tmp_path / "run" / "model")
    theirs, mine = adapters_of(reference), adapters_of(ours)
    assert mine.keys() == theirs.keys() and any("experts" in key for key in mine)
    start = adapters_of(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter))
    for key, p in mine.items():
        torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{variant} {key}: {m}")
        assert (p - start[key]).abs().max() > 1e-3, f"{key} did not train"
    assert results["loss"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    assert results["loss_terms"]["router_aux"] == pytest.approx(terms, rel=1e-5)


def test_a_fresh_lora_on_the_experts_and_attention_trains_as_a_plain_hugging_face_loop(checkpoints, tmp_path):
    pretrained = checkpoints("qwen2_moe")
    keys = [f"model.pretrained={pretrained}", "adapter=lora", "adapter.target_modules=[q_proj,v_proj]",
            f"adapter.target_parameters=[{','.join(EXPERT_TENSORS)}]", "strategy=l2l", *RUN_KEYS]
    cfg = resolve(compose_config(keys))
    run(cfg, tmp_path / "run", table=False)
    plain = build_model(cfg.model, seed=cfg.train.seed, adapter=cfg.adapter).hf_model  # the run's fresh adapter
    trainable = [p for p in plain.parameters() if p.requires_grad]
    o = cfg.optim
    moe_loop(plain, torch.optim.AdamW(trainable, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay),
             cfg)  # Hugging Face's forward (peft's layers injected), torch's AdamW
    saved_adapter = load_file(tmp_path / "run" / "model" / "adapter_model.safetensors")  # peft's names
    mine = {key.removeprefix("base_model.model."): p for key, p in saved_adapter.items()}
    theirs = {key.replace(".default", ""): p for key, p in adapters_of(plain).items()}
    assert mine.keys() == theirs.keys() and sum("experts" in key for key in mine) == 2 * 2 * 3  # both fused tensors
    for key, p in mine.items():
        torch.testing.assert_close(p, theirs[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
        assert "lora_A" in key or p.abs().max() > 1e-3, f"{key} did not leave zero"
    with pytest.raises(ConfigError, match="names no parameter"):
        validate(resolve(compose_config([*keys[:3], "adapter.target_parameters=[mlp.experts.up_proj]", *RUN_KEYS])))


# ------------------------------------------------------------------ the published configs, as the cost model counts them

# (total, active per token) as published, billions.
PUBLISHED = {"qwen3_30b_a3b": (30.5, 3.3), "qwen3_235b_a22b": (235.0, 22.0), "mixtral_8x7b": (46.7, 12.9),
             "olmoe_1b_7b": (6.9, 1.3), "gpt_oss_120b": (116.8, 5.1), "gpt_oss_20b": (20.9, 3.6)}
# OpenAI's model card counts GPT-OSS's active parameters without the embedding table (a lookup, not a
# matmul; the untied unembedding is counted)
ACTIVE_WITHOUT_EMBEDDING = {"gpt_oss_120b", "gpt_oss_20b"}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_a_published_mixture_counts_every_expert_for_memory_and_the_active_ones_for_flops(name):
    m = compose_config([f"model={name}"]).model
    total, active = PUBLISHED[name]
    assert count_parameters(m) / 1e9 == pytest.approx(total, rel=0.01)  # memory, transfers: every expert
    embed, block, head = part_parameters(m)
    assert embed + m.num_layers * block + head == count_parameters(m)
    # FLOPs: 2 per active weight per token (the top-k experts and the router, never the idle ones)
    per_token = embed + head + m.num_layers * block_matmul_flops(block_shape(m)) / 2
    per_token -= embed if name in ACTIVE_WITHOUT_EMBEDDING else 0
    assert per_token / 1e9 == pytest.approx(active, rel=0.03)


# The bias-balanced mixtures with dense first layers: (total, active per token) by their model
# cards, billions. Their cards count a multi-token-prediction layer Hugging Face's model lacks, and
# the cost models scale an expert layer by the layer count, so the dense first layers count as
# expert layers (the largest block): a few per cent over, never under.
PUBLISHED_DENSE_FIRST = {"deepseek_v3_671b": (671.0, 37.0), "glm4_5_355b": (355.0, 32.0), "kimi_k2_1t": (1000.0, 32.0)}


@pytest.mark.parametrize("name", list(PUBLISHED_DENSE_FIRST))
def test_a_published_mixture_with_dense_first_layers_is_counted_by_its_expert_layers(name):
    m = compose_config([f"model={name}"]).model
    total, active = PUBLISHED_DENSE_FIRST[name]
    assert count_parameters(m) / 1e9 == pytest.approx(total, rel=0.03)
    embed, block, head = part_parameters(m)
    scaled = embed + m.num_layers * block + head
    assert count_parameters(m) < scaled < 1.05 * count_parameters(m)
    per_token = embed + head + m.num_layers * block_matmul_flops(block_shape(m)) / 2
    assert per_token / 1e9 == pytest.approx(active, rel=0.06)


@pytest.mark.parametrize("name", ["olmoe_1b_7b", "gpt_oss_20b"])  # GPT-OSS: experts stored (in, out), with biases
def test_a_dry_run_of_a_mixture_counts_every_expert_in_fp32(name, tmp_path):
    keys = [f"model={name}", "model.output_router_logits=true", "model.num_layers=2", "train.device=meta",
            "strategy=baseline", "data.seq_len=64", "train.steps=1", "strategy.microbatch_size=1",
            "strategy.num_microbatches=2"]
    cfg = compose_config(keys)
    memory = run(cfg, tmp_path / "run", table=False, quiet=True)["memory"]["device"]["by_kind"]
    assert memory["weights"] == 4 * count_parameters(cfg.model)  # the fused expert tensors whole, in fp32
    assert memory["activations and temporaries"] > 0


@pytest.mark.parametrize("name", ["deepseek_v3_671b", "kimi_k2_1t", "glm4_5_355b"])
def test_a_published_mixture_with_dense_first_layers_runs_dry(name, tmp_path):
    """Its config's own architecture keys build the model Hugging Face builds (DeepSeek-V3's rotary
    slice is head_dim, as its config sets it): the dense first layers and one expert layer."""
    layers = compose_config([f"model={name}"]).model.architecture.first_k_dense_replace + 1
    keys = [f"model={name}", f"model.num_layers={layers}", "train.device=meta", "strategy=l2l", "data.seq_len=64",
            "train.steps=1", "strategy.microbatch_size=1", "strategy.num_microbatches=1"]
    cfg = compose_config(keys)
    results = run(cfg, tmp_path / "run", table=False, quiet=True)
    assert results["memory"]["device"]["peak_allocated_bytes"] >= 4 * part_parameters(cfg.model)[1]  # the expert layer


@pytest.mark.parametrize("variant", ["l2l", pytest.param("baseline", marks=pytest.mark.slow)])
def test_a_mixture_resumes_from_its_step_one_checkpoint_bit_for_bit(variant, checkpoints, tmp_path):
    keys = [f"model.pretrained={checkpoints('qwen2_moe')}", *VARIANTS[variant], *RUN_KEYS,
            "train.checkpoint_every=1", "train.keep_checkpoints=0"]
    results = run(compose_config(keys), tmp_path / "run", table=False)
    first = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "run"), 1)
    resumed = run(compose_config([*keys, f"train.resume={first}"]), tmp_path / "resumed", table=False)
    whole = dict(saved(tmp_path / "run").named_parameters())
    for key, p in saved(tmp_path / "resumed").named_parameters():
        assert torch.equal(p, whole[key]), f"{key} differs after resuming"
    assert resumed["loss"] == results["loss"] and resumed["loss_terms"] == results["loss_terms"]
