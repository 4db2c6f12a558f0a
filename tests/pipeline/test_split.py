"""The held-out split rule: last `fraction` of the bytes, cut at a line boundary, disjoint."""

import hashlib
import math
import pathlib

import pytest
from hypothesis import given, strategies as st

from model.data.pipeline import heldout_start_byte, split_heldout

# ../shared/data beside the project root (every developer machine and CI; not in a user's clone).
SHAKESPEARE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
needs_shakespeare = pytest.mark.skipif(not SHAKESPEARE.is_file(),
                                       reason=f"{SHAKESPEARE} not present (outside the project)")


def _check_rule(data: bytes, fraction: float, train: bytes, heldout: bytes) -> None:
  n = len(data)
  need = math.ceil(fraction * n)
  assert train + heldout == data  # disjoint and complete
  assert len(heldout) >= need  # every byte of the last `fraction` is held out
  cut = len(train)
  assert cut == 0 or data[cut - 1:cut] == b"\n"  # starts at a line start
  # Minimal: the held-out side holds no whole line that lies before the last `need` bytes, i.e.
  # the line containing byte n - need starts at `cut`.
  assert b"\n" not in data[cut:n - need]


@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
                min_size=1, max_size=30),
       st.sampled_from([0.05, 0.1, 0.25, 0.5, 0.9]))
def test_rule_on_random_texts(lines, fraction):
  text = "\n".join(lines)
  train, heldout = split_heldout(text, fraction)
  data = text.encode("utf-8")
  _check_rule(data, fraction, train.encode("utf-8"), heldout.encode("utf-8"))
  # bytes and str agree
  assert split_heldout(data, fraction) == (train.encode("utf-8"), heldout.encode("utf-8"))


def test_hand_examples():
  # 10 lines of 10 bytes: the last 10 % is exactly the last line.
  text = "".join(f"line {i:03d}\n" for i in range(10))
  train, heldout = split_heldout(text, 0.1)
  assert heldout == "line 009\n" and train == text[:-9]
  # target byte inside a line -> the whole line is held out
  assert split_heldout("aaaa\nbbbb\ncc", 0.1) == ("aaaa\nbbbb\n", "cc")
  assert split_heldout("aaaa\nbbbb\ncc", 0.3) == ("aaaa\n", "bbbb\ncc")
  assert split_heldout("one line only", 0.1) == ("", "one line only")
  assert heldout_start_byte(b"", 0.1) == 0
  # Measured in UTF-8 bytes (10 here), not characters (8): counting characters would hold out
  # both lines.
  assert split_heldout("aaaa\néé\n", 0.5) == ("aaaa\n", "éé\n")
  assert split_heldout("aaaa\néé\n".encode(), 0.5) == (b"aaaa\n", "éé\n".encode())


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_bad_fraction(fraction):
  with pytest.raises(ValueError, match="fraction"):
    split_heldout("a\nb\n", fraction)


@needs_shakespeare
def test_tinyshakespeare_golden():
  data = SHAKESPEARE.read_bytes()
  assert hashlib.sha256(data).hexdigest() == (
      "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed")
  train, heldout = split_heldout(data.decode("utf-8"), 0.1)
  _check_rule(data, 0.1, train.encode(), heldout.encode())
  # Golden numbers every tool relies on (the demo tokenizer, train and perplexity).
  assert len(train.encode()) == 1_003_836 and len(heldout.encode()) == 111_558
  assert heldout_start_byte(data, 0.1) == 1_003_836
