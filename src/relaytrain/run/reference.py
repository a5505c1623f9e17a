"""The reference's log-probs of every preference row, computed once before training and cached.

A preference objective that compares the policy with a reference (`objective=dpo`) reads each
row's reference log-prob from the row (`ref_logps`). The reference never changes while the
policy trains: it is the initial model (`objective.ref_model=DIR`: another checkpoint), and with
an adapter the model as built for training: a new LoRA adapter starts at zero, so that is the
base as if the adapter were off (TRL disables it); a continued adapter, its initial weights (TRL
copies them as a "ref" adapter); a QLoRA base in its 4 bits. So its
log-probs are computed once, in one forward-only pass before any worker starts (TRL's
`precompute_ref_log_probs`), and no second model is held while training.

The pass streams the model through the device block by block, as L2L does: a group of
micro-batches' hidden states stays on the device while each block visits it, so the pass needs
one block's weights and the group's activations there, whatever the strategy, and the host
holds the model once (it is freed before training).

The log-probs are cached under data.cache_dir (`reference/`), keyed by the tokenized rows
(their bytes) and what makes the reference (the model keys, the seed of a fresh one, the
checkpoint's weight files by name, size and time, the adapter, the precision); a second start
reuses them and says so. `objective.ref_cache=false` computes them every time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from relaytrain.data.cache import cache_root
from relaytrain.data.dataset import TokenDataset
from relaytrain.models import build_model
from relaytrain.models.layered import LayeredModel, eval_mode
from relaytrain.schema.config import AdapterConfig, ModelConfig
from relaytrain.utils.files import atomic_write

FORMAT = 1  # bump when what is stored, or how it is computed, changes
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


@dataclass(frozen=True)
class ReferencePass:
    """What the reference pass takes of the config, read once before the data is (plain values):
    the reference's model keys (`objective.ref_model` as its checkpoint), the adapter, the seed
    of a fresh model, the micro-batches the pass runs, and where its cache file goes."""

    model: dict
    adapter: dict
    seed: int
    microbatch: int
    group: int
    cache: Path | None  # the cache's directory; None: objective.ref_cache=false
    data_key: dict  # what else the cached values depend on: the checkpoint's files, the precision

    @classmethod
    def of(cls, cfg, spec) -> ReferencePass | None:
        """The run's pass; None for an objective that reads no reference."""
        if not spec.objective.needs_reference:
            return None
        model = OmegaConf.to_container(cfg.model, resolve=True)
        if cfg.objective.ref_model is not None:
            model["pretrained"] = cfg.objective.ref_model
        s = cfg.strategy
        return cls(model=model, adapter=OmegaConf.to_container(cfg.adapter, resolve=True), seed=cfg.train.seed,
                   microbatch=s.microbatch_size, group=s.microbatch_size * s.num_microbatches,
                   cache=cache_root(cfg.data.cache_dir) / "reference" if cfg.objective.ref_cache else None,
                   data_key={"weights": _weight_files(model["pretrained"]), "precision": spec.precision.name,
                             "objective": spec.objective.name})

    def given(self, spec, train: TokenDataset, held_out: TokenDataset | None, device: torch.device
              ) -> tuple[TokenDataset, TokenDataset | None]:
        """`train` and `held_out` with each row's reference log-prob (`ref_logps`), from the
        cache or computed here; a dry run (the meta device) computes nothing: zeros in their
        place (`cost.reference` prices the pass)."""
        if device.type == "meta":
            return tuple(None if s is None else dataclasses.replace(s, ref_logps=torch.zeros(s.input_ids.shape[0]))
                         for s in (train, held_out))
        sets = [s for s in (train, held_out) if s is not None]
        entry = None if self.cache is None else self.cache / f"{self._entry_name(sets)}.pt"
        found = _read(entry)
        if found is not None:
            print(f"reference log-probs: reused from {entry}", flush=True)
        else:
            found = self._computed(spec, sets, device)
            if entry is not None:
                atomic_write(entry, lambda f: torch.save(found, f))
                print(f"reference log-probs: computed for {sum(s.input_ids.shape[0] for s in sets)} rows, cached at {entry}",
                      flush=True)
        given = [dataclasses.replace(s, ref_logps=logps) for s, logps in zip(sets, found, strict=True)]
        return given[0], (given[1] if held_out is not None else None)

    def _computed(self, spec, sets: list[TokenDataset], device: torch.device) -> list[torch.Tensor]:
        """Every row's log-prob under the reference, set by set."""
        model = build_model(OmegaConf.structured(ModelConfig(**self.model)), self.seed, quiet=True,
                            adapter=OmegaConf.structured(AdapterConfig(**self.adapter)), family=spec.family,
                            objective=spec.objective)
        with torch.no_grad(), eval_mode(model), spec.precision.autocast_context(device):
            return [streamed_logps(model, s, self.microbatch, self.group, device) for s in sets]

    def _entry_name(self, sets: list[TokenDataset]) -> str:
        """The cache file's name: a hash of the tokenized rows (their bytes) and what makes the
        reference (the model keys, the seed of a fresh model, the checkpoint's files, the adapter)."""
        rows = hashlib.blake2b(digest_size=16)
        for s in sets:
            for t in (s.input_ids, s.labels, s.attention_mask):
                if t is not None:
                    rows.update(t.contiguous().numpy().tobytes())
        key = {"format": FORMAT, "rows": rows.hexdigest(), "model": self.model, "adapter": self.adapter,
               "seed": None if self.model.get("pretrained") else self.seed, **self.data_key}
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def streamed_logps(model: LayeredModel, dataset: TokenDataset, microbatch: int, group: int,
                   device: torch.device) -> torch.Tensor:
    """Every row's log-prob [rows] (`LayeredModel.row_logps`), `group` items at a time in
    micro-batches of `microbatch` items, the model streamed through `device` part by part."""
    out = []
    for start in range(0, len(dataset), group):
        batches = [dataset.take(torch.arange(i, min(i + microbatch, start + group, len(dataset)))).to(device)
                   for i in range(start, min(start + group, len(dataset)), microbatch)]
        with _visiting(model.embed, device):
            hidden = [model.embed_input(mb.input_ids) for mb in batches]
        contexts = [model.context(mb, h) for mb, h in zip(batches, hidden, strict=True)]
        for block in model.blocks:
            with _visiting(block, device):
                hidden = [block(h, ctx) for h, ctx in zip(hidden, contexts, strict=True)]
        with _visiting(model.head, device):
            out += [model.row_logps(h, mb).float().cpu() for h, mb in zip(hidden, batches, strict=True)]
    return torch.cat(out)


class _visiting:
    """A part on `device` while it computes, back on the host after (nothing moves on the CPU)."""

    def __init__(self, part: torch.nn.Module, device: torch.device):
        self.part, self.device = part, device

    def __enter__(self):
        if self.device.type != "cpu":
            self.part.to(self.device)

    def __exit__(self, *exc):
        if self.device.type != "cpu":
            self.part.to("cpu")


def _weight_files(location: str | None) -> list | None:
    """A checkpoint directory's weight files by name, size and modification time (a changed
    file changes them; hashing a 140 GB checkpoint's bytes on every start would not pay)."""
    if not location or not Path(location).expanduser().is_dir():
        return None if not location else [location]  # a hub id: its name
    root = Path(location).expanduser()
    files = sorted({f for pattern in WEIGHT_FILES for f in root.glob(pattern)})
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def _read(entry: Path | None) -> list[torch.Tensor] | None:
    """The cached log-probs, or None (none kept, or a damaged copy: computed again)."""
    if entry is None or not entry.is_file():
        return None
    try:
        return torch.load(entry, weights_only=True)
    except Exception:  # noqa: BLE001 - a damaged copy is computed again
        return None
