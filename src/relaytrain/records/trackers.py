"""Experiment trackers: where a run's figures go besides metrics.csv.

    log.tensorboard=true  TensorBoard events in RUN_DIR/tensorboard             extra: tensorboard
    log.mlflow=true       an MLflow run, in RUN_DIR/mlruns/mlflow.db (sqlite)   extra: mlflow
                          or log.mlflow_uri (a server, a database)
    log.wandb=true        a Weights & Biases run, offline in RUN_DIR/wandb      extra: wandb
                          unless log.wandb_project is set and a key is known

Each one gets the resolved config as its parameters when it starts, every metrics.csv column of
every step (`runlog.MetricsLog` hands it each row, on the reporting process only), and the final
results (results.json's numbers, as `results/KEY`) at the end. Their packages are imported only
by the run that asks for them (MLflow's import alone takes seconds); `check_trackers` refuses a
missing one in one line before any work.

A resumed run continues the MLflow and W&B runs that RUN_DIR/trackers.json names (TensorBoard's
events stay in their directory). A tracker that continues its run is `continued`: it already
holds every step metrics.csv held before the resume, and `MetricsLog` sends it none of them again.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import netrc
import os
import re
import time
import urllib.error
import urllib.request
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from relaytrain.records.runlog import FAILED, FINISHED, INTERRUPTED
from relaytrain.utils.errors import ConfigError, first_line
from relaytrain.utils.files import write_json

TRACKERS_FILE = "trackers.json"


class Tracker(ABC):
    """One destination of a run's figures. Subclasses start their run in `__init__(settings,
    run_dir, config, saved, say)`: `settings` its own log keys' values (`settings_of`), `config`
    the resolved config as nested dicts, `saved` what `identity` returned in an earlier attempt in
    this run directory (None: there was none, or the run starts afresh), `say` prints a line for
    the user."""

    key = ""  # the switch: log.<key>=true
    module = ""  # what it imports, checked before any work
    package = ""  # its PyPI package; relaytrain's extra has the same name
    continued = False  # it reopened the run of an earlier attempt, which holds that attempt's steps

    @classmethod
    def settings_of(cls, log) -> dict:
        """Its own keys of the config's log keys `log`, as plain values (none but the switch)."""
        return {}

    def identity(self) -> dict | None:
        """What trackers.json keeps so that a resumed run finds this run again."""
        return None

    @abstractmethod
    def log_step(self, step: int, figures: dict[str, float]) -> None:
        """One metrics.csv row's figures at `step`."""

    def log_results(self, results: dict) -> None:
        """The run's final numbers (results.json's), keyed `results/KEY` (`final_figures`)."""
        self.log_final(int(results["steps"]), final_figures(results))

    @abstractmethod
    def log_final(self, step: int, figures: dict[str, float]) -> None:
        """The run's final figures, at its last step."""

    def close(self, outcome: str) -> None:
        """End the run as `outcome` (FINISHED, FAILED or INTERRUPTED)."""


class TensorBoard(Tracker):
    key = module = package = "tensorboard"

    def __init__(self, settings: dict, run_dir: Path, config: dict, saved: dict | None, say: Callable[[str], None]):
        from torch.utils.tensorboard import SummaryWriter

        self.continued = saved is not None
        self.events = SummaryWriter(str(run_dir / "tensorboard"))
        if not self.continued:
            self.events.add_text("config", "\n".join(f"    {k} = {v}" for k, v in flat(config).items()))

    def identity(self) -> dict:
        return {"directory": "tensorboard"}

    def log_step(self, step: int, figures: dict[str, float]) -> None:
        for key, value in figures.items():
            self.events.add_scalar(key.replace("eval_", "eval/"), value, step)
        self.events.flush()

    def log_final(self, step: int, figures: dict[str, float]) -> None:
        self.log_step(step, figures)

    def close(self, outcome: str) -> None:
        self.events.close()


class MLflow(Tracker):
    """An MLflow run through `MlflowClient` (no global active run). The default store is sqlite in
    the run directory: MLflow 3 refuses its file store (`./mlruns`) without an opt-out."""

    key = module = package = "mlflow"
    STATUS = {FINISHED: "FINISHED", FAILED: "FAILED", INTERRUPTED: "KILLED"}
    MAX_PARAMS, MAX_VALUE = 100, 6000  # MLflow's limits: params in one log_batch, characters in a value

    @classmethod
    def settings_of(cls, log) -> dict:
        return {"uri": log.mlflow_uri, "experiment": log.mlflow_experiment}

    def __init__(self, settings: dict, run_dir: Path, config: dict, saved: dict | None, say: Callable[[str], None]):
        from mlflow import MlflowClient

        default = default_mlflow_store(run_dir)
        self.uri = settings["uri"] or os.environ.get("MLFLOW_TRACKING_URI") or default
        experiment = settings["experiment"]
        # In the default store, artifacts go beside it, not into the working directory.
        artifacts = (run_dir / "mlruns" / "artifacts").resolve().as_uri() if self.uri == default else None
        if self.uri == default:
            (run_dir / "mlruns").mkdir(parents=True, exist_ok=True)
        with quiet_mlflow():
            self.client = MlflowClient(tracking_uri=self.uri)
            self.run_id = self._reopen(saved) or self._create(experiment, run_dir.name, artifacts)
            self._log_params(flat(config))
        browse = f"; browse with: mlflow ui --backend-store-uri {self.uri}" if self.uri.startswith("sqlite:") else ""
        run = "continuing run" if self.continued else "run"
        say(f"mlflow: {run} {self.run_id} (experiment {experiment}) in {self.uri}{browse}")

    def _reopen(self, saved: dict | None) -> str | None:
        """The run an earlier attempt logged to, marked running again; None when it is not in this store."""
        if not saved or saved.get("uri") != self.uri:
            return None
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(saved["run_id"], status="RUNNING")
        except MlflowException:
            return None
        self.continued = True
        return saved["run_id"]

    def _create(self, experiment_name: str, run_name: str, artifacts: str | None) -> str:
        """A new run in the experiment, made (its artifacts at `artifacts`, None: the store's choice) when missing."""
        experiment = self.client.get_experiment_by_name(experiment_name)
        if experiment is None:
            experiment_id = self.client.create_experiment(experiment_name, artifact_location=artifacts)
        else:
            experiment_id = experiment.experiment_id
        return self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def _log_params(self, params: dict[str, str]) -> None:
        """The config as params. MLflow never changes a param: on a resumed run a key whose value
        changed (train.steps raised) is kept as the tag resumed/KEY instead."""
        from mlflow.entities import Param, RunTag

        logged = self.client.get_run(self.run_id).data.params if self.continued else {}
        values = {k: v[: self.MAX_VALUE] for k, v in params.items()}
        new = [Param(k, v) for k, v in values.items() if k not in logged]
        changed = [RunTag(f"resumed/{k}", v) for k, v in values.items() if k in logged and logged[k] != v]
        for start in range(0, max(len(new), len(changed)), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=new[start:start + self.MAX_PARAMS],
                                  tags=changed[start:start + self.MAX_PARAMS])

    def identity(self) -> dict:
        return {"uri": self.uri, "run_id": self.run_id}

    def log_step(self, step: int, figures: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in figures.items()])

    def log_final(self, step: int, figures: dict[str, float]) -> None:
        self.log_step(step, figures)

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, status=self.STATUS[outcome])


class WandB(Tracker):
    """A Weights & Biases run. Where it goes: WANDB_MODE where the user set it; else online with
    log.wandb_project and a known API key; else offline, in RUN_DIR/wandb (`wandb sync` uploads it)."""

    key = module = package = "wandb"

    @classmethod
    def settings_of(cls, log) -> dict:
        return {"project": log.wandb_project}

    def __init__(self, settings: dict, run_dir: Path, config: dict, saved: dict | None, say: Callable[[str], None]):
        import wandb

        self.continued = saved is not None
        project = settings["project"]
        self.run = wandb.init(project=project or "relaytrain", name=run_dir.name, dir=str(run_dir),
                              config=config, id=saved["id"] if saved else None, resume="allow" if saved else None,
                              mode=wandb_mode(project, say),
                              settings=wandb.Settings(console="off", silent=True))  # relaytrain's output stays its own
        say(self._where())

    def _where(self) -> str:
        run = f"{'continuing run' if self.continued else 'run'} {self.run.id}"
        if self.run.disabled:
            return "wandb: disabled (WANDB_MODE): nothing is logged to W&B"
        if self.run.offline:
            files = Path(self.run.dir).parent
            return f"wandb: offline {run} in {files}; upload it with: wandb sync {files}"
        return f"wandb: {run} at {self.run.url}"

    def identity(self) -> dict:
        return {"id": self.run.id}

    def log_step(self, step: int, figures: dict[str, float]) -> None:
        self.run.log(figures, step=step)

    def log_final(self, step: int, figures: dict[str, float]) -> None:
        self.run.summary.update(figures)

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome == FINISHED else 1)


TRACKERS = (TensorBoard, MLflow, WandB)


def check_trackers(log) -> dict[str, dict]:
    """Refuse, in one line, before any work (`log`: the config's log keys): a tracker whose package
    is not installed, a tracker's key set while the tracker is off, an MLflow server that does not
    answer (MLflow itself retries for minutes before it gives up). Returns the trackers `log`
    asks for, by key, each with its settings: what `open_trackers` starts."""
    for cls in TRACKERS:
        if log[cls.key] and not _importable(cls.module):
            raise ConfigError(f"log.{cls.key}=true needs the {cls.package} package: pip install "
                              f"'relaytrain[{cls.package}]' (or pip install {cls.package}), or set log.{cls.key}=false")
    for key, tracker in (("mlflow_uri", "mlflow"), ("wandb_project", "wandb")):
        if log[key] is not None and not log[tracker]:
            raise ConfigError(f"log.{key} is set but log.{tracker}=false; add log.{tracker}=true (or drop log.{key})")
    uri = log.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if log.mlflow and uri.startswith(("http://", "https://")):
        _check_server(uri)
    return {cls.key: cls.settings_of(log) for cls in TRACKERS if log[cls.key]}


def _check_server(uri: str, timeout_s: float = 10.0) -> None:
    """An MLflow server answers at `uri` (any HTTP answer will do: a server behind a login says 401)."""
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as err:  # refused, unresolved, timed out (URLError is an OSError)
        reason = getattr(err, "reason", err)
        raise ConfigError(f"log.mlflow: no MLflow server answers at {uri} ({reason}); start it (mlflow server) "
                          f"or fix log.mlflow_uri (MLFLOW_TRACKING_URI)") from err


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def open_trackers(chosen: dict[str, dict], run_dir: Path, config: dict, resumed: bool,
                  say: Callable[[str], None]) -> list[Tracker]:
    """Start every tracker `chosen` names (`check_trackers`' answer: each key with its settings);
    `resumed`: the run continues from a checkpoint, so each continues its earlier run where
    trackers.json names one. A tracker that cannot start ends the run in one line."""
    path = Path(run_dir) / TRACKERS_FILE
    saved = json.loads(path.read_text()) if resumed and path.is_file() else {}
    started = []
    for cls in TRACKERS:
        if cls.key not in chosen:
            continue
        try:
            started.append(cls(chosen[cls.key], Path(run_dir), config, saved.get(cls.key), say))
        except Exception as err:  # a library's own error, from a bad URI to a refused key
            for tracker in started:
                tracker.close(FAILED)
            raise ConfigError(f"log.{cls.key}=true: {cls.package} could not start: {first_line(err)}") from err
    if started:
        write_json(path, {**saved, **{t.key: t.identity() for t in started}})
    return started


def default_mlflow_store(run_dir: Path) -> str:
    """MLflow's store when neither log.mlflow_uri nor MLFLOW_TRACKING_URI names one: sqlite in the run directory."""
    return f"sqlite:///{Path(run_dir).resolve() / 'mlruns' / 'mlflow.db'}"


@contextmanager
def quiet_mlflow():
    """Without the lines MLflow and SQLAlchemy print while they make a new sqlite store (its
    tables, their migrations, a deprecation inside MLflow): a user can do nothing about them."""
    loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def wandb_mode(project: str | None, say: Callable[[str], None]) -> str | None:
    """W&B's mode: None (WANDB_MODE decides, wandb reads it), online, or offline."""
    if os.environ.get("WANDB_MODE"):
        return None
    if project is None:
        return "offline"
    if _wandb_key_known():
        return "online"
    say(f"wandb: log.wandb_project={project} but no W&B API key is known (WANDB_API_KEY, or `wandb login`): "
        f"logging offline; upload the run later with `wandb sync`")
    return "offline"


def _wandb_key_known() -> bool:
    """An API key in the environment or in the netrc file `wandb login` writes, found without the network."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def flat(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config sections as one level of dotted keys, each value as text (`model.hidden_size`: '128')."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def final_figures(results: dict) -> dict[str, float]:
    """results.json's numbers as `results/KEY` (dotted keys: `results/throughput.samples_per_s`),
    the last evaluation's as `results/eval.METRIC`; a character MLflow refuses in a name as _
    (`forward+backward`: `forward_backward`)."""
    evaluations = results.get("eval") or []
    scalars = {**{k: v for k, v in results.items() if k != "eval"}, **({"eval": evaluations[-1]} if evaluations else {})}
    return {"results/" + re.sub(r"[^\w./ :-]", "_", key): float(value) for key, value in _numbers(scalars)}


def _numbers(record: dict, prefix: str = ""):
    """(dotted key, value) of every number in `record`, nested sections included."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _numbers(value, f"{prefix}{key}.")
        elif _number(value):
            yield f"{prefix}{key}", value


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
