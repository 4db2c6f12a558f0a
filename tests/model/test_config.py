"""Config loading, overrides, validation and serialisation; the 48B config's real size."""

import jax
import numpy as np
import pytest
from flax import nnx

from model.config import ConfigError, ModelArgs, config_from_json, config_to_json, load_config


def test_overrides_parse_every_type():
  cfg = load_config(["tiny", "hidden_size=48", "rms_norm_eps=2e-5", "norm_topk_prob=false",
                     "attention=kda_reference", "kda_layers=[1,2,3]", "full_attn_layers=[4]",
                     "q_lora_rank=16", "kda_gate_lower_bound=-3"])
  assert cfg.hidden_size == 48 and isinstance(cfg.hidden_size, int)
  assert cfg.rms_norm_eps == 2e-5
  assert cfg.norm_topk_prob is False
  assert cfg.attention == "kda_reference"
  assert list(cfg.kda_layers) == [1, 2, 3] and list(cfg.full_attn_layers) == [4]
  assert cfg.q_lora_rank == 16 and cfg.kda_gate_lower_bound == -3.0
  assert load_config(["tiny", "q_lora_rank=none"]).q_lora_rank is None
  assert ModelArgs.from_config(cfg).layer_types == ("kda", "kda", "kda", "mla")


def test_none_on_a_string_key_is_unset_or_the_word_it_is_a_value_of():
  """README: `none` for unset. A string key whose default is "" takes it as "" (tokenizer_path=none was
  refused); where "none" is one of the key's values it is that value (remat_policy=none, not the default, was
  refused on the command line)."""
  cfg = load_config(["tiny", "tokenizer_path=none", "output_json=None", "remat_policy=none", "split_long=none"])
  assert (cfg.tokenizer_path, cfg.output_json, cfg.remat_policy, cfg.split_long) == ("", "", "none", "none")
  for name in ("full", "nothing_saveable", "minimal", "dots_saveable"):   # README's list, alias included
    assert load_config(["tiny", f"remat_policy={name}"]).remat_policy == name
  with pytest.raises(ConfigError, match="remat_policy must be one of none, full, nothing_saveable"):
    load_config(["tiny", "remat_policy=everything"])


def test_real_layer_layout_is_one_indexed():
  a = ModelArgs.from_config(load_config(["kimi-linear-48b-a3b"]))
  assert [i for i, t in enumerate(a.layer_types) if t == "mla"] == [3, 7, 11, 15, 19, 23, 26]


def test_unknown_key_suggests_close_names():
  with pytest.raises(ConfigError, match=r"unknown config key 'hiden_size'.*hidden_size"):
    load_config(["tiny", "hiden_size=3"])


def test_unknown_config_name():
  with pytest.raises(ConfigError, match=r"unknown model config 'tinny'.*tiny"):
    load_config(["tinny"])


@pytest.mark.parametrize("override, pattern", [
    ("hidden_size=abc", r"hidden_size expects int, got 'abc'"),
    ("hidden_size=2.5", r"hidden_size expects int"),
    ("norm_topk_prob=yes", r"norm_topk_prob expects bool"),
    ("kda_layers=1,3", r"kda_layers expects a list"),
    ("kda_layers=[1,x]", r"kda_layers\[1\] expects int"),
    ("hidden_size=none", r"hidden_size cannot be none; it expects int"),
])
def test_wrong_type_names_key_and_type(override, pattern):
  with pytest.raises(ConfigError, match=pattern):
    load_config(["tiny", override])


@pytest.mark.parametrize("overrides, pattern", [
    (["num_hidden_layers=5"], r"layers \[5\] are in neither"),
    (["kda_layers=[1,2,3]"], r"layers \[2\] are in both"),
    (["kda_layers=[1,3,5]"], r"kda_layers holds \[5\], outside 1..num_hidden_layers=4"),
    # Only num_hidden_layers changed: the error names both lists to change with it.
    (["num_hidden_layers=2"], r"outside 1..num_hidden_layers=2 .*kda_layers and full_attn_layers together must "
                              r"cover exactly 1..2: set both with num_hidden_layers"),
    (["num_hidden_layers=5"], r"neither kda_layers nor full_attn_layers.*set both with num_hidden_layers"),
    (["kda_layers=[0,1,3]"], r"kda_layers holds \[0\]"),
    (["kda_layers=[1,1,3]"], r"kda_layers lists layers \[1\] more than once"),
])
def test_layer_lists_must_cover_layers_exactly(overrides, pattern):
  with pytest.raises(ConfigError, match=pattern):
    load_config(["tiny", *overrides])


def test_json_round_trip_and_checks():
  cfg = load_config(["demo", "dtype=bfloat16", "q_lora_rank=32"])
  back = config_from_json(config_to_json(cfg))
  assert back.to_dict() == cfg.to_dict()
  with pytest.raises(ConfigError, match="unknown config key 'hidden'"):
    config_from_json('{"hidden": 3}')
  with pytest.raises(ConfigError, match="vocab_size expects int"):
    config_from_json('{"vocab_size": "big"}')


def test_config_file_paths(tmp_path):
  path = tmp_path / "mine.json"
  path.write_text(config_to_json(load_config(["tiny", "vocab_size=99"])))
  assert load_config([str(path), "hidden_size=16"]).vocab_size == 99
  py = tmp_path / "mine.py"
  py.write_text("from configs import tiny\ndef get_config():\n  c = tiny.get_config()\n  c.vocab_size = 77\n  return c\n")
  assert load_config([str(py)]).vocab_size == 77


@pytest.mark.parametrize("name,body,says", [
    ("bad.json", "{bad json", "is not valid JSON: Expecting property name"),
    ("latin1.json", b'{"model_name": "caf\xe9"}', "is not valid JSON: 'utf-8' codec"),
    ("bad.py", "x = (\n", "is not valid Python: "),
])
def test_unreadable_config_files_name_the_file(tmp_path, name, body, says):
  path = tmp_path / name
  (path.write_bytes if isinstance(body, bytes) else path.write_text)(body)
  with pytest.raises(ConfigError) as e:
    load_config([str(path)])
  assert str(e.value).startswith(f"config file {str(path)!r} {says}"), str(e.value)


def test_48b_config_has_the_published_size():
  """49,122,681,728 parameters in 20,493 HF tensors (kda.md section 5), counted without allocation;
  the HF checkpoint stores each of the 26 x 256 experts' w1/w2/w3 separately, we stack them."""
  from model.nn.kimi_linear import KimiLinearForCausalLM
  cfg = load_config(["kimi-linear-48b-a3b", "attention=kda_reference"])
  leaves = jax.tree_util.tree_leaves(nnx.state(nnx.eval_shape(lambda: KimiLinearForCausalLM(cfg))))
  assert sum(int(np.prod(x.shape)) for x in leaves) == 49_122_681_728
  moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
  assert len(leaves) - 3 * moe_layers + 3 * moe_layers * cfg.num_experts == 20_493


def test_sections_partition_the_keys():
  from configs import base
  from model.config import SECTIONS, section
  cfg = base.get_config()
  keys = {name: set(section(cfg, name)) for name in SECTIONS}
  assert sum(len(k) for k in keys.values()) == len(set().union(*keys.values())) == len(list(cfg.keys()))
  assert {"hidden_size", "attention", "kda_implementation", "tokenizer_path"} <= keys["model"]
  assert {"prompt", "eval_data", "dump_logprobs", "output_json"} <= keys["serving"]
  assert {"train_data", "steps", "output_dir"} <= keys["train"]
  assert {"ici_data_parallelism", "logical_axis_rules", "distributed_init"} <= keys["mesh"]


def test_checkpoint_config_json_holds_the_model_section_only():
  import json

  from model.config import checkpoint_json
  cfg = load_config(["tiny", "prompt=hi", "steps=7", "ici_data_parallelism=1", "hidden_size=48",
                     "compiled_trainstep_file=/tmp/step.bin"])
  stored = json.loads(checkpoint_json(cfg))
  # compiled_trainstep_file was stored (and a fine-tune from the export inherited the earlier job's file)
  assert not {"prompt", "steps", "ici_data_parallelism", "dump_logprobs", "train_data",
              "compiled_trainstep_file"} & set(stored)
  assert stored["hidden_size"] == 48 and stored["model_name"] == cfg.model_name
  back = config_from_json(checkpoint_json(cfg))  # tool keys come back as the base defaults
  assert back.hidden_size == 48 and back.prompt == "" and back.steps == load_config([]).steps


def test_shipped_demo_config_json_holds_the_model_section_only():
  """The demo asset follows the same rule as every checkpoint the project writes (issue 14): its
  config.json was re-written from the old all-keys file, and that file's tool keys equal the base
  defaults, so loading the demo gives the same job config as before."""
  import json
  import pathlib

  from model.config import section_of
  path = pathlib.Path(__file__).resolve().parents[2] / "kda_plugin" / "assets" / "demo" / "config.json"
  stored = json.loads(path.read_text())
  assert {k for k in stored if section_of(k) != "model"} == set()
  assert "kda_impl" not in stored and stored["kda_implementation"] == "auto"


def test_kda_impl_is_read_as_kda_implementation():
  import json
  with pytest.warns(DeprecationWarning, match=r"'kda_impl' is deprecated; write kda_implementation=xla"):
    cfg = load_config(["tiny", "kda_impl=xla"])
  assert cfg.kda_implementation == "xla"
  old = json.loads(config_to_json(load_config(["tiny"])))
  old["kda_impl"] = old.pop("kda_implementation")  # a config.json written before the rename
  assert config_from_json(json.dumps(old)).kda_implementation == "auto"
