"""Tokenizers: the model's HF tokenizer (with its chat template), or bytes for speed-only runs."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from sparsetune.errors import SparsetuneError


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def chat_prompt(self, user_message: str) -> list[int]: ...
    def chat_messages(self, messages: list[dict[str, str]]) -> list[int]: ...
    def chat_frame(self) -> tuple[str, str]: ...


# A private-use character no tokenizer merges with its neighbours: where the user message goes.
_SLOT = "\ue000"


class HFTokenizer:
    def __init__(self, directory: Path, eos_token_ids: tuple[int, ...]) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(directory))
        except Exception as e:  # noqa: BLE001 - broken tokenizer files raise anything (KeyError, TypeError, Rust errors)
            raise SparsetuneError(f"cannot load the tokenizer from {directory} ({type(e).__name__}: {e}); its "
                                  "tokenizer files are damaged or of a kind transformers cannot read: replace "
                                  "them (tokenizer.json, tokenizer_config.json) or pass another --model") from None
        self._adopt(eos_token_ids)

    @classmethod
    def wrap(cls, hf, eos_token_ids: tuple[int, ...] = ()) -> HFTokenizer:
        """A transformers tokenizer loaded elsewhere (SGLang's, in its tokenizer process)."""
        self = cls.__new__(cls)
        self.hf = hf
        self._adopt(eos_token_ids)
        return self

    def _adopt(self, eos_token_ids: tuple[int, ...]) -> None:
        ids = set(eos_token_ids)
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        self.eos_token_ids = tuple(sorted(ids))
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, user_message: str) -> list[int]:
        return self.chat_messages([{"role": "user", "content": user_message}])

    def chat_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation (roles user/assistant/system) ending in a user turn, ready for the reply."""
        if not self.has_chat_template:
            return self.encode("\n\n".join(m["content"] for m in messages))
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.hf.encode(text, add_special_tokens=False))

    def chat_frame(self) -> tuple[str, str]:
        """The chat template's text before and after a single user message (ready for the reply)."""
        if not self.has_chat_template:
            return "", ""
        text = self.hf.apply_chat_template([{"role": "user", "content": _SLOT}], add_generation_prompt=True, tokenize=False)
        before, after = text.split(_SLOT)
        return before, after


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, for random-weight runs of models whose tokenizer is absent.

    Only for speed work: the text it decodes from a random model is noise anyway.
    """

    has_chat_template = False

    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, user_message: str) -> list[int]:
        return self.encode(user_message)

    def chat_messages(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("\n\n".join(m["content"] for m in messages))

    def chat_frame(self) -> tuple[str, str]:
        return "", ""


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
