"""8 simulated devices: sharded init, checkpoints saved under one mesh restored under another (and
on one device) with identical values, converted Hugging Face checkpoints restored sharded, and the
Generator serving on a mesh.

Run by tests/sharding/test_multidevice.py (in a subprocess: the device count is fixed per process).
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from model import loading, partitioning
from model.checkpoint import format as checkpointing
from model.nn.kimi_linear import KimiLinearForCausalLM
from tests.sharding.multidevice import common as c

c.require_devices()

FIXTURE = pathlib.Path(__file__).parents[2] / "fixtures" / "hf_tiny_dense_moe"


def _flat(model_or_state):
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
  return {path: v.get_value() for path, v in nnx.to_flat_state(state)}


def _assert_identical(got, want):
  assert got.keys() == want.keys()
  for path in want:
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]), err_msg=str(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A checkpoint written from a model initialised sharded on fsdp2 x tensor2 x data2."""
  cfg = c.config(*c.MESHES["fsdp2_tensor2_data2"])
  mesh = partitioning.create_mesh(cfg)
  model = loading.init_sharded(cfg, mesh)
  path = tmp_path_factory.mktemp("ckpt") / "params"
  checkpointing.save_parameters(path, model, cfg)
  return path, cfg, model


def test_sharded_init_equals_the_one_device_init(saved):
  """The same random draws as the one-device init. Threefry bits and uniforms are bit-identical
  whatever the partitioning; the normal initialiser's erf_inv may differ by up to 2 ulp, because
  XLA:CPU vectorises an elementwise loop differently for a [16, 4] shard than for [32, 8] (checked:
  `jax.random.bits`/`uniform` identical, `jax.lax.erf_inv` of identical inputs 2 ulp apart)."""
  _, cfg, model = saved
  one = dict(_flat(KimiLinearForCausalLM(c.config(*c.ONE_DEVICE))))
  got = _flat(model)
  assert got.keys() == one.keys()
  for path in one:
    np.testing.assert_array_max_ulp(np.asarray(got[path]), np.asarray(one[path]), maxulp=2)
  q = model.model.layers[0].self_attn.q_proj.kernel.get_value()
  assert q.addressable_shards[0].data.shape == (q.shape[0] // 2, q.shape[1] // 2)  # fsdp x tensor


@pytest.mark.parametrize("target", ["tensor8", "expert4_data2"])
def test_checkpoint_from_one_mesh_restores_under_another(saved, target):
  path, _, model = saved
  restored, cfg, mesh = loading.load(path, c.MESHES[target])
  assert dict(mesh.shape) == partitioning.mesh_shape(cfg, c.DEVICES)
  _assert_identical(_flat(restored), _flat(model))
  # Born sharded on the new mesh: each device holds only its slice.
  if target == "tensor8":
    q = restored.model.layers[0].self_attn.q_proj.kernel.get_value()
    assert q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // 8)
  else:
    w1 = restored.model.layers[1].block_sparse_moe.experts.w1.get_value()
    assert w1.addressable_shards[0].data.shape == (w1.shape[0] // 4,) + w1.shape[1:]


def test_checkpoint_from_a_mesh_restores_on_one_device(saved):
  path, _, model = saved
  restored, _ = loading.load_model(path, list(c.ONE_DEVICE))
  _assert_identical(_flat(restored), _flat(model))


@pytest.mark.slow
def test_converted_hf_checkpoint_restores_sharded(tmp_path):
  """tools.convert_checkpoint output, restored on fsdp2 x expert2 x tensor2 (2 heads, 4 experts):
  the same parameters as the one-device load, and the same logits."""
  from tools import convert_checkpoint
  out = tmp_path / "converted"
  convert_checkpoint.convert([f"hf_model_path={FIXTURE}", f"output_path={out}"])
  mesh_keys = ("ici_data_parallelism=1", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2",
               "ici_tensor_parallelism=2", "attention=kda_reference")
  model, cfg, mesh = loading.load(out, mesh_keys)
  one, _ = loading.load_model(out, ["attention=kda_reference"])
  _assert_identical(_flat(model), _flat(one))
  w1 = model.model.layers[1].block_sparse_moe.experts.w1.get_value()
  assert w1.addressable_shards[0].data.shape == (w1.shape[0] // 2, w1.shape[1] // 2, w1.shape[2] // 2)
  ids = np.random.default_rng(1).integers(3, cfg.vocab_size, (2, 10)).astype(np.int32)
  seg = np.array([[1] * 6 + [2] * 4, [1] * 8 + [0] * 2], np.int32)
  fwd = lambda m, i, s: m(i, s, mode="eval", max_num_segments=2)
  want = jax.jit(fwd)(one, ids, seg)
  with partitioning.mesh_context(mesh, cfg):
    got = jax.jit(fwd)(model, ids, seg)
  c.assert_close(got, want, "converted checkpoint logits")


@pytest.mark.slow   # the tools on the mesh: `make test-slow` (tests/sharding/test_multidevice.py)
def test_generate_tool_serves_on_the_mesh(saved, tmp_path, capsys):
  """tools.generate on 8 devices (default mesh: data=-1 -> 8, the checkpoint's own mesh keys are
  ignored): restored sharded, the same greedy ids as a one-device Generator."""
  import json

  from model.engine.generator import Generator
  from tools import generate
  path, _, _ = saved
  out = tmp_path / "gen.json"
  rc = generate.main([f"load_parameters_path={path}", "prompts_file=" + str(_ids_file(tmp_path)), "max_new_tokens=4",
                      "generate_batch_size=8", "prefill_length_multiple=16", "decode_stop_at_eos=false",
                      f"output_json={out}"])
  assert rc in (0, None)
  assert "serving on mesh data=8 fsdp=1 expert=1 tensor=1 (8 devices, 1 process)" in capsys.readouterr().err
  got = [r["generated_ids"] for r in json.loads(out.read_text())["results"]]
  model, cfg = loading.load_model(path, list(c.ONE_DEVICE))
  gen = Generator(model, max_length=cfg.max_cache_length, eos_id=None, batch_size=8, prefill_multiple=16,
                  cache_multiple=16)
  want = [r.token_ids for r in gen.generate(PROMPTS, 4)[0]]
  assert got == want


PROMPTS = [[5 + i, 9, 11 + i, 3] for i in range(8)]


def _ids_file(tmp_path):
  f = tmp_path / "prompts.txt"
  f.write_text("\n".join(" ".join(map(str, p)) for p in PROMPTS) + "\n")
  return f


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["fsdp2_tensor2_data2", "data8"])
def test_perplexity_tool_scores_on_the_mesh(saved, tmp_path, capsys, mesh_name):
  """tools.perplexity under the job's mesh keys: parameters restored sharded, windows of 4 rows split
  on data x fsdp (data8: 4 rows do not divide 8, so they are replicated), documents longer than a
  window carried across windows; every per-token log-prob and the perplexity equal a one-device
  Scorer's on the same checkpoint."""
  import json

  from model.engine.scoring import Scorer
  from tools import perplexity
  path, _, _ = saved
  rng = np.random.default_rng(3)
  docs = [rng.integers(3, 64, n).tolist() for n in (5, 19, 2, 11, 30, 7, 13, 4, 9)]
  data = tmp_path / "docs.txt"
  data.write_text("\n".join(" ".join(map(str, d)) for d in docs) + "\n")
  out = tmp_path / "ppl.json"
  rc = perplexity.main([f"load_parameters_path={path}", f"eval_data={data}", "eval_format=ids",
                        "max_target_length=8", "eval_batch_size=4", "prefill_length_multiple=16",
                        "dump_logprobs=true", f"output_json={out}", *c.MESHES[mesh_name]])
  assert rc == 0
  sizes = dict(zip(("data", "fsdp", "expert", "tensor"), c.SIZES[mesh_name]))
  want_mesh = " ".join(f"{a}={n}" for a, n in sizes.items())
  assert f"scoring on mesh {want_mesh} (8 devices, 1 process)" in capsys.readouterr().err
  got = json.loads(out.read_text())
  model, cfg = loading.load_model(path, list(c.ONE_DEVICE))
  ref = Scorer(model, seq_len=8, batch_size=4, num_slots=cfg.max_num_segments, cache_multiple=16).score(docs)
  assert got["num_windows"] == ref.num_windows > 2  # long documents continue across windows
  assert got["num_tokens"] == ref.num_tokens == sum(len(d) - 1 for d in docs)
  for i, d in enumerate(got["documents"]):
    assert d["token_ids"] == docs[i]
    c.assert_close(d["logprobs"], ref.logprobs[i], f"document {i} log-probs")
  print(f"{mesh_name}: perplexity {got['perplexity']!r} vs one device {ref.perplexity!r}")
  assert abs(got["perplexity"] - ref.perplexity) <= 1e-5 * ref.perplexity, (got["perplexity"], ref.perplexity)


def test_megablox_is_refused_on_the_mesh_before_anything_runs(saved, tmp_path, capsys):
  """moe_impl=megablox on the 8 devices (the default mesh: data=8), whose Pallas kernel GSPMD cannot
  partition: a checkpoint load and the generate and train tools refuse it in one line naming
  moe_impl and what to use instead, before a parameter is read or a run directory made. On one
  device the same checkpoint loads with it."""
  from model.errors import ConfigError
  from tools import generate, train
  path, _, _ = saved
  with pytest.raises(ConfigError, match=r"^moe_impl=megablox needs one device: .* 8 devices \(ici_data_parallelism=-1 "
                                       r"\(the devices left: 8\)\); use moe_impl=auto"):
    loading.load(path, ["moe_impl=megablox"])
  assert generate.main([f"load_parameters_path={path}", "prompt_ids=5,9", "moe_impl=megablox"]) == 2
  data, out = tmp_path / "ids.txt", tmp_path / "run"
  data.write_text("5 9 11 3\n7 8 9\n")
  assert train.main([*c.BASE, "moe_impl=megablox", f"train_data={data}", "train_data_format=ids",
                     f"output_dir={out}"]) == 2
  errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
  assert len(errors) == 2, errors
  for line in errors:
    assert line.startswith("error: moe_impl=megablox needs one device") and "use moe_impl=auto" in line, line
  assert not out.exists()
  loaded = loading.load(path, ["moe_impl=megablox", *c.ONE_DEVICE], mesh=None)
  assert loaded.config.moe_impl == "megablox" and loaded.mesh is None
