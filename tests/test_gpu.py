"""The GPU acceptance suite (`make test-gpu`; docs/benchmarks.md, "GPU acceptance run").

On a CUDA device, with the conformance suite's tiny BERT and its references:
- every strategy this machine has enough GPUs for trains to the weights its update rule says
  (the plain loop, or the delayed rule), with `train.device=cuda`. The reference loop runs on the
  GPU too: CUDA's generator draws other dropout masks than the CPU's from the same keys;
- L2L relays through pinned host memory on copy streams of its own, with and without prefetch,
  its activation stash on the device or on the host, to the same weights;
- half precision (amp_bf16 under the baseline and L2L, cmp_bf16 under L2L) lands within bf16's
  error of the fp32 reference;
- FSDP with its shards and optimizer on the host (`strategy.offload=host`) equals the plain loop;
- bf16 masters (`optim.master_dtype=bf16`) live in pinned bf16 buffers and round as on the CPU;
- QLoRA (bitsandbytes' CUDA kernels) and the mixtures of experts train as on the CPU, and L2L's
  experts streamed by need train what uploading them all trains;
- FP8 products (amp_fp8, cmp_fp8) on a card that has them land the baseline and L2L together;
- GRPO's relay decode of a host-held policy (blocks uploaded on a side stream, the KV cache on the
  device or offloaded to the host) draws the tokens a whole device copy draws, leaving nothing.

Skipped where torch sees no CUDA device; `make test-gpu` then says so in one line and runs nothing.
"""

from __future__ import annotations

import pytest
import torch

from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.run.train import run
from relaytrain.strategies import build_strategy, choices, strategy_class
from tests.conformance.references import assert_same_weights, assert_within_a_rounding
from tests.test_conformance import conformance_cfg, plain_reference, saved_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = "train.device=cuda"
# fp32 on the GPU against fp32 on the CPU differ only in the order of sums (PyTorch keeps TF32 off
# for fp32 matrix products unless asked): the conformance suite's own tolerance holds
# (`references.assert_same_weights`).
# bf16 keeps 8 significant bits (a rounding error of 2^-9 per operation). On the CPU, this model's
# two-step update came out 0.38 % off the fp32 one under amp_bf16 (baseline and l2l alike) and
# 0.66 % under cmp_bf16 (update_error, 2026-11-25); 5 % leaves room for CUDA's autocast choosing
# other kernels, and still fails a run whose half-precision path drops or scales a gradient.
BF16_UPDATE_ERROR = 0.05
NO_DROPOUT = "model.dropout=0.0"


def trained_on_cuda(name: str, tmp_path, *overrides: str):
    """(config, results, saved weights) of the conformance run of `name` on the CUDA device. Each
    worker process needs a GPU of its own: a data-parallel strategy runs with as many replicas as
    there are GPUs (fsdp's defaults ask for two), a pipeline with fewer GPUs than stages is skipped."""
    cls, gpus = strategy_class(name), torch.cuda.device_count()
    cfg = conformance_cfg(name, CUDA, *overrides)
    if cls.processes(cfg) > gpus and cls.processes(cfg) == cls.replicas(cfg):
        cfg = conformance_cfg(name, CUDA, *overrides, f"strategy.replicas={gpus}")
    if cls.processes(cfg) > gpus:
        pytest.skip(f"strategy={name} runs {cls.processes(cfg)} workers, one GPU each; {gpus} visible")
    results = run(cfg, tmp_path / "run", quiet=True)
    assert results["device"].startswith("cuda"), results["device"]
    assert results["memory"]["device"]["peak_allocated_bytes"] > 0  # the CUDA allocator held its tensors
    return cfg, results, saved_weights(tmp_path / "run", cfg)


def update_error(ours: torch.nn.Module, reference: torch.nn.Module, initial: torch.nn.Module) -> float:
    """|ours - reference| / |reference - initial| over every weight: the error of the update the
    steps made, relative to its size (the weights themselves barely move in two steps)."""
    flat = [torch.cat([p.detach().float().flatten().cpu() for p in m.parameters()]) for m in (ours, reference, initial)]
    return float((flat[0] - flat[1]).norm() / (flat[1] - flat[2]).norm())


@pytest.mark.parametrize("name", choices())
def test_every_strategy_equals_its_update_rule_on_cuda(name, tmp_path):
    cfg, _, ours = trained_on_cuda(name, tmp_path)
    assert_same_weights(ours, plain_reference(cfg, strategy_class(name).capabilities.update_delay, "cuda"), name)


@pytest.mark.parametrize("stash", ["device", "host"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_l2l_relays_through_pinned_memory_on_its_own_streams(stash, prefetch, tmp_path):
    overrides = (f"strategy.stash={stash}", f"strategy.prefetch={str(prefetch).lower()}")
    cfg, results, ours = trained_on_cuda("l2l", tmp_path, *overrides)
    assert_same_weights(ours, plain_reference(cfg, 0, "cuda"), f"l2l {overrides}")
    report = results["strategy_report"]
    assert report["stash"] == stash and report["peak_resident_blocks"] <= report["max_resident_blocks"]
    if prefetch:  # the next part arrives while the current one computes: both are resident
        assert report["peak_resident_blocks"] == report["max_resident_blocks"] == 2

    # What the run cannot report: where the host copies live and which streams carry them.
    model = build_model(cfg.model, seed=cfg.train.seed)
    strategy = build_strategy(model, cfg, "cuda")
    try:
        strategy.step(next(iter(build_loader(cfg, build_dataset(cfg)))), cfg.optim.lr)
        transfers, compute = strategy.transfers, torch.cuda.current_stream()
        assert all(p.is_pinned() for p in model.parameters()), "host masters must be pinned for asynchronous copies"
        assert transfers.upload_stream is not None and transfers.offload_stream is not None
        assert compute not in (transfers.upload_stream, transfers.offload_stream)
    finally:
        strategy.close()


@pytest.mark.parametrize(("name", "precision"), [("baseline", "amp_bf16"), ("l2l", "amp_bf16"), ("l2l", "cmp_bf16")])
def test_bf16_updates_stay_within_bf16_error_of_fp32(name, precision, tmp_path):
    """Without dropout: CUDA's dropout kernel draws its mask in a pattern that depends on the
    activations' dtype (its vector width), so a bf16 run and an fp32 run of one seed drop other
    elements. With dropout on, an H100 (2026-11-27) put every bf16 update 14 % (amp_bf16) and 21 %
    (cmp_bf16) off the fp32 one, the baseline and L2L alike to six digits."""
    cfg, results, ours = trained_on_cuda(name, tmp_path, f"precision={precision}", NO_DROPOUT)
    assert results["precision"] == precision and not results["skipped_steps"]
    fp32 = conformance_cfg(name, NO_DROPOUT)  # the same run in fp32, as the plain loop trains it
    initial = build_model(fp32.model, seed=fp32.train.seed).hf_model
    error = update_error(ours, plain_reference(fp32, 0, "cuda"), initial)
    assert error < BF16_UPDATE_ERROR, f"{name} {precision}: update off by {error:.1%} of its size"


def test_bf16_masters_beside_a_gpu_round_as_the_same_run_on_the_cpu(tmp_path):
    """optim.master_dtype=bf16 under l2l on CUDA: the masters are pinned bf16 buffers that travel
    themselves, and the run ends within a rounding of the CPU's (fp32 compute, the order of sums
    apart; without dropout, whose CUDA masks differ)."""
    keys = ("optim.master_dtype=bf16", "optim.host_loops=false", NO_DROPOUT)
    cfg, _, ours = trained_on_cuda("l2l", tmp_path, *keys)
    cpu = conformance_cfg("l2l", *keys)
    run(cpu, tmp_path / "cpu", quiet=True)
    assert_within_a_rounding(ours, saved_weights(tmp_path / "cpu", cpu), "l2l bf16 masters, cuda against cpu")
    strategy = build_strategy(build_model(cfg.model, seed=cfg.train.seed), cfg, "cuda")
    try:
        for part in (part for part in strategy.eps.parts if part.owned):
            assert part.buffer.dtype == torch.bfloat16 and part.buffer.is_pinned()
    finally:
        strategy.close()


def test_fsdp_with_shards_on_the_host_equals_the_plain_loop(tmp_path):
    cfg, _, ours = trained_on_cuda("fsdp", tmp_path, "strategy.offload=host")
    assert_same_weights(ours, plain_reference(cfg, 0, "cuda"), "fsdp offload=host")


@pytest.mark.parametrize("name", ["baseline", "l2l"])
def test_lora_on_a_bf16_base_continues_a_peft_adapter_on_cuda(name, tmp_path):
    """adapter=lora on cuda: under L2L the bf16 base stays in pinned host memory in bf16, is
    uploaded and cast on the device; the adapter lands where a plain peft loop on the CPU does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from relaytrain.run.compose import compose_config
    from tests.checkpoints import tiny_decoder
    from tests.models.test_lora import RUN_KEYS, adapters_of, peft_adapter, peft_reference

    base = tiny_decoder(tmp_path / "base", "llama", layers=4, dtype=torch.bfloat16)
    adapter = peft_adapter(base, tmp_path / "adapter")
    cfg = compose_config([f"model.pretrained={base}", f"adapter.pretrained={adapter}", f"strategy={name}",
                          *RUN_KEYS, CUDA])
    results = run(cfg, tmp_path / "run", quiet=True)
    assert results["device"].startswith("cuda")
    ours = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                     tmp_path / "run" / "model")
    reference, _ = peft_reference(base, adapter, cfg, delay=0)
    mine, theirs = adapters_of(ours), adapters_of(reference)
    for key, p in mine.items():  # saved in bf16 (the checkpoint's dtype): bf16's rounding is the tolerance
        torch.testing.assert_close(p, theirs[key].to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2, msg=key)


@pytest.mark.parametrize("name", ["baseline", "l2l"])
def test_qlora_quantizes_and_dequantizes_on_cuda_as_the_cpu_round_trip(name, tmp_path):
    """model.quantize=nf4 on cuda: bitsandbytes' CUDA kernels quantize the blocks at load and
    dequantize each layer just before use (under L2L the 4-bit storage is what travels); the
    continued adapter lands where the plain peft loop over the CPU's NF4 round trip does."""
    from tests.models.test_qlora import continues_the_round_trip, qlora_checkpoints

    results, _ = continues_the_round_trip(qlora_checkpoints(tmp_path), name, tmp_path / "run", CUDA)
    assert results["device"].startswith("cuda")


@pytest.mark.parametrize(("arch", "name"), [("qwen3_moe", "baseline"), ("mixtral", "l2l")])
def test_a_mixture_of_experts_trains_on_cuda_as_the_plain_hugging_face_loop(arch, name, tmp_path):
    """A Hugging Face mixture on cuda (its routing, experts and balancing loss as transformers
    computes them there) ends with the weights of the plain loop on the CPU."""
    from relaytrain.run.compose import compose_config
    from tests.checkpoints import tiny_moe
    from tests.models.test_moe import RUN_KEYS, VARIANTS, trains_as_hugging_face

    pretrained = tiny_moe(tmp_path / "checkpoint", arch, layers=3)
    cfg = compose_config([f"model.pretrained={pretrained}", *VARIANTS[name], *RUN_KEYS, CUDA])
    results, _, _ = trains_as_hugging_face(pretrained, cfg, tmp_path / "run", f"{arch} under {name} on cuda", rel=1e-4)
    assert results["device"].startswith("cuda")


@pytest.mark.parametrize("keys", [[], ["model.quantize=nf4"], ["precision=amp_bf16"]])
def test_experts_streamed_by_need_on_cuda_train_what_uploading_them_all_trains(keys, tmp_path):
    """L2L's experts by need on cuda: zeros made on the copy stream, the picked experts copied into
    them from pinned memory (a bf16 base cast into place on the compute stream), the backward's
    picks prefetched with their part: bit for bit the run that uploads every expert."""
    from tests.checkpoints import tiny_moe
    from tests.models.test_moe import expert_adapter
    from tests.strategies.test_experts_by_need import SPARSE, assert_same_run, train

    base = tiny_moe(tmp_path / "base", "qwen3_moe", **SPARSE)
    adapter = expert_adapter(base, tmp_path / "adapter")
    streamed = train(base, adapter, tmp_path / "streamed", CUDA, *keys, "strategy.experts_by_need=true")
    whole = train(base, adapter, tmp_path / "whole", CUDA, *keys)
    assert_same_run(streamed, whole, tmp_path / "streamed", tmp_path / "whole")
    by_need = streamed["strategy_report"]["experts_by_need"]
    assert by_need["uploaded_bytes"] < by_need["whole_bytes"] and by_need["recompute_misses"] == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="expert parallelism needs a GPU a worker")
def test_experts_shared_over_two_gpus_train_as_the_plain_loop(tmp_path):
    """Expert parallelism over NCCL: the counts, experts and rows exchanged as CUDA tensors."""
    from relaytrain.run.compose import compose_config
    from tests.checkpoints import tiny_moe
    from tests.models.test_moe import RUN_KEYS, trains_as_hugging_face

    pretrained = tiny_moe(tmp_path / "checkpoint", "qwen3_moe")
    cfg = compose_config([f"model.pretrained={pretrained}", "strategy=baseline", "strategy.replicas=2",
                          "strategy.expert_parallel=2", *RUN_KEYS, CUDA])
    trains_as_hugging_face(pretrained, cfg, tmp_path / "run", "qwen3_moe, experts over 2 GPUs", rel=1e-4)


@pytest.mark.parametrize("cache_on_host", [False, True])
def test_a_relayed_policy_samples_on_cuda_what_a_whole_copy_samples(cache_on_host, tmp_path):
    """GRPO's relay decode (`rollout.on_device.RelayCopy`): a host-held policy's blocks uploaded
    on a side stream one ahead of the compute, the KV cache on the device or the host (Hugging
    Face's offloaded cache), draws the tokens a whole copy on the device draws; nothing stays."""
    from transformers import AutoModelForCausalLM

    from relaytrain.rollout.on_device import DeviceCopy, RelayCopy
    from relaytrain.rollout.sampling import Sampling, sample, sample_key
    from tests.checkpoints import chat_tokenizer, tiny_decoder

    policy = AutoModelForCausalLM.from_pretrained(tiny_decoder(tmp_path / "llama", layers=4)).eval()
    for p in policy.parameters():
        p.data = p.data.pin_memory()  # as L2L's masters are held beside a GPU
    tok, cuda = chat_tokenizer(), torch.device("cuda")
    prompts = [tok(t)["input_ids"] for t in ("What is two plus", "Hello there", "A")]
    keys = [sample_key(3, 0, j, 0) for j in range(len(prompts))]
    draw = dict(sampling=Sampling(temperature=0.7), max_new_tokens=12, end_ids={tok.eos_token_id},
                pad_id=tok.pad_token_id, device=cuda)
    with DeviceCopy(policy, cuda).on_device() as model:
        expected = sample(model, prompts, keys, **draw)
    relay = RelayCopy(policy, cuda, [f"model.layers.{i}" for i in range(4)], cache_on_host=cache_on_host)
    before = torch.cuda.memory_allocated()
    with relay.on_device() as model:
        got = sample(model, prompts, keys, **draw, cache_on_host=cache_on_host)
    assert got == expected
    assert torch.cuda.memory_allocated() == before


def test_a_relayed_policy_scores_a_batch_on_cuda_streaming_it_once(tmp_path):
    """GRPO's scoring pass through a relay (`RelayCopy.each_logits`): every micro-batch through
    each block while it is on the device, the next block uploading on the side stream, gives the
    log-probs of a whole copy's forwards; the model streamed once; nothing stays."""
    from transformers import AutoModelForCausalLM

    from relaytrain.models.decoder import LayeredDecoder
    from relaytrain.models.layered import MicroBatch
    from relaytrain.objectives import objective
    from relaytrain.rollout.on_device import DeviceCopy, RelayCopy
    from relaytrain.rollout.scoring import token_logps
    from tests.checkpoints import tiny_decoder

    policy = AutoModelForCausalLM.from_pretrained(tiny_decoder(tmp_path / "llama", layers=4)).eval()
    for p in policy.parameters():
        p.data = p.data.pin_memory()
    cuda = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(3):
        ids = torch.randint(3, policy.config.vocab_size, (2, 16), generator=generator)
        labels = ids.clone()
        labels[:, :6] = -100
        rows.append(MicroBatch(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids)))
    with DeviceCopy(policy, cuda).on_device() as model:
        expected = token_logps(model, rows, temperature=0.7)
    relay = RelayCopy(policy, cuda, [f"model.layers.{i}" for i in range(4)],
                      layered=lambda model: LayeredDecoder(model, objective("grpo")))
    before = torch.cuda.memory_allocated()
    with relay.on_device() as model:
        got = token_logps(model, rows, temperature=0.7)
    assert relay.visits == 4 + 1
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.cuda.memory_allocated() == before


def test_muons_newton_schulz_on_the_gpu_beside_l2l_s_host_masters(tmp_path, capfd):
    """`optim.orthogonalize_on=device`: L2L's host-held Muon ships each update to the GPU in bf16
    for its Newton-Schulz steps; the run lands where the host's steps land, within what bf16
    products summed in another order move after three steps (tests/test_muon.py's bound for
    sums in another order); `auto` times both sides once and says which it took."""
    from tests.checkpoints import tiny_decoder
    from tests.test_muon import SUMMED_ELSEWHERE, hf_saved, muon_cfg

    checkpoint = tiny_decoder(tmp_path / "llama", layers=4)
    weights = {}
    for where in ("host", "device", "auto"):
        cfg = muon_cfg(checkpoint, "strategy=l2l", CUDA, f"optim.orthogonalize_on={where}")
        run(cfg, tmp_path / where, quiet=True)
        weights[where] = dict(hf_saved(tmp_path / where).named_parameters())
    said = capfd.readouterr().err
    assert "optim.orthogonalize_on=auto: Newton-Schulz over a" in said, said
    largest, mean = (share * cfg.optim.lr for share in SUMMED_ELSEWHERE)
    for name, p in weights["host"].items():
        difference = (weights["device"][name] - p).abs()
        assert difference.max() <= largest and difference.mean() <= mean, name


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 products need compute capability 8.9 or newer")
def test_fp8_blocks_on_cuda_under_the_baseline_and_l2l(tmp_path):
    """`precision=amp_fp8` on the GPU's FP8 tensor cores: the baseline and L2L land together, far
    nearer each other than FP8's rounding is from fp32; `cmp_fp8` within that rounding."""
    pytest.importorskip("torchao.float8")
    from tests.test_float8 import largest_difference, trained

    fp32 = trained(tmp_path, "fp32", CUDA)
    baseline = trained(tmp_path, "baseline", CUDA, "precision=amp_fp8")
    l2l = trained(tmp_path, "l2l", CUDA, "precision=amp_fp8", "strategy=l2l")
    cmp = trained(tmp_path, "cmp", CUDA, "precision=cmp_fp8", "strategy=l2l")
    fp8_noise = largest_difference(baseline, fp32)
    assert fp8_noise > 0
    assert largest_difference(l2l, baseline) <= 0.05 * fp8_noise
    assert largest_difference(cmp, baseline) <= fp8_noise
