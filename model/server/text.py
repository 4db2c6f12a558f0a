"""Generated ids to text, incrementally, with OpenAI `stop` strings matched on the decoded text.

`TextStream.add(token_id)` returns the text that may be sent now. The continuation is decoded
together with the last prompt tokens (`CONTEXT` of them) and the decoded context is cut off, so a
piece that starts a word keeps its leading space (sentencepiece drops a leading "▁" of the first
piece of a decode). Text is held back while it (a) ends in U+FFFD, an incomplete multi-byte character
of byte-fallback pieces, or (b) ends in a prefix of a stop string (it may yet become one), so that
streamed deltas concatenate to exactly the final text. A stop string ends the text before it (the
stop string is not part of the output, as in the OpenAI API); stop token ids (EOS) are never shown.
"""

from __future__ import annotations

CONTEXT = 8   # prompt tokens decoded with the continuation (for its first piece's leading space)


class TextStream:
  """Incremental text of one request.

  Args:
    tokenizer: has `decode(ids) -> str`.
    prompt_ids: the prompt (its last CONTEXT ids are decoded with the output).
    stop: stop strings (non-empty).
    hidden_ids: ids never shown as text (the stop token ids).
  """

  def __init__(self, tokenizer, prompt_ids, stop: tuple[str, ...] = (), hidden_ids=frozenset()):
    self._tok = tokenizer
    self._context = [int(t) for t in list(prompt_ids)[-CONTEXT:] if int(t) not in hidden_ids]
    self._prefix = tokenizer.decode(self._context) if self._context else ""
    self._ids: list[int] = []
    self._hidden = frozenset(hidden_ids)
    self._stop = tuple(stop)
    self.text = ""          # the final text so far (stop string cut off once found)
    self.sent = 0           # characters of `text` already handed out
    self.stopped = False    # a stop string was found

  def _decode(self) -> str:
    full = self._tok.decode(self._context + self._ids) if self._ids else self._prefix
    if full.startswith(self._prefix):
      return full[len(self._prefix):]
    return self._tok.decode(self._ids)  # the context decoded differently joined: no leading-space fix

  def add(self, token_id: int) -> str:
    """Adds one generated id; returns the new text that may be sent ("" while held back or stopped)."""
    if self.stopped:
      return ""
    if int(token_id) not in self._hidden:
      self._ids.append(int(token_id))
    text = self._decode()
    if self._stop:
      start = max(0, len(self.text) - max(map(len, self._stop)))
      hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
      if hits:
        self.text, self.stopped = text[:min(hits)], True
        return self._release(len(self.text))
    self.text = text
    return self._release(len(text) - self._held(text))

  def finish(self) -> str:
    """The text still held back (the request ended): everything not sent yet."""
    return self._release(len(self.text))

  def _held(self, text: str) -> int:
    held = len(text) - len(text.rstrip("\ufffd"))
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
