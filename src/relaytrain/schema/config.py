"""The run config's typed schema: the ground floor every layer reads (no relaytrain import but utils).

The dataclasses below are registered in Hydra's ConfigStore (`relaytrain.run.compose`). The root
schema (`relaytrain_schema`, the first default of `configs/config.yaml`) types the groups every
run shares; the `strategy` and `optim` groups are typed per option: each strategy class brings
its own config dataclass (`Strategy.Config`) and each optimizer its own (`optim.py`), registered as
`strategy/<name>_schema` and `optim/<name>_schema` and extended by the option's YAML file. So
Hydra itself refuses a key the chosen strategy or optimizer does not have
(`strategy.stages` under `baseline`, `optim.momentum` under `lamb`), a wrong type, or a
value outside an enum, while composing. The checks that involve several keys live a floor up
(`run/checks.py`). Nothing here knows a strategy, an optimizer, an objective or a data source:
every model group names its objective (`model.task`), and the data keys are judged by the
chosen source (`data/sources/`).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING


class Choice(str, Enum):
    """An enum whose members read and print as their plain value (`model.task=causal_lm`)."""

    def __str__(self) -> str:
        return self.value


class LRSchedule(Choice):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class PrecisionName(Choice):
    fp32 = "fp32"
    amp_bf16 = "amp_bf16"
    amp_fp16 = "amp_fp16"
    cmp_bf16 = "cmp_bf16"
    cmp_fp16 = "cmp_fp16"
    amp_fp8 = "amp_fp8"  # amp_bf16 with the blocks' linear layers in FP8 (torchao's float8 training; FP8 GPUs)
    cmp_fp8 = "cmp_fp8"  # cmp_bf16 with them in FP8


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    meta = "meta"  # a dry run: the real strategy code on PyTorch's meta device, device memory simulated


class MasterDtype(Choice):
    fp32 = "fp32"  # the optimizer's weights in fp32
    bf16 = "bf16"  # in bf16, each update made in fp32 and rounded back stochastically (the eager param server's)


class SaveDtype(Choice):
    auto = "auto"  # the checkpoint's own dtype (model.checkpoint_dtype), else float32
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Backend(Choice):
    auto = "auto"  # nccl on CUDA devices, gloo on the CPU
    gloo = "gloo"
    nccl = "nccl"


class AdapterName(Choice):
    none = "none"  # every parameter trains
    lora = "lora"  # low-rank adapters (peft's LoRA) train; the base is frozen


class Quantize(Choice):
    none = "none"  # the base as the checkpoint stores it
    nf4 = "nf4"  # the blocks' linear weights in NormalFloat-4 (QLoRA's), under an adapter


class Recompute(Choice):
    none = "none"  # keep every activation for backward
    block = "block"  # keep each block's input, recompute the block in backward
    stage = "stage"  # pipelines: keep each stage's input, recompute the stage in backward


class Offload(Choice):
    """Whether a strategy keeps state in host memory instead of the device's (`strategy.offload`
    of FSDP and the pipelines): `host` means host memory wherever a key names a place."""

    none = "none"  # on the device
    host = "host"  # in host memory: FSDP's shards (CPUOffloadPolicy), a pipeline stage's masters and optimizer state


# --------------------------------------------------------------------------- shared groups


@dataclass
class ModelConfig:
    name: str = MISSING  # what the report calls the model (the group's name, or the checkpoint's directory)
    family: str = MISSING  # the model family that builds the layered model: bert, gpt2 or decoder
    num_layers: int = MISSING  # transformer blocks
    hidden_size: int = MISSING  # width of every block's hidden state
    num_heads: int = MISSING  # attention heads per block (must divide hidden_size)
    intermediate_size: int = MISSING  # width of each block's feed-forward layer
    max_seq_len: int = 512  # the model's position table (max_position_embeddings)
    vocab_size: int = 30522  # embedding table rows: token ids must be below it
    num_labels: int = 2  # classification only
    task: str = MISSING  # the objective: classification, masked_lm (BERT), causal_lm (GPT-2, decoders), or package.module:Class of your own
    loss_chunk_tokens: str = "auto"  # causal_lm: tokens per chunk of the LM head and its loss (its gradients taken in the forward); auto: chunked where it saves memory; 0: the whole sequence's logits at once
    dropout: float = 0.1  # hidden and attention dropout; its masks are the same whichever strategy runs
    pretrained: str | None = None  # local Hugging Face directory, or a hub id when online
    trust_remote_code: bool = False  # let a checkpoint that ships its own modelling code run it
    # decoders (family=decoder): the Hugging Face architecture and its attention's shape
    model_type: str | None = None  # llama, qwen2, qwen3, mistral, gemma2, phi3, ...
    num_kv_heads: int | None = None  # grouped-query attention's key/value heads (default: num_heads)
    head_dim: int | None = None  # width of one head (default: hidden_size / num_heads)
    tie_embeddings: bool | None = None  # one matrix for input embeddings and LM head (default: the architecture's)
    sliding_window: int | None = None  # tokens a sliding-window layer sees (default: the architecture's; refused where it slides none)
    rope_theta: float | None = None  # rotary base frequency (default: the architecture's), e.g. 500000 for Llama 3
    rope_scaling: Any = None  # rotary scaling as in config.json: {rope_type: llama3, factor: 8.0, ...}; null: none (a mapping; Any: null can replace one)
    norm_eps: float | None = None  # the norms' epsilon (rms_norm_eps, layer_norm_eps; default: the architecture's)
    attn_implementation: str = "sdpa"  # Hugging Face attention kernel: sdpa or eager
    resolved_from: str | None = None  # set by relaytrain: the checkpoint whose config filled these keys
    checkpoint_dtype: str | None = None  # set by relaytrain: the dtype model.pretrained stores its weights in
    pad_token_id: int | None = None  # set by relaytrain: a sequence classifier's padding id, where model.pretrained names none (its tokenizer's pad, else eos, as TRL's RewardTrainer sets it)
    # QLoRA (adapter=qlora sets nf4): embeddings, norms and the head stay as stored. Needs
    # model.pretrained and an adapter (a quantized weight cannot train).
    quantize: Quantize = Quantize.none  # nf4: the frozen base's block linear weights as NormalFloat-4 (bitsandbytes; scales over blocks of 64)
    quantize_double: bool = False  # nf4: quantize the scales too (8 bits, blocks of 256): 4.13 bits a weight, not 4.5
    # mixtures of experts (decoders of model_type qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss, deepseek_v3, glm4_moe, dots1; models/moe.py). 0: dense
    num_experts: int = 0  # experts of each routed layer
    experts_per_token: int = 0  # experts each token is routed to (top-k)
    expert_intermediate_size: int | None = None  # one expert's MLP width (default: intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert's MLP width (0: none)
    output_router_logits: bool | None = None  # the router's balancing loss in the loss (default: the checkpoint's, else off)
    router_aux_loss_coef: float | None = None  # its coefficient (default: the checkpoint's, else the architecture's)
    architecture: Any = None  # set from model.pretrained: its architecture's own config attributes no key above names (DeepSeek-V3's latent-attention ranks, expert groups, shared experts; models/moe.py ARCHITECTURE_KEYS); null: none


@dataclass
class AdapterConfig:
    name: AdapterName = AdapterName.none  # none (full fine-tuning) or lora (set by the adapter= group)
    r: int = 8  # lora: the adapters' rank
    alpha: float = 16.0  # lora: scaling numerator (updates are scaled by alpha / r)
    dropout: float = 0.0  # lora: dropout on each adapter's input (keyed like the model's)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # lora: linear layers of the blocks to adapt, by name ending (q_proj, v_proj), or all-linear
    pretrained: str | None = None  # lora: a peft adapter directory to continue training (its r, alpha and targets apply)
    merge_on_save: bool = False  # train.save_model writes the merged full model (peft's merge_and_unload) instead
    use_dora: bool = False  # lora: DoRA (peft's use_dora): a trained magnitude per output of each adapted layer
    lora_bias: bool = False  # lora: a trained bias on each adapter's lora_B (peft's lora_bias)
    modules_to_save: list[str] = field(default_factory=list)  # lora: modules trained in full beside the adapters (e.g. lm_head)
    target_parameters: list[str] = field(default_factory=list)  # lora: parameters to adapt by name ending, e.g. a mixture's fused experts mlp.experts.gate_up_proj, mlp.experts.down_proj (peft's target_parameters)


@dataclass
class ObjectiveConfig:
    """What the model is trained to do (the objective= group): the model's own task, or a preference
    objective (objectives/preference.py), whose keys follow TRL's trainer of the same name."""

    name: str = "${model.task}"  # the objective: model.task's cross-entropy (the default) or dpo
    beta: float = 0.1  # dpo: how far the policy may move from the reference (IPO's tau)
    loss_type: str = "sigmoid"  # dpo: sigmoid, ipo, hinge or robust (TRL's DPOConfig.loss_type); kto: kto
    label_smoothing: float = 0.0  # dpo robust: the chance a preference label is flipped, in [0, 0.5)
    rpo_alpha: float | None = None  # dpo: weight of the NLL term on the chosen replies (TRL's loss_type [.., sft] with loss_weights [1, rpo_alpha]); null: none
    ref_model: str | None = None  # dpo: a checkpoint directory for the reference; default: the initial model (with a new adapter: the base)
    ref_cache: bool = True  # dpo: keep the reference's log-probs beside the tokenize cache (data.cache_dir) and reuse them
    # kto (objectives/kto.py) trains on unpaired examples (data=preference records with a 'label'). As TRL's
    # KTOTrainer, it needs data.shuffle=false and strategy.microbatch_size >= 2: each example's KL row takes the
    # completion of its neighbour in the micro-batch.
    desirable_weight: float = 1.0  # kto: weight of a desirable example's loss (TRL's KTOConfig.desirable_weight)
    undesirable_weight: float = 1.0  # kto: weight of an undesirable example's loss (TRL's KTOConfig.undesirable_weight)
    # simpo and orpo (objectives/reference_free.py) read no reference; beta is SimPO's beta and ORPO's lambda.
    gamma: float = 0.5  # simpo: the target reward margin (TRL's CPOConfig.simpo_gamma)
    cpo_alpha: float = 1.0  # simpo: weight of the NLL term on the chosen replies (TRL's CPOConfig.cpo_alpha); 0: SimPO as published
    # reward (objectives/reward.py): a one-score sequence classifier on pairs, Bradley-Terry as TRL's RewardTrainer.
    center_rewards_coefficient: float | None = None  # reward: weight of the mean squared (chosen + rejected) score, pulling scores towards 0 (TRL's RewardConfig; it recommends 0.01); null: none
    # grpo (objectives/grpo.py): online RL on data=prompts, TRL's GRPOConfig names and defaults (beta 0, loss_type
    # dapo: configs/objective/grpo.yaml). A micro-batch holds strategy.microbatch_size prompts x num_generations rows.
    num_generations: int = 8  # grpo: completions sampled per prompt (G), the group each completion's advantage is taken over
    max_completion_length: int = 512  # grpo: most tokens a completion may have; data.seq_len holds the prompt and this
    temperature: float = 1.0  # grpo: sampling temperature; the loss's log-probs are taken at it too (TRL)
    top_p: float = 1.0  # grpo: nucleus sampling's cut (1: none)
    top_k: int = 0  # grpo: sample among the k likeliest tokens (0: all)
    epsilon: float = 0.2  # grpo: the ratio's clipping range below 1 (and above, without epsilon_high)
    epsilon_high: float | None = None  # grpo: the clipping range above 1 (DAPO's clip-higher: 0.28); null: epsilon
    num_iterations: int = 1  # grpo: updates per rollout batch (mu); above 1 the loss reads the sampling policy's log-probs
    scale_rewards: str = "group"  # grpo: divide advantages by the group's reward std (group), the batch's (batch) or not (none: Dr. GRPO)
    mask_truncated_completions: bool = False  # grpo: a completion cut at max_completion_length counts in no loss (DAPO)
    rewards: list[str] = field(default_factory=list)  # grpo: reward functions, package.module:function (TRL's signature) or a built-in: exact_answer, contains_answer, format_regex, math_answer; or model:DIR, a reward model
    reward_weights: list[float] | None = None  # grpo: each reward's weight in the summed reward; null: 1 each
    use_bias_correction_kl: bool = True  # grpo: the KL term times the ratio (TRL 1.16's default, DeepSeek-V3.2's unbiased reverse-KL gradient)
    rollout_engine: str = "builtin"  # grpo: who samples the completions: builtin (the run's own weights, keyed sampling) or vllm
    rollout_placement: str = "auto"  # grpo: where a host-held policy (l2l's; the whole model shards and stages gather) samples: auto (copy where it and the KV cache fit on the device, else relay, else host), copy, relay (a block at a time), host


@dataclass
class MixConfig:
    """One part of a mixture (data.mix): records in any form data.path takes, and its weight."""

    path: str = MISSING
    weight: float = 1.0  # its share of the drawn records, relative to the others' (positive, finite)
    name: str | None = None  # a hub dataset's config
    split: str = "train"  # a hub dataset's or `datasets` directory's split


@dataclass
class DataConfig:
    source: str = MISSING  # where samples come from: a source registered in data/sources/ (set by the data= group)
    path: str | None = None  # records: a jsonl/json, parquet, arrow or csv file, a glob, a `datasets` directory, or a hub id
    name: str | None = None  # hub dataset config, e.g. "sst2" or "wikitext-2-raw-v1"
    split: str = "train"  # a hub dataset's or `datasets` directory's split to train on
    text_field: str = "text"  # jsonl/hub: the text column(s), comma-separated for pairs
    label_field: str = "label"  # jsonl/hub: the label column (classification)
    seq_len: int = 128  # tokens per sample (longer ones are cut, shorter ones padded)
    pack: bool = False  # chat: pack short records into rows of seq_len, each record attending only to itself
    shuffle: bool = True  # reshuffle every epoch (from data.seed: the same order whatever the strategy)
    seed: int = 1234  # data order, synthetic data, masking and the held-out draw
    num_samples: int = 4096  # synthetic: size of the generated set
    tokenizer: str | None = None  # a tokenizer directory; default: the model's, else one trained locally
    # held-out data for evaluation: one of these
    eval_path: str | None = None  # jsonl / chat: a file of held-out samples, in the training file's format
    eval_split: str | None = None  # glue / wikitext: the dataset's own split, e.g. validation
    eval_fraction: float = 0.0  # any source without the above: this share of the data, held out
    roles: Any = None  # chat: a mapping of other `from`/role names to roles, e.g. {bot: assistant} (ShareGPT: human, gpt, system, tool)
    mix: list[MixConfig] = field(default_factory=list)  # jsonl / chat: several record sets drawn by weight, instead of data.path
    cache: bool = True  # keep the tokenized set under data.cache_dir and reuse it while nothing it depends on changes
    cache_dir: str | None = None  # where; default: $XDG_CACHE_HOME/relaytrain/data (~/.cache/relaytrain/data)
    num_proc: int = 0  # chat: processes that render records (0: one per core, up to 8, for large sets)
    streaming: bool = False  # jsonl / chat: read and tokenize records as they are trained on, never all in memory
    shuffle_buffer: int = 10_000  # streaming with data.shuffle: records held in the seeded shuffle buffer


@dataclass
class StrategyConfig:
    """Keys every strategy has; each strategy's own config extends it (strategies/*.py)."""

    name: str = MISSING  # the strategy (set by the strategy= group)
    microbatch_size: int = 8  # samples per micro-batch (per replica where there are replicas)
    num_microbatches: int = 4  # micro-batches per minibatch (one weight update per minibatch)


@dataclass
class WorkersConfig:
    """Keys of strategies that run several worker processes (one launcher starts them all)."""

    replicas: int = 1  # data-parallel copies, each on its own share of every minibatch
    backend: Backend = Backend.auto  # torch.distributed backend: auto (nccl on GPUs, gloo on CPU), gloo or nccl
    timeout_s: float = 120.0  # a worker silent this long ends the run


@dataclass
class SequenceParallelConfig:
    """The key of strategies that can cut every sequence over several workers."""

    sequence_parallel: int = 1  # S: workers sharing every sequence, each holding 1/S of its tokens (decoders; an all-to-all around attention, DeepSpeed-Ulysses); R x S workers in all


@dataclass
class TensorParallelConfig:
    """The key of strategies that can split every block's weights over several workers."""

    tensor_parallel: int = 1  # T: workers sharing every block, each holding 1/T of its attention heads and MLP width (torch DTensor, Megatron's column/row split: two all-reduces a block each way); R x S x T workers in all


@dataclass
class ExpertParallelConfig:
    """The key of strategies that can spread a mixture's experts over their data-parallel workers."""

    expert_parallel: int = 1  # E: data-parallel workers (replicas, FSDP's shards) sharing every block's experts, each holding 1/E of them, tokens sent to their expert's holder (all-to-all); E divides strategy.replicas


@dataclass
class OptimConfig:
    """Keys every optimizer has; each optimizer's config extends it (`relaytrain.step.optim`)."""

    name: str = MISSING  # the optimizer (set by the optim= group)
    lr: float = 3e-4  # peak learning rate
    weight_decay: float = 0.01  # decoupled weight decay on matrices and embeddings (not biases, norms)
    schedule: LRSchedule = LRSchedule.constant  # after warm-up: constant, linear or cosine decay to 0
    warmup_steps: int = 0  # linear learning-rate warm-up steps
    grad_clip: float = 0.0  # global-norm clipping; 0 disables
    master_dtype: MasterDtype = MasterDtype.fp32  # the trained weights the optimizer keeps: fp32, or bf16 (the eager param server's host masters, under l2l or a pipeline with strategy.offload=host: 2 bytes a parameter, updates rounded stochastically, keyed by train.seed)
    host_loops: bool = True  # relaytrain's C++ loops for host updates with 8-bit states or bf16 masters, built by torch with the C++ compiler on first use (~30 s, cached); false: torch's and torchao's kernels


@dataclass
class PrecisionConfig:
    name: PrecisionName = PrecisionName.fp32  # the dtype policy (set by the precision= group)
    loss_scale: float = 65536.0  # fp16: the initial dynamic loss scale
    growth_interval: int = 2000  # fp16: steps without overflow before the loss scale doubles


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps (minibatches) to train
    seed: int = 0  # weight initialisation and dropout
    device: Device = Device.auto  # auto (cuda when visible, else cpu), cpu, cuda, or meta (a dry run: simulated device memory)
    save_model: bool = False  # write RUN_DIR/model, a Hugging Face save_pretrained directory
    save_dtype: SaveDtype = SaveDtype.auto  # dtype of the saved weights; auto: the checkpoint's (model.pretrained), else float32
    untimed_steps: int | None = None  # steps left out of the throughput figures (optim.warmup_steps is the LR warm-up); default 2, fewer in a shorter run (one step is always measured)
    log_every: int = 25  # plain-progress lines when not on a terminal
    threads: int = 0  # torch intra-op threads per process; 0: the cores this process may use / the machine's workers (at most OMP_NUM_THREADS where set)
    check_memory: bool = True  # refuse runs the host cannot hold
    compile: bool = False  # torch.compile the block function once, one graph shared by every block (results.json: compile time)
    # checkpoints
    checkpoint_every: int = 0  # also after the last step when set
    keep_checkpoints: int = 3  # the newest checkpoints kept (0: all)
    keep_best: str | None = None  # also keep the checkpoint of the best evaluation by this metric (e.g. loss, accuracy)
    resume: str | None = None  # auto (this run directory's latest, or a fresh start) or a checkpoint path; unset: a fresh start, refused where the directory holds a run


@dataclass
class EvalConfig:
    every: int = 0  # evaluate every N steps (0: only after the last step); needs held-out data
    max_batches: int = 0  # micro-batches of held-out data per evaluation (0: all of it)


@dataclass
class PlanConfig:
    workers: int = 1  # devices (or CPU worker processes) to plan for
    device_memory_gb: float = 16.0  # memory of each device, GiB (2**30 bytes)
    batch_size: int = 0  # the global minibatch in samples (0: strategy.microbatch_size x strategy.num_microbatches)
    device: str = "this"  # this (profile this machine) or a GPU profile: a name in configs/profiles/ or a JSON file
    host_memory_gb: float = 0.0  # host memory of each machine, GiB (2**30 bytes); 0: this machine's RAM with plan.device=this, else unlimited
    strategies: list[str] = field(default_factory=list)  # strategies to consider (empty: every registered one)


@dataclass
class LogConfig:
    tensorboard: bool = False  # also write TensorBoard events to RUN_DIR/tensorboard (pip install 'relaytrain[tensorboard]')
    mlflow: bool = False  # also log to an MLflow run: the config as params, every step's metrics, the results (pip install 'relaytrain[mlflow]')
    mlflow_uri: str | None = None  # the MLflow tracking URI (a server, a database); unset: $MLFLOW_TRACKING_URI, else sqlite in RUN_DIR/mlruns
    mlflow_experiment: str = "relaytrain"  # the MLflow experiment the run goes in (made when missing)
    wandb: bool = False  # also log to a Weights & Biases run, the same figures (pip install 'relaytrain[wandb]')
    wandb_project: str | None = None  # the W&B project, online with an API key (WANDB_API_KEY, wandb login); unset: offline in RUN_DIR/wandb


@dataclass
class RelayTrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: Any = MISSING  # typed by the chosen option's schema (strategy/<name>_schema)
    optim: Any = MISSING  # typed by the chosen option's schema (optim/<name>_schema)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def field_docs(schema: type) -> dict[str, str]:
    """Each field's help: the comment that ends its line in the schema's source (and its
    bases'), so `relaytrain train --help` is read off the schema and cannot drift from it."""
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if not dataclasses.is_dataclass(cls) or cls.__module__ == "builtins":
            continue
        for line in inspect.getsource(cls).splitlines():
            match = _FIELD_LINE.match(line)
            if match:
                docs[match.group(1)] = match.group(2).strip()
    return docs


_FIELD_LINE = re.compile(r"^    (\w+): [^#]*?#\s*(.+)$")


DEFAULT_UNTIMED_STEPS = 2  # a first step compiles and allocates; a second still settles on a CPU


def untimed_steps(given: int | None, steps: int) -> int:
    """Steps of a run of `steps` left out of the throughput figures: the `given` number
    (train.untimed_steps), or by default 2 where the run has a third to measure (`train.steps=2`
    measures its last)."""
    if given is not None:
        return int(given)
    return min(DEFAULT_UNTIMED_STEPS, max(int(steps) - 1, 0))
