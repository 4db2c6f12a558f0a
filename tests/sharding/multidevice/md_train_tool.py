"""8 simulated devices: tools.train on a mesh, interrupted (stop_at_step) and resumed on another
mesh, continues like the uninterrupted run (the train state restores into the new shardings).

Run by tests/sharding/test_multidevice.py (marked slow: three training runs).
"""

from __future__ import annotations

import json

import numpy as np

from tests.sharding.multidevice import common as c

c.require_devices()


def _run(tmp_path, out, *keys):
  from tools import train
  data = tmp_path / "ids.txt"
  if not data.exists():
    rng = np.random.default_rng(0)
    data.write_text("\n".join(" ".join(map(str, rng.integers(3, 64, rng.integers(5, 30)))) for _ in range(120)) + "\n")
  args = list(c.BASE) + [f"train_data={data}", "train_data_format=ids", "seq_len=32", "batch_size=8", "steps=4",
                         "warmup_steps=1", "eval_every=0", "log_every=1", "checkpoint_every=2", "adam_eps=1e-3",
                         f"output_dir={tmp_path / out}", *keys]
  assert train.main(args) == 0
  return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]


def test_train_tool_resumes_on_another_mesh(tmp_path):
  mesh_a, mesh_b = c.MESHES["fsdp2_tensor2_data2"], c.MESHES["tensor8"]
  full = _run(tmp_path, "full", *mesh_a)
  _run(tmp_path, "split", *mesh_a, "stop_at_step=2")
  resumed = _run(tmp_path, "split", *mesh_b)
  want = {r["step"]: r["loss"] for r in full if "loss" in r}
  got = {r["step"]: r["loss"] for r in resumed if "loss" in r}
  assert set(got) >= {3, 4}
  for step in (3, 4):
    c.assert_close(got[step], want[step], f"loss at step {step}")
