"""Where a training step's samples come from: ``trainer.async_mode`` (docs/async.md).

- ``sync``: generate the step's prompts, then train (the rollout waits for training and back).
- ``one_step_off_policy`` (split placement): generation of step k+1 is issued to the rollout group before
  step k trains, so the two overlap; the rollout's weights are at most one policy version behind.
- ``fully_async`` (split placement): a driver-side thread keeps every rollout worker generating chunks of
  prompt groups into a bounded queue; a step takes ``data.train_batch_size`` finished groups. A group
  more than ``trainer.async_max_staleness`` versions old is dropped and its prompt generated again; new
  weights are queued behind the chunk a worker is generating (``async_inflight=finish``), or that chunk's
  result is discarded and its prompts generated again on the new weights (``abort``).

Every sample has an id, ``<epoch>-<position in the epoch's order>/<sample index>``, and the version of the
policy that generated it. Each step appends the ids it trained on to ``RUN_DIR/samples.jsonl``; a
checkpoint stores the queue (finished groups with their tensors, prompts in flight or waiting) with the
data loader's position, so a resumed run trains every prompt once: none lost, none twice.

Off-policy samples are corrected with truncated importance weights ``min(pi_train / pi_rollout, cap)``
(``algorithm.rollout_correction``, TIS; ``trainer.async_tis_cap`` switches it on when unset), computed from
the rollout's log-probs and the actor's recomputed ones.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from polyrl import batch as batch_ops
from polyrl.checkpoint_io import load_tensors
from polyrl.controller.worker_group import CallHandle, WorkerGroup, wait_any
from polyrl.errors import ConfigError
from polyrl.trainer.step_rows import expand_to_rows, group_slices, pad_step_rows, step_row_divisor

log = logging.getLogger("polyrl")

MODES = ("sync", "one_step_off_policy", "fully_async")
_ALIASES = {"one_step_off": "one_step_off_policy", "async": "fully_async"}
SAMPLES_FILE = "samples.jsonl"
#: Seed offset per prompt position of a chunk that starts inside a batch (a prime: no collision with the
#: per-step seeds of runs shorter than it).
_CHUNK_SEED_STRIDE = 104_729
QUEUE_FILE = "async_queue.pt"


# ---------------------------------------------------------------------- config


def configure_async_mode(trainer: Any) -> str:
    """Check ``trainer.async_*`` against the run's placement and prepare the trainer for off-policy data.

    In the async modes the PPO ratio is taken against the policy being trained (its recomputed old log-probs,
    or with one update pass its own detached ones), not the one that generated, and token-level TIS on the
    policy gap is switched on when ``algorithm.rollout_correction.rollout_is`` is unset and ``trainer.async_tis_cap > 0``.
    Returns the mode's canonical name.
    """
    cfg = trainer.config
    t = cfg.trainer
    mode = _ALIASES.get(str(t.async_mode), str(t.async_mode))
    if mode not in MODES:
        raise ConfigError(f"trainer.async_mode={t.async_mode!r}: choose one of {', '.join(MODES)}")
    t.async_mode = mode
    if t.async_inflight not in ("finish", "abort"):
        raise ConfigError(f"trainer.async_inflight={t.async_inflight!r}: choose 'finish' or 'abort'")
    if t.async_max_staleness < 0:
        raise ConfigError(f"trainer.async_max_staleness={t.async_max_staleness}: give 0 or more policy versions")
    if mode == "sync":
        return mode
    placement = getattr(trainer, "placement", None)
    own_pool = placement is not None and placement.spelling != "local" and not placement.shares("actor", "rollout")
    if t.executor != "ray" or not own_pool:
        raise ConfigError(
            f"trainer.async_mode={mode} overlaps generation with training, so the rollout needs its own workers: "
            f"set trainer.executor=ray and trainer.placement=split, or place the rollout in a pool apart from the "
            f"actor's (now executor={t.executor}, placement={t.placement})")
    if cfg.rollout.tensor_parallel_size != 1:
        raise ConfigError(f"trainer.async_mode={mode} drives each rollout worker on its own; "
                          f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} is not supported there "
                          "yet: set it to 1 or use trainer.async_mode=sync")
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is None and not rc.bypass_mode and t.async_tis_cap > 0:
        rc.rollout_is = "token"
        rc.rollout_is_threshold = float(t.async_tis_cap)
        log.info("trainer.async_mode=%s: token-level TIS on the policy gap, cap %.3g "
                 "(trainer.async_tis_cap; algorithm.rollout_correction overrides)", mode, t.async_tis_cap)
    # with one update pass over one mini-batch (the on-policy shortcut) the TIS weights are computed inside the
    # update from its own detached log-probs; otherwise the old-log-prob pass gives them
    return mode


def make_rollout_source(trainer: Any) -> RolloutSource:
    """The sample source for ``trainer.async_mode``."""
    mode = trainer.config.trainer.async_mode
    if mode == "one_step_off_policy":
        return OneStepOffPolicySource(trainer)
    if mode == "fully_async":
        return StreamingSource(trainer)
    return RolloutSource(trainer)


# ---------------------------------------------------------------------- helpers


def sample_base(row: dict) -> str:
    """A prompt's id, ``<epoch>-<position>``: the loader's uid without its random suffix (stable on resume)."""
    uid = str(row["uid"])
    head, _, _ = uid.rpartition("-")
    return head or uid


def attach_sample_fields(batch: TensorDict, rows: list[dict], n: int, version: int) -> TensorDict:
    """The per-row fields the trainer reads (uid, data source, ground truth, extra info, the raw prompt), plus the sample
    ids and the policy version that generated them, on a batch generated for ``rows`` repeated ``n`` times."""
    samples = [row for row in rows for _ in range(n)]
    # a step-wise agent loop gives a sample several rows (polyrl.trainer.step_rows)
    samples, ids = expand_to_rows(batch, samples, [f"{sample_base(r)}/{j}" for r in rows for j in range(n)])
    batch_ops.set_non_tensor(batch, "uid", [s["uid"] for s in samples])
    batch_ops.set_non_tensor(batch, "data_source", [s.get("data_source", "") for s in samples])
    batch_ops.set_non_tensor(batch, "ground_truth", [(s.get("reward_model") or {}).get("ground_truth") for s in samples])
    batch_ops.set_non_tensor(batch, "extra_info", [s.get("extra_info") or {} for s in samples])
    batch_ops.set_non_tensor(batch, "raw_prompt", [json.dumps(s.get("prompt")) for s in samples])
    batch_ops.set_non_tensor(batch, "sample_id", ids)
    batch_ops.set_non_tensor(batch, "gen_version", [int(version)] * len(samples))
    return batch


def _submit_generate(group: WorkerGroup, rows: list[dict], n: int, sampling: Any) -> list[tuple[CallHandle, list[dict]]]:
    """``generate`` on each rollout rank for its share of ``rows`` (whole groups), without waiting; returns
    ``(handle, rows)`` per rank that got some."""
    size = group.world_size
    out = []
    for rank in range(size):
        part = rows[rank::size]
        if part:
            samples = [row for row in part for _ in range(n)]
            out.append((group.call_rank_async(rank, "generate", samples, sampling), part))
    return out


def _staleness_metrics(batch: TensorDict, policy_version: int) -> dict[str, float]:
    versions = np.array(batch_ops.non_tensor(batch, "gen_version", policy_version), dtype=float)
    stale = policy_version - versions
    return {"async/staleness_mean": float(stale.mean()), "async/staleness_max": float(stale.max()),
            "async/policy_version": float(policy_version)}


@dataclass
class Snapshot:
    """The sample source's state at one instant: the loader position, JSON state and tensors to write."""

    loader: dict[str, int]
    state: dict[str, Any] | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def write(self, path: str | Path) -> None:
        """Write the queue's tensors (if any) into checkpoint folder ``path``."""
        if self.tensors:
            torch.save(self.tensors, Path(path) / QUEUE_FILE)


def pending_prompts(state: dict[str, Any] | None) -> list[dict]:
    """The prompts a checkpoint's rollout-source state had drawn from the loader but not trained on, in the
    order they were drawn: ``one_step_off_policy``'s prefetched batch, ``fully_async``'s finished groups, the
    chunks in flight and the prompts waiting. A source of another mode generates them again."""
    if not state:
        return []
    rows = [g["row"] for g in state.get("groups") or []]
    return rows + list(state.get("rows") or []) + list(state.get("pending_rows") or [])


def _log_handover(state: dict[str, Any] | None, mode: str, count: int) -> None:
    if state and state.get("mode") not in (None, mode) and count:
        log.warning("the checkpoint is from trainer.async_mode=%s: the %d prompts it had queued are generated again "
                    "in %s before new ones", state.get("mode"), count, mode)


# ---------------------------------------------------------------------- sync


class RolloutSource:
    """``sync``: generate the step's prompts now, train, then sync weights (blocking)."""

    mode = "sync"

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.n = trainer.config.rollout.n
        #: prompts a checkpoint of another mode had queued or in flight: trained before new ones are drawn
        self._carry: deque[dict] = deque()

    def _rows(self) -> list[dict]:
        """The next batch's prompts: carried-over ones first, then the loader's (its rest is carried on)."""
        t = self.trainer
        if not self._carry:
            return t.next_rows()
        size = t.config.data.train_batch_size
        while len(self._carry) < size:
            self._carry.extend(t.next_rows())
        return [self._carry.popleft() for _ in range(size)]

    def start(self) -> None:
        """Called once the workers run and hold the starting (or resumed) weights."""
        self._truncate_samples_log()

    def next_batch(self, groups: int | None = None) -> TensorDict:
        """The next prompt groups with their samples (rows ``n`` per prompt). ``groups``: how many the step
        still needs (fewer in dynamic sampling's later rounds); a source that generates whole batches
        (``sync``, ``one_step_off_policy``) returns a batch's worth anyway."""
        return self.trainer.generate_batch(self._rows(), self.n, validate=False)

    def push_weights(self) -> None:
        """After the actor update: the rollout gets the new weights."""
        self.trainer.groups.sync_weights()

    def end_step(self, step: int, batch: TensorDict) -> dict[str, float]:
        """Record the step's sample ids (async modes) and return its staleness metrics."""
        return {}

    def snapshot(self) -> Snapshot:
        """The state a checkpoint stores."""
        if self._carry:
            return Snapshot(self.trainer.loader.state_dict(), {"mode": self.mode, "pending_rows": list(self._carry)})
        return Snapshot(self.trainer.loader.state_dict())

    def restore(self, path: str | Path, state: dict[str, Any] | None) -> None:
        """Continue from a checkpoint's :meth:`snapshot` (the loader is already restored). A checkpoint of
        another ``trainer.async_mode`` hands over the prompts it had queued or in flight (:func:`pending_prompts`):
        they are trained first, none lost, none twice."""
        self._carry.extend(pending_prompts(state))
        _log_handover(state, self.mode, len(self._carry))

    def stop(self) -> None:
        """Stop background work (the run ends or failed)."""

    # -- the sample log (async modes)
    def _samples_log(self) -> Path:
        return self.trainer.run_dir / SAMPLES_FILE

    def _truncate_samples_log(self) -> None:
        """Drop lines of steps after the current one (a killed run's, re-run after resume)."""
        path = self._samples_log()
        if self.mode == "sync" or not path.exists():
            return
        keep = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= self.trainer.global_step]
        path.write_text("".join(line + "\n" for line in keep))

    def _log_samples(self, step: int, batch: TensorDict) -> None:
        ids = batch_ops.non_tensor(batch, "sample_id", None)
        versions = batch_ops.non_tensor(batch, "gen_version", None)
        with self._samples_log().open("a") as f:
            f.write(json.dumps({"step": step, "sample_ids": ids, "gen_version": versions}) + "\n")


# ---------------------------------------------------------------------- one step off


class OneStepOffPolicySource(RolloutSource):
    """Generation of the next step's prompts runs on the rollout workers while this step trains."""

    mode = "one_step_off_policy"

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self._pending: list[tuple[CallHandle, list[dict]]] | None = None
        self._pending_rows: list[dict] | None = None
        self._pending_version = 0
        self.version = 0  # the policy version the rollout holds

    def start(self) -> None:
        super().start()
        self.version = self.trainer.global_step

    def _issue(self, rows: list[dict], ahead: int) -> None:
        t = self.trainer
        # the seed a sync run gives the step these prompts are trained in
        sampling = t.sampling_params().replace(seed=t.config.trainer.seed * 1_000_003 + t.global_step + ahead)
        self._pending = _submit_generate(t.groups.rollout, rows, self.n, sampling)
        self._pending_rows, self._pending_version = rows, self.version

    def next_batch(self, groups: int | None = None) -> TensorDict:
        if self._pending is None:  # first step (or first after resume): nothing prefetched
            self._issue(self._rows(), 0)
        refs, version = self._pending, self._pending_version
        parts = [(handle.result(), rows) for handle, rows in refs]
        rows = [r for _, part in parts for r in part]
        batch = batch_ops.concat([b for b, _ in parts]) if len(parts) > 1 else parts[0][0]
        self._pending = None
        # the next step's generation starts now, on the weights the rollout holds (this step's trains meanwhile)
        self._issue(self._rows(), 1)
        batch = attach_sample_fields(batch, rows, self.n, version)
        return pad_step_rows(batch, step_row_divisor(self.trainer.config, self.trainer.use_critic))

    def push_weights(self) -> None:
        super().push_weights()  # queued behind the prefetch on each rollout worker: it finishes on old weights
        self.version = self.trainer.global_step + 1

    def end_step(self, step: int, batch: TensorDict) -> dict[str, float]:
        self._log_samples(step, batch)
        return _staleness_metrics(batch, step - 1)

    def snapshot(self) -> Snapshot:
        # the prefetched prompts were drawn from the loader: a resumed run generates them again
        rows = (list(self._pending_rows or []) if self._pending is not None else []) + list(self._carry)
        return Snapshot(self.trainer.loader.state_dict(), {"mode": self.mode, "pending_rows": rows or None})

    def stop(self) -> None:
        for handle, _ in self._pending or []:  # the prefetch is not needed any more (its prompts are in a snapshot)
            handle.cancel()
        self._pending = None


# ---------------------------------------------------------------------- fully async


@dataclass
class _Group:
    """One prompt's ``n`` finished samples and the policy version that generated them."""

    row: dict
    batch: TensorDict
    version: int


@dataclass
class _Chunk:
    rows: list[dict]
    version: int
    worker: int
    aborted: bool = False


class StreamingSource(RolloutSource):
    """A thread keeps each rollout worker generating chunks of prompt groups into a bounded queue."""

    mode = "fully_async"

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        cfg = trainer.config
        t = cfg.trainer
        self.batch_groups = cfg.data.train_batch_size
        self.max_staleness = int(t.async_max_staleness)
        self.abort = t.async_inflight == "abort"
        self.capacity = t.async_queue_groups or self.batch_groups * max(1, self.max_staleness)
        placement = getattr(trainer, "placement", None)
        workers = max(1, placement.size_of("rollout") if placement is not None else t.rollout_workers)
        # a batch spread over the workers: a generation call costs about the same for fewer samples on a rollout
        # whose time goes into per-token steps (hf on CPU: half-batch chunks took twice as long per batch)
        self.chunk_groups = t.async_chunk_groups or max(1, self.batch_groups // workers)
        self.capacity = max(self.capacity, self.chunk_groups)
        self.cond = threading.Condition()
        self.ready: deque[_Group] = deque()
        self.todo: deque[dict] = deque()  # prompts to generate before drawing new ones from the loader
        self.inflight: dict[CallHandle, _Chunk] = {}
        self.version = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restored: list[_Group] = []
        self.dropped = 0
        self.aborted = 0
        self.chunks_done = 0

    # -- lifecycle
    def start(self) -> None:
        super().start()
        self.version = self.trainer.global_step
        self.group: WorkerGroup = self.trainer.groups.rollout
        self.ready.extend(self._restored)
        self._restored = []
        self._thread = threading.Thread(target=self._produce, name="polyrl-rollout-stream", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        with self.cond:  # chunks not started yet are dropped (their prompts are in any snapshot taken before)
            for handle in self.inflight:
                handle.cancel()
        groups = self.trainer.groups
        if groups is not None:  # the last weights reach the rollout before the workers stop (bounded wait)
            try:
                groups.weight_sync.wait(timeout=30)
            except Exception:  # the run is ending; a failed last load must not hide why
                log.warning("the last weight load of the rollout failed", exc_info=True)

    # -- the producer thread
    def _take_rows(self, count: int) -> list[dict]:
        rows = []
        while len(rows) < count:
            if not self.todo:
                self.todo.extend(self.trainer.next_rows())
            rows.append(self.todo.popleft())
        return rows

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                with self.cond:
                    busy = {c.worker for c in self.inflight.values()}
                    queued = len(self.ready) + sum(len(c.rows) for c in self.inflight.values())
                    for i in range(self.group.world_size):
                        if i in busy or queued + self.chunk_groups > self.capacity:
                            continue
                        rows = self._take_rows(self.chunk_groups)
                        sampling = self.trainer.sampling_params().replace(seed=self._seed(rows))
                        samples = [row for row in rows for _ in range(self.n)]
                        handle = self.group.call_rank_async(i, "generate", samples, sampling)
                        self.inflight[handle] = _Chunk(rows, self.version, i)
                        queued += len(rows)
                    handles = list(self.inflight)
                if not handles:
                    with self.cond:
                        self.cond.wait(timeout=0.05)
                    continue
                for handle in wait_any(handles, timeout=0.05):
                    batch = handle.result()
                    with self.cond:
                        chunk = self.inflight.pop(handle)
                        self.chunks_done += 1
                        if chunk.aborted:  # generated on weights replaced meanwhile: generate again
                            self.aborted += len(chunk.rows)
                            self.todo.extendleft(reversed(chunk.rows))
                        else:
                            attach_sample_fields(batch, chunk.rows, self.n, chunk.version)
                            # a group is its n samples' rows: n, or one per step of a step-wise loop's episodes
                            parts = group_slices(batch, len(chunk.rows), self.n)
                            for row, part in zip(chunk.rows, parts):
                                self.ready.append(_Group(row, batch[part], chunk.version))
                        self.cond.notify_all()
        except BaseException as exc:  # handed to the trainer, which raises it in next_batch
            log.exception("the rollout stream failed")
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _seed(self, rows: list[dict]) -> int:
        """The sampling seed of a chunk starting at ``rows[0]``: for a chunk that starts a batch, the seed a
        synchronous run gives the step that batch is trained in (as ``one_step_off_policy`` does), so the two
        modes draw the same random numbers for the same prompts (a paired comparison: their first step samples
        the same responses); a chunk starting inside a batch adds an offset per position. Derived from the
        prompt's id, so a resumed run samples what an uninterrupted one would."""
        t = self.trainer
        base = t.config.trainer.seed * 1_000_003
        head = sample_base(rows[0])
        epoch, _, position = head.partition("-")
        try:
            step, offset = divmod(int(position), self.batch_groups)
            step += int(epoch) * len(t.loader)
        except (TypeError, ValueError):  # an id of another form: a seed of its own
            return (base + zlib.crc32(head.encode())) % (2**31)
        return (base + step + _CHUNK_SEED_STRIDE * offset) % (2**31)

    # -- the trainer side
    def next_batch(self, groups: int | None = None) -> TensorDict:
        policy = self.trainer.global_step  # the version this step trains
        want = max(1, min(groups or self.batch_groups, self.batch_groups))
        taken: list[_Group] = []
        deadline = time.monotonic() + 3600
        with self.cond:
            while len(taken) < want:
                if self.error is not None:
                    raise RuntimeError(f"trainer.async_mode=fully_async: the rollout stream failed: {self.error!r}") \
                        from self.error
                while self.ready and len(taken) < want:
                    group = self.ready.popleft()
                    if policy - group.version > self.max_staleness:  # too old: its prompt is generated again
                        self.dropped += 1
                        self.todo.appendleft(group.row)
                        continue
                    taken.append(group)
                if len(taken) < want:
                    if time.monotonic() > deadline or (self._thread is not None and not self._thread.is_alive()
                                                       and self.error is None):
                        raise RuntimeError("trainer.async_mode=fully_async: no samples arrive from the rollout workers")
                    self.cond.notify_all()
                    self.cond.wait(timeout=0.5)
            self.cond.notify_all()  # room in the queue: the producer submits now, not at its next poll
        batch = batch_ops.concat([g.batch for g in taken])
        if "episode_end" in batch.keys():  # step rows (a step-wise agent loop): whole mini-batches, as in the others
            batch = pad_step_rows(batch, step_row_divisor(self.trainer.config, self.trainer.use_critic))
        return batch

    def push_weights(self) -> None:
        """Queue the actor's new weights on every rollout worker behind what it generates now; the trainer
        does not wait for the load (:meth:`polyrl.trainer.weight_sync.CollectiveWeightSync.stage` / ``push``:
        with ``trainer.weight_transfer=collective`` the actor gathers a packed copy and broadcasts it from a
        background thread, which the rollout leaders join once their generation in flight is done;
        ``object_store``: one gather, one shared copy, one load per worker)."""
        t = self.trainer
        sync = t.groups.weight_sync
        sync.stage()  # the actor's gather; the previous push is through first (one snapshot at a time)
        with self.cond:  # the producer tags what it submits from now on with the new version
            sync.push()
            self.version = t.global_step + 1
            if self.abort:
                for chunk in self.inflight.values():
                    chunk.aborted = True
            self.cond.notify_all()

    def end_step(self, step: int, batch: TensorDict) -> dict[str, float]:
        self._log_samples(step, batch)
        with self.cond:
            out = {"async/queue_groups": float(len(self.ready)), "async/dropped_stale_groups": float(self.dropped),
                   "async/aborted_groups": float(self.aborted)}
        return {**_staleness_metrics(batch, step - 1), **out}

    # -- checkpoints
    def snapshot(self) -> Snapshot:
        with self.cond:
            groups = list(self.ready)
            # in flight or waiting: their prompts are generated again after a resume (in this order)
            rows = [r for c in self.inflight.values() for r in c.rows] + list(self.todo)
            loader = self.trainer.loader.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        meta = []
        for i, g in enumerate(groups):
            fields = {}
            for key in g.batch.keys():
                value = g.batch.get(key)
                if isinstance(value, torch.Tensor):
                    tensors[f"{i}/{key}"] = value
                else:
                    fields[key] = batch_ops.non_tensor(g.batch, key)
            meta.append({"row": g.row, "version": g.version, "non_tensor": fields})
        state = {"mode": self.mode, "groups": meta, "rows": rows, "dropped": self.dropped, "aborted": self.aborted}
        return Snapshot(loader, state, tensors)

    def restore(self, path: str | Path, state: dict[str, Any] | None) -> None:
        if not state:
            return
        if state.get("mode") != self.mode:  # another mode's queue: its prompts are generated again, first
            self.todo.extend(pending_prompts(state))
            _log_handover(state, self.mode, len(self.todo))
            return
        file = Path(path) / QUEUE_FILE
        tensors = load_tensors(file) if file.exists() else {}
        groups = []
        for i, g in enumerate(state.get("groups") or []):
            if f"{i}/responses" not in tensors:
                self.todo.append(g["row"])
                continue
            fields = {k[len(f"{i}/"):]: v for k, v in tensors.items() if k.startswith(f"{i}/")}
            batch = batch_ops.make_batch(fields, g["non_tensor"])
            groups.append(_Group(g["row"], batch, int(g["version"])))
        self._restored = groups
        self.todo.extend(state.get("rows") or [])
        self.dropped, self.aborted = int(state.get("dropped", 0)), int(state.get("aborted", 0))
