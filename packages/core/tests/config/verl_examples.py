"""verl's GRPO / PPO / DAPO example scripts, as override lists written for these tests.

Each entry stands for one script under verl's ``examples/`` (verl b178a3cd, 2026-01-29) that trains with FSDP or
Megatron and generates with vLLM or SGLang. The lists are not the scripts' text: they are built here from the
shapes the scripts share (``grpo``, ``ppo``, ``dapo`` below), with each script's own numbers and its extra keys,
shell variables replaced by the values the script sets by default. TensorRT-LLM scripts are left out (not vLLM or
SGLang). ``refused`` names the key a case must be refused on (a refused verl key, or a key verl itself does not
know); every other case must resolve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ARR = "actor_rollout_ref"
GSM8K = ("data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet")
GSM8K_MATH = ("data.train_files=[/data/gsm8k/train.parquet, /data/math/train.parquet]",
              "data.val_files=[/data/gsm8k/test.parquet, /data/math/test.parquet]")
GEO3K = ("data.train_files=/data/geo3k/train.parquet", "data.val_files=/data/geo3k/test.parquet", "data.image_key=images")
DAPO_MATH = ("data.train_files=/data/dapo-math-17k.parquet", "data.val_files=/data/aime-2024.parquet",
             "data.prompt_key=prompt")


@dataclass
class Example:
    """One verl example script: its override list, the trainer config it names, and the expected outcome."""

    overrides: list[str]
    config_name: str | None = None
    #: The verl key(s) the run must be refused on (None: it resolves).
    refused: str | tuple[str, ...] | None = None
    #: Further polyrl values to check (dotted key of ``to_dict(config)`` -> value).
    expect: dict = field(default_factory=dict)


def _trainer(gpus: int, nodes: int = 1, *, epochs: int = 15, save: int = 20, test: int = 5) -> list[str]:
    return ["trainer.critic_warmup=0", "trainer.logger=[console,wandb]", "trainer.project_name=verl_example",
            "trainer.experiment_name=case", f"trainer.n_gpus_per_node={gpus}", f"trainer.nnodes={nodes}",
            f"trainer.save_freq={save}", f"trainer.test_freq={test}", f"trainer.total_epochs={epochs}"]


def grpo(model: str, *, bs: int, pl: int, rl: int, mini: int, tp: int, n: int, gpus: int, nodes: int = 1,
         micro: int | None = None, lpm: int | None = None, rlpm: int | None = None, rollout: str = "vllm",
         lr: str = "1e-6", kl_coef: float = 0.001, kl_loss: bool = True, mem: float = 0.6, files=GSM8K,
         megatron: bool = False, offload_ref: bool = True, extra: tuple[str, ...] = ()) -> list[str]:
    """The GRPO script shape: KL in the loss, one rollout engine, FSDP (or Megatron) training."""
    out = ["algorithm.adv_estimator=grpo", *files, f"data.train_batch_size={bs}", f"data.max_prompt_length={pl}",
           f"data.max_response_length={rl}", "data.filter_overlong_prompts=True", "data.truncation=error",
           f"{ARR}.model.path={model}", f"{ARR}.actor.optim.lr={lr}", f"{ARR}.actor.ppo_mini_batch_size={mini}",
           f"{ARR}.actor.use_kl_loss={kl_loss}", f"{ARR}.actor.kl_loss_coef={kl_coef}",
           f"{ARR}.actor.kl_loss_type=low_var_kl", f"{ARR}.actor.entropy_coeff=0",
           f"{ARR}.rollout.tensor_model_parallel_size={tp}", f"{ARR}.rollout.name={rollout}",
           f"{ARR}.rollout.gpu_memory_utilization={mem}", f"{ARR}.rollout.n={n}", "algorithm.use_kl_in_reward=False"]
    if not megatron:
        out += [f"{ARR}.model.use_remove_padding=True", f"{ARR}.model.enable_gradient_checkpointing=True",
                f"{ARR}.actor.fsdp_config.param_offload=False", f"{ARR}.actor.fsdp_config.optimizer_offload=False",
                f"{ARR}.ref.fsdp_config.param_offload={offload_ref}"]
    if micro is not None:
        out.append(f"{ARR}.actor.ppo_micro_batch_size_per_gpu={micro}")
    if lpm is not None:
        out.append(f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu={lpm}")
    if rlpm is not None:
        out.append(f"{ARR}.ref.log_prob_micro_batch_size_per_gpu={rlpm}")
    return out + _trainer(gpus, nodes) + list(extra)


def mcore(role: str, *, tp: int = 1, pp: int = 1, **more: object) -> list[str]:
    """Megatron layout keys of one role (``actor`` / ``ref`` under actor_rollout_ref, or ``critic``)."""
    prefix = f"{ARR}.{role}" if role in ("actor", "ref") else role
    out = [f"{prefix}.megatron.tensor_model_parallel_size={tp}", f"{prefix}.megatron.pipeline_model_parallel_size={pp}"]
    return out + [f"{prefix}.megatron.{k}={'null' if v is None else v}" for k, v in more.items()]


def ppo(model: str, *, bs: int, pl: int, rl: int, mini: int, tp: int, gpus: int, nodes: int = 1,
        micro: int | None = None, lpm: int | None = None, cmicro: int | None = None, rollout: str = "vllm",
        mem: float = 0.4, megatron: bool = False, files=GSM8K, extra: tuple[str, ...] = ()) -> list[str]:
    """The PPO (GAE) script shape: a critic from the same model, no KL."""
    out = ["algorithm.adv_estimator=gae", *files, f"data.train_batch_size={bs}", f"data.max_prompt_length={pl}",
           f"data.max_response_length={rl}", "data.filter_overlong_prompts=True", "data.truncation=error",
           f"{ARR}.model.path={model}", f"{ARR}.actor.optim.lr=1e-6", f"{ARR}.actor.ppo_mini_batch_size={mini}",
           f"{ARR}.actor.use_kl_loss=False", f"{ARR}.rollout.tensor_model_parallel_size={tp}",
           f"{ARR}.rollout.name={rollout}", f"{ARR}.rollout.gpu_memory_utilization={mem}",
           "critic.optim.lr=1e-5", f"critic.model.path={model}", "algorithm.use_kl_in_reward=False"]
    if not megatron:
        out += [f"{ARR}.model.use_remove_padding=True", f"{ARR}.model.enable_gradient_checkpointing=True",
                f"{ARR}.actor.fsdp_config.param_offload=False", f"{ARR}.actor.fsdp_config.optimizer_offload=False",
                "critic.model.use_remove_padding=True", "critic.model.enable_gradient_checkpointing=True",
                "critic.model.fsdp_config.param_offload=False", "critic.model.fsdp_config.optimizer_offload=False"]
    if micro is not None:
        out.append(f"{ARR}.actor.ppo_micro_batch_size_per_gpu={micro}")
    if lpm is not None:
        out.append(f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu={lpm}")
    if cmicro is not None:
        out.append(f"critic.ppo_micro_batch_size_per_gpu={cmicro}")
    return out + _trainer(gpus, nodes, epochs=100 if megatron else 15) + list(extra)


def dapo(model: str, *, bs: int, mini: int, n: int, tp: int, gpus: int, nodes: int, pl: int = 2048, rl: int = 8192,
         clip_low: float = 0.2, clip_high: float = 0.28, overlong: int = 4096, rollout: str = "vllm",
         megatron: bool = False, extra: tuple[str, ...] = ()) -> list[str]:
    """The DAPO recipe shape: no KL, decoupled clip, token-level loss, dynamic batches, DAPO's overlong reward."""
    out = [*DAPO_MATH, "data.truncation=left", f"data.max_prompt_length={pl}", f"data.max_response_length={rl}",
           f"data.train_batch_size={bs}", f"{ARR}.rollout.n={n}", "algorithm.adv_estimator=grpo",
           "algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.0", f"{ARR}.actor.use_kl_loss=False",
           f"{ARR}.actor.kl_loss_coef=0.0", f"{ARR}.actor.clip_ratio_low={clip_low}",
           f"{ARR}.actor.clip_ratio_high={clip_high}", f"{ARR}.actor.use_dynamic_bsz=True",
           f"{ARR}.ref.log_prob_use_dynamic_bsz=True", f"{ARR}.rollout.log_prob_use_dynamic_bsz=True",
           f"{ARR}.actor.ppo_max_token_len_per_gpu={(pl + rl) * 2}",
           f"{ARR}.ref.log_prob_max_token_len_per_gpu={(pl + rl) * 3}",
           f"{ARR}.rollout.log_prob_max_token_len_per_gpu={(pl + rl) * 3}", f"{ARR}.rollout.name={rollout}",
           f"{ARR}.model.path={model}", f"{ARR}.actor.optim.lr=1e-6", f"{ARR}.actor.optim.lr_warmup_steps=10",
           f"{ARR}.actor.optim.weight_decay=0.1", f"{ARR}.actor.ppo_mini_batch_size={mini}",
           f"{ARR}.actor.entropy_coeff=0", f"{ARR}.actor.loss_agg_mode=token-mean",
           f"{ARR}.rollout.gpu_memory_utilization=0.80", f"{ARR}.rollout.tensor_model_parallel_size={tp}",
           f"{ARR}.rollout.enable_chunked_prefill=True", f"{ARR}.rollout.max_num_batched_tokens={pl + rl}",
           f"{ARR}.rollout.temperature=1.0", f"{ARR}.rollout.top_p=1.0", f"{ARR}.rollout.top_k=-1",
           f"{ARR}.rollout.val_kwargs.temperature=1.0", f"{ARR}.rollout.val_kwargs.top_p=0.7",
           f"{ARR}.rollout.val_kwargs.top_k=-1", f"{ARR}.rollout.val_kwargs.do_sample=True",
           f"{ARR}.rollout.val_kwargs.n=1", "reward_model.reward_manager=dapo",
           "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
           f"+reward_model.reward_kwargs.overlong_buffer_cfg.len={overlong}",
           "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
           "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False", f"+reward_model.reward_kwargs.max_resp_len={rl}",
           "trainer.logger=[console,wandb]", "trainer.project_name=DAPO", "trainer.experiment_name=case",
           f"trainer.n_gpus_per_node={gpus}", f"trainer.nnodes={nodes}", "trainer.val_before_train=True",
           "trainer.test_freq=10", "trainer.save_freq=10", "trainer.total_epochs=10",
           "trainer.default_local_dir=/ckpts/DAPO/case", "trainer.resume_mode=auto", "trainer.log_val_generations=10"]
    if not megatron:
        out += [f"{ARR}.model.use_remove_padding=True", f"{ARR}.model.enable_gradient_checkpointing=True",
                f"{ARR}.actor.grad_clip=1.0"]
    return out + list(extra)


_MCORE_OFFLOAD = ("param_offload", "optimizer_offload", "grad_offload")


def _offload(role: str, on: bool = True) -> list[str]:
    keys = _MCORE_OFFLOAD if role == "actor" else ("param_offload",)
    return [f"{ARR}.{role}.megatron.{k}={on}" for k in keys]


_RECOMPUTE = tuple(f"+{ARR}.actor.megatron.override_transformer_config.{k}" for k in (
    "recompute_method=uniform", "recompute_granularity=full", "recompute_num_layers=1"))
_OPTIM_OFFLOAD = tuple(f"+{ARR}.actor.optim.override_optimizer_config.{k}" for k in (
    "optimizer_offload_fraction=1.0", "overlap_cpu_optimizer_d2h_h2d=True", "use_precision_aware_optimizer=True",
    "optimizer_cpu_offload=True"))
_MOE = tuple(f"+{ARR}.actor.megatron.override_transformer_config.{k}" for k in (
    "moe_router_dtype=fp32", "moe_enable_deepep=True", "moe_token_dispatcher_type=flex",
    "gradient_accumulation_fusion=True", "moe_permute_fusion=True"))
_VL = ("data.image_key=images", f"+{ARR}.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True",
       f"{ARR}.rollout.enable_chunked_prefill=False", f"{ARR}.rollout.enforce_eager=False")
_NPU_PROFILE = tuple(f"{ARR}.{role}.profiler.{k}" for role in ("actor", "ref") for k in (
    "enable=True", "all_ranks=False", "tool_config.npu.discrete=False", "tool_config.npu.contents=[npu,cpu]",
    "tool_config.npu.level=level0", "tool_config.npu.analysis=True")) + (
    "global_profiler.tool=npu", "global_profiler.steps=[2,4]", "global_profiler.save_path=./profiler_data")
_LORA_TUNING = ("data.shuffle=False", f"{ARR}.model.use_shm=True", f"{ARR}.model.lora_rank=32",
                f"{ARR}.model.lora_alpha=32", f"{ARR}.model.target_modules=all-linear",
                f"{ARR}.actor.fsdp_config.fsdp_size=-1", f"{ARR}.rollout.max_num_seqs=512",
                f"{ARR}.rollout.max_model_len=1536", f"{ARR}.rollout.max_num_batched_tokens=1536",
                f"{ARR}.rollout.enable_chunked_prefill=False", f"{ARR}.rollout.load_format=safetensors",
                f"{ARR}.rollout.layered_summon=True", "algorithm.kl_ctrl.kl_coef=0.001")
_RM_LOOP = ("reward_model.enable=True", "reward_model.use_reward_loop=True", "reward_model.rollout.name=vllm",
            "reward_model.rollout.gpu_memory_utilization=0.8", "reward_model.rollout.tensor_model_parallel_size=1",
            "reward_model.num_workers=8")
_MEGATRON = "ppo_megatron_trainer"
#: What an example that scores with a reward model resolves to (the discriminative reward_model role).
_RM_ON = {"reward_model.enable": True, "reward_model.engine": "fsdp"}


def _tuning_lora(model_size: str, *, procs: int, tp: int, mem: float, sp: int, gpus: int, n: int = 5,
                 micro_key: str = "ppo_micro_batch_size") -> list[str]:
    """verl's examples/tuning LoRA scripts: batch = processes, every micro-batch count given globally."""
    return grpo(f"Qwen/Qwen2-{model_size}-Instruct", bs=procs, pl=512, rl=1024, mini=procs, tp=tp, n=n, gpus=gpus,
                lr="3e-5", mem=mem, extra=(f"data.val_batch_size={procs}", *_LORA_TUNING,
                                           f"{ARR}.actor.{micro_key}={procs}",
                                           f"{ARR}.rollout.log_prob_micro_batch_size={procs}",
                                           f"{ARR}.ref.log_prob_micro_batch_size={procs}",
                                           f"{ARR}.actor.ulysses_sequence_parallel_size={sp}"))


EXAMPLES: dict[str, Example] = {
    # ------------------------------------------------------------------ examples/grpo_trainer
    "grpo_trainer/run_deepseek7b_llm.sh": Example(grpo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=512, rl=1024, mini=256, micro=80, lpm=160, rlpm=160, tp=2, n=5,
        gpus=8), expect={"ref.micro_batch_size": 160, "rollout.gpu_memory_utilization": 0.6}),
    "grpo_trainer/run_deepseek7b_llm_math.sh": Example(grpo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=1024, rl=1024, mini=256, micro=40, lpm=40, rlpm=40, tp=2,
        n=5, gpus=8, files=GSM8K_MATH), expect={"data.train_files": ["/data/gsm8k/train.parquet",
                                                                    "/data/math/train.parquet"]}),
    "grpo_trainer/run_deepseek7b_llm_math_megatron.sh": Example(grpo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=1024, rl=1024, mini=256, micro=4, lpm=4, rlpm=4, tp=2, n=5,
        gpus=16, files=GSM8K_MATH, megatron=True, extra=(*mcore("actor", tp=2, pp=2), *mcore("ref", tp=2, pp=2))),
        config_name=_MEGATRON),
    "grpo_trainer/run_deepseek7b_llm_seq_balance.sh": Example(grpo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=512, rl=512, mini=256, tp=2, n=5, gpus=8,
        extra=(f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=24000"))),
    "grpo_trainer/run_deepseek671b_math_megatron_80gb.sh": Example(grpo(
        "/models/dsv3-config", bs=512, pl=2048, rl=4096, mini=128, micro=1, lpm=1, tp=32, n=4, gpus=8, nodes=32,
        megatron=True, files=GSM8K_MATH, extra=(
            f"{ARR}.actor.use_torch_compile=False", f"{ARR}.model.use_fused_kernels=True",
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=6144",
            f"{ARR}.actor.megatron.override_transformer_config.attention_backend=fused",
            f"+{ARR}.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=4",
            f"+{ARR}.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=1",
            *mcore("actor", tp=1, pp=16, expert_model_parallel_size=16, expert_tensor_parallel_size=1),
            *mcore("ref", tp=1, pp=16, expert_model_parallel_size=16, expert_tensor_parallel_size=1),
            *_offload("actor"), *_offload("ref"), *_RECOMPUTE, f"{ARR}.actor.megatron.use_mbridge=True",
            "trainer.default_local_dir=/ckpts/dsv3", "trainer.val_before_train=False")),
        config_name=_MEGATRON, expect={"actor.plugin_config.pipeline_model_parallel_size": 16, "trainer.n_workers": 256}),
    "grpo_trainer/run_deepseek671b_math_megatron_96gb.sh": Example(dapo(
        "/models/dsv3", bs=96, mini=32, n=8, tp=32, gpus=8, nodes=12, rl=1204 * 8, megatron=True, extra=(
            f"{ARR}.model.use_fused_kernels=True", f"{ARR}.actor.megatron.use_mbridge=True",
            f"{ARR}.actor.clip_ratio_c=10.0", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2",
            f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=4", f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4",
            *_OPTIM_OFFLOAD, *_offload("actor"), *_offload("ref"),
            *mcore("actor", tp=8, pp=12, expert_model_parallel_size=8, expert_tensor_parallel_size=1,
                   context_parallel_size=1),
            *mcore("ref", tp=8, pp=12, expert_model_parallel_size=8, expert_tensor_parallel_size=1,
                   context_parallel_size=1),
            f"{ARR}.actor.optim.clip_grad=1.0", f"{ARR}.nccl_timeout=1200", f"{ARR}.rollout.enforce_eager=True",
            *_RECOMPUTE, *_MOE, f"+{ARR}.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=6",
            "trainer.val_before_train=False")),
        config_name=_MEGATRON, expect={"reward.manager": "dapo", "reward.overlong_buffer_len": 4096,
                                       "actor.clip_ratio_c": 10.0, "rollout.plugin_config.enforce_eager": True}),
    "grpo_trainer/run_glm41v_9b.sh": Example(grpo(
        "zai-org/GLM-4.1V-9B-Thinking", bs=512, pl=1024, rl=2048, mini=128, micro=10, lpm=20, rlpm=20, tp=2, n=5,
        gpus=8, kl_coef=0.01, files=GEO3K, extra=(*_VL[1:], f"{ARR}.rollout.free_cache_engine=True")),
        expect={"rollout.plugin_config.engine_kwargs": {"disable_mm_preprocessor_cache": True}}),
    "grpo_trainer/run_gptoss_20b.sh": Example(grpo(
        "/models/gpt-oss-20b", bs=256, pl=512, rl=8192, mini=256, micro=32, lpm=32, rlpm=32, tp=2, n=5, gpus=8,
        rollout="sglang", mem=0.7, extra=(
            "+data.apply_chat_template_kwargs.reasoning_effort=medium",
            f"+{ARR}.actor.fsdp_config.model_dtype=bfloat16", f"{ARR}.rollout.mode=async",
            f"{ARR}.rollout.engine_kwargs.sglang.attention_backend=triton", f"{ARR}.rollout.load_format=safetensors")),
        expect={"data.apply_chat_template_kwargs": {"reasoning_effort": "medium"}, "actor.model.dtype": "bfloat16",
                "rollout.plugin_config.attention_backend": "triton"}),
    "grpo_trainer/run_minicpmo2_6.sh": Example(grpo(
        "openbmb/MiniCPM-o-2_6", bs=128, pl=1024, rl=2048, mini=32, micro=16, lpm=16, rlpm=16, tp=2, n=8, gpus=8,
        files=GEO3K, extra=("data.custom_cls.path=recipe/minicpmo/rl_dataset.py", "data.custom_cls.name=RLHFDataset",
                            f"{ARR}.model.trust_remote_code=True", f"{ARR}.actor.fsdp_config.use_orig_params=True")),
        refused="data.custom_cls.path"),
    "grpo_trainer/run_mistral13b_skyworkrm_hhrlhf.sh": Example(grpo(
        "mistralai/Mistral-Nemo-Instruct-2407", bs=512, pl=4096, rl=2048, mini=128, micro=10, lpm=10, tp=4, n=5,
        gpus=8, kl_loss=False, mem=0.7, extra=(*_RM_LOOP, "reward_model.model.path=Skywork/Skywork-Reward-Llama-3.1-8B")),
        expect=_RM_ON),
    "grpo_trainer/run_moonlight16b_math_megatron.sh": Example(grpo(
        "/models/Moonlight-16B-A3B", bs=192, pl=1024, rl=2048, mini=64, micro=16, lpm=16, rlpm=16, tp=4, n=5,
        gpus=8, nodes=3, megatron=True, files=GSM8K_MATH, extra=(
            "data.trust_remote_code=True", f"{ARR}.model.trust_remote_code=True",
            *mcore("actor", tp=4, pp=3, expert_model_parallel_size=4, use_dist_checkpointing=True,
                   dist_checkpointing_path="/ckpts/moonlight-dist"),
            *mcore("ref", tp=4, pp=3, expert_model_parallel_size=4, use_dist_checkpointing=True,
                   dist_checkpointing_path="/ckpts/moonlight-dist"))),
        config_name=_MEGATRON, expect={"model.trust_remote_code": True, "trainer.n_workers": 24}),
    "grpo_trainer/run_qwen2-32b_sglang_fsdp_npu.sh": Example(grpo(
        "/models/Qwen2.5-32B", bs=32, pl=2048, rl=8192, mini=32, micro=1, lpm=1, rlpm=1, tp=4, n=8, gpus=8, nodes=2,
        rollout="sglang", mem=0.5, files=DAPO_MATH, extra=(
            "data.filter_overlong_prompts=False", "data.truncation=left", f"{ARR}.actor.use_torch_compile=False",
            f"{ARR}.ref.use_torch_compile=False", f"+{ARR}.rollout.engine_kwargs.sglang.attention_backend=ascend",
            f"{ARR}.rollout.data_parallel_size=1", f"{ARR}.rollout.expert_parallel_size=1",
            f"{ARR}.rollout.multi_stage_wake_up=True", f"{ARR}.rollout.val_kwargs.do_sample=True",
            f"{ARR}.rollout.val_kwargs.temperature=1.0", "trainer.device=npu")),
        config_name="ppo_trainer", expect={"trainer.device": "npu", "data.truncation": "left",
                                           "rollout.val_temperature": 1.0}),
    "grpo_trainer/run_qwen2-7b.sh": Example(grpo(
        "Qwen/Qwen2-7B-Instruct", bs=1024, pl=512, rl=1024, mini=256, micro=40, lpm=40, rlpm=40, tp=2, n=5, gpus=8)),
    "grpo_trainer/run_qwen2-7b_math.sh": Example(grpo(
        "Qwen/Qwen2-7B-Instruct", bs=1024, pl=1024, rl=1024, mini=256, micro=16, lpm=16, rlpm=16, tp=2, n=5, gpus=8,
        files=GSM8K_MATH)),
    "grpo_trainer/run_qwen2-7b_math_megatron.sh": Example(grpo(
        "Qwen/Qwen2-7B-Instruct", bs=1024, pl=1024, rl=1024, mini=256, micro=4, lpm=4, rlpm=4, tp=2, n=5, gpus=8,
        megatron=True, files=GSM8K_MATH, extra=(
            "data.return_raw_chat=True", f"{ARR}.model.use_fused_kernels=False", f"{ARR}.rollout.mode=async",
            *mcore("actor", tp=2, pp=2), *mcore("ref", tp=2, pp=2))),
        config_name=_MEGATRON, expect={"actor.plugin_config.sequence_parallel": True}),
    "grpo_trainer/run_qwen2-7b_math_megatron_lora.sh": Example(grpo(
        "Qwen/Qwen2-7B-Instruct", bs=128, pl=1024, rl=1024, mini=16, micro=2, lpm=4, rlpm=4, tp=2, n=4, gpus=8,
        megatron=True, files=GSM8K_MATH, extra=(
            "data.shuffle=False", f"{ARR}.model.lora.rank=256", f"{ARR}.model.lora.alpha=512",
            f"{ARR}.model.lora.lora_A_init_method=kaiming", f"{ARR}.model.lora.type=canonical_lora",
            f"{ARR}.model.lora.target_modules=[linear_q,linear_k,linear_v,linear_proj,linear_fc1_up,linear_fc1_gate,"
            "linear_fc2]", f"{ARR}.model.lora.dropout=0.05", f"{ARR}.actor.use_dynamic_bsz=True",
            *mcore("actor", tp=4, pp=1), *mcore("ref", tp=4, pp=1), *_RECOMPUTE, "trainer.val_before_train=False")),
        config_name=_MEGATRON, refused=f"{ARR}.model.lora.type"),
    "grpo_trainer/run_qwen2-7b_seq_balance.sh": Example(grpo(
        "Qwen/Qwen2-7B-Instruct", bs=1024, pl=512, rl=1024, mini=256, tp=2, n=5, gpus=8, extra=(
            "data.return_raw_chat=True", f"{ARR}.actor.use_dynamic_bsz=True",
            f"{ARR}.actor.ppo_max_token_len_per_gpu=24000", f"{ARR}.rollout.mode=async",
            f"{ARR}.rollout.multi_turn.format=hermes", "trainer.val_before_train=False")),
        expect={"actor.max_token_len_per_gpu": 24000, "trainer.val_before_train": False}),
    "grpo_trainer/run_qwen2-7b_seq_balance_math_megatron.sh": Example(grpo(
        "Qwen/Qwen2-7B-Instruct", bs=1024, pl=1024, rl=1024, mini=256, lpm=4, rlpm=4, tp=2, n=5, gpus=8,
        megatron=True, files=GSM8K_MATH, extra=(
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=12000",
            *mcore("actor", tp=2, pp=2), *mcore("ref", tp=2, pp=2), *_offload("actor", False), *_offload("ref", False))),
        config_name=_MEGATRON),
    "grpo_trainer/run_qwen2-7b_sgl_megatron.sh": Example(grpo(
        "Qwen/Qwen2-7B-Instruct", bs=1024, pl=1024, rl=1024, mini=256, micro=4, lpm=4, rlpm=4, tp=2, n=5, gpus=8,
        rollout="sglang", megatron=True, files=GSM8K_MATH, extra=(
            *mcore("actor", tp=4, pp=2, virtual_pipeline_model_parallel_size=2),)),
        config_name=_MEGATRON, expect={"actor.plugin_config.tensor_model_parallel_size": 4}),
    "grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh": Example(grpo(
        "Qwen/Qwen2.5-3B-Instruct", bs=1024, pl=512, rl=1024, mini=256, micro=40, lpm=40, rlpm=40, tp=2, n=5, gpus=8,
        lr="3e-6", extra=("data.shuffle=False", f"{ARR}.model.lora_rank=64", f"{ARR}.model.lora_alpha=32",
                          f"{ARR}.rollout.load_format=safetensors", f"{ARR}.rollout.layered_summon=True",
                          f"{ARR}.model.use_shm=True", "trainer.val_before_train=False")),
        expect={"model.lora.rank": 64, "model.lora.alpha": 32, "data.shuffle": False,
                "rollout.plugin_config.load_format": "safetensors"}),
    "grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora_from_adapter.sh": Example(grpo(
        "Qwen/Qwen2.5-3B-Instruct", bs=1024, pl=512, rl=1024, mini=256, micro=40, lpm=40, rlpm=40, tp=2, n=5, gpus=8,
        lr="3e-6", extra=("data.shuffle=False", f"{ARR}.model.use_shm=True",
                          f"{ARR}.model.lora_adapter_path=/adapters/qwen2.5-3b-gsm8k",
                          f"{ARR}.rollout.load_format=safetensors", f"{ARR}.rollout.layered_summon=True")),
        refused=f"{ARR}.model.lora_adapter_path"),
    "grpo_trainer/run_qwen2_5-7b_math_megatron_diff_tp.sh": Example(grpo(
        "Qwen/Qwen2.5-7B-Instruct", bs=1024, pl=1024, rl=1024, mini=256, micro=4, lpm=4, rlpm=4, tp=4, n=5, gpus=8,
        megatron=True, files=GSM8K_MATH, extra=(*mcore("actor", tp=2, pp=2), *mcore("ref", tp=2, pp=2))),
        config_name=_MEGATRON, expect={"rollout.tensor_parallel_size": 4,
                                       "actor.plugin_config.tensor_model_parallel_size": 2}),
    "grpo_trainer/run_qwen2_5_32b_grpo_npu.sh": Example(grpo(
        "Qwen/Qwen2.5-32B-Instruct", bs=1024, pl=1024, rl=1024, mini=128, micro=2, lpm=2, rlpm=2, tp=8, n=5, gpus=16,
        nodes=2, mem=0.4, extra=(f"{ARR}.model.use_remove_padding=False", "trainer.device=npu")),
        expect={"actor.use_remove_padding": False, "trainer.n_workers": 32}),
    "grpo_trainer/run_qwen2_5_7b_grpo_discrete_prof_npu.sh": Example(grpo(
        "Qwen/Qwen2.5-7B-Instruct", bs=32, pl=1024, rl=1024, mini=2, micro=1, lpm=1, rlpm=1, tp=4, n=4, gpus=8,
        lr="5e-8", mem=0.3, extra=(f"{ARR}.model.use_remove_padding=False", *_NPU_PROFILE,
                                   f"{ARR}.actor.profiler.ranks=[0,1]", f"{ARR}.ref.profiler.ranks=[0,1]",
                                   f"{ARR}.rollout.enable_chunked_prefill=False", "trainer.device=npu"))),
    "grpo_trainer/run_qwen2_5_7b_grpo_e2e_prof_npu.sh": Example(grpo(
        "Qwen/Qwen2.5-7B-Instruct", bs=32, pl=1024, rl=1024, mini=2, micro=1, lpm=1, rlpm=1, tp=4, n=4, gpus=8,
        lr="5e-8", mem=0.3, extra=(f"{ARR}.model.use_remove_padding=False", *_NPU_PROFILE,
                                   f"{ARR}.rollout.enable_chunked_prefill=False", "trainer.device=npu"))),
    "grpo_trainer/run_qwen2_5_7b_grpo_npu.sh": Example(grpo(
        "Qwen/Qwen2.5-7B-Instruct", bs=1024, pl=1024, rl=1024, mini=32, micro=2, lpm=2, rlpm=2, tp=4, n=5, gpus=16,
        lr="5e-8", mem=0.3, extra=(f"{ARR}.model.use_remove_padding=False",
                                   f"{ARR}.rollout.enable_chunked_prefill=False", "trainer.device=npu"))),
    "grpo_trainer/run_qwen2_5_vl-7b-megatron.sh": Example(grpo(
        "/models/Qwen2.5-VL-7B-Instruct", bs=512, pl=1024, rl=2048, mini=128, micro=4, lpm=20, rlpm=20, tp=1, n=5,
        gpus=8, kl_coef=0.01, mem=0.8, megatron=True, files=GEO3K, extra=(
            # the script sets these two without verl's actor_rollout_ref prefix: verl refuses them too
            "ref.log_prob_use_dynamic_bsz=True", "rollout.log_prob_use_dynamic_bsz=True",
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=5120",
            *mcore("actor", tp=2, pp=1, use_dist_checkpointing=True, dist_checkpointing_path="/ckpts/vl-dist"),
            *mcore("ref", tp=2, pp=1, use_dist_checkpointing=True, dist_checkpointing_path="/ckpts/vl-dist"),
            *_RECOMPUTE, *_offload("actor", False), *_offload("ref", False))),
        config_name=_MEGATRON, refused="ref"),
    "grpo_trainer/run_qwen2_5_vl-7b-sglang.sh": Example(grpo(
        "Qwen/Qwen2.5-VL-7B-Instruct", bs=512, pl=1024, rl=2048, mini=128, micro=10, lpm=20, rlpm=20, tp=1, n=5,
        gpus=8, kl_coef=0.01, mem=0.85, rollout="sglang", files=GEO3K, extra=(
            *_VL[1:], f"{ARR}.rollout.multi_stage_wake_up=True", "global_profiler.tool=torch_memory",
            "global_profiler.save_path=./mem_snapshots",
            "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000",
            "global_profiler.global_tool_config.torch_memory.stack_depth=32", f"{ARR}.rollout.free_cache_engine=True",
            f"{ARR}.rollout.mode=async")),
        expect={"rollout.plugin_config.disable_cuda_graph": False}),
    "grpo_trainer/run_qwen2_5_vl-7b.sh": Example(grpo(
        "Qwen/Qwen2.5-VL-7B-Instruct", bs=512, pl=1024, rl=2048, mini=128, micro=10, lpm=20, rlpm=20, tp=2, n=5,
        gpus=8, kl_coef=0.01, files=GEO3K, extra=(*_VL[1:], f"{ARR}.model.use_fused_kernels=True",
                                                  f"{ARR}.rollout.free_cache_engine=True"))),
    "grpo_trainer/run_qwen2_5_vl-7b_freeze_vision.sh": Example(grpo(
        "Qwen/Qwen2.5-VL-7B-Instruct", bs=512, pl=1024, rl=2048, mini=128, micro=10, lpm=20, rlpm=20, tp=2, n=5,
        gpus=8, kl_coef=0.01, files=GEO3K, extra=(*_VL[1:], f"{ARR}.actor.freeze_vision_tower=True")),
        expect={"model.freeze_vision_tower": True}),
    "grpo_trainer/run_qwen2_5_vl-7b_lora.sh": Example(grpo(
        "Qwen/Qwen2.5-VL-7B-Instruct", bs=512, pl=1024, rl=2048, mini=128, micro=10, lpm=20, rlpm=20, tp=2, n=5,
        gpus=8, kl_coef=0.01, lr="3e-6", files=GEO3K, extra=(
            *_VL[1:], f"{ARR}.model.lora_rank=64", f"{ARR}.model.lora_alpha=32", f"{ARR}.model.target_modules=all-linear",
            f"{ARR}.model.exclude_modules=.*visual.*", f"{ARR}.rollout.free_cache_engine=False")),
        refused=f"{ARR}.model.exclude_modules"),
    "grpo_trainer/run_qwen2_5_vl-7b_seq_balance.sh": Example(grpo(
        "Qwen/Qwen2.5-VL-7B-Instruct", bs=512, pl=1024, rl=2048, mini=128, tp=2, n=5, gpus=8, kl_coef=0.01,
        files=GEO3K, extra=(f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=6144",
                            f"{ARR}.rollout.enable_chunked_prefill=False", f"{ARR}.rollout.enforce_eager=False",
                            f"{ARR}.rollout.free_cache_engine=False", f"{ARR}.ref.log_prob_max_token_len_per_gpu=6144")),
        expect={"rollout.free_cache_engine": False}),
    "grpo_trainer/run_qwen2_5_vl_32b_npu.sh": Example(grpo(
        "Qwen/Qwen2.5-VL-32B-Instruct", bs=512, pl=1024, rl=2048, mini=32, micro=1, lpm=1, rlpm=1, tp=8, n=5, gpus=16,
        nodes=2, kl_coef=0.01, mem=0.3, files=GEO3K, extra=(
            f"{ARR}.actor.use_torch_compile=False", *_VL[1:3], f"{ARR}.rollout.enforce_eager=True",
            f"{ARR}.rollout.free_cache_engine=True", "trainer.device=npu"))),
    "grpo_trainer/run_qwen2_5_vl_3b_npu.sh": Example(grpo(
        "Qwen/Qwen2.5-VL-3B-Instruct", bs=512, pl=1024, rl=2048, mini=16, micro=2, lpm=4, rlpm=4, tp=2, n=5, gpus=8,
        kl_coef=0.01, files=GEO3K, extra=(
            f"{ARR}.actor.use_torch_compile=False", *_VL[1:3], f"{ARR}.rollout.enforce_eager=True",
            f"{ARR}.rollout.free_cache_engine=True", "trainer.use_legacy_worker_impl=disable", "trainer.device=npu"))),
    "grpo_trainer/run_qwen2_5_vl_7b_npu.sh": Example(grpo(
        "Qwen/Qwen2.5-VL-7B-Instruct", bs=512, pl=1024, rl=2048, mini=32, micro=2, lpm=4, rlpm=4, tp=4, n=5, gpus=16,
        kl_coef=0.01, mem=0.5, files=GEO3K, extra=(
            f"{ARR}.actor.use_torch_compile=False", *_VL[1:3], f"{ARR}.rollout.enforce_eager=True",
            f"{ARR}.rollout.free_cache_engine=True", "trainer.device=npu"))),
    "grpo_trainer/run_qwen3-235b_megatron_96gb.sh": Example(dapo(
        "/models/Qwen3-235B-A22B", bs=32, mini=16, n=8, tp=8, gpus=8, nodes=4, rl=1204 * 8, overlong=1024,
        megatron=True, extra=(
            f"{ARR}.rollout.cudagraph_capture_sizes=[1,2,4,8,16,32]", f"{ARR}.rollout.enforce_eager=True",
            f"{ARR}.rollout.free_cache_engine=True", f"{ARR}.model.use_fused_kernels=True",
            f"{ARR}.actor.megatron.use_mbridge=True", f"{ARR}.actor.clip_ratio_c=10.0",
            f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2", f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=4",
            f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4", *_OPTIM_OFFLOAD, *_offload("actor"), *_offload("ref"),
            *mcore("actor", tp=4, pp=8, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                   context_parallel_size=1),
            *mcore("ref", tp=4, pp=8, expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                   context_parallel_size=1),
            f"{ARR}.actor.optim.clip_grad=1.0", f"{ARR}.nccl_timeout=1200", *_MOE,
            f"+{ARR}.actor.megatron.override_transformer_config.account_for_loss_in_pipeline_split=True",
            "trainer.val_before_train=False")),
        config_name=_MEGATRON, expect={"trainer.n_workers": 32, "rollout.top_p": 1.0, "rollout.val_top_p": 0.7}),
    "grpo_trainer/run_qwen3-32b_npu.sh": Example(grpo(
        "/models/Qwen3-32B", bs=1024, pl=2048, rl=2048, mini=64, micro=8, lpm=8, rlpm=8, tp=4, n=4, gpus=8, nodes=4,
        mem=0.7, extra=("data.shuffle=False", f"{ARR}.actor.ulysses_sequence_parallel_size=4",
                        f"+{ARR}.actor.fsdp_config.mixed_precision.param_dtype=bf16",
                        f"+{ARR}.actor.fsdp_config.mixed_precision.reduce_dtype=bf16",
                        f"+{ARR}.actor.fsdp_config.mixed_precision.buffer_dtype=fp32",
                        f"{ARR}.actor.use_torch_compile=False", f"{ARR}.ref.use_torch_compile=False",
                        f"{ARR}.rollout.enable_chunked_prefill=True", f"{ARR}.rollout.max_num_batched_tokens=32768",
                        "trainer.resume_from_path=checkpoints/", "trainer.device=npu")),
        expect={"actor.plugin_config.reduce_dtype": "bfloat16", "rollout.plugin_config.max_num_batched_tokens": 32768}),
    "grpo_trainer/run_qwen3-8b.sh": Example(grpo(
        "Qwen/Qwen3-8B", bs=1024, pl=512, rl=1024, mini=256, micro=32, lpm=32, rlpm=32, tp=2, n=5, gpus=8)),
    "grpo_trainer/run_qwen3-8b_npu.sh": Example(grpo(
        "/models/Qwen3-8B", bs=256, pl=512, rl=1024, mini=64, micro=10, lpm=32, rlpm=32, tp=2, n=5, gpus=8, extra=(
            f"{ARR}.actor.use_torch_compile=False", f"{ARR}.ref.use_torch_compile=False",
            "trainer.default_local_dir=/ckpts/qwen3-8b", "trainer.resume_mode=auto",
            f"{ARR}.actor.fsdp_config.forward_prefetch=True", f"{ARR}.ref.fsdp_config.forward_prefetch=True",
            f"++{ARR}.actor.entropy_from_logits_with_chunking=True", f"++{ARR}.ref.entropy_from_logits_with_chunking=True",
            "trainer.val_before_train=True", "trainer.device=npu")),
        expect={"trainer.run_dir": "/ckpts/qwen3-8b", "trainer.resume": "auto"}),
    "grpo_trainer/run_qwen3_4b_grpo_vllm_1k_npu.sh": Example(grpo(
        "/models/Qwen3-4B", bs=512, pl=1024, rl=1024, mini=256, tp=2, n=5, gpus=16, lr="5e-7", mem=0.9, extra=(
            f"{ARR}.actor.use_torch_compile=False", f"{ARR}.actor.use_dynamic_bsz=True",
            f"{ARR}.actor.ppo_max_token_len_per_gpu=3000", f"{ARR}.rollout.enforce_eager=True",
            f"{ARR}.rollout.log_prob_use_dynamic_bsz=True", f"{ARR}.rollout.log_prob_max_token_len_per_gpu=4096",
            f"{ARR}.rollout.enable_chunked_prefill=False", f"{ARR}.ref.log_prob_use_dynamic_bsz=True",
            f"{ARR}.ref.log_prob_max_token_len_per_gpu=8192", f"{ARR}.ref.use_torch_compile=True",
            "algorithm.kl_ctrl.kl_coef=0.001", "trainer.default_local_dir=/ckpts/q4b", "trainer.val_before_train=False",
            "trainer.device=npu"))),
    "grpo_trainer/run_qwen3_8b_grpo_sglang_1k_spmd_npu.sh": Example(grpo(
        "/models/Qwen3-8B", bs=16, pl=512, rl=1024, mini=16, micro=1, lpm=2, rlpm=2, tp=4, n=5, gpus=4,
        rollout="sglang", mem=0.3, extra=(
            f"{ARR}.actor.use_torch_compile=False", f"+{ARR}.rollout.engine_kwargs.sglang.attention_backend=ascend",
            f"{ARR}.rollout.enable_chunked_prefill=False", f"{ARR}.nccl_timeout=1800", "trainer.val_before_train=False",
            "trainer.default_local_dir=/ckpts/q8b", f"{ARR}.actor.ulysses_sequence_parallel_size=4",
            f"{ARR}.ref.ulysses_sequence_parallel_size=4", "trainer.device=npu")),
        expect={"rollout.plugin_config.attention_backend": "ascend"}),
    "grpo_trainer/run_qwen3_8b_grpo_sglang_32k_spmd_npu.sh": Example(grpo(
        "/models/Qwen3-8B", bs=16, pl=2048, rl=32768, mini=16, micro=1, lpm=1, rlpm=1, tp=4, n=5, gpus=8,
        rollout="sglang", mem=0.3, extra=(
            f"{ARR}.actor.use_torch_compile=False", f"+{ARR}.rollout.engine_kwargs.sglang.attention_backend=ascend",
            f"{ARR}.rollout.enable_chunked_prefill=False", f"{ARR}.nccl_timeout=3600", "trainer.val_before_train=False",
            "trainer.default_local_dir=/ckpts/q8b-32k", f"{ARR}.actor.ulysses_sequence_parallel_size=8",
            f"{ARR}.ref.ulysses_sequence_parallel_size=8", "trainer.device=npu"))),
    "grpo_trainer/run_qwen3_vl-235b-megatron.sh": Example(grpo(
        "/models/Qwen3-VL-235B-A22B", bs=512, pl=1024, rl=2048, mini=128, micro=1, lpm=1, rlpm=1, tp=16, n=5, gpus=8,
        nodes=8, kl_coef=0.01, mem=0.7, megatron=True, files=GEO3K, extra=(
            *mcore("actor", tp=4, pp=8, context_parallel_size=2, expert_model_parallel_size=8,
                   expert_tensor_parallel_size=1),
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=4096",
            f"{ARR}.ref.log_prob_use_dynamic_bsz=True", f"{ARR}.ref.log_prob_max_token_len_per_gpu=4096",
            f"{ARR}.rollout.log_prob_use_dynamic_bsz=True", f"{ARR}.rollout.log_prob_max_token_len_per_gpu=4096",
            f"+{ARR}.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True",
            f"{ARR}.actor.megatron.use_mbridge=True", *_offload("actor"), *_offload("ref"), *_OPTIM_OFFLOAD, *_MOE,
            *_RECOMPUTE)), config_name=_MEGATRON),
    "grpo_trainer/run_qwen3_vl-30b-megatron.sh": Example(grpo(
        "/models/Qwen3-VL-30B-A3B", bs=512, pl=1024, rl=2048, mini=128, micro=1, lpm=1, rlpm=1, tp=4, n=5, gpus=8,
        kl_coef=0.01, mem=0.7, megatron=True, files=GEO3K, extra=(
            *mcore("actor", tp=2, pp=1, context_parallel_size=2, expert_model_parallel_size=8,
                   expert_tensor_parallel_size=1),
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=4096",
            f"{ARR}.ref.log_prob_use_dynamic_bsz=True", f"{ARR}.ref.log_prob_max_token_len_per_gpu=4096",
            f"{ARR}.rollout.log_prob_use_dynamic_bsz=True", f"{ARR}.rollout.log_prob_max_token_len_per_gpu=4096",
            f"+{ARR}.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True",
            f"{ARR}.actor.megatron.use_mbridge=True", *_offload("actor"), *_offload("ref"), *_OPTIM_OFFLOAD, *_MOE,
            *_RECOMPUTE, f"+{ARR}.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
            f"+{ARR}.actor.megatron.override_transformer_config.moe_z_loss_coeff=0.001")), config_name=_MEGATRON),
    "grpo_trainer/run_qwen3_vl-8b-megatron.sh": Example(grpo(
        "/models/Qwen3-VL-8B", bs=512, pl=1024, rl=2048, mini=128, micro=1, lpm=1, rlpm=1, tp=4, n=5, gpus=8,
        kl_coef=0.01, mem=0.7, megatron=True, files=GEO3K, extra=(
            *mcore("actor", tp=2, pp=1, context_parallel_size=2), f"{ARR}.actor.use_dynamic_bsz=True",
            f"{ARR}.actor.ppo_max_token_len_per_gpu=4096", f"{ARR}.ref.log_prob_use_dynamic_bsz=True",
            f"{ARR}.ref.log_prob_max_token_len_per_gpu=4096", f"{ARR}.rollout.log_prob_use_dynamic_bsz=True",
            f"{ARR}.rollout.log_prob_max_token_len_per_gpu=4096",
            f"+{ARR}.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True",
            f"{ARR}.actor.megatron.use_mbridge=True", *_offload("actor"), *_offload("ref"), *_OPTIM_OFFLOAD, *_MOE,
            *_RECOMPUTE)), config_name=_MEGATRON),
    "grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh": Example(dapo(
        "/models/Qwen3-30B-A3B", bs=512, mini=128, n=16, tp=4, gpus=8, nodes=1, megatron=True, extra=(
            f"{ARR}.actor.clip_ratio_c=10.0", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2",
            f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=2", f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=2",
            f"+{ARR}.model.override_config.model_config.max_position_embeddings=10240",
            f"{ARR}.model.use_fused_kernels=False", f"{ARR}.actor.optim.lr_decay_style=constant", *_OPTIM_OFFLOAD,
            f"{ARR}.actor.megatron.use_mbridge=True", f"{ARR}.actor.megatron.use_dist_checkpointing=False",
            *_offload("actor"), *mcore("actor", tp=4, pp=1, virtual_pipeline_model_parallel_size=None,
                                       context_parallel_size=1, expert_model_parallel_size=8,
                                       expert_tensor_parallel_size=1), *_MOE)),
        config_name=_MEGATRON, expect={"model.override_config": {"max_position_embeddings": 10240},
                                       "actor.optim.lr_scheduler_type": "constant"}),
    "grpo_trainer/run_qwen3moe-30b_megatron_lora.sh": Example(grpo(
        "Qwen/Qwen3-30B-A3B-Instruct-2507", bs=128, pl=1024, rl=1024, mini=16, micro=2, lpm=4, rlpm=4, tp=8, n=4,
        gpus=8, lr="3e-6", mem=0.25, megatron=True, extra=(
            "data.shuffle=False", f"{ARR}.model.use_fused_kernels=True", f"{ARR}.model.lora.rank=32",
            f"{ARR}.model.lora.alpha=64", f"{ARR}.model.lora.lora_A_init_method=kaiming",
            f"{ARR}.model.lora.type=canonical_lora", f"{ARR}.model.lora.dropout=0.05",
            f"{ARR}.actor.megatron.use_mbridge=True", f"{ARR}.actor.megatron.vanilla_mbridge=False",
            f"{ARR}.actor.use_dynamic_bsz=True",
            *mcore("actor", tp=2, pp=2, expert_model_parallel_size=4, context_parallel_size=2,
                   expert_tensor_parallel_size=1), *_offload("actor"), *_RECOMPUTE)),
        config_name=_MEGATRON, refused=f"{ARR}.model.lora.type"),
    "grpo_trainer/run_seed_oss_36b.sh": Example(grpo(
        "ByteDance-Seed/Seed-OSS-36B-Base", bs=64, pl=512, rl=1024, mini=8, micro=2, lpm=2, rlpm=2, tp=2, n=2, gpus=8,
        extra=(f"{ARR}.model.use_fused_kernels=True", f"{ARR}.actor.use_dynamic_bsz=True",
               f"{ARR}.actor.strategy=fsdp2", f"{ARR}.rollout.log_prob_use_dynamic_bsz=True",
               f"{ARR}.rollout.free_cache_engine=True", f"{ARR}.ref.log_prob_use_dynamic_bsz=True",
               f"{ARR}.ref.strategy=fsdp2", "trainer.val_before_train=False")),
        expect={"actor.engine": "fsdp", "ref.engine": ""}),
    # ------------------------------------------------------------------ examples/ppo_trainer
    "ppo_trainer/run_deepseek7b_llm.sh": Example(ppo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=512, rl=512, mini=256, micro=16, lpm=32, cmicro=32, tp=4, gpus=8,
        extra=("trainer.use_legacy_worker_impl=auto",)),
        expect={"critic.optim.lr": 1e-5, "critic.micro_batch_size": 32, "critic.model.path": "deepseek-ai/deepseek-llm-7b-chat"}),
    "ppo_trainer/run_deepseek7b_llm_modelscope.sh": Example(ppo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=512, rl=512, mini=256, micro=16, lpm=32, cmicro=32, tp=4,
        gpus=8)),
    "ppo_trainer/run_deepseek7b_llm_pfppo.sh": Example(ppo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=512, rl=512, mini=256, micro=16, lpm=32, cmicro=32, tp=4, gpus=8,
        extra=(f"{ARR}.rollout.n=5", "algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=pow",
               "algorithm.pf_ppo.weight_pow=2.0")), refused="algorithm.use_pf_ppo"),
    "ppo_trainer/run_deepseek7b_llm_sandbox_fusion.sh": Example(ppo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=512, rl=512, mini=256, micro=16, lpm=32, cmicro=32, tp=4, gpus=8,
        extra=("reward_model.sandbox_fusion.url=https://sandbox.example/run_code",
               "reward_model.sandbox_fusion.max_concurrent=128", "reward_model.reward_manager=prime")),
        expect={"reward.sandbox_fusion.url": "https://sandbox.example/run_code",
                "reward.sandbox_fusion.max_concurrent": 128}),
    "ppo_trainer/run_deepseek7b_llm_sp2.sh": Example(ppo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=512, rl=512, mini=256, micro=32, lpm=64, cmicro=64, tp=4, gpus=8,
        mem=0.6, extra=(f"{ARR}.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"))),
    "ppo_trainer/run_deepseek_full_hh_rlhf.sh": Example(ppo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=512, pl=128, rl=128, mini=128, micro=4, lpm=4, cmicro=4, tp=4, gpus=8,
        megatron=True, extra=(*_RM_LOOP, "reward_model.model.path=deepseek-ai/deepseek-llm-7b-chat")),
        config_name=_MEGATRON, expect={**_RM_ON, "reward_model.engine": "megatron"}),
    "ppo_trainer/run_deepseek_math_gsm8k_megatron.sh": Example(ppo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=1024, pl=1024, rl=512, mini=256, micro=4, lpm=4, cmicro=4, tp=4, gpus=8,
        megatron=True, files=GSM8K_MATH, extra=(*mcore("actor", tp=2, pp=2), *mcore("ref", tp=2, pp=2))),
        config_name=_MEGATRON, expect={"critic.engine": "megatron", "critic.plugin_config.tensor_model_parallel_size": 1}),
    "ppo_trainer/run_deepseek_math_gsm8k_megatron_nsys.sh": Example(ppo(
        "deepseek-ai/deepseek-llm-7b-chat", bs=256, pl=1024, rl=512, mini=64, micro=4, lpm=4, cmicro=4, tp=2, gpus=8,
        mem=0.8, megatron=True, files=GSM8K_MATH, extra=(
            *mcore("actor", tp=2, pp=2), *mcore("ref", tp=2, pp=2), f"{ARR}.actor.profiler.enable=True",
            f"{ARR}.actor.profiler.ranks=[0,1]", f"{ARR}.actor.profiler.all_ranks=False", "critic.profiler.enable=True",
            "critic.profiler.ranks=[0,1]", "critic.profiler.all_ranks=False", "trainer.total_training_steps=1",
            "global_profiler.tool=nsys", "global_profiler.steps=[1]", "global_profiler.global_tool_config.nsys.discrete=False")),
        config_name=_MEGATRON, expect={"trainer.total_steps": 1}),
    "ppo_trainer/run_gemma.sh": Example(ppo(
        "google/gemma-2-2b-it", bs=512, pl=1024, rl=512, mini=128, micro=4, lpm=4, cmicro=4, tp=2, gpus=2, extra=(
            "critic.model.use_remove_padding=False", "critic.model.enable_gradient_checkpointing=False")),
        expect={"critic.model.gradient_checkpointing": False, "trainer.n_workers": 2}),
    "ppo_trainer/run_moonlight16b_a3b_gsm8k_megatron.sh": Example(ppo(
        "/models/Moonlight-16B-A3B", bs=1024, pl=1024, rl=512, mini=256, micro=4, lpm=2, cmicro=4, tp=4, gpus=8,
        nodes=4, mem=0.7, megatron=True, extra=(
            "data.trust_remote_code=True", f"{ARR}.model.trust_remote_code=True", "critic.model.trust_remote_code=True",
            f"+{ARR}.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=13",
            *mcore("actor", tp=8, pp=2, expert_model_parallel_size=8, expert_tensor_parallel_size=1),
            *mcore("ref", tp=8, pp=2, expert_model_parallel_size=8, expert_tensor_parallel_size=1),
            *mcore("critic", tp=8, pp=2, expert_model_parallel_size=8, expert_tensor_parallel_size=1),
            *_offload("actor", False), *_offload("ref", False),
            *(f"critic.megatron.{k}=False" for k in _MCORE_OFFLOAD),
            *(f"{role}.megatron.use_dist_checkpointing=True" for role in (f"{ARR}.actor", f"{ARR}.ref", "critic")),
            *(f"{role}.megatron.dist_checkpointing_path=/ckpts/moonlight"
              for role in (f"{ARR}.actor", f"{ARR}.ref", "critic")), "trainer.val_before_train=False")),
        config_name=_MEGATRON, expect={"critic.plugin_config.tensor_model_parallel_size": 8, "trainer.n_workers": 32}),
    "ppo_trainer/run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh": Example(ppo(
        "/models/Qwen1.5-MoE-A2.7B", bs=1024, pl=1024, rl=512, mini=256, micro=4, lpm=2, cmicro=4, tp=4, gpus=8, nodes=4,
        mem=0.7, megatron=True, extra=(
            *mcore("actor", tp=4, pp=2, context_parallel_size=1, use_dist_checkpointing=True,
                   dist_checkpointing_path="/ckpts/q15moe"),
            *mcore("ref", tp=4, pp=2, context_parallel_size=1, use_dist_checkpointing=True,
                   dist_checkpointing_path="/ckpts/q15moe"),
            *mcore("critic", tp=4, pp=2, context_parallel_size=1, use_dist_checkpointing=True,
                   dist_checkpointing_path="/ckpts/q15moe"))), config_name=_MEGATRON),
    "ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh": Example(ppo(
        "Qwen/Qwen2-7B-Instruct", bs=1024, pl=1024, rl=512, mini=256, micro=4, lpm=4, cmicro=4, tp=4, gpus=8,
        megatron=True, files=GSM8K_MATH, extra=(*mcore("actor", tp=2, pp=2), *mcore("ref", tp=2, pp=2))),
        config_name=_MEGATRON),
    "ppo_trainer/run_qwen2-7b_rm.sh": Example(ppo(
        "/models/Qwen2-7B-Instruct", bs=1024, pl=1024, rl=512, mini=256, micro=16, lpm=16, cmicro=32, tp=1, gpus=8,
        mem=0.6, extra=("data.return_raw_chat=True", f"{ARR}.actor.optim.lr_warmup_steps_ratio=0.1",
                        "critic.optim.lr_warmup_steps_ratio=0.05", *_RM_LOOP,
                        "reward_model.model.path=/models/FsfairX-LLaMA3-RM-v0.1")), expect=_RM_ON),
    "ppo_trainer/run_qwen2-7b_rm_legacy.sh": Example(ppo(
        "/models/Qwen2.5-3B-Instruct", bs=1024, pl=1024, rl=2048, mini=256, micro=16, lpm=16, cmicro=32, tp=1, gpus=8,
        mem=0.6, extra=("data.return_raw_chat=True", "reward_model.enable=True", "reward_model.use_reward_loop=False",
                        "reward_model.model.path=/models/Skywork-Reward-V2-Llama-3.2-3B",
                        "reward_model.micro_batch_size_per_gpu=32")), expect=_RM_ON),
    "ppo_trainer/run_qwen2-7b_rm_reward_loop_colocate.sh": Example(ppo(
        "/models/Qwen2.5-3B-Instruct", bs=1024, pl=1024, rl=2048, mini=256, micro=16, lpm=16, cmicro=32, tp=1, gpus=8,
        mem=0.6, extra=("data.return_raw_chat=True", *_RM_LOOP,
                        "reward_model.model.path=/models/Skywork-Reward-V2-Llama-3.2-3B")), expect=_RM_ON),
    "ppo_trainer/run_qwen2-7b_rm_seq_balance.sh": Example(ppo(
        "Qwen/Qwen2-7B-Instruct", bs=4096, pl=4096, rl=4096, mini=512, tp=2, gpus=8, mem=0.5, extra=(
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=24000",
            "critic.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=98304", *_RM_LOOP,
            "reward_model.model.path=sfairXC/FsfairX-LLaMA3-RM-v0.1")), expect=_RM_ON),
    "ppo_trainer/run_qwen2-7b_rm_seq_balance_fused_kernels.sh": Example(ppo(
        "Qwen/Qwen2-7B-Instruct", bs=4096, pl=4096, rl=4096, mini=512, tp=2, gpus=8, mem=0.5, extra=(
            f"{ARR}.model.use_fused_kernels=True", f"{ARR}.model.fused_kernel_options.impl_backend=triton",
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=24000", *_RM_LOOP,
            "reward_model.model.path=sfairXC/FsfairX-LLaMA3-RM-v0.1")), expect=_RM_ON),
    "ppo_trainer/run_qwen2-7b_rm_seq_balance_nsys.sh": Example(ppo(
        "Qwen/Qwen2-7B-Instruct", bs=4096, pl=4096, rl=4096, mini=512, micro=2, cmicro=2, tp=2, gpus=8, mem=0.5, extra=(
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=12000",
            f"{ARR}.actor.profiler.enable=True", *_RM_LOOP, "reward_model.model.path=sfairXC/FsfairX-LLaMA3-RM-v0.1",
            "global_profiler.tool=nsys")), expect=_RM_ON),
    "ppo_trainer/run_qwen2-7b_seq_balance.sh": Example(ppo(
        "Qwen/Qwen2-7B-Instruct", bs=4096, pl=4096, rl=4096, mini=512, tp=2, gpus=8, mem=0.5, extra=(
            "data.return_raw_chat=True", f"{ARR}.actor.use_dynamic_bsz=True",
            f"{ARR}.actor.ppo_max_token_len_per_gpu=24000", f"{ARR}.rollout.mode=async",
            f"{ARR}.rollout.multi_turn.format=hermes", f"{ARR}.rollout.log_prob_max_token_len_per_gpu=24000",
            "critic.ppo_max_token_len_per_gpu=98304", "trainer.val_before_train=False")),
        expect={"critic.use_dynamic_bsz": True, "critic.max_token_len_per_gpu": 98304}),
    "ppo_trainer/run_qwen2-7b_sglang_seq_balance.sh": Example(ppo(
        "Qwen/Qwen2-7B-Instruct", bs=4096, pl=4096, rl=4096, mini=512, tp=2, gpus=8, mem=0.5, rollout="sglang", extra=(
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=24000",
            f"{ARR}.rollout.log_prob_max_token_len_per_gpu=24000", "critic.ppo_max_token_len_per_gpu=98304",
            "trainer.val_before_train=False"))),
    "ppo_trainer/run_qwen2.5-32b.sh": Example(ppo(
        "Qwen/Qwen2.5-32B-Instruct", bs=1024, pl=1024, rl=1024, mini=256, micro=8, lpm=16, cmicro=8, tp=4, gpus=8,
        nodes=4, mem=0.5, extra=("critic.model.enable_gradient_checkpointing=False",))),
    "ppo_trainer/run_qwen2.5-3b_rm_legacy.sh": Example(ppo(
        "/models/Qwen2.5-3B-Instruct", bs=1024, pl=1024, rl=2048, mini=256, micro=16, lpm=16, cmicro=32, tp=1, gpus=8,
        mem=0.6, extra=("reward_model.enable=True", "reward_model.use_reward_loop=False",
                        "reward_model.model.path=/models/Skywork-Reward-V2-Llama-3.2-3B")), expect=_RM_ON),
    "ppo_trainer/run_qwen2.5-3b_rm_reward_loop_colocate.sh": Example(ppo(
        "/models/Qwen2.5-3B-Instruct", bs=1024, pl=1024, rl=2048, mini=256, micro=16, lpm=16, cmicro=32, tp=1, gpus=8,
        mem=0.6, extra=(*_RM_LOOP, "reward_model.model.path=/models/Skywork-Reward-V2-Llama-3.2-3B")),
        expect=_RM_ON),
    "ppo_trainer/run_qwen3-8b_npu.sh": Example(ppo(
        "Qwen/Qwen3-8B", bs=256, pl=2000, rl=12000, mini=64, micro=1, lpm=1, cmicro=1, tp=1, gpus=8, mem=0.9, extra=(
            "data.shuffle=False", f"{ARR}.actor.ulysses_sequence_parallel_size=2", f"{ARR}.actor.use_dynamic_bsz=True",
            f"{ARR}.actor.use_torch_compile=False", f"{ARR}.rollout.max_num_batched_tokens=14000",
            f"{ARR}.rollout.max_num_seqs=64", f"{ARR}.rollout.log_prob_use_dynamic_bsz=True",
            f"{ARR}.rollout.enable_chunked_prefill=True", f"{ARR}.rollout.enforce_eager=False",
            "critic.ulysses_sequence_parallel_size=2", "critic.model.fsdp_config.param_offload=True",
            "critic.model.fsdp_config.optimizer_offload=True", "critic.use_dynamic_bsz=True",
            "trainer.val_before_train=False", "trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=1",
            "trainer.total_training_steps=100", "trainer.device=npu")),
        expect={"trainer.max_checkpoints": 1, "critic.plugin_config.param_offload": True,
                "rollout.plugin_config.max_num_seqs": 64}),
    # ------------------------------------------------------------------ examples/tuning
    "tuning/0.5b/qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh": Example(
        _tuning_lora("0.5B", procs=128, tp=1, mem=0.1, sp=1, gpus=1, n=1, micro_key="ppo_micro_batch_size_per_gpu"),
        expect={"actor.micro_batch_size": 128, "ref.micro_batch_size": 128, "rollout.max_model_len": 1536}),
    "tuning/1.5b/qwen2-1.5b_grpo-lora_1_h100_fsdp_vllm.sh": Example(
        _tuning_lora("1.5B", procs=128, tp=1, mem=0.1, sp=1, gpus=1), expect={"actor.micro_batch_size": 128}),
    "tuning/3b/qwen2-3b_grpo-lora_1_h100_fsdp_vllm.sh": Example(
        _tuning_lora("3B", procs=62, tp=1, mem=0.1, sp=1, gpus=1)),
    "tuning/7b/qwen2-7b_grpo-lora_1_h100_fsdp_vllm.sh": Example(
        _tuning_lora("7B", procs=16, tp=1, mem=0.2, sp=1, gpus=1)),
    "tuning/14b/qwen2-14b_grpo-lora_2_h100_fsdp_vllm.sh": Example(
        _tuning_lora("14B", procs=32, tp=2, mem=0.25, sp=2, gpus=2), expect={"actor.micro_batch_size": 16}),
    "tuning/32b/qwen2-32b_grpo-lora_4_h100_fsdp_vllm.sh": Example(
        _tuning_lora("32B", procs=32, tp=4, mem=0.3, sp=2, gpus=4), expect={"actor.micro_batch_size": 8}),
    "tuning/70b/qwen2-72b_grpo-lora_8_h100_fsdp_vllm.sh": Example(
        _tuning_lora("72B", procs=64, tp=8, mem=0.4, sp=2, gpus=8), expect={"actor.micro_batch_size": 8}),
    "tuning/7b/qwen2-7b_grpo_2_h800_fsdp_vllm.sh": Example(grpo(
        "/models/Qwen2-7B-Instruct", bs=1024, pl=1024, rl=1024, mini=256, micro=16, lpm=16, rlpm=16, tp=2, n=5,
        gpus=2)),
    "tuning/14b/qwen2_14b_grpo_4_h800_fsdp_vllm.sh": Example(grpo(
        "/models/Qwen2-14B-Instruct", bs=1024, pl=1024, rl=1024, mini=256, micro=16, lpm=16, rlpm=16, tp=4, n=5,
        gpus=4, mem=0.5)),
    "tuning/32b/qwen2_32B_grpo_8_h20_megatron_vllm.sh": Example(grpo(
        "/models/Qwen2-32B-Instruct", bs=512, pl=2048, rl=6144, mini=256, micro=1, lpm=1, rlpm=1, tp=8, n=5, gpus=8,
        megatron=True, extra=(*mcore("actor", tp=8, pp=1), *_offload("actor"), *_offload("ref"))),
        config_name=_MEGATRON),
    "tuning/70b/qwen2-70b_grpo_32_h20_fsdp_vllm.sh": Example(grpo(
        "/models/Qwen2-70B-Instruct", bs=1024, pl=512, rl=512, mini=256, tp=16, n=5, gpus=8, nodes=4, extra=(
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=24000")),
        expect={"rollout.tensor_parallel_size": 16, "trainer.n_workers": 32}),
    "tuning/70b/qwen2-70b_grpo_32_h800_fsdp_vllm.sh": Example(grpo(
        "/models/Qwen2-70B-Instruct", bs=1024, pl=512, rl=512, mini=256, tp=16, n=5, gpus=8, nodes=4, extra=(
            f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=24000"))),
    # ------------------------------------------------------------------ DAPO under examples/
    "gmpo_trainer/test_dapo_7b_math.sh": Example(dapo(
        "/models/Qwen2.5-Math-7B", bs=512, mini=32, n=16, tp=4, gpus=8, nodes=8, clip_low=0.4, clip_high=0.4, extra=(
            f"{ARR}.actor.policy_loss.loss_mode=geo_mean",
            f"+{ARR}.model.override_config.max_position_embeddings=32768",
            f"{ARR}.actor.fsdp_config.param_offload=True", f"{ARR}.actor.fsdp_config.optimizer_offload=True",
            f"{ARR}.ref.fsdp_config.param_offload=True", f"{ARR}.actor.ulysses_sequence_parallel_size=4",
            f"{ARR}.ref.ulysses_sequence_parallel_size=4", f"{ARR}.actor.fsdp_config.fsdp_size=32",
            f"{ARR}.actor.checkpoint.save_contents=[model,optimizer,extra]", "trainer.total_training_steps=200")),
        expect={"actor.policy_loss.loss_mode": "geo_mean", "actor.clip_ratio_high": 0.4, "trainer.total_steps": 200,
                "actor.plugin_config.fsdp_size": 32, "reward.overlong_buffer_enable": True,
                "rollout.val_temperature": 1.0, "trainer.log_val_generations": 10}),
    "gmpo_trainer/test_dapo_qwen3_30b_math.sh": Example(dapo(
        "/models/Qwen3-30B-A3B-Base", bs=512, mini=32, n=16, tp=4, gpus=8, nodes=8, clip_low=0.4, clip_high=0.4, extra=(
            f"{ARR}.actor.policy_loss.loss_mode=geo_mean", f"{ARR}.actor.fsdp_config.param_offload=True",
            f"{ARR}.actor.fsdp_config.optimizer_offload=True", f"{ARR}.ref.fsdp_config.param_offload=True",
            f"{ARR}.actor.ulysses_sequence_parallel_size=4", f"{ARR}.ref.ulysses_sequence_parallel_size=4",
            f"{ARR}.actor.fsdp_config.fsdp_size=32", f"{ARR}.actor.checkpoint.save_contents=[model,optimizer,extra]",
            "trainer.total_training_steps=300"))),
    "mtp_trainer/test_dapo_mimo_7b_with_mtp_math_megatron.sh": Example(dapo(
        "/models/MiMo-7B-RL", bs=128, mini=32, n=16, tp=4, gpus=8, nodes=16, rollout="sglang", megatron=True, extra=(
            f"{ARR}.model.mtp.enable=True", f"{ARR}.model.mtp.enable_train=True",
            f"{ARR}.model.mtp.mtp_loss_scaling_factor=0.1", f"{ARR}.model.mtp.detach_encoder=True",
            f"{ARR}.actor.clip_ratio_c=10.0", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2",
            *_offload("actor"), *mcore("actor", tp=2, pp=2, context_parallel_size=2),
            *mcore("ref", tp=2, pp=2, context_parallel_size=2), f"{ARR}.actor.optim.clip_grad=1.0")),
        config_name=_MEGATRON, refused=f"{ARR}.model.mtp.enable"),
    "sglang_multiturn/run_qwen3_4b_dapo_multiturn.sh": Example(grpo(
        "font-info/qwen3-4b-sft-SGLang-RL", bs=32, pl=2048, rl=16384, mini=32, micro=8, lpm=4, rlpm=4, tp=1, n=8,
        gpus=8, kl_loss=False, kl_coef=0.0, mem=0.85, rollout="sglang", extra=(
            "algorithm.kl_ctrl.kl_coef=0.0", "data.return_raw_chat=True", "data.custom_cls.path=recipe/retool/retool.py",
            "data.custom_cls.name=CustomRLHFDataset", "custom_reward_function.path=recipe/retool/retool.py",
            "custom_reward_function.name=compute_score", f"{ARR}.actor.clip_ratio_high=0.28",
            f"{ARR}.actor.clip_ratio_c=10.0", f"{ARR}.rollout.mode=async", f"{ARR}.rollout.multi_turn.enable=True",
            f"{ARR}.rollout.multi_turn.max_user_turns=16", f"{ARR}.rollout.multi_turn.max_assistant_turns=16",
            f"{ARR}.rollout.multi_turn.tool_config_path=recipe/retool/sandbox_fusion_tool_config.yaml",
            f"{ARR}.rollout.multi_turn.format=hermes", f"{ARR}.rollout.val_kwargs.n=30",
            "trainer.log_val_generations=20")),
        refused=("data.custom_cls.path", f"{ARR}.rollout.multi_turn.tool_config_path",
                 f"{ARR}.rollout.multi_turn.max_user_turns")),
    "sglang_multiturn/gsm8k_toolcall_shaping/run_gsm8k_grpo_toolcall_shaping.sh": Example(grpo(
        "Qwen/Qwen2.5-0.5B-Instruct", bs=256, pl=1024, rl=1024, mini=64, micro=8, lpm=32, rlpm=32, tp=2, n=16, gpus=4,
        rollout="sglang", mem=0.5, extra=(
            "data.sampler.class_name=RandomCurriculumSampler", "data.sampler.class_path=pkg://tests.utils.dataset",
            "data.dataloader_num_workers=0", "data.return_raw_chat=True",
            "custom_reward_function.path=examples/sglang_multiturn/gsm8k_toolcall_shaping/gsm8k_toolcall_shaping.py",
            "custom_reward_function.name=compute_score",
            f"{ARR}.rollout.multi_turn.tool_config_path=examples/sglang_multiturn/config/gsm8k_tool_config.yaml")),
        refused=("data.sampler.class_path", f"{ARR}.rollout.multi_turn.tool_config_path")),
}
