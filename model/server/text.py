"""Generated ids to text, incrementally, with OpenAI `stop` strings matched on the decoded text.

`TextStream.add(token_id)` returns the text that may be sent now. Each step decodes a bounded window
of ids (the detokenizer runs on the event loop once per token: a whole-output decode would cost
O(length) per token), starting at `prefix`, and cuts off the text of the already emitted
`ids[prefix:read]`, so a new piece keeps its leading space and byte-fallback pieces that spell one
character decode together (vLLM's and transformers' prefix/read offsets; the first window starts with
the last `CONTEXT` prompt tokens). Text is held back while it ends in U+FFFD (an incomplete character)
or in a prefix of a stop string, so streamed deltas concatenate to exactly the final text; a stop
string ends the text before it, and stop token ids are never shown.

`spans`: per id, the start and end in `decoded` of the text its decode added (they tile the text;
ids that decode only together get empty spans up to the one completing the character).
"""

from __future__ import annotations

CONTEXT = 8   # prompt tokens decoded with the continuation (for its first piece's leading space)


class TextStream:
  """Incremental text of one request.

  Args:
    tokenizer: has `decode(ids) -> str`.
    prompt_ids: the prompt (its last CONTEXT ids start the first decode window).
    stop: stop strings (non-empty).
    hidden_ids: ids never shown as text (the stop token ids).
  """

  def __init__(self, tokenizer, prompt_ids, stop: tuple[str, ...] = (), hidden_ids=frozenset()):
    self._tok = tokenizer
    self._hidden = frozenset(int(t) for t in hidden_ids)
    self._ids = [int(t) for t in list(prompt_ids)[-CONTEXT:] if int(t) not in self._hidden]
    self._prefix, self._read = 0, len(self._ids)    # window start; end of the ids already decoded
    self._read_text = tokenizer.decode(self._ids) if self._ids else ""   # text of ids[prefix:read]
    self._stop = tuple(stop)
    self._longest_stop = max(map(len, self._stop), default=0)
    self._decoded = ""      # the output's text up to `read` (complete characters only)
    self.text = ""          # the final text so far (stop string cut off once found)
    self.sent = 0           # characters of `text` already handed out
    self.stopped = False    # a stop string was found
    self.spans: list[list[int]] = []   # per added id: [start, end) of its text in `decoded`
    self._last_shown: int | None = None   # index in `spans` of the last id that is not a stop token id

  @property
  def decoded(self) -> str:
    """The whole decoded output so far (complete characters), stop string and beyond included."""
    return self._decoded

  def _advance(self, final: bool = False) -> None:
    """Decodes the window; appends its new complete text to `_decoded` and moves the window on."""
    if self._read == len(self._ids):
      return
    window = self._tok.decode(self._ids[self._prefix:])
    if window.endswith("\ufffd") and not final:
      return                    # a multi-byte character is still incomplete: decode it with its rest
    if window.startswith(self._read_text):
      new = window[len(self._read_text):]
    else:                       # the emitted part decodes differently joined: the new ids alone
      new = self._tok.decode(self._ids[self._read:])
    self._decoded += new
    self._prefix, self._read = self._read, len(self._ids)
    self._read_text = self._tok.decode(self._ids[self._prefix:])   # alone, as the next window starts

  def _update(self) -> int:
    """Finds a stop string in the decoded text; returns how far `text` may be sent now."""
    text = self._decoded
    if self._stop:
      start = max(0, len(self.text) - self._longest_stop)
      hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
      if hits:
        self.text, self.stopped = text[:min(hits)], True
        return len(self.text)
    self.text = text
    return len(text) - self._held(text)

  def add(self, token_id: int) -> str:
    """Adds one generated id; returns the new text that may be sent ("" while held back or stopped)."""
    at = len(self._decoded)
    if self.stopped or int(token_id) in self._hidden:
      self.spans.append([at, at])
      return ""
    self._ids.append(int(token_id))
    self._advance()
    self._last_shown = len(self.spans)
    self.spans.append([at, len(self._decoded)])
    return self._release(self._update())

  def finish(self) -> str:
    """The text still held back (the request ended): everything not sent yet.

    An incomplete character left at the end (the output stopped inside a byte sequence) is released
    as the tokenizer decodes it (U+FFFD), as a whole-output decode shows it.
    """
    if not self.stopped:
      at = len(self._decoded)
      self._advance(final=True)
      end = len(self._decoded)
      if end > at and self._last_shown is not None:   # an incomplete character: the last shown id's text
        self.spans[self._last_shown][1] = end
        for span in self.spans[self._last_shown + 1:]:   # stop token ids after it: empty, at the end
          span[0] = span[1] = end
      self._update()
    return self._release(len(self.text))

  def _held(self, text: str) -> int:
    held = 0
    for s in self._stop:
      for k in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:k]):
          held = max(held, k)
          break
    return held

  def _release(self, upto: int) -> str:
    upto = max(upto, self.sent)
    out = self.text[self.sent:upto]
    self.sent = upto
    return out
