"""The checks across the run config's keys that every run shares, run by `compose.validate` after
Hydra has typed each key against the schema (`schema/config.py`) and `resolve.choose` has looked
the config's names up: `check_shared`, the keys on their own and against each other, then
`check_layers`, what the chosen data source and the model builder say of theirs. Every failure is
a `ConfigError` naming the key and the fix."""

from __future__ import annotations

from collections.abc import Mapping

from relaytrain.models import float8
from relaytrain.schema.config import AdapterConfig, Device
from relaytrain.utils.errors import ConfigError


def positive(node, section: str, *keys: str) -> None:
    """Each of `keys` of the `section` node `node` is set and above zero."""
    for key in keys:
        value = getattr(node, key)
        if value is None or value <= 0:
            raise ConfigError(f"{section}.{key}={value} must be positive")


def check_shared(cfg, chosen) -> None:
    """The checks involving several keys that every strategy shares, read here; ConfigError on the
    first problem. `chosen`: what the config's names name (`resolve.Choices`)."""
    positive(cfg.model, "model", "num_layers", "hidden_size", "num_heads", "intermediate_size", "max_seq_len", "vocab_size")
    positive(cfg.data, "data", "seq_len")
    positive(cfg.strategy, "strategy", "microbatch_size", "num_microbatches")
    positive(cfg.train, "train", "steps")
    positive(cfg.optim, "optim", "lr")
    _check_model(cfg.model, cfg.data.seq_len, chosen)
    _check_eval(cfg, chosen)
    _check_train(cfg)
    _check_capabilities(chosen.strategy, cfg.strategy.name, cfg.precision.name, cfg.optim.grad_clip)
    float8.check_config(cfg.precision.name, cfg.adapter.name, cfg.model.quantize)
    _check_muon(cfg.optim)
    _check_state_bits(cfg.optim, chosen.strategy, cfg.strategy.name)
    _check_master_dtype(cfg.optim, chosen.strategy, cfg.strategy.name)
    _check_pairs(chosen.objective, chosen.source, int(cfg.strategy.get("sequence_parallel", 1)))


def _check_online(objective, cls, layout, adapter: str) -> None:
    """An objective that samples its own completions: its rewards found (a user's imported, a
    reward model's directory there), and what it cannot do yet, each in one line."""
    from relaytrain.rollout.rewards import Rewards

    Rewards.load(list(objective.rewards), None if objective.reward_weights is None else list(objective.reward_weights),
                 models=False)
    if objective.rollout_engine != "builtin":
        raise ConfigError(f"objective.rollout_engine={objective.rollout_engine}: relaytrain samples with its own "
                          f"engine only (objective.rollout_engine=builtin), which reads the run's weights where they "
                          f"are; an external engine is not built in yet")
    if objective.rollout_placement != "auto" and not cls.capabilities.host_held_policy and layout.replicates_whole:
        raise ConfigError(f"objective.rollout_placement={objective.rollout_placement} chooses where a host-held policy "
                          f"samples (l2l's, or the whole model shards and stages gather), and strategy={cls.name} holds "
                          f"the whole policy where it computes, which is where it samples; leave it at auto")
    if not layout.replicates_whole and adapter != "none":
        split = (f"strategy.expert_parallel={layout.experts} shares its experts out over groups of {layout.experts} "
                 f"processes" if layout.experts > 1 else f"this strategy splits it over {layout.size} processes")
        raise ConfigError(f"adapter={adapter} with objective={objective.name} samples from a whole copy of the model "
                          f"(one process, or replicas), and {split}; use a strategy that holds the whole model in "
                          f"every process (strategy.replicas welcome), or train every weight")


MUON_LR_SCALINGS = (None, "original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn


def _check_muon(o) -> None:
    """optim=muon's keys torch's Muon would refuse at the first step, each in one line before any work."""
    if o.name != "muon":
        return
    if o.adjust_lr_fn not in MUON_LR_SCALINGS:
        raise ConfigError(f"optim.adjust_lr_fn={o.adjust_lr_fn} is not one of torch's Muon scalings; use null "
                          f"(original: sqrt(max(1, out/in))) or match_rms_adamw")
    if len(o.ns_coefficients) != 3:
        raise ConfigError(f"optim.ns_coefficients={list(o.ns_coefficients)} must be three numbers, the quintic's "
                          f"a, b, c (default [3.4445, -4.775, 2.0315])")
    if not 0 <= o.momentum < 1:
        raise ConfigError(f"optim.momentum={o.momentum} must be in [0, 1) (default 0.95)")
    if not 0 < o.ns_steps < 100:
        raise ConfigError(f"optim.ns_steps={o.ns_steps} must be between 1 and 99 (default 5)")
    if o.adamw_lr is not None and not o.adamw_lr > 0:
        raise ConfigError(f"optim.adamw_lr={o.adamw_lr} must be positive, or null for optim.lr")


def _check_state_bits(o, cls, name) -> None:
    """optim.state_bits: a width torchao quantizes to, a strategy whose parameters it can step, and
    torchao installed; each refused in one line before any work."""
    from relaytrain.step.lowbit import STATE_BITS

    bits = o.get("state_bits", 32)  # read here, not through lowbit.state_bits: the config's walk stays in checks
    if bits == 32:
        return
    if bits not in STATE_BITS:
        raise ConfigError(f"optim.state_bits={bits} must be 32 (fp32 moments), 8 or 4 (torchao's AdamW8bit, AdamW4bit)")
    if not cls.capabilities.lowbit_states:
        raise ConfigError(f"optim.state_bits={bits} under strategy={name}: torchao's quantized moments over its "
                          f"parameters are not checked here yet; use strategy=l2l, baseline, fsdp or a pipeline, or "
                          f"optim.state_bits=32")
    if str(o.host_kernel) == "deepspeed":
        raise ConfigError(f"optim.state_bits={bits} steps torchao's AdamW, and optim.host_kernel=deepspeed DeepSpeed's "
                          f"fp32 one: drop one of them")


def _check_master_dtype(o, cls, name) -> None:
    """optim.master_dtype=bf16: masters the eager param server keeps; refused in one line elsewhere."""
    if str(o.get("master_dtype", "fp32")) == "bf16" and not cls.capabilities.bf16_masters:
        raise ConfigError(f"optim.master_dtype=bf16 under strategy={name}: bf16 masters are the eager param "
                          f"server's host copies, under strategy=l2l, l2l_stash_cpu, or a pipeline with "
                          f"strategy.offload=host; use one of them, or optim.master_dtype=fp32")


def _check_pairs(objective, source, sequence_parts: int) -> None:
    """An objective whose items are several rows (a preference pair) needs a source that makes
    them; it sums each row's log-probs over all its tokens, and a classifier reads each row at one
    token (a decoder's: its last): a row cut over sequence-parallel workers would need them gathered.
    An objective that learns online needs prompts (its items' rows are the completions its rollout
    stage samples for each, not a source's), and sums each completion's log-probs whole too."""
    if objective.learns_online and not source.gives_prompts:
        from relaytrain.data.sources import sources

        prompts = " or ".join(f"data={name}" for name, s in sources().items() if s.gives_prompts)
        raise ConfigError(f"objective={objective.name} samples completions for prompts, which {prompts} gives; "
                          f"data={source.name} gives whole rows: use {prompts} (records {{\"prompt\": ...}})")
    if objective.rows_per_item > 1 and not source.gives_pairs and not objective.learns_online:
        raise ConfigError(f"objective={objective.name} compares the two rows of each item (a preference pair, an "
                          f"example and its KL row), which data=preference makes; data={source.name} gives single "
                          f"rows: use data=preference")
    if objective.classifies and sequence_parts > 1:
        raise ConfigError(f"strategy.sequence_parallel={sequence_parts} cuts sequences, and objective={objective.name} "
                          f"scores each whole one at one of its tokens; drop strategy.sequence_parallel")
    if objective.learns_online and sequence_parts > 1:
        raise ConfigError(f"strategy.sequence_parallel={sequence_parts} cuts sequences, and objective={objective.name} "
                          f"sums each sampled completion's log-probs over the whole sequence; drop "
                          f"strategy.sequence_parallel")
    if objective.rows_per_item > 1 and sequence_parts > 1:
        raise ConfigError(f"strategy.sequence_parallel={sequence_parts} cuts sequences, and objective={objective.name} "
                          f"compares whole ones (a pair's log-probs); drop strategy.sequence_parallel")


def check_layers(cfg, chosen) -> None:
    """What the strategy says of its keys (a preset's fixed ones, its own rules), the data source
    of the data keys (data/sources/), and the model builder of the model and adapter keys
    (`models.check_model`), after the keys every run shares."""
    from relaytrain.models import check_model
    from relaytrain.step.lowbit import check_available
    from relaytrain.strategies import check_preset

    check_preset(cfg.strategy)
    chosen.strategy.check_config(cfg)
    if chosen.objective.learns_online:  # where the strategy puts the model: its to say, once its keys are checked
        _check_online(chosen.objective, chosen.strategy, chosen.strategy.rank_layout(cfg), cfg.adapter.name)
    chosen.source.check(cfg, chosen.objective)
    check_model(cfg.model, cfg.adapter, chosen.family, chosen.objective, defaults=AdapterConfig())
    check_available(cfg.optim.get("state_bits", 32))  # torchao: last, so what no install mends is said first


def _check_model(m, seq_len: int, chosen) -> None:
    from relaytrain.objectives.chunked import chunk_setting

    family, wanted = chosen.family, chosen.objective
    if not family.trains(wanted):
        tasks = family.tasks
        raise ConfigError(f"model.task={m.task} is not available for model.family={m.family}; "
                          f"use model.task={tasks[0]}" + (f" (or {', '.join(tasks[1:])})" if len(tasks) > 1 else ""))
    if m.num_kv_heads is not None and (m.num_kv_heads <= 0 or m.num_heads % m.num_kv_heads):
        raise ConfigError(f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads} "
                          f"(each key/value head serves a whole group of query heads)")
    if m.head_dim is None and m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} does not divide model.hidden_size={m.hidden_size}; "
            f"pick heads that divide it (e.g. model.num_heads={_a_divisor(m.hidden_size, m.num_heads)})"
        )
    if seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={seq_len} exceeds the model's positions (model.max_seq_len={m.max_seq_len}); "
                          + family.past_positions_remedy(seq_len, bool(m.pretrained)))
    if wanted.num_labels is not None and m.num_labels != wanted.num_labels:
        raise ConfigError(f"model.num_labels={m.num_labels}: objective={wanted.name} trains a head of "
                          f"{wanted.num_labels} output(s); set model.num_labels={wanted.num_labels}")
    if wanted.classifies and wanted.num_labels is None and m.num_labels < 2:
        raise ConfigError(f"model.num_labels={m.num_labels} must be at least 2 for classification")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    chunk_setting(m.loss_chunk_tokens)  # auto, 0 or a number of tokens: else one line
    if m.rope_scaling is not None and not (isinstance(m.rope_scaling, Mapping) and "rope_type" in m.rope_scaling):
        raise ConfigError(f"model.rope_scaling={m.rope_scaling} must be a mapping with a rope_type, as config.json's "
                          f"rope_scaling is (e.g. {{rope_type: llama3, factor: 8.0, ...}}), or null for none")


def _check_capabilities(cls, name, precision, grad_clip: float) -> None:
    """What the precision and optimizer keys ask of strategy=`name` (a preset's name, or its
    class's), against what its class can do."""
    from relaytrain.strategies import registry

    can = cls.capabilities
    if precision.value.startswith("cmp") and not can.cross_precision:
        able = " or ".join(f"strategy={n}" for n, c in registry().items() if c.capabilities.cross_precision)
        raise ConfigError(
            f"precision={precision} (cross mixed precision) needs the eager param server; "
            f"use {able} or precision=amp_{precision.value.split('_')[1]}"
        )
    if precision.value.endswith("fp16") and not can.fp16:
        raise ConfigError(
            f"precision={precision} needs one loss-scale decision across every weight, which strategy={name} "
            f"does not make; use precision=amp_bf16 or fp32"
        )
    if grad_clip > 0 and not can.grad_clip:
        raise ConfigError(
            f"optim.grad_clip={grad_clip}: global-norm clipping across stages would stall "
            f"strategy={name} at every update; set optim.grad_clip=0"
        )


def has_held_out_data(d) -> bool:
    return bool(d.eval_path or d.eval_split or d.eval_fraction > 0)


def _check_eval(cfg, chosen) -> None:
    d, e = cfg.data, cfg.eval
    given = [key for key, on in (("data.eval_path", d.eval_path), ("data.eval_split", d.eval_split),
                                 ("data.eval_fraction", d.eval_fraction > 0)) if on]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} both name held-out data; keep one")
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
    if e.every < 0 or e.max_batches < 0:
        raise ConfigError(f"eval.every={e.every} and eval.max_batches={e.max_batches} must be 0 or positive")
    if e.every and not has_held_out_data(d):
        from relaytrain.data.sources import held_out_options

        raise ConfigError(f"eval.every={e.every} needs held-out data: set {held_out_options()}")
    if cfg.train.keep_best:
        _check_keep_best(cfg, chosen)


def _check_keep_best(cfg, chosen) -> None:
    from relaytrain.step.evaluation import metric_names

    allowed = metric_names(chosen.objective, chosen.source.benchmark_task(cfg.data.name))
    if cfg.train.keep_best not in allowed:
        named = f"objective={chosen.objective.name}" if cfg.objective.name != cfg.model.task else \
            f"model.task={cfg.model.task}"
        raise ConfigError(f"train.keep_best={cfg.train.keep_best} is not a metric of {named}; "
                          f"choose one of {', '.join(allowed)}")
    if not has_held_out_data(cfg.data) or not cfg.train.checkpoint_every:
        raise ConfigError(f"train.keep_best={cfg.train.keep_best} keeps the best evaluated checkpoint: it needs "
                          f"held-out data (data.eval_fraction, eval_path or eval_split) and train.checkpoint_every")


def _check_train(cfg) -> None:
    t = cfg.train
    if t.untimed_steps is not None and (t.untimed_steps < 0 or t.untimed_steps >= t.steps and t.steps > 1):
        raise ConfigError(
            f"train.untimed_steps={t.untimed_steps} leaves no measured step of train.steps={t.steps}; "
            f"lower train.untimed_steps"
        )
    if t.threads < 0:
        raise ConfigError(f"train.threads={t.threads} must be 0 (the cores shared out) or positive")
    if t.device == Device.cuda:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if t.device == Device.meta:
        _check_dry_run(cfg)


def _check_dry_run(cfg) -> None:
    """A dry run computes nothing: what needs values is refused rather than silently skipped."""
    valued = [key for key, on in (("train.save_model=true", cfg.train.save_model),
                                  ("train.checkpoint_every", cfg.train.checkpoint_every),
                                  ("train.resume", cfg.train.resume),
                                  ("held-out data", has_held_out_data(cfg.data)),
                                  ("data.pack=true", cfg.data.pack),  # packed records' positions
                                  *((f"log.{k}=true", cfg.log[k]) for k in ("tensorboard", "mlflow", "wandb"))) if on]
    if valued:
        raise ConfigError(f"train.device=meta is a dry run (shapes, no values): drop {', '.join(valued)}")


def _a_divisor(n: int, near: int) -> int:
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    return min(divisors, key=lambda k: abs(k - near))
