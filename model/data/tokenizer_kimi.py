"""Kimi-Linear's own tokenizer: a tiktoken byte-level BPE with Kimi's pre-tokenizer pattern, special tokens
above the base vocabulary, and the checkpoint's chat template.

A Hugging Face Kimi checkpoint directory holds (Kimi-Linear-48B-A3B-Instruct, Kimi-K2):

  tiktoken.model         "<base64 token bytes> <rank>" per line, ranks 0..N-1 (N = 163584 for Kimi);
  tokenizer_config.json  `added_tokens_decoder` {"<id>": {"content": "<|im_end|>", ...}, ...} for ids N and
                         up ([BOS] N, [EOS] N+1, <|im_end|> N+2, <|im_user|> N+3, <|im_assistant|> N+4,
                         <|im_system|> N+10, <|im_middle|> N+17, [UNK] N+254, [PAD] N+255, ...);
                         `bos_token`, `eos_token`, `unk_token`, `pad_token`; `chat_template`;
  chat_template.jinja    (optional) the chat template, preferred over tokenizer_config.json's, as
                         transformers prefers it;
  generation_config.json (optional) `eos_token_id`: ids that end generation.

`KimiTokenizer` exposes the surface of `model.data.tokenizer.SentencePieceTokenizer` (encode, encode_batch,
decode, vocab_size, bos/eos/pad/unk ids, ids_only) plus `stop_ids`, `special_tokens`, `chat_template`
(a `ChatTemplate`), `render_chat` and `encode_chat`.

Encoding (`encode`) is tiktoken's `encode_ordinary`: a special-token string in the text is plain text,
never its control id (only the chat template's own structural tokens become control ids: `encode_chat`).
Like Kimi's `tokenization_kimi.py`, text is encoded in windows of at most 400,000 characters, each cut
inside any run of more than 25,000 whitespace or non-whitespace characters (tiktoken's BPE is
quadratic in a piece's length), so the ids equal the reference tokenizer's also for such text.

Decoding is bytes-level: `decode` joins the tokens' bytes and decodes UTF-8 with U+FFFD for invalid or
incomplete sequences, so ids that end inside a character decode to a trailing U+FFFD, which the
server's incremental detokenizer (`model.server.text.TextStream`) and `tools/generate.py` hold back
until the character's last byte arrives. Special tokens decode to nothing unless
`skip_special_tokens=False`.

The special tokens are the `added_tokens_decoder` entries plus a `<|reserved_token_<id>|>` for every
other id from N to N+255 (Kimi's tokenizer adds 258 slots, but the model's embedding has N+256 rows:
ids N+256 and N+257 could never be fed to it), and any listed id above that.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Iterable, Sequence

import tiktoken

from model.data.chat_template import ChatPrompt, ChatTemplate, ChatTemplateError
from model.data.errors import TokenizerError

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# The files a checkpoint conversion carries along are listed by model.checkpoint.tokenizer_files.
NUM_RESERVED_SPECIAL = 256

# Kimi's pre-tokenizer (the `pat_str` of tokenization_kimi.py): runs of Han characters; words (letters
# other than Han, with an optional leading non-letter and an English contraction); 1-3 digits;
# punctuation runs with trailing newlines; newline runs; other whitespace. `&&` is character-class
# intersection in the Rust regex engine tiktoken runs.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

MAX_ENCODE_CHARS = 400_000      # per tiktoken call (tokenization_kimi.py's TIKTOKEN_MAX_ENCODE_CHARS)
MAX_RUN_CHARS = 25_000          # longest run of whitespace or non-whitespace per piece (tiktoken issue 195)
# A run of more than MAX_RUN_CHARS whitespace (str.isspace) or other characters; finditer starts each
# match at its run's start (the leftmost position with that many such characters after it).
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))
_LONG_SPACE = re.compile(r"\s{%d}" % (MAX_RUN_CHARS + 1))


def is_kimi_tokenizer_dir(path: str | os.PathLike) -> bool:
  """Whether `path` is a directory holding a `tiktoken.model`."""
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, TIKTOKEN_FILE))


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
  """The token bytes -> rank of a `tiktoken.model` file (what tiktoken's `load_tiktoken_bpe` reads, without
  its download cache, which keeps a copy per path name and would serve a replaced file's old content).

  Raises:
    TokenizerError: a line that is not "<base64> <rank>", a repeated token or rank, ranks not 0..N-1.
  """
  path = os.fspath(path)
  ranks: dict[bytes, int] = {}
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      fields = line.split()
      try:
        if len(fields) != 2:
          raise ValueError("expected two fields")
        token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
      except (ValueError, binascii.Error):
        raise TokenizerError(f"{path}:{lineno}: expected '<base64 token bytes> <rank>', got "
                             f"{line[:80].decode('utf-8', 'replace').rstrip()!r}") from None
      if token in ranks:
        raise TokenizerError(f"{path}:{lineno}: token {token!r} is listed twice")
      ranks[token] = rank
  if not ranks:
    raise TokenizerError(f"tiktoken file has no tokens: {path!r}")
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise TokenizerError(f"tiktoken file {path!r}: the ranks must be 0..{len(ranks) - 1}, each once")
  missing = [b for b in range(256) if bytes([b]) not in ranks]
  if missing:
    raise TokenizerError(f"tiktoken file {path!r} lacks single-byte tokens (a bytes-level BPE needs all 256): "
                         f"{[bytes([b]) for b in missing[:8]]}")
  return ranks


def _token_name(value, key: str, path: str) -> str | None:
  """A tokenizer_config.json token entry: a string, or an AddedToken object {"content": ...}."""
  if value is None:
    return None
  if isinstance(value, dict):
    value = value.get("content")
  if not isinstance(value, str):
    raise TokenizerError(f"{path}: {key} must be a token string or {{\"content\": ...}}, got {value!r}")
  return value


def _has_long_run(text: str) -> bool:
  # str.split() finds the non-whitespace runs faster than a regex does (measured: 23 vs 32 ms per MB).
  return bool(_LONG_SPACE.search(text)) or max(map(len, text.split()), default=0) > MAX_RUN_CHARS


def _pieces(text: str) -> list[str]:
  """`text` cut as tokenization_kimi.py cuts it before tiktoken (module docstring): windows of
  MAX_ENCODE_CHARS characters, each cut inside a longer run every MAX_RUN_CHARS characters from the
  run's start."""
  if len(text) <= MAX_RUN_CHARS or (len(text) <= MAX_ENCODE_CHARS and not _has_long_run(text)):
    return [text]
  out = []
  for w in range(0, len(text), MAX_ENCODE_CHARS):
    window, start = text[w:w + MAX_ENCODE_CHARS], 0
    if not _has_long_run(window):
      out.append(window)
      continue
    for m in _LONG_RUN.finditer(window):
      for cut in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS):
        out.append(window[start:cut])
        start = cut
    out.append(window[start:])
  return out


class KimiTokenizer:
  """The tiktoken tokenizer of a Kimi checkpoint directory (module docstring).

  Args:
    path: the directory holding tiktoken.model and tokenizer_config.json.

  Raises:
    TokenizerError: a missing directory or file, or a malformed one (the message names the file and
      what was expected). ChatTemplateError: a chat template that does not compile.
  """

  ids_only = False

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    if not os.path.isdir(self.path):
      raise TokenizerError(f"Kimi tokenizer directory not found: {self.path!r}" if not os.path.exists(self.path)
                           else f"a Kimi tokenizer is a directory (with {TIKTOKEN_FILE}), got the file {self.path!r}")
    for name in (TIKTOKEN_FILE, CONFIG_FILE):
      if not os.path.isfile(os.path.join(self.path, name)):
        raise TokenizerError(f"the tokenizer directory {self.path!r} has no {name} (a Kimi tokenizer needs "
                             f"{TIKTOKEN_FILE} and {CONFIG_FILE})")
    ranks = read_tiktoken_ranks(os.path.join(self.path, TIKTOKEN_FILE))
    config_path = os.path.join(self.path, CONFIG_FILE)
    config = self._read_json(config_path)
    self.num_base_tokens = n = len(ranks)

    named: dict[int, str] = {}
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
      raise TokenizerError(f"{config_path}: added_tokens_decoder must be an object {{\"<id>\": {{\"content\": ...}}}}")
    for key, entry in decoder.items():
      content = _token_name(entry, f"added_tokens_decoder[{key!r}]", config_path)
      try:
        i = int(key)
      except ValueError:
        raise TokenizerError(f"{config_path}: added_tokens_decoder key {key!r} is not a token id") from None
      if i < n:
        raise TokenizerError(f"{config_path}: added token {content!r} has id {i}, inside the base vocabulary "
                             f"[0, {n}) of {TIKTOKEN_FILE}; special tokens start at {n}")
      named[i] = content
    top = max([n + NUM_RESERVED_SPECIAL - 1, *named])
    self.special_tokens: dict[str, int] = {}
    for i in range(n, top + 1):
      name = named.get(i, f"<|reserved_token_{i}|>")
      if name in self.special_tokens:
        raise TokenizerError(f"{config_path}: the special token {name!r} has two ids "
                             f"({self.special_tokens[name]} and {i})")
      self.special_tokens[name] = i
    self._special_names = {i: s for s, i in self.special_tokens.items()}
    self._enc = tiktoken.Encoding(name=f"kimi:{self.path}", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                  special_tokens=self.special_tokens)
    self.vocab_size = top + 1

    def special(key: str, default: str | None) -> int | None:
      name = _token_name(config.get(key, default), key, config_path)
      if name is None:
        return None
      if name not in self.special_tokens:
        if key not in config:     # tokenization_kimi's default name, absent here: no such token
          return None
        raise TokenizerError(f"{config_path}: {key} {name!r} is not one of the special tokens (added_tokens_decoder)")
      return self.special_tokens[name]

    self.bos_id = special("bos_token", "[BOS]")
    self.eos_id = special("eos_token", "[EOS]")
    self.unk_id = special("unk_token", None)
    self.pad_id = special("pad_token", None)
    stops = {self.eos_id, self.special_tokens.get("<|im_end|>")}
    gen_path = os.path.join(self.path, GENERATION_CONFIG_FILE)
    if os.path.isfile(gen_path):
      eos = self._read_json(gen_path).get("eos_token_id")
      for i in (eos if isinstance(eos, list) else [eos]):
        if i is None:
          continue
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size:
          raise TokenizerError(f"{gen_path}: eos_token_id {i!r} is not a token id in [0, {self.vocab_size})")
        stops.add(i)
    self.stop_ids = frozenset(i for i in stops if i is not None)

    self.template_vars = {k: self._special_names.get(v) for k, v in (
        ("bos_token", self.bos_id), ("eos_token", self.eos_id), ("unk_token", self.unk_id),
        ("pad_token", self.pad_id)) if v is not None}
    source = self._template_source(config, config_path)
    self.chat_template = None if source is None else ChatTemplate(source, self.special_tokens, self.template_vars)

  @staticmethod
  def _read_json(path: str) -> dict:
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise TokenizerError(f"cannot read {path!r} as JSON: {e}") from None
    if not isinstance(data, dict):
      raise TokenizerError(f"{path!r} must hold a JSON object")
    return data

  def _template_source(self, config: dict, config_path: str) -> str | None:
    jinja_path = os.path.join(self.path, TEMPLATE_FILE)
    if os.path.isfile(jinja_path):
      try:
        with open(jinja_path, encoding="utf-8") as f:
          return f.read()
      except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read the chat template {jinja_path!r}: {e}") from None
    source = config.get("chat_template")
    if isinstance(source, list):   # named templates [{"name": ..., "template": ...}]: the default one
      by_name = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
      source = by_name.get("default")
    if source is not None and not isinstance(source, str):
      raise TokenizerError(f"{config_path}: chat_template must be a string (or named templates with a 'default')")
    return source

  # --- the project's tokenizer surface ------------------------------------------------------------

  def _framed(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
    if add_bos:
      if self.bos_id is None:
        raise TokenizerError(f"add_bos=True but the tokenizer {self.path!r} has no bos token")
      ids.insert(0, self.bos_id)
    if add_eos:
      if self.eos_id is None:
        raise TokenizerError(f"add_eos=True but the tokenizer {self.path!r} has no eos token")
      ids.append(self.eos_id)
    return ids

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, *,
             allow_special: bool = False) -> list[int]:
    """Token ids of `text`, optionally framed by bos/eos.

    A special-token string in `text` is plain text, unless `allow_special=True` (then each becomes its
    control id, as tokenization_kimi.py's default `encode` does: for text that is trusted to be a prompt
    rendered already, never for what a user typed).
    """
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    if allow_special:
      ids = [t for piece in _pieces(text) for t in self._enc.encode(piece, allowed_special="all")]
    else:
      ids = self._encode_plain(text)
    return self._framed(ids, add_bos, add_eos)

  def encode_batch(self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
    """`encode` over a list of strings (tiktoken's threads for the common case)."""
    texts = list(texts)
    for i, t in enumerate(texts):
      if not isinstance(t, str):
        raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
    if all(len(_pieces(t)) == 1 for t in texts):
      out = self._enc.encode_ordinary_batch(texts)
    else:
      out = [self.encode(t) for t in texts]
    return [self._framed(ids, add_bos, add_eos) for ids in out]

  def _check_ids(self, ids: Iterable[int]) -> list[int]:
    ids = [int(i) for i in ids]
    n = self.vocab_size
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
      raise TokenizerError(f"ids out of range [0, {n}) for {self.path!r}: {bad[:8]}")
    return ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids` (UTF-8, U+FFFD for invalid or incomplete byte sequences); special tokens decode to
    nothing, or to their text with `skip_special_tokens=False`.

    Raises:
      TokenizerError: an id outside [0, vocab_size).
    """
    ids = self._check_ids(ids)
    n = self.num_base_tokens
    if skip_special_tokens:
      ids = [i for i in ids if i < n]
    return self._enc.decode_bytes(ids).decode("utf-8", errors="replace")

  def token_bytes(self, i: int) -> bytes:
    """The bytes of token `i` (a special token: its text's UTF-8)."""
    return self._enc.decode_single_token_bytes(self._check_ids([i])[0])

  def id_to_piece(self, i: int) -> str:
    """Token `i` as text (a piece holding part of a character shows U+FFFD for it)."""
    return self.token_bytes(i).decode("utf-8", errors="replace")

  def is_special(self, i: int) -> bool:
    return int(i) >= self.num_base_tokens

  # --- chat ---------------------------------------------------------------------------------------

  def _template(self) -> ChatTemplate:
    if self.chat_template is None:
      raise ChatTemplateError(f"the tokenizer {self.path!r} has no chat template ({CONFIG_FILE} has no "
                              f"chat_template and there is no {TEMPLATE_FILE})", None)
    return self.chat_template

  def render_chat(self, messages, *, add_generation_prompt: bool = True, tools=None, documents=None,
                  **kwargs) -> str:
    """The prompt text of `messages` (as transformers' `apply_chat_template(..., tokenize=False)`)."""
    return self._template().render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   documents=documents, **kwargs)

  def encode_chat(self, messages, *, add_generation_prompt: bool = True, tools=None, documents=None,
                  **kwargs) -> ChatPrompt:
    """The prompt of `messages`: text and ids; only the template's own special tokens are control ids.

    Raises:
      ChatMessageError / ChatTemplateError (model.data.chat_template): bad messages, a template that raised.
    """
    return self._template().encode(messages, self._encode_plain, add_generation_prompt=add_generation_prompt,
                                   tools=tools, documents=documents, **kwargs)

  def _encode_plain(self, text: str) -> list[int]:
    pieces = _pieces(text)
    if len(pieces) == 1:
      return self._enc.encode_ordinary(text)
    return [t for piece in pieces for t in self._enc.encode_ordinary(piece)]

  def __repr__(self) -> str:
    return (f"KimiTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id}, stop_ids={sorted(self.stop_ids)})")
