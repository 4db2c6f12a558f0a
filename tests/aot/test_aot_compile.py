"""tools.aot_compile compiles the 48B layer pattern (configs/kimi_linear_48b_pattern_small.py) for a real
4-chip TPU topology (`v5e:2x2`) with libtpu's compiler, in its compile venv.

Three compiles, one per mode, that together put each of the data, fsdp, tensor and expert mesh axes
at 2 somewhere: train (fsdp=2, expert=2; the pattern's first five layers in make test, all 27 with
scan_layers and remat_policy=full as a slow case), prefill (data=2, tensor=2) and decode (expert=2, tensor=2) with
a batch forced not to fit in v5e's usable 15.75 GiB. The per-device argument bytes are checked
against the bytes the config implies (counted here from the abstract model on the CPU, independently
of the compiler; TPU layouts pad arrays to tiles, so the upper bound pads each array to (8, 128)
tiles), the Mosaic kernel against the prefill program's HLO, and the verdict against the totals.
"""

from __future__ import annotations

import json
import math

import jax
import pytest

from model import loading
from model.config import load_config

pytestmark = pytest.mark.aot

CONFIG = "kimi_linear_48b_pattern_small"
TOPOLOGY = "v5e:2x2"
V5E_USABLE_HBM = round(15.75 * 2**30)  # libtpu 0.0.52's figure (model.aot.usable_hbm_bytes)
DOES_NOT_FIT = 3  # tools.aot_compile's exit status


def _compile(tpu_aot, tmp_path, mode, *overrides, returncodes=(0,)):
  out = tmp_path / f"{mode}.json"
  report = tpu_aot.run("tools.aot_compile", CONFIG, f"compile_topology={TOPOLOGY}", f"mode={mode}", *overrides,
                       f"output_json={out}", timeout=900, returncodes=returncodes)
  return report, json.loads(out.read_text())


def _padded(shape, itemsize) -> int:
  """Bytes of an array in an (8, 128)-tiled TPU layout (sublanes x4 for 16-bit, x8 for 8-bit types):
  an upper bound for any shard of it."""
  sub = 8 * max(1, 4 // itemsize)
  if len(shape) < 2:
    return math.ceil(max(math.prod(shape), 1) / (sub * 128)) * sub * 128 * itemsize
  lead = math.prod(shape[:-2])
  return lead * math.ceil(shape[-2] / sub) * sub * math.ceil(shape[-1] / 128) * 128 * itemsize


def _param_bytes(overrides=()):
  """(logical bytes, tile-padded bytes, config) of the model's parameters."""
  cfg = load_config([CONFIG, *overrides])
  leaves = jax.tree.leaves(loading.abstract_model(cfg))
  return (sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves),
          sum(_padded(x.shape, x.dtype.itemsize) for x in leaves), cfg)


def _check_memory(m):
  assert m["hbm_bytes"] == V5E_USABLE_HBM and not m["refused_by_compiler"]
  assert m["total_bytes"] == m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
  assert m["fits"] == (m["total_bytes"] <= m["hbm_bytes"])
  assert m["margin_bytes"] == m["hbm_bytes"] - m["total_bytes"]


# The first five layers of the pattern (dense KDA, KDA, KDA, MLA, KDA; MoE from layer 2): every layer
# kind of the 48B model in a backward that compiles in make test's budget (120 s wall, 69 s CPU on the
# shared 2-core host). The 27-layer train compile (scanned, remat=full: 242 s wall, 160 s CPU there;
# unrolled it took 355-420 s) is the slow case.
FIVE_LAYERS = ("num_hidden_layers=5", "full_attn_layers=[4]", "kda_layers=[1,2,3,5]")
TRAIN_CASES = [pytest.param(FIVE_LAYERS, id="five_layers"),
               pytest.param(("scan_layers=true", "remat_policy=full"), id="27_layers_scanned",
                            marks=pytest.mark.slow)]


@pytest.mark.parametrize("overrides", TRAIN_CASES)
def test_train_step_compiles_with_fsdp_and_expert_axes(tpu_aot, tmp_path, overrides):
  mesh = ["ici_data_parallelism=1", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2", *overrides]
  report, full = _compile(tpu_aot, tmp_path, "train", *mesh)
  assert report["num_devices"] == 4 and report["device_kind"] == "TPU v5 lite"
  assert report["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}
  m = report["memory"]
  _check_memory(m)
  assert m["fits"] and report["verdict"].startswith("fits")
  params, padded, cfg = _param_bytes(mesh)
  # Arguments: parameters + AdamW mu and nu (3 copies), each split at most 4 ways, plus the batch
  # (ids, labels, segment ids int32 and a bool mask [B, T]) and the step / key / counts.
  batch = 4 * _padded((cfg.batch_size, cfg.seq_len), 4)
  assert 3 * params / 4 <= m["argument_bytes"] <= 3 * padded + batch + 64 * 1024, (m, params, padded)
  # The state is donated: its buffers are reused by the new state, not counted twice.
  assert m["alias_bytes"] >= 3 * params / 4
  assert report["flops_per_device"] > 0 and report["compile_seconds"] > 0
  assert "all-gather" in full["hlo"] or "all-reduce" in full["hlo"]  # fsdp gathers parameters
  # kda_native trains through the Mosaic kernel's forward on a TPU (kda_chunked[pallas_tpu])
  assert "kda_train_fwd_tpu" in full["hlo"]
  if "scan_layers=true" in overrides:
    assert "while" in full["hlo"]  # the scan over the six layer groups


def test_prefill_runs_the_mosaic_kernel_with_data_and_tensor_axes(tpu_aot, tmp_path):
  report, full = _compile(tpu_aot, tmp_path, "prefill", "ici_data_parallelism=2", "ici_tensor_parallelism=2",
                          "scan_layers=true")
  assert report["mesh"] == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 2}
  m = report["memory"]
  _check_memory(m)
  assert m["fits"] and report["verdict"].startswith("fits")
  assert report["has_tpu_custom_call"] and "tpu_custom_call" in full["hlo"]
  params, padded, cfg = _param_bytes()
  ids = 2 * _padded((cfg.batch_size, cfg.seq_len), 4)
  assert params / 4 <= m["argument_bytes"] <= padded + ids, (m, params, padded)


def test_decode_that_cannot_fit_is_reported_not_crashed(tpu_aot, tmp_path):
  batch, length = 262144, 64
  mesh = ["ici_data_parallelism=1", "ici_expert_parallelism=2", "ici_tensor_parallelism=2"]
  report, full = _compile(tpu_aot, tmp_path, "decode", *mesh, "scan_layers=true", f"batch_size={batch}",
                          f"max_cache_length={length}", returncodes=(DOES_NOT_FIT,))
  assert report["mesh"] == {"data": 1, "fsdp": 1, "expert": 2, "tensor": 2}
  m = report["memory"]
  _, _, cfg = _param_bytes(mesh)
  # The cache per device, from the config: sequences are not split (data = fsdp = 1), KDA heads are
  # split over tensor=2; KDA state [S, H, K, K] and three conv windows [S, W-1, H*K] in float32, MLA
  # latents [S, L, r + rope] in float32 (replicated), lengths [S] int32.
  h, k, w = cfg.kda_num_heads // 2, cfg.kda_head_dim, cfg.kda_conv_kernel_size
  kda = len(cfg.kda_layers) * (h * k * k + 3 * (w - 1) * h * k) * 4
  mla = len(cfg.full_attn_layers) * length * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
  cache = batch * (kda + mla + 4)
  assert cache > V5E_USABLE_HBM  # the forced case really cannot fit
  # libtpu refuses it at compile and states one total: at least the cache it must hold.
  assert m["refused_by_compiler"] and "RESOURCE_EXHAUSTED" in m["compiler_message"]
  assert m["hbm_bytes"] == V5E_USABLE_HBM
  assert m["total_bytes"] >= cache and not m["fits"] and m["margin_bytes"] == V5E_USABLE_HBM - m["total_bytes"]
  over = (m["total_bytes"] - V5E_USABLE_HBM) / 2**30
  assert report["verdict"].startswith(f"does not fit in 15.75 GiB usable HBM per TPU v5 lite device (libtpu) "
                                      f"by {over:.2f} GiB")
  assert full["hlo"] is None and report["flops_per_device"] is None


def test_mesh_axis_that_splits_the_torus_is_laid_out_with_a_warning(tpu_aot):
  """tensor=8 on a 4x4 v6e slice is no product of whole torus axes: jax.make_mesh refuses it, and
  create_mesh lays it out with split physical axes, saying so (it crashed the tool before)."""
  out = tpu_aot.run("tests.aot.helpers.mesh_split_check", timeout=300)
  assert out["shape"] == {"data": 1, "fsdp": 2, "expert": 1, "tensor": 8} and out["devices_once"]
  assert len(out["warnings"]) == 1 and "splitting physical axes" in out["warnings"][0]
  assert "ici_tensor_parallelism=8" in out["warnings"][0]
