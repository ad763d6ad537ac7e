"""The artifact's tokenizer without transformers: ``tokenizers`` + a jinja2 chat template.

Reproduces what ``transformers`` does for the same files, token for token:

* encoding: ``tokenizer/tokenizer.json`` through ``tokenizers.Tokenizer``;
* chat template: rendered as ``PreTrainedTokenizerBase.apply_chat_template`` does (a
  sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``, the loop-controls
  extension, its ``tojson`` filter, ``raise_exception``/``strftime_now``, and the special
  tokens of ``special_tokens_map.json`` in the context), then encoded *without* special
  tokens (the template writes them);
* decoding: ``skip_special_tokens`` and, when ``tokenizer_config.json`` sets
  ``clean_up_tokenization_spaces``, transformers' clean-up of spaces before punctuation.

:class:`StreamDecoder` turns tokens arriving step by step into text that is never
printed half-formed: an incomplete UTF-8 character (U+FFFD at the end of the decoded
text) or a tail the clean-up or a stop string may still change is held back.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Sequence

from ..errors import ArtifactError, ChatTemplateError
from ..stops import find_stop_string

#: transformers' ``clean_up_tokenization`` replacements, in its order.
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
#: What a template-less artifact cannot do (a base model: no chat roles).
NO_TEMPLATE_MESSAGE = ("this artifact has no chat template (a base model): it cannot render chat messages; give a "
                       "plain-text prompt (generate encodes it as is and the model continues it)")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ..., ...}
        return value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: str):
    """A jinja2 template compiled the way transformers compiles chat templates."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant masks in transformers): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc} (line {exc.lineno})") from None


class RuntimeTokenizer:
    """Encode, decode and apply the chat template.

    Args:
        tokenizer_json: path of a ``tokenizer.json``; ``tokenizer_config.json`` and
            ``special_tokens_map.json`` next to it are read when present.
        chat_template: the Jinja chat template source, or None/"" when the model has none.
        eos_token_ids: ids that end a reply (the artifact's manifest is the source of truth,
            not the tokenizer's own EOS, which is wrong for some GGUF tokenizers).

    Raises:
        ArtifactError: the tokenizer file is missing or cannot be parsed.
        ChatTemplateError: the template does not compile.
    """

    def __init__(self, tokenizer_json: str | Path, chat_template: str | None = None,
                 eos_token_ids: Sequence[int] = ()):
        from tokenizers import Tokenizer

        path = Path(tokenizer_json)
        if not path.is_file():
            raise ArtifactError(f"tokenizer file {path} is missing")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ArtifactError(f"cannot read the tokenizer {path}: {exc}") from None
        config = _read_json(path.parent / "tokenizer_config.json")
        special = {**{k: config.get(k) for k in _SPECIAL_KEYS if k in config},
                   **_read_json(path.parent / "special_tokens_map.json")}
        self.special_tokens = {k: s for k, v in special.items() if k in _SPECIAL_KEYS and (s := _token_str(v))}
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.chat_template = chat_template or None
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def from_artifact(cls, artifact) -> "RuntimeTokenizer":
        """The tokenizer of a loaded :class:`~medusa_runtime.contract.artifact.Artifact`.

        Raises:
            ArtifactError: the manifest has no tokenizer section or a file is missing.
        """
        tok = artifact.manifest.tokenizer
        if tok is None or "tokenizer" not in artifact.manifest.files:
            raise ArtifactError(f"{artifact.path}: the manifest has no tokenizer")
        template_file = artifact.manifest.files.get("chat_template")
        template = (artifact.path / template_file).read_text() if template_file else None
        return cls(artifact.file("tokenizer"), template, tok.eos_token_ids)

    @property
    def has_chat_template(self) -> bool:
        """False for a base model's artifact: prompts are plain text, continued rather than answered."""
        return self._template is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's BOS etc. unless ``add_special_tokens`` is False)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, as transformers' ``decode`` gives it."""
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return clean_up_spaces(text) if self.clean_up_spaces else text

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (``[{"role": ..., "content": ...}, ...]``).

        Raises:
            ChatTemplateError: the artifact has no template, or the template rejects the messages.
        """
        import jinja2

        if self._template is None:
            raise ChatTemplateError(NO_TEMPLATE_MESSAGE)
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat (what transformers' ``apply_chat_template(tokenize=True)`` returns)."""
        return self.encode(self.render(messages, add_generation_prompt), add_special_tokens=False)

    def stream(self, stop_strings: Sequence[str] = ()) -> "StreamDecoder":
        """A fresh :class:`StreamDecoder` for one reply."""
        return StreamDecoder(self, stop_strings)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization``: drop spaces before punctuation and contractions."""
    for old, new in _CLEANUP:
        text = text.replace(old, new)
    return text


def _unstable_tail(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``patterns``."""
    best = 0
    for p in patterns:
        for n in range(min(len(p) - 1, len(text)), best, -1):
            if text.endswith(p[:n]):
                best = n
                break
    return best


class StreamDecoder:
    """Incremental detokenization of one reply, with stop strings.

    Feed tokens one at a time with :meth:`add`; read the newly printable text with
    :meth:`take`. The text printed so far is always a prefix of the final text
    (:attr:`text`): an incomplete UTF-8 character, a tail the space clean-up may still
    merge, and a tail that may still grow into a stop string are held back until they
    are settled. When a stop string appears, :attr:`text` is cut where it starts and
    :attr:`stopped` becomes True; later tokens are ignored.

    The full reply is decoded at each token (the Rust decoder takes microseconds for a
    reply of a few hundred tokens), which keeps the printed text exactly equal to
    ``decode(tokens)``, whatever the tokenizer's decoder does with token boundaries.

    Attributes:
        tokens: the ids consumed, up to and including the one that completed a stop string.
        stopped: a stop string was found.
    """

    def __init__(self, tokenizer: RuntimeTokenizer, stop_strings: Sequence[str] = ()):
        self._tok = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self._hold = list(self.stop_strings) + ([old for old, _ in _CLEANUP] if tokenizer.clean_up_spaces else [])
        self.tokens: list[int] = []
        self.stopped = False
        self._text = ""
        self._printed = ""
        self._search_from = 0

    def add(self, token: int) -> bool:
        """Consume one token; True when it completes a stop string (then later tokens are ignored)."""
        if self.stopped:
            return True
        self.tokens.append(int(token))
        self._text = self._tok.decode(self.tokens)
        if self.stop_strings:
            cut = find_stop_string(self._text, self.stop_strings, self._search_from)
            if cut >= 0:
                self._text = self._text[:cut]
                self.stopped = True
                return True
            # The next search may start where a stop string could still complete; the
            # clean-up can shorten the last few characters, hence the extra margin.
            longest = max(len(s) for s in self.stop_strings)
            self._search_from = max(0, len(self._text) - longest - 4)
        return False

    def add_all(self, tokens: Sequence[int]) -> int | None:
        """Consume a step's tokens; the number consumed when one completes a stop string (the
        loop's ``on_tokens`` stop protocol), else None."""
        for i, t in enumerate(tokens):
            if self.add(t):
                return i + 1
        return None

    def take(self) -> str:
        """The text that became printable since the last call (maybe "")."""
        text = self._text
        end = len(text)
        if not self.stopped:
            end = len(text.rstrip("\ufffd"))
            end -= _unstable_tail(text[:end], self._hold)
        return self._advance(text[:end])

    def finish(self) -> str:
        """The rest of the text at the end of the reply (held-back tails included)."""
        return self._advance(self._text)

    def _advance(self, settled: str) -> str:
        # A decoder that rewrites earlier text (not seen with byte-level or SentencePiece
        # decoders) would break the prefix property: print nothing rather than garble.
        if len(settled) <= len(self._printed) or not settled.startswith(self._printed):
            return ""
        out = settled[len(self._printed):]
        self._printed = settled
        return out

    @property
    def text(self) -> str:
        """The reply's text so far (cut at a stop string)."""
        return self._text
