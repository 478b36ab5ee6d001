"""The FSDP2 engine: :class:`polyrl.protocols.Engine` over transformers models.

Each decoder layer and the whole model are ``fully_shard``-ed over a 1-D device
mesh (pure data parallelism). The model sits inside :class:`_Head`, a root module
whose forward runs the backbone and then the LM head on the response positions
only, in chunks, so ``[tokens x vocab]`` logits never exist whole.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from polyrl.batch import require_fields
from polyrl.errors import CheckpointError, ConfigError
from polyrl.protocols import LossScale
from polyrl_engine_fsdp.config import FSDPConfig

_NEEDED = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


# ---------------------------------------------------------------------------- the root module


class _Head(nn.Module):
    """Backbone + chunked LM head (log-probs / entropy) or value head, on response positions only."""

    def __init__(self, model: nn.Module, model_type: str, chunk: int) -> None:
        super().__init__()
        self.model = model
        self.model_type = model_type
        self.chunk = chunk

    def _parts(self) -> tuple[nn.Module, nn.Module]:
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        head = inner.score if self.model_type == "value" else inner.get_output_embeddings()
        return inner.base_model, head

    def forward(self, input_ids, attention_mask, position_ids, responses, temperature: float = 1.0,
                compute_entropy: bool = False) -> dict[str, torch.Tensor]:
        backbone, head = self._parts()
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        r = responses.shape[1]
        # the token at response position t is predicted from position P - 1 + t
        h = hidden[:, -r - 1 : -1, :]
        if self.model_type == "value":
            return {"values": head(hidden[:, -r:, :]).squeeze(-1).float().clone()}
        flat_h, flat_y = h.reshape(-1, h.shape[-1]), responses.reshape(-1)
        logps, ents = [], []
        for start in range(0, flat_h.shape[0], self.chunk):
            hs, ys = flat_h[start : start + self.chunk], flat_y[start : start + self.chunk]
            if torch.is_grad_enabled():
                lp, ent = torch.utils.checkpoint.checkpoint(
                    _chunk_logprob, hs, ys, head.weight, head.bias, temperature, compute_entropy, use_reentrant=False)
            else:
                lp, ent = _chunk_logprob(hs, ys, head.weight, head.bias, temperature, compute_entropy)
            logps.append(lp)
            ents.append(ent)
        # clone: FSDP2 must not hand out views of its output (an in-place op would skip its backward hook)
        out = {"log_probs": torch.cat(logps).view(responses.shape).clone()}
        if compute_entropy:
            out["entropy"] = torch.cat(ents).view(responses.shape).clone()
        return out


def _chunk_logprob(h, y, weight, bias, temperature: float, compute_entropy: bool):
    logits = F.linear(h, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if compute_entropy else torch.zeros_like(token_logp)
    return token_logp, entropy


# ---------------------------------------------------------------------------- the engine


class FSDPEngine:
    """FSDP2 engine for the ``actor``, ``ref`` (no optimizer) and ``critic`` (``model_type="value"``) roles."""

    def __init__(self, config: Any, *, role: str, model_type: str = "causal_lm", platform: Any = None) -> None:
        from polyrl.platforms import detect_platform

        self.config = config
        self.role = role
        self.model_type = model_type
        self.fsdp: FSDPConfig = config.plugin_config if isinstance(config.plugin_config, FSDPConfig) else FSDPConfig()
        self.platform = platform or detect_platform()
        self.device = self.platform.current_device()
        self.temperature = 1.0
        _ensure_process_group(self.platform.dist_backend)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self.step = 0
        self.lora = config.model.lora.rank > 0
        self._build_model()
        self.optimizer = self.scheduler = None
        if role != "ref":
            self._build_optimizer()

    # ------------------------------------------------------------------ construction
    @property
    def dp_rank(self) -> int:
        return self._rank

    @property
    def dp_size(self) -> int:
        return self._world

    def _build_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import AutoConfig

        mcfg = self.config.model
        path = Path(mcfg.path)
        if not (path / "config.json").exists():
            raise ConfigError(f"{self.role}.model.path={mcfg.path}: no HF model there (config.json is missing)")
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=mcfg.trust_remote_code, **mcfg.override_config)
        archs = getattr(hf_config, "architectures", None) or []
        if archs and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
            raise ConfigError(f"{self.role}.model.path={mcfg.path}: {archs} is not a causal LM; the fsdp engine "
                              "trains causal LMs and value models built from them")
        self.hf_config = hf_config
        dtype = getattr(torch, mcfg.dtype)
        torch.manual_seed(self.config.seed)
        model = self._load_hf(path, hf_config, dtype, mcfg)
        if mcfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            model = self._apply_lora(model, mcfg.lora)
        root = _Head(model, self.model_type, max(1, self.config.logits_chunk_size))
        mesh = init_device_mesh(self.platform.device_type, (self._world,))
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, self.fsdp.param_dtype),
                                  reduce_dtype=getattr(torch, self.fsdp.reduce_dtype))
        kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": self.fsdp.reshard_after_forward}
        if self.fsdp.param_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        layer_names = set(getattr(model, "_no_split_modules", None) or getattr(
            getattr(model, "get_base_model", lambda: model)(), "_no_split_modules", None) or [])
        for module in root.modules():
            if type(module).__name__ in layer_names:
                fully_shard(module, **kwargs)
        fully_shard(root, **kwargs)
        if not self.fsdp.param_offload:
            root.to(self.device)
        self.module = root

    def _load_hf(self, path: Path, hf_config: Any, dtype: torch.dtype, mcfg: Any) -> nn.Module:
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        cls = AutoModelForTokenClassification if self.model_type == "value" else AutoModelForCausalLM
        kwargs: dict[str, Any] = {"attn_implementation": mcfg.attn_implementation,
                                  "trust_remote_code": mcfg.trust_remote_code}
        if self.model_type == "value":
            hf_config.num_labels = 1
        if mcfg.random_init:
            model = cls.from_config(hf_config, dtype=dtype, **kwargs)
        else:
            model = cls.from_pretrained(path, config=hf_config, dtype=dtype, **kwargs)
        if self.model_type == "value":
            nn.init.zeros_(model.score.weight)
        return model

    def _apply_lora(self, model: nn.Module, lora: Any) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        targets = list(lora.target_modules)
        target = "all-linear" if targets == ["all-linear"] else targets
        try:
            return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                    target_modules=target, bias="none"))
        except ValueError as exc:
            names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise ConfigError(f"{self.role}.model.lora.target_modules={targets} matches no module of the model "
                              f"({exc}). Linear layers it has: {', '.join(names)}") from None

    def _build_optimizer(self) -> None:
        o = self.config.optim
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        total = max(1, o.total_steps)
        warmup = o.warmup_steps or int(o.warmup_ratio * total)

        def factor(step: int) -> float:
            if warmup and step < warmup:
                return (step + 1) / warmup
            if o.lr_scheduler == "cosine":
                progress = min(1.0, (step - warmup) / max(1, total - warmup))
                return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
            if o.lr_scheduler != "constant":
                raise ConfigError(f"{self.role}.optim.lr_scheduler={o.lr_scheduler!r}: choose constant or cosine")
            return 1.0

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    # ------------------------------------------------------------------ forward passes
    def _forward(self, mb: TensorDict, temperature: float, compute_entropy: bool) -> dict[str, torch.Tensor]:
        mb = _trim(mb)
        return self.module(mb["input_ids"].to(self.device), mb["attention_mask"].to(self.device),
                           mb["position_ids"].to(self.device), mb["responses"].to(self.device),
                           temperature=temperature, compute_entropy=compute_entropy), mb

    def _micro_batches(self, batch: TensorDict) -> list[TensorDict]:
        cfg = self.config
        size = batch.batch_size[0]
        if cfg.use_dynamic_bsz:
            lengths = batch["attention_mask"].sum(-1).tolist()
            order = sorted(range(size), key=lambda i: -lengths[i])
            groups: list[list[int]] = []
            budget = cfg.max_token_len_per_gpu
            for i in order:  # first-fit decreasing by tokens; padding inside a group is trimmed later
                for g in groups:
                    width = max(lengths[j] for j in g + [i])
                    if width * (len(g) + 1) <= budget:
                        g.append(i)
                        break
                else:
                    groups.append([i])
            groups = [sorted(g) for g in groups]
            mbs = [batch[torch.tensor(g)] for g in groups]
        else:
            step = max(1, cfg.micro_batch_size)
            mbs = [batch[i : i + step] for i in range(0, size, step)]
        # every rank must run the same number of forward/backward passes (they are collective)
        count = torch.tensor([len(mbs)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(mbs) < int(count):
            dummy = batch[:1].clone()
            dummy["response_mask"] = torch.zeros_like(dummy["response_mask"])
            mbs.append(dummy)
        return mbs

    @torch.no_grad()
    def infer_batch(self, batch: TensorDict, *, temperature: float = 1.0, compute_entropy: bool = False,
                    disable_adapter: bool = False) -> TensorDict:
        require_fields(batch, _NEEDED, f"{self.role} engine infer_batch")
        self.module.eval()
        outs: dict[str, list[torch.Tensor]] = {}
        width = batch["responses"].shape[1]
        step = max(1, self.config.micro_batch_size)
        n_chunks = torch.tensor([math.ceil(batch.batch_size[0] / step)])
        dist.all_reduce(n_chunks, op=dist.ReduceOp.MAX)
        ctx = self.module.model.disable_adapter() if disable_adapter and self.lora else _nullcontext()
        with ctx:
            for k in range(int(n_chunks)):
                mb = batch[k * step : (k + 1) * step]
                if mb.batch_size[0] == 0:
                    self._forward(batch[:1], temperature, False)  # keep collectives in step
                    continue
                out, trimmed = self._forward(mb, temperature, compute_entropy)
                for key, value in out.items():
                    padded = torch.zeros(value.shape[0], width, dtype=torch.float32)
                    padded[:, : value.shape[1]] = value.float().cpu()
                    outs.setdefault(key, []).append(padded * mb["response_mask"].float())
        return TensorDict({k: torch.cat(v) for k, v in outs.items()}, batch_size=batch.batch_size)

    def train_batch(self, batch: TensorDict, loss_fn: Any) -> dict[str, float]:
        require_fields(batch, _NEEDED, f"{self.role} engine train_batch")
        if self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine has no optimizer (role 'ref' only infers)")
        self.module.train()
        totals = torch.tensor([float(batch["response_mask"].sum()), float(batch.batch_size[0])], dtype=torch.float64)
        dist.all_reduce(totals)
        scale = LossScale(dp_size=self._world, batch_num_tokens=int(totals[0]), global_batch_size=int(totals[1]))
        metrics: dict[str, float] = {}
        mbs = self._micro_batches(batch)
        for mb in mbs:
            out, trimmed = self._forward(mb, self.temperature, compute_entropy=self.model_type != "value")
            loss, m = loss_fn(out, trimmed, scale)
            loss.backward()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) / len(mbs)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.module.parameters() if p.requires_grad], self.config.optim.grad_clip or float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            metrics["skipped_step"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        prefix = "critic" if self.model_type == "value" else "actor"
        metrics[f"{prefix}/grad_norm"] = grad_norm
        metrics[f"{prefix}/lr"] = lr
        return metrics

    # ------------------------------------------------------------------ weights
    def _full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) one parameter at a time (collective); LoRA merged per module."""
        lora_mods = {}
        if self.lora:
            from peft.tuners.lora import LoraLayer

            lora_mods = {n: m for n, m in self.module.named_modules() if isinstance(m, LoraLayer)}
        for name, param in self.module.named_parameters():
            if ".lora_" in name:
                continue
            full = _full(param)
            hf = _hf_name(name)
            if self.lora and name.endswith(".base_layer.weight"):
                mod = lora_mods[name[: -len(".base_layer.weight")]]
                full = full.clone()
                for adapter in mod.active_adapters:
                    a = _full(mod.lora_A[adapter].weight)
                    b = _full(mod.lora_B[adapter].weight)
                    full += (b.float() @ a.float()).to(full.dtype) * mod.scaling[adapter]
            yield hf, full

    def _adapter_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            if ".lora_" in name:
                yield _adapter_name(name), _full(param)

    def weights_for_rollout(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        source = self._adapter_params() if self.lora and self.config.model.lora.sync == "adapter" else self._full_params()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in source:
            bucket.append((name, tensor.detach()))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    # ------------------------------------------------------------------ checkpoints
    def _fingerprint(self) -> str:
        return ";".join(f"{n}:{tuple(p.shape)}" for n, p in self.module.named_parameters())

    def _dcp_state(self) -> dict[str, Any]:
        """Model (and optimizer) state dicts in the form torch.distributed.checkpoint saves and loads."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.optimizer is None:
            return {"model": get_state_dict(self.module, [])[0]}
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        final = Path(path)
        token = [uuid.uuid4().hex[:8] if self._rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        tmp = final.parent / f"{final.name}.tmp-{token[0]}"
        state = self._dcp_state()
        dcp.save(state, checkpoint_id=str(tmp))
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        torch.save({"rng": rng, "scheduler": self.scheduler.state_dict() if self.scheduler else None},
                   tmp / f"extra_rank{self._rank}.pt")
        dist.barrier()
        if self._rank == 0:
            meta = {"world_size": self._world, "step": self.step, "role": self.role, "model_type": self.model_type,
                    "fingerprint": self._fingerprint(), "format": "polyrl-fsdp-1"}
            (tmp / "meta.json").write_text(json.dumps(meta))
            old = None
            if final.exists():
                old = final.parent / f"{final.name}.old-{token[0]}"
                os.replace(final, old)
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        folder = Path(path)
        meta_file = folder / "meta.json"
        if not meta_file.exists():
            raise CheckpointError(f"{folder} is not an fsdp engine checkpoint (no meta.json)")
        meta = json.loads(meta_file.read_text())
        if meta["world_size"] != self._world:
            raise CheckpointError(f"checkpoint {folder} was written by {meta['world_size']} ranks; this {self.role} "
                                  f"group has {self._world}. Resume with the same trainer.n_workers.")
        if meta["fingerprint"] != self._fingerprint():
            raise CheckpointError(f"checkpoint {folder} holds a different model (parameter names/shapes differ from "
                                  f"{self.role}.model.path={self.config.model.path})")
        state = self._dcp_state()
        dcp.load(state, checkpoint_id=str(folder))
        if self.optimizer is not None:
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_state_dict(self.module, [], model_state_dict=state["model"], optim_state_dict={})
        extra = torch.load(folder / f"extra_rank{self._rank}.pt", weights_only=False)
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"]["torch"])
        random.setstate(extra["rng"]["python"])
        self.step = meta["step"]

    def export_hf(self, path: str) -> None:
        from safetensors.torch import save_file

        out = Path(path)
        adapter = self.lora and self.fsdp.lora_export == "adapter"
        tensors = {n: t.detach().cpu().contiguous() for n, t in (self._adapter_params() if adapter else self._full_params())}
        if self._rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if adapter:
                peft_cfg = self.module.model.peft_config["default"]
                peft_cfg.save_pretrained(str(out))
                save_file(tensors, str(out / "adapter_model.safetensors"))
            else:
                if getattr(self.hf_config, "tie_word_embeddings", False):
                    tensors.pop("lm_head.weight", None)
                self.hf_config.save_pretrained(out)
                save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
            tok_src = self.config.model.tokenizer_path or self.config.model.path
            try:
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(tok_src).save_pretrained(out)
            except (OSError, ValueError):
                pass  # a model folder without a tokenizer exports without one
        dist.barrier()

    # ------------------------------------------------------------------ memory
    def offload(self) -> None:
        if self.device.type == "cpu" or self.fsdp.param_offload:
            return
        self.module.to("cpu")
        _move_optimizer(self.optimizer, "cpu")
        self.platform.empty_cache()

    def onload(self) -> None:
        if self.device.type == "cpu" or self.fsdp.param_offload:
            return
        self.module.to(self.device)
        if not self.fsdp.optimizer_offload:
            _move_optimizer(self.optimizer, self.device)


# ---------------------------------------------------------------------------- helpers


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _ensure_process_group(backend: str) -> None:
    if dist.is_initialized():
        return
    from polyrl.controller.distributed import free_port, init_distributed

    init_distributed(backend, 0, 1, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                     int(os.environ.get("MASTER_PORT", 0)) or free_port())


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param.data


def _hf_name(name: str, keep_lora: bool = False) -> str:
    """Parameter name inside the engine -> HF checkpoint name."""
    name = name[len("model."):] if name.startswith("model.") else name  # the _Head wrapper
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    if not keep_lora:
        name = name.replace(".base_layer.", ".")
    return name


def _adapter_name(name: str) -> str:
    """A LoRA parameter inside the engine -> its name in a peft ``adapter_model.safetensors``."""
    name = name[len("model."):] if name.startswith("model.") else name  # the _Head wrapper
    # peft drops the adapter name on save: ...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight
    for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        name = re.sub(rf"\.{part}\.[^.]+\.", f".{part}.", name)
    return name


def _trim(mb: TensorDict) -> TensorDict:
    """Drop all-padding columns: left of the longest prompt, right of the longest response."""
    attn = mb["attention_mask"]
    r = mb["responses"].shape[1]
    prompt_attn, resp_attn = attn[:, :-r], attn[:, -r:]
    keep_p = int(prompt_attn.sum(-1).max()) if prompt_attn.numel() else 0
    keep_r = max(1, int(resp_attn.sum(-1).max()))
    p = prompt_attn.shape[1]
    cols = torch.cat([torch.arange(p - keep_p, p), torch.arange(p, p + keep_r)])
    out = mb.clone(False)
    for key in ("input_ids", "attention_mask", "position_ids"):
        out[key] = mb[key][:, cols]
    for key in mb.keys():
        value = mb.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == r and key not in (
                "input_ids", "attention_mask", "position_ids"):
            out[key] = value[:, :keep_r]
    return out


def _move_optimizer(optimizer: Any, device: Any) -> None:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to(device)
