"""`objective=grpo` runs: every one-process strategy samples the same completions and trains the
same weights, and TRL's GRPO loss on a plain Hugging Face model, replayed on the completions a
run records in rollouts.jsonl, reproduces the run's update (SGD and AdamW; each loss type;
one and two updates per rollout batch; with and without the KL term); resume is exact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import chat_tokenizer, tiny_decoder, tiny_moe
from tests.objectives.grpo_reference import trl_inputs, trl_scoring, trl_token_logps, trl_trainer

PROMPTS, G, ACCUMULATE, LENGTH, SEQ, STEPS = 2, 3, 2, 6, 32, 2
LR = {"sgd": 0.5, "adamw": 1e-2}
OPTIM = {"sgd": ["optim=sgd", "optim.momentum=0.0"], "adamw": ["optim=adamw"]}
HERE = "tests.rollout.test_grpo_runs"


def length_reward(prompts, completions, **kwargs):
    """A reward that differs within a group: the completion's length in characters, over 10."""
    return [len(c) / 10 for c in completions]


def digit_reward(prompts, completions, answer, **kwargs):
    """A second reward reading a column: 1 where the completion holds a digit of the record's answer."""
    return [float(any(d in c for d in a)) for c, a in zip(completions, answer, strict=True)]


def failing_reward(prompts, completions, **kwargs):
    raise ValueError("this reward is broken")


# Many end tokens (the checkpoint's generation config names them, as a chat model's names its
# end of turn): about half the completions end within LENGTH, the rest are cut there.
ENDS = {"eos_token_id": [chat_tokenizer().eos_token_id, *range(10, 40)]}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_runs")
    return prompts_for(tiny_decoder(root / "llama", layers=2, **ENDS), root)


@pytest.fixture(scope="module")
def moe_setting(tmp_path_factory):
    """A tiny Qwen3-MoE, its router's balancing loss on (tests/checkpoints.py's coefficient 0.5)."""
    root = tmp_path_factory.mktemp("grpo_runs_moe")
    return prompts_for(tiny_moe(root / "qwen3_moe", layers=2, **ENDS), root)


def prompts_for(checkpoint: Path, root: Path) -> tuple[Path, Path, Path]:
    records = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(12)]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return checkpoint, data, root


def grpo_run(setting, run_dir: Path, optim: str = "sgd", *overrides: str) -> dict:
    checkpoint, data, root = setting
    cfg = compose_config([
        f"model.pretrained={checkpoint}", "data=prompts", f"data.path={data}", f"data.seq_len={SEQ}",
        "data.shuffle=false", f"data.cache_dir={root / 'cache'}", "objective=grpo", f"objective.num_generations={G}",
        f"objective.max_completion_length={LENGTH}", "objective.temperature=0.9",
        f"objective.rewards=[{HERE}:length_reward,{HERE}:digit_reward]", "objective.reward_weights=[1.0,0.5]",
        f"strategy.microbatch_size={PROMPTS}", f"strategy.num_microbatches={ACCUMULATE}", f"train.steps={STEPS}",
        "train.untimed_steps=0", "train.save_model=true", f"optim.lr={LR[optim]}", "optim.weight_decay=0.0",
        *OPTIM[optim], *overrides])
    return run(resolve(cfg, ()), run_dir, quiet=True)


def rollouts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def trained(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


def assert_same_weights(a: dict, b: dict, **tolerance) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name, **tolerance)


STRATEGIES = {  # every placement: one process, and two (two replicas; two stages; two shards)
    "l2l": ["strategy=l2l"], "l2l_stash_cpu": ["strategy=l2l_stash_cpu"],
    # L2L's host-held policy (and the KL term's reference) sampling from a device copy, or relayed a
    # block at a time: here the "device" is the CPU, so the copies' filling and the relay's visits
    # are what runs (tests/test_gpu.py relays on a GPU)
    "l2l-copy": ["strategy=l2l", "objective.rollout_placement=copy"],
    "l2l-relay": ["strategy=l2l", "objective.rollout_placement=relay"],
    "baseline-replicas": ["strategy=baseline", "strategy.replicas=2", "strategy.num_microbatches=1",
                          f"strategy.microbatch_size={PROMPTS}"],
    "pipe_flush": ["strategy=pipe_flush", "strategy.stages=2"],
    "fsdp": ["strategy=fsdp", "strategy.replicas=2", "strategy.num_microbatches=1", f"strategy.microbatch_size={PROMPTS}"],
    # the whole model two stages gather on the first's host, relayed a block at a time
    "pipe_flush-relay": ["strategy=pipe_flush", "strategy.stages=2", "objective.rollout_placement=relay"],
}
DEFAULT_STRATEGIES = ("l2l", "l2l-relay")  # the others in the slow step (the multi-process ones take ~9 s each here)


@pytest.mark.parametrize("strategy", [pytest.param(name, marks=() if name in DEFAULT_STRATEGIES else pytest.mark.slow)
                                      for name in STRATEGIES])
def test_every_strategy_samples_the_same_completions_and_trains_the_same_weights(setting, tmp_path, strategy):
    """Two replicas of one micro-batch each hold what one process's two micro-batches hold."""
    grpo_run(setting, tmp_path / "baseline", "adamw", "strategy=baseline", "objective.beta=0.04")
    grpo_run(setting, tmp_path / strategy, "adamw", *STRATEGIES[strategy], "objective.beta=0.04")
    ours, theirs = rollouts(tmp_path / strategy), rollouts(tmp_path / "baseline")
    assert [r["completion_ids"] for r in ours] == [r["completion_ids"] for r in theirs]
    assert len(ours) == STEPS * PROMPTS * ACCUMULATE * G
    assert_same_weights(trained(tmp_path / strategy), trained(tmp_path / "baseline"), rtol=1e-5, atol=1e-6)


def test_a_relayed_policy_scores_its_batch_together_and_trains_as_the_baseline(setting, tmp_path):
    """num_iterations = 2 and the KL term: the sampling policy's and the reference's scoring
    passes both relayed, every micro-batch through each block at once (`RelayCopy.each_logits`),
    train the weights the baseline's forwards a micro-batch give."""
    common = ("objective.beta=0.04", "objective.num_iterations=2")
    grpo_run(setting, tmp_path / "baseline", "adamw", "strategy=baseline", *common)
    grpo_run(setting, tmp_path / "relay", "adamw", "strategy=l2l", "objective.rollout_placement=relay", *common)
    assert [r["completion_ids"] for r in rollouts(tmp_path / "relay")] == [
        r["completion_ids"] for r in rollouts(tmp_path / "baseline")]
    assert_same_weights(trained(tmp_path / "relay"), trained(tmp_path / "baseline"), rtol=1e-5, atol=1e-6)


def replay_with_trl(setting, run_dir: Path, optim: str, loss_type: str, beta: float, iterations: int,
                    masked_truncated: bool = False, adapter: Path | None = None) -> dict[str, torch.Tensor]:
    """TRL's loss on a plain Hugging Face model (with `adapter`: peft's, continued from it, its
    reference the model with the adapter off, as TRL takes it), stepped on the run's recorded
    completions; the trained weights (the adapter's, by peft's names)."""
    from peft import PeftModel, get_peft_model_state_dict

    checkpoint, _, root = setting
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    tok = chat_tokenizer()
    trainer = trl_trainer(model, tok, root / f"trl-{run_dir.name}", microbatch_rows=PROMPTS * G,
                          accumulate=ACCUMULATE, generations=G, completion_length=LENGTH, loss_type=loss_type,
                          beta=beta, temperature=0.9, num_iterations=iterations,
                          mask_truncated_completions=masked_truncated)
    reference = None
    if beta and adapter is None:
        trl_scoring(trainer, trainer.ref_model)
        reference = lambda i: trl_token_logps(trainer, trainer.ref_model, i)  # noqa: E731
    elif beta:
        def reference(i):
            with model.disable_adapter():
                return trl_token_logps(trainer, model, i)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = (torch.optim.SGD(trained, lr=LR[optim]) if optim == "sgd" else
                 torch.optim.AdamW(trained, lr=LR[optim], eps=1e-6, weight_decay=0.0))
    recorded = rollouts(run_dir)
    per_step = PROMPTS * G * ACCUMULATE
    old = None
    for step in range(STEPS):
        batch = step // iterations
        rows = [r for r in recorded if r["step"] == batch * iterations + 1]
        assert len(rows) == per_step
        masked = [masked_truncated and r["truncated"] for r in rows]
        tokens = sum(len(r["completion_ids"]) for r, m in zip(rows, masked, strict=True) if not m)
        inputs = []
        for k in range(ACCUMULATE):
            part = rows[k * PROMPTS * G:(k + 1) * PROMPTS * G]
            inputs.append(trl_inputs(trainer, [r["prompt_ids"] for r in part], [r["completion_ids"] for r in part],
                                     torch.tensor([r["advantage"] for r in part]), tokens,
                                     masked[k * PROMPTS * G:(k + 1) * PROMPTS * G], ref=reference))
        if iterations > 1 and step % iterations == 0:  # the sampling policy's log-probs, kept for the batch
            old = [trl_token_logps(trainer, model, i) for i in inputs]
        model.train()
        optimizer.zero_grad()
        for k, i in enumerate(inputs):
            if iterations > 1:
                i["old_per_token_logps"] = old[k]
            trainer._compute_loss(model, i).backward()
        optimizer.step()
    if adapter is not None:
        return {name: p.detach() for name, p in get_peft_model_state_dict(model).items()}
    return {name: p.detach() for name, p in model.state_dict().items()}


CASES = [  # (optimizer, loss type, beta, updates per rollout batch, truncated masked): each loss type, KL, mu = 2
    pytest.param("sgd", "dapo", 0.0, 1, False, id="sgd-dapo"),
    pytest.param("adamw", "grpo", 0.04, 2, False, id="adamw-grpo-kl-mu2"),
    pytest.param("sgd", "dr_grpo", 0.04, 1, False, id="sgd-dr_grpo-kl", marks=pytest.mark.slow),
    pytest.param("adamw", "bnpo", 0.0, 2, False, id="adamw-bnpo-mu2", marks=pytest.mark.slow),
    pytest.param("adamw", "dapo", 0.0, 1, True, id="adamw-dapo-truncated-masked", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("optim, loss_type, beta, iterations, masked", CASES)
def test_trls_loss_replayed_on_the_recorded_completions_reproduces_the_run(setting, tmp_path, optim, loss_type, beta,
                                                                           iterations, masked):
    run_dir = tmp_path / "run"
    grpo_run(setting, run_dir, optim, f"objective.loss_type={loss_type}", f"objective.beta={beta}",
             f"objective.num_iterations={iterations}", f"objective.mask_truncated_completions={masked}".lower())
    ours = trained(run_dir)
    cut = [r["truncated"] for r in rollouts(run_dir)]
    assert 0 < sum(cut) < len(cut)
    theirs = replay_with_trl(setting, run_dir, optim, loss_type, beta, iterations, masked)
    assert_same_weights({k: ours[k] for k in theirs}, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_mixture_trains_as_trl_with_its_router_term(moe_setting, tmp_path):
    """A Qwen3-MoE whose checkpoint turns the balancing loss on: TRL adds the router's term to each
    micro-batch's loss (over the prompt's and completion's tokens), and so does relaytrain."""
    run_dir = tmp_path / "run"
    grpo_run(moe_setting, run_dir, "sgd", "strategy=l2l", "objective.loss_type=grpo")  # SGD: AdamW would magnify
    # the float noise of the embedding rows whose gradient is near 0 (this model's embedding moved 9e-5 apart)
    ours = AutoModelForCausalLM.from_pretrained(run_dir / "model").state_dict()  # the experts as transformers fuses them
    theirs = replay_with_trl(moe_setting, run_dir, "sgd", "grpo", 0.0, 1)
    assert_same_weights({k: ours[k] for k in theirs}, theirs, rtol=1e-4, atol=1e-5)


def test_a_lora_run_with_the_kl_term_equals_trl_with_peft(setting, tmp_path):
    """A continued peft adapter (both matrices non-zero, so the adapter matters): the reference is
    the model with its adapter off, in relaytrain as in TRL; the trained adapters agree."""
    from safetensors.torch import load_file as load_adapter

    from tests.conformance.references import peft_adapter

    adapter = peft_adapter(setting[0], tmp_path / "adapter")
    run_dir = tmp_path / "run"
    grpo_run(setting, run_dir, "adamw", "strategy=l2l", "adapter=lora", f"adapter.pretrained={adapter}",
             "objective.beta=0.04")
    ours = load_adapter(run_dir / "model" / "adapter_model.safetensors")
    theirs = replay_with_trl(setting, run_dir, "adamw", "dapo", 0.04, 1, adapter=adapter)
    assert_same_weights(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_replicas_of_a_lora_model_sample_from_the_first_and_train_as_one_process(setting, tmp_path):
    """Replicas hold the whole model: the first samples from its own (its adapters on), no gather."""
    lora = ["adapter=lora", "objective.beta=0.04"]
    grpo_run(setting, tmp_path / "one", "adamw", "strategy=baseline", *lora)
    grpo_run(setting, tmp_path / "two", "adamw", *STRATEGIES["baseline-replicas"], *lora)
    assert [r["completion_ids"] for r in rollouts(tmp_path / "two")] == \
        [r["completion_ids"] for r in rollouts(tmp_path / "one")]
    from safetensors.torch import load_file as load_adapter

    ours, theirs = (load_adapter(tmp_path / run / "model" / "adapter_model.safetensors") for run in ("two", "one"))
    assert_same_weights(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_recorded_rewards_and_advantages_are_the_functions_and_trls_formula(setting, tmp_path):
    from trl.trainer.utils import nanstd as trl_nanstd

    grpo_run(setting, tmp_path / "run", "sgd", "train.steps=1")
    rows = rollouts(tmp_path / "run")
    completions, answers = [r["completion"] for r in rows], [str(2 * int(r["prompt"].split()[2])) for r in rows]
    assert [r["rewards"]["length_reward"] for r in rows] == pytest.approx(length_reward(None, completions))
    assert [r["rewards"]["digit_reward"] for r in rows] == pytest.approx(digit_reward(None, completions, answers))
    rewards = torch.tensor([r["reward"] for r in rows]).view(-1, G)
    expected = (rewards - rewards.mean(1, keepdim=True)) / (trl_nanstd(rewards, dim=1).unsqueeze(1) + 1e-4)
    assert [r["advantage"] for r in rows] == pytest.approx(expected.flatten().tolist(), abs=1e-5)


def test_a_run_resumed_inside_a_rollout_batch_ends_as_the_uninterrupted_one(setting, tmp_path):
    """Two updates a rollout batch, a checkpoint after the first: the resumed run trains the second
    on the saved batch, not a new one, and rollouts.jsonl holds each batch once."""
    grpo_run(setting, tmp_path / "whole", "adamw", "objective.num_iterations=2", "train.steps=4")
    grpo_run(setting, tmp_path / "cut", "adamw", "objective.num_iterations=2", "train.steps=1",
             "train.checkpoint_every=1")
    grpo_run(setting, tmp_path / "cut", "adamw", "objective.num_iterations=2", "train.steps=4",
             f"train.resume={tmp_path / 'cut'}")
    assert rollouts(tmp_path / "cut") == rollouts(tmp_path / "whole")
    assert_same_weights(trained(tmp_path / "cut"), trained(tmp_path / "whole"), rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["l2l", "baseline"])
def test_a_dry_run_trains_on_the_longest_completions_without_sampling(setting, tmp_path, strategy):
    """The meta device has no values to sample from: the rows are the longest completions every
    prompt may have (what the planner's dry runs measure), and nothing is written as a rollout."""
    results = grpo_run(setting, tmp_path / "dry", "sgd", f"strategy={strategy}", "train.device=meta",
                       "train.save_model=false", "objective.beta=0.04", "objective.num_iterations=2")
    assert results["memory"]["device"]["simulated"] and results["memory"]["device"]["peak_allocated_bytes"] > 0
    assert not (tmp_path / "dry" / "rollouts.jsonl").exists()


def test_held_out_prompts_are_sampled_and_scored_and_the_best_reward_is_kept(setting, tmp_path):
    """Evaluation samples each held-out prompt's G completions from the policy of that step
    (keyed apart from training's) and reports TRL's reward figures over them; train.keep_best
    keeps the checkpoint of the highest mean reward."""
    results = grpo_run(setting, tmp_path / "run", "sgd", "data.eval_fraction=0.25", "eval.every=1",
                       "train.keep_best=reward", "train.checkpoint_every=1")
    evaluated = results["eval"]
    assert [e["step"] for e in evaluated] == list(range(1, STEPS + 1))
    assert all(e["items"] == 3 and 0 <= e["completions/mean_length"] <= LENGTH for e in evaluated)
    assert all(e["reward"] == pytest.approx(e["rewards/length_reward/mean"] + 0.5 * e["rewards/digit_reward/mean"])
               for e in evaluated)
    best = max(evaluated, key=lambda e: e["reward"])["step"]
    assert json.loads((tmp_path / "run" / "checkpoints" / "best.json").read_text())["step"] == best
    training = {tuple(r["prompt_ids"]) for r in rollouts(tmp_path / "run")}
    assert len(training) == PROMPTS * ACCUMULATE * STEPS  # the held-out prompts are not trained on


def test_a_reward_model_scores_completions_as_trl_scores_with_one(setting, tmp_path):
    """`objective.rewards=[model:DIR]`: a one-label sequence classifier (what objective=reward
    saves) scores each prompt and completion joined, unpadded on the right, its logit 0: TRL's
    way, here checked against transformers' own forward of each text alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    checkpoint = setting[0]
    scorer = AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels=1)
    scorer.config.pad_token_id = chat_tokenizer().pad_token_id
    scorer.save_pretrained(tmp_path / "rm")
    chat_tokenizer().save_pretrained(tmp_path / "rm")
    grpo_run(setting, tmp_path / "run", "sgd", "train.steps=1", f"objective.rewards=[model:{tmp_path / 'rm'}]",
             "objective.reward_weights=null")
    rows = rollouts(tmp_path / "run")
    tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    scorer.eval()
    for row in rows[:4]:
        ids = tok(row["prompt"] + row["completion"], add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            expected = float(scorer(**ids).logits[0, 0])
        assert row["rewards"]["rm"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_a_reward_that_raises_stops_the_run_in_one_line_naming_it(setting, tmp_path):
    with pytest.raises(ConfigError) as err:
        grpo_run(setting, tmp_path / "run", "sgd", f"objective.rewards=[{HERE}:failing_reward]",
                 "objective.reward_weights=null")
    message = str(err.value)
    assert "failing_reward" in message and "this reward is broken" in message and "\n" not in message


@pytest.mark.parametrize("overrides, says", [
    (["strategy=pipe_flush", "strategy.stages=2", "adapter=lora"], "samples from a whole copy of the model"),
    (["data.eval_fraction=0.25", "eval.every=1", "train.keep_best=loss", "train.checkpoint_every=1"],
     "train.keep_best=loss is not a metric of objective=grpo; choose one of reward"),
    (["objective.rollout_engine=vllm"], "objective.rollout_engine=vllm"),
    (["objective.rollout_placement=relay"], "objective.rollout_placement=relay chooses where a host-held policy"),
    (["strategy=l2l", "objective.rollout_placement=nowhere"], "objective.rollout_placement=nowhere is not one of"),
    (["data=chat"], "samples completions for prompts, which data=prompts gives"),
    (["objective.rewards=[model:/no/such/dir]", "objective.reward_weights=null"],
     "objective.rewards=model:/no/such/dir: no such directory"),
    (["objective.rewards=[exact_anser]", "objective.reward_weights=null"], "did you mean exact_answer?"),
])
def test_what_grpo_cannot_do_yet_is_refused_in_one_line(setting, tmp_path, overrides, says):
    with pytest.raises(ConfigError) as err:
        grpo_run(setting, tmp_path / "run", "sgd", *overrides)
    assert says in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run" / "metrics.csv").exists()  # refused by the config checks, before any step


@pytest.mark.slow  # two runs of two processes
def test_a_mixture_s_experts_shared_out_sample_from_the_gathered_model_and_train_as_replicas(moe_setting, tmp_path):
    """With the experts shared out (strategy.expert_parallel=2) no worker holds the whole policy: the
    workers gather it on the first's host, which samples from it (before, the first sampled from its
    own share and waited on the others' all-to-alls until gloo's timeout). The completions and the
    trained weights are those of replicas each holding every expert, the KL term's reference included."""
    keys = [*STRATEGIES["baseline-replicas"], "objective.beta=0.04"]
    grpo_run(moe_setting, tmp_path / "shared", "adamw", *keys, "strategy.expert_parallel=2")
    grpo_run(moe_setting, tmp_path / "whole", "adamw", *keys)
    assert [r["completion_ids"] for r in rollouts(tmp_path / "shared")] == \
        [r["completion_ids"] for r in rollouts(tmp_path / "whole")]
    assert_same_weights(trained(tmp_path / "shared"), trained(tmp_path / "whole"), rtol=1e-5, atol=1e-6)


def test_an_adapter_over_experts_shared_out_is_refused_in_one_line(moe_setting, tmp_path):
    """The gathered policy is the base's weights alone: an adapter's sampling is from the replicas' own."""
    with pytest.raises(ConfigError, match="strategy.expert_parallel=2 shares its experts out over groups of 2") as err:
        grpo_run(moe_setting, tmp_path / "run", "sgd", "strategy=baseline", "strategy.replicas=2",
                 "strategy.expert_parallel=2", "adapter=lora")
    assert "\n" not in str(err.value)


def test_the_summary_shows_the_sampling_time_the_step_time_leaves_out():
    from relaytrain.records.display import rollout_rows

    assert rollout_rows({"rollout_s": [0.5, None, 1.5]}) == [
        ("rollouts (mean per batch)", "1.000 s sampling and scoring 2 batches, beside the step time")]
    assert rollout_rows({"router_aux": [0.1]}) == []


@pytest.mark.slow
def test_qlora_grpo_samples_from_the_4_bit_base_and_trains_its_adapter(setting, tmp_path):
    """A 4-bit base with a LoRA adapter: sampling runs on the quantized model as training does, the
    KL term's reference is the base alone (adapters off), and the adapter trains; relayed a block
    at a time (the 4-bit storage is what a relay uploads), it samples the same completions."""
    results = grpo_run(setting, tmp_path / "run", "adamw", "strategy=l2l", "adapter=qlora", "objective.beta=0.04")
    rows = rollouts(tmp_path / "run")
    assert len(rows) == STEPS * PROMPTS * ACCUMULATE * G and all(math.isfinite(x) for x in results["loss"])
    assert (tmp_path / "run" / "model" / "adapter_model.safetensors").is_file()
    grpo_run(setting, tmp_path / "relay", "adamw", "strategy=l2l", "adapter=qlora", "objective.beta=0.04",
             "objective.rollout_placement=relay")
    assert [r["completion_ids"] for r in rollouts(tmp_path / "relay")] == [r["completion_ids"] for r in rows]


@pytest.mark.parametrize(("strategy", "beta", "copies"), [("fsdp", 0.04, 2), ("pipe_flush", 0.0, 1), ("l2l", 0.04, 0),
                                                          ("baseline-replicas", 0.04, 0)])
def test_the_first_process_s_host_holds_the_model_shards_or_stages_gather(strategy, beta, copies):
    """Where shards or stages split the model, the first process gathers it whole in fp32 on its
    host before each rollout batch, and keeps the initial one as the KL term's reference: the
    pre-run host estimate and the planner count both (L2L's policy is on the host already; a
    replica holds the whole model anyway)."""
    from relaytrain.run.preflight import gathered_policy_bytes
    from relaytrain.strategies import strategy_class

    cfg = compose_config(["model=llama_tiny", "objective=grpo", "objective.rewards=[exact_answer]", f"objective.beta={beta}",
                          *STRATEGIES[strategy]])
    assert gathered_policy_bytes(cfg, strategy_class(str(cfg.strategy.name)), 1000) == 4 * 1000 * copies
