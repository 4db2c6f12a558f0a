"""kda-convert carries a Kimi checkpoint's tokenizer: HF -> Orbax copies the tokenizer files into
DIR/tokenizer/ (covered by checksums.json, named by config.json's tokenizer_path), and Orbax -> HF writes
them back byte for byte; every tool then finds tokenizer and chat template from load_parameters_path
alone. Failures leave nothing behind.

Oracle: the bytes of the source files (tests/fixtures/kimi_tokenizer plus the optional files a released
checkpoint has: special_tokens_map.json, chat_template.jinja, tokenization_kimi.py), and zlib's CRC-32.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import zlib

import pytest

from model.checkpoint import format as ck
from model.checkpoint.format import read_config
from tests.helpers.kimi_checkpoint import KIMI_TOKENIZER, MODEL_NAME, write_tiny_kimi_hf
from tools import convert_checkpoint as cc
from tools import perplexity, verify_checkpoint
from tools.cli import run_tool

REPO = pathlib.Path(__file__).resolve().parents[2]
DENSE = REPO / "tests" / "fixtures" / "hf_tiny_dense_moe"
# Optional files of a released Kimi checkpoint (their content is opaque to the converter).
EXTRA = {"special_tokens_map.json": '{"bos_token": "[BOS]", "eos_token": "[EOS]"}\n',
         "chat_template.jinja": json.loads((KIMI_TOKENIZER / "tokenizer_config.json").read_text())["chat_template"],
         "tokenization_kimi.py": "# transformers' remote code would be here\nclass TikTokenTokenizer: ...\n"}


def _tool(module, argv):
  return run_tool(module.main, module.__doc__, [str(a) for a in argv])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """The tiny HF Kimi directory with the fixture tokenizer and the optional files."""
  hf = write_tiny_kimi_hf(tmp_path_factory.mktemp("hf_kimi") / MODEL_NAME)
  for name, text in EXTRA.items():
    (hf / name).write_text(text, encoding="utf-8")
  (hf / "README.md").write_text("not a tokenizer file\n")
  return hf


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp("kimi_ckpt") / "ckpt"
  assert cc.main([f"hf_model_path={hf_dir}", f"output_path={out}"]) == 0
  return out


TOKENIZER_NAMES = sorted(["tiktoken.model", "tokenizer_config.json", "generation_config.json", *EXTRA])


def test_to_orbax_copies_the_tokenizer_files(hf_dir, converted):
  assert sorted(os.listdir(converted / "tokenizer")) == TOKENIZER_NAMES   # README.md is not one of them
  for name in TOKENIZER_NAMES:
    assert (converted / "tokenizer" / name).read_bytes() == (hf_dir / name).read_bytes(), name
  assert json.loads((converted / "config.json").read_text())["tokenizer_path"] == "tokenizer"
  assert read_config(converted).tokenizer_path == os.fspath(converted / "tokenizer")
  files = json.loads((converted / ck.CHECKSUMS_FILE).read_text())["files"]
  assert sorted(files) == sorted([f"tokenizer/{n}" for n in TOKENIZER_NAMES] + ["hf_config.json"])
  for name, entry in files.items():
    data = (converted / name).read_bytes()
    assert entry == {"crc32": f"{zlib.crc32(data):08x}", "bytes": len(data)}, name


def test_round_trip_writes_the_tokenizer_back_byte_for_byte(hf_dir, converted, tmp_path):
  back = tmp_path / "hf_back"
  summary = cc.convert(["direction=to_hf", f"load_parameters_path={converted}", f"output_path={back}"])
  assert summary["tokenizer"] == TOKENIZER_NAMES
  for name in TOKENIZER_NAMES:
    assert (back / name).read_bytes() == (hf_dir / name).read_bytes(), name
  # ... and that directory converts again to the same tokenizer.
  again = tmp_path / "again"
  assert cc.main([f"hf_model_path={back}", f"output_path={again}"]) == 0
  for name in TOKENIZER_NAMES:
    assert (again / "tokenizer" / name).read_bytes() == (hf_dir / name).read_bytes(), name


def test_the_chat_template_and_stop_ids_come_with_the_checkpoint(converted):
  from tools.cli import checkpoint_config, parse_args, tokenizer_for
  _, cfg = parse_args([f"load_parameters_path={converted}"])
  tok = tokenizer_for(checkpoint_config(cfg, []))
  assert tok.chat_template is not None and tok.path == os.fspath(converted / "tokenizer")
  assert tok.stop_ids == {2049, 2050}    # [EOS]; <|im_end|> (and generation_config.json's eos_token_id)


def test_perplexity_finds_the_tokenizer_from_the_checkpoint(converted, tmp_path, capsys):
  docs = ["First Citizen: before we proceed any further, hear me speak.", "Speak, speak."]
  text = tmp_path / "docs.txt"
  text.write_text("\n\n".join(docs) + "\n")
  out = tmp_path / "ppl.json"
  assert _tool(perplexity, [f"load_parameters_path={converted}", f"eval_data={text}", "max_target_length=32",
                            "dump_logprobs=true", f"output_json={out}"]) == 0, capsys.readouterr().err
  from model.data.tokenizer_kimi import KimiTokenizer
  tok = KimiTokenizer(KIMI_TOKENIZER)
  got = [d["token_ids"] for d in json.loads(out.read_text())["documents"]]
  assert got == [[tok.bos_id, *tok.encode(d), tok.eos_id] for d in docs]   # the Kimi tokenizer, framed


def test_a_corrupted_tokenizer_file_is_refused(converted, tmp_path, capsys):
  bad = tmp_path / "bad"
  shutil.copytree(converted, bad)
  f = bad / "tokenizer" / "tokenizer_config.json"
  f.write_text(f.read_text().replace("You are a helpful assistant.", "You are a hacked assistant."))
  with pytest.raises(ck.CheckpointError, match=r"tokenizer/tokenizer_config.json does not match its checksum"):
    ck.check_parameters(bad)
  assert _tool(verify_checkpoint, [f"load_parameters_path={bad}"]) == 2
  assert "tokenizer/tokenizer_config.json does not match its checksum" in capsys.readouterr().err
  assert cc.main(["direction=to_hf", f"load_parameters_path={bad}", f"output_path={tmp_path / 'hf'}"]) == 2
  assert "tokenizer_config.json does not match its checksum" in capsys.readouterr().err
  assert not (tmp_path / "hf").exists()
  (bad / "tokenizer" / "tiktoken.model").unlink()
  with pytest.raises(ck.CheckpointError, match=r"tokenizer/tiktoken.model is missing"):
    ck.check_parameters(bad)


def test_a_failed_copy_leaves_nothing(hf_dir, tmp_path, monkeypatch, capsys):
  real = shutil.copyfile
  calls = []

  def fail_on_third(src, dst, *a, **k):
    calls.append(src)
    if len(calls) == 3:
      raise OSError(28, "No space left on device", os.fspath(dst))
    return real(src, dst, *a, **k)

  monkeypatch.setattr(shutil, "copyfile", fail_on_third)
  assert cc.main([f"hf_model_path={hf_dir}", f"output_path={tmp_path / 'ck'}"]) == 1
  assert "No space left on device" in capsys.readouterr().err
  assert os.listdir(tmp_path) == []    # neither the checkpoint nor a temporary sibling


def test_tokenizer_path_choices(hf_dir, tmp_path, capsys):
  # none: no tokenizer.
  assert cc.main([f"hf_model_path={hf_dir}", f"output_path={tmp_path / 'none'}", "tokenizer_path=none"]) == 0
  assert not (tmp_path / "none" / "tokenizer").exists()
  assert json.loads((tmp_path / "none" / "config.json").read_text())["tokenizer_path"] == ""
  # An explicit directory: the fixture (without the optional files).
  assert cc.main([f"hf_model_path={hf_dir}", f"output_path={tmp_path / 'dir'}", f"tokenizer_path={KIMI_TOKENIZER}"]) == 0
  assert sorted(os.listdir(tmp_path / "dir" / "tokenizer")) == sorted(os.listdir(KIMI_TOKENIZER))
  # A directory that is no Kimi tokenizer, a path that does not exist.
  for value, needle in ((DENSE, "has no tiktoken.model or tokenizer_config.json"), (tmp_path / "nope", "does not exist")):
    assert cc.main([f"hf_model_path={hf_dir}", f"output_path={tmp_path / 'x'}", f"tokenizer_path={value}"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer_path" in err and needle in err, err
    assert not (tmp_path / "x").exists()


def test_a_tokenizer_that_does_not_fit_is_refused(tmp_path, capsys):
  """The dense fixture (vocabulary 512) with the Kimi tokenizer (2304 ids) beside it: refused, nothing written."""
  src = tmp_path / "hf"
  shutil.copytree(DENSE, src)
  for f in KIMI_TOKENIZER.iterdir():
    shutil.copyfile(f, src / f.name)
  assert cc.main([f"hf_model_path={src}", f"output_path={tmp_path / 'ck'}"]) == 2
  err = capsys.readouterr().err
  assert "in hf_model_path" in err and "2304 tokens but vocab_size=512" in err and "tokenizer_path=none" in err
  assert not (tmp_path / "ck").exists()


def test_a_checkpoint_without_tokenizer_is_unchanged(tmp_path):
  out = tmp_path / "dense"
  assert cc.main([f"hf_model_path={DENSE}", f"output_path={out}"]) == 0
  assert sorted(os.listdir(out)) == ["checksums.json", "config.json", "hf_config.json", "params"]
  back = tmp_path / "back"
  assert cc.main(["direction=to_hf", f"load_parameters_path={out}", f"output_path={back}"]) == 0
  assert sorted(os.listdir(back)) == ["config.json", "model.safetensors"]
