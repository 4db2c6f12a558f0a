r"""Peak host memory and throughput of tools.convert_checkpoint on a synthetic multi-GB checkpoint.

Usage:
  .venv/bin/python tools/bench/benchmark_convert.py [layers=12] [runs=3] [workdir=/tmp] [to_hf=true] [keep=false]

Writes a random bfloat16 Hugging Face Kimi-Linear checkpoint (config.json, shards of ~1 GB and
model.safetensors.index.json; 2.3 GB with the default 12 layers: 64 experts of width 512 at
hidden 1024) with safetensors, one shard at a time; then converts it to the project format (and,
with to_hf=true, back) in a subprocess, `runs` times each. For every run it reports the child's
peak RSS (`os.wait4` rusage ru_maxrss), the bound "1 GB + largest tensor" that the converter is meant
to stay under, wall seconds and GB/s; then the medians. It also reports the RSS of a child that only
imports the converter (jax, flax, orbax: the fixed cost inside the bound). Everything it wrote is
deleted at the end unless keep=true.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULTS = {"layers": "12", "runs": "3", "workdir": tempfile.gettempdir(), "to_hf": "true", "keep": "false"}
SHARD_BYTES = 10**9


def hf_config(layers: int) -> dict:
  """A Kimi-Linear-shaped config (KDA 3 : MLA 1, MoE after layer 0) sized by `layers`."""
  mla = [i for i in range(1, layers + 1) if i % 4 == 0] or [layers]
  return {
      "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "bfloat16",
      "vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": layers, "intermediate_size": 4096,
      "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
      "linear_attn_config": {"kda_layers": [i for i in range(1, layers + 1) if i not in mla],
                             "full_attn_layers": mla, "num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4},
      "num_attention_heads": 8, "q_lora_rank": None, "kv_lora_rank": 256, "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
      "first_k_dense_replace": 1, "num_experts": 64, "num_experts_per_token": 4, "moe_intermediate_size": 512,
      "num_shared_experts": 1, "routed_scaling_factor": 2.446, "moe_renormalize": True,
      "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
      "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
  }


def hf_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
  """(name, shape, dtype) of every HF tensor, from the converter's own table (independent shapes
  would only duplicate it; the converter checks each shape against the config anyway)."""
  # Imported here, not at the top: the converter pulls in jax, flax and orbax, which the measuring
  # parent needs only for this table (its children are what is measured).
  import numpy as np
  from model.hf import convert as conversion, names as hl
  pcfg, _ = hl.config_from_hf(cfg, weight_dtype="bfloat16")
  out = []
  for e in conversion.parameter_table(pcfg):
    dt = "F32" if e.dtype == np.float32 else "BF16"
    out += [(n, e.hf_shape, dt) for n in e.hf_names]
  return out


def write_checkpoint(root: pathlib.Path, layers: int, seed: int = 0) -> dict:
  """Writes the synthetic checkpoint shard by shard; returns sizes."""
  # Here, not at the top: the parent stays small (see run_child: a child's ru_maxrss starts at it).
  import ml_dtypes
  import numpy as np
  from safetensors.numpy import save_file
  cfg = hf_config(layers)
  root.mkdir(parents=True)
  (root / "config.json").write_text(json.dumps(cfg, indent=2))
  tensors = hf_tensors(cfg)
  rng = np.random.default_rng(seed)
  shards, cur, size = [], [], 0
  for t in tensors:
    n = int(np.prod(t[1])) * (4 if t[2] == "F32" else 2)
    if cur and size + n > SHARD_BYTES:
      shards.append(cur)
      cur, size = [], 0
    cur.append(t)
    size += n
  shards.append(cur)
  weight_map, total, largest = {}, 0, 0
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    data = {}
    for name, shape, dt in shard:
      a = rng.standard_normal(shape, dtype=np.float32) * 0.02
      data[name] = a if dt == "F32" else a.astype(ml_dtypes.bfloat16)
      weight_map[name] = fname
      total += data[name].nbytes
      largest = max(largest, data[name].nbytes)
    save_file(data, root / fname, metadata={"format": "pt"})
    del data
  (root / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
  return {"bytes": total, "tensors": len(tensors), "shards": len(shards), "largest_hf_tensor": largest,
          "largest_parameter": _largest_parameter(cfg)}


def _largest_parameter(cfg: dict) -> int:
  from model.hf import convert as conversion, names as hl  # as in hf_tensors: parent-side only
  pcfg, _ = hl.config_from_hf(cfg, weight_dtype="bfloat16")
  return max(e.nbytes for e in conversion.parameter_table(pcfg))


def run_child(argv: list[str], echo: bool = True) -> tuple[float, int, int, int]:
  """Runs `python argv...` from the repo.

  Returns (seconds, peak RSS from the kernel's rusage (ru_maxrss of the waited child), peak RSS
  sampled with psutil every 20 ms (a cross-check; may miss short spikes), exit status). This
  process stays small (no jax, no arrays), because on Linux a child's ru_maxrss starts from its
  parent's RSS at fork.
  """
  import psutil  # optional: only this cross-check needs it
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  t = time.perf_counter()
  proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
  sampled = 0
  ps = psutil.Process(proc.pid)
  while True:
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid:
      break
    try:
      sampled = max(sampled, ps.memory_info().rss)
    except psutil.Error:
      pass
    time.sleep(0.02)
  seconds = time.perf_counter() - t
  out = proc.stdout.read()
  proc.stdout.close()
  proc.returncode = os.waitstatus_to_exitcode(status)
  if echo and out.strip():
    print("   ", out.strip().splitlines()[-1])
  return seconds, usage.ru_maxrss * 1024, sampled, proc.returncode


def main(argv: list[str]) -> int:
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    return 0
  opts = dict(DEFAULTS)
  for a in argv:
    k, _, v = a.partition("=")
    if k not in DEFAULTS or not v:
      print(f"error: unknown or empty argument {a!r}; known: {', '.join(DEFAULTS)}", file=sys.stderr)
      return 2
    opts[k] = v
  layers, runs = int(opts["layers"]), int(opts["runs"])
  work = pathlib.Path(tempfile.mkdtemp(prefix="bench_convert_", dir=opts["workdir"]))
  try:
    t = time.perf_counter()
    # Written by a child process: the random data must not inflate this process (see run_child).
    code = (f"import json, pathlib, sys; sys.path.insert(0, {str(REPO)!r}); from tools.bench import benchmark_convert as b; "
            f"print(json.dumps(b.write_checkpoint(pathlib.Path({str(work / 'hf')!r}), {layers})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if proc.returncode:
      print(proc.stderr[-2000:], file=sys.stderr)
      return 1
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    largest = max(info["largest_hf_tensor"], info["largest_parameter"])
    bound = 2**30 + largest
    gb = info["bytes"] / 1e9
    print(f"synthetic HF checkpoint: {gb:.2f} GB bf16, {info['tensors']} tensors in {info['shards']} shards "
          f"(written in {time.perf_counter() - t:.0f} s); largest HF tensor {info['largest_hf_tensor'] / 2**20:.0f} MiB, "
          f"largest parameter {info['largest_parameter'] / 2**20:.0f} MiB")
    _, base_rss, _, _ = run_child(["-c", "import jax, flax.nnx, orbax.checkpoint.experimental.v1, safetensors, "
                                         "tools.convert_checkpoint; jax.numpy.zeros(1).block_until_ready()"])
    print(f"import-only child peak RSS: {base_rss / 2**20:.0f} MiB (the fixed cost of jax/flax/orbax)")
    print(f"bound: 1 GiB + largest tensor = {bound / 2**20:.0f} MiB")
    results = {"to_orbax": [], "to_hf": []}

    def convert(direction: str, r: int, args: list[str]) -> bool:
      """One timed conversion in a child process; records and prints it; False if it failed."""
      s, rss, sampled, rc = run_child(["-m", "tools.convert_checkpoint", *args])
      if rc:
        print(f"{direction} failed with exit status {rc}", file=sys.stderr)
        return False
      results[direction].append((s, rss))
      print(f"  {direction:<8} run {r}: {s:.1f} s, {gb / s:.2f} GB/s, peak RSS {rss / 2**20:.0f} MiB "
            f"(psutil-sampled {sampled / 2**20:.0f} MiB) "
            f"({'within' if rss <= bound else 'ABOVE'} bound)")
      return True

    for r in range(runs):
      out = work / f"orbax{r}"
      if not convert("to_orbax", r, [f"hf_model_path={work / 'hf'}", f"output_path={out}"]):
        return 1
      if opts["to_hf"] == "true":
        if not convert("to_hf", r, ["direction=to_hf", f"load_parameters_path={out}",
                                    f"output_path={work / f'hf_back{r}'}", "max_shard_size=1GB"]):
          return 1
        shutil.rmtree(work / f"hf_back{r}")
      shutil.rmtree(out)
    for d, rows in results.items():
      if rows:
        s = statistics.median(x[0] for x in rows)
        rss = statistics.median(x[1] for x in rows)
        peak = max(x[1] for x in rows)
        print(f"{d}: median {s:.1f} s, {gb / s:.2f} GB/s, median peak RSS {rss / 2**20:.0f} MiB, max "
              f"{peak / 2**20:.0f} MiB vs bound {bound / 2**20:.0f} MiB ({runs} runs, {gb:.2f} GB)")
    return 0
  finally:
    if opts["keep"] != "true":
      shutil.rmtree(work, ignore_errors=True)
    else:
      print(f"kept {work}")


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
