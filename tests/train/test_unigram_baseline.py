"""tools.unigram_baseline against a direct count (collections.Counter, float64) on a small corpus."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from model.data.pipeline import split_heldout
from model.data.tokenizer import SentencePieceTokenizer
from tools.train_tokenizer import train_tokenizer
from tools.unigram_baseline import main, unigram_baseline


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  # One-line documents separated by blank lines; words with a skewed (Zipf-like) frequency.
  rng = np.random.default_rng(0)
  words = ["the", "king", "shall", "speak", "to", "thee", "my", "lord", "and", "queen", "of", "night"]
  p = 1.0 / np.arange(1, len(words) + 1)
  p /= p.sum()
  docs = [" ".join(rng.choice(words, size=int(rng.integers(3, 12)), p=p)) for _ in range(400)]
  d = tmp_path_factory.mktemp("uni")
  path = d / "corpus.txt"
  path.write_text("\n\n".join(docs) + "\n")
  tok = train_tokenizer(str(path), str(d / "sp"), 300, num_threads=1)["model_path"]
  return path, tok


def test_matches_a_direct_count(corpus):
  path, tok_path = corpus
  tok = SentencePieceTokenizer(tok_path)
  train_text, held_text = split_heldout(path.read_text(), 0.1)
  train_docs = [d for d in train_text.split("\n\n") if d.strip()]
  held_docs = [d.strip("\n") for d in held_text.split("\n\n") if d.strip()]
  # Targets: every token of [bos] + ids + [eos] except the bos.
  counts = collections.Counter()
  for d in train_docs:
    counts.update(tok.encode(d.strip("\n")) + [tok.eos_id])
  n_train = sum(counts.values())
  v = tok.vocab_size
  nll, n = 0.0, 0
  for d in held_docs:
    for t in tok.encode(d) + [tok.eos_id]:
      nll -= math.log((counts[t] + 1) / (n_train + v))
      n += 1
  n_bytes = sum(len(d.encode("utf-8")) for d in held_docs)

  got = unigram_baseline(str(path), tok_path)
  assert got["train_tokens"] == n_train and got["heldout_tokens"] == n and got["heldout_bytes"] == n_bytes
  assert got["nll_per_token"] == pytest.approx(nll / n, rel=1e-12)
  assert got["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-12)
  assert got["bits_per_byte"] == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-12)
  # Sanity of the oracle: a skewed unigram beats the uniform distribution over the vocabulary.
  assert got["perplexity"] < v


def test_command_line(corpus, capsys, tmp_path):
  path, tok_path = corpus
  assert main([f"data={path}", f"tokenizer_path={tok_path}"]) == 0
  assert '"perplexity"' in capsys.readouterr().out
  assert main([f"data={tmp_path / 'missing.txt'}", f"tokenizer_path={tok_path}"]) == 2
  assert "input file not found" in capsys.readouterr().err
  assert main([f"data={path}"]) == 2
  assert "missing required argument(s): tokenizer_path" in capsys.readouterr().err
