"""The contracts every polyrl component implements.

These are :class:`typing.Protocol` classes: a plugin satisfies one by having the
methods, not by inheriting. They are written for every backend polyrl targets:
FSDP and Megatron engines, HF / vLLM / SGLang rollouts, flow-matching diffusion
models, and CUDA / NPU / ROCm / CPU platforms. ``polyrl.testing`` holds a
conformance suite per protocol that checks the behaviour promised here.

Tensor conventions (verl's names, shared by engines, losses and the trainer):

* A **batch** is a :class:`tensordict.TensorDict` with ``batch_size=[B]``.
  Sequences are ``prompt + response``; prompts are left-padded to ``P`` tokens,
  responses right-padded to ``R`` tokens, so ``input_ids`` is ``[B, P + R]``.
* ``input_ids``, ``attention_mask``, ``position_ids``: ``[B, P + R]``.
* ``responses``: ``[B, R]`` token ids; ``response_mask``: ``[B, R]``, 1 where a
  response token is trained on (tool / environment tokens are 0).
* Per-token quantities over the response: ``old_log_probs``, ``ref_log_prob``,
  ``rollout_log_probs``, ``values``, ``token_level_scores``,
  ``token_level_rewards``, ``advantages``, ``returns``: ``[B, R]`` float.
* Non-tensor fields (``uid``, ``data_source``, ``ground_truth``, ``extra_info``)
  ride along as :class:`tensordict.NonTensorStack`; see :mod:`polyrl.batch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # keep `import polyrl.protocols` free of torch for the CLI's start-up
    import torch
    from tensordict import TensorDict

#: Roles whose engines only infer: engines build no optimizer for them and never train them (an ``Engine``
#: factory receives the role's name). Also :data:`polyrl.trainer.roles.INFERENCE_ROLES`.
INFERENCE_ROLES: frozenset[str] = frozenset({"ref", "reward_model", "teacher"})

__all__ = [
    "INFERENCE_ROLES",
    "AdvantageEstimator",
    "AgentLoop",
    "AgentLoopOutput",
    "Engine",
    "Environment",
    "ForwardProducts",
    "GenerationClient",
    "GenerationRequest",
    "GenerationResult",
    "LossFn",
    "LossScale",
    "Platform",
    "PolicyLoss",
    "RewardFunction",
    "RewardManager",
    "RewardOutput",
    "Rollout",
    "RolloutCapabilities",
    "SamplingParams",
    "Tool",
    "ToolResult",
]


# --------------------------------------------------------------------------- generation types


@dataclass
class SamplingParams:
    """How a rollout samples. Field names follow vLLM / verl.

    ``top_k=-1`` and ``top_p=1.0`` disable those filters; ``temperature=0`` is
    greedy decoding. ``n`` samples are drawn per request. ``stop_token_ids``
    end a sample in addition to the tokenizer's EOS (``ignore_eos`` disables EOS).
    ``logprobs`` asks for the log-probability of each sampled token under the
    rollout's (temperature-scaled) distribution.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = True
    seed: int | None = None

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (e.g. ``n=1`` for validation)."""
        return dataclasses.replace(self, **changes)


@dataclass
class GenerationRequest:
    """One prompt to complete, as token ids.

    ``multi_modal`` carries backend-specific inputs (images for a VLM, latents or
    prompt embeddings for a diffusion rollout); text rollouts ignore it.
    """

    prompt_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    multi_modal: dict[str, Any] | None = None


@dataclass
class GenerationResult:
    """One sampled completion.

    ``log_probs[i]`` is the log-probability of ``response_ids[i]`` (empty when
    the request did not ask for log-probs). ``finish_reason`` is ``"stop"``
    (EOS or a stop token, which is included in ``response_ids``), ``"length"``
    (``max_new_tokens`` reached) or ``"abort"``. ``sample_index`` is which of
    the request's ``n`` samples this is. ``extra`` carries backend outputs
    (for diffusion: the SDE trajectory and per-step log-probs).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]
    finish_reason: Literal["stop", "length", "abort"] = "stop"
    request_id: str | None = None
    sample_index: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutCapabilities:
    """What a rollout can do, so the trainer can plan around it.

    * ``sleep``: ``sleep()/wake_up()`` really release accelerator memory.
    * ``async_generate``: ``agenerate`` serves concurrent requests natively
      (otherwise the trainer batches concurrent calls for it).
    * ``log_probs``: returns per-token log-probs.
    * ``lora_adapter``: ``update_weights`` accepts an adapter alone.
    * ``tensor_parallel``: shards one model over several devices.
    * ``weight_formats``: what ``update_weights`` accepts, ``"hf"`` names at least.
    """

    sleep: bool = False
    async_generate: bool = False
    log_probs: bool = True
    lora_adapter: bool = False
    tensor_parallel: bool = False
    weight_formats: tuple[str, ...] = ("hf",)


@runtime_checkable
class GenerationClient(Protocol):
    """What an agent loop calls to generate: a rollout, or the trainer's batching front of one."""

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        """Return ``request.sampling_params.n`` results for ``request``."""
        ...


@runtime_checkable
class Rollout(GenerationClient, Protocol):
    """The generation side: turns prompts (token ids) into sampled responses.

    Built by the trainer as ``factory(config, model_path=..., tokenizer=..., platform=...)``
    inside the worker process that owns the device(s): with ``tensor_parallel_size > 1``
    in the leader process of a replica, which owns the devices of ``tp`` workers (see
    :mod:`polyrl.rollout.replicas`). Implementations: the
    built-in ``hf`` (transformers ``generate``), ``vllm``, ``sglang``, and the
    diffusion rollout (where ``prompt_ids`` are text-encoder ids and results
    carry latents in ``extra``).
    """

    capabilities: RolloutCapabilities
    #: The longest prompt + response this rollout takes, in tokens (``None``: no limit, or not a token model).
    #: ``generate`` refuses longer requests; the trainer's batching client merges concurrent agent-loop
    #: requests only while every merged one still fits.
    max_model_len: int | None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Sample every request, as a batch.

        Returns ``sum(r.sampling_params.n for r in requests)`` results, grouped by
        request in input order (request ``i``'s samples are contiguous, in
        ``sample_index`` order). Raises ``ValueError`` naming the request when a
        prompt plus ``max_new_tokens`` exceeds the model length.
        """
        ...

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        """Sample one request from a coroutine; many may be in flight at once.

        Rollouts without a native async engine may run ``generate`` in a thread.
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights, given as HF parameter names and full tensors.

        Called with the chunks of an engine's ``weights_for_rollout()``; a call may
        carry any subset of the parameters. Must invalidate caches that depend on
        the weights (prefix / KV caches). Raises ``KeyError`` naming a tensor that
        matches no parameter and ``ValueError`` naming a shape mismatch; on error
        the rollout keeps its previous weights usable.
        """
        ...

    def sleep(self, level: int = 1) -> None:
        """Release accelerator memory (level 1: KV cache; level 2: weights too).

        A no-op where meaningless (CPU); ``capabilities.sleep`` says which.
        """
        ...

    def wake_up(self) -> None:
        """Retake what ``sleep`` released. After level 2 the weights must be re-sent."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and the processes it started; the rollout is unusable afterwards.

        The trainer calls it once, when a worker is torn down (end of a run, or a failed start).
        A no-op where there is nothing to stop.
        """
        ...


# --------------------------------------------------------------------------- training engines


@dataclass(frozen=True)
class LossScale:
    """Global sizes of the mini-batch one ``train_batch`` call steps on.

    An engine splits its shard into micro-batches and sums their losses; to make
    the result independent of the split (and of the data-parallel size) the loss
    of a micro-batch is normalised by these *global* counts, as verl's ``agg_loss``
    does: ``dp_size`` ranks, ``batch_num_tokens`` response tokens (mask sum) and
    ``global_batch_size`` sequences over all ranks.
    """

    dp_size: int = 1
    batch_num_tokens: int | None = None
    global_batch_size: int | None = None


@dataclass(frozen=True)
class ForwardProducts:
    """Extra outputs of an engine's log-prob forward pass, beyond ``log_probs`` and ``entropy``.

    Each is computed from the same logits (at the pass's ``temperature``) in the same chunks over the
    vocabulary, so no ``[tokens x vocab]`` tensor is kept. Asked of ``Engine.infer_batch`` (they come back
    as fields of its result) or ``Engine.train_batch`` (they reach the loss in ``model_output``, with
    gradients). All are ``[B, R]`` or ``[B, R, k]`` over the response tokens, zero where
    ``response_mask`` is 0 (see docs/plugins/forward_products.md):

    - ``sum_pi_squared``: ``sum_pi_squared [B, R]``, the sum over the vocabulary of ``p_v^2`` at each token
      (the optimal-token-baseline estimators' path-variance proxy);
    - ``top_k`` (> 0): ``top_k_log_probs [B, R, k]`` and ``top_k_ids [B, R, k]`` (int64), the ``k`` most
      likely tokens at each position, most likely first (a teacher's top-k for distillation);
    - ``gather_ids``: the name of a batch field ``[B, R, k]`` of token ids; ``gathered_log_probs [B, R, k]``
      holds their log-probs (a student's log-probs at its teacher's top-k ids).

    An engine lists the products it computes in its class attribute ``forward_products`` (names of these
    fields); the trainer checks a run's needs against it before any worker starts.
    """

    sum_pi_squared: bool = False
    top_k: int = 0
    gather_ids: str | None = None

    def requested(self) -> tuple[str, ...]:
        """The names of the products asked for (``sum_pi_squared``, ``top_k``, ``gather_ids``)."""
        return tuple(name for name, on in (("sum_pi_squared", self.sum_pi_squared), ("top_k", self.top_k > 0),
                                           ("gather_ids", bool(self.gather_ids))) if on)

    def output_keys(self) -> tuple[str, ...]:
        """The fields these products add to a forward pass's outputs."""
        keys = {"sum_pi_squared": ("sum_pi_squared",), "top_k": ("top_k_log_probs", "top_k_ids"),
                "gather_ids": ("gathered_log_probs",)}
        return tuple(k for name in self.requested() for k in keys[name])

    def __bool__(self) -> bool:
        return bool(self.requested())


class LossFn(Protocol):
    """A loss the caller hands to ``Engine.train_batch``.

    ``model_output`` holds what the forward pass produced for ``micro_batch``:
    ``log_probs`` and ``entropy`` ``[b, R]`` for a causal LM, ``values`` ``[b, R]``
    for a value model. Returns the micro-batch's share of the mini-batch loss
    (already normalised with ``scale``) and float metrics, each the micro-batch's
    own value (a loss term as its own token mean, not its share): the engines
    average the metrics of a step's micro-batches.
    """

    def __call__(
        self, model_output: Mapping[str, torch.Tensor], micro_batch: TensorDict, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


@runtime_checkable
class Engine(Protocol):
    """A model being trained or evaluated by one role (actor, critic, reference).

    Built by the trainer inside each worker process, after the platform set the
    device and ``torch.distributed`` is initialised, as
    ``factory(config, role=..., model_type=..., platform=...)`` with
    ``model_type`` one of ``"causal_lm"``, ``"value"`` (backbone + scalar head)
    or a plugin's own (``"diffusion"``). Every method is called on every rank of
    the role's worker group (SPMD); batches arrive already split by data-parallel
    rank. FSDP, Megatron and the diffusion engine all implement this.
    """

    role: str

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (batches are split by it)."""
        ...

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards of the batch."""
        ...

    # Optional (read with ``getattr(engine, "collects_output", True)``): whether the driver keeps this rank's
    # results. Exactly one rank of each data-parallel group does (Megatron: tensor-parallel rank 0 on the last
    # pipeline stage); the other ranks of the group get the same shard and their results are dropped.
    #
    # Optional on the engine's factory (a static or class method): ``data_parallel_size(role_config,
    # world_size) -> int``, the data-parallel size a group of ``world_size`` ranks will have. The trainer checks
    # batch sizes against it before any worker starts; a factory without it is pure data-parallel. A factory
    # whose method also takes ``role=`` gets the role's section name (``actor``, ``critic``, ``ref``) for its errors.
    #
    # Optional (read with ``getattr(engine_or_factory, "forward_products", ())``): the extra forward products
    # (:class:`ForwardProducts` field names: ``sum_pi_squared``, ``top_k``, ``gather_ids``) the engine computes.
    # An engine that lists any takes ``products: ForwardProducts | None = None`` as a keyword of both
    # ``infer_batch`` and ``train_batch``; the trainer passes it only when a run asks for a product, after
    # checking, before any worker starts, that the role's engine lists it.

    def train_batch(self, batch: TensorDict, loss_fn: LossFn, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on this rank's shard of a mini-batch.

        Log-probabilities in the forward pass are taken at ``temperature`` (the
        rollout's, so that training and ``infer_batch`` see the same distribution).
        Splits ``batch`` into micro-batches (fixed size or by token budget),
        runs forward, ``loss_fn``, backward for each, then clips the global
        gradient norm, steps the optimizer and the LR schedule. Returns metrics
        averaged over micro-batches plus ``grad_norm`` and ``lr``. Raises
        ``KeyError`` naming a field the forward pass needs and ``batch`` lacks.
        A non-finite gradient norm skips the step and reports it.
        """
        ...

    def infer_batch(
        self, batch: TensorDict, *, temperature: float = 1.0, compute_entropy: bool = False,
        disable_adapter: bool = False,
    ) -> TensorDict:
        """Forward without gradients.

        Returns a TensorDict of ``batch``'s size with ``log_probs`` (log-probability
        of each response token at ``temperature``) and, when asked, ``entropy``;
        a value model returns ``values``. All ``[B, R]``, zero where
        ``response_mask`` is 0. ``disable_adapter=True`` computes with a LoRA
        adapter switched off (the reference policy of a LoRA actor).
        """
        ...

    def weights_for_rollout(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield the full weights in HF names, in chunks of about ``bucket_bytes``.

        Every rank must iterate (gathers are collective); the tensors are complete
        (unsharded) on every rank. Never materialises the whole model at once.
        With LoRA, yields merged weights unless configured to send the adapter.
        """
        ...

    def save_checkpoint(self, path: str) -> None:
        """Write a resumable checkpoint (model, optimizer, scheduler, RNG, step) to ``path``.

        Collective. Atomic: a crash mid-save leaves any previous checkpoint whole.
        """
        ...

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote. Raises ``ValueError`` naming the
        mismatch when the checkpoint is of another model or world size."""
        ...

    def export_hf(self, path: str) -> None:
        """Write a folder that ``transformers`` ``from_pretrained`` loads (safetensors)."""
        ...

    def offload(self) -> None:
        """Move parameters / optimizer state off the accelerator (to make room for a rollout)."""
        ...

    def onload(self) -> None:
        """Undo ``offload``."""
        ...


# --------------------------------------------------------------------------- rewards


class RewardFunction(Protocol):
    """verl's ``compute_score``: score one decoded response.

    Returns a float or a dict with a ``"score"`` key (other keys become metrics,
    e.g. ``"acc"``). May raise: the reward manager then gives the configured
    fallback score, counts the failure, and shows the traceback once.
    """

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> float | dict[str, Any]: ...


@dataclass
class RewardOutput:
    """What a reward manager returns for a batch of ``B`` finished samples.

    ``token_level_scores`` is ``[B, R]`` (usually the score on the last response
    token); ``extra`` holds per-sample lists (``acc``, ``score``...) for metrics
    and validation; ``metrics`` holds batch-level floats (e.g. failure counts).
    """

    token_level_scores: torch.Tensor
    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class RewardManager(Protocol):
    """Turns a batch of finished samples into token-level scores.

    Built as ``factory(tokenizer=..., compute_score=..., config=...)``. The batch
    has ``responses``, ``response_mask`` and the non-tensor fields
    ``data_source``, ``ground_truth``, ``extra_info``. Built-ins: ``naive``
    (one call per sample), ``batch`` (one call for all), ``dapo`` (overlong penalty).
    """

    def __call__(self, batch: TensorDict) -> RewardOutput:
        """Score ``batch``. Never raises for a failing reward function (see RewardFunction)."""
        ...


# --------------------------------------------------------------------------- agent loops and tools


@dataclass
class AgentLoopOutput:
    """One finished trajectory.

    ``response_ids`` interleaves model tokens with tool / environment tokens;
    ``response_mask`` is 1 on model tokens only, so those are the ones trained.
    ``log_probs`` has one entry per response token (0.0 for masked tokens).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    log_probs: list[float] = field(default_factory=list)
    num_turns: int = 1
    finish_reason: str = "stop"
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class AgentLoop(Protocol):
    """Drives generation for one sample: single-turn, multi-turn with tools, ...

    Built as ``factory(tokenizer=..., config=..., tools=...)`` once per worker; a factory that
    also takes ``max_prompt_length`` gets ``data.max_prompt_length`` (to check a prompt it re-renders).
    ``sample`` is a dataset row (``prompt`` messages, ``prompt_ids``,
    ``extra_info``...). ``client.agenerate`` samples from the current policy.
    """

    async def run(
        self, sample: Mapping[str, Any], sampling_params: SamplingParams, client: GenerationClient
    ) -> AgentLoopOutput | list[AgentLoopOutput]:
        """Return one trajectory for ``sample`` (``sampling_params.n`` is 1 here).

        A loop that trains each step of a trajectory as its own sample (``stepwise``) returns a non-empty list,
        one output per step, in order: each becomes a batch row carrying the sample's ``uid`` and row fields, and
        an ``extra["step_index"]`` (0 on a trajectory's first row; set by the runner when the loop did not).
        """
        ...


@dataclass
class ToolResult:
    """What a tool returns to the conversation; ``reward`` feeds step rewards."""

    text: str
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Tool(Protocol):
    """A function an agent loop may call, with an OpenAI-style JSON schema."""

    name: str
    schema: dict[str, Any]

    async def execute(self, arguments: dict[str, Any], sample: Mapping[str, Any]) -> ToolResult:
        """Run the tool; raise ``ValueError`` for bad arguments (shown to the model)."""
        ...


# --------------------------------------------------------------------------- environments


@runtime_checkable
class Environment(Protocol):
    """A text environment a step-wise agent loop plays, one instance per trajectory (never shared).

    Built by the factory registered through ``register_environments`` as ``factory(config)`` (``config`` is the
    row's ``extra_info.env_kwargs`` mapping). Either method may be ``async def``: the loop awaits a coroutine and runs
    a plain method in a worker thread, under a deadline either way, so a slow environment never blocks the other
    trajectories. Observations are text the history policy puts into the next prompt.
    """

    def reset(self, seed: int, row: Mapping[str, Any]) -> str:
        """Start an episode from the state ``seed`` determines (the same seed: the same initial state; every
        sample of one prompt row gets the row's seed) and return the first observation. ``row`` is the dataset
        row (``extra_info`` and all)."""
        ...

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply ``action`` (the text the loop parsed from the model's turn) and return ``(observation, reward,
        done, info)``. ``info`` may hold ``success`` (bool, counted in ``env/success_rate``). Raise ``ValueError``
        for an action the environment cannot take: the loop ends the episode and counts it as malformed.

        GiGPO groups the steps taken from identical *anchor* states: by default a state's key is the observation
        text; an environment whose text does not identify its state may add a method ``state_key() -> Hashable``
        (called after ``reset`` and after each ``step``)."""
        ...


# --------------------------------------------------------------------------- algorithms


class AdvantageEstimator(Protocol):
    """verl's advantage estimator signature.

    ``token_level_rewards`` and ``response_mask`` are ``[B, R]``; ``index`` is the
    group id of each sample (prompt uid; samples of one prompt share it).
    Estimators that need more (``values`` for GAE, ``reward_baselines`` for ReMax,
    ``old_log_probs``/``sum_pi_squared`` for the optimal-token-baseline ones,
    ``non_tensor_batch`` for GDPO) name them in their signature; the trainer passes
    the batch fields a signature names. Returns ``(advantages, returns)``, both
    ``[B, R]`` and zero where ``response_mask`` is 0; whatever padding holds (NaN
    included) does not change them. Raises ``ValueError`` naming the argument for
    mismatched shapes or non-finite rewards on response tokens.
    """

    def __call__(
        self,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: Any = None,
        config: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class PolicyLoss(Protocol):
    """verl's policy loss signature, plus the two keywords polyrl's trainer passes.

    The trainer calls ``fn(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode, config, rollout_log_probs=..., loss_scale=..., rollout_is_weights=...)``
    for each micro-batch. ``config`` carries verl's actor fields (``clip_ratio``,
    ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ``policy_loss.*``) and is read
    by attribute, by ``.get(key, default)``, or as a mapping; it also holds verl's
    ``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``). The keywords, each ``None`` when it does not apply:

    - ``rollout_log_probs``: the rollout's log-probs ``[B, R]``, for the legacy ``tis_imp_ratio_cap``;
    - ``loss_scale`` (:class:`LossScale`): normalise by the mini-batch's global counts (see ``agg_loss``),
      so micro-batches and data-parallel ranks add up to the whole mini-batch's loss;
    - ``rollout_is_weights``: rollout-correction importance weights ``[B, R]`` (multiply the per-token
      loss; detached).

    A loss written for verl declares only some of them (verl 0.5: ``rollout_log_probs``; verl main:
    ``rollout_is_weights``): :func:`polyrl.algorithms.get_policy_loss_fn` adapts it once, at look-up, to
    this signature, passing it only what it declares (it then reads the global counts from
    ``config.global_batch_info``).

    Returns ``(loss, metrics)`` with a scalar loss and float metrics (``pg_clipfrac``,
    ``ppo_kl``...; bare names get an ``actor/`` prefix, names with a ``/`` are kept).
    """

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_log_probs: torch.Tensor | None = None,
        *,
        loss_scale: LossScale | None = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...


# --------------------------------------------------------------------------- platforms


class Platform(Protocol):
    """One kind of device: CPU, CUDA, Ascend NPU, ROCm...

    The trainer asks the platform, never ``torch.cuda`` directly, so one plugin
    brings a new accelerator to every engine and rollout. Constructing a platform
    is cheap and imports nothing heavy; the device extension (``torch_npu``...)
    is imported by :meth:`is_available` and the device calls.
    """

    name: str
    device_type: str  # torch device type: "cpu", "cuda", "npu"
    dist_backend: str  # torch.distributed backend for training: "gloo", "nccl", "hccl"
    weight_sync_backend: str  # collective backend between actor and rollout processes (same values)
    visible_devices_env: str | None  # e.g. "CUDA_VISIBLE_DEVICES"; None for CPU
    ray_resource: str | None  # Ray resource per worker: "GPU", "NPU"; None for CPU

    def is_available(self) -> bool:
        """Whether this machine has the device and its torch extension imports. Never raises: a platform
        that cannot tell answers False (and says why in :meth:`unavailable_reason`)."""
        ...

    def unavailable_reason(self) -> str:
        """Why :meth:`is_available` is False, in one line with what to do (``""`` when available): shown in
        the error of a run that names this platform and in ``platform.json``'s probes."""
        ...

    def device_count(self) -> int:
        """Number of devices visible to this process."""
        ...

    def set_device(self, local_rank: int) -> None:
        """Bind this process to device ``local_rank``: an index among the devices visible to this
        process on its node (never the global rank)."""
        ...

    def current_device(self) -> torch.device:
        """The device this process computes on."""
        ...

    def synchronize(self) -> None:
        """Wait for the work queued on the current device (timings, before host reads)."""
        ...

    def rng_state(self) -> torch.Tensor:
        """The current device's random-generator state (a ``uint8`` tensor; on CPU, torch's default
        generator), saved in checkpoints so a resumed run draws the numbers an uninterrupted one would."""
        ...

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state returned by :meth:`rng_state`."""
        ...

    def empty_cache(self) -> None:
        """Return cached allocator memory to the device."""
        ...

    def memory_stats(self) -> dict[str, float]:
        """This process's memory in GiB (``{}`` where unknown): ``allocated_gib``, ``reserved_gib``,
        ``max_allocated_gib`` on an accelerator, ``max_rss_gib`` (peak resident host memory) on the CPU. The
        trainer logs them per worker group each step (``perf/<group>/...``, the largest over the ranks)."""
        ...

    def worker_env(self) -> dict[str, str]:
        """Environment variables a worker process on this platform needs (rollout backend switches such
        as vLLM's plugin selection). Set with ``setdefault`` before any device work: a user's value wins."""
        ...

    def apply_patches(self) -> None:
        """Apply model or library patches this device needs (idempotent)."""
        ...


# --------------------------------------------------------------------------- aliases for plugins

EngineFactory = Callable[..., Engine]
RolloutFactory = Callable[..., Rollout]
