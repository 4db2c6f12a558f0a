"""Every tool keeps the one command-line contract (tools/cli.py), run as a user runs it: a subprocess.

`--help` works (also through its installed console command); a typo'd key, a value of the wrong type
and `attention=no_such_backend` each print exactly one `error:` line naming the key, exit with
status 2 and print no traceback. Each bad argument is caught before any checkpoint, corpus or
output path is touched, so the arguments around it need not exist. The bad-argument invocations of
one tool share one subprocess (tests/layout/tool_cases.py: each runs as `python -m tools.<tool>`
would, with its own stdout and stderr), so jax starts once per tool, not once per invocation.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = REPO / "kda_plugin" / "assets" / "demo"
CKPT = f"load_parameters_path={DEMO}"
MISSING = "/nonexistent/for-this-test"

# tool module -> (console command, [(argv, key the error line must name)])
TOOLS = {
    "generate": ("kda-generate", [([CKPT, "prompt_ids=1", "max_new_tokns=3"], "max_new_tokns"),
                                  ([CKPT, "prompt_ids=1", "max_new_tokens=three"], "max_new_tokens"),
                                  ([CKPT, "prompt_ids=1", "attention=no_such_backend"], "attention")]),
    "serve": ("kda-serve", [([CKPT, "engine=static", "max_num_seq=3"], "max_num_seq"),
                            ([CKPT, "engine=static", "port=high"], "port"),
                            ([CKPT, "engine=static", "attention=no_such_backend"], "attention")]),
    "perplexity": ("kda-perplexity", [([CKPT, f"eval_data={MISSING}", "max_target_lenght=8"], "max_target_lenght"),
                                      ([CKPT, f"eval_data={MISSING}", "eval_batch_size=1.5"], "eval_batch_size"),
                                      ([CKPT, f"eval_data={MISSING}", "attention=no_such_backend"], "attention")]),
    "train": ("kda-train", [(["tiny", "learning_rat=1"], "learning_rat"),
                            (["tiny", "steps=many"], "steps"),
                            (["tiny", f"output_dir={MISSING}", "attention=no_such_backend"], "attention")]),
    "demo": ("kda-demo", [(["max_new_tokns=3"], "max_new_tokns"),
                          (["max_new_tokens=three"], "max_new_tokens"),
                          (["attention=no_such_backend"], "attention")]),
    "forward_check": ("kda-forward-check", [(["tiny", "hiden_size=8"], "hiden_size"),
                                            (["tiny", "hidden_size=wide"], "hidden_size"),
                                            (["tiny", "attention=no_such_backend"], "attention")]),
    "convert_checkpoint": ("kda-convert", [([f"hf_model_pth={MISSING}", f"output_path={MISSING}"], "hf_model_pth"),
                                           ([f"hf_model_path={MISSING}", f"output_path={MISSING}", "overwrite=maybe"],
                                            "overwrite"),
                                           ([f"hf_model_path={MISSING}", f"output_path={MISSING}",
                                             "attention=no_such_backend"], "attention")]),
    "train_tokenizer": ("kda-train-tokenizer", [([f"inpt={MISSING}"], "inpt"),
                                                ([f"input={MISSING}", f"model_prefix={MISSING}", "vocab_size=big"],
                                                 "vocab_size"),
                                                ([f"input={MISSING}", "attention=no_such_backend"], "attention")]),
    # The compile itself needs libtpu (.venv-tpu-aot): here only the arguments checked before it.
    "aot_compile": ("kda-aot-compile", [(["tiny", "compile_topology=v5e:2x2", "batch_sze=2"], "batch_sze"),
                                        (["tiny", "compile_topology=v5e:2x2", "mode=serve"], "mode"),
                                        (["tiny", "compile_topology=v5e:2x2", "stacked_params=maybe"],
                                         "stacked_params"),
                                        (["tiny", "compile_topology=v5e:2x2", "attention=no_such_backend"],
                                         "attention"),
                                        (["tiny", "compile_topology=v5e:2x2", "batch_size=0"], "batch_size"),
                                        (["tiny", "compile_topology=v5e:2x2", "seq_len=-5"], "seq_len"),
                                        # a typo of the tool's own key is suggested, not only config keys
                                        (["tiny", "compile_topolgy=v5e:2x2"], "compile_topology")]),
    "unigram_baseline": ("kda-unigram-baseline", [([f"dat={MISSING}"], "dat"),
                                                  ([f"data={MISSING}", f"tokenizer_path={MISSING}",
                                                    "heldout_fraction=half"], "heldout_fraction"),
                                                  ([f"data={MISSING}", "attention=no_such_backend"], "attention")]),
    "verify_checkpoint": ("kda-verify-checkpoint", [([f"load_parameters_pth={MISSING}"], "load_parameters_pth"),
                                                    ([f"load_parameters_path={MISSING}", "allow_non_finite=maybe"],
                                                     "allow_non_finite"),
                                                    ([f"load_parameters_path={MISSING}", "attention=no_such_backend"],
                                                     "attention")]),
}
CASES = [(tool, argv, key) for tool, (_, cases) in TOOLS.items() for argv, key in cases]

# tools/bench/benchmark_serving.py (a script: no console command, argparse flags): every flag is checked before a
# server starts, a model loads or a file is written. "{JSON}" is a path under a directory that must still
# not exist afterwards. (flags, the flag the error line must name)
_ONLINE = ["--online", "--json", "{JSON}"]
BENCHMARK_CASES = [
    (_ONLINE + ["--concurrency", "0"], "--concurrency"),           # hung (a semaphore of 0)
    (_ONLINE + ["--concurrency", "-1"], "--concurrency"),
    (_ONLINE + ["--num-requests", "0"], "--num-requests"),         # IndexError
    (_ONLINE + ["--warmup", "-2"], "--warmup"),
    (_ONLINE + ["--suffix-min", "200", "--suffix-max", "100"], "--suffix-min"),
    (_ONLINE + ["--prompt-min", "64", "--prompt-max", "32"], "--prompt-min"),
    (_ONLINE + ["--output-min", "9", "--output-max", "8"], "--output-min"),
    (_ONLINE + ["--output-min", "0"], "--output-min"),
    (_ONLINE + ["--prefix-len", "0", "--workloads", "shared_prefix"], "--prefix-len"),
    (_ONLINE + ["--workloads", "bogus"], "--workloads"),           # exited 1
    (_ONLINE + ["--workloads", ","], "--workloads"),
    (_ONLINE + ["--engines", "dynamic"], "--engines"),
    (_ONLINE + ["--max-num-seqs", "0"], "--max-num-seqs"),
    (_ONLINE + ["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "--max-num-batched-tokens"),
    (_ONLINE + ["--max-model-len", "100"], "--max-model-len"),    # the workload's requests are longer
    (_ONLINE + ["--prefix-cache-bytes", "-1"], "--prefix-cache-bytes"),
    (_ONLINE + ["--serve-arg", "engine"], "--serve-arg"),
    (_ONLINE + ["--serve-arg", "max_num_seqs=4"], "--max-num-seqs"),   # set by the tool: would override silently
    (_ONLINE + ["--concurrency", "many"], "--concurrency"),
    (_ONLINE + ["--checkpoint", MISSING], "--checkpoint"),
    (_ONLINE + ["--url", "http://127.0.0.1:1"], "--url"),          # nothing listens: was a URLError traceback
    (_ONLINE + ["--url", "127.0.0.1:8000"], "--url"),
    (_ONLINE + ["--url", "http://127.0.0.1:1", "--in-process"], "--in-process"),
    (_ONLINE + ["--url", "http://127.0.0.1:1", "--rounds", "2"], "--rounds"),
    (_ONLINE + ["--seed", "-1"], "--seed"),                          # was numpy's ValueError traceback
    (_ONLINE + ["--seed", str(2 ** 32)], "--seed"),
    (_ONLINE + ["--serve-arg", "bogus_key=1"], "--serve-arg"),      # started a server that failed, left a log
    (_ONLINE + ["--serve-arg", "max_waiting=many"], "--serve-arg"),
    # --url: the flags of the servers the tool would start were ignored silently
    (_ONLINE + ["--url", "http://127.0.0.1:1", "--engines", "static"], "--engines"),
    (_ONLINE + ["--url", "http://127.0.0.1:1", "--max-num-seqs", "4"], "--max-num-seqs"),
    (_ONLINE + ["--url", "http://127.0.0.1:1", "--max-num-batched-tokens", "512"], "--max-num-batched-tokens"),
    (_ONLINE + ["--url", "http://127.0.0.1:1", "--max-model-len", "4096"], "--max-model-len"),
    (_ONLINE + ["--url", "http://127.0.0.1:1", "--prefix-cache-bytes", "0"], "--prefix-cache-bytes"),
    (_ONLINE + ["--url", "http://127.0.0.1:1", "--serve-arg", "max_waiting=4"], "--serve-arg"),
    (_ONLINE + ["--url", "http://127.0.0.1:1", "--start-timeout", "60"], "--start-timeout"),
    (_ONLINE + ["--in-process", "--serve-arg", "max_waiting=4"], "--serve-arg"),
    (["--online", "--json", "/proc/kda-benchmark-test/out.json"], "--json"),   # cannot be created
    (["--online", "--json", "/proc/out.json"], "--json"),   # was a FileNotFoundError traceback after the run
    (["--runs", "0", "--json", "{JSON}"], "--runs"),                 # the offline mode
    (["--seed", "-1", "--json", "{JSON}"], "--seed"),
    (["--json", "/proc/out.json"], "--json"),
]


def _run(argv, cwd=REPO):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_bad_argument_is_one_error_line(tool):
  cases = TOOLS[tool][1]
  r = _run([sys.executable, "-m", "tests.layout.tool_cases", tool, json.dumps([argv for argv, _ in cases])])
  assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr   # the driver itself
  results = json.loads(r.stdout.strip().splitlines()[-1])
  assert [res["argv"] for res in results] == [argv for argv, _ in cases]
  for res, (argv, key) in zip(results, cases):
    errors = [line for line in res["stderr"].splitlines() if "error:" in line]
    assert res["code"] == 2, (argv, res)
    assert "Traceback" not in res["stderr"] + res["stdout"], (argv, res["stderr"])
    assert len(errors) == 1 and errors[0].startswith("error: "), (argv, res["stderr"])
    assert key in errors[0], (argv, errors[0])


def test_benchmark_serving_bad_flag_is_one_error_line_before_anything_starts(tmp_path):
  out_dir = tmp_path / "not_created"
  cases = [[a.replace("{JSON}", str(out_dir / "out.json")) for a in argv] for argv, _ in BENCHMARK_CASES]
  r = _run([sys.executable, "-m", "tests.layout.tool_cases", "bench.benchmark_serving", json.dumps(cases)])
  assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
  results = json.loads(r.stdout.strip().splitlines()[-1])
  assert [res["argv"] for res in results] == cases
  for res, (argv, flag) in zip(results, BENCHMARK_CASES):
    errors = [line for line in res["stderr"].splitlines() if "error:" in line]
    assert res["code"] == 2, (argv, res)
    assert "Traceback" not in res["stderr"] + res["stdout"] and res["stdout"] == "", (argv, res)
    assert len(errors) == 1 and errors[0].startswith("error: ") and flag in errors[0], (argv, res["stderr"])
    assert len(res["stderr"].splitlines()) == 1, (argv, res["stderr"])   # no usage dump around it
  assert not out_dir.exists()   # nothing written: no JSON, no server log (a started server writes one)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_help_through_the_console_command(tool):
  command = pathlib.Path(sys.executable).parent / TOOLS[tool][0]
  assert command.is_file(), f"{command} is not installed (pyproject [project.scripts]; reinstall with make install)"
  r = _run([str(command), "--help"])
  assert r.returncode == 0 and r.stderr == "", r.stderr
  assert len(r.stdout.splitlines()) > 5  # the tool's help text, not an empty line


def test_a_renamed_key_warns_on_stderr():
  """Python hides DeprecationWarning by default; a tool shows the renamed-key one (then goes on: here to
  the missing-checkpoint error)."""
  r = _run([sys.executable, "-m", "tools.generate", "kda_impl=xla", "prompt_ids=1"])
  assert r.returncode == 2, r.stderr
  assert "DeprecationWarning: config key 'kda_impl' is deprecated; write kda_implementation=xla" in r.stderr, r.stderr
  assert "error: load_parameters_path is required" in r.stderr, r.stderr
