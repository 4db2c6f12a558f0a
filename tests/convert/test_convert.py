"""tools/convert_checkpoint.py: HF fixtures -> project checkpoint -> logits vs transformers' goldens,
HF -> Orbax -> HF bit-exactness (float32 and bfloat16 sources), transformers loading the output, and
one test per kind of bad input (each must leave the output path absent)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from model import loading
from model.hf import convert as conversion
from model.checkpoint import format as ck
from tools import convert_checkpoint as cc
from model.hf import names as hl

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
DENSE, SHARDED = FIXTURES / "hf_tiny_dense_moe", FIXTURES / "hf_tiny_sharded"
REF_PY = REPO / ".venv-ref" / "bin" / "python"
ATOL = 1e-4  # the brief's bound; the measured error is ~3e-7 (float32 summation order only)
# transformers' save_pretrained names the dense FFN of layer 0 block_sparse_moe.*; we write mlp.*.
_DENSE_ALIAS = {f"model.layers.0.block_sparse_moe.{p}.weight": f"model.layers.0.mlp.{p}.weight"
                for p in ("gate_proj", "up_proj", "down_proj")}


def _hf_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor of an HF directory, read with safetensors (independent of the converter)."""
  out = {}
  for f in sorted(path.glob("*.safetensors")):
    for k, v in load_file(f).items():
      assert k not in out, k
      out[_DENSE_ALIAS.get(k, k)] = v
  return out


def _run(argv) -> dict:
  return cc.convert([str(a) for a in argv])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """Both fixtures converted with the default arguments (dtype auto)."""
  root = tmp_path_factory.mktemp("converted")
  out = {}
  for name, src in (("dense", DENSE), ("sharded", SHARDED)):
    _run([f"hf_model_path={src}", f"output_path={root / name}"])
    out[name] = root / name
  return out


@pytest.fixture(scope="module")
def forward():
  """One jitted forward per (graphdef) in `mode="eval"`: with kda_native that is `kda_inference`,
  the megakernel path users evaluate and prefill with."""
  cache = {}

  def run(model, ids):
    gd, st = nnx.split(model)
    if gd not in cache:
      cache[gd] = jax.jit(lambda st, ids: nnx.merge(gd, st)(ids, mode="eval"))
    return np.asarray(cache[gd](st, ids))
  return run


# ------------------------------------------------------------------------------------------------
# Numerics and round trips
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["kda_native", "kda_reference"])
@pytest.mark.parametrize("name", ["dense", "sharded"])
def test_logits_match_transformers(converted, forward, name, attention):
  ref = np.load((DENSE if name == "dense" else SHARDED) / "reference.npz")
  model, cfg = loading.load_model(converted[name], [f"attention={attention}"])
  assert cfg.attention == attention
  logits = forward(model, ref["input_ids"])
  err = np.max(np.abs(logits - ref["logits"]))
  assert err < ATOL, f"{name}/{attention}: max |logits - transformers| = {err}"


def test_config_read_from_hf(converted):
  _, cfg = loading.load_model(converted["sharded"], abstract=True)
  assert (cfg.kda_layers, cfg.full_attn_layers) == ([1, 2, 4], [3])
  assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel_size) == (3, 24, 4)
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_shared_experts, cfg.first_k_dense_replace) == (6, 2, 2, 2)
  assert (cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank) == (8, 12, 24)
  assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
  assert cfg.weight_dtype == "float32" and cfg.model_name == "hf_tiny_sharded"


@pytest.mark.parametrize("name", ["dense", "sharded"])
def test_round_trip_float32_bit_exact(converted, tmp_path, name, monkeypatch):
  src = DENSE if name == "dense" else SHARDED
  # Tiny read pieces: the to_hf reader then makes many partial reads.
  monkeypatch.setattr(conversion, "PIECE_BYTES", 20_000)
  summary = _run(["direction=to_hf", f"load_parameters_path={converted[name]}", f"output_path={tmp_path / 'hf'}",
                  "max_shard_size=300KB"])
  a, b = _hf_tensors(src), _hf_tensors(tmp_path / "hf")
  assert sorted(a) == sorted(b)
  for k in a:
    assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
    assert a[k].tobytes() == b[k].tobytes(), k
  shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
  assert summary["shards"] == len(shards) >= 3
  index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
  assert sorted(index["weight_map"]) == sorted(b) and set(index["weight_map"].values()) == set(shards)
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in b.values())


def test_piecewise_orbax_write_is_exact(tmp_path, monkeypatch):
  """Orbax written in ~15 partial saves (the path big checkpoints take) holds the same arrays."""
  monkeypatch.setattr(conversion, "PIECE_BYTES", 50_000)
  _run([f"hf_model_path={SHARDED}", f"output_path={tmp_path / 'ck'}"])
  _run(["direction=to_hf", f"load_parameters_path={tmp_path / 'ck'}", f"output_path={tmp_path / 'hf'}"])
  a, b = _hf_tensors(SHARDED), _hf_tensors(tmp_path / "hf")
  assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
  assert [p.name for p in (tmp_path / "hf").glob("*.safetensors")] == ["model.safetensors"]


def _write_bf16_source(dst: pathlib.Path) -> dict[str, np.ndarray]:
  """A bf16 copy of the dense fixture as transformers saves one: weights bf16, but the router weight,
  router bias and dt_bias float32 (its `_keep_in_fp32_modules_strict`)."""
  dst.mkdir()
  keep_f32 = ("gate.weight", "e_score_correction_bias", "dt_bias")
  tensors = {k: (v if k.endswith(keep_f32) else v.astype(ml_dtypes.bfloat16))
             for k, v in load_file(DENSE / "model.safetensors").items()}
  save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  cfg = json.loads((DENSE / "config.json").read_text())
  cfg["dtype"] = "bfloat16"
  (dst / "config.json").write_text(json.dumps(cfg))
  return tensors


def test_round_trip_bfloat16_bit_exact(tmp_path, forward):
  src = _write_bf16_source(tmp_path / "bf16")
  _run([f"hf_model_path={tmp_path / 'bf16'}", f"output_path={tmp_path / 'ck'}"])
  stored = ck.stored_parameters(tmp_path / "ck")
  assert stored["lm_head.kernel"][1] == ml_dtypes.bfloat16
  assert stored["model.layers.1.block_sparse_moe.gate.kernel"][1] == np.float32  # kept as the source has it
  _run(["direction=to_hf", f"load_parameters_path={tmp_path / 'ck'}", f"output_path={tmp_path / 'hf'}"])
  out = _hf_tensors(tmp_path / "hf")
  src = {_DENSE_ALIAS.get(k, k): v for k, v in src.items()}
  assert sorted(src) == sorted(out)
  for k in src:
    assert (src[k].dtype, src[k].shape) == (out[k].dtype, out[k].shape), k
    assert src[k].tobytes() == out[k].tobytes(), k
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
  # The bf16 checkpoint loads: weight_dtype bfloat16, A_log/dt_bias/router bias float32 in the model.
  model, cfg = loading.load_model(tmp_path / "ck")
  assert cfg.weight_dtype == "bfloat16"
  assert model.model.layers[0].self_attn.A_log.get_value().dtype == np.float32
  assert model.lm_head.kernel.get_value().dtype == ml_dtypes.bfloat16


def test_weight_dtype_bfloat16_casts_weights_only(converted, tmp_path):
  _run([f"hf_model_path={DENSE}", f"output_path={tmp_path / 'ck'}", "weight_dtype=bfloat16"])
  stored = ck.stored_parameters(tmp_path / "ck")
  f32_only = [k for k in stored
              if k.endswith(("A_log", "dt_bias", "e_score_correction_bias", "block_sparse_moe.gate.kernel"))]
  assert f32_only and all(stored[k][1] == np.float32 for k in f32_only)
  assert all(stored[k][1] == ml_dtypes.bfloat16 for k in stored if k not in f32_only)
  src = load_file(DENSE / "model.safetensors")
  got = ck.read_parameters(tmp_path / "ck", ["lm_head.kernel", "model.layers.0.self_attn.q_conv1d.kernel"])
  np.testing.assert_array_equal(got["lm_head.kernel"], src["lm_head.weight"].T.astype(ml_dtypes.bfloat16))
  np.testing.assert_array_equal(got["model.layers.0.self_attn.q_conv1d.kernel"],
                                src["model.layers.0.self_attn.q_conv1d.weight"][:, 0, :].T.astype(ml_dtypes.bfloat16))
  assert json.loads((tmp_path / "ck" / "config.json").read_text())["weight_dtype"] == "bfloat16"


def test_parameter_mapping_against_numpy(converted):
  """Each transform kind, checked against the HF tensors with plain NumPy indexing."""
  src = load_file(DENSE / "model.safetensors")
  names = ["model.layers.1.block_sparse_moe.experts.w1", "model.layers.1.block_sparse_moe.experts.w2",
           "model.layers.0.self_attn.A_log", "model.layers.0.self_attn.k_conv1d.kernel",
           "model.layers.2.self_attn.kv_b_proj.kernel", "model.embed_tokens.embedding", "model.norm.scale",
           "model.layers.0.mlp.down_proj.kernel", "model.layers.4.block_sparse_moe.gate.e_score_correction_bias"]
  got = ck.read_parameters(converted["dense"], names)
  p = "model.layers.1.block_sparse_moe.experts"
  for e in range(4):
    np.testing.assert_array_equal(got[p + ".w1"][e], src[f"{p}.{e}.w1.weight"].T)
    np.testing.assert_array_equal(got[p + ".w2"][e], src[f"{p}.{e}.w2.weight"].T)
  np.testing.assert_array_equal(got["model.layers.0.self_attn.A_log"], src["model.layers.0.self_attn.A_log"][0, 0, :, 0])
  conv = src["model.layers.0.self_attn.k_conv1d.weight"]  # [D, 1, W]: tap w of channel c -> kernel[w, c]
  for c in (0, 5, 31):
    np.testing.assert_array_equal(got["model.layers.0.self_attn.k_conv1d.kernel"][:, c], conv[c, 0, :])
  np.testing.assert_array_equal(got["model.layers.2.self_attn.kv_b_proj.kernel"],
                                src["model.layers.2.self_attn.kv_b_proj.weight"].T)
  np.testing.assert_array_equal(got["model.embed_tokens.embedding"], src["model.embed_tokens.weight"])
  np.testing.assert_array_equal(got["model.norm.scale"], src["model.norm.weight"])
  np.testing.assert_array_equal(got["model.layers.0.mlp.down_proj.kernel"],
                                src["model.layers.0.block_sparse_moe.down_proj.weight"].T)
  bias = got["model.layers.4.block_sparse_moe.gate.e_score_correction_bias"]
  np.testing.assert_array_equal(bias, src["model.layers.4.block_sparse_moe.gate.e_score_correction_bias"])
  assert np.any(bias != 0)


def test_to_hf_config_agrees_with_transformers_config(converted, tmp_path):
  """Without transformers: every key the fixture's transformers-written config.json shares with ours
  has the same value, and reading ours back gives the same project config."""
  for name, src in (("dense", DENSE), ("sharded", SHARDED)):
    out = tmp_path / name
    _run(["direction=to_hf", f"load_parameters_path={converted[name]}", f"output_path={out}"])
    ours, theirs = json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())
    shared = set(ours) & set(theirs) - {"transformers_version"}
    assert len(shared) > 30
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    back, _ = hl.config_from_hf(ours, name="x")
    orig = ck.read_config(converted[name])
    skip = {"model_name", "load_parameters_path", "tokenizer_path"}
    assert {k: v for k, v in back.items() if k not in skip} == {k: v for k, v in orig.items() if k not in skip}


# The keys to_hf may add to the source's config.json (transformers' defaults the model needs).
TO_HF_ADDED_KEYS = {"mla_use_nope", "moe_layer_freq", "moe_router_activation_func", "num_nextn_predict_layers",
                    "use_grouped_topk"}


def test_help_says_what_a_round_trip_preserves(capsys):
  """--help states what test_round_trip_keeps_the_source_hf_config checks: values bit-exact, names in
  transformers' spelling, config = source keys + the keys to_hf adds (it used to promise the source's
  config.json back)."""
  from tools import convert_checkpoint as cc
  assert cc.main(["--help"]) == 0
  text = " ".join(capsys.readouterr().out.split())
  assert "gives back the source's config.json" not in text
  assert "tensor values bit-exact" in text and "`mlp.*` even when the source named it `block_sparse_moe.*`" in text
  for key in TO_HF_ADDED_KEYS:
    assert key in text, key


def test_round_trip_keeps_the_source_hf_config(converted, tmp_path):
  """to_orbax keeps the source config.json as hf_config.json; to_hf merges it back, so informational
  keys (model_max_length, linear_num_heads, head_dim, qk_head_dim, ...) survive the round trip."""
  for name, src in (("dense", DENSE), ("sharded", SHARDED)):
    theirs = json.loads((src / "config.json").read_text())
    assert json.loads((converted[name] / "hf_config.json").read_text()) == theirs
    out = tmp_path / name
    _run(["direction=to_hf", f"load_parameters_path={converted[name]}", f"output_path={out}"])
    ours = json.loads((out / "config.json").read_text())
    for key in ("model_max_length", "linear_num_heads", "head_dim", "qk_head_dim", "linear_head_dim",
                "pretraining_tp", "transformers_version"):
      assert ours[key] == theirs[key], key
    assert {k: ours[k] for k in theirs} == theirs  # ours adds a few keys transformers defaults (mla_use_nope, ...)
    assert set(ours) - set(theirs) <= TO_HF_ADDED_KEYS
  # A checkpoint without hf_config.json (e.g. written by tools.train) gets the model's keys only.
  bare = tmp_path / "bare"
  shutil.copytree(converted["dense"], bare)
  (bare / "hf_config.json").unlink()
  _run(["direction=to_hf", f"load_parameters_path={bare}", f"output_path={tmp_path / 'bare_hf'}"])
  ours = json.loads((tmp_path / "bare_hf" / "config.json").read_text())
  assert "model_max_length" not in ours and ours["dtype"] == "float32" and ours["vocab_size"] == 512


def test_to_hf_dtype_is_the_dtype_of_most_parameter_bytes(tmp_path):
  """bf16 matrices + float32 vectors (a tools.train export with export_dtype=bfloat16 keeps
  weight_dtype=float32 in its config) are labelled bfloat16, in dtype and torch_dtype."""
  src = _write_bf16_source(tmp_path / "bf16")
  cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
  cfg["torch_dtype"] = cfg.pop("dtype")  # an older transformers' spelling
  (tmp_path / "bf16" / "config.json").write_text(json.dumps(cfg))
  _run([f"hf_model_path={tmp_path / 'bf16'}", f"output_path={tmp_path / 'ck'}"])
  stored = json.loads((tmp_path / "ck" / "config.json").read_text())
  stored["weight_dtype"] = "float32"
  (tmp_path / "ck" / "config.json").write_text(json.dumps(stored))
  bytes_by_dtype = {}
  for v in src.values():
    bytes_by_dtype[v.dtype.name] = bytes_by_dtype.get(v.dtype.name, 0) + v.nbytes
  assert 0 < bytes_by_dtype["float32"] < bytes_by_dtype["bfloat16"]  # a mixed checkpoint
  summary = _run(["direction=to_hf", f"load_parameters_path={tmp_path / 'ck'}", f"output_path={tmp_path / 'hf'}"])
  out = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert (out["dtype"], out["torch_dtype"], summary["weight_dtype"]) == ("bfloat16",) * 3
  # weight_dtype=float32 casts every tensor: then the label is float32.
  _run(["direction=to_hf", f"load_parameters_path={tmp_path / 'ck'}", f"output_path={tmp_path / 'hf32'}",
        "weight_dtype=float32"])
  out = json.loads((tmp_path / "hf32" / "config.json").read_text())
  assert (out["dtype"], out["torch_dtype"]) == ("float32", "float32")
  assert conversion.majority_dtype([("a", (3, 2), np.dtype(np.float32)), ("b", (4, 4), np.dtype(ml_dtypes.bfloat16))]) == \
      "bfloat16"  # 24 bytes vs 32
  assert conversion.majority_dtype([("a", (5, 2), np.dtype(np.float32)), ("b", (4, 4), np.dtype(ml_dtypes.bfloat16))]) == \
      "float32"  # 40 bytes vs 32


@pytest.mark.skipif(not REF_PY.exists(), reason=".venv-ref (torch + transformers) is absent")
def test_transformers_loads_to_hf_output(converted, tmp_path):
  args = []
  for name, src in (("dense", DENSE), ("sharded", SHARDED)):
    _run(["direction=to_hf", f"load_parameters_path={converted[name]}", f"output_path={tmp_path / name}",
          "max_shard_size=400KB"])
    args += [tmp_path / name, src / "reference.npz"]
  proc = subprocess.run([REF_PY, REPO / "tests" / "convert" / "helpers" / "hf_load_check.py", *args], capture_output=True,
                        text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert len(results) == 2
  for r in results:
    assert r["missing"] == [] and r["unexpected"] == [] and r["mismatched"] == [], r
    assert r["max_abs_logits"] < ATOL, r


# ------------------------------------------------------------------------------------------------
# Bad input: a clear one-line error naming the culprit, exit 2, nothing at output_path
# ------------------------------------------------------------------------------------------------

def _copy_dense(dst: pathlib.Path, edit=None, cfg_edit=None) -> pathlib.Path:
  dst.mkdir()
  tensors = load_file(DENSE / "model.safetensors")
  if edit:
    edit(tensors)
  save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  cfg = json.loads((DENSE / "config.json").read_text())
  if cfg_edit:
    cfg_edit(cfg)
  (dst / "config.json").write_text(json.dumps(cfg))
  return dst


def _expect_failure(tmp_path, argv, *needles, capsys):
  out = tmp_path / "out"
  rc = cc.main([*map(str, argv), f"output_path={out}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2
  assert len(err) == 1 and err[0].startswith("error: "), err
  for needle in needles:
    assert needle in err[0], err[0]
  assert not out.exists() and not list(tmp_path.glob(".out*")), sorted(os.listdir(tmp_path))
  return err[0]


def test_missing_tensor(tmp_path, capsys):
  src = _copy_dense(tmp_path / "src", edit=lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"))
  _expect_failure(tmp_path, [f"hf_model_path={src}"], "missing tensor model.layers.2.self_attn.kv_b_proj.weight",
                  capsys=capsys)


def test_unexpected_tensor(tmp_path, capsys):
  def add(t):
    t["model.layers.5.self_attn.q_proj.weight"] = np.zeros((2, 2), np.float32)
  src = _copy_dense(tmp_path / "src", edit=add)
  _expect_failure(tmp_path, [f"hf_model_path={src}"], "unexpected tensor model.layers.5.self_attn.q_proj.weight",
                  "model.safetensors", capsys=capsys)


def test_wrong_shape(tmp_path, capsys):
  def bad(t):
    t["model.layers.1.block_sparse_moe.experts.3.w2.weight"] = np.zeros((64, 31), np.float32)
  src = _copy_dense(tmp_path / "src", edit=bad)
  _expect_failure(tmp_path, [f"hf_model_path={src}"], "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                  "[64, 31]", "expected [64, 32]", capsys=capsys)


def test_unconvertible_dtype(tmp_path, capsys):
  def bad(t):
    t["model.norm.weight"] = np.ones(64, np.int32)
  src = _copy_dense(tmp_path / "src", edit=bad)
  _expect_failure(tmp_path, [f"hf_model_path={src}"], "model.norm.weight", "I32", "cannot be converted", capsys=capsys)


def test_truncated_file(tmp_path, capsys):
  src = _copy_dense(tmp_path / "src")
  f = src / "model.safetensors"
  os.truncate(f, f.stat().st_size - 100)
  _expect_failure(tmp_path, [f"hf_model_path={src}"], str(f), "truncated or corrupt", capsys=capsys)


def test_corrupt_header(tmp_path, capsys):
  src = _copy_dense(tmp_path / "src")
  (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json header}" + b"\0" * 64)
  _expect_failure(tmp_path, [f"hf_model_path={src}"], "model.safetensors", "not a readable safetensors file",
                  capsys=capsys)


def test_missing_shard(tmp_path, capsys):
  src = tmp_path / "src"
  shutil.copytree(SHARDED, src)
  (src / "model-00002-of-00003.safetensors").unlink()
  _expect_failure(tmp_path, [f"hf_model_path={src}"], "model-00002-of-00003.safetensors", "does not exist",
                  capsys=capsys)


def test_pickle_refused(tmp_path, capsys):
  src = tmp_path / "src"
  src.mkdir()
  shutil.copy(DENSE / "config.json", src)
  (src / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
  _expect_failure(tmp_path, [f"hf_model_path={src}"], "pytorch_model.bin", "refused", capsys=capsys)


@pytest.mark.parametrize("edit,needles", [
    (lambda c: c.update(model_type="llama"), ("model_type='llama'", "kimi_linear")),
    (lambda c: c.pop("kv_lora_rank"), ("lacks required key", "kv_lora_rank")),
    (lambda c: c.update(layer_types=["full_attention"] * 5), ("layer_types", "contradicts linear_attn_config")),
    (lambda c: c.update(linear_head_dim=8), ("linear_head_dim=8", "linear_attn_config.head_dim=16")),
    (lambda c: c.update(num_experts_per_tok=3), ("num_experts_per_token=2", "num_experts_per_tok=3")),
    (lambda c: c["linear_attn_config"].update(kda_layers=[1, 2, 9]), ("kda_layers", "outside")),
    (lambda c: c.update(tie_word_embeddings=True), ("tie_word_embeddings",)),
    (lambda c: c.update(mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"]), ("mlp_layer_types",)),
], ids=["model_type", "missing_key", "layer_types", "head_dim", "alias_conflict", "layer_range", "tied",
        "mlp_layout"])
def test_bad_config(tmp_path, capsys, edit, needles):
  src = _copy_dense(tmp_path / "src", cfg_edit=edit)
  _expect_failure(tmp_path, [f"hf_model_path={src}"], "config.json", *needles, capsys=capsys)


def test_bad_arguments(tmp_path, capsys):
  _expect_failure(tmp_path, [f"hf_model_path={DENSE}", "weight_dtype=float16"], "weight_dtype", "auto, float32, "
                  "bfloat16", capsys=capsys)
  _expect_failure(tmp_path, [f"hf_model_path={DENSE}", "dirction=to_hf"], "unknown argument 'dirction'",
                  capsys=capsys)
  _expect_failure(tmp_path, [f"hf_model_path={tmp_path / 'nope'}"], "not a directory", capsys=capsys)
  _expect_failure(tmp_path, ["direction=to_hf", f"load_parameters_path={tmp_path / 'nope'}"], "does not exist",
                  capsys=capsys)
  assert cc.main(["hf_model_path=x"]) == 2 and "output_path" in capsys.readouterr().err


def test_tokenizer_must_fit_the_model(tmp_path, capsys):
  """tokenizer_path is copied into the checkpoint only when it is a sentencepiece model that fits the config."""
  from tools.demo import ASSETS
  text = tmp_path / "notes.txt"
  text.write_text("not a tokenizer\n")
  _expect_failure(tmp_path, [f"hf_model_path={DENSE}", f"tokenizer_path={text}"], "notes.txt", capsys=capsys)
  _expect_failure(tmp_path, [f"hf_model_path={DENSE}", f"tokenizer_path={ASSETS / 'tokenizer.model'}"],
                  "tokenizer_path=", "has 1024 tokens but vocab_size=512", capsys=capsys)


def test_existing_output(converted, tmp_path, capsys):
  out = tmp_path / "out"
  shutil.copytree(converted["sharded"], out)
  before = (out / "config.json").read_text()
  assert cc.main([f"hf_model_path={DENSE}", f"output_path={out}"]) == 2
  assert "already exists; pass overwrite=true" in capsys.readouterr().err
  assert (out / "config.json").read_text() == before
  assert cc.main([f"hf_model_path={DENSE}", f"output_path={out}", "overwrite=true"]) == 0
  assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
  assert sorted(os.listdir(tmp_path)) == ["out"]
  # A directory that is not a checkpoint is never replaced.
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep")
  assert cc.main([f"hf_model_path={DENSE}", f"output_path={tmp_path / 'mine'}", "overwrite=true"]) == 2
  assert "not a checkpoint directory" in capsys.readouterr().err
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
  # An output that cannot be created is refused before anything is read (/sys takes no new entries,
  # root included), and so is one under a file.
  for target, msg in (("/sys/kda_out", "error: output_path '/sys/kda_out': cannot create a directory in '/sys'"),
                      (tmp_path / "mine" / "notes.txt" / "out", "is a file, not a directory")):
    assert cc.main([f"hf_model_path={DENSE}", f"output_path={target}"]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err


def test_cli_help_and_clean_error():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", "--help"], cwd=REPO, capture_output=True,
                        text=True, env=env, timeout=120)
  assert proc.returncode == 0
  for key in cc.KEYS:
    assert key in proc.stdout
  proc = subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", "hf_model_path=/nonexistent",
                         "output_path=/tmp/never"], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.strip() == "error: hf_model_path '/nonexistent' is not a directory"
  assert "Traceback" not in proc.stderr


def test_released_style_config_maps_to_48b():
  """A config.json in the released checkpoints' style (Moonshot keys, `torch_dtype`, `auto_map`,
  RoPE keys that NoPE MLA ignores) maps onto configs/kimi_linear_48b_a3b.py; the table then lists
  the 20,493 HF tensors / 603 parameters that model/README.md counts."""
  from model.config import load_config
  full = [4, 8, 12, 16, 20, 24, 27]
  hf = {"architectures": ["KimiLinearForCausalLM"], "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
        "model_type": "kimi_linear", "torch_dtype": "bfloat16", "vocab_size": 163840, "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": None, "tie_word_embeddings": False, "use_cache": True, "model_max_length": 1048576,
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "linear_attn_config": {"kda_layers": [i for i in range(1, 28) if i not in full], "full_attn_layers": full,
                               "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8,
        "num_shared_experts": 1, "moe_intermediate_size": 1024, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "num_nextn_predict_layers": 0}
  cfg, ignored = hl.config_from_hf(hf, name="kimi-linear-48b-a3b", weight_dtype="bfloat16")
  assert ignored == []
  ref = load_config(["kimi-linear-48b-a3b"])
  arch = [k for k in ref if k not in ("max_cache_length", "dtype", "load_parameters_path", "tokenizer_path",
                                      "model_name") and not k.startswith(("ici_", "logical_", "distributed_",
                                                                          "coordinator_", "num_processes", "process_id"))]
  assert {k: cfg[k] for k in arch} == {k: ref[k] for k in arch}
  table = conversion.parameter_table(cfg)
  assert len(table) == 603 and sum(len(e.hf_names) for e in table) == 20493
  assert sum(int(np.prod(e.shape)) for e in table) == 49_122_681_728


def test_out_of_memory_is_one_error_line(tmp_path, capsys, monkeypatch):
  """XLA's RESOURCE_EXHAUSTED during a conversion (simulated: the Orbax write raises it, nothing is
  allocated) is one `error:` line in the shared wording (tools.cli), exit 2, nothing written;
  on an accelerator it points to JAX_PLATFORMS=cpu. Any other runtime error is not hidden."""
  xla = "RESOURCE_EXHAUSTED: Out of memory allocating 987654321 bytes."

  def oom(self, piece):
    raise jax.errors.JaxRuntimeError(xla + "\nmore detail")
  monkeypatch.setattr(ck.ParameterWriter, "write", oom)

  def fails():  # the progress bar may have drawn on stderr before: the error is the last line, alone
    out = tmp_path / "out"
    assert cc.main([f"hf_model_path={DENSE}", f"output_path={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    assert not out.exists() and not list(tmp_path.glob(".out*")), sorted(os.listdir(tmp_path))
    return err[-1]
  err = fails()
  assert err == (f"error: out of memory ({xla}): run it on a machine with more memory (the largest tensor, e.g. "
                 f"one layer's stacked experts, must fit); nothing was written to the output path"), err
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  err = fails()
  assert err == (f"error: out of memory ({xla}): run it with JAX_PLATFORMS=cpu (the conversion needs no "
                 f"accelerator; host memory is larger); nothing was written to the output path"), err

  def other(self, piece):
    raise jax.errors.JaxRuntimeError("INTERNAL: not a memory error")
  monkeypatch.setattr(ck.ParameterWriter, "write", other)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    cc.main([f"hf_model_path={DENSE}", f"output_path={tmp_path / 'out'}"])
  assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# dtype-exact conversion (weight_dtype=auto keeps F16 / BF16 / F32 / F64 bit for bit)
# ------------------------------------------------------------------------------------------------

def _write_source_in(dst: pathlib.Path, dtype) -> dict[str, np.ndarray]:
  """The dense fixture with every tensor stored as `dtype`. The float64 copy gets low-order bits a
  float32 cannot hold (a narrowing on the way is then visible in the bytes)."""
  dst.mkdir()
  tensors = {}
  for k, v in load_file(DENSE / "model.safetensors").items():
    a = v.astype(dtype)
    if np.dtype(dtype) == np.float64:
      a = a * (1.0 + 2.0**-40)
    tensors[k] = a
  save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  (dst / "config.json").write_text((DENSE / "config.json").read_text())
  return tensors


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64],
                         ids=["F16", "BF16", "F32", "F64"])
def test_round_trip_keeps_every_dtype_bit_exact(tmp_path, dtype, capsys):
  src = _write_source_in(tmp_path / "src", dtype)
  assert cc.main([f"hf_model_path={tmp_path / 'src'}", f"output_path={tmp_path / 'ck'}"]) == 0
  assert "every tensor in its stored dtype" in capsys.readouterr().out
  stored = ck.stored_parameters(tmp_path / "ck")
  assert {d for _, d in stored.values()} == {np.dtype(dtype)}
  assert cc.main(["direction=to_hf", f"load_parameters_path={tmp_path / 'ck'}", f"output_path={tmp_path / 'hf'}"]) == 0
  assert "every tensor in its stored dtype" in capsys.readouterr().out
  out = _hf_tensors(tmp_path / "hf")
  src = {_DENSE_ALIAS.get(k, k): v for k, v in src.items()}
  assert sorted(src) == sorted(out)
  for k in src:
    assert (src[k].dtype, src[k].shape) == (out[k].dtype, out[k].shape), k
    assert src[k].tobytes() == out[k].tobytes(), k


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["F16", "F64"])
def test_f16_and_f64_parameters_load_cast_to_the_compute_dtype(tmp_path, dtype, forward):
  """An F16/F64-stored checkpoint loads with float32 parameters equal to the stored values cast to
  float32 (numpy's cast is the oracle), and its logits match the float32 checkpoint of the same values."""
  src = _write_source_in(tmp_path / "src", dtype)
  _run([f"hf_model_path={tmp_path / 'src'}", f"output_path={tmp_path / 'ck'}"])
  model, cfg = loading.load_model(tmp_path / "ck")
  assert cfg.weight_dtype == "float32"
  got = np.asarray(model.lm_head.kernel.get_value())
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, src["lm_head.weight"].T.astype(np.float32))
  # The same values stored as float32: identical parameters, hence identical logits.
  f32 = tmp_path / "f32"
  f32.mkdir()
  save_file({k: v.astype(np.float32) for k, v in src.items()}, f32 / "model.safetensors", metadata={"format": "pt"})
  (f32 / "config.json").write_text((DENSE / "config.json").read_text())
  _run([f"hf_model_path={f32}", f"output_path={tmp_path / 'ck32'}"])
  ref_model, _ = loading.load_model(tmp_path / "ck32")
  ids = np.load(DENSE / "reference.npz")["input_ids"]
  np.testing.assert_array_equal(forward(model, ids), forward(ref_model, ids))


def test_explicit_weight_dtype_casts_and_says_so(tmp_path, capsys):
  _write_source_in(tmp_path / "src", np.float16)
  assert cc.main([f"hf_model_path={tmp_path / 'src'}", f"output_path={tmp_path / 'ck'}", "weight_dtype=float32"]) == 0
  out = capsys.readouterr().out
  assert "cast " in out and "F16 -> float32" in out, out
  assert {d for _, d in ck.stored_parameters(tmp_path / "ck").values()} == {np.dtype(np.float32)}
  assert cc.main(["direction=to_hf", f"load_parameters_path={tmp_path / 'ck'}", f"output_path={tmp_path / 'hf'}",
                  "weight_dtype=bfloat16"]) == 0
  out = capsys.readouterr().out
  assert "F32 -> bfloat16" in out, out


def test_a_project_checkpoint_as_hf_model_path_points_to_to_hf(tmp_path, capsys):
  demo = REPO / "kda_plugin" / "assets" / "demo"
  _expect_failure(tmp_path, [f"hf_model_path={demo}"], f"hf_model_path={demo} is a checkpoint of this project",
                  f"pass direction=to_hf load_parameters_path={demo} output_path=DIR", capsys=capsys)
  empty = tmp_path / "empty"   # an HF config, no weights
  empty.mkdir()
  shutil.copy(DENSE / "config.json", empty / "config.json")
  _expect_failure(tmp_path, [f"hf_model_path={empty}"], f"hf_model_path={empty} holds no model.safetensors",
                  capsys=capsys)
