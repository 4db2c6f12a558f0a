"""tools/bench/decode_profile.py: the HLO text and the profile are read as XLA and jax write them."""

import json

import pytest
from jax.profiler import ProfileData

from tools.bench import decode_profile as dp

# The shape of XLA's module text since the stack-frame tables (jax >= 0.10): tables first, then the
# computations; instructions point at their stack through stack_frame_id, and a frame's caller is the
# frame numbered parent_frame_id - 1 (1: none), as jax 0.10.2 and 0.12 print them. Here: 2 = a Linear
# called from MLA (frame 1), 5 = a Linear called from a SwiGLU (frame 7) called from the MoE block
# (frame 6), 8 = a Linear called from a SwiGLU alone.
HLO = """HloModule jit_decode_loop, is_scheduled=true

FileNames
1 "/repo/model/nn/mla.py"
2 "/site-packages/flax/nnx/nn/linear.py"
3 "/repo/kda_plugin/ops/decode_pallas_tpu.py"
4 "/repo/model/nn/moe.py"
5 "/repo/model/nn/layers.py"

FunctionNames
1 "MultiHeadLatentAttention.decode_latent"
2 "Linear.__call__"
3 "decode_step_tpu"
4 "Experts._megablox"
5 "SparseMoeBlock.__call__"
6 "SwiGLU.__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=321 end_line=321 column=4 end_column=9}
2 {file_name_id=2 function_name_id=2 line=422 end_line=422 column=4 end_column=9}
3 {file_name_id=3 function_name_id=3 line=140 end_line=140 column=4 end_column=9}
4 {file_name_id=4 function_name_id=4 line=312 end_line=312 column=4 end_column=9}
5 {file_name_id=4 function_name_id=5 line=350 end_line=350 column=4 end_column=9}
6 {file_name_id=5 function_name_id=6 line=40 end_line=40 column=4 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=1}
4 {file_location_id=4 parent_frame_id=1}
5 {file_location_id=2 parent_frame_id=8}
6 {file_location_id=5 parent_frame_id=1}
7 {file_location_id=6 parent_frame_id=7}
8 {file_location_id=2 parent_frame_id=10}
9 {file_location_id=6 parent_frame_id=1}

%body {
  %scores_fusion.7 = f32[64,32,1064]{2,1,0:T(8,128)} fusion(%p0, %p1), kind=kOutput, calls=%f7, metadata={op_name="jit(decode_loop)/while/body/dot_general" stack_frame_id=1}
  %proj_fusion.2 = bf16[64,6144]{1,0} fusion(%p2), kind=kOutput, calls=%f2, metadata={op_name="jit(decode_loop)/while/body/dot_general" stack_frame_id=2}
  %custom-call.9 = (bf16[64,32,128]{2,1,0}, f32[64,32,128,128]{3,2,1,0}) custom-call(%a, %b), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "x"}, "kernel_name": "kda_decode_step_tpu"}, metadata={op_name="pallas" stack_frame_id=3}
  %copy-start.1 = (bf16[16,2304,1024]{2,1,0}, bf16[16,2304,1024]{2,1,0:S(1)}, u32[]) copy-start(%w), metadata={op_name="x" stack_frame_id=4}
  %shared_fusion.4 = bf16[64,2304]{1,0} fusion(%p3), kind=kOutput, calls=%f4, metadata={op_name="x" stack_frame_id=8}
  %lone_fusion.5 = bf16[64,2304]{1,0} fusion(%p3), kind=kOutput, calls=%f5, metadata={op_name="x" stack_frame_id=5}
  %gmm.12 = bf16[512,2304]{1,0} custom-call(%x, %w), custom_call_target="tpu_custom_call", metadata={op_name="y" stack_frame_id=4}
  ROOT %while.3 = (s32[], f32[4]) while(%t), condition=%c, body=%b
}
"""


def test_instructions_read_with_their_kind_source_and_part():
  ins = dp.hlo_instructions(HLO)
  assert set(ins) == {"scores_fusion.7", "proj_fusion.2", "custom-call.9", "copy-start.1", "shared_fusion.4",
                      "lone_fusion.5", "gmm.12", "while.3"}
  assert ins["scores_fusion.7"] == {"opcode": "fusion", "shape": "f32[64,32,1064]", "kind": "kOutput",
                                    "op_name": "jit(decode_loop)/while/body/dot_general", "part": "mla",
                                    "source": "nn/mla.py:321 MultiHeadLatentAttention.decode_latent"}
  # a Linear called from the MLA layer: its own frame is flax's, its caller's names the part
  assert ins["proj_fusion.2"]["part"] == "mla"
  assert ins["proj_fusion.2"]["source"] == "nn/linear.py:422 Linear.__call__"
  assert ins["custom-call.9"]["target"] == "tpu_custom_call:kda_decode_step_tpu"
  assert ins["custom-call.9"]["part"] == "kda"
  # without a kernel_name, XLA:TPU's instruction is named after the Pallas kernel
  assert ins["gmm.12"]["target"] == "tpu_custom_call:gmm" and ins["gmm.12"]["part"] == "moe"
  assert ins["copy-start.1"]["shape"] == "(bf16[16,2304,1024], bf16[16,2304,1024], u32[])"
  assert ins["copy-start.1"]["part"] == "moe"
  assert ins["while.3"]["part"] == "other" and "source" not in ins["while.3"]
  # a shared expert's projection is the MoE block's (the layer-level part wins), a lone SwiGLU's is ffn
  assert ins["lone_fusion.5"]["part"] == "moe" and ins["shared_fusion.4"]["part"] == "ffn"
  frames = dp.stack_frames(HLO)
  assert [f[1] for f in frames[5]] == ["Linear.__call__", "SwiGLU.__call__", "SparseMoeBlock.__call__"]
  assert [f[1] for f in frames[1]] == ["MultiHeadLatentAttention.decode_latent"]


def test_stack_frames_are_absent_from_older_module_text():
  assert dp.stack_frames("HloModule m\n\nENTRY %main {\n  ROOT %p = f32[2] parameter(0)\n}\n") == {}
  assert dp.hlo_instructions("ENTRY %main {\n  ROOT %p = f32[2]{0} parameter(0)\n}\n")["p"]["part"] == "other"


PROFILE = """
planes { name: "/host:CPU" lines { name: "python" events { metadata_id: 1 duration_ps: 7000000 } }
         event_metadata { key: 1 value { id: 1 name: "scores_fusion.7" } } }
planes { name: "/device:TPU:0"
  lines { name: "XLA Ops"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 }
    events { metadata_id: 2 offset_ps: 2500000 duration_ps: 9000000 }
    events { metadata_id: 3 offset_ps: 3000000 duration_ps: 500000 }
    events { metadata_id: 1 offset_ps: 5000000 duration_ps: 1000000 }
    events { metadata_id: 4 offset_ps: 7000000 duration_ps: 250000 } }
  event_metadata { key: 1 value { id: 1 name: "scores_fusion.7" } }
  event_metadata { key: 2 value { id: 2 name: "while.3" } }
  event_metadata { key: 3 value { id: 3 name: "custom-call.9" } }
  event_metadata { key: 4 value { id: 4 name: "not-in-this-program.1" } } }
"""


def test_device_plane_times_sum_the_program_s_own_instructions():
  ins = dp.hlo_instructions(HLO)
  plane, times = dp.instruction_times(ProfileData.from_text_proto(PROFILE), ins)
  # the device plane wins over the host's; the loop itself (its body's time) and foreign names are left out
  assert plane == "/device:TPU:0"
  assert times == {"scores_fusion.7": [3000, 2], "custom-call.9": [500, 1]}
  s = dp.summarize(times, ins, steps=2, top=1)
  assert s["sum_ms_per_step"] == pytest.approx(0.00175)
  assert s["by_part_ms_per_step"] == {"mla": 0.0015, "kda": 0.00025}
  assert s["by_opcode_ms_per_step"] == {"fusion": 0.0015, "tpu_custom_call:kda_decode_step_tpu": 0.00025}
  assert [r["name"] for r in s["top"]] == ["scores_fusion.7"] and s["top"][0]["count_per_step"] == 1


def test_asynchronous_starts_are_apart_from_the_instructions_in_order():
  # on the v5e a copy-start's event spans its transfer while compute runs: summing it with the rest
  # made 254 ms of a 26 ms decode step (decode_profile at B=64, 2026-12-07)
  ins = {"copy-start.3": {"opcode": "copy-start", "part": "other", "shape": "(bf16[128], bf16[128], u32[])"},
         "copy-done.3": {"opcode": "copy-done", "part": "other", "shape": "bf16[128]"},
         "fusion.1": {"opcode": "fusion", "part": "moe", "shape": "bf16[64,2304]"}}
  times = {"copy-start.3": [40_000_000, 2], "copy-done.3": [1_000_000, 2], "fusion.1": [6_000_000, 2]}
  s = dp.summarize(times, ins, steps=2, top=4)
  assert s["in_order_ms_per_step"] == pytest.approx(3.5) and s["async_span_ms_per_step"] == pytest.approx(20.0)
  assert s["sum_ms_per_step"] == pytest.approx(23.5)
  assert [r["name"] for r in s["top"]] == ["fusion.1", "copy-done.3"]
  assert [r["name"] for r in s["top_async"]] == ["copy-start.3"]


def test_device_events_named_by_their_whole_instruction_text():
  # as libtpu 0.0.42 (jax 0.10.2) names the "XLA Ops" events on the v5e: the instruction's text
  ins = dp.hlo_instructions(HLO)
  text = ('%custom-call.9 = (bf16[64,32,128]{2,1,0}, f32[64,32,128,128]{3,2,1,0}) custom-call(%a, %b), '
          'custom_call_target="tpu_custom_call"')
  profile = ProfileData.from_text_proto(f"""
planes {{ name: "/device:TPU:0"
  lines {{ name: "XLA Ops" events {{ metadata_id: 1 duration_ps: 4000000 }} events {{ metadata_id: 2 duration_ps: 1000 }} }}
  event_metadata {{ key: 1 value {{ id: 1 name: {json.dumps(text)} }} }}
  event_metadata {{ key: 2 value {{ id: 2 name: "%while.3 = (s32[], f32[4]) while(%t), condition=%c" }} }} }}
""")
  assert dp.instruction_times(profile, ins) == ("/device:TPU:0", {"custom-call.9": [4000, 1]})
  assert dp.event_instruction("%fusion.3 = f32[8]{0} fusion(%p), kind=kLoop") == "fusion.3"
  assert dp.event_instruction("scores_fusion.7") == "scores_fusion.7"


def test_host_plane_when_no_device_plane_has_the_program():
  ins = dp.hlo_instructions(HLO)
  profile = ProfileData.from_text_proto("""
planes { name: "/device:TPU:0" lines { name: "XLA Ops" events { metadata_id: 1 duration_ps: 5000 } }
         event_metadata { key: 1 value { id: 1 name: "another_program_fusion.1" } } }
planes { name: "/host:CPU" lines { name: "tf_XLAEigen" events { metadata_id: 1 duration_ps: 7000000 } }
         event_metadata { key: 1 value { id: 1 name: "scores_fusion.7" } } }
""")
  assert dp.instruction_times(profile, ins) == ("/host:CPU", {"scores_fusion.7": [7000, 1]})
  assert dp.instruction_times(ProfileData.from_text_proto('planes { name: "/host:metadata" }'), ins) == (None, {})


def test_smoke_run_on_this_host(tmp_path, capsys):
  out = tmp_path / "p.json"
  assert dp.main(["--smoke", "--json", str(out), "--top", "500", "--compilation-cache-dir", "none"]) == 0
  r = json.loads(out.read_text())
  assert r["step_ms"] > 0 and r["plane"] == "/host:CPU" and r["instructions_seen"] > 20
  assert {"kda", "mla", "moe"} <= set(r["by_part_ms_per_step"])
  assert sum(r["by_part_ms_per_step"].values()) == pytest.approx(r["sum_ms_per_step"], abs=1e-3)
  rows = r["top"]
  assert len(rows) == min(500, r["instructions_seen"]) and rows[0]["ms_per_step"] >= rows[-1]["ms_per_step"]
  assert all(row["opcode"] not in dp.CONTAINERS for row in rows)
  # this jax's own stack tables: every projection (flax's Linear, Embed) is put in the part that called it
  linear = [row for row in rows if "linear.py" in row.get("source", "")]
  assert linear and all(row["part"] in ("kda", "mla", "moe", "ffn", "model", "embed") for row in linear), linear
  assert "decode B=2:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--batch", "-1"], "--batch must be >= 1"),
    (["--top", "0"], "--top must be >= 1"),
    # a number past what any host holds or any profile needs: a traceback or hours before, one line now
    (["--batch", "99999999999999999999"], "--batch must be at most 512, got 99999999999999999999"),
    (["--steps", "5000"], "--steps must be at most 4096"),
    (["--repeats", "1001"], "--repeats must be at most 1000"),
    (["--set", "nope=1"], "--config 'tiny' / --set: unknown config key 'nope'"),
    (["--config", "nosuch"], "--config 'nosuch' / --set: unknown model config 'nosuch'"),
    (["--json", "{tmp}"], "is a directory; expected a file path"),
    (["--json", "/proc/p.json"], "cannot be written (/proc is not a writable directory)"),
    (["--config", ""], "--config: expected a model config name or file, got an empty value"),
    (["--compilation-cache-dir", "{tmp}/file/cache"], "--compilation-cache-dir: compilation_cache_dir="),
    (["--json", "{tmp}/file/p.json"], "cannot be written ({tmp}/file is not a writable directory)"),
])
def test_bad_arguments_exit_2_naming_them_before_anything_is_written(tmp_path, capsys, argv, message):
  (tmp_path / "file").write_text("")
  argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
  with pytest.raises(SystemExit) as e:
    dp.main(["--smoke", "--json", str(tmp_path / "out" / "p.json"), *argv])
  assert e.value.code == 2 and message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]   # nothing created


def test_the_real_width_default_is_refused_off_a_tpu(tmp_path, capsys):
  # without --smoke or --config the model is the ~9.9 GB real-width shard: a CPU would build it for minutes
  with pytest.raises(SystemExit) as e:
    dp.main(["--json", str(tmp_path / "p.json")])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "a model for the chip; this backend is cpu: use --smoke or --config" in err
  assert list(tmp_path.iterdir()) == []
