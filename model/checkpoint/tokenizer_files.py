"""Which files make up the tokenizer a checkpoint carries (no tokenizer library imported here).

Two kinds of tokenizer travel with a checkpoint (model/checkpoint/format.py):

  * a sentencepiece model: one file, stored as `DIR/tokenizer.model`;
  * a Kimi (tiktoken) tokenizer: a directory, as a Hugging Face Kimi checkpoint holds it, stored as
    `DIR/tokenizer/` with the files `tokenizer_dir_files` names, each copied byte for byte:
    tiktoken.model and tokenizer_config.json (required; the chat template is in the latter),
    generation_config.json (the EOS ids that end generation), special_tokens_map.json,
    chat_template.jinja and any tokenization_*.py (transformers' remote code), when present.
    Converting back to Hugging Face writes the same files, byte for byte.

`model.data.tokenizer_kimi.KimiTokenizer` reads such a directory; this module only lists files, so
that the checkpoint format needs neither tiktoken nor jinja2 (the compile-only venvs lack them).
"""

from __future__ import annotations

import os
import pathlib

TOKENIZER_FILE = "tokenizer.model"   # a sentencepiece tokenizer in a checkpoint
TOKENIZER_DIR = "tokenizer"          # a Kimi tokenizer in a checkpoint
TIKTOKEN_FILE = "tiktoken.model"
REQUIRED_FILES = (TIKTOKEN_FILE, "tokenizer_config.json")
OPTIONAL_FILES = ("generation_config.json", "special_tokens_map.json", "chat_template.jinja")
REMOTE_CODE_GLOB = "tokenization_*.py"


def is_tokenizer_dir(path: str | os.PathLike) -> bool:
  """Whether `path` is a directory holding a Kimi tokenizer (a `tiktoken.model`)."""
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, TIKTOKEN_FILE))


def tokenizer_dir_files(path: str | os.PathLike) -> list[str]:
  """The names of the tokenizer files in directory `path` that a checkpoint carries (module docstring),
  in a fixed order: the required ones, the optional ones present, then tokenization_*.py sorted.

  Raises:
    FileNotFoundError: `path` lacks tiktoken.model or tokenizer_config.json (the message names both).
  """
  p = pathlib.Path(path)
  missing = [n for n in REQUIRED_FILES if not (p / n).is_file()]
  if missing:
    raise FileNotFoundError(f"the tokenizer directory {os.fspath(path)!r} has no {' or '.join(missing)} (a Kimi "
                            f"tokenizer needs {' and '.join(REQUIRED_FILES)})")
  names = list(REQUIRED_FILES) + [n for n in OPTIONAL_FILES if (p / n).is_file()]
  names += sorted(f.name for f in p.glob(REMOTE_CODE_GLOB) if f.is_file())
  return names
