"""Document readers on good and malformed files (tmp files)."""

import numpy as np
import pytest

from model.data.pipeline import (DataFormatError, read_documents, read_text_file, split_heldout,
                                  tokenize_documents)
from model.data.tokenizer import IdsOnlyTokenizer


def _write(tmp_path, name, content):
  p = tmp_path / name
  p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
  return p


def test_text_blocks(tmp_path):
  p = _write(tmp_path, "a.txt", "\n\nFirst:\nHello there.\n \t\nSecond:\r\nline two\r\n\n\n\nlast")
  assert read_documents(p, "text") == ["First:\nHello there.", "Second:\nline two", "last"]


def test_text_bom_and_empty(tmp_path):
  assert read_documents(_write(tmp_path, "b.txt", b"\xef\xbb\xbfdoc\n"), "text") == ["doc"]
  assert read_documents(_write(tmp_path, "e.txt", ""), "text") == []


def test_jsonl_good(tmp_path):
  p = _write(tmp_path, "a.jsonl", '{"text": "one", "id": 3}\n\n"two"\n{"text": "th\\nree"}\n')
  assert read_documents(p, "jsonl") == ["one", "two", "th\nree"]


@pytest.mark.parametrize("line,needle", [
    ('{"text": "x"', "invalid JSON"),
    ('{"body": "x"}', 'no "text" field'),
    ('{"text": 5}', '"text" must be a string'),
    ("[1, 2]", "got list"),
    ("17", "got int"),
])
def test_jsonl_bad(tmp_path, line, needle):
  p = _write(tmp_path, "bad.jsonl", '{"text": "ok"}\n\n' + line + "\n")
  with pytest.raises(DataFormatError, match=needle) as e:
    read_documents(p, "jsonl")
  assert f"{p}:3:" in str(e.value)  # file and 1-based line (the blank line counts)


def test_ids_good(tmp_path):
  p = _write(tmp_path, "a.ids", "1 2 3\n\n4,5, 6\n  7\t8  \n")
  docs = read_documents(p, "ids")
  assert [d.tolist() for d in docs] == [[1, 2, 3], [4, 5, 6], [7, 8]]
  assert all(d.dtype == np.int32 for d in docs)


@pytest.mark.parametrize("line,needle", [
    ("1 x 3", "field 2 is not an integer"),
    ("1 -2", "outside"),
    ("1 2.5", "not an integer"),
    ("3 10", "outside \\[0, 10\\)"),
])
def test_ids_bad(tmp_path, line, needle):
  p = _write(tmp_path, "bad.ids", "1 2\n" + line + "\n")
  with pytest.raises(DataFormatError, match=needle) as e:
    read_documents(p, "ids", vocab_size=10)
  assert f"{p}:2:" in str(e.value)


@pytest.mark.parametrize("fmt", ["text", "jsonl", "ids"])
def test_non_utf8_names_file_and_line(tmp_path, fmt):
  p = _write(tmp_path, "latin1.txt", b"fine\nstill fine\ncaf\xe9\n")
  with pytest.raises(DataFormatError, match="not valid UTF-8") as e:
    read_documents(p, fmt)
  assert f"{p}:3:" in str(e.value) and "0xe9" in str(e.value)


def test_missing_file_and_bad_format(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.txt"):
    read_text_file(tmp_path / "nope.txt")
  p = _write(tmp_path, "a.txt", "x\n")
  with pytest.raises(ValueError, match="format must be one of"):
    read_documents(p, "csv")
  with pytest.raises(ValueError, match="split must be"):
    read_documents(p, "text", split="validation")


def test_split_sides_partition_the_file(tmp_path):
  lines = [f"{{\"text\": \"doc {i}\"}}" for i in range(40)]
  content = "\n".join(lines) + "\n"
  p = _write(tmp_path, "a.jsonl", content)
  train = read_documents(p, "jsonl", split="train")
  held = read_documents(p, "jsonl", split="heldout")
  assert train + held == [f"doc {i}" for i in range(40)]
  tr_text, ho_text = split_heldout(content, 0.1)
  assert len(held) == ho_text.count("\n") and len(held) >= 4


def test_heldout_errors_report_file_lines(tmp_path):
  content = "".join(f"{i} {i + 1}\n" for i in range(30)) + "5 oops\n"
  p = _write(tmp_path, "a.ids", content)
  assert len(read_documents(p, "ids", split="train")) < 30
  with pytest.raises(DataFormatError) as e:
    read_documents(p, "ids", split="heldout")
  assert f"{p}:31:" in str(e.value)


def test_tokenize_documents_frames_ids():
  tok = IdsOnlyTokenizer(100, bos_id=1, eos_id=2)
  out = tokenize_documents(["5 6", "7"], tok)
  assert [o.tolist() for o in out] == [[1, 5, 6, 2], [1, 7, 2]]
  out = tokenize_documents([np.array([9, 9])], tok, add_bos=False)
  assert [o.tolist() for o in out] == [[9, 9, 2]]
  with pytest.raises(ValueError, match="no bos_id"):
    tokenize_documents(["1"], IdsOnlyTokenizer(10), add_eos=False)
