"""Tokenizers for the Kimi-Linear host: a thin sentencepiece wrapper and an "ids only" stand-in.

Both classes expose the same small surface, so the train, generate and perplexity tools never branch
on which one they hold:

  * `encode(text, add_bos=False, add_eos=False) -> list[int]`
  * `encode_batch(texts, add_bos=False, add_eos=False) -> list[list[int]]`
  * `decode(ids) -> str`
  * `vocab_size: int`, `bos_id / eos_id / pad_id: int | None` (None when the model has no such token)
  * `stop_ids: frozenset[int]`: the ids that end generation (the eos id, and for Kimi also <|im_end|>
    and the checkpoint's generation_config.json eos ids)
  * `ids_only: bool`, `chat_template`: a `model.data.chat_template.ChatTemplate`, or None

`SentencePieceTokenizer` loads a `.model` file written by `tools/train_tokenizer.py` (or any other
sentencepiece model). `IdsOnlyTokenizer` serves checkpoints that ship without a tokenizer: text is a
list of integer ids ("12 7 99" or "12,7,99") and decoding prints the ids back. Kimi checkpoints carry
their own tiktoken tokenizer and chat template (`model.data.tokenizer_kimi.KimiTokenizer`, a directory).
`load_tokenizer(path)` picks the class from the path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

import sentencepiece as spm

from model.data.errors import TokenizerError
from model.data.tokenizer_kimi import TIKTOKEN_FILE, KimiTokenizer

__all__ = ["IdsOnlyTokenizer", "KimiTokenizer", "SentencePieceTokenizer", "Tokenizer", "TokenizerError",
           "check_tokenizer_fits", "load_tokenizer"]


def _optional_id(i: int) -> int | None:
  # sentencepiece reports a disabled special token as -1.
  return None if i is None or i < 0 else int(i)


class SentencePieceTokenizer:
  """A sentencepiece model loaded from a `.model` file.

  Args:
    path: path of a serialized sentencepiece `ModelProto` (the `<prefix>.model` file).

  Raises:
    TokenizerError: the file does not exist, is a directory, or is not a sentencepiece model; the
      message names the path.
  """

  ids_only = False
  chat_template = None

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    if not os.path.exists(self.path):
      raise TokenizerError(f"tokenizer file not found: {self.path!r}")
    if not os.path.isfile(self.path):
      raise TokenizerError(f"tokenizer path is not a file: {self.path!r}")
    with open(self.path, "rb") as f:
      proto = f.read()
    if not proto:
      raise TokenizerError(f"tokenizer file is empty: {self.path!r}")
    self._sp = spm.SentencePieceProcessor()
    try:
      # load_from_serialized_proto avoids sentencepiece's own path handling (non-ASCII paths on
      # some platforms) and gives one error path for every malformed file.
      self._sp.LoadFromSerializedProto(proto)
    except Exception as e:  # sentencepiece raises RuntimeError or OSError depending on the defect
      raise TokenizerError(
          f"not a valid sentencepiece model file: {self.path!r} ({type(e).__name__}: {e})") from None
    if self._sp.vocab_size() <= 0:
      raise TokenizerError(f"sentencepiece model has an empty vocabulary: {self.path!r}")

  @property
  def vocab_size(self) -> int:
    """Number of pieces; every id produced by `encode` is in [0, vocab_size)."""
    return int(self._sp.vocab_size())

  @property
  def bos_id(self) -> int | None:
    return _optional_id(self._sp.bos_id())

  @property
  def eos_id(self) -> int | None:
    return _optional_id(self._sp.eos_id())

  @property
  def pad_id(self) -> int | None:
    return _optional_id(self._sp.pad_id())

  @property
  def unk_id(self) -> int | None:
    return _optional_id(self._sp.unk_id())

  @property
  def stop_ids(self) -> frozenset[int]:
    return frozenset() if self.eos_id is None else frozenset({self.eos_id})

  def _specials(self, add_bos: bool, add_eos: bool) -> tuple[list[int], list[int]]:
    if add_bos and self.bos_id is None:
      raise TokenizerError(f"add_bos=True but the tokenizer {self.path!r} has no bos token")
    if add_eos and self.eos_id is None:
      raise TokenizerError(f"add_eos=True but the tokenizer {self.path!r} has no eos token")
    return ([self.bos_id] if add_bos else []), ([self.eos_id] if add_eos else [])

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Token ids of `text` (a `str`), optionally framed by bos/eos."""
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    head, tail = self._specials(add_bos, add_eos)
    return head + list(self._sp.encode(text)) + tail

  def encode_batch(self, texts: Sequence[str], add_bos: bool = False,
                   add_eos: bool = False) -> list[list[int]]:
    """`encode` over a list of strings in one sentencepiece call (multi-threaded inside)."""
    texts = list(texts)
    for i, t in enumerate(texts):
      if not isinstance(t, str):
        raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
    head, tail = self._specials(add_bos, add_eos)
    return [head + list(ids) + tail for ids in self._sp.encode(texts)]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`; control tokens (bos/eos/pad) decode to nothing.

    Raises:
      TokenizerError: an id outside [0, vocab_size).
    """
    ids = [int(i) for i in ids]
    n = self.vocab_size   # once, not per id: the server decodes every streamed token's text
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
      raise TokenizerError(f"ids out of range [0, {self.vocab_size}) for {self.path!r}: {bad[:8]}")
    return self._sp.decode(ids)

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))

  def __repr__(self) -> str:
    return (f"SentencePieceTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id})")


_ID_SPLIT = re.compile(r"[\s,]+")


class IdsOnlyTokenizer:
  """Stand-in for checkpoints without a tokenizer: "text" is a list of integer token ids.

  `encode("5 17,3")` gives `[5, 17, 3]`; `decode([5, 17, 3])` gives `"5 17 3"`.

  Args:
    vocab_size: the model's vocabulary size; ids must lie in [0, vocab_size).
    bos_id, eos_id, pad_id: special ids, or None when the model has none.

  Raises:
    TokenizerError: vocab_size < 1 or a special id outside [0, vocab_size).
  """

  ids_only = True
  path = None
  chat_template = None

  def __init__(self, vocab_size: int, *, bos_id: int | None = None, eos_id: int | None = None,
               pad_id: int | None = 0):
    if int(vocab_size) < 1:
      raise TokenizerError(f"vocab_size must be >= 1, got {vocab_size}")
    self.vocab_size = int(vocab_size)
    for name, v in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
      if v is not None and not 0 <= int(v) < self.vocab_size:
        raise TokenizerError(f"{name}={v} is outside [0, vocab_size={self.vocab_size})")
    self.bos_id = None if bos_id is None else int(bos_id)
    self.eos_id = None if eos_id is None else int(eos_id)
    self.pad_id = None if pad_id is None else int(pad_id)
    self.unk_id = None
    self.stop_ids = frozenset() if self.eos_id is None else frozenset({self.eos_id})

  def _check(self, ids: list[int]) -> list[int]:
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise TokenizerError(f"ids out of range [0, {self.vocab_size}): {bad[:8]}")
    return ids

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Parses whitespace/comma separated integers.

    Raises:
      TokenizerError: a field that is not an integer, an id out of range, or a missing bos/eos.
    """
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    fields = [f for f in _ID_SPLIT.split(text.strip()) if f]
    ids = []
    for f in fields:
      try:
        ids.append(int(f))
      except ValueError:
        raise TokenizerError(
            f"ids-only tokenizer: expected integer token ids separated by spaces or commas, "
            f"got {f!r}") from None
    self._check(ids)
    if add_bos and self.bos_id is None:
      raise TokenizerError("add_bos=True but the ids-only tokenizer has no bos_id")
    if add_eos and self.eos_id is None:
      raise TokenizerError("add_eos=True but the ids-only tokenizer has no eos_id")
    return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

  def encode_batch(self, texts: Sequence[str], add_bos: bool = False,
                   add_eos: bool = False) -> list[list[int]]:
    return [self.encode(t, add_bos, add_eos) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    return " ".join(str(i) for i in self._check([int(i) for i in ids]))

  def __repr__(self) -> str:
    return (f"IdsOnlyTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})")


Tokenizer = SentencePieceTokenizer | IdsOnlyTokenizer | KimiTokenizer


def load_tokenizer(path: str | os.PathLike | None, *, vocab_size: int | None = None,
                   bos_id: int | None = None, eos_id: int | None = None,
                   pad_id: int | None = 0) -> Tokenizer:
  """The tokenizer at `path`, whichever kind it is, or an ids-only one when `path` is None or "".

  Args:
    path: a sentencepiece `.model` file (`SentencePieceTokenizer`); a directory holding `tiktoken.model`
      and `tokenizer_config.json`, e.g. a Hugging Face Kimi checkpoint (`KimiTokenizer`); or None/""
      for ids-only mode.
    vocab_size, bos_id, eos_id, pad_id: used only in ids-only mode (vocab_size then required).

  Raises:
    TokenizerError: a missing path, a directory without tiktoken.model, an invalid file (the message
      names the path and what was expected), or ids-only mode without vocab_size.
  """
  if path:
    path = os.fspath(path)
    if os.path.isdir(path):
      if not os.path.isfile(os.path.join(path, TIKTOKEN_FILE)):
        raise TokenizerError(f"the tokenizer directory {path!r} has no {TIKTOKEN_FILE}: expected a sentencepiece "
                             f".model file, or a directory with {TIKTOKEN_FILE} and tokenizer_config.json "
                             f"(a Kimi checkpoint's tokenizer)")
      return KimiTokenizer(path)
    if not os.path.exists(path):
      raise TokenizerError(f"tokenizer file not found: {path!r} (expected a sentencepiece .model file, or a directory "
                           f"with {TIKTOKEN_FILE} and tokenizer_config.json)")
    return SentencePieceTokenizer(path)
  if vocab_size is None:
    raise TokenizerError("no tokenizer path given: ids-only mode needs vocab_size")
  return IdsOnlyTokenizer(vocab_size, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)


def check_tokenizer_fits(tok: Tokenizer, config, *, name: str | None = None, advise: bool = True) -> None:
  """Checks that tokenizer `tok` fits a model config: no more pieces than `config.vocab_size`, and
  each special id the tokenizer has (bos, eos, pad) equal to the config's `*_token_id`. The config's
  eos may also be any of the tokenizer's `stop_ids` (Kimi: the config's eos_token_id is <|im_end|>,
  the tokenizer's eos_token [EOS]; both end generation).

  Every mismatch is reported in ONE error, so a user fixes them all in one go, e.g. the tiny config
  (bos 1, eos 2) with a tokenizer from tools.train_tokenizer (bos 2, eos 3) gives
  "the tokenizer 'tok.model' does not fit the model config: its bos id is 2 but bos_token_id=1; its
  eos id is 3 but eos_token_id=2; pass bos_token_id=2 eos_token_id=3".

  Args:
    tok: the tokenizer. config: anything indexable by vocab_size / bos_token_id / eos_token_id /
      pad_token_id (a model config). name: how the message calls the tokenizer (default its path).
    advise: end the message with the `key=value` overrides that would fit, all of them on one
      `pass ...` (for tools where the config keys can be overridden on the command line).

  Raises:
    TokenizerError: one message listing every mismatch (vocabulary size first, then bos, eos, pad).
  """
  name = name if name is not None else repr(os.fspath(getattr(tok, "path", "") or ""))
  problems, fixes = [], []
  vocab = int(config["vocab_size"])
  if tok.vocab_size > vocab:
    problems.append(f"it has {tok.vocab_size} tokens but vocab_size={vocab}")
    fixes.append(f"vocab_size={tok.vocab_size}")
  stops = getattr(tok, "stop_ids", frozenset())
  for key, what, tid in (("bos_token_id", "bos", tok.bos_id), ("eos_token_id", "eos", tok.eos_id),
                         ("pad_token_id", "pad", tok.pad_id)):
    if key == "eos_token_id" and int(config[key]) in stops:
      continue
    if tid is not None and tid != int(config[key]):
      problems.append(f"its {what} id is {tid} but {key}={config[key]}")
      fixes.append(f"{key}={tid}")
  if problems:
    fix = f"; pass {' '.join(fixes)}" if advise else ""
    if advise and fixes[0].startswith("vocab_size="):
      fix += " (vocab_size may be larger)"
    raise TokenizerError(f"the tokenizer {name} does not fit the model config: {'; '.join(problems)}{fix}")
