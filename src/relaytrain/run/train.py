"""One training run: config -> model, data, strategy -> steps -> results.json and a table.

`run` checks everything it can before any process starts, then hands `train_process` to the
launcher, which runs it in every process of the strategy (one, or one per worker). Each
process builds the model, its strategy and the data loader, and `Trainer` drives the
strategy through the contract of `strategies/base.py`: one loop for every strategy, with the
checkpoints, stop requests, progress and results written once, here.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from relaytrain.data import TokenDataset, build_datasets, build_loader, data_facts, eval_batches
from relaytrain.dryrun.memory import DeviceMemory
from relaytrain.models import Trains, build_model, float8
from relaytrain.models import compile as compiling
from relaytrain.models.pretrained import explicit_overrides
from relaytrain.models.pretrained import resolve as resolve_pretrained
from relaytrain.placement.world import StopVotes, World, pick_device, under_torchrun
from relaytrain.records import checkpoint, runlog, trackers
from relaytrain.records.display import StepProgress, print_one_line, print_results_table
from relaytrain.records.export import run_tokenizer, save_model, saved_model_facts
from relaytrain.run import elastic
from relaytrain.run.compose import validate
from relaytrain.run.earlier import earlier_run, how_to_train_further, step_of
from relaytrain.run.launch import launch
from relaytrain.run.preflight import check_can_start
from relaytrain.run.resolve import RunSpec, describe_run
from relaytrain.run.results import assemble_results, process_report, write_results
from relaytrain.run.rollouts import Rollouts
from relaytrain.step import metrics
from relaytrain.step.evaluation import better
from relaytrain.utils import failpoints
from relaytrain.utils.errors import Aborted, Interrupted, TrainingDiverged, first_line
from relaytrain.utils.units import duration

EMPTY_SHARE = {"weights": {}, "optimizer": {}, "scaler": None, "extra": None}


@dataclass
class Job:
    """What every process of a run gets from the launcher, besides the config."""

    spec: RunSpec  # the run's strategy, family, objective, source and precision, resolved once before any worker
    run_dir: Path
    dataset: TokenDataset
    eval_dataset: TokenDataset | None = None
    resume: Path | None = None
    overrides: list[str] = field(default_factory=list)
    estimate_s: float | None = None  # the predicted step time, for the ETA before the first step ends
    quiet: bool = False  # print nothing (a dry run for the planner)
    host_estimate_bytes: int | None = None  # the host memory the pre-launch check estimated (a dry run reports it)


def run(cfg, run_dir: str | Path, overrides: list[str] | None = None, table: bool = True,
        quiet: bool = False, estimate=None, device: torch.device | None = None) -> dict:
    """Train as `cfg` says, write `run_dir/results.json`, print the summary (the whole table, or
    with `table=False` one line, or with `quiet` nothing at all), return the results (an empty
    dict on the processes of a torchrun launch that do not report). `run_dir/status.json` says
    how the run ended. `estimate`: the planner's prediction the caller made (`relaytrain.planner.estimate`),
    for the ETA before the first step ends. `device`: the run's device as the caller decided it
    (None: decided here from train.device); every check and worker is handed this decision."""
    run_dir = Path(run_dir)
    logs = not under_torchrun() or int(os.environ["RANK"]) == 0
    device = device or pick_device(cfg.train.device)
    resume = elastic.resume_key(cfg.train.resume, device.type)
    done = earlier_run(resume, cfg.train.steps, run_dir)  # before the try: the run there keeps its status.json
    if done is not None:
        if logs:
            print(f"this run already finished its {cfg.train.steps} steps ({run_dir / 'results.json'}); "
                  f"{how_to_train_further(cfg.train.steps, run_dir)}", flush=True)
        return done
    try:
        results = _run(cfg, run_dir, overrides or [], logs, quiet, estimate.step_s if estimate else None,
                       device)
    except (Interrupted, Aborted) as stop:
        if logs:
            reached = {"step": stop.step} if isinstance(stop, Interrupted) else {}  # the step its checkpoint holds
            runlog.write_status(run_dir, runlog.INTERRUPTED, error=str(stop), **reached)
        if isinstance(stop, Aborted):  # the handler that raised it could not know where checkpoints go
            raise Aborted(stop.signum, checkpoint.latest(run_dir)) from None
        raise
    except BaseException as err:
        if logs:
            runlog.write_status(run_dir, runlog.FAILED, error=first_line(err))
        if not under_torchrun():  # every worker has ended: a save the failure cut short is only in the way
            checkpoint.remove_staging(checkpoint.checkpoint_dir(run_dir))
        raise
    if not results:
        return {}
    runlog.write_status(run_dir, runlog.FINISHED, step=results["steps"])
    if not quiet:
        (print_results_table if table else print_one_line)(results, run_dir / "results.json")
    return results


def _run(cfg, run_dir: Path, overrides: list[str], logs: bool, quiet: bool, estimate_s: float | None,
         device: torch.device) -> dict | None:
    cfg = resolve_pretrained(elastic.prepare(cfg, device), explicit_overrides(overrides))
    chosen = validate(cfg)  # every name looked up once (`resolve.choose`), then every check
    spec = describe_run(cfg, chosen)  # `Job.spec` hands what was resolved to every process
    host_bytes = check_can_start(cfg, spec.strategy, device, spec.parameters)
    resume = _find_resume(cfg.train.resume, cfg.train.steps, spec, run_dir)
    if logs:
        elastic.record_attempt(run_dir, resume)
        runlog.write_status(run_dir, runlog.RUNNING, strategy=str(cfg.strategy.name),
                            step=step_of(resume) if resume is not None else 0)
    # Once, before any worker: data errors end here.
    dataset, eval_dataset = build_datasets(cfg, str(run_dir), spec.source, spec.objective, spec.family)
    build_loader(cfg, dataset, spec.replicas)  # refuses a dataset smaller than one minibatch
    if spec.reference is not None:  # a preference objective's reference log-probs, on every row
        dataset, eval_dataset = spec.reference.given(spec, dataset, eval_dataset, device)
    job = Job(spec, run_dir, dataset, eval_dataset, resume, overrides, estimate_s, quiet, host_bytes)
    return launch(train_process, cfg, spec.processes, lambda rank: spec.process_names[rank],
                  run_dir, job, lambda: checkpoint.latest(run_dir), device)


def _find_resume(resume: str | None, steps: int, spec: RunSpec, run_dir: Path) -> Path | None:
    """The checkpoint train.resume (`resume`) names, checked against the run (`spec`, training
    `steps` steps) before any process starts."""
    path, passed = checkpoint.find(resume, run_dir) if resume else (None, [])
    for line in passed:
        print(f"checkpoint {line}: passed over for an earlier one", flush=True)
    if path is None:
        elastic.announce_fresh_restart()
        return None
    found = checkpoint.read(path, spec.identity, steps, spec.name, spec.layout)
    line = elastic.resume_line(found.step, path)
    if not found.exact:
        line += (f" (saved by strategy={found.strategy} with layout {found.manifest['layout']}: weights and "
                 f"optimizer state carry over by name, the RNG streams start afresh)")
    print(line, flush=True)
    return path


def train_process(cfg, world: World, job: Job) -> dict | None:
    """One process of the run: build, train, report. Returns the results on the reporter."""
    cls = job.spec.strategy
    host = metrics.HostMemory()
    host.reset_peak()
    metrics.reset_device_peak(world.device)
    model = build_model(cfg.model, cfg.train.seed, quiet=world.rank != 0 or job.quiet, device=world.device,
                        adapter=cfg.adapter, compact_base=cls.compact_base, family=job.spec.family,
                        objective=job.spec.objective)
    # Under an adapter (the spec counted what trains), what trains as built, before a placement cuts or shards it.
    built = Trains.of(model) if job.spec.trains is not None else None
    if float8.uses_float8(cfg.precision.name):  # before any copy of a block is made
        float8.float8_blocks(model)
    compiled = compiling.compile_blocks(model, cfg.train.compile, world.device)  # before copies are made
    strategy = cls(model, cfg, world)
    # A dry run counts the device tensors this process holds from here on (memory.DeviceMemory).
    tracker = DeviceMemory(world.device, strategy.memory_holders) if world.simulated else None
    try:
        with tracker or nullcontext():
            if tracker is not None:
                tracker.register(t for held in strategy.memory_holders().values() for t in held)
            return Trainer(cfg, strategy, world, job, host, tracker, compiled, built).run()
    finally:
        strategy.close()
        if compiled is not None:
            compiled.close()


class Trainer:
    """The loop: one `strategy.step` per minibatch, the same on every process.

    Whole steps are timed with the device synchronised. Checkpoints every
    `train.checkpoint_every` steps and after the last (with `train.resume` set, after the last
    in any case), and on SIGINT/SIGTERM at a step every
    process agrees on (then raises Interrupted). A resumed run continues the loss history, data
    stream, RNG streams and LR schedule exactly where the checkpoint left them.
    """

    def __init__(self, cfg, strategy, world: World, job: Job, host: metrics.HostMemory,
                 tracker: DeviceMemory | None = None, compiled: compiling.CompileStats | None = None,
                 built: Trains | None = None):
        self.cfg, self.strategy, self.world, self.job, self.host = cfg, strategy, world, job, host
        self.built = built  # what trains in the model as built (`Trains.of`)
        self.spec = spec = job.spec
        self.tracker = tracker  # a dry run's device memory
        self.compiled = compiled  # train.compile: this process's compile times
        self.reporter = world.rank == spec.reporter
        self.loader = build_loader(cfg, job.dataset, spec.replicas)
        self.votes = StopVotes(world, spec.strategy.stop_lag)
        self.directory = checkpoint.checkpoint_dir(job.run_dir)
        self.history: dict = {"losses": [], "step_times": [], "skipped": 0, "eval": []}
        self.first = 0
        # Optimizer updates applied so far (steps an fp16 overflow skipped are not): the LR
        # schedule's position, on every process alike (every strategy agrees on a skip).
        self.applied = 0
        self.lr = spec.schedule.at(0)  # the learning rate the last step ran with
        s = cfg.strategy
        self.eval_batches = None if job.eval_dataset is None else eval_batches(
            job.eval_dataset, s.microbatch_size * spec.replicas, s.num_microbatches, cfg.eval.max_batches)
        self.glue_task = spec.benchmark_task
        self.progress: StepProgress | None = None
        # An online objective's rows are sampled from the policy as it trains (`run/rollouts.py`).
        self.rollouts = None if not spec.objective.learns_online else Rollouts(
            spec, strategy, world, job.dataset.records,
            run_tokenizer(cfg.model.pretrained, cfg.model.trust_remote_code, job.run_dir), cfg.data.seq_len,
            cfg.train.seed, job.run_dir, self.reporter, cfg.adapter.name != "none",
            cfg.strategy.microbatch_size * spec.replicas, cfg.strategy.num_microbatches)

    def run(self) -> dict | None:
        steps = self.cfg.train.steps
        self.first = step = self._restore()
        if self.world.rank == 0:
            checkpoint.remove_staging(self.directory)  # before the barrier: nobody writes shares yet
        self.world.barrier()  # start the clock together
        title = f"{self.cfg.strategy.name} · {self.cfg.model.name}" + (" (dry run)" if self.world.simulated else "")
        progress = StepProgress(steps, self.cfg.train.log_every, title, enabled=self.reporter and not self.job.quiet,
                                first=step, estimate_s=self.job.estimate_s)
        extra = () if self.rollouts is None else self.rollouts.columns()
        self.log = runlog.MetricsLog(self.job.run_dir, step, self._open_trackers(), extra) if self.reporter else None
        if self.reporter:
            self.strategy.on_progress = progress.inside
        self.world.stop.how_long = self._time_to_next_safe_point
        results, outcome = None, runlog.FAILED
        try:
            with progress as self.progress:
                while step < steps:
                    signum = self.votes.before(step)
                    if signum:
                        raise self._stop(signum, step)
                    self._step(step)
                    step += 1
                    self._between_steps(step, last=step == steps)
                    self._log(step)
            results, outcome = self._finish(), runlog.FINISHED
        except (Interrupted, Aborted):
            outcome = runlog.INTERRUPTED
            raise
        finally:
            if self.log is not None:  # the trackers' runs end as the run does, with its results
                self.log.close(outcome, results)
        return results

    def _open_trackers(self) -> list[trackers.Tracker]:
        """The experiment trackers log.* asks for (`RunSpec.trackers`), started with the resolved
        config as their parameters."""
        if not self.spec.trackers:
            return []
        config = OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
        say = (lambda line: None) if self.job.quiet else (lambda line: print(line, flush=True))
        return trackers.open_trackers(self.spec.trackers, self.job.run_dir, config, self.job.resume is not None, say)

    def _time_to_next_safe_point(self) -> str:
        """For the first stop signal's message: the rest of the step in flight, at the mean pace."""
        if not self.progress or not (self.progress.times or self.progress.estimate_s):
            return ""
        times = self.progress.times
        mean = sum(times) / len(times) if times else self.progress.estimate_s
        left = max(mean - (time.monotonic() - self.progress.step_started), 0.0)
        return f"about {duration(left)} more at {duration(mean)} a step"

    def _log(self, step: int) -> None:
        """metrics.csv's row for `step`: its loss and times, memory now, and the evaluation made after it."""
        if self.log is None:
            return
        elapsed = self.history["step_times"][-1]
        samples = self.spec.minibatch_samples
        evaluated = self.history["eval"][-1] if self.history["eval"] and self.history["eval"][-1]["step"] == step else {}
        self.log.write({
            "step": step, "loss": self.history["losses"][-1],
            **{name: values[-1] for name, values in self.history.get("loss_terms", {}).items()},
            "lr": self.lr,
            "step_time_s": elapsed, "samples_per_s": samples / elapsed,
            "tokens_per_s": metrics.tokens_per_step(samples, self.spec.objective.rows_per_item,
                                                    self.cfg.data.seq_len) / elapsed,
            "host_rss_bytes": self.host.current_bytes(),
            "device_allocated_bytes": metrics.device_allocated(self.world.device),
            **{f"eval_{k}": v for k, v in evaluated.items() if k != "step"},
        })

    def _between_steps(self, step: int, last: bool) -> None:
        """The evaluation and checkpoint due after `step` steps, on every process at once; after
        the last step always an evaluation (with held-out data) and a checkpoint (when saving,
        or resuming: a run meant to be continued keeps its final state, whatever checkpoint_every)."""
        every_eval, every_save = self.cfg.eval.every, self.cfg.train.checkpoint_every
        evaluate = self.eval_batches is not None and (last or bool(every_eval) and step % every_eval == 0)
        keeps_final = bool(every_save) or self.cfg.train.resume is not None
        save = (last and keeps_final) or (bool(every_save) and step % every_save == 0)
        if not (evaluate or save or last):
            return
        self.strategy.drain()
        best = self._evaluate(step) if evaluate else False
        signum = self.votes.settle()
        if save or best:
            path = self._save(step, best)
            if signum and not last:
                raise Interrupted(signum, step, path)
        elif signum and not last:
            raise Interrupted(signum, step, self._save(step))

    def _evaluate(self, step: int) -> bool:
        """Evaluate on the held-out set; True on every process when `train.keep_best`'s metric improved."""
        self.world.mark("evaluation", step)
        failpoints.reach("evaluate", step, self.world.rank)
        if self.rollouts is not None:  # an online objective's held-out prompts: sampled and scored (every process)
            online = self.rollouts.evaluate(step, self.eval_batches, self.job.eval_dataset.records)
        else:
            stats = self.strategy.evaluate(self.eval_batches)
        improved = False
        if self.reporter:
            figures = online if self.rollouts is not None else stats.metrics(self.spec.objective, self.glue_task)
            self.history["eval"].append({"step": step, **figures})
            self.progress.evaluated(step, figures)
            metric = self.cfg.train.keep_best
            improved = bool(metric) and better(metric, figures[metric], self._best_so_far(exclude_last=True))
        return bool(self.world.max_int(int(improved))) if self.cfg.train.keep_best else False

    def _best_so_far(self, exclude_last: bool = False) -> float | None:
        metric = self.cfg.train.keep_best
        values = [e[metric] for e in self.history["eval"][: -1 if exclude_last else None]]
        best = None
        for value in values:
            best = value if better(metric, value, best) else best
        return best

    def _step(self, step: int) -> None:
        if step == self.first + self.spec.untimed_steps:
            self.strategy.reset_measurements()  # phase times cover the measured steps, as the step time does
        self.world.mark("step", step + 1)
        failpoints.reach("step", step + 1, self.world.rank)
        minibatch = self.loader.minibatch(step) if self.rollouts is None else self.rollouts.minibatch(step, self.loader)
        start = time.perf_counter()
        self.lr = self.spec.schedule.at(self.applied)
        result = self.strategy.step(minibatch, self.lr)
        metrics.synchronize(self.world.device)
        elapsed = time.perf_counter() - start
        if self.compiled is not None:
            self.compiled.step_done()
        self.applied += not result.skipped  # a skipped step consumes no warm-up (as HF and accelerate)
        self.votes.after(step)
        terms = self.strategy.loss_terms()  # beside the loss: a mixture's router term (every process: summed over replicas)
        rollout = {} if self.rollouts is None else self.rollouts.take_figures()  # a rollout batch made for this step
        terms = {**rollout, **terms}
        if not self.reporter:
            return
        held = self.history.setdefault("loss_terms", {})
        for name in terms.keys() - held.keys():  # a term new this step: None at the steps before (as below)
            held[name] = [None] * len(self.history["step_times"])
        for name, values in held.items():  # None where a step had none of it (KTO's rewards/rejected: no such example)
            values.append(terms.get(name))
        if failpoints.reach("loss", step + 1, self.world.rank) == "nan":
            result.loss = math.nan
        self.history["step_times"].append(elapsed)
        if result.skipped:
            self.history["skipped"] += 1
        elif result.loss is not None and not math.isfinite(result.loss):
            raise self._diverged(result.loss, step + 1)
        self.history["losses"].append(result.loss)
        aside = "" if self.rollouts is None else self.rollouts.progress_note(rollout)
        self.progress.update(step + 1, result.loss, elapsed + rollout.get("rollout_s", 0.0), result.skipped, aside)

    def _diverged(self, loss: float, step: int) -> TrainingDiverged:
        """Nothing of the step that diverged is saved; the user continues from the newest checkpoint."""
        precision = self.spec.precision.name
        fix = "lower optim.lr" + ("" if precision == "fp32" else " or use precision=fp32")
        where = checkpoint.continue_from(checkpoint.latest(self.directory), fix)
        return TrainingDiverged(f"the loss became {loss} at step {step} under precision={precision}; {where}")

    def _stop(self, signum: int, step: int) -> Interrupted:
        """Every process decided to stop before `step`: finish what is in flight, save there."""
        self.strategy.drain()
        self.votes.settle()
        return Interrupted(signum, step, self._save(step))

    # -- checkpoints ----------------------------------------------------------------------------
    def _save(self, step: int, best: bool = False) -> Path:
        """Every process's share of the checkpoint at `step`; `best`: it also becomes the kept best checkpoint."""
        self.world.mark("checkpoint", step)
        share = self.strategy.state_dict() or dict(EMPTY_SHARE)
        share = {**share, "rng": checkpoint.rng_state(self.world.device)}
        trainer = {"step": step, "applied_updates": self.applied, "history": self.history} if self.reporter else None
        if trainer is not None and self.rollouts is not None:
            trainer["rollout"] = self.rollouts.state()
        manifest = {"strategy": self.spec.name, "layout": self.spec.layout,
                    "identity": self.spec.identity, "base": self._base()}
        return checkpoint.save(self.world, self.directory, step, share, trainer, manifest,
                               self.cfg.train.keep_checkpoints, best=best, sharded=self.strategy.sharded_state_dict())

    def _base(self) -> str | None:
        """The frozen base's fingerprint under adapters (a checkpoint holds no base: resuming
        reloads it and must find the same one); None when every parameter trains."""
        return getattr(self.strategy.model, "base_fingerprint", None)

    def _restore(self) -> int:
        """Fresh: seed torch's global streams (dropout does not draw from them: each part's draws
        are keyed by its micro-batch, `MicroBatch.draw`; only a micro-batch without a key would).
        Resumed: the checkpoint's weights, optimizer and scaler state, RNG streams and history."""
        if self.job.resume is None:
            torch.manual_seed(self.cfg.train.seed)
            self.strategy.start(0)
            if self.rollouts is not None:
                self.rollouts.load_state(None, 0)
            return 0
        found = checkpoint.read(self.job.resume, self.spec.identity, self.cfg.train.steps, self.spec.name,
                                self.spec.layout, self._base())
        self.strategy.start(found.step)
        self.strategy.load_checkpoint(found)
        self.applied = found.applied_updates()
        rng = found.rng(self.world.rank)
        if rng is not None:
            checkpoint.set_rng_state(rng, self.world.device)
        else:
            torch.manual_seed(self.cfg.train.seed + found.step)
        if self.reporter:
            self.history = {"eval": [], **found.trainer()["history"]}
        if self.rollouts is not None:
            self.rollouts.load_state(found.trainer().get("rollout"), found.step)
        return found.step

    # -- the end --------------------------------------------------------------------------------
    def _finish(self) -> dict | None:
        self.world.mark("the end", self.cfg.train.steps)
        if self.cfg.train.save_model:  # on rank 0: Hugging Face writes files only there once a group exists
            weights = self.world.gather(self.strategy.weights(), 0)
            if self.world.rank == 0:
                save_model(self.cfg, self.strategy, weights, self.job.run_dir, self.spec.family, self.spec.objective)
        device = self.strategy.simulated_memory(self.tracker) if self.tracker else metrics.device_memory(self.world.device)
        report = process_report(self.strategy, self.world, self.host, device, self.built)
        report["compile"] = None if self.compiled is None else self.compiled.report()
        reports = self.world.gather(report, self.spec.reporter)
        if not self.reporter:
            return None
        measured = self.history["step_times"][self.first + self.spec.untimed_steps:]
        results = assemble_results(self.cfg, self.spec, self.history, measured, reports, self.world, self.job.overrides,
                                   self.job.host_estimate_bytes)
        results.update(elastic.results_entry(self.job.run_dir))
        results.update(compiling.results_entry([r["compile"] for r in reports]))
        results.update(data_facts(self.job.dataset, self.job.eval_dataset))  # e.g. chat records cut or dropped
        results.update(saved_model_facts(self.cfg.model, self.cfg.adapter, self.cfg.train, self.job.run_dir,
                                         self.spec.objective))
        write_results(self.job.run_dir, results)
        return results
