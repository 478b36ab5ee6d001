"""The TensorBoard / W&B / MLflow trackers for real, offline: log, then read back with each backend's reader."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyrl.tracking import MLFLOW_ID_FILE, WANDB_ID_FILE, Tracker, _wandb_has_credentials

CONFIG = {
    "actor": {"optim": {"lr": 1e-3, "betas": [0.9, 0.99]}, "ppo_epochs": 2},
    "trainer": {"logger": ["tensorboard", "wandb", "mlflow"], "experiment_name": "exp"},
    "data": {"path": "x" * 600},
    "seed": None,
}


def _steps(first: int, last: int, scale: float = 1.0) -> dict[int, dict[str, float]]:
    return {s: {"critic/score/mean": 0.1 * s * scale, "actor/pg_loss": -1.0 / (s + 3) * scale,
                "val/gsm8k/mean@1": 0.25 * s * scale} for s in range(first, last + 1)}


def _log(tracker: Tracker, steps: dict[int, dict[str, float]]) -> None:
    for step, metrics in steps.items():
        # not finite / not a number: dropped by every backend
        tracker.log({**metrics, "actor/nan": float("nan"), "actor/inf": float("inf"), "note": "text"}, step)


def _log_run(backend: str, run_dir: Path, steps: dict[int, dict[str, float]], **kwargs) -> None:
    """A whole run of one backend: open (with CONFIG unless given), log ``steps``, close."""
    kwargs.setdefault("config", CONFIG)
    tracker = Tracker([backend], run_dir, project="proj", experiment="exp", **kwargs)
    _log(tracker, steps)
    tracker.close()


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    """No network and nothing outside tmp_path: W&B offline with its dirs in tmp_path, MLflow default store."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_RESUME",
                "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    # set then delete: monkeypatch restores "absent" even though the tracker sets it
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    _wandb_teardown()
    yield
    _wandb_teardown()
    assert not any(cwd.iterdir()), f"a tracker wrote into the working directory: {list(cwd.iterdir())}"


def _wandb_teardown() -> None:
    """W&B reads the environment once per process (its settings singleton): forget it between tests."""
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()


# --- TensorBoard ----------------------------------------------------------------------------------------


def _tb_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event TensorBoard shows, per tag: (step, value) in order (a step twice shows twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _expected(steps: dict[int, dict[str, float]]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for step, metrics in steps.items():
        for k, v in metrics.items():
            out.setdefault(k, []).append((step, pytest.approx(v, rel=1e-6)))  # float32 in TensorBoard
    return out


def test_tensorboard_writes_scalars_and_config_under_run_dir(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    run_dir = tmp_path / "run"
    steps = _steps(1, 3)
    _log_run("tensorboard", run_dir, steps)

    got = _tb_scalars(run_dir / "tensorboard")
    assert got == _expected(steps)
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    [event] = acc.Tensors("config/text_summary")
    text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
    assert json.loads("\n".join(line[4:] for line in text.splitlines())) == CONFIG


def test_tensorboard_resume_replaces_steps_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run"
    _log_run("tensorboard", run_dir, _steps(1, 3), config=None)  # crashed after logging step 3, last checkpoint at step 2
    first_second = int(time.time())
    while int(time.time()) == first_second:  # event files sort by their creation second
        time.sleep(0.02)

    _log_run("tensorboard", run_dir, _steps(3, 5, scale=10.0), config=None, resume=True)

    expected = {**_steps(1, 2), **_steps(3, 5, scale=10.0)}
    assert _tb_scalars(run_dir / "tensorboard") == _expected(expected)


# --- W&B (offline) ----------------------------------------------------------------------------------------
# Checked through W&B's public API only: the ``wandb.Run`` the tracker opens (its id, project, name, config,
# ``offline``, ``dir``) and the public calls made on it (``Run.log``, ``Run.finish``). The records inside the
# ``.wandb`` file are W&B's private format (they changed in wandb 0.31), so they are not parsed here.

#: Spies on ``wandb.init`` / ``Run.log`` / ``Run.finish``; the pty test runs it in a child process too.
_WANDB_SPY = '''
import wandb

RUNS = []


def _entry(run):
    for entry in RUNS:
        if entry["run"] is run:
            return entry
    raise AssertionError("Run.log/finish on a run that wandb.init did not return")


def _spy(init=wandb.init, log=wandb.Run.log, finish=wandb.Run.finish):
    def spy_init(*args, **kwargs):
        run = init(*args, **kwargs)
        RUNS.append({"run": run, "init": kwargs, "history": {}, "exit_code": None, "finished": False})
        return run

    def spy_log(self, data, step=None, *args, **kwargs):
        history = _entry(self)["history"]
        assert step not in history, f"step {step} logged twice"
        history[step] = dict(data)
        return log(self, data, step, *args, **kwargs)

    def spy_finish(self, exit_code=None, *args, **kwargs):
        entry = _entry(self)
        entry.update(exit_code=exit_code, finished=True)
        return finish(self, exit_code, *args, **kwargs)

    return spy_init, spy_log, spy_finish
'''


@pytest.fixture
def wandb_runs(monkeypatch) -> list[dict]:
    """Each W&B run the tracker opens, in order: ``run`` (the ``wandb.Run``), the ``init`` kwargs,
    ``history`` ({step: metrics} as passed to ``Run.log``), ``exit_code`` and ``finished`` (``Run.finish``)."""
    wandb = pytest.importorskip("wandb")
    spy: dict = {}
    exec(_WANDB_SPY, spy)  # noqa: S102 - the test's own source, shared with the child process below
    spy_init, spy_log, spy_finish = spy["_spy"]()
    monkeypatch.setattr(wandb, "init", spy_init)
    monkeypatch.setattr(wandb.Run, "log", spy_log)
    monkeypatch.setattr(wandb.Run, "finish", spy_finish)
    return spy["RUNS"]


def _assert_wandb_run_under(run: object, run_dir: Path) -> None:
    """The run's local files (``Run.dir``) and its ``.wandb`` datastore for ``wandb sync`` lie under run_dir."""
    files = Path(run.dir)  # type: ignore[attr-defined]
    assert files.is_relative_to(run_dir / "wandb"), files
    [datastore] = files.parent.glob(f"run-{run.id}.wandb")  # type: ignore[attr-defined]
    assert datastore.stat().st_size > 0


def test_wandb_offline_run_holds_metrics_and_config(tmp_path, wandb_runs):
    run_dir = tmp_path / "run"
    steps = _steps(1, 3)
    _log_run("wandb", run_dir, steps)

    [entry] = wandb_runs
    run = entry["run"]
    assert run.id == (run_dir / WANDB_ID_FILE).read_text().strip()
    assert (run.project, run.name, run.offline) == ("proj", "exp", True)
    assert entry["history"] == steps  # nan / inf / text dropped before W&B
    assert {k: v for k, v in dict(run.config).items() if k != "_wandb"} == CONFIG
    assert (entry["finished"], entry["exit_code"]) == (True, 0)
    _assert_wandb_run_under(run, run_dir)
    assert not any((tmp_path / "wandb_home").glob("**/*.wandb")), "W&B run files outside run_dir"


def test_wandb_resume_continues_the_same_run(tmp_path, wandb_runs):
    run_dir = tmp_path / "run"
    _log_run("wandb", run_dir, _steps(1, 2))
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()

    _log_run("wandb", run_dir, _steps(3, 4), resume=True)
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == run_id
    first, second = wandb_runs
    assert first["run"].id == second["run"].id == run_id
    assert second["init"].get("resume") == "allow"
    assert first["history"] == _steps(1, 2)
    assert second["history"] == _steps(3, 4)
    _assert_wandb_run_under(second["run"], run_dir)

    # a fresh (not resumed) run in the same directory is a new W&B run
    Tracker(["wandb"], run_dir, project="proj", experiment="exp").close()
    assert wandb_runs[2]["run"].id != run_id
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == wandb_runs[2]["run"].id


def test_wandb_marks_a_failed_run(tmp_path, wandb_runs):
    run_dir = tmp_path / "run"
    tracker = Tracker(["wandb"], run_dir, project="proj", experiment="exp")
    with pytest.raises(RuntimeError, match="boom"):
        try:
            _log(tracker, _steps(1, 1))
            raise RuntimeError("boom")
        finally:
            tracker.close()
    [entry] = wandb_runs
    assert (entry["finished"], entry["exit_code"]) == (True, 1)
    assert entry["history"] == _steps(1, 1)


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_wandb_without_credentials_logs_offline_and_says_so(tmp_path):
    """With a terminal, no WANDB_MODE and no API key, wandb.init would ask to log in: the tracker goes offline."""
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    code = (_WANDB_SPY + "wandb.init, wandb.Run.log, wandb.Run.finish = _spy()\n"
            "import json\nfrom polyrl.tracking import Tracker\n"
            f"t = Tracker(['wandb'], {str(run_dir)!r}, project='proj', experiment='exp')\n"
            "t.log({'critic/score/mean': 0.5}, 1)\nt.close()\n"
            "[e] = RUNS\nprint('TRACKER-DONE', json.dumps({'offline': e['run'].offline, 'mode': e['init'].get('mode'),"
            " 'history': e['history'], 'exit_code': e['exit_code']}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_SILENT")}
    assert not _wandb_has_credentials()
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave, env=env,
                            cwd=Path.cwd())
    os.close(slave)
    out, deadline = b"", time.monotonic() + 60
    try:
        while time.monotonic() < deadline and b"Enter your choice" not in out:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = out.decode(errors="replace")
    assert "TRACKER-DONE" in text and proc.returncode == 0, text
    assert text.count("wandb: no W&B API key") == 1, text  # a warning of the polyrl.metrics logger
    [line] = [ln for ln in text.splitlines() if ln.startswith("TRACKER-DONE ")]
    seen = json.loads(line.removeprefix("TRACKER-DONE "))
    assert seen == {"offline": True, "mode": "offline", "history": {"1": {"critic/score/mean": 0.5}}, "exit_code": 0}
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_credentials_are_found_in_env_and_netrc(tmp_path, monkeypatch):
    assert not _wandb_has_credentials()
    (tmp_path / "no.netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    assert _wandb_has_credentials()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert not _wandb_has_credentials()
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    assert _wandb_has_credentials()


# --- MLflow ---------------------------------------------------------------------------------------------


def _mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _mlflow_history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_mlflow_default_store_under_run_dir(tmp_path):
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    steps = _steps(1, 3)
    _log_run("mlflow", run_dir, steps)

    client = _mlflow_client((run_dir / "mlruns").as_uri())
    run_id = (run_dir / MLFLOW_ID_FILE).read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "exp"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    names = {"critic/score/mean": "critic/score/mean", "actor/pg_loss": "actor/pg_loss",
             "val/gsm8k/mean@1": "val/gsm8k/mean_at_1"}
    assert set(run.data.metrics) == set(names.values())  # nan / inf / text dropped
    for logged, stored in names.items():
        assert _mlflow_history(client, run_id, stored) == {s: m[logged] for s, m in steps.items()}
    params = run.data.params
    assert params["actor.optim.lr"] == "0.001"
    assert params["actor.optim.betas"] == "[0.9, 0.99]"
    assert params["trainer.experiment_name"] == "exp"
    assert params["seed"] == "None"
    assert params["data.path"] == "x" * 497 + "..."
    assert params["trainer.logger"] == str(CONFIG["trainer"]["logger"])


def test_mlflow_respects_tracking_uri(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    run_dir = tmp_path / "run"
    _log_run("mlflow", run_dir, _steps(1, 2), config=None)
    assert not (run_dir / "mlruns").exists()
    run_id = (run_dir / MLFLOW_ID_FILE).read_text().strip()
    assert _mlflow_history(_mlflow_client(store.as_uri()), run_id, "critic/score/mean") == {1: 0.1, 2: 0.2}


def test_mlflow_resume_continues_the_same_run(tmp_path, caplog):
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    _log_run("mlflow", run_dir, _steps(1, 2))
    run_id = (run_dir / MLFLOW_ID_FILE).read_text().strip()

    changed = {**CONFIG, "actor": {**CONFIG["actor"], "ppo_epochs": 3}, "extra": 7}
    _log_run("mlflow", run_dir, _steps(3, 4), config=changed, resume=True)

    assert (run_dir / MLFLOW_ID_FILE).read_text().strip() == run_id
    client = _mlflow_client((run_dir / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert _mlflow_history(client, run_id, "val/gsm8k/mean_at_1") == {s: 0.25 * s for s in range(1, 5)}
    assert run.data.params["actor.ppo_epochs"] == "2"  # MLflow params cannot change
    assert run.data.params["extra"] == "7"
    assert "kept as they were: actor.ppo_epochs" in caplog.text  # a warning through polyrl's logger

    # a fresh run in the same directory is a new MLflow run
    Tracker(["mlflow"], run_dir, project="proj", experiment="exp").close()
    assert (run_dir / MLFLOW_ID_FILE).read_text().strip() != run_id


def test_mlflow_sanitises_metric_names(tmp_path):
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    tracker = Tracker(["mlflow"], run_dir, project="proj", experiment="exp",
                      config={"a@b": {"c(d)": 1}, "weird key=": "v"})
    names = {"val/x/pass@4": "val/x/pass_at_4", "a(b)+c": "a_b__c", "a//b/": "a/b", "../up": "__/up",
             "./x/./y": "x/y", "c:d": "c_d", "ok-name_1.2 x": "ok-name_1.2 x", "é": "_", "k" * 300: "k" * 250}
    tracker.log({k: float(i) for i, k in enumerate(names)}, step=7)
    tracker.close()
    client = _mlflow_client((run_dir / "mlruns").as_uri())
    run = client.get_run((run_dir / MLFLOW_ID_FILE).read_text().strip())
    assert run.data.metrics == {stored: float(i) for i, stored in enumerate(names.values())}
    assert run.data.params == {"a_at_b.c_d_": "1", "weird key_": "v"}


def test_mlflow_marks_a_failed_run(tmp_path):
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    tracker = Tracker(["mlflow"], run_dir, project="proj", experiment="exp")
    with pytest.raises(RuntimeError, match="boom"):
        try:
            raise RuntimeError("boom")
        finally:
            tracker.close()
    client = _mlflow_client((run_dir / "mlruns").as_uri())
    assert client.get_run((run_dir / MLFLOW_ID_FILE).read_text().strip()).info.status == "FAILED"


def test_all_backends_together_and_jsonl(tmp_path, wandb_runs):
    for mod in ("tensorboard", "mlflow"):
        pytest.importorskip(mod)
    from polyrl.tracking import read_metrics

    run_dir = tmp_path / "run"
    tracker = Tracker(["console", "jsonl", "tensorboard", "wandb", "mlflow"], run_dir, project="proj",
                      experiment="exp", config=CONFIG)
    steps = _steps(1, 2)
    _log(tracker, steps)
    tracker.close()
    assert [{k: v for k, v in row.items() if k not in ("step", "time")} for row in read_metrics(run_dir)] == \
        list(steps.values())
    assert _tb_scalars(run_dir / "tensorboard")["actor/pg_loss"] == _expected(steps)["actor/pg_loss"]
    [wandb_run] = wandb_runs
    assert wandb_run["history"] == steps and wandb_run["exit_code"] == 0
    client = _mlflow_client((run_dir / "mlruns").as_uri())
    assert _mlflow_history(client, (run_dir / MLFLOW_ID_FILE).read_text().strip(), "actor/pg_loss") == \
        {1: -0.25, 2: -0.2}
