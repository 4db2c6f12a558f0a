"""The error of the tokenizer modules (model.data.tokenizer re-exports it, for its existing importers)."""

from __future__ import annotations

from model.errors import UserError


class TokenizerError(UserError):
  """A tokenizer file that is missing or unreadable, or text/ids that the tokenizer cannot handle."""
