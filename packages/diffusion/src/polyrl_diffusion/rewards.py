"""Offline image rewards and the reward manager that scores a batch of generated images.

An *image reward* is a callable on a batch of images::

    fn(images, prompts, ground_truths=None, extra_infos=None) -> scores

``images`` arrive as a uint8 array ``[B, H, W, 3]`` (:func:`as_uint8_images` also takes
torch tensors, float images in [0, 1], channels-first batches and PIL images); ``scores``
is anything with ``B`` finite numbers (a tensor, an array, a list), or a dict with a
``"score"`` entry and more per-sample entries (logged as metrics). A function may take
only ``(images, prompts)``: a user's reward model is exactly that (:class:`CallableReward`).

Built in (registered as reward functions, docs/diffusion.md "Rewards"):

- ``jpeg_compressibility``: ``-size`` of the image as JPEG (quality 95) in kB: smaller files
  score higher. ``jpeg_incompressibility``: ``+size`` in kB. (verl's documentation and its code
  disagree on which of the two is which; polyrl follows the names: *compressibility* rewards
  compressible images, as in DDPO and Flow-GRPO.)
- ``brightness`` (mean pixel value in [0, 1]) and ``colourfulness`` (Hasler and Suesstrunk's
  metric / 100, about 0.86 for pure red): cheap, deterministic rewards for tests and demos.
- ``ocr``: ``1 - normalised edit distance`` between the text RapidOCR reads in the image and
  the target text (the ground truth, else the text in quotes in the prompt), as in Flow-GRPO's
  OCR task. Its ONNX models ship inside the ``rapidocr`` wheel: no download.
- :class:`WeightedReward`: several rewards combined with weights.

A reward that returns NaN/inf or the wrong number of scores raises :class:`RewardError`
naming the reward: an image model silently trained on a fallback score is worse than a stop.
"""

from __future__ import annotations

import inspect
import io
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from polyrl_diffusion.agent_loop import prompt_text

log = logging.getLogger("polyrl_diffusion.rewards")

ImageReward = Callable[..., Any]
#: JPEG quality used by the compressibility rewards (DDPO / Flow-GRPO use 95)
JPEG_QUALITY = 95


class RewardError(ValueError):
    """A reward returned something unusable (NaN, inf, the wrong number of scores); names the reward."""


# --------------------------------------------------------------------------- images


def as_uint8_images(images: Any) -> np.ndarray:
    """A uint8 array ``[B, H, W, 3]`` from a batch of images.

    Accepts a torch tensor or numpy array ``[B, H, W, 3]`` / ``[B, 3, H, W]`` (one image without the
    batch dimension too), uint8 or float in [0, 1], and a PIL image or a list of them. Grayscale
    (one channel) and RGBA are turned into RGB.
    """
    if isinstance(images, (list, tuple)):
        if not images:
            return np.zeros((0, 1, 1, 3), dtype=np.uint8)
        return np.stack([as_uint8_images(im)[0] for im in images])
    if hasattr(images, "convert") and hasattr(images, "size"):  # a PIL image
        return np.asarray(images.convert("RGB"), dtype=np.uint8)[None]
    if isinstance(images, torch.Tensor):
        images = images.detach().cpu()
        images = images.float().numpy() if images.is_floating_point() else images.numpy()
    arr = np.asarray(images)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4:
        raise ValueError(f"images must be [B, H, W, 3] (or [B, 3, H, W]), got shape {arr.shape}")
    if arr.shape[-1] not in (1, 3, 4) and arr.shape[1] in (1, 3, 4):
        arr = arr.transpose(0, 2, 3, 1)
    if arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"images must have 1, 3 or 4 channels, got shape {arr.shape}")
    if arr.dtype != np.uint8:
        if np.issubdtype(arr.dtype, np.floating):
            if not np.isfinite(arr).all():
                raise ValueError("images hold NaN/inf pixel values")
            arr = np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8)
        else:
            arr = np.clip(arr, 0, 255).astype(np.uint8)
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    elif arr.shape[-1] == 4:
        arr = arr[..., :3]
    return np.ascontiguousarray(arr)


def jpeg_sizes_kb(images: Any, quality: int = JPEG_QUALITY) -> np.ndarray:
    """Size of each image saved as JPEG at ``quality``, in kB (1000 bytes)."""
    from PIL import Image

    sizes = []
    for img in as_uint8_images(images):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return np.asarray(sizes, dtype=np.float64)


# --------------------------------------------------------------------------- built-in rewards


def jpeg_compressibility(images: Any, prompts: Sequence[str] | None = None, **kwargs: Any) -> torch.Tensor:
    """``-(JPEG size in kB)``: the more compressible (smaller as JPEG) the image, the higher."""
    return torch.from_numpy(-jpeg_sizes_kb(images)).float()


def jpeg_incompressibility(images: Any, prompts: Sequence[str] | None = None, **kwargs: Any) -> torch.Tensor:
    """``+(JPEG size in kB)``: the less compressible (larger as JPEG) the image, the higher."""
    return torch.from_numpy(jpeg_sizes_kb(images)).float()


def brightness(images: Any, prompts: Sequence[str] | None = None, **kwargs: Any) -> torch.Tensor:
    """Mean pixel value over all channels, in [0, 1] (0 black, 1 white)."""
    arr = as_uint8_images(images).astype(np.float64) / 255.0
    return torch.from_numpy(arr.reshape(arr.shape[0], -1).mean(-1)).float()


def colourfulness(images: Any, prompts: Sequence[str] | None = None, **kwargs: Any) -> torch.Tensor:
    """Hasler and Suesstrunk's colourfulness ``sqrt(s_rg^2 + s_yb^2) + 0.3 sqrt(m_rg^2 + m_yb^2)`` / 100.

    ``rg = R - G``, ``yb = (R + G) / 2 - B`` on 0..255 pixels; 0 for any gray image, 0.86 for
    pure red.
    """
    arr = as_uint8_images(images).astype(np.float64)
    r, g, b = arr[..., 0], arr[..., 1], arr[..., 2]
    rg = (r - g).reshape(arr.shape[0], -1)
    yb = (0.5 * (r + g) - b).reshape(arr.shape[0], -1)
    value = np.sqrt(rg.std(-1) ** 2 + yb.std(-1) ** 2) + 0.3 * np.sqrt(rg.mean(-1) ** 2 + yb.mean(-1) ** 2)
    return torch.from_numpy(value / 100.0).float()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one character each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def quoted_text(prompt: str) -> str:
    """The target text of an OCR prompt: what is between the first pair of double (else single) quotes;
    the whole prompt without quotes."""
    for quote in ('"', "'"):
        parts = prompt.split(quote)
        if len(parts) >= 3:
            return parts[1]
    return prompt


def _normalise_text(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_text_score(recognised: str, target: str) -> float:
    """Flow-GRPO's OCR score: ``1 - min(d, n) / n`` with ``d`` the edit distance between the recognised and
    the target text and ``n`` the target's length, both lower-cased without spaces; 1 when the target
    appears inside the recognised text."""
    rec, tgt = _normalise_text(recognised), _normalise_text(target)
    if not tgt:
        return 1.0 if not rec else 0.0
    dist = 0 if tgt in rec else edit_distance(rec, tgt)
    return 1.0 - min(dist, len(tgt)) / len(tgt)


class OcrReward:
    """``1 - normalised edit distance`` between the text RapidOCR reads and the target text.

    The target of sample ``i`` is ``ground_truths[i]`` when given (verl rows:
    ``reward_model.ground_truth``), else the quoted text of ``prompts[i]``. The OCR engine
    (``rapidocr`` with ``onnxruntime``; models inside the wheel) is built on the first call and
    shared by the threads of this process. ``min_confidence``: recognised pieces below it are dropped.
    ``det_max_side``: images whose longer side exceeds it are shrunk for text detection (RapidOCR's own
    default *enlarges* every image to 736 px on its shorter side, 10x slower on small images).
    """

    def __init__(self, min_confidence: float = 0.0, engine: Any = None, det_max_side: int = 960) -> None:
        self.min_confidence = min_confidence
        self.det_max_side = det_max_side
        self._engine = engine
        self._lock = threading.Lock()

    def _get_engine(self) -> Any:
        with self._lock:
            if self._engine is None:
                try:
                    from rapidocr import RapidOCR
                except ImportError as exc:
                    raise ImportError("the ocr reward needs rapidocr and onnxruntime: pip install "
                                      "'polyrl-diffusion[ocr]' (or pip install rapidocr onnxruntime)") from exc
                self._engine = RapidOCR(params={"Global.use_cls": False, "Global.log_level": "warning",
                                                "Det.limit_type": "max", "Det.limit_side_len": self.det_max_side})
                from polyrl.logs import route_library_logger

                # its warnings ("The text detection result is empty", one per image without text) go to the run's
                # log file; only its errors reach the console
                route_library_logger("RapidOCR", logging.ERROR)
            return self._engine

    def recognise(self, image: np.ndarray) -> str:
        """The text read in one uint8 ``[H, W, 3]`` image, pieces joined in reading order."""
        engine = self._get_engine()
        with self._lock:  # one onnxruntime session; calls from several threads queue here
            result = engine(np.ascontiguousarray(image))
        texts = getattr(result, "txts", None) or ()
        scores = getattr(result, "scores", None) or (1.0,) * len(texts)
        return "".join(t for t, s in zip(texts, scores) if s >= self.min_confidence)

    def __call__(self, images: Any, prompts: Sequence[str], ground_truths: Sequence[Any] | None = None,
                 **kwargs: Any) -> dict[str, Any]:
        """Scores in [0, 1] and the recognised texts (``{"score": [...], "ocr_text": [...]}``)."""
        arr = as_uint8_images(images)
        targets = [str(gt) if gt is not None else quoted_text(p)
                   for gt, p in zip(ground_truths or [None] * len(prompts), prompts)]
        if len(targets) != arr.shape[0]:
            raise ValueError(f"ocr reward: {arr.shape[0]} images but {len(targets)} prompts")
        texts = [self.recognise(img) for img in arr]
        return {"score": [ocr_text_score(t, g) for t, g in zip(texts, targets)], "ocr_text": texts}


_OCR = OcrReward()


def ocr(images: Any, prompts: Sequence[str], ground_truths: Sequence[Any] | None = None,
        **kwargs: Any) -> dict[str, Any]:
    """The ``ocr`` reward with this process's shared :class:`OcrReward`."""
    return _OCR(images, prompts, ground_truths)


# --------------------------------------------------------------------------- calling and checking rewards


def describe_reward(fn: Any) -> str:
    """A reward's name for messages: its ``name`` attribute, qualified name or repr."""
    name = getattr(fn, "name", None) or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        name = type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and not getattr(fn, "name", None) else str(name)


def check_scores(name: str, scores: Any, n: int) -> torch.Tensor:
    """``scores`` as a float32 tensor ``[n]``; :class:`RewardError` naming the reward if it is not ``n`` finite
    numbers (a ``[n, 1]`` column is accepted)."""
    try:
        values = torch.as_tensor(np.asarray(scores.detach().cpu() if isinstance(scores, torch.Tensor) else scores,
                                            dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise RewardError(f"reward {name} returned {type(scores).__name__} that is not a list of numbers: {exc}") \
            from None
    if values.dim() == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if values.dim() != 1 or values.shape[0] != n:
        raise RewardError(f"reward {name} returned scores of shape {tuple(values.shape)} for {n} images; "
                          f"it must return one number per image, shape ({n},)")
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        where = bad.nonzero().flatten().tolist()[:5]
        raise RewardError(f"reward {name} returned NaN/inf for {int(bad.sum())} of {n} images (e.g. index "
                          f"{where}); fix the reward or clamp its output")
    return values.float()


def _takes(fn: Any) -> set[str] | None:
    """Keyword names ``fn`` accepts (None: it takes ``**kwargs``, so everything)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {"images", "prompts"}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def call_reward(fn: ImageReward, images: Any, prompts: Sequence[str], ground_truths: Sequence[Any] | None = None,
                extra_infos: Sequence[dict] | None = None) -> tuple[torch.Tensor, dict[str, list]]:
    """Run one image reward and check its output: ``(scores [B] float32, extra per-sample lists)``.

    ``fn`` gets ``(images, prompts)`` and, when its signature takes them, ``ground_truths`` and
    ``extra_infos``. A dict result must hold ``score``; its other entries of length ``B`` come back
    as extras.
    """
    arr = as_uint8_images(images)
    n = arr.shape[0]
    if len(prompts) != n:
        raise ValueError(f"{n} images but {len(prompts)} prompts")
    takes = _takes(fn)
    kwargs: dict[str, Any] = {}
    if takes is None or "ground_truths" in takes:
        kwargs["ground_truths"] = list(ground_truths) if ground_truths is not None else [None] * n
    if takes is None or "extra_infos" in takes:
        kwargs["extra_infos"] = list(extra_infos) if extra_infos is not None else [{}] * n
    result = fn(arr, list(prompts), **kwargs)
    name = describe_reward(fn)
    extra: dict[str, list] = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            raise RewardError(f"reward {name} returned a dict without 'score' (keys: {sorted(result)})")
        for key, value in result.items():
            if key != "score" and hasattr(value, "__len__") and len(value) == n:
                extra[key] = list(value.tolist() if hasattr(value, "tolist") else value)
        result = result["score"]
    return check_scores(name, result, n), extra


class CallableReward:
    """A user's reward model as an image reward: ``model(images, prompts) -> scores`` (``B`` numbers).

    ``images`` is what ``image_format`` says: ``"uint8"`` (numpy ``[B, H, W, 3]``), ``"float"``
    (a torch float tensor ``[B, 3, H, W]`` in [0, 1], what most vision models eat) or ``"pil"`` (a list
    of PIL images). ``scale`` / ``shift`` map its output (``scale * s + shift``).
    """

    def __init__(self, model: Callable[..., Any], *, name: str | None = None, image_format: str = "uint8",
                 scale: float = 1.0, shift: float = 0.0) -> None:
        if image_format not in ("uint8", "float", "pil"):
            raise ValueError(f"image_format={image_format!r}: choose uint8, float or pil")
        self.model, self.image_format, self.scale, self.shift = model, image_format, scale, shift
        self.name = name or describe_reward(model)

    def __call__(self, images: Any, prompts: Sequence[str], **kwargs: Any) -> torch.Tensor:
        arr = as_uint8_images(images)
        if self.image_format == "float":
            arg: Any = torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255.0
        elif self.image_format == "pil":
            from PIL import Image

            arg = [Image.fromarray(a) for a in arr]
        else:
            arg = arr
        with torch.no_grad():
            scores = self.model(arg, list(prompts))
        return self.scale * check_scores(self.name, scores, arr.shape[0]) + self.shift


class WeightedReward:
    """``sum_k w_k * reward_k(images, prompts, ...)``; each component's scores come back as an extra
    (``reward/<name>`` in the metrics). ``components``: ``{name or callable: weight}`` or ``[(reward, weight)]``;
    names are resolved with :func:`build_image_reward`."""

    def __init__(self, components: Mapping[Any, float] | Sequence[tuple[Any, float]]) -> None:
        items = list(components.items()) if isinstance(components, Mapping) else list(components)
        if not items:
            raise ValueError("a weighted reward needs at least one component")
        self.components: list[tuple[str, ImageReward, float]] = []
        for spec, weight in items:
            fn = build_image_reward(spec)
            label = spec if isinstance(spec, str) else describe_reward(fn)
            if not math.isfinite(float(weight)):
                raise ValueError(f"weight of reward {label} must be a finite number, got {weight!r}")
            self.components.append((label, fn, float(weight)))
        self.name = " + ".join(f"{w:g}*{label}" for label, _, w in self.components)

    def __call__(self, images: Any, prompts: Sequence[str], ground_truths: Sequence[Any] | None = None,
                 extra_infos: Sequence[dict] | None = None) -> dict[str, Any]:
        arr = as_uint8_images(images)
        total = torch.zeros(arr.shape[0])
        out: dict[str, Any] = {}
        for label, fn, weight in self.components:
            scores, _ = call_reward(fn, arr, prompts, ground_truths, extra_infos)
            total += weight * scores
            out[label] = scores.tolist()
        out["score"] = total.tolist()
        return out


def build_image_reward(spec: Any) -> ImageReward:
    """An image reward from ``spec``: a callable, a registered reward function name (``ocr``...),
    ``path/to/file.py:function``, ``package.module:attr``, a ``{name: weight}`` mapping or a
    ``"name=weight,name=weight"`` string (both :class:`WeightedReward`)."""
    if callable(spec):
        return spec
    if isinstance(spec, Mapping):
        return WeightedReward(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"an image reward must be a name, an import string, a mapping or a callable, got {spec!r}")
    spec = spec.strip()
    if "=" in spec:
        parts = {}
        for piece in spec.split(","):
            name, _, weight = piece.partition("=")
            try:
                parts[name.strip()] = float(weight)
            except ValueError:
                raise ValueError(f"reward spec {spec!r}: weight {weight!r} of {name.strip()!r} is not a number") \
                    from None
        return WeightedReward(parts)
    if ":" in spec and not spec.endswith(".py") and ".py:" not in spec:
        from polyrl.registry import resolve_import_string

        return resolve_import_string(spec)
    from polyrl.rewards.scoring import load_compute_score

    return load_compute_score(spec)


# --------------------------------------------------------------------------- reward manager


#: batch fields the manager reads the images from, first found wins
IMAGE_FIELDS = ("images", "image")
#: non-tensor batch fields holding the prompt text, first found wins
PROMPT_FIELDS = ("prompt_text", "raw_prompt", "prompt")


def _field(batch: Any, names: Sequence[str], what: str) -> Any:
    from polyrl.batch import non_tensor

    keys = set(batch.keys())
    for name in names:
        if name in keys:
            value = batch.get(name)
            return value if isinstance(value, torch.Tensor) else non_tensor(batch, name)
    raise KeyError(f"the image reward manager needs the {what} in batch field {' or '.join(names)}; the batch "
                   f"has {sorted(keys)}")


def image_reward_entry(data_source: str, plugins: Any = None) -> Any:
    """The registry entry of the image reward registered for ``data_source`` (``kind="image"``,
    ``data_sources=[...]``), or ``None``."""
    from polyrl.plugins import get_plugin_manager

    for entry in (plugins or get_plugin_manager()).registry("reward_function").entries():
        if entry.metadata.get("kind") == "image" and data_source in entry.metadata.get("data_sources", ()):
            return entry
    return None


def image_data_sources(plugins: Any = None) -> list[str]:
    """The data sources some registered image reward scores, sorted."""
    from polyrl.plugins import get_plugin_manager

    return sorted({s for e in (plugins or get_plugin_manager()).registry("reward_function").entries()
                   if e.metadata.get("kind") == "image" for s in e.metadata.get("data_sources", ())})


class ImageRewardManager:
    """Scores a batch of generated images (registered as reward manager ``image``).

    Built like every reward manager, ``ImageRewardManager(tokenizer=..., compute_score=..., config=...)``;
    ``compute_score`` is an image reward or anything :func:`build_image_reward` takes. The core's default
    (score by ``data_source``) picks, per data source, the reward function registered for it with
    ``kind="image"``; ``compute_score=None`` with ``config.function`` like ``"ocr=1,brightness=0.2"`` builds a
    :class:`WeightedReward`. The score of sample ``i`` is put on its last trained step (``response_mask``),
    so advantage estimators that sum a row see the image's reward.
    """

    def __init__(self, *, tokenizer: Any = None, compute_score: Any = None, config: Any = None) -> None:
        from polyrl.rewards.scoring import default_compute_score

        self.config = config
        spec = str(getattr(config, "function", "") or "")
        if compute_score is None and "=" in spec:  # reward.function: "ocr=1.0,jpeg_compressibility=0.1"
            compute_score = build_image_reward(spec)
        self.by_data_source = compute_score is None or compute_score is default_compute_score
        self.reward = None if self.by_data_source else build_image_reward(compute_score)

    def _reward_for(self, data_source: str) -> ImageReward:
        entry = image_reward_entry(data_source)
        if entry is None:  # the trainer's start-up check (FlowGRPOTrainer.check_rewards) refuses such rows first
            raise KeyError(f"no image reward registered for data_source '{data_source}' (known: "
                           f"{', '.join(image_data_sources())}); set reward.function to an image reward "
                           "(docs/diffusion.md, Rewards)")
        return entry.load()

    def score(self, images: Any, prompts: Sequence[str], ground_truths: Sequence[Any] | None = None,
              extra_infos: Sequence[dict] | None = None,
              data_sources: Sequence[str] | None = None) -> tuple[torch.Tensor, dict[str, list]]:
        """Scores ``[B]`` and per-sample extras for images outside a batch (validation, benchmarks)."""
        arr = as_uint8_images(images)
        n = arr.shape[0]
        if self.reward is not None:
            return call_reward(self.reward, arr, prompts, ground_truths, extra_infos)
        sources = list(data_sources or [""] * n)
        scores = torch.zeros(n)
        extra: dict[str, list] = {}
        for source in dict.fromkeys(sources):
            idx = [i for i, s in enumerate(sources) if s == source]
            part, part_extra = call_reward(self._reward_for(source), arr[idx], [prompts[i] for i in idx],
                                           None if ground_truths is None else [ground_truths[i] for i in idx],
                                           None if extra_infos is None else [extra_infos[i] for i in idx])
            scores[idx] = part
            for key, values in part_extra.items():
                column = extra.setdefault(key, [None] * n)
                for i, v in zip(idx, values):
                    column[i] = v
        return scores, extra

    def __call__(self, batch: Any) -> Any:
        from polyrl.batch import non_tensor
        from polyrl.protocols import RewardOutput

        images = _field(batch, IMAGE_FIELDS, "generated images")
        n = batch.batch_size[0]
        prompts = [prompt_text(p) for p in _field(batch, PROMPT_FIELDS, "prompt text")]
        truths = non_tensor(batch, "ground_truth", None)
        infos = non_tensor(batch, "extra_info", None)
        sources = non_tensor(batch, "data_source", "")
        scores, extra = self.score(images, prompts, truths, [i or {} for i in infos], sources)
        mask = batch["response_mask"] if "response_mask" in batch.keys() else torch.ones(n, 1)
        valid = (mask != 0).long()
        last = torch.where(valid.any(-1), valid.cumsum(-1).argmax(-1), torch.zeros(n, dtype=torch.long))
        token_scores = torch.zeros(mask.shape, dtype=torch.float32)
        token_scores[torch.arange(n), last] = torch.where(valid.any(-1), scores, torch.zeros_like(scores))
        extra["score"] = scores.tolist()
        metrics = {f"reward/{k}": float(np.mean([float(v) for v in vals]))
                   for k, vals in extra.items() if k != "score" and vals and all(_is_number(v) for v in vals)}
        return RewardOutput(token_scores, extra, metrics)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
