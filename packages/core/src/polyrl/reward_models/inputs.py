"""What a reward model reads: each sample turned into the reward model's tokens (driver side).

* Same tokenizer as the policy (``reward_model.input_format: tokens``, or ``auto`` with equal tokenizers):
  the policy's prompt tokens and the response's tokens as they are.
* Another tokenizer (``chat``, or ``auto`` when they differ), as verl does: the response is decoded with the
  policy's tokenizer, the prompt's chat messages (the row's ``prompt``) get the response as the assistant's
  turn, the reward model's chat template renders them and its tokenizer re-tokenizes the text.

A discriminative reward model scores the last token of that sequence. The batch it gets follows the engine
convention of a value model: the sequence is the "prompt" (left-padded) and one padding token the "response";
the value an engine computes for that token comes from the state of the token before it, the sequence's last
(``polyrl.protocols``: per-token values are predicted from the preceding position). Any engine that serves
``model_type="value"`` (fsdp, megatron, a plugin's) therefore scores it, with its own micro-batching.

A generative reward model (a judge) gets the judge template filled with the prompt's text, the response's
text and the row's ground truth, as one user message through the judge tokenizer's chat template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.batch import non_tensor

#: ``reward_model.input_format`` values.
INPUT_FORMATS = ("auto", "tokens", "chat")


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map text to the same ids and render chats alike (vocabulary, specials, template)."""
    if a is b:
        return True
    return (a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
            and a.all_special_tokens == b.all_special_tokens)


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def prompt_text(prompt: Any) -> str:
    """The text of a row's prompt: a string as it is, chat messages as their last user message's content."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return str(users[-1] if users else (prompt[-1].get("content", "") if prompt else ""))


class RewardModelInputs:
    """Turns generated batches into reward-model inputs.

    ``policy_tokenizer`` decoded the policy's tokens; ``rm_tokenizer`` is the reward model's. ``retemplate``:
    decode, re-template and re-tokenize (else the policy's tokens go as they are). ``max_length``: longest
    input in tokens, cut on the ``truncation`` side (``right`` / ``left``).
    """

    def __init__(self, *, policy_tokenizer: Any, rm_tokenizer: Any, retemplate: bool, max_length: int,
                 truncation: str = "right") -> None:
        self.policy_tokenizer = policy_tokenizer
        self.rm_tokenizer = rm_tokenizer
        self.retemplate = retemplate
        self.max_length = max_length
        self.truncation = truncation
        pad = rm_tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (rm_tokenizer.eos_token_id or 0))

    # ------------------------------------------------------------------ the parts of a sample
    @staticmethod
    def _response_lengths(batch: TensorDict) -> torch.Tensor:
        """Each response's length up to its last non-padding token (tool tokens of a multi-turn response count)."""
        responses = batch["responses"]
        valid = batch["attention_mask"][:, -responses.shape[1]:] if "attention_mask" in batch.keys() \
            else batch["response_mask"]
        valid = valid.long()
        return torch.where(valid.any(-1), valid.cumsum(-1).argmax(-1) + 1, torch.zeros_like(valid[:, 0]))

    def response_texts(self, batch: TensorDict) -> list[str]:
        """Each response decoded with the policy's tokenizer, special tokens dropped."""
        lengths = self._response_lengths(batch)
        return [self.policy_tokenizer.decode(batch["responses"][i, : int(lengths[i])].tolist(), skip_special_tokens=True)
                for i in range(batch.batch_size[0])]

    def prompts(self, batch: TensorDict) -> list[Any]:
        """Each row's prompt as the data set gave it (chat messages or a string; the batch carries it as JSON text
        in ``raw_prompt``); decoded from the prompt tokens when the batch does not carry it."""
        raw = non_tensor(batch, "raw_prompt", None)
        out = []
        for i, prompt in enumerate(raw):
            prompt = json.loads(prompt) if isinstance(prompt, str) else prompt
            if prompt is None:
                ids = batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()]
                prompt = self.policy_tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            out.append(prompt)
        return out

    # ------------------------------------------------------------------ discriminative
    def sequences(self, batch: TensorDict) -> list[list[int]]:
        """Each sample as the reward model's token ids (see the module docstring), at most ``max_length``."""
        if not self.retemplate:
            width = batch["prompts"].shape[1]
            lengths = self._response_lengths(batch)
            out = []
            for i in range(batch.batch_size[0]):
                prompt = batch["prompts"][i][batch["attention_mask"][i, :width].bool()].tolist()
                out.append(prompt + batch["responses"][i, : int(lengths[i])].tolist())
        else:
            texts = self.response_texts(batch)
            out = []
            for prompt, response in zip(self.prompts(batch), texts):
                chat = _messages(prompt) + [{"role": "assistant", "content": response}]
                text = self.rm_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
                out.append(list(self.rm_tokenizer(text, add_special_tokens=False)["input_ids"]))
        return [self._cut(ids) for ids in out]

    def _cut(self, ids: list[int]) -> list[int]:
        if self.max_length and len(ids) > self.max_length:
            return ids[-self.max_length:] if self.truncation == "left" else ids[: self.max_length]
        return ids

    def batch(self, batch: TensorDict) -> TensorDict:
        """The engine batch that scores each sample at its last token (see the module docstring)."""
        return sequences_batch(self.sequences(batch), self.pad_id)

    # ------------------------------------------------------------------ generative
    def judge_prompts(self, batch: TensorDict, template: str, *, chat_template: bool = True) -> list[list[int]]:
        """The judge's prompt for each sample, as the judge tokenizer's token ids."""
        texts = self.response_texts(batch)
        truths = non_tensor(batch, "ground_truth", None)
        sources = non_tensor(batch, "data_source", "")
        out = []
        for i, (prompt, response) in enumerate(zip(self.prompts(batch), texts)):
            ground_truth = "" if truths[i] is None else str(truths[i])
            message = template.format(prompt=prompt_text(prompt), response=response, ground_truth=ground_truth,
                                      data_source=sources[i])
            tok = self.rm_tokenizer
            if chat_template and getattr(tok, "chat_template", None):
                ids = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                              tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
            else:
                ids = tok(message, add_special_tokens=True)["input_ids"]
            out.append(self._cut_left(list(ids)))
        return out

    def _cut_left(self, ids: list[int]) -> list[int]:
        # a judge prompt keeps its end (the response and the question to answer)
        return ids[-self.max_length:] if self.max_length and len(ids) > self.max_length else ids


def sequences_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> TensorDict:
    """Token sequences as a value-model batch scored at their last token: each sequence left-padded as the
    prompt, one ``pad_id`` token as the response (``response_mask`` 1), positions counted from each start."""
    n = len(sequences)
    width = max(1, max((len(s) for s in sequences), default=1))
    prompts = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros(n, width + 1, dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            prompts[i, width - len(seq):] = torch.tensor(list(seq), dtype=torch.long)
            attn[i, width - len(seq):] = 1
        attn[i, width] = 1  # the scoring token: its value is read from the sequence's last state
    responses = torch.full((n, 1), pad_id, dtype=torch.long)
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return TensorDict({"input_ids": input_ids, "attention_mask": attn, "position_ids": position_ids,
                       "prompts": prompts, "responses": responses,
                       "response_mask": torch.ones(n, 1, dtype=torch.long)}, batch_size=[n])
