"""tools/serving_load.py's round aggregation (no server): medians over interleaved rounds and the
shared-prefix TTFT ratio, each round's own ratio beside it."""

from __future__ import annotations

import pytest

from tools import serving_load


def _run(ttft, tok_s=100.0):
  return {"config": "x", "requests": 4, "wall_s": 1.0, "output_tokens_per_s": tok_s, "ttft_p50_s": ttft,
          "ttft_p99_s": 2 * ttft, "tpot_p50_s": 0.02, "tpot_p99_s": 0.03, "ttft_mean_s": ttft, "cached_tokens": 0}


def test_rounds_report_the_median_of_each_figure():
  row = serving_load.median_row([_run(0.30, 90.0), _run(0.10, 300.0), _run(0.20, 100.0)])
  assert row["rounds"] == 3 and row["ttft_p50_s"] == 0.20 and row["output_tokens_per_s"] == 100.0
  assert [r["ttft_p50_s"] for r in row["per_round"]] == [0.30, 0.10, 0.20]
  assert serving_load.median_row([_run(0.5)])["ttft_p50_s"] == 0.5


def test_prefix_cache_ratio_is_off_over_on_with_each_round():
  on = {"workload": "shared_prefix", **serving_load.median_row([{**_run(t), "config": "cache on"} for t in (0.1, 0.2)])}
  off = {"workload": "shared_prefix", **serving_load.median_row([{**_run(t), "config": "cache off"} for t in (0.4, 0.5)])}
  text = serving_load.prefix_cache_ratio([on, off])
  assert text.startswith("prefix cache TTFT p50 ratio (off / on, medians): 3.00x")   # 0.45 / 0.15
  assert text.endswith("(each round: 4.00x, 2.50x)")
  assert serving_load.prefix_cache_ratio([on]) == ""


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--rounds", "2", "--url", "http://127.0.0.1:1"]])
def test_bad_rounds_are_refused_before_anything_starts(argv, capsys):
  with pytest.raises(SystemExit) as e:
    serving_load.main(argv)
  assert e.value.code == 2 and "--rounds" in capsys.readouterr().err


def test_shared_prefix_ttft_is_split_at_a_block_of_suffix():
  results = [{"prompt_tokens": 512 + s, "output_tokens": 2, "cached_tokens": 512, "ttft_s": t, "tpot_s": 0.01}
             for s, t in ((16, 0.03), (63, 0.05), (64, 0.08), (128, 0.09), (100, 0.07))]
  row = serving_load.summarize(results, 1.0, prefix_len=512)
  assert row["requests_suffix_under_block"] == 2
  assert row["ttft_p50_suffix_under_block_s"] == pytest.approx(0.04)
  assert row["ttft_p50_suffix_block_or_more_s"] == pytest.approx(0.08)
  assert "ttft_p50_suffix_under_block_s" not in serving_load.summarize(results, 1.0)


def test_the_client_block_is_the_prefix_cache_block():
  from model.engine.prefix_cache import BLOCK
  assert serving_load.BLOCK == BLOCK


def test_server_metrics_are_the_differences_over_the_measured_requests():
  before = {"kda_num_compilations": 40.0, "kda_prompt_tokens_total": 1000.0, "kda_cached_prompt_tokens_total": 200.0,
            "kda_generation_tokens_total": 5000.0, "kda_prefix_cache_bytes": 10.0, "kda_num_requests_running": 0.0}
  after = {**before, "kda_prompt_tokens_total": 1800.0, "kda_cached_prompt_tokens_total": 800.0,
           "kda_generation_tokens_total": 5640.0, "kda_prefix_cache_bytes": 99.0}
  d = serving_load.metrics_delta(before, after)
  assert (d["kda_num_compilations"], d["kda_prompt_tokens_total"], d["kda_cached_prompt_tokens_total"],
          d["kda_generation_tokens_total"]) == (0.0, 800.0, 600.0, 640.0)
  assert d["prefix_cache_hit_rate"] == 0.75 and d["kda_prefix_cache_bytes_after"] == 99.0
  assert "differences" in d["scope"]
  missing = serving_load.metrics_delta({**before, "kda_num_compilations": None}, after)
  assert missing["kda_num_compilations"] is None and missing["kda_generation_tokens_total"] == 640.0
  idle = serving_load.metrics_delta(before, before)
  assert idle["prefix_cache_hit_rate"] is None and idle["kda_generation_tokens_total"] == 0.0


def test_a_warm_server_gets_a_note():
  cold = {"kda_prefix_cache_bytes": 0.0, "kda_cached_prompt_tokens_total": 0.0}
  assert serving_load.warm_note("http://h:1", cold) == ""
  assert serving_load.warm_note("http://h:1", {"kda_prefix_cache_bytes": None}) == ""
  note = serving_load.warm_note("http://h:1", {"kda_prefix_cache_bytes": 4096.0, "kda_cached_prompt_tokens_total": 64.0})
  assert note.startswith("note: the server at http://h:1 is already warm") and "4096 bytes" in note
  assert "\n" not in note


@pytest.mark.parametrize("argv, mode, present, absent", [
    (["--url", "http://h:1", "--workloads", "shared_prefix"], "url", {"url": "http://h:1", "prefix_len": 512,
                                                                      "client": "raw"},
     {"max_num_seqs", "max_num_batched_tokens", "prefix_cache_bytes", "engines", "rounds", "serve_arg",
      "start_timeout", "in_process", "prompt_min", "prompt_max"}),
    (["--workloads", "mixed", "--engines", "static", "--concurrency", "4"], "servers",
     {"engines": ["static"], "max_num_seqs": 32, "max_num_batched_tokens": 2048, "prompt_max": 1024,
      "warmup": 4, "concurrency": 4, "rounds": 1, "start_timeout": 1200.0, "serve_arg": []},
     {"url", "prefix_cache_bytes", "prefix_len", "suffix_min", "in_process"}),
    (["--in-process", "--workloads", "mixed,shared_prefix"], "in_process",
     {"engines": ["continuous", "static"], "prefix_cache_bytes": 1 << 30, "suffix_max": 128, "warmup": 32,
      "workloads": ["mixed", "shared_prefix"]},
     {"url", "client", "serve_arg", "start_timeout"}),
])
def test_the_json_records_typed_args_of_its_mode_only(argv, mode, present, absent):
  args = serving_load._parser().parse_args(argv)
  kinds = serving_load._split(args.workloads)
  engines = serving_load._split(args.engines) if "mixed" in kinds and not args.url else []
  rec = serving_load.recorded_args(args, kinds, engines, max_len=1300)
  assert rec["mode"] == mode
  for key, value in present.items():
    assert rec[key] == value and type(rec[key]) is type(value), (key, rec.get(key))
  assert not absent & set(rec), absent & set(rec)
  assert isinstance(rec["num_requests"], int) and isinstance(rec["checkpoint"], str)
  if mode != "url":
    assert rec["max_model_len"] == 1300
