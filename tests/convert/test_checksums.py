"""Per-parameter checksums: every checkpoint the project writes records them (checksums.json beside
params/), loading verifies them (a flipped bit is one error line naming the parameter), old
checkpoints without them still load with one notice, and `tools.verify_checkpoint` checks a directory."""

from __future__ import annotations

import json
import pathlib
import shutil
import zlib

import numpy as np
import pytest

from model import loading
from model.checkpoint import checksums, format as ck
from model.config import load_config
from tools import convert_checkpoint as cc
from tools import verify_checkpoint as vc
from tools.cli import run_tool

REPO = pathlib.Path(__file__).resolve().parents[2]
DENSE = REPO / "tests" / "fixtures" / "hf_tiny_dense_moe"
DEMO = REPO / "kda_plugin" / "assets" / "demo"
TARGET = "lm_head.kernel"


def _verify(argv):
  return run_tool(vc.main, vc.__doc__, [str(a) for a in argv])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  out = tmp_path_factory.mktemp("sums") / "ck"
  assert cc.main([f"hf_model_path={DENSE}", f"output_path={out}"]) == 0
  return out


def test_conversion_records_a_crc32_per_parameter(converted):
  sums = json.loads((converted / ck.CHECKSUMS_FILE).read_text())
  assert sums["algorithm"] == "crc32"
  stored = ck.stored_parameters(converted)
  assert sorted(sums["parameters"]) == sorted(stored)
  got = ck.read_parameters(converted, [TARGET])[TARGET]
  # Oracle: zlib's CRC-32 of the array's C-order bytes, computed here independently.
  assert sums["parameters"][TARGET]["crc32"] == f"{zlib.crc32(np.ascontiguousarray(got).tobytes()):08x}"
  assert sums["parameters"][TARGET]["shape"] == list(got.shape)


def test_training_export_records_checksums(tmp_path):
  cfg = load_config(["tiny"])
  model = loading.create(cfg)
  path = ck.save_parameters(tmp_path / "ck", model, cfg)
  sums = checksums.read_checksums(path)
  assert sorted(sums) == sorted(ck.stored_parameters(path))
  assert ck.check_parameters(path)["checksums"] is True


def _flip_a_bit_of(ckpt: pathlib.Path, name: str) -> None:
  """Flips one bit inside the stored bytes of parameter `name` (found by its value, so only that
  parameter's data changes, whichever OCDBT file holds it)."""
  arr = ck.read_parameters(ckpt, [name])[name]
  needle = np.ascontiguousarray(arr).tobytes()[:64]
  for f in sorted((ckpt / ck.PARAMS_DIR).rglob("*")):
    if f.is_file():
      data = bytearray(f.read_bytes())
      i = data.find(needle)
      if i >= 0:
        data[i + 5] ^= 0x10
        f.write_bytes(bytes(data))
        return
  raise AssertionError(f"bytes of {name} not found uncompressed in params/")


@pytest.fixture
def corrupted(converted, tmp_path):
  ckpt = tmp_path / "bad"
  shutil.copytree(converted, ckpt)
  _flip_a_bit_of(ckpt, TARGET)
  return ckpt


def test_a_flipped_bit_is_one_error_naming_the_parameter(corrupted, capsys):
  with pytest.raises(ck.CheckpointError, match=rf"parameter {TARGET} does not match its checksum \(crc32 "
                     r"recorded [0-9a-f]{8}, read [0-9a-f]{8}\).*verify_checksums=false"):
    loading.load_model(corrupted)
  assert _verify([f"load_parameters_path={corrupted}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and TARGET in err[0], err
  model, _ = loading.load_model(corrupted, ["verify_checksums=false"])  # documented escape hatch
  assert model.lm_head.kernel.get_value().shape == ck.stored_parameters(corrupted)[TARGET][0]


def test_verify_checkpoint_ok(converted, capsys):
  assert _verify([f"load_parameters_path={converted}"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("ok: ") and "checksums match (crc32)" in out and "all finite" in out, out


def test_old_checkpoint_without_checksums_loads_with_one_notice(converted, tmp_path, capsys):
  old = tmp_path / "old"
  shutil.copytree(converted, old)
  (old / ck.CHECKSUMS_FILE).unlink()
  loading.load_model(old)
  loading.load_model(old)
  err = capsys.readouterr().err
  assert err.count(f"has no {ck.CHECKSUMS_FILE}") == 1, err
  assert _verify([f"load_parameters_path={old}"]) == 1
  assert "unverified" in capsys.readouterr().out
  assert _verify([f"load_parameters_path={old}", "record_checksums=true"]) == 0
  assert checksums.read_checksums(old) == checksums.read_checksums(converted)
  assert _verify([f"load_parameters_path={old}"]) == 0


def test_shipped_demo_has_checksums_that_match():
  assert (DEMO / ck.CHECKSUMS_FILE).is_file()
  res = ck.check_parameters(DEMO)
  assert res["checksums"] is True and res["parameters"] == len(ck.stored_parameters(DEMO))
