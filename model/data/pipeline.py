"""Text input pipeline: document readers, the held-out split, packing, and the training iterator.

Everything here is host-side NumPy (no JAX at import time, so the tokenizer tool stays light); the
arrays it produces are what the model consumes:

  file --read_documents--> documents (str or id lists) --tokenize_documents--> id arrays
       --pack_documents--> rows `Batch[R, T]` --BatchIterator--> training batches `Batch[B, T]`
       --pack_eval_windows--> `EvalWindow[B, T]` list for perplexity with state carried across windows

Conventions (shared with the KDA ops, docs/packing.md section 'The contract'):
  * `segment_ids` int32: 0 = padding, documents in a row are labelled 1..n left to right; label n
    uses state slot n - 1.
  * `positions` int32: offset of the token inside its document (0 on padding).
  * `targets[b, t]` is the token that `inputs[b, t]` must predict; `loss_mask[b, t]` (bool) is True
    only where that target is the next token *of the same document*. So padding is masked and the
    last token of a document never predicts the first token of the next one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from model.errors import UserError

FORMATS = ("text", "jsonl", "ids")
SPLIT_MODES = ("none", "long", "fill")


class DataFormatError(UserError):
  """Malformed input data; the message names the file (or source) and the 1-based line."""


class DocumentTooLongError(ValueError):
  """`pack_documents(split="none")` met a document longer than a row; callers name their own key for
  the split mode (kda-train: `split_long`)."""

  def __init__(self, index: int, length: int, seq_len: int):
    super().__init__(f"documents[{index}] has {length} tokens > seq_len={seq_len}; use split='long' or 'fill' "
                     f"to cut long documents")
    self.index, self.length, self.seq_len = index, length, seq_len


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def decode_utf8(data: bytes, source: str = "<bytes>") -> str:
  """Strict UTF-8 decoding (a leading BOM is dropped).

  Raises:
    DataFormatError: invalid UTF-8, naming `source`, the line and the byte offset of the first bad
      byte.
  """
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    raise DataFormatError(
        f"{source}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}: "
        f"{e.reason})") from None
  return text[1:] if text.startswith("\ufeff") else text


def read_text_file(path: str | os.PathLike) -> str:
  """Whole file as `str` (strict UTF-8).

  Raises:
    FileNotFoundError: no such file (message names the path).
    DataFormatError: invalid UTF-8 (file, line, offset).
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"input file not found: {path!r}")
  with open(path, "rb") as f:
    return decode_utf8(f.read(), path)


def _lines(text: str, first_line: int) -> Iterator[tuple[int, str]]:
  # Split on "\n" only (str.splitlines also splits on \x0b, \u2028, ... and would make our line
  # numbers disagree with editors and `grep -n`); tolerate CRLF files.
  if not text:
    return
  parts = text.split("\n")
  if parts[-1] == "":
    parts.pop()  # a final newline ends the last line, it does not start a new one
  for i, line in enumerate(parts):
    yield first_line + i, line.removesuffix("\r")


def parse_text_documents(text: str, source: str = "<string>", first_line: int = 1) -> list[str]:
  """Documents of a plain-text corpus: maximal blocks of non-blank lines.

  A line that is empty or only whitespace separates documents. A document is its lines joined with
  "\\n" (no trailing newline). `source`/`first_line` only label error messages.
  """
  del source  # plain text cannot be malformed once it is valid UTF-8
  docs, block = [], []
  for _, line in _lines(text, first_line):
    if line.strip():
      block.append(line)
    elif block:
      docs.append("\n".join(block))
      block = []
  if block:
    docs.append("\n".join(block))
  return docs


def parse_jsonl_documents(text: str, source: str = "<string>", first_line: int = 1) -> list[str]:
  """Documents of a JSON-lines corpus: each non-blank line is a JSON string or an object with a
  string "text" field (other fields are ignored).

  Raises:
    DataFormatError: invalid JSON, or a value of another shape (names source and line).
  """
  docs = []
  for lineno, line in _lines(text, first_line):
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataFormatError(f"{source}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(obj, dict):
      if "text" not in obj:
        raise DataFormatError(f"{source}:{lineno}: JSON object has no \"text\" field "
                              f"(keys: {sorted(obj)[:8]})")
      obj = obj["text"]
      if not isinstance(obj, str):
        raise DataFormatError(f"{source}:{lineno}: \"text\" must be a string, got "
                              f"{type(obj).__name__}")
    elif not isinstance(obj, str):
      raise DataFormatError(f"{source}:{lineno}: expected a JSON object with a \"text\" field or a "
                            f"JSON string, got {type(obj).__name__}")
    docs.append(obj)
  return docs


_ID_SEP = re.compile(r"[\s,]+")


def parse_ids_documents(text: str, source: str = "<string>", first_line: int = 1,
                        vocab_size: int | None = None) -> list[np.ndarray]:
  """Documents of a token-id corpus: each non-blank line is one document, ids separated by
  whitespace and/or commas.

  Returns:
    A list of int32 `[L]` arrays.

  Raises:
    DataFormatError: a field that is not a non-negative integer, or an id >= vocab_size.
  """
  docs = []
  for lineno, line in _lines(text, first_line):
    fields = [f for f in _ID_SEP.split(line.strip()) if f]
    if not fields:
      continue
    ids = []
    for col, f in enumerate(fields, 1):
      try:
        v = int(f)
      except ValueError:
        raise DataFormatError(f"{source}:{lineno}: field {col} is not an integer token id: {f!r}") from None
      if v < 0 or (vocab_size is not None and v >= vocab_size) or v >= 2**31:
        limit = vocab_size if vocab_size is not None else 2**31
        raise DataFormatError(f"{source}:{lineno}: token id {v} (field {col}) is outside [0, {limit})")
      ids.append(v)
    docs.append(np.asarray(ids, np.int32))
  return docs


def parse_documents(text: str, fmt: str, source: str = "<string>", first_line: int = 1,
                    vocab_size: int | None = None) -> list:
  """Dispatches to `parse_{text,jsonl,ids}_documents` by `fmt`."""
  if fmt == "text":
    return parse_text_documents(text, source, first_line)
  if fmt == "jsonl":
    return parse_jsonl_documents(text, source, first_line)
  if fmt == "ids":
    return parse_ids_documents(text, source, first_line, vocab_size)
  raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def read_documents(path: str | os.PathLike, fmt: str, *, split: str | None = None,
                   heldout_fraction: float = 0.1, vocab_size: int | None = None) -> list:
  """Reads documents from a file, optionally from one side of the held-out split.

  Args:
    path: the corpus file.
    fmt: "text" (blank-line separated blocks -> list[str]), "jsonl" (-> list[str]) or "ids"
      (-> list of int32 arrays).
    split: None for the whole file, "train" or "heldout" for the two sides of
      `split_heldout(file_text, heldout_fraction)`. The split is taken on the raw file, so it is the
      same byte cut whatever the format; error line numbers stay those of the file.
    vocab_size: for "ids", reject ids >= vocab_size.

  Raises:
    FileNotFoundError, DataFormatError (file and line), ValueError (bad fmt/split).
  """
  if fmt not in FORMATS:
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
  path = os.fspath(path)
  text = read_text_file(path)
  first_line = 1
  if split is not None:
    if split not in ("train", "heldout"):
      raise ValueError(f"split must be None, 'train' or 'heldout', got {split!r}")
    train, heldout = split_heldout(text, heldout_fraction)
    if split == "train":
      text = train
    else:
      first_line = train.count("\n") + 1
      text = heldout
  return parse_documents(text, fmt, path, first_line, vocab_size)


# ----------------------------------------------------------------------------------------------
# Held-out split
# ----------------------------------------------------------------------------------------------


def heldout_start_byte(data: bytes, fraction: float = 0.1) -> int:
  """Byte offset where the held-out split of `data` starts.

  The rule (the project's held-out split, used by the tokenizer, training and evaluation alike): the
  last `fraction` of the bytes, cut at a line boundary.
  Precisely: let `target = n - ceil(fraction * n)`; the split starts at the beginning of the line
  that contains byte `target`. Every one of the last `ceil(fraction * n)` bytes is therefore held
  out (the held-out side is >= the fraction, by less than one line), and no line is split.

  Raises:
    ValueError: fraction not in (0, 1).
  """
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"heldout fraction must be in (0, 1), got {fraction}")
  n = len(data)
  if n == 0:
    return 0
  target = n - math.ceil(fraction * n)
  return data.rfind(b"\n", 0, target) + 1  # rfind gives -1 when the first line holds `target`


def split_heldout(text: str | bytes, fraction: float = 0.1) -> tuple:
  """Splits a corpus into (train, heldout) by the project's held-out rule (`heldout_start_byte`).

  Args:
    text: the whole corpus, `str` (measured in UTF-8 bytes) or `bytes`.
    fraction: held-out share of the bytes, in (0, 1).

  Returns:
    `(train, heldout)` of the same type as `text`, with `train + heldout == text`; `heldout` starts
    at a line start. `train` may be empty for a single-line corpus.

  Raises:
    ValueError: fraction not in (0, 1).
  """
  data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
  cut = heldout_start_byte(data, fraction)
  if isinstance(text, str):
    # "\n" is a single byte that never occurs inside a multi-byte UTF-8 sequence, so the byte cut
    # is also a character boundary.
    return data[:cut].decode("utf-8"), data[cut:].decode("utf-8")
  return data[:cut], data[cut:]


# ----------------------------------------------------------------------------------------------
# Tokenization
# ----------------------------------------------------------------------------------------------


def frame_ids(ids, bos_id: int | None = None, eos_id: int | None = None) -> np.ndarray:
  """int32 `[L (+1) (+1)]`: `ids` with an optional bos prepended and eos appended."""
  parts = ([bos_id] if bos_id is not None else []) + list(np.asarray(ids, np.int64).reshape(-1))
  if eos_id is not None:
    parts.append(eos_id)
  return np.asarray(parts, np.int32)


def tokenize_documents(docs: Sequence, tokenizer, *, add_bos: bool = True,
                       add_eos: bool = True) -> list[np.ndarray]:
  """Token ids of each document, framed by bos/eos as configured.

  Args:
    docs: strings (encoded with `tokenizer.encode_batch`) or id sequences (used as they are).
    tokenizer: a `model.data.tokenizer` tokenizer (its bos_id/eos_id are used for id documents too).

  Returns:
    A list of int32 `[L_i]` arrays.

  Raises:
    ValueError: add_bos/add_eos requested but the tokenizer lacks that token.
  """
  if add_bos and tokenizer.bos_id is None:
    raise ValueError("add_bos=True but the tokenizer has no bos_id")
  if add_eos and tokenizer.eos_id is None:
    raise ValueError("add_eos=True but the tokenizer has no eos_id")
  bos = tokenizer.bos_id if add_bos else None
  eos = tokenizer.eos_id if add_eos else None
  docs = list(docs)
  if docs and all(isinstance(d, str) for d in docs):
    encoded = tokenizer.encode_batch(docs)
  else:
    encoded = [tokenizer.encode(d) if isinstance(d, str) else d for d in docs]
  return [frame_ids(ids, bos, eos) for ids in encoded]


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------


class Batch(NamedTuple):
  """Packed rows (a JAX pytree: pass it straight to jitted code).

  Attributes (all `[B, T]`):
    inputs: int32 token ids; `pad_id` on padding.
    targets: int32 next-token ids; `pad_id` where `loss_mask` is False.
    loss_mask: bool; True where `targets` is the next token of the same document.
    segment_ids: int32; 0 padding, 1..n documents (pieces) in the row, left to right.
    positions: int32; offset inside the document (training pieces restart at 0), 0 on padding.
  """

  inputs: np.ndarray
  targets: np.ndarray
  loss_mask: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray


class EvalWindow(NamedTuple):
  """One evaluation window: `Batch` fields plus, per state slot, how to seed it.

  Row b of window w+1 continues row b of window w (each row is an independent stream of documents).

  Attributes:
    inputs, targets, loss_mask, segment_ids, positions: `[B, T]` as in `Batch`, except that
      `positions` continue across windows (document offsets), and the last token of a piece that
      the next window continues does predict that continuation (`loss_mask` True; its target is the
      document's next token). Over all windows every document token but the first is a target
      exactly once.
    continues: bool `[B, N]`; True for slot n-1 when segment n continues a document from the
      previous window (then n == 1: only the first piece of a row can continue).
    prev_label: int32 `[B, N]`; the label (1..N) that document had in the previous window's row,
      0 when not continuing. Initial state of slot n-1 = that window's final state of slot
      prev_label - 1 (see `carry_initial_states`).
    doc_index: int32 `[B, N]`; index of the document in the packer's input list, -1 for an
      unused slot.
    doc_offset: int32 `[B, N]`; token offset inside the document where this piece starts.
  """

  inputs: np.ndarray
  targets: np.ndarray
  loss_mask: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  continues: np.ndarray
  prev_label: np.ndarray
  doc_index: np.ndarray
  doc_offset: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Piece:
  doc: int    # index into the documents list
  start: int  # token offset inside the document
  end: int    # exclusive


def _as_documents(docs: Sequence) -> list[np.ndarray]:
  out = []
  for i, d in enumerate(docs):
    a = np.asarray(d)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
      raise ValueError(f"documents[{i}] must be a 1-D sequence of integer token ids, got "
                       f"shape {a.shape} dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= 2**31):
      raise ValueError(f"documents[{i}] has token ids outside [0, 2**31)")
    out.append(a.astype(np.int32))
  return out


def _check_pack_args(seq_len: int, max_segments: int | None) -> None:
  if int(seq_len) < 2:
    raise ValueError(f"seq_len must be >= 2 (a token and its target), got {seq_len}")
  if max_segments is not None and int(max_segments) < 1:
    raise ValueError(f"max_segments must be >= 1 or None, got {max_segments}")


def _plan_rows(docs: list[np.ndarray], seq_len: int, max_segments: int | None,
               split: str) -> list[list[_Piece]]:
  """Next-fit packing plan: pieces in document order, a new row when the piece or the segment
  budget does not fit. Order is kept, so concatenating the rows' tokens gives the documents back."""
  if split not in SPLIT_MODES:
    raise ValueError(f"split must be one of {SPLIT_MODES}, got {split!r}")
  rows: list[list[_Piece]] = []
  cur: list[_Piece] = []
  used = 0

  def full(extra: int) -> bool:
    return used + extra > seq_len or (max_segments is not None and len(cur) >= max_segments)

  for i, d in enumerate(docs):
    n = len(d)
    if n == 0:
      continue
    if split == "fill":
      s = 0
      while s < n:
        if full(1):
          rows.append(cur)
          cur, used = [], 0
        take = min(n - s, seq_len - used)
        cur.append(_Piece(i, s, s + take))
        used += take
        s += take
      continue
    if n > seq_len and split == "none":
      raise DocumentTooLongError(i, n, seq_len)
    for s in range(0, n, seq_len):
      piece = _Piece(i, s, min(n, s + seq_len))
      if full(piece.end - piece.start):
        rows.append(cur)
        cur, used = [], 0
      cur.append(piece)
      used += piece.end - piece.start
  if cur:
    rows.append(cur)
  return rows


def pack_documents(docs: Sequence, seq_len: int, *, max_segments: int | None = None,
                   split: str = "long", pad_id: int = 0) -> Batch:
  """Packs token-id documents into fixed-length training rows.

  Documents are placed in order, next-fit: a document (piece) goes into the current row if its
  tokens and a free segment label fit, otherwise a new row starts. Empty documents are skipped.

  Args:
    docs: sequence of 1-D integer id arrays (already framed with bos/eos, see `tokenize_documents`).
    seq_len: T, the row length.
    max_segments: at most this many segments per row (the static N of the KDA state slots), or
      None for no limit (then N <= T).
    split: what to do with documents longer than T:
      "none" raises; "long" cuts them into T-token pieces (shorter documents are never cut);
      "fill" cuts any document at a row end so rows are filled completely (least padding).
      A cut is a plain restart: each piece is its own segment with positions from 0, and the last
      token of a piece is not trained to predict the next piece.
    pad_id: token id on padding (inputs and masked targets).

  Returns:
    `Batch` of `[R, T]` arrays, R = number of rows.

  Raises:
    ValueError: seq_len < 2, max_segments < 1, a bad split mode, a non-1-D or negative document.
    DocumentTooLongError: (split="none") a document longer than T.
  """
  _check_pack_args(seq_len, max_segments)
  docs = _as_documents(docs)
  rows = _plan_rows(docs, int(seq_len), max_segments, split)
  r_count, t = len(rows), int(seq_len)
  inputs = np.full((r_count, t), pad_id, np.int32)
  targets = np.full((r_count, t), pad_id, np.int32)
  loss_mask = np.zeros((r_count, t), bool)
  segment_ids = np.zeros((r_count, t), np.int32)
  positions = np.zeros((r_count, t), np.int32)
  for r, row in enumerate(rows):
    u = 0
    for label, p in enumerate(row, 1):
      n = p.end - p.start
      tokens = docs[p.doc][p.start:p.end]
      inputs[r, u:u + n] = tokens
      segment_ids[r, u:u + n] = label
      positions[r, u:u + n] = np.arange(n)
      targets[r, u:u + n - 1] = tokens[1:]
      loss_mask[r, u:u + n - 1] = True
      u += n
  return Batch(inputs, targets, loss_mask, segment_ids, positions)


def _balance_streams(lengths: list[int], num_streams: int) -> list[list[int]]:
  # Greedy least-loaded assignment in document order (ties -> lowest stream): deterministic and
  # keeps the streams within one document length of each other.
  loads = [0] * num_streams
  streams: list[list[int]] = [[] for _ in range(num_streams)]
  for i, n in enumerate(lengths):
    if n == 0:
      continue
    s = min(range(num_streams), key=lambda j: (loads[j], j))
    streams[s].append(i)
    loads[s] += n
  return streams


def pack_eval_windows(docs: Sequence, seq_len: int, batch_size: int, *,
                      max_segments: int | None = None, pad_id: int = 0) -> list[EvalWindow]:
  """Packs documents into evaluation windows whose documents may continue into the next window.

  Documents are spread over `batch_size` row streams (least-loaded first, in order, never split
  across streams). Each stream is cut into windows of T tokens ("fill" packing): a document that
  does not fit is cut at the window end and continues as segment 1 of the same row in the next
  window, where `continues`/`prev_label` say which final state to carry over. Streams that run out
  are padded, so all windows have the same `[B, T]` and `[B, N]` shapes.

  Args:
    docs: 1-D integer id arrays (framed with bos/eos as desired). Empty documents are skipped.
    seq_len: T.
    batch_size: B, the number of row streams.
    max_segments: N, the segment budget per row; None uses the largest count that occurs (so N is
      fixed for the whole list and can be a static argument).
    pad_id: id on padding.

  Returns:
    list of `EvalWindow` (empty when there are no tokens).

  Raises:
    ValueError: seq_len < 2, batch_size < 1, max_segments < 1, malformed documents.
  """
  _check_pack_args(seq_len, max_segments)
  if int(batch_size) < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  docs = _as_documents(docs)
  t = int(seq_len)
  streams = _balance_streams([len(d) for d in docs], int(batch_size))
  # Each stream's windows, planned with the "fill" packer over that stream's documents.
  plans = []
  for ids in streams:
    rows = _plan_rows([docs[i] for i in ids], t, max_segments, "fill")
    plans.append([[_Piece(ids[p.doc], p.start, p.end) for p in row] for row in rows])
  num_windows = max((len(p) for p in plans), default=0)
  n_slots = max_segments if max_segments is not None else max(
      (len(row) for p in plans for row in p), default=1)
  b = int(batch_size)
  windows = []
  for w in range(num_windows):
    inputs = np.full((b, t), pad_id, np.int32)
    targets = np.full((b, t), pad_id, np.int32)
    loss_mask = np.zeros((b, t), bool)
    segment_ids = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    continues = np.zeros((b, n_slots), bool)
    prev_label = np.zeros((b, n_slots), np.int32)
    doc_index = np.full((b, n_slots), -1, np.int32)
    doc_offset = np.zeros((b, n_slots), np.int32)
    for r, plan in enumerate(plans):
      if w >= len(plan):
        continue
      u = 0
      for label, p in enumerate(plan[w], 1):
        d = docs[p.doc]
        n = p.end - p.start
        inputs[r, u:u + n] = d[p.start:p.end]
        segment_ids[r, u:u + n] = label
        positions[r, u:u + n] = np.arange(p.start, p.end)
        # Targets run one past the piece when the document goes on in the next window.
        last = min(p.end + 1, len(d))
        targets[r, u:u + last - p.start - 1] = d[p.start + 1:last]
        loss_mask[r, u:u + last - p.start - 1] = True
        doc_index[r, label - 1] = p.doc
        doc_offset[r, label - 1] = p.start
        if p.start > 0:  # "fill" only cuts at a window end, so this is label 1
          continues[r, label - 1] = True
          prev_label[r, label - 1] = len(plan[w - 1])
        u += n
    windows.append(EvalWindow(inputs, targets, loss_mask, segment_ids, positions, continues,
                              prev_label, doc_index, doc_offset))
  return windows


def carry_initial_states(final_states, window: EvalWindow):
  """Initial per-slot states for `window` from the previous window's final states.

  Args:
    final_states: `[B, N, ...]` (e.g. KDA states `[B, N, H, K, V]` or conv caches `[B, N, W-1, D]`),
      the previous window's final state per slot; NumPy or JAX.
    window: the window about to run (its `continues`/`prev_label` are `[B, N]`).

  Returns:
    `[B, N, ...]` like `final_states`: slot n-1 holds `final_states[b, prev_label - 1]` where
    `continues[b, n-1]`, zeros elsewhere (a document starting fresh).
  """
  import jax.numpy as jnp  # local: keep the module importable without JAX initialisation

  final_states = jnp.asarray(final_states)
  cont = jnp.asarray(window.continues)
  if final_states.shape[:2] != cont.shape:
    raise ValueError(f"final_states leading dims {final_states.shape[:2]} must be [B, N] = "
                     f"{cont.shape}")
  src = jnp.maximum(jnp.asarray(window.prev_label) - 1, 0)
  extra = final_states.ndim - 2
  idx = src.reshape(src.shape + (1,) * extra)
  gathered = jnp.take_along_axis(final_states, idx, axis=1)
  keep = cont.reshape(cont.shape + (1,) * extra)
  return jnp.where(keep, gathered, jnp.zeros_like(gathered))


# ----------------------------------------------------------------------------------------------
# Training iterator
# ----------------------------------------------------------------------------------------------


class BatchIterator:
  """Seeded, shuffling, epoch-aware iterator over packed rows; every batch is a pure function of
  (seed, step), so a resumed run sees exactly the batches it would have seen.

  Global row slot i = step * B + j (j < B) belongs to epoch `i // R` and takes row
  `perm_e[i % R]`, where `perm_e` is a permutation of the R rows drawn from
  `np.random.default_rng([seed, e])` (identity when shuffle=False). A batch may straddle two
  epochs. With `num_epochs` set, slots past `num_epochs * R` are all-padding rows (loss_mask False)
  and iteration stops after the batch holding the last real row.

  Args:
    rows: `Batch` of `[R, T]` arrays from `pack_documents` (R >= 1).
    batch_size: B.
    seed: int, the shuffle seed.
    shuffle: permute rows per epoch.
    num_epochs: stop after this many epochs, or None for an endless stream.
    start_step: first step to yield (or use `restore`).
    pad_id: input/target id of the all-padding rows past the last epoch.
    process_rows: a `slice` of the B batch rows: iteration then yields only these rows of each
      global batch (`[stop - start, T]`; a multi-host job's share, `model.partitioning.process_rows`);
      the global order, epochs and `state` are those of the whole batch. None: every row.

  Raises:
    ValueError: no rows, batch_size < 1, num_epochs < 1.
  """

  def __init__(self, rows: Batch, batch_size: int, seed: int, *, shuffle: bool = True,
               num_epochs: int | None = None, start_step: int = 0, pad_id: int = 0,
               process_rows: slice | None = None):
    self.rows = Batch(*(np.asarray(a) for a in rows))
    self.num_rows = int(self.rows.inputs.shape[0])
    if self.num_rows < 1:
      raise ValueError("BatchIterator needs at least one packed row (is the corpus empty?)")
    if int(batch_size) < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_epochs is not None and int(num_epochs) < 1:
      raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.num_epochs = None if num_epochs is None else int(num_epochs)
    self.step = int(start_step)
    self.process_rows = process_rows
    self._perm_cache: dict[int, np.ndarray] = {}
    pad_row = [np.zeros_like(a[:1]) for a in self.rows]
    pad_row[0] = np.full_like(pad_row[0], pad_id)  # inputs
    pad_row[1] = np.full_like(pad_row[1], pad_id)  # targets
    self._pad = Batch(*pad_row)

  @property
  def steps_per_epoch(self) -> float:
    """R / B (fractional when the batch does not divide the rows)."""
    return self.num_rows / self.batch_size

  @property
  def num_steps(self) -> int | None:
    """Total steps with `num_epochs`, else None."""
    if self.num_epochs is None:
      return None
    return math.ceil(self.num_epochs * self.num_rows / self.batch_size)

  def epoch_of(self, step: int) -> int:
    """Epoch of the first row of batch `step`."""
    return step * self.batch_size // self.num_rows

  @property
  def epoch(self) -> int:
    return self.epoch_of(self.step)

  def _perm(self, epoch: int) -> np.ndarray:
    if not self.shuffle:
      return np.arange(self.num_rows)
    if epoch not in self._perm_cache:
      if len(self._perm_cache) > 2:
        self._perm_cache.clear()
      rng = np.random.default_rng([self.seed, epoch])
      self._perm_cache[epoch] = rng.permutation(self.num_rows)
    return self._perm_cache[epoch]

  def row_indices(self, step: int) -> np.ndarray:
    """int64 `[B]`: the packed-row index of each batch row at `step` (-1 = padding past the end)."""
    slots = step * self.batch_size + np.arange(self.batch_size)
    out = np.empty(self.batch_size, np.int64)
    for j, i in enumerate(slots):
      e, k = divmod(int(i), self.num_rows)
      out[j] = -1 if self.num_epochs is not None and e >= self.num_epochs else self._perm(e)[k]
    return out

  def batch_at(self, step: int, rows: slice | None = None) -> Batch:
    """The batch of `step` (`[B, T]` arrays), independent of the iterator's position; with `rows`
    (a slice of the B batch rows) only those rows are gathered (`[len, T]`).

    Raises:
      ValueError: a negative step, or `rows` with a step or outside [0, B].
    """
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    idx = self.row_indices(step)
    if rows is not None:
      if rows.step not in (None, 1) or not 0 <= (rows.start or 0) <= (rows.stop or 0) <= self.batch_size:
        raise ValueError(f"rows must be a contiguous slice of the {self.batch_size} batch rows, got {rows}")
      idx = idx[rows]
    safe = np.where(idx < 0, 0, idx)
    fields = []
    for a, pad in zip(self.rows, self._pad):
      picked = a[safe]
      fields.append(np.where((idx < 0)[:, None], pad, picked).astype(a.dtype))
    return Batch(*fields)

  def __iter__(self) -> BatchIterator:
    return self

  def __next__(self) -> Batch:
    if self.num_steps is not None and self.step >= self.num_steps:
      raise StopIteration
    batch = self.batch_at(self.step, self.process_rows)
    self.step += 1
    return batch

  @property
  def state(self) -> dict:
    """JSON-serialisable position: {"seed", "step", "num_rows", "batch_size"}."""
    return {"seed": self.seed, "step": self.step, "num_rows": self.num_rows,
            "batch_size": self.batch_size}

  def restore(self, state: dict) -> None:
    """Continues from a saved `state` (the next batch is the one at `state["step"]`).

    Raises:
      ValueError: the saved seed, row count or batch size differs from this iterator's (the data
        or config changed, so the batches would not be the same).
    """
    for key in ("seed", "num_rows", "batch_size"):
      if key in state and int(state[key]) != getattr(self, key):
        raise ValueError(f"cannot restore iterator state: saved {key}={state[key]} but this "
                         f"iterator has {key}={getattr(self, key)}")
    self.step = int(state["step"])


# ----------------------------------------------------------------------------------------------
# One-call builders for the tools
# ----------------------------------------------------------------------------------------------


def load_token_documents(path: str | os.PathLike, fmt: str, tokenizer, *, split: str | None,
                         heldout_fraction: float = 0.1, add_bos: bool = True,
                         add_eos: bool = True) -> list[np.ndarray]:
  """`read_documents` + `tokenize_documents` (ids documents are range-checked against the
  tokenizer's vocab_size)."""
  docs = read_documents(path, fmt, split=split, heldout_fraction=heldout_fraction,
                        vocab_size=tokenizer.vocab_size)
  return tokenize_documents(docs, tokenizer, add_bos=add_bos, add_eos=add_eos)


def make_train_iterator(path: str | os.PathLike, fmt: str, tokenizer, *, seq_len: int,
                        batch_size: int, seed: int, heldout_fraction: float = 0.1,
                        max_segments: int | None = None, split_long: str = "long",
                        add_bos: bool = True, add_eos: bool = True,
                        num_epochs: int | None = None) -> BatchIterator:
  """Training batches from the *train* side of the held-out split of `path`.

  Documents are shuffled once with `seed` before packing (so rows mix distant documents), packed
  with `pack_documents(split=split_long, max_segments=...)`, and served by a `BatchIterator`
  seeded with `seed`. Padding uses the tokenizer's pad_id (0 when it has none).
  """
  docs = load_token_documents(path, fmt, tokenizer, split="train",
                              heldout_fraction=heldout_fraction, add_bos=add_bos, add_eos=add_eos)
  order = np.random.default_rng([seed, 2**31 - 1]).permutation(len(docs))
  pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
  rows = pack_documents([docs[i] for i in order], seq_len, max_segments=max_segments,
                        split=split_long, pad_id=pad)
  return BatchIterator(rows, batch_size, seed, num_epochs=num_epochs, pad_id=pad)


def make_eval_windows(path: str | os.PathLike, fmt: str, tokenizer, *, seq_len: int,
                      batch_size: int, split: str | None = "heldout", heldout_fraction: float = 0.1,
                      max_segments: int | None = None, add_bos: bool = True,
                      add_eos: bool = True) -> list[EvalWindow]:
  """Evaluation windows (`pack_eval_windows`) over the held-out side of `path` (by default)."""
  docs = load_token_documents(path, fmt, tokenizer, split=split, heldout_fraction=heldout_fraction,
                              add_bos=add_bos, add_eos=add_eos)
  pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
  return pack_eval_windows(docs, seq_len, batch_size, max_segments=max_segments, pad_id=pad)
