"""Typed config schema and the checks that run before any work.

The dataclasses below are registered in Hydra's ConfigStore as the schema of the whole
config tree (see `configs/config.yaml`, whose first default is `relaytrain_schema`). Hydra
then rejects unknown keys and wrong types while composing; `validate` adds the checks that
involve several keys (heads dividing the hidden size, sequence length within the model's
positions, ...). Every failure is a `ConfigError` naming the key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from relaytrain.errors import ConfigError

MODEL_TASKS = ("classification", "masked_lm", "causal_lm")
DATA_SOURCES = ("synthetic", "jsonl", "glue", "wikitext")
STRATEGIES = ("baseline", "l2l", "l2l_stash_cpu", "pipe_2bw", "pipe_flush")
OPTIMIZERS = ("adamw", "lamb", "sgd")
SCHEDULES = ("constant", "linear", "cosine")
PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "cmp_bf16", "cmp_fp16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = MISSING  # "bert" or "gpt2": which adapter builds the layered model
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_heads: int = MISSING
    intermediate_size: int = MISSING
    max_seq_len: int = 512  # the model's position table (max_position_embeddings)
    vocab_size: int = 30522
    num_labels: int = 2  # classification only
    task: str = "classification"
    dropout: float = 0.1  # hidden and attention dropout; 0 makes runs deterministic
    pretrained: str | None = None  # local Hugging Face directory, or a hub id when online
    attn_implementation: str = "sdpa"


@dataclass
class DataConfig:
    source: str = "synthetic"
    path: str | None = None  # jsonl file, or a local `datasets` directory for glue/wikitext
    name: str | None = None  # hub dataset config, e.g. "sst2" or "wikitext-2-raw-v1"
    split: str = "train"
    text_field: str = "text"  # jsonl/hub: the text column(s), comma-separated for pairs
    label_field: str = "label"
    seq_len: int = 128
    shuffle: bool = True
    seed: int = 1234
    num_samples: int = 4096  # synthetic: size of the generated set
    tokenizer: str | None = None  # a tokenizer directory; default: the model's, else one trained locally


@dataclass
class StrategyConfig:
    name: str = "baseline"
    microbatch_size: int = 8
    num_microbatches: int = 4
    recompute: bool = False  # activation checkpointing per block (baseline, pipelines; L2L always recomputes)
    # l2l
    stash: str = "device"  # device | cpu: where L2L keeps the per-block input stash
    prefetch: bool = True  # L2L: relay the next block in while the current one computes
    max_resident_blocks: int = 2  # L2L: executing + prefetched
    # pipelines
    stages: int = 2
    replicas: int = 1
    layout: list[int] | None = None  # blocks per stage, overriding the even split
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 120.0  # a worker silent this long ends the run


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.01
    eps: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    momentum: float = 0.0  # sgd
    schedule: str = "constant"
    warmup_steps: int = 0
    grad_clip: float = 0.0  # global-norm clipping; 0 disables
    fused: bool = True  # torch's fused kernels where the optimizer and device have them


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    loss_scale: float = 65536.0  # fp16: the initial dynamic loss scale
    growth_interval: int = 2000


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 0
    device: str = "auto"
    save_model: bool = False
    warmup_steps: int = 2  # steps left out of the throughput figures
    log_every: int = 25  # plain-progress lines when not on a terminal
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    check_memory: bool = True  # refuse runs the host cannot hold
    # checkpoints
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: str | None = None


@dataclass
class RelayTrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def register_schema() -> None:
    ConfigStore.instance().store(name="relaytrain_schema", node=RelayTrainConfig)


# --------------------------------------------------------------------------- checks


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value} is not one of {', '.join(allowed)}")


def _positive(cfg, section: str, *keys: str) -> None:
    for key in keys:
        value = getattr(getattr(cfg, section), key)
        if value is None or value <= 0:
            raise ConfigError(f"{section}.{key}={value} must be positive")


def validate(cfg) -> None:
    """Checks involving several keys; raise ConfigError on the first problem."""
    _check_choices(cfg)
    _positive(cfg, "model", "num_layers", "hidden_size", "num_heads", "intermediate_size", "max_seq_len", "vocab_size")
    _positive(cfg, "data", "seq_len")
    _positive(cfg, "strategy", "microbatch_size", "num_microbatches")
    _positive(cfg, "train", "steps")
    _positive(cfg, "optim", "lr")
    _check_model(cfg.model, cfg.data)
    _check_data(cfg.data)
    _check_strategy(cfg)
    _check_train(cfg.train)


def _check_choices(cfg) -> None:
    m, d, s, o, p, t = cfg.model, cfg.data, cfg.strategy, cfg.optim, cfg.precision, cfg.train
    _choice("model.task", m.task, MODEL_TASKS)
    _choice("model.family", m.family, ("bert", "gpt2"))
    _choice("data.source", d.source, DATA_SOURCES)
    _choice("strategy.name", s.name, STRATEGIES)
    _choice("strategy.stash", s.stash, ("device", "cpu"))
    _choice("strategy.backend", s.backend, ("auto", "gloo", "nccl"))
    _choice("optim.name", o.name, OPTIMIZERS)
    _choice("optim.schedule", o.schedule, SCHEDULES)
    _choice("precision.name", p.name, PRECISIONS)
    _choice("train.device", t.device, DEVICES)


def _check_model(m, d) -> None:
    if m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} does not divide model.hidden_size={m.hidden_size}; "
            f"pick heads that divide it (e.g. model.num_heads={_a_divisor(m.hidden_size, m.num_heads)})"
        )
    if d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} exceeds the model's positions (model.max_seq_len={m.max_seq_len}); "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    if m.family == "gpt2" and m.task != "causal_lm":
        raise ConfigError(f"model.task={m.task} is not available for GPT-2; use model.task=causal_lm")
    if m.family == "bert" and m.task == "causal_lm":
        raise ConfigError("model.task=causal_lm needs a decoder; use model=gpt2_small or model.task=masked_lm")
    if m.task == "classification" and m.num_labels < 2:
        raise ConfigError(f"model.num_labels={m.num_labels} must be at least 2 for classification")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")


def _check_data(d) -> None:
    if d.source == "jsonl":
        if not d.path:
            raise ConfigError("data=jsonl needs a file: set data.path=/path/to/train.jsonl")
        if not Path(d.path).expanduser().is_file():
            raise ConfigError(f"data.path={d.path} does not exist; point data.path at a JSONL file")
    if d.path and d.source in ("glue", "wikitext") and not Path(d.path).expanduser().exists():
        raise ConfigError(f"data.path={d.path} does not exist; give a `datasets` directory or drop data.path")


def _check_strategy(cfg) -> None:
    s, m, p = cfg.strategy, cfg.model, cfg.precision
    if p.name.startswith("cmp") and not s.name.startswith("l2l"):
        raise ConfigError(
            f"precision={p.name} (cross mixed precision) needs the eager param server; "
            f"use strategy=l2l or precision=amp_{p.name.split('_')[1]}"
        )
    if s.name.startswith("l2l"):
        if s.max_resident_blocks < 1:
            raise ConfigError(f"strategy.max_resident_blocks={s.max_resident_blocks} must be at least 1")
        if s.name == "l2l_stash_cpu" and s.stash != "cpu":
            raise ConfigError(f"strategy=l2l_stash_cpu keeps the stash on the host; drop strategy.stash={s.stash}")
    if s.name.startswith("pipe"):
        _positive(cfg, "strategy", "stages", "replicas")
        if s.stages > m.num_layers:
            raise ConfigError(
                f"strategy.stages={s.stages} exceeds model.num_layers={m.num_layers}; every stage needs a block"
            )
        if s.layout is not None and (len(s.layout) != s.stages or sum(s.layout) != m.num_layers or min(s.layout) < 1):
            raise ConfigError(
                f"strategy.layout={list(s.layout)} must give {s.stages} positive block counts "
                f"summing to model.num_layers={m.num_layers}"
            )


def _check_train(t) -> None:
    if t.warmup_steps < 0 or t.warmup_steps >= t.steps and t.steps > 1:
        raise ConfigError(
            f"train.warmup_steps={t.warmup_steps} leaves no measured step of train.steps={t.steps}; "
            f"lower train.warmup_steps"
        )
    if t.threads < 0:
        raise ConfigError(f"train.threads={t.threads} must be 0 (torch's default) or positive")
    if t.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")


def _a_divisor(n: int, near: int) -> int:
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    return min(divisors, key=lambda k: abs(k - near))


def compose_config(overrides: list[str] | tuple[str, ...] = ()):
    """The config `relaytrain train OVERRIDES...` would run with (no validation, no Hydra run dir).

    For tests, benchmarks and helper commands that need a config exactly as the CLI builds it.
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="relaytrain.configs", version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()
