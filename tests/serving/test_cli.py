"""tools.generate and tools.perplexity end to end (in-process), and their one-line errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from model.data.tokenizer import SentencePieceTokenizer
from tools import generate, perplexity
from tools.demo import ASSETS
from tools.cli import run_tool

DEMO_TOKENIZER = ASSETS / "tokenizer.model"  # 1024 pieces, pad 0, bos 2, eos 3


def _gen(argv):
  return run_tool(generate.main, generate.__doc__, [str(a) for a in argv])


def _ppl(argv):
  return run_tool(perplexity.main, perplexity.__doc__, [str(a) for a in argv])


# The fixture tokenizer's specials (pad 0, bos 2, eos 3) as config overrides: the dense checkpoint says
# bos 1, eos 2, and a tokenizer that disagrees with the config is refused.
FITS = ["bos_token_id=2", "eos_token_id=3"]


def _ids(a):
  return ",".join(str(int(t)) for t in a)


def test_generate_ids_prompt(checkpoints, reference, tmp_path, capsys):
  ref = reference("dense")
  out = tmp_path / "gen.json"
  status = _gen([f"load_parameters_path={checkpoints['dense']}", "attention=kda_reference",
                 f"prompt_ids={_ids(ref['prompt_ids'][0])}", "max_new_tokens=12", "decode_stop_at_eos=false",
                 f"output_json={out}"])
  text = capsys.readouterr().out
  assert status == 0
  data = json.loads(out.read_text())
  (r,) = data["results"]
  assert r["generated_ids"] == ref["greedy_ids"][0].tolist() and r["prompt_ids"] == ref["prompt_ids"][0].tolist()
  assert r["text"] is None and r["finish_reason"] == "length"
  # The single prompt streamed as ids: prompt then continuation on one line.
  assert " ".join(map(str, ref["prompt_ids"][0].tolist() + ref["greedy_ids"][0].tolist())) in text
  for what in ("time to first token", "tokens/s", "prefill 12 tokens", "decode 11 generated tokens in 11 steps"):
    assert what in text
  t = data["timings"]
  assert t["prefill_tokens"] == 12 and t["decode_tokens"] == 11 and t["time_to_first_token_s"] > 0
  assert list(tmp_path.iterdir()) == [out]    # no temporary left behind


def test_greedy_accepts_temperature_zero(checkpoints, reference, tmp_path, capsys):
  """--help says greedy ignores the temperature, so 0 (a common way to ask for greedy) is accepted and the
  continuation is the greedy golden."""
  ref = reference("dense")
  out = tmp_path / "gen.json"
  status = _gen([f"load_parameters_path={checkpoints['dense']}", "attention=kda_reference",
                 f"prompt_ids={_ids(ref['prompt_ids'][0])}", "max_new_tokens=12", "decode_stop_at_eos=false",
                 "decode_sampling_strategy=greedy", "decode_sampling_temperature=0", f"output_json={out}"])
  err = capsys.readouterr().err
  assert status == 0, err
  (r,) = json.loads(out.read_text())["results"]
  assert r["generated_ids"] == ref["greedy_ids"][0].tolist()


def test_generate_text_prompts(checkpoints, tokenizer_file, tmp_path, capsys):
  tok = SentencePieceTokenizer(tokenizer_file)
  base = [f"load_parameters_path={checkpoints['dense']}", "attention=kda_reference", f"tokenizer_path={tokenizer_file}",
          "max_new_tokens=12", "decode_stop_at_eos=false", *FITS]
  out = tmp_path / "one.json"
  assert _gen(base + ["prompt=the cat sat on", f"output_json={out}"]) == 0
  text = capsys.readouterr().out
  (r,) = json.loads(out.read_text())["results"]
  assert r["prompt_ids"] == [tok.bos_id] + tok.encode("the cat sat on")
  assert r["text"] == tok.decode([t for t in r["generated_ids"] if t != tok.eos_id])
  assert text.startswith(tok.decode(r["prompt_ids"] + r["generated_ids"]))  # streamed: prompt + continuation
  # Three prompts from a file (blank lines skipped) generate as one packed batch, in order.
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("the cat sat on\n\na dog ran\nthe bird\n")
  out3 = tmp_path / "three.json"
  assert _gen(base + [f"prompts_file={prompts}", f"output_json={out3}"]) == 0
  res = json.loads(out3.read_text())["results"]
  assert [x["prompt"] for x in res] == ["the cat sat on", "a dog ran", "the bird"]
  assert res[0]["generated_ids"] == r["generated_ids"]


# slow (about 55 s of CPU: two models scored): make test keeps the perplexity CLI through the other tests.
@pytest.mark.slow
def test_perplexity_ids_and_compare(checkpoints, reference, tmp_path, capsys):
  ref = reference("dense")
  data = tmp_path / "ids.txt"
  data.write_text("\n".join(_ids(row) for row in ref["input_ids"]) + "\n")
  out = tmp_path / "ppl.json"
  status = _ppl([f"load_parameters_path={checkpoints['dense']}", f"eval_data={data}", "eval_format=ids",
                 "max_target_length=16", "eval_batch_size=1", "compare_attention=kda_reference",
                 "compare_tolerance=0", "dump_logprobs=true", f"output_json={out}"])
  text = capsys.readouterr().out
  res = json.loads(out.read_text())
  want = ref["next_token_logprobs"].astype(np.float64)
  assert res["attention"] == "kda_native" and res["num_tokens"] == want.size and "bits_per_byte" not in res
  assert res["perplexity"] == pytest.approx(math.exp(-want.mean()), rel=1e-4)
  for doc, row, lp in zip(res["documents"], ref["input_ids"], want):
    assert doc["token_ids"] == row.tolist()
    np.testing.assert_allclose(doc["logprobs"], lp, atol=1e-4, rtol=0)
  cmp = res["compare"]
  assert cmp["attention"] == "kda_reference" and 0 <= cmp["max_abs_logprob_diff"] < 1e-5
  # compare_tolerance=0: any difference at all fails the comparison (exit status 1).
  assert status == (1 if cmp["max_abs_logprob_diff"] > 0 else 0) and cmp["within_tolerance"] == (status == 0)
  assert "perplexity" in text and "tokens/s" in text and "max |log-prob diff|" in text


def test_perplexity_text_bits_per_byte(checkpoints, tokenizer_file, tmp_path, capsys):
  tok = SentencePieceTokenizer(tokenizer_file)
  docs = ["the cat sat on a mat\nand the dog ran", "a bird in the tree", "the garden house"]
  data = tmp_path / "corpus.txt"
  data.write_text("\n\n".join(docs) + "\n")
  out = tmp_path / "ppl.json"
  assert _ppl([f"load_parameters_path={checkpoints['dense']}", "attention=kda_reference", f"eval_data={data}",
               f"tokenizer_path={tokenizer_file}", "max_target_length=16", "eval_batch_size=1",
               "dump_logprobs=true", f"output_json={out}", *FITS]) == 0
  res = json.loads(out.read_text())
  framed = [[tok.bos_id] + tok.encode(d) + [tok.eos_id] for d in docs]
  assert [d["token_ids"] for d in res["documents"]] == framed
  nll = -sum(sum(d["logprobs"]) for d in res["documents"])
  assert res["num_bytes"] == sum(len(d.encode()) for d in docs)
  assert res["bits_per_byte"] == pytest.approx(nll / math.log(2) / res["num_bytes"], rel=1e-9)
  assert res["num_tokens"] == sum(len(f) - 1 for f in framed)


@pytest.fixture()
def bad_files(tmp_path):
  latin1 = tmp_path / "latin1.txt"
  latin1.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
  return {"latin1": latin1, "blank": _write(tmp_path / "blank.txt", "\n  \n")}


def _write(path, text):
  path.write_text(text)
  return path


def test_clear_errors(checkpoints, tokenizer_file, bad_files, tmp_path, capsys):
  ck = f"load_parameters_path={checkpoints['dense']}"
  out = tmp_path / "never.json"
  cases = [
      (_gen, ["load_parameters_path=/nonexistent/ckpt", "prompt_ids=3"], "checkpoint '/nonexistent/ckpt' does not exist"),
      (_gen, [ck, "tokenizer_path=/nonexistent/tok.model", "prompt=hi"], "tokenizer file not found"),
      (_gen, [ck, f"tokenizer_path={tokenizer_file}", "prompt=", *FITS], "prompt is empty"),
      (_gen, [ck, f"tokenizer_path={tokenizer_file}", "prompt=   ", *FITS], "prompt is whitespace only"),
      (_gen, [ck, "prompt_ids="], "prompt_ids is empty"),
      (_gen, [ck, f"prompts_file={bad_files['blank']}"], "holds no prompt"),
      (_gen, [ck, "prompt_ids=" + ",".join(["3"] * 300)], "longer than the model's limit max_cache_length=256"),
      (_gen, [ck, "prompt_ids=3,4", "max_new_tokens=255"], "raise max_cache_length"),
      (_gen, [ck, f"prompts_file={bad_files['latin1']}"], "prompts_file: .*latin1.txt:1: not valid UTF-8"),
      (_gen, [ck, "prompt_ids=3,512"], r"prompt_ids:1: token id 512 \(field 2\) is outside \[0, 512\)"),
      (_gen, [ck, "prompt_ids=3", "decode_sampling_strategy=beam"], "unknown sampling strategy 'beam'"),
      (_gen, [ck, "prompt_ids=3", "decode_sampling_strategy=topk", "decode_sampling_top_k=0"],
       r"^error: decode_sampling_top_k must be an integer >= 1, got 0$"),
      (_gen, [ck, "prompt_ids=3", "decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=1.5"],
       r"^error: decode_sampling_nucleus_p must be in \(0, 1\], got 1.5$"),
      (_gen, [ck, "prompt_ids=3", "decode_sampling_strategy=weighted", "decode_sampling_temperature=0"],
       r"^error: decode_sampling_temperature must be a finite number > 0 for 'weighted', got 0 \(0 only fits "
       r"greedy: pass decode_sampling_strategy=greedy\)$"),
      (_gen, [ck, "prompt_ids=3", "generate_batch_size=0"], r"^error: generate_batch_size must be an integer >= 1, got 0$"),
      (_gen, [ck, "prompt_ids=3", "prefill_length_multiple=0"],
       r"^error: prefill_length_multiple must be an integer >= 1, got 0$"),
      (_gen, [ck, "prompt=hello"], "needs a tokenizer"),
      (_gen, [ck], "give exactly one of prompt=, prompts_file= or prompt_ids="),
      (_gen, ["prompt_ids=3"], "load_parameters_path is required"),
      (_gen, ["tiny", ck], "the model config comes from the checkpoint"),
      (_gen, [ck, "promt=3"], "unknown config key 'promt'; did you mean prompt"),
      (_gen, [ck, "max_new_tokens=many"], "max_new_tokens expects int"),
      (_gen, [ck, "prompt_ids=3", "ici_data_parallelism=3"], "multiply to 3 but there are 1 devices"),
      (_ppl, [ck, f"eval_data={bad_files['latin1']}", f"tokenizer_path={tokenizer_file}", *FITS],
       "eval_data: .*latin1.txt:1: not valid UTF-8"),
      (_ppl, [ck, "eval_data=/nonexistent.txt", "eval_format=ids"], "eval_data='/nonexistent.txt' does not exist"),
      (_ppl, [ck], "eval_data is required"),
      (_ppl, [ck, f"eval_data={bad_files['blank']}", "eval_format=ids"], "holds no document"),
      (_ppl, [ck, f"eval_data={bad_files['blank']}"], "eval_format=text needs a tokenizer"),
      (_ppl, [ck, f"eval_data={bad_files['blank']}", "eval_format=csv"], "eval_format must be one of"),
      (_ppl, [ck, f"eval_data={_write(tmp_path / 'ids.txt', '3 4 900')}", "eval_format=ids"],
       r"token id 900 \(field 3\) is outside \[0, 512\)"),
      (_ppl, [ck, f"eval_data={_write(tmp_path / 'ok.txt', '3 4 5')}", "eval_format=ids",
              "compare_attention=nope"], r"compare_attention=nope"),
  ]
  for tool, argv, msg in cases:
    status = tool(argv + [f"output_json={out}"])
    err = capsys.readouterr().err
    assert status == 2, (argv, err)
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, (argv, err)
    assert __import__("re").search(msg, lines[0]), (argv, lines[0])
    assert not out.exists()


def test_errors_before_model_load(checkpoints, tokenizer_file, tmp_path, capsys, monkeypatch):
  """Bad settings that the checkpoint's config.json can judge fail before any parameter is loaded."""
  from tools import cli as serving_common

  def no_load(*a, **k):
    raise AssertionError("the model was loaded before the bad input was rejected")
  monkeypatch.setattr(serving_common, "load", no_load)
  ck = f"load_parameters_path={checkpoints['dense']}"
  out = tmp_path / "never.json"
  cases = [
      (_gen, [ck, "prompt_ids=3", "decode_sampling_strategy=topk", "decode_sampling_top_k=100000"],
       "decode_sampling_top_k=100000 exceeds the model's vocabulary size 512"),
      (_ppl, [ck, "eval_data=" + str(_write(tmp_path / "one.txt", "7\n\n")), "eval_format=ids"],
       "nothing to score"),
      (_ppl, [ck, f"eval_data={_write(tmp_path / 'ok.txt', '3 4 5')}", "eval_format=ids", "max_target_length=1"],
       "max_target_length must be >= 2"),
      (_ppl, [ck, f"eval_data={tmp_path / 'ok.txt'}", "eval_format=ids", "eval_batch_size=0"],
       "eval_batch_size must be >= 1"),
      # A tokenizer that does not fit the checkpoint's config (tools.train refuses the same).
      (_gen, [ck, f"tokenizer_path={tokenizer_file}", "prompt=hi"],
       r"the tokenizer tokenizer_path=.*tok.model' does not fit the model config: its bos id is 2 but bos_token_id=1; "
       r"its eos id is 3 but eos_token_id=2; pass bos_token_id=2 eos_token_id=3$"),
      (_ppl, [ck, f"tokenizer_path={tokenizer_file}", f"eval_data={tmp_path / 'ok.txt'}", "bos_token_id=2"],
       r"does not fit the model config: its eos id is 3 but eos_token_id=2; pass eos_token_id=3$"),
      (_gen, [ck, f"tokenizer_path={DEMO_TOKENIZER}", "prompt=hi", "bos_token_id=2", "eos_token_id=3"],
       r"it has 1024 tokens but vocab_size=512; pass vocab_size=1024"),
      (_gen, [ck, f"tokenizer_path={tmp_path / 'ok.txt'}", "prompt=hi"], r"ok.txt"),
  ]
  for tool, argv, msg in cases:
    status = tool(argv + [f"output_json={out}"])
    err = capsys.readouterr().err
    assert status == 2, (argv, err)
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "windows of" not in err, (argv, err)
    assert __import__("re").search(msg, lines[0]), (argv, lines[0])
    assert not out.exists()
  # Output paths that cannot be written are refused before any work, naming output_json.
  for tool, argv in ((_gen, [ck, "prompt_ids=3"]), (_ppl, [ck, f"eval_data={tmp_path / 'ok.txt'}", "eval_format=ids"])):
    # /sys refuses new files to every user, root included: a directory that exists but cannot be written.
    for target, msg in ((tmp_path / "nodir" / "x.json", "directory .*nodir' does not exist"),
                        (tmp_path, "is a directory; expected a file path"),
                        (tmp_path / "ok.txt" / "x.json", "directory .*ok.txt' is a file, not a directory"),
                        ("/sys/x.json", "cannot write in directory '/sys'")):
      assert tool(argv + [f"output_json={target}"]) == 2
      err = capsys.readouterr().err
      assert err.startswith("error: output_json=") and __import__("re").search(msg, err) and ".tmp" not in err, err


def test_existing_output_json_needs_overwrite(checkpoints, tmp_path, capsys, monkeypatch):
  """An existing output_json is refused before any work (as tools.convert_checkpoint refuses an existing
  output), unless overwrite=true; then it is replaced, through a temporary file."""
  from tools import cli as serving_common
  ck = f"load_parameters_path={checkpoints['dense']}"
  out = tmp_path / "old.json"
  out.write_text("keep me\n")
  ids = tmp_path / "ok.txt"
  ids.write_text("3 4 5 6\n")
  def no_load(*a, **k):
    raise AssertionError("the model was loaded before the existing output_json was refused")
  monkeypatch.setattr(serving_common, "load", no_load)
  for tool, argv in ((_gen, [ck, "prompt_ids=3"]), (_ppl, [ck, f"eval_data={ids}", "eval_format=ids"])):
    assert tool(argv + [f"output_json={out}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: output_json={str(out)!r} already exists; pass overwrite=true to replace it\n", err
    assert out.read_text() == "keep me\n"
  with pytest.raises(serving_common.UsageError, match="already exists; pass overwrite=true"):
    serving_common.write_json_atomic(out, {"a": 1})
  assert out.read_text() == "keep me\n"

  # overwrite=true: the existing file passes the up-front check (the tool goes on to load the model)...
  for tool, argv in ((_gen, [ck, "prompt_ids=3"]), (_ppl, [ck, f"eval_data={ids}", "eval_format=ids"])):
    with pytest.raises(AssertionError, match="the model was loaded"):
      tool(argv + [f"output_json={out}", "overwrite=true"])
  # ... and the final write replaces it through a temporary file.
  serving_common.write_json_atomic(out, {"a": 1}, overwrite=True)
  assert json.loads(out.read_text()) == {"a": 1}
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.txt", "old.json"]  # no temporary left behind


@pytest.mark.parametrize("prompt_len", [2, 9])  # 9: the prompt itself ends inside a byte-fallback character
def test_streamed_text_with_byte_fallback_is_written_once(prompt_len):
  """Multi-byte characters built from byte-fallback pieces (the demo tokenizer has byte fallback):
  the stream is exactly the decoded text, no prefix written twice; an unfinished character is
  written by finish()."""
  import io
  tok = SentencePieceTokenizer(DEMO_TOKENIZER)
  text = "ROMEO: café 日本!"
  ids = tok.encode(text)
  pieces = [tok.id_to_piece(i) for i in ids]
  assert sum(p.startswith("<0x") for p in pieces) == 8, pieces  # é (2 bytes), 日 and 本 (3 each)
  out = io.StringIO()
  stream = generate._Streamer(tok, tok.eos_id, ids[:prompt_len], out=out)
  for t in ids[prompt_len:] + [tok.eos_id]:
    stream(0, np.array([t]), np.array([True]))
  stream(0, np.array([0]), np.array([False]))  # a masked step after EOS writes nothing
  stream.finish()
  assert out.getvalue() == text
  # Bytes no later piece completes: held back while streaming, written (as U+FFFD) at the end.
  out = io.StringIO()
  stream = generate._Streamer(tok, tok.eos_id, ids[:1], out=out)
  for t in ids[1:9]:  # ends after <0xE6>, the first of 日's three bytes
    stream(0, np.array([t]), np.array([True]))
  assert out.getvalue() == "ROMEO: café "
  stream.finish()
  assert out.getvalue() == "ROMEO: café \ufffd" == tok.decode(ids[:9])


def test_json_output_has_no_nan(tmp_path):
  from tools.cli import write_json_atomic
  out = tmp_path / "x.json"
  write_json_atomic(out, {"perplexity": float("nan"), "v": [np.float64("inf"), 1.5]})
  assert "NaN" not in out.read_text() and "Infinity" not in out.read_text()
  assert json.loads(out.read_text()) == {"perplexity": None, "v": [None, 1.5]}


def test_out_of_memory_is_one_error_line(checkpoints, tmp_path, capsys, monkeypatch):
  """XLA's RESOURCE_EXHAUSTED (e.g. max_target_length=100000: 2.6 TB for the demo model) is one
  `error:` line, exit 2 (was a traceback, exit 1), naming only keys that lower the memory of what ran out:
  in a scoring window the keys of that pass (a lone long document: max_target_length, not
  eval_batch_size), outside the windows none. Simulated: the window / scoring / generation call raises
  the error XLA raises (nothing is allocated)."""
  import jax
  from model.engine.scoring import Scorer
  from model.engine.generator import Generator
  ids = tmp_path / "ok.txt"
  ids.write_text("3 4 5 6\n")
  long = tmp_path / "long.txt"
  long.write_text(" ".join(["7"] * 40) + "\n3 4 5\n")
  ck = f"load_parameters_path={checkpoints['dense']}"
  xla = "RESOURCE_EXHAUSTED: Out of memory allocating 2662825103120 bytes."

  def oom(*a, **k):
    raise jax.errors.JaxRuntimeError(xla + "\nmore detail")
  real = Scorer._window_fn
  monkeypatch.setattr(Scorer, "_window_fn", lambda self, rows, slots, length: oom() if slots == 1 else
                      real(self, rows, slots, length))
  assert _ppl([ck, f"eval_data={long}", "eval_format=ids", "max_target_length=8"]) == 2
  err = capsys.readouterr().err.splitlines()[-1]
  assert err.startswith(f"error: out of memory ({xla}): lower max_target_length (windows of 1 x 8 tokens; the "
                        f"cache of document 0 (40 tokens), 1 x 64 MLA entries per layer ("), err
  assert "eval_batch_size" not in err and "max_num_segments" not in err
  monkeypatch.setattr(perplexity, "score", oom)
  monkeypatch.setattr(Generator, "generate", oom)
  assert _ppl([ck, f"eval_data={ids}", "eval_format=ids", "max_target_length=100000"]) == 2
  err = capsys.readouterr().err.splitlines()[-1]
  assert err == f"error: out of memory ({xla}): {perplexity.OUTSIDE_SCORING}", err
  assert _gen([ck, "prompt_ids=3,4", "max_new_tokens=2"]) == 2
  err = capsys.readouterr().err.splitlines()[-1]
  assert err == f"error: out of memory ({xla}): lower generate_batch_size, max_new_tokens or the prompt length", err

  def other(*a, **k):
    raise jax.errors.JaxRuntimeError("INTERNAL: not a memory error")
  monkeypatch.setattr(perplexity, "score", other)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # anything else is not hidden
    _ppl([ck, f"eval_data={ids}", "eval_format=ids"])


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_output_json_gets_the_umask_mode(tmp_path, umask):
  """output_json (tools.generate / tools.perplexity write it with write_json_atomic) gets 0o666 less
  the umask, as a plain open() gives (it was 0o600: mkstemp's mode); a failed write leaves nothing."""
  import os
  from model.atomic import atomic_writer
  from tools.cli import write_json_atomic
  old = os.umask(umask)
  try:
    write_json_atomic(tmp_path / "out.json", {"a": 1})
    with pytest.raises(RuntimeError, match="boom"):
      with atomic_writer(tmp_path / "never.json") as f:
        f.write("partial")
        raise RuntimeError("boom")
  finally:
    os.umask(old)
  assert os.stat(tmp_path / "out.json").st_mode & 0o777 == 0o666 & ~umask
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_dump_logprobs_needs_output_json(checkpoints, capsys):
  """dump_logprobs=true without output_json is refused up front (it used to be ignored silently)."""
  assert _ppl([f"load_parameters_path={checkpoints['dense']}", "eval_data=x", "dump_logprobs=true"]) == 2
  assert capsys.readouterr().err == ("error: dump_logprobs=true needs output_json=FILE (the per-token log-probs "
                                     "are written there)\n")


def test_interrupt_ends_the_streamed_line(checkpoints, capsys, monkeypatch):
  """Ctrl-C while a prompt streams: the streamed text's line is ended before run_tool's "interrupted"
  (a terminal showed "ROMEO:interrupted"); exit status 130."""
  from model.engine.generator import Generator

  def interrupted(self, prompts, *a, on_tokens=None, **k):
    on_tokens(0, np.array([5]), np.array([True]))
    raise KeyboardInterrupt
  monkeypatch.setattr(Generator, "generate", interrupted)
  assert _gen([f"load_parameters_path={checkpoints['dense']}", "prompt_ids=3,4", "max_new_tokens=4"]) == 130
  out = capsys.readouterr()
  assert out.out.endswith("3 4 5\n") and out.err.endswith("interrupted\n"), out


def test_help(capsys):
  assert _gen(["--help"]) == 0 and "decode_sampling_strategy" in capsys.readouterr().out
  assert _ppl(["--help"]) == 0 and "compare_attention" in capsys.readouterr().out
  for tool in (_gen, _ppl):
    assert tool(["--help"]) == 0 and "overwrite             true: replace an existing output_json" in capsys.readouterr().out
