"""Images in the data path: verl's ``images`` column, the model's processor, and what the batch carries.

A row with images (verl's format)::

    {"prompt": [{"role": "user", "content": "<image> What colour is the square?"}],
     "images": ["shapes/0.png"],            # paths, bytes, {"bytes": ..., "path": ...} (parquet), or PIL images
     "data_source": "...", "reward_model": {"ground_truth": "red"}}

Each ``<image>`` in the prompt's text is one image of ``images``, in order (verl's placeholder). The
dataset renders the prompt with the processor's chat template (image parts become the model's vision
tokens), so ``prompt_ids`` hold one ``<|image_pad|>`` per merged patch, exactly what the processor makes.

What crosses the batch (:mod:`polyrl.batch`), for Qwen2-VL and Qwen2.5-VL:

* :data:`MULTI_MODAL_INPUTS` (a non-tensor field): per row ``{"pixel_values": [patches, D],
  "image_grid_thw": [images, 3]}`` or ``None`` for a row without images. Rows have different numbers of
  patches, so they are kept per row; an engine concatenates its micro-batch's rows (the model's own layout).
  The ``n`` samples of a prompt share one set of tensors (a processed image is never copied per sample).
* :data:`MROPE_POSITION_IDS` (a tensor field ``[B, 3, P + R]``): Qwen-VL's multimodal rotary positions
  (temporal, height, width) of every token; ``position_ids`` stays the text position (masks, packing).

:class:`ImageInputs` processes the images of one step once each (a cache keyed by the image), whatever the
number of rows and samples that show it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Non-tensor batch field: per row the processor's image tensors (``pixel_values``, ``image_grid_thw``) or None.
MULTI_MODAL_INPUTS = "multi_modal_inputs"
#: Tensor batch field ``[B, 3, P + R]``: multimodal rotary position ids (Qwen-VL's M-RoPE).
MROPE_POSITION_IDS = "mrope_position_ids"
#: verl's image placeholder in a prompt's text.
IMAGE_PLACEHOLDER = "<image>"
#: Model types whose data path polyrl supports (image inputs, M-RoPE positions).
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")


# ---------------------------------------------------------------------------- the model's processor


def vision_model_type(path: str, *, trust_remote_code: bool = False) -> str | None:
    """The model type of the HF model at ``path`` when it is a vision-language model (its config has a
    ``vision_config``), else ``None``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return config.model_type if getattr(config, "vision_config", None) is not None else None


def load_processor(path: str, *, trust_remote_code: bool = False) -> Any | None:
    """The multimodal processor of the model at ``path`` (``None`` for a text-only model).

    ``AutoProcessor`` where it loads. Without torchvision, transformers cannot build Qwen-VL's processor (its
    video processor needs torchvision): polyrl then builds the same processor class from the folder's image
    processor (PIL backend), tokenizer and chat template, for images only (no video). Raises ``ValueError``
    for a vision-language model outside :data:`QWEN_VL_TYPES`.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if getattr(config, "vision_config", None) is None:
        return None
    if config.model_type not in QWEN_VL_TYPES:
        raise ValueError(f"{path} is a {config.model_type} vision-language model; polyrl's image path supports "
                         f"{', '.join(QWEN_VL_TYPES)} (Qwen2-VL, Qwen2.5-VL)")
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise
    if config.model_type not in _IMAGES_ONLY_NOTED:  # once per process, not once per load
        _IMAGES_ONLY_NOTED.add(config.model_type)
        logger.info("torchvision is not installed: the %s processor is built for images only (no video)",
                    config.model_type)
    return _images_only_processor(path, config.model_type, trust_remote_code)


_IMAGES_ONLY_NOTED: set[str] = set()


def _images_only_processor(path: str, model_type: str, trust_remote_code: bool) -> Any:
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    cls = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    return _images_only_class(cls)(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                   chat_template=tokenizer.chat_template)


_IMAGES_ONLY: dict[type, type] = {}


def _images_only_class(cls: type) -> type:
    """``cls`` accepting ``video_processor=None`` (its argument check would look the video class up)."""
    if cls not in _IMAGES_ONLY:
        def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return cls.check_argument_for_proper_class(self, argument_name, argument)

        _IMAGES_ONLY[cls] = type(cls.__name__, (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class,
                                                        "__module__": __name__})
    return _IMAGES_ONLY[cls]


def processor_token_ids(processor: Any) -> dict[str, int]:
    """``image_token_id`` and ``spatial_merge_size`` of a Qwen-VL processor (what :func:`mrope_position_ids` needs)."""
    tok = processor.tokenizer
    image_token = getattr(processor, "image_token", "<|image_pad|>")
    return {"image_token_id": int(tok.convert_tokens_to_ids(image_token)),
            "spatial_merge_size": int(processor.image_processor.merge_size)}


# ---------------------------------------------------------------------------- images


def image_source(spec: Any) -> str:
    """How an image of a row is named in messages: its path, or ``<N bytes>`` / ``<PIL image>``."""
    if isinstance(spec, (str, Path)):
        return str(spec)
    if isinstance(spec, Mapping):
        if spec.get("path"):
            return str(spec["path"])
        if spec.get("bytes") is not None:
            return f"<{len(spec['bytes'])} bytes>"
        if spec.get("image") is not None:
            return image_source(spec["image"])
    if isinstance(spec, (bytes, bytearray)):
        return f"<{len(spec)} bytes>"
    return f"<{type(spec).__name__}>"


def resolve_image(spec: Any, base_dir: Path | None = None) -> Any:
    """``spec`` with a relative path made absolute: against ``base_dir`` (the data file's folder) when the file
    is there, else the working directory. Bytes and PIL images are returned as they are."""
    def resolve(p: str) -> str:
        p = p[len("file://"):] if p.startswith("file://") else p
        path = Path(p).expanduser()
        if not path.is_absolute() and base_dir is not None and (base_dir / path).exists():
            return str((base_dir / path).resolve())
        return str(path.resolve())

    if isinstance(spec, (str, Path)):
        return resolve(str(spec))
    if isinstance(spec, Mapping) and spec.get("bytes") is None and spec.get("path") and spec.get("image") is None:
        return dict(spec, path=resolve(str(spec["path"])))
    return spec


def open_image(spec: Any) -> Any:
    """A decoded RGB ``PIL.Image`` from a path, bytes, ``{"bytes"|"path"|"image": ...}`` or a PIL image.

    Raises ``ValueError`` saying why: a file that does not exist, data that is not an image, an image over
    PIL's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``).
    """
    from PIL import Image

    if isinstance(spec, Mapping):
        if spec.get("bytes") is not None:
            spec = bytes(spec["bytes"])
        elif spec.get("image") is not None:
            spec = spec["image"]
        elif spec.get("path"):
            spec = spec["path"]
        else:
            raise ValueError(f"an image entry needs 'bytes', 'path' or 'image'; it has {sorted(spec)}")
    if isinstance(spec, Image.Image):
        return spec.convert("RGB")
    if isinstance(spec, (bytes, bytearray)):
        source: Any = io.BytesIO(spec)
    elif isinstance(spec, (str, Path)):
        source = Path(str(spec)[len("file://"):] if str(spec).startswith("file://") else spec)
        if not source.exists():
            raise ValueError("the file does not exist")
        if not source.is_file():
            raise ValueError("it is not a file")
    else:
        raise ValueError(f"an image must be a path, bytes or a PIL image, not {type(spec).__name__}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(source) as img:
                img.load()
                return img.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(f"the image is larger than PIL's limit of {Image.MAX_IMAGE_PIXELS} pixels "
                         f"(PIL.Image.MAX_IMAGE_PIXELS): {exc}") from None
    except (OSError, SyntaxError) as exc:  # PIL's UnidentifiedImageError is an OSError
        raise ValueError(f"it is not an image PIL can read ({type(exc).__name__}: {str(exc)[:120]})") from None


def image_cache_key(spec: Any) -> str:
    """An identity for ``spec`` within one step: its path (and modification time), a digest of its bytes, or
    the identity of a PIL image object."""
    if isinstance(spec, Mapping):
        if spec.get("bytes") is not None:
            return image_cache_key(bytes(spec["bytes"]))
        if spec.get("image") is not None:
            return image_cache_key(spec["image"])
        return image_cache_key(spec.get("path", ""))
    if isinstance(spec, (bytes, bytearray)):
        return "sha1:" + hashlib.sha1(spec).hexdigest()
    if isinstance(spec, (str, Path)):
        path = Path(str(spec))
        try:
            return f"path:{path}:{path.stat().st_mtime_ns}"
        except OSError:
            return f"path:{path}"
    return f"object:{id(spec)}"


def image_messages(prompt: Any, n_images: int) -> list[dict]:
    """The prompt's messages with verl's ``<image>`` placeholders turned into the chat template's parts
    (``{"type": "image"}``, ``{"type": "text", "text": ...}``); messages already in parts are kept.

    Raises ``ValueError`` when the prompt's images (placeholders or image parts) are not ``n_images``.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    seen = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            pieces = re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", content)
            if len(pieces) > 1:
                parts: list[dict] = []
                for piece in pieces:
                    if piece == IMAGE_PLACEHOLDER:
                        parts.append({"type": "image"})
                        seen += 1
                    elif piece:
                        parts.append({"type": "text", "text": piece})
                message["content"] = parts
        elif isinstance(content, list):
            seen += sum(1 for part in content if isinstance(part, Mapping) and part.get("type") == "image")
    if seen != n_images:
        raise ValueError(f"the prompt has {seen} image placeholder{'s' if seen != 1 else ''} ({IMAGE_PLACEHOLDER}) but "
                         f"the row has {n_images} image{'s' if n_images != 1 else ''}; each {IMAGE_PLACEHOLDER} stands "
                         "for the next image of the row")
    return messages


def count_placeholders(prompt: Any) -> int:
    """How many images a prompt's text asks for (``<image>`` placeholders and image parts)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    count = 0
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            count += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            count += sum(1 for part in content if isinstance(part, Mapping) and part.get("type") == "image")
    return count


def max_image_pixels(processor: Any) -> int | None:
    """The most pixels the processor keeps of an image (larger ones are resized down), where it says."""
    ip = processor.image_processor
    value = getattr(ip, "max_pixels", None)
    if value is None:
        size = getattr(ip, "size", None)
        value = size.get("longest_edge") if isinstance(size, Mapping) else getattr(size, "longest_edge", None)
    return int(value) if value else None


# ---------------------------------------------------------------------------- processing, once per image


class ImageInputs:
    """The processor's tensors for the images of rows, each image processed once while this object lives
    (create one per step: the ``n`` samples of a prompt, and rows showing the same image, share the work).

    ``inputs(images)`` returns ``{"image": [PIL images], "pixel_values": [patches, D], "image_grid_thw":
    [images, 3], "key": str}`` for a row's images (``None`` for a row without any); rollouts take the
    raw images (vLLM, SGLang) or the tensors (``hf``), and ``key`` names the images (rows whose prompt ids and
    key agree are the same prompt).
    """

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self._cache: dict[str, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._rows: dict[tuple[str, ...], dict[str, Any]] = {}
        self.processed = 0  # images actually run through the processor (the rest came from the cache)

    def _one(self, spec: Any) -> tuple[str, tuple[Any, torch.Tensor, torch.Tensor]]:
        key = image_cache_key(spec)
        if key not in self._cache:
            image = open_image(spec)
            out = self.processor.image_processor(images=[image], return_tensors="pt")
            self._cache[key] = (image, out["pixel_values"], out["image_grid_thw"])
            self.processed += 1
        return key, self._cache[key]

    def inputs(self, images: Sequence[Any] | None) -> dict[str, Any] | None:
        """The processed images of one row (see the class docstring); the same dict for the same images."""
        if not images:
            return None
        parts = [self._one(spec) for spec in images]
        keys = tuple(k for k, _ in parts)
        if keys not in self._rows:
            self._rows[keys] = {
                "image": [p[0] for _, p in parts],
                "pixel_values": torch.cat([p[1] for _, p in parts]),
                "image_grid_thw": torch.cat([p[2] for _, p in parts]),
                "key": hashlib.sha1("|".join(keys).encode()).hexdigest(),
            }
        return self._rows[keys]


def model_inputs(inputs: Mapping[str, Any] | None) -> dict[str, torch.Tensor] | None:
    """What an engine's forward takes of :meth:`ImageInputs.inputs` (the tensors; not the PIL images)."""
    if inputs is None:
        return None
    return {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}


def attach_image_inputs(samples: Sequence[Mapping[str, Any]], image_inputs: ImageInputs,
                        image_key: str = "images") -> list[Mapping[str, Any]]:
    """``samples`` with ``multi_modal_data`` (:meth:`ImageInputs.inputs` of each row's ``image_key``) where a row
    has images; repeated rows (the same dict object, GRPO's ``n`` samples) stay one object."""
    out: list[Mapping[str, Any]] = []
    done: dict[int, Mapping[str, Any]] = {}
    for sample in samples:
        if id(sample) not in done:
            images = sample.get(image_key)
            done[id(sample)] = dict(sample, multi_modal_data=image_inputs.inputs(images)) if images else sample
        out.append(done[id(sample)])
    return out


# ---------------------------------------------------------------------------- multimodal rotary positions


def mrope_position_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       image_grid_thw: torch.Tensor | None, *, image_token_id: int,
                       spatial_merge_size: int) -> torch.Tensor:
    """Qwen-VL's M-RoPE positions ``[3, L]`` (temporal, height, width) of one sequence ``input_ids`` ``[L]``.

    Text tokens count up on all three axes; the ``t * h * w / merge**2`` image tokens of an image (in
    ``image_grid_thw`` order) take ``start + (t, h, w)`` of their merged patch, and the text after it
    continues at ``start + max(h, w) / merge``. Padding (``attention_mask`` 0) gets 0. Image tokens past
    the images' (a response that sampled the image token) are text, as they were when sampled. Raises
    ``ValueError`` when there are fewer image tokens than ``image_grid_thw`` needs, or they are not contiguous.
    """
    length = input_ids.shape[0]
    valid = attention_mask.bool() if attention_mask is not None else torch.ones(length, dtype=torch.bool)
    ids = input_ids[valid]
    n = ids.shape[0]
    pos = torch.empty(3, n, dtype=torch.long)
    image_at = (ids == image_token_id).nonzero().squeeze(-1).tolist()
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw]
    need = sum(t * (h // spatial_merge_size) * (w // spatial_merge_size) for t, h, w in grids)
    if len(image_at) < need:
        raise ValueError(f"the sequence has {len(image_at)} image tokens but its images' grids "
                         f"({image_grid_thw.tolist() if image_grid_thw is not None else []}) make {need}")
    start = 0  # next position
    cursor = 0  # next token
    k = 0  # next image token (index into image_at)
    for t, h, w in grids:
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        count = t * gh * gw
        first = image_at[k]
        if image_at[k + count - 1] != first + count - 1:
            raise ValueError(f"the {count} image tokens of an image are not contiguous (from token {first})")
        k += count
        text = first - cursor
        pos[:, cursor:first] = torch.arange(start, start + text).expand(3, text)
        start += text
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
        pos[:, first:first + count] = grid.reshape(3, -1) + start
        start += max(gh, gw)
        cursor = first + count
    rest = n - cursor
    pos[:, cursor:] = torch.arange(start, start + rest).expand(3, rest)
    out = torch.zeros(3, length, dtype=torch.long)
    out[:, valid] = pos
    return out


def add_multimodal_fields(batch: Any, inputs: Sequence[Mapping[str, Any] | None], *, image_token_id: int,
                          spatial_merge_size: int) -> None:
    """Set :data:`MULTI_MODAL_INPUTS` (each row's :func:`model_inputs`) and :data:`MROPE_POSITION_IDS`
    (``[B, 3, P + R]`` from ``input_ids`` and ``attention_mask``) on a collated batch."""
    from polyrl.batch import set_non_tensor

    rows = [model_inputs(x) for x in inputs]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = torch.stack([
        mrope_position_ids(ids[i], mask[i], None if r is None else r["image_grid_thw"], image_token_id=image_token_id,
                           spatial_merge_size=spatial_merge_size)
        for i, r in enumerate(rows)])
    set_non_tensor(batch, MULTI_MODAL_INPUTS, rows)
    batch[MROPE_POSITION_IDS] = positions


def concat_model_inputs(rows: Iterable[Mapping[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """The model's image inputs for a micro-batch: every row's tensors concatenated in row order (``{}`` when
    no row has images)."""
    present = [r for r in rows if r is not None]
    if not present:
        return {}
    return {key: torch.cat([r[key] for r in present]) for key in present[0]}


# ---------------------------------------------------------------------------- prompts with images


def row_images(row: Mapping[str, Any], image_key: str = "images") -> list[Any]:
    """The images of ``row`` as a list (a single path or entry becomes a list of one; none: ``[]``)."""
    images = row.get(image_key)
    if images is None:
        return []
    if isinstance(images, (str, bytes, bytearray, Mapping)) or not isinstance(images, Iterable):
        return [images]
    return list(images)


def encode_image_prompt(prompt: Any, images: Sequence[Any], processor: Any, *,
                        base_dir: Path | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], list[Any], int]:
    """``(prompt_ids, images, downscaled)`` for a prompt with images: the ids the processor makes from the prompt
    rendered with its chat template (with ``chat_template_kwargs``, ``data.apply_chat_template_kwargs``; one
    vision token per merged patch), the images with relative paths
    resolved (:func:`resolve_image`), and how many images were larger than the processor keeps (it resizes
    them down). Raises ``ValueError`` naming the image (its index and source) and why it cannot be used."""
    resolved = [resolve_image(spec, base_dir) for spec in images]
    messages = image_messages(prompt, len(resolved))
    decoded = []
    for j, spec in enumerate(resolved):
        try:
            decoded.append(open_image(spec))
        except ValueError as exc:
            raise ValueError(f"image {j} ({image_source(spec)}): {exc}") from None
    limit = max_image_pixels(processor)
    downscaled = sum(1 for img in decoded if limit and img.width * img.height > limit)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **(chat_template_kwargs or {}))
    try:
        encoded = processor(text=[text], images=decoded)
    except ValueError as exc:  # e.g. an aspect ratio over the processor's limit (Qwen-VL: 200)
        raise ValueError(f"the processor refused the images: {exc}") from None
    return [int(t) for t in encoded["input_ids"][0]], resolved, downscaled
