"""Chat template application and streaming detokenization (exporter side, transformers tokenizer)."""

from __future__ import annotations

from typing import TextIO


def has_chat_template(tokenizer, template: str | None) -> bool:
    """True when ``template`` or the tokenizer's own chat template is set (base models have none)."""
    return bool(template or getattr(tokenizer, "chat_template", None))


def apply_chat_template(tokenizer, template: str | None, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template plus the assistant prompt.

    A model without a chat template (a base model; transformers would raise "Cannot use chat
    template functions because tokenizer.chat_template is not set") gets its messages' contents
    as plain text, joined by blank lines, encoded as ``tokenizer.encode`` does (with BOS where the
    tokenizer adds one): the model continues the text. For one user message these are the ids of
    ``generate --raw`` and of the runtime's ``generate`` on such an artifact.

    Args:
        tokenizer: a transformers tokenizer.
        template: a Jinja chat template, or None for the tokenizer's own.
        messages: ``[{"role": "user"|"assistant"|"system", "content": str}, ...]``.
    """
    if not has_chat_template(tokenizer, template):
        return [int(i) for i in tokenizer.encode("\n\n".join(m["content"] for m in messages))]
    ids = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


class TextStreamer:
    """Prints text as tokens arrive, decoding the whole reply each time so that
    multi-token characters are never printed half-formed."""

    def __init__(self, tokenizer, out: TextIO):
        self.tokenizer = tokenizer
        self.out = out
        self.tokens: list[int] = []
        self.printed = 0

    def put(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()
