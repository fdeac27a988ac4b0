"""The model's tokenizer, read from an HF-layout folder with the ``tokenizers`` library.

The gateway never imports ``transformers`` (its image has no torch); it reads the same files
``AutoTokenizer`` reads: ``tokenizer.json`` (the pipeline: normalizer, pre-tokenizer, model,
post-processor, decoder, added tokens), ``tokenizer_config.json`` (special tokens, chat template),
``chat_template.jinja`` / ``chat_template.json`` (the template as transformers 5 saves it) and
``generation_config.json`` (end-of-sequence ids).  Tests compare every output with ``AutoTokenizer``.
"""

import functools
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# How many characters of a text a normalizer may turn into one.  Unicode composition joins at most 4 (the
# longest canonical decomposition, U+1F82's, has 4 characters); decomposition, lowercasing and prepending never
# shorten a text.  Any other normalizer (Replace, Strip, ...) may delete characters: no bound then.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}


class TokenizerLoadError(ValueError):
    """The model folder has no usable tokenizer; the message names the file and what is wrong."""


@dataclass(frozen=True)
class TokenizerFiles:
    """What the model folder says about tokenization, parsed but not yet compiled."""

    special_tokens: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = ()


class ModelTokenizer:
    """Encode and decode with the model's tokenizer; safe to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, files: TokenizerFiles) -> None:
        self._tokenizer = tokenizer
        self.special_tokens = dict(files.special_tokens)
        self.chat_template = files.chat_template
        eos_ids = list(files.eos_token_ids)
        eos_text = files.special_tokens.get("eos_token")
        if eos_text is not None and (eos_id := tokenizer.token_to_id(eos_text)) is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        self.eos_token_ids = tuple(eos_ids)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_chars_per_token = _max_chars_per_token(tokenizer)
        # Single-token texts by skip_special_tokens, filled as tokens are first seen (the vocabulary is fixed).
        self._single_texts = {skip: SingleTokenTexts(self.decoder(skip)) for skip in (False, True)}
        self._files = files
        self._keeping: dict[tuple[str, ...], ModelTokenizer] = {}
        self._keeping_lock = threading.Lock()

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelTokenizer":
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerLoadError(f"{folder}: no tokenizer.json (the gateway needs the HF fast-tokenizer file)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises a bare Exception on malformed files
            raise TokenizerLoadError(f"{path}: cannot be loaded: {exc}") from exc
        return cls(tokenizer, read_tokenizer_files(folder))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # The batch call releases the GIL while the Rust side works (encode does not), and the "fast"
        # one skips the character offsets we never use (about half the work).
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
        """``decode`` with the flag bound, without a Python frame per call (it runs for every streamed token)."""
        return functools.partial(self._tokenizer.decode, skip_special_tokens=skip_special_tokens)

    def single_token_decoder(self, skip_special_tokens: bool) -> Callable[[int], str]:
        """``decode([token_id], skip_special_tokens)``, cached: a dict lookup once a token has been seen."""
        return self._single_texts[skip_special_tokens].__getitem__

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (what logprobs report); cached, the vocabulary is fixed."""
        return self._single_texts[False][token_id]

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` as the tokenizer stores it (byte-level: ``Ġ`` for a space)."""
        return self._tokenizer.id_to_token(token_id) or ""

    @functools.cached_property
    def special_token_ids(self) -> dict[str, int]:
        """Text -> id of the added tokens marked special (those ``skip_special_tokens`` drops)."""
        added = self._tokenizer.get_added_tokens_decoder()
        return {token.content: token_id for token_id, token in added.items() if token.special}

    def keeping(self, tokens: Sequence[str]) -> "ModelTokenizer":
        """This tokenizer, but decoding ``tokens`` as text even with ``skip_special_tokens`` (an output parser reads
        them: M3's tool-call and reasoning markers).  Built once per set of tokens."""
        key = tuple(sorted(token for token in tokens if token in self.special_token_ids))
        if not key:
            return self
        with self._keeping_lock:
            if key not in self._keeping:
                pipeline = json.loads(self._tokenizer.to_str())
                for added in pipeline.get("added_tokens", []):
                    if added.get("content") in key:
                        added["special"] = False
                self._keeping[key] = ModelTokenizer(Tokenizer.from_str(json.dumps(pipeline)), self._files)
            return self._keeping[key]


def _max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most characters of an input text one token can stand for, or None when the normalizer may delete
    characters.  A vocabulary entry is never shorter than the text it matches (byte-level entries have one
    character per byte, added tokens are their text), so a text of C characters has at least C / this tokens:
    the gateway refuses a prompt over the context from its length alone, before tokenizing it."""
    longest = max(len(token) for token in tokenizer.get_vocab(with_added_tokens=True))
    pipeline = json.loads(tokenizer.to_str())
    if any(added.get("lstrip") or added.get("rstrip") for added in pipeline.get("added_tokens", [])):
        logger.info("an added token absorbs the whitespace around it: prompts are not bounded by length")
        return None
    normalizer = pipeline.get("normalizer")
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else [normalizer]
    shrink = 1
    for step in steps:
        if step is None:
            continue
        factor = _NORMALIZER_SHRINK.get(step.get("type"))
        if factor is None:
            logger.info("the tokenizer's %s normalizer may delete characters: prompts are not bounded by length", step)
            return None
        shrink *= factor
    return longest * shrink


class SingleTokenTexts(dict[int, str]):
    """Token id -> its text decoded alone; a missing id is decoded and kept."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        super().__init__()
        self._decode = decode

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self._decode([token_id])
        return text


def read_tokenizer_files(folder: Path) -> TokenizerFiles:
    """Special tokens, chat template and EOS ids from the folder's JSON/Jinja files."""
    config = _read_json(folder / "tokenizer_config.json")
    special_tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # the older AddedToken serialization
            value = value.get("content")
        if isinstance(value, str):
            special_tokens[key] = value
    if config.get("clean_up_tokenization_spaces"):
        logger.warning("%s sets clean_up_tokenization_spaces; the gateway decodes without that clean-up", folder)
    return TokenizerFiles(
        special_tokens=special_tokens,
        chat_template=_chat_template(folder, config),
        eos_token_ids=_eos_token_ids(folder),
    )


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """transformers 5 precedence: chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_token_ids(folder: Path) -> tuple[int, ...]:
    value = _read_json(folder / "generation_config.json").get("eos_token_id")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path}: expected a JSON object")
    return data
