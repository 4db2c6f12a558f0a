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
