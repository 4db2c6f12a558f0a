"""One cell of the Kimi-Linear-48B-A3B table (docs/performance.md, docs/aot_48b_compiles.json),
recompiled with tools.aot_compile for a real v5p topology: decode of 64 sequences with 8192-token
caches on v5p:2x2x1 (4 chips, expert=4), the scanned layers' parameters stacked at load.

Slow (about 2-3 minutes of libtpu compile, ~1 GiB host RSS): `make test-slow` only. The argument bytes
are checked against the bytes the config implies (counted on the CPU from the abstract model,
independently of the compiler), the verdict against the totals, and every per-device figure against
the table's record of the same command (libtpu 0.0.52 is deterministic: a change means the table is
stale).
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import pytest

from model import loading
from model.config import load_config

pytestmark = [pytest.mark.aot, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = "v5p4_decode_stacked"
V5P_USABLE_HBM = 102789304812  # libtpu 0.0.52's 95.73 GiB per v5p device (model.aot.usable_hbm_bytes)
GIB = 2**30


def _record():
  recs = {r["name"]: r for r in json.loads((ROOT / "docs" / "aot_48b_compiles.json").read_text())}
  return recs[RECORD]


def test_48b_decode_on_v5p_2x2x1_matches_the_table(tpu_aot, tmp_path):
  rec = _record()
  args = rec["command"].split("kimi_linear_48b_a3b", 1)[1].split()
  report = tpu_aot.run("tools.aot_compile", "kimi_linear_48b_a3b", *args, timeout=1500)
  m = report["memory"]
  assert report["topology"] == "v5p:2x2x1" and report["num_devices"] == 4 and report["stacked_params"]
  assert report["mesh"] == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 1}
  assert m["hbm_bytes"] == V5P_USABLE_HBM and not m["refused_by_compiler"]
  assert m["total_bytes"] == m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
  assert m["fits"] and report["verdict"].startswith("fits: ")
  # Independent oracle for the arguments: the expert weights [E, ...] split 4 ways, every other
  # parameter whole on each device (data = fsdp = tensor = 1), plus the donated cache, replicated
  # (model/nn/cache.py): MLA latents [64, 8192, 640] bf16 per MLA layer (512 + 64 padded); KDA state
  # [64, 32, 128, 128] and three conv windows [64, W - 1, 32 * 128] float32 per KDA layer.
  cfg = load_config(["kimi_linear_48b_a3b"])
  params = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(loading.abstract_model(cfg)):
    n = math.prod(leaf.shape) * leaf.dtype.itemsize
    params += n // 4 if "experts" in jax.tree_util.keystr(path) and leaf.shape[0] == cfg.num_experts else n
  lanes = 128  # the latent's columns padded to whole 128-lane tiles (`MultiHeadLatentAttention.latent_width`)
  width = -(-(cfg.kv_lora_rank + cfg.qk_rope_head_dim) // lanes) * lanes
  mla = len(cfg.full_attn_layers) * 64 * 8192 * width * 2
  hk = cfg.kda_num_heads * cfg.kda_head_dim
  kda = len(cfg.kda_layers) * 64 * (hk * cfg.kda_head_dim + 3 * (cfg.kda_conv_kernel_size - 1) * hk) * 4
  want = params + mla + kda
  assert want <= m["argument_bytes"] <= 1.01 * want, (m, params, mla, kda)  # TPU tiles pad a little
  # The table's figures, to the byte's GiB rounding of the record.
  got = {"arguments": m["argument_bytes"], "outputs": m["output_bytes"], "temporaries": m["temp_bytes"],
         "total": m["total_bytes"]}
  for key, value in got.items():
    assert abs(value / GIB - rec["per_device_gib"][key]) < 0.0015, (key, value / GIB, rec["per_device_gib"])
