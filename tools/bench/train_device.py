r"""The phases of tools/bench/train_device_check.sh (one process each, so each runs under its own time limit
and a crash in one leaves the others' figures): the train step of the 0.4B model on the device, its split
by layer kind, the KDA training op alone, and `kda-train` on real text with a kill and a resume.

    python -m tools.bench.train_device PHASE --json FILE [--smoke] [--set key=value ...]
    python -m tools.bench.train_device check-set [--smoke] [--seq-len N] [--set key=value ...]

PHASE:
  step   the whole train step (`model.training.steps.train_step_fn`: forward, backward, AdamW) of
         `kimi_linear_48b_pattern_0p9b num_experts=4` (about 0.4 B parameters), bf16 compute, f32 weights,
         on `--batches` x `--seq-len` packed rows of random token ids (documents of random lengths). Every
         batch size of `--batches` is compiled (on threads, at once); the largest that fits is timed and the
         others are reported (fits or not, and libtpu's figure when it refused). Figures: the compile
         (seconds, persistent-cache hits), step time (median and spread), tokens/s, MFU, the compiled
         step's `memory_analysis()` and jax's `memory_stats()` peak after the timed steps; then one
         more step traced (`profile`, `--profile-top`): its device time by model part
         (`by_part_ms_per_step`: kda, mla, moe (each the whole mixer or block, projections included),
         ffn, norm, embed, head (LM head and loss), model (the decoder's own glue: residual adds),
         optimizer, train_step (the rest of the step function), other (no source frame)), by opcode
         (`by_opcode_ms_per_step`, each Mosaic kernel apart), and the `top` largest instructions.
  split  the step's parts at the same shapes, each jitted alone, forward + backward: one KDA mixer, one
         MLA mixer, one MoE FFN, the dense FFN, the head (embedding, final norm, lm_head, loss), and the
         optimizer update over all parameters; each times its count in the model. Labelled as pieces:
         they are timed alone (no remat, no fusion across layers), so their sum differs from the step.
         The MoE FFN is timed again under the platform's other expert implementations (`alternatives`,
         e.g. `moe_ffn[dense]` beside the TPU's megablox; not in the sum; `moe_impl` says which one
         `moe_ffn` ran). A piece that fails to lower or compile is a row with its `error`.
         Then the KDA training op alone (the backend's mode "train" op): H=32, T=8192, B=1, K=V=128, bf16
         inputs, one document, forward + backward, beside deltanet-tpu's reported 22.5 ms on a v6e (their
         figure, not measured here).
  loss   `python -m tools.train` (the `kda-train` console command) on real text (--corpus, default
         .train-data/tinyshakespeare.txt) with the project's tokenizer (kda_plugin/assets/demo): run A
         is SIGTERMed once its metrics reach `--kill-at`, run B resumes it, run C runs uninterrupted.
         Figures: the loss curve (every 10 steps), the held-out loss at the end, the compile lines each
         run printed (B and C load the step from the persistent cache), the per-step losses after the
         resume point against run C's (equal: one device, the same executable, a bit-exact restore), and
         the Orbax checkpoints read back on the CPU (this process runs with JAX_PLATFORMS=cpu; the runs
         get `--child-platforms`): B's final train checkpoint restores, and B's exported parameters equal
         C's bit for bit. The runs' keys are checked before any run (exit 2, naming --loss-model /
         --loss-set); a run that fails (A other than by this phase's SIGTERM) ends the phase with its
         `error:` line said, `failed_runs` in the JSON and exit status 1 (A failing: B and C do not start).

Formulas (docs/training.md, "On a TPU"):
  - step time: `--repeats` times, `--steps-per-repeat` steps dispatched and blocked once (device time, no
    per-call host sync), divided; median and min/max over the repeats;
  - MFU = 6 x active parameters x tokens/s / PEAK_FLOPS (v5e bf16: 197e12), active parameters = every
    parameter but the embedding table and the routed experts a token is not sent to (num_experts_per_tok
    of num_experts); plus, stated separately, attention FLOPs (3 x the forward: forward + backward):
      MLA causal, per layer: 2 x heads x (qk_nope + qk_rope + v head dims) x the (query, key) pairs of
        every document (L (L + 1) / 2 for a document of L tokens);
      KDA chunked (chunk C = 64), per layer, token and head: 6 C K + 4 C V + 6 K V + 2 C^2 / 3 (the
        chunk's k k^T and q k^T, the UT transform of k and v, the state's read, output and update, the
        triangular inverse); an ESTIMATE of the algorithm's matmul work, not a count of what XLA runs;
    and XLA's own FLOP count of the compiled step (`cost_analysis`) beside them.
`--smoke`: a tiny model and shapes on whatever backend jax has (the CPU test runs it that way).
`check-set`: the --set overrides checked against the step/split model config, nothing run (the shell
script runs it before it creates or clears anything); a bad key or value is one `error:` line naming
`--set-source` and the key, exit status 2. So is a count flag below 1 (`--seq-len 0`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import hashlib
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from tools.bench.e2e_device import PEAK_FLOPS, parameter_counts

REPO = pathlib.Path(__file__).resolve().parents[2]
STEP_CONFIG = ["kimi_linear_48b_pattern_0p9b", "num_experts=4"]
SMOKE_STEP_CONFIG = ["tiny", "num_hidden_layers=2", "kda_layers=[1]", "full_attn_layers=[2]"]  # every kind of block
KDA_CHUNK = 64
# The split's MoE FFN is also timed under these expert implementations (keyed by "on a TPU"), beside the
# step's own: megablox needs a TPU (Pallas Mosaic), ragged is the CPU's grouped alternative.
MOE_ALTERNATIVES = {True: ("megablox", "dense"), False: ("dense", "ragged")}
PROFILE_TOP = 40   # the step phase's traced step: how many of its largest instructions the JSON lists
DELTANET_TPU_V6E_MS = 22.5   # deltanet-tpu's reported forward + backward, H=32 T=8192, on a v6e (issue 37)
DEMO = REPO / "kda_plugin" / "assets" / "demo"
CORPUS_DEFAULT = REPO / ".train-data" / "tinyshakespeare.txt"   # git-ignored; the device tool carries it
INTERRUPTED_RC = 130   # kda-train's exit status after it checkpointed on SIGINT / SIGTERM (tools/train.py `run`)


def write_json(path, obj) -> None:
  """Writes `obj` to `path` now (each phase writes as it goes: a phase stopped at its time limit still
  leaves what it measured)."""
  tmp = pathlib.Path(str(path) + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
  os.replace(tmp, path)


def say(msg: str) -> None:
  print(msg, flush=True)


# --- model, data, costs ------------------------------------------------------------------------------
def step_config(args, batch: int):
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from model.config import load_config
  base = SMOKE_STEP_CONFIG if args.smoke else STEP_CONFIG
  return load_config([*base, "dtype=bfloat16", "weight_dtype=float32", f"batch_size={batch}",
                      f"seq_len={args.seq_len}", "steps=1000", "warmup_steps=10", *args.set])


def packed_batch(cfg, batch: int, seq_len: int, seed: int = 0) -> tuple[dict, list[int]]:
  """Random token ids in `batch` rows of `seq_len`, each row packed with up to `max_num_segments`
  documents of random lengths (the last one cut at the row's end); `(fields, document lengths)`."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, cfg.vocab_size, (batch, seq_len)).astype(np.int32)
  seg = np.zeros((batch, seq_len), np.int32)
  lengths = []
  mean = max(16, seq_len // max(1, cfg.max_num_segments // 2))
  for b in range(batch):
    t, label = 0, 1
    while t < seq_len and label <= cfg.max_num_segments:
      n = seq_len - t if label == cfg.max_num_segments else int(min(seq_len - t, rng.integers(mean // 4, 2 * mean)))
      seg[b, t:t + n] = label
      lengths.append(n)
      t, label = t + n, label + 1
  targets = np.zeros_like(ids)
  targets[:, :-1] = ids[:, 1:]
  mask = (seg > 0)
  mask[:, :-1] &= seg[:, 1:] == seg[:, :-1]
  mask[:, -1] = False
  return {"inputs": ids, "targets": targets, "loss_mask": mask, "segment_ids": seg}, lengths


def layer_counts(cfg) -> dict:
  n_mla = len(cfg.full_attn_layers)
  n_dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers) if cfg.num_experts else cfg.num_hidden_layers
  return {"kda": cfg.num_hidden_layers - n_mla, "mla": n_mla, "moe": cfg.num_hidden_layers - n_dense,
          "dense_ffn": n_dense}


def kda_chunk_flops_per_token_head(k: int, v: int, c: int = KDA_CHUNK) -> float:
  """Forward matmul FLOPs of the chunked KDA per token and head (module docstring; ESTIMATE)."""
  return 6 * c * k + 4 * c * v + 6 * k * v + 2 * c * c / 3


def attention_flops(cfg, doc_lengths, steps_factor: float = 3.0) -> dict:
  """Training (forward + backward = 3 x forward) attention FLOPs of one step over documents `doc_lengths`."""
  counts = layer_counts(cfg)
  pairs = float(sum(n * (n + 1) / 2 for n in doc_lengths))
  tokens = float(sum(doc_lengths))
  mla = counts["mla"] * 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                       + cfg.v_head_dim) * pairs * steps_factor
  kda = counts["kda"] * cfg.kda_num_heads * tokens * kda_chunk_flops_per_token_head(
      cfg.kda_head_dim, cfg.kda_head_dim) * steps_factor
  return {"mla_causal": mla, "kda_chunk_estimate": kda, "total": mla + kda, "document_pairs": pairs}


def memory_figures(compiled) -> dict | None:
  try:
    m = compiled.memory_analysis()
  except Exception as e:  # a backend without the analysis: say so, the rest of the phase still runs
    return {"error": f"{type(e).__name__}: {e}"[:300]}
  if m is None:
    return None
  args, out, alias, temp = (int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                            int(m.alias_size_in_bytes), int(m.temp_size_in_bytes))
  total = args + out - alias + temp
  return {"argument_bytes": args, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
          "generated_code_bytes": int(m.generated_code_size_in_bytes), "total_bytes": total,
          "total_gib": round(total / 2**30, 3), "temp_gib": round(temp / 2**30, 3)}


def xla_flops(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # a backend without the analysis
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  value = (cost or {}).get("flops")
  return None if value is None else float(value)


def device_memory_stats() -> dict:
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  keep = ("bytes_limit", "peak_bytes_in_use", "bytes_in_use", "largest_alloc_size")
  return {k: int(stats[k]) for k in keep if k in stats}


def time_calls(fn, repeats: int, per_repeat: int) -> dict:
  """Device time of `fn()` (returns arrays): `per_repeat` calls dispatched, blocked once, divided;
  `repeats` such loops. ms: median, min, max, and all."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  runs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(per_repeat):
      out = fn()
    jax.block_until_ready(out)
    runs.append((time.perf_counter() - t0) / per_repeat * 1e3)
  return {"median_ms": round(statistics.median(runs), 3), "min_ms": round(min(runs), 3),
          "max_ms": round(max(runs), 3), "runs_ms": [round(r, 3) for r in runs], "calls_per_run": per_repeat}


def compile_all(lowered: dict, threads: int) -> dict:
  """`{name: (compiled | exception, seconds)}`: every lowered program compiled on threads at once (XLA's
  compilation releases the GIL: the wall time is about the slowest one's)."""
  def one(item):
    name, low = item
    t = time.perf_counter()
    try:
      return name, low.compile(), time.perf_counter() - t
    except Exception as e:  # a refused program is a figure (libtpu's OOM), not the end of the phase
      return name, e, time.perf_counter() - t
  with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(lowered)))) as pool:
    return {name: (exe, sec) for name, exe, sec in pool.map(one, lowered.items())}


# --- phase: the whole step ---------------------------------------------------------------------------
def phase_step(args, out: dict) -> None:
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  from model import memory
  from model.engine import compilation_cache
  from model.training import steps as train_lib
  batches = sorted({int(b) for b in args.batches.split()}, reverse=True)
  cfg = step_config(args, batches[0])
  hparams = train_lib.optimizer_hparams(cfg)
  t0 = time.perf_counter()
  graphdef, state = train_lib.create_train_state(cfg, hparams)
  jax.block_until_ready(state)
  params = parameter_counts(state["params"], cfg)
  dev = jax.devices()[0]
  out.update({"config": (SMOKE_STEP_CONFIG if args.smoke else STEP_CONFIG) + ["dtype=bfloat16", "weight_dtype=float32"]
              + list(args.set), "model_name": cfg.model_name, "dtype": cfg.dtype, "weight_dtype": cfg.weight_dtype,
              "remat_policy": cfg.remat_policy, "moe_impl": cfg.moe_impl, "scan_layers": cfg.scan_layers,
              "attention": cfg.attention, "mla_impl": cfg.mla_impl, "seq_len": args.seq_len,
              "donate_state": args.donate,
              "donation_note": ("the step phase jits train_step_fn's step itself, donating the train state "
                                "(as model/aot.py's fit check compiles it and kda-train runs it) when donate_state; "
                                "without, the old and the new train state are live at once"),
              "parameters": params, "layers": layer_counts(cfg), "peak_flops": PEAK_FLOPS,
              "backend": jax.default_backend(), "device": dev.device_kind, "jax": jax.__version__,
              "init_s": round(time.perf_counter() - t0, 2), "memory_after_init": device_memory_stats()})
  say(f"model {cfg.model_name} {out['config']}: {params['total'] / 1e9:.3f} B parameters, "
      f"{params['active_matmul'] / 1e9:.3f} B active; {dev.device_kind}")
  step_fn = train_lib.train_step_fn(graphdef, hparams, cfg.max_num_segments, float(cfg.router_bias_update_rate))
  data = {b: packed_batch(cfg, b, args.seq_len, seed=b) for b in batches}
  if args.compiled_step:   # compiled ahead of time on another host (kda-aot-compile compiled_trainstep_file)
    # imported in the phase that needs it: a missing package fails that phase alone, by name
    from model import partitioning
    from model.training import compiled_step
    say(f"loading the train step compiled ahead of time from {args.compiled_step} (batch size {batches[0]})")
    t_c = time.perf_counter()
    want = compiled_step.header(cfg, dev.device_kind, 1, partitioning.mesh_shape(cfg, 1))
    exe = compiled_step.load(args.compiled_step, want)
    load_s = time.perf_counter() - t_c
    compiled = {batches[0]: (exe, load_s)}
    batches = batches[:1]
    out["donate_state"] = True   # kda-aot-compile donates the train state
    out["compile"] = {"loaded_from": str(args.compiled_step), "load_s": round(load_s, 2),
                      "file_bytes": os.path.getsize(args.compiled_step)}
  else:
    say(f"compiling the train step for batch sizes {batches} x seq_len {args.seq_len} at once (cold on a fresh "
        f"machine: minutes for this model on a v5e; persistent cache at {compilation_cache.directory()})")
    t_c = time.perf_counter()
    with compilation_cache.watch() as seen:
      lowered = {b: train_lib_lower(step_fn, state, data[b][0], donate=args.donate) for b in batches}
      compiled = compile_all(lowered, threads=len(batches))
    out["compile"] = {"wall_s": round(time.perf_counter() - t_c, 2), "cache_hits": seen["hits"],
                      "cache_dir": compilation_cache.directory(),
                      "per_batch_s": {str(b): round(sec, 2) for b, (_, sec) in compiled.items()}}
  have, _ = memory.available_memory_bytes(dev)
  out["bytes_limit"] = have
  candidates = {}
  for b in batches:
    exe, _ = compiled[b]
    if isinstance(exe, Exception):
      if not memory.is_compile_oom(exe):
        candidates[str(b)] = {"fits": False, "error": f"{type(exe).__name__}: {str(exe).splitlines()[0][:300]}"}
        continue
      required, available = memory.oom_bytes(exe)
      candidates[str(b)] = {"fits": False, "refused_by_compiler": True, "required_bytes": required,
                            "available_bytes": available, "message": str(exe).strip().splitlines()[0][:400]}
      continue
    mem = memory_figures(exe)
    fits = not (have and mem and mem.get("total_bytes") and mem["total_bytes"] > have)
    candidates[str(b)] = {"fits": fits, "memory_analysis": mem, "xla_flops": xla_flops(exe)}
  out["batch_candidates"] = candidates
  say("compile: " + json.dumps(out["compile"]) + "\nfit: " + json.dumps(
      {b: c["fits"] for b, c in candidates.items()}))
  fitting = [b for b in batches if candidates[str(b)]["fits"]]
  write_json(args.json, out)
  if not fitting:
    out["timed"] = None
    out["note"] = f"no batch size of {batches} x {args.seq_len} fits: nothing timed"
    return
  b = fitting[0]
  out["batch_size"] = b
  if b != batches[0]:
    out["fallback"] = (f"batch_size={batches[0]} does not fit ({candidates[str(batches[0])]}); timed at the "
                       f"largest that does, batch_size={b}")
  exe = compiled[b][0]
  fields, doc_lengths = data[b]
  batch_args = tuple(jax.numpy.asarray(fields[k]) for k in train_lib.BATCH_FIELDS)
  box = {"state": state}

  def one_step():
    box["state"], m = exe(box["state"], *batch_args)
    return m["loss"]

  t_w = time.perf_counter()
  first_loss = float(one_step())
  out["first_step_s"] = round(time.perf_counter() - t_w, 3)
  timing = time_calls(one_step, args.repeats, args.steps_per_repeat)
  tokens = b * args.seq_len
  step_s = timing["median_ms"] / 1e3
  tps = tokens / step_s
  attn = attention_flops(cfg, doc_lengths)
  model_flops = 6.0 * params["active_matmul"] * tokens
  xf = candidates[str(b)]["xla_flops"]
  out["timed"] = {
      "batch_size": b, "tokens_per_step": tokens, "documents": len(doc_lengths),
      "mean_document_tokens": round(float(np.mean(doc_lengths)), 1), "step": timing,
      "tokens_per_s": round(tps, 1), "first_loss": first_loss,
      "flops_per_step": {"model_6N": model_flops, "attention_mla_causal": attn["mla_causal"],
                         "attention_kda_chunk_estimate": attn["kda_chunk_estimate"], "xla_cost_analysis": xf},
      "mfu_6N": round(model_flops / step_s / PEAK_FLOPS, 4),
      "mfu_6N_plus_attention": round((model_flops + attn["total"]) / step_s / PEAK_FLOPS, 4),
      "mfu_xla_flops": None if xf is None else round(xf / step_s / PEAK_FLOPS, 4),
      "memory_stats_after": device_memory_stats(),
  }
  t = out["timed"]
  say(f"step at {b} x {args.seq_len}: {timing['median_ms']:.1f} ms median ({timing['min_ms']:.1f}-"
      f"{timing['max_ms']:.1f}), {tps:,.0f} tokens/s, MFU {t['mfu_6N']:.1%} (6N) / "
      f"{t['mfu_6N_plus_attention']:.1%} (+ attention); peak {t['memory_stats_after'].get('peak_bytes_in_use')}")
  write_json(args.json, out)
  if args.profile_top:
    out["profile"] = step_profile(one_step, exe, args.profile_top)
    p = out["profile"]
    if "by_part_ms_per_step" in p:
      say("one step traced, device ms by model part: " + json.dumps(p["by_part_ms_per_step"]))
    else:
      say(f"the traced step gave no profile (the timing above stands): {p['error']}")


def step_profile(one_step, exe, top: int) -> dict:
  """One more step traced with jax's profiler: the compiled step's instructions' device time summed by
  model part (KDA, MLA, MoE, FFN, norms, embedding, head and loss, optimizer: `decode_profile.part_of`
  on each instruction's source stack), by opcode (custom calls by kernel) and the `top` largest
  (`decode_profile.summarize`). A program whose text cannot be read (an executable loaded from a file
  may not give it) or a trace with no instruction events is reported as such, not as figures."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from tools.bench import decode_profile as dp
  try:
    instructions, plane, times, lines_seen = dp.traced_instruction_times(one_step, exe)
  except Exception as e:  # noqa: BLE001  (the timing above stands; the JSON says why there is no profile)
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
  if not times:
    return {"error": "the trace held no event named like an instruction of the step", "lines_seen": lines_seen}
  return {"plane": plane, **dp.summarize(times, instructions, steps=1, top=top)}


def train_lib_lower(step_fn, state, fields, *, donate: bool):
  """The step lowered for `fields` (not compiled): `train_step_fn`'s un-jitted `step` under a jit of its
  own (so that several batch sizes compile at once), donating the train state when `donate` (what
  model/aot.py compiles) or not (what `train_step_fn`'s own jit does at this commit)."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  from model.training import steps as train_lib
  args = tuple(jax.numpy.asarray(fields[k]) for k in train_lib.BATCH_FIELDS)
  return jax.jit(step_fn.step, donate_argnums=(0,) if donate else ()).lower(state, *args)


# --- phase: the split --------------------------------------------------------------------------------
def _fwd_bwd(module, call):
  """`(fn(params, rest, x, ct, *extra), params, rest)`: value and gradients (params and x) of
  sum(call(module, x, *extra) * ct) for an nnx submodule `module`."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  import jax.numpy as jnp
  from flax import nnx
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def loss(params, rest, x, ct, *extra):
    m = nnx.merge(graphdef, params, rest)
    y = call(m, x, *extra)
    return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 2))), params, rest


def phase_split(args, out: dict) -> None:
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from model import loading, registry
  from model.engine import runner
  from model.training import steps as train_lib
  b = args.batch or int(args.batches.split()[0])
  cfg = step_config(args, b)
  t_len = args.seq_len
  model = loading.create(cfg)
  layers = list(model.model.layers)
  counts = layer_counts(cfg)
  fields, doc_lengths = packed_batch(cfg, b, t_len, seed=b)
  seg = jnp.asarray(fields["segment_ids"])
  ids = jnp.asarray(fields["inputs"])
  rng = np.random.default_rng(1)
  dt = jnp.bfloat16
  x = jnp.asarray(rng.normal(size=(b, t_len, cfg.hidden_size)), dt)
  ct = jnp.asarray(rng.normal(size=(b, t_len, cfg.hidden_size)) / np.sqrt(cfg.hidden_size), dt)
  n = cfg.max_num_segments
  kda_layer = next(layer for layer in layers if layer.kind == "kda")
  mla_layer = next(layer for layer in layers if layer.kind != "kda")
  moe_layer = next((layer for layer in layers if layer.is_moe), None)
  dense_layer = next((layer for layer in layers if not layer.is_moe), None)
  mixer = lambda m, x, seg: m(x, segment_ids=seg, mode="train", num_slots=n)[0]
  pieces = {"kda_mixer": (kda_layer.self_attn, mixer, (seg,), counts["kda"]),
            "mla_mixer": (mla_layer.self_attn, mixer, (seg,), counts["mla"])}
  if moe_layer is not None:
    pieces["moe_ffn"] = (moe_layer.block_sparse_moe, lambda m, x: m(x), (), counts["moe"])
  if dense_layer is not None:
    pieces["dense_ffn"] = (dense_layer.mlp, lambda m, x: m(x), (), counts["dense_ffn"])
  # the MoE FFN under the other expert implementations of this platform, timed beside the step's own
  # (not in the sum): which one a step should take is a measurement, not a rule
  alternatives = {}
  if moe_layer is not None:
    from model.nn import moe as moe_lib  # imported in the phase that needs it: a missing package fails that phase alone
    own = moe_lib.resolve_moe_impl(cfg.moe_impl)
    out["moe_impl"] = {"config": cfg.moe_impl, "moe_ffn": own}
    for impl in MOE_ALTERNATIVES[moe_lib.target_platform() == "tpu"]:
      if impl != own:
        block = nnx.clone(moe_layer.block_sparse_moe)
        block.experts.impl = impl
        alternatives[f"moe_ffn[{impl}]"] = (block, lambda m, x: m(x), (), counts["moe"])
  progs, inputs, lower_errors = {}, {}, {}
  for name, (module, call, extra, _) in {**pieces, **alternatives}.items():
    fn, p, r = _fwd_bwd(module, call)
    inputs[name] = (fn, (p, r, x, ct, *extra))
    try:
      progs[name] = fn.lower(p, r, x, ct, *extra)
    except Exception as e:  # noqa: BLE001  (a piece that cannot lower here is a row with its error)
      lower_errors[name] = (e, 0.0)

  # the head: embedding, final norm, lm_head and the loss, forward + backward
  class Head(nnx.Module):
    def __init__(self, embed, norm, lm_head):
      self.embed, self.norm, self.lm_head = embed, norm, lm_head

  hg, hp, hr = nnx.split(Head(model.model.embed_tokens, model.model.norm, model.lm_head), nnx.Param, ...)

  blocked = getattr(train_lib, "blocked_nll", None)   # the step's loss where it forms logits by blocks

  def head_loss(p, r, ids, targets, mask):
    h = nnx.merge(hg, p, r)
    hidden = h.embed(ids)
    if blocked is not None:
      total, count = blocked(lambda x: h.lm_head(h.norm(x)), hidden, targets, mask)
    else:
      total, count = train_lib.masked_nll(h.lm_head(h.norm(hidden)), targets, mask)
    return total / jnp.maximum(count, 1.0)

  head_fn = jax.jit(jax.value_and_grad(head_loss))
  head_args = (hp, hr, ids, jnp.asarray(fields["targets"]), jnp.asarray(fields["loss_mask"]))
  progs["head"] = head_fn.lower(*head_args)
  inputs["head"] = (head_fn, head_args)
  pieces["head"] = (None, None, (), 1)

  # the optimizer: AdamW (with clipping) over every parameter, given gradients
  hparams = train_lib.optimizer_hparams(cfg)
  tx = train_lib.make_optimizer(hparams)
  _, params, _ = train_lib.split_model(model)
  opt_state = tx.init(params)
  grads = jax.tree.map(lambda p: (p * 1e-3).astype(p.dtype), params)

  def update(params, opt_state, grads):
    import optax  # noqa: PLC0415  (the optimizer's library, already loaded by model.training.steps)
    upd, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, upd), opt_state

  # donated, as in a step (the update happens in place): a copy of the parameters, so the model's own
  # arrays stay valid for the pieces; the timing loop feeds each call's outputs to the next
  params = jax.tree.map(jnp.copy, params)
  opt_fn = jax.jit(update, donate_argnums=(0, 1))
  progs["optimizer"] = opt_fn.lower(params, opt_state, grads)
  inputs["optimizer"] = (opt_fn, (params, opt_state, grads))
  pieces["optimizer"] = (None, None, (), 1)

  # the KDA training op alone, by each implementation the backends train with (kda_native's on this
  # platform, and the XLA chunk scan): the H=32, T=8192, B=1, one document; and the 0.4B
  # step's shape, B x T of the step, the config's heads, 4 documents a row
  backend = registry.get_backend(cfg.attention)
  main_impl = (backend.chunked_implementation(cfg.kda_implementation)
               if hasattr(backend, "chunked_implementation") else "xla")
  op_cases = {}
  for suffix, (ob, ot, oh, ok, docs) in {
      "": (1, 256, 2, 64, 1) if args.smoke else (1, 8192, 32, 128, 1),
      "_step": (b, t_len, cfg.kda_num_heads, cfg.kda_head_dim, 4)}.items():
    for impl in dict.fromkeys([main_impl, "xla"]):
      op_cases[f"kda_op{suffix}" + ("_xla" if impl != main_impl else "")] = (ob, ot, oh, ok, docs, impl)
  for name, (ob, ot, oh, ok, docs, impl) in op_cases.items():
    progs[name], inputs[name] = kda_op_program(ob, ot, oh, ok, docs, impl, dt, cfg, rng)

  out.update({"batch_size": b, "seq_len": t_len, "layers": counts, "device": jax.devices()[0].device_kind,
              "kda_op_gate": "model_init (tools/bench/train_device.py OP_GATES)",
              "note": ("each piece jitted alone at the step's shapes, forward + backward (gradients of the "
                       "piece's parameters and input), no remat; x count = its share of one step (the "
                       "step's norms, residual adds and fusion across layers are not in the pieces)")})
  t_c = time.perf_counter()
  compiled = compile_all(progs, runner.default_compile_threads(len(progs)))
  out["compile"] = {"wall_s": round(time.perf_counter() - t_c, 2),
                    **{name: round(sec, 2) for name, (_, sec) in compiled.items()}}
  compiled.update(lower_errors)
  say(f"compiled {len(compiled)} programs in {out['compile']['wall_s']:.1f} s")
  write_json(args.json, out)
  def timed_row(name, count):
    """A piece's row: its error, or its time (median and spread, x count) and compiled memory."""
    exe, _ = compiled[name]
    if isinstance(exe, Exception):
      return {"error": f"{type(exe).__name__}: {str(exe).splitlines()[0][:300]}", "count": count}
    _, a = inputs[name]
    if name == "optimizer":   # donated: each call takes the previous call's parameters and moments
      box = {"p": a[0], "o": a[1]}

      def call(exe=exe, g=a[2], box=box):
        box["p"], box["o"] = exe(box["p"], box["o"], g)
        return box["o"]
    else:
      call = functools.partial(exe, *a)
    jax.block_until_ready(call())
    t = time_calls(call, args.repeats, args.steps_per_repeat)
    return {"count": count, "one_ms": t["median_ms"], "times_count_ms": round(t["median_ms"] * count, 3),
            "spread_ms": [t["min_ms"], t["max_ms"]], "memory_analysis": memory_figures(exe)}

  rows = {}
  for name in pieces:
    rows[name] = row = timed_row(name, pieces[name][3])
    if "one_ms" in row:
      say(f"{name}: {row['one_ms']:.3f} ms x {row['count']} = {row['times_count_ms']:.1f} ms")
    out["pieces"] = rows
    write_json(args.json, out)
  total = sum(row.get("times_count_ms", 0.0) for row in rows.values())
  out["pieces_sum_ms"] = round(total, 3)
  for name, row in rows.items():
    if "times_count_ms" in row and total:
      row["share_of_sum"] = round(row["times_count_ms"] / total, 4)
  alt_rows = {}
  for name, (_, _, _, count) in alternatives.items():
    alt_rows[name] = row = timed_row(name, count)
    if "one_ms" in row:
      say(f"{name} (instead of the step's own, not in the sum): {row['one_ms']:.3f} ms x {count}")
    out["alternatives"] = alt_rows
    write_json(args.json, out)
  for name, (ob, ot, oh, ok, docs, impl) in op_cases.items():
    exe, _ = compiled[name]
    if isinstance(exe, Exception):
      out[name] = {"implementation": impl, "error": f"{type(exe).__name__}: {str(exe).splitlines()[0][:300]}"}
      write_json(args.json, out)
      continue
    a = inputs[name][1]
    jax.block_until_ready(exe(*a))
    t = time_calls(lambda exe=exe, a=a: exe(*a), args.repeats, args.steps_per_repeat)
    flops = 3 * ob * oh * ot * kda_chunk_flops_per_token_head(ok, ok)
    out[name] = {"op": f"kda_chunked[{impl}]", "implementation": impl, "B": ob, "T": ot, "H": oh, "K": ok,
                 "V": ok, "dtype": "bfloat16", "documents": docs, "forward_backward": t,
                 "chunk_flops_estimate": flops, "tflop_s": round(flops / (t["median_ms"] / 1e3) / 1e12, 2),
                 "memory_analysis": memory_figures(exe)}
    if name == "kda_op":
      out[name]["peer"] = {"deltanet_tpu_v6e_ms": DELTANET_TPU_V6E_MS,
                           "source": "deltanet-tpu's reported forward + backward at H=32, T=8192 on a TPU v6e "
                                     "(their figure, cited in issue 37; not measured here; v6e has ~4.7x "
                                     "v5e's bf16 peak)"}
    say(f"KDA op kda_chunked[{impl}] B={ob} T={ot} H={oh}: fwd+bwd {t['median_ms']:.2f} ms"
        + (f" (deltanet-tpu on v6e: {DELTANET_TPU_V6E_MS} ms, their figure)" if name == "kda_op" else ""))
    write_json(args.json, out)


# The KDA op's gate inputs (`kda_op_program`): A = exp(A_log) uniform in [1, 16] for both.
#   model_init: the model's gate at initialisation (model/nn/kda.py): dt log-uniform in [1e-3, 0.1]
#     (dt_bias = softplus^-1(dt)), raw pre-activations N(0, 0.145^2), the std of the 0.4B model's
#     f_b_proj(f_a_proj(x)) at initializer_range 0.02 on unit-RMS x. Every row decays by at most ~2.6
#     nats, a quarter of the chunk-heads by more than 88 nats over 64 rows.
#   steep: raw N(0, 1), dt_bias N(-4, 1) (the data of every op figure before 448ff55): rows decay by up
#     to ~30 nats, so most chunks take the kernels' and the XLA op's elementwise (costliest) paths.
OP_GATES = ("model_init", "steep")


def kda_op_program(b, t, h, kd, docs, implementation, dt, cfg, rng, gate="model_init"):
  """`(lowered, (fn, args))`: the value and input gradients of `kda_chunked(implementation=...)` on
  lane-dense bf16 `[b, t, h*kd]` inputs with the config's gate (its inputs drawn as `gate` says:
  OP_GATES), `docs` equal documents a row."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  import jax.numpy as jnp
  from kda_plugin.ops import kda_chunked

  if gate not in OP_GATES:
    raise ValueError(f"gate must be one of {OP_GATES}, got {gate!r}")
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h * kd)), dt) for _ in range(3))
  raw_std = 0.145 if gate == "model_init" else 1.0
  g = jnp.asarray(rng.normal(size=(b, t, h * kd)) * raw_std, dt)
  beta = jnp.asarray(rng.uniform(size=(b, t, h)), jnp.float32)
  a_log = jnp.asarray(np.log(rng.uniform(1, 16, h)), jnp.float32)
  if gate == "model_init":
    dt_init = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), h * kd))
    dt_bias = jnp.asarray(np.log(np.expm1(dt_init)), jnp.float32)
  else:
    dt_bias = jnp.asarray(rng.normal(size=(h * kd,)) - 4.0, jnp.float32)
  seg = jnp.asarray(np.broadcast_to(1 + np.arange(t) * docs // t, (b, t)), jnp.int32)
  ct = jnp.asarray(rng.normal(size=(b, t, h * kd)), dt)

  def loss(q, k, v, g, beta):
    o, _ = kda_chunked(q, k, v, g, beta, segment_ids=seg, max_num_segments=docs, a_log=a_log,
                       dt_bias=dt_bias, lower_bound=cfg.kda_gate_lower_bound, use_qk_l2norm=True,
                       num_heads=h, implementation=implementation)
    return jnp.sum(o.astype(jnp.float32) * ct.astype(jnp.float32))

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  return fn.lower(q, k, v, g, beta), (fn, (q, k, v, g, beta))


# --- phase: kda-train on real text, killed and resumed ------------------------------------------------
def find_corpus(given: str) -> tuple[pathlib.Path, str]:
  """The corpus to train on and what it is: `given` (a path), else CORPUS_DEFAULT when it exists, else
  (None, "fallback"): the repository's own documentation is used (English prose, said so in the JSON)."""
  if given:
    p = pathlib.Path(given)
    if not p.is_file():
      raise SystemExit(f"--corpus {given!r}: no such file")
    return p, "given"
  if CORPUS_DEFAULT.is_file():
    return CORPUS_DEFAULT, "tinyshakespeare"
  return None, "fallback"


def docs_corpus(dest: pathlib.Path) -> pathlib.Path:
  """The repository's docs/*.md and README.md as one text file (blank-line separated paragraphs)."""
  parts = [(REPO / "README.md").read_text()] + [p.read_text() for p in sorted((REPO / "docs").rglob("*.md"))]
  dest.write_text("\n\n".join(parts))
  return dest


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
  path = run_dir / "metrics.jsonl"
  if not path.exists():
    return []
  recs = []
  for line in path.read_text().splitlines():
    try:
      recs.append(json.loads(line))
    except json.JSONDecodeError:
      continue  # a line being written
  return recs


def compile_lines(text: str) -> list[str]:
  return [ln.strip() for ln in text.splitlines() if ln.startswith(("compiling the train step", "train step ready"))]


def phase_loss(args, out: dict) -> None:
  work = pathlib.Path(args.dir)
  work.mkdir(parents=True, exist_ok=True)
  corpus, what = find_corpus(args.corpus)
  if corpus is None:
    corpus = docs_corpus(work / "docs_corpus.txt")
    what = (f"the repository's README.md and docs/*.md (no --corpus, and {CORPUS_DEFAULT.relative_to(REPO)} "
            f"does not exist)")
  out["corpus"] = {"path": str(corpus), "what": what, "bytes": corpus.stat().st_size,
                   "sha256": hashlib.sha256(corpus.read_bytes()).hexdigest()}
  steps, kill_at = (args.loss_steps, args.kill_at)
  keys = loss_keys(args, corpus)
  out.update({"command": "python -m tools.train (kda-train) " + " ".join(keys) + " output_dir=DIR",
              "steps": steps, "kill_at_or_after": kill_at})
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if args.child_platforms:
    env["JAX_PLATFORMS"] = args.child_platforms

  def launch(name, run_dir, kill=False):
    argv = [sys.executable, "-m", "tools.train", *keys, f"output_dir={run_dir}"]
    log_path = work / f"{name}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
      proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
      signalled = None
      try:
        while proc.poll() is None:
          if kill and signalled is None:
            recs = read_metrics(run_dir)
            if recs and recs[-1].get("step", 0) >= kill_at:
              proc.send_signal(signal.SIGTERM)
              signalled = recs[-1]["step"]
          time.sleep(0.05)
      finally:
        if proc.poll() is None:
          proc.kill()
        proc.wait()
    text = log_path.read_text()
    rec = {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 2), "compile_lines": compile_lines(text),
           "log_has_traceback": "Traceback" in text, "log_tail": text[-1500:]}
    if kill:
      rec["sigterm_after_step"] = signalled
    say(f"run {name}: rc {proc.returncode} in {rec['seconds']} s; " + " | ".join(rec["compile_lines"]))
    # 0, or kda-train's exit after checkpointing on the SIGTERM this phase sent (tools/train.py)
    rec["ok"] = proc.returncode == 0 or (signalled is not None and proc.returncode == INTERRUPTED_RC)
    if not rec["ok"]:
      lines = [ln for ln in text.splitlines() if ln.strip()]
      errors = [ln for ln in lines if ln.startswith("error:")]
      say(f"run {name} failed: " + (errors[-1] if errors else lines[-1] if lines else "(no output)"))
      out.setdefault("failed_runs", []).append(name)
    return rec

  a, c = work / "A_killed_then_B_resumed", work / "C_uninterrupted"
  runs = {}
  out["runs"] = runs

  def record_curve():
    """The loss curve from C (uninterrupted), or, until C has logged, from A then B (the same run, killed
    and resumed): written after every run, so a phase stopped at its budget still reports what ran."""
    recs = {r["step"]: r for r in read_metrics(c) if "loss" in r}
    source = "C_uninterrupted"
    if not recs:
      recs = {r["step"]: r for r in read_metrics(a) if "loss" in r}
      source = "A_killed then B_resumed" if recs else None
    curve_steps = [1] + list(range(10, steps + 1, 10))
    out["loss_curve_from"] = source
    out["loss_curve"] = {str(s): recs[s]["loss"] for s in curve_steps if s in recs}
    first = [recs[s]["loss"] for s in range(1, 11) if s in recs]
    last = [recs[s]["loss"] for s in range(steps - 9, steps + 1) if s in recs]
    out["loss_first10_mean"] = float(np.mean(first)) if first else None
    out["loss_last10_mean"] = float(np.mean(last)) if last else None
    out["loss_falls"] = bool(first and last and out["loss_last10_mean"] < out["loss_first10_mean"] - 0.5)
    out["seconds_per_step_median"] = (statistics.median(r["seconds_per_step"] for r in recs.values())
                                      if recs else None)
    write_json(args.json, out)
    return recs

  runs["A_killed"] = launch("A_killed", a, kill=True)
  if not runs["A_killed"]["ok"]:   # B has nothing to resume and C would fail alike
    record_curve()
    return
  killed_metrics = read_metrics(a)
  runs["A_killed"]["metrics_steps"] = [killed_metrics[0]["step"], killed_metrics[-1]["step"]] if killed_metrics else []
  record_curve()
  # imported here: the orbax checkpoint listing needs the project (this process runs on the CPU)
  from model.training import steps as train_lib
  ckpt = train_lib.TrainCheckpointer(a / "checkpoints", 3)
  resume_from = ckpt.latest_step()
  ckpt.close()
  runs["A_killed"]["checkpointed_step"] = resume_from
  if resume_from is None:   # A never reached a checkpoint (it failed, or the kill came first): nothing to resume
    runs["B_resumed"] = {"skipped": "A_killed wrote no checkpoint to resume from"}
  else:
    runs["B_resumed"] = launch("B_resumed", a)
  record_curve()
  runs["C_uninterrupted"] = launch("C_uninterrupted", c)
  record_curve()
  full = {r["step"]: r for r in read_metrics(c) if "loss" in r}   # the reference of the resume check: C only
  joined = {r["step"]: r for r in read_metrics(a) if "loss" in r}
  evals = [r for r in read_metrics(c) if "heldout_loss" in r]
  out["heldout"] = evals[-1] if evals else None
  after = [s for s in range(1, steps + 1) if resume_from is not None and s > resume_from]
  diffs = [abs(joined[s]["loss"] - full[s]["loss"]) for s in after if s in joined and s in full]
  before = [abs(joined[s]["loss"] - full[s]["loss"]) for s in range(1, (resume_from or 0) + 1)
            if s in joined and s in full]
  complete = bool(resume_from) and len(diffs) == len(after) and len(before) == resume_from
  out["resume"] = {
      "resumed_from_step": resume_from, "steps_compared_after_resume": len(diffs),
      "max_abs_loss_diff_after_resume": max(diffs) if diffs else None,
      "max_abs_loss_diff_before_kill": max(before) if before else None,
      "tolerance": 0.0,
      # null when the comparison could not be made (no checkpoint, or a run stopped early)
      "equal": (max(diffs + before) == 0.0) if complete else None,
      "why_exact": ("one device: the resumed run executes the same compiled step on the same batches (the data "
                    "iterator's position is checkpointed) from a state restored bit for bit (f32 parameters, "
                    "AdamW moments, step, PRNG key), and XLA's reductions on one device are deterministic, so "
                    "every per-step loss must be equal, not merely close"),
  }
  write_json(args.json, out)

  # The checkpoints, read back on the CPU (this process): Orbax train checkpoints and exported parameters.
  from flax import nnx
  from model import loading
  from model.checkpoint import format as checkpointing
  from model.config import load_config
  report = {"platform_reading": "cpu"}
  ckpt = train_lib.TrainCheckpointer(a / "checkpoints", 3)
  report["train_checkpoint_steps"] = ckpt.all_steps()
  latest = ckpt.latest_step()
  if latest is None:
    ckpt.close()
    report["restored_step"] = None
    out["checkpoints"] = report
    write_json(args.json, out)
    say("loss: no train checkpoint was written; resume: " + json.dumps(out["resume"]))
    return
  step_dir = a / "checkpoints" / str(latest)
  report["train_checkpoint_layout"] = sorted(str(p.relative_to(step_dir)) for p in step_dir.iterdir()) if step_dir.is_dir() else []
  cfg = load_config([*keys, f"output_dir={a}"])
  graphdef, target = train_lib.create_train_state(cfg, train_lib.optimizer_hparams(cfg))
  restored, data_state = ckpt.restore(latest, target)
  ckpt.close()
  report["restored_step"] = int(restored["step"])
  report["restored_data_step"] = int(data_state.get("step", -1)) if isinstance(data_state, dict) else None
  exports = {}
  for name, d in (("B_resumed", a), ("C_uninterrupted", c)):
    p = d / "params"
    exports[name] = checkpointing.flatten(nnx.state(loading.load_model(str(p))[0])) if checkpointing.is_checkpoint(p) else None
  report["exported_is_checkpoint"] = {k: v is not None for k, v in exports.items()}
  eb, ec = exports["B_resumed"], exports["C_uninterrupted"]
  if eb is not None and ec is not None:
    same = sorted(eb) == sorted(ec) and all(np.array_equal(np.asarray(eb[k]), np.asarray(ec[k])) for k in eb)
    report["exported_params_equal_uninterrupted"] = bool(same)
    report["exported_parameter_arrays"] = len(eb)
  restored_params = checkpointing.flatten(nnx.state(nnx.merge(graphdef, restored["params"], restored["rest"])))
  if eb is not None:
    report["train_checkpoint_params_equal_export"] = bool(all(
        np.array_equal(np.asarray(restored_params[k], np.float32), np.asarray(eb[k], np.float32)) for k in eb))
  out["checkpoints"] = report
  say("loss: " + json.dumps({k: out[k] for k in ("loss_first10_mean", "loss_last10_mean", "loss_falls")})
      + "\nresume: " + json.dumps(out["resume"]) + "\ncheckpoints: " + json.dumps(report))


PHASES = {"step": phase_step, "split": phase_split, "loss": phase_loss}
CHECK_SET = "check-set"   # not a phase: checks --set against the config the step and split phases load


def positive_int(text: str) -> int:
  """argparse type of the count flags: a whole number >= 1 (argparse names the flag in its error)."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
  return value


def batch_list(text: str) -> str:
  """argparse type of --batches: batch sizes >= 1 separated by spaces."""
  sizes = text.split()
  if not sizes or not all(b.isdigit() and int(b) >= 1 for b in sizes):
    raise argparse.ArgumentTypeError(f"expected batch sizes >= 1 separated by spaces, e.g. '8 4 1', got {text!r}")
  return text


class _Parser(argparse.ArgumentParser):
  """Bad arguments: one `prog: error: argument --flag: ...` line and exit status 2, not the whole usage."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
  summary, rest = __doc__.split("\n\n", 1)
  p = _Parser(prog="python -m tools.bench.train_device", description=summary,
              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest)
  p.add_argument("phase", choices=[*sorted(PHASES), CHECK_SET],
                 help=f"the phase to run (see below); {CHECK_SET}: only check the --set overrides against the "
                      f"step/split model config (with --smoke and --seq-len as the phase gets them), exit 2 "
                      f"naming --set-source and the bad key; no --json")
  p.add_argument("--json", help="where the phase's figures are written (as it goes); required by every phase")
  p.add_argument("--smoke", action="store_true",
                 help="step/split: a tiny model (the CPU test; --seq-len still applies); the loss phase's "
                      "model and sizes are --loss-model / --loss-set")
  p.add_argument("--set", action="append", default=[], help="step/split: key=value model override (repeatable)")
  p.add_argument("--set-source", default="--set",
                 help="what the --set overrides are called in an error (train_device_check.sh: TRAIN_MODEL_SET)")
  p.add_argument("--batches", default="8 4 1", type=batch_list,
                 help="step: batch sizes to compile, the largest that fits is timed")
  p.add_argument("--batch", type=positive_int, default=None,
                 help="split: the batch size, >= 1 (default the first of --batches)")
  p.add_argument("--seq-len", type=positive_int, default=2048,
                 help="step/split: tokens per packed row, >= 1 (default 2048)")
  p.add_argument("--donate", action=argparse.BooleanOptionalAction, default=True,
                 help="step: donate the train state to the step, as model/aot.py compiles it (default); "
                      "--no-donate: a step without donation (two train states live)")
  p.add_argument("--repeats", type=positive_int, default=5,
                 help="step/split: timed loops, >= 1; the median and spread are over them (default 5)")
  p.add_argument("--steps-per-repeat", type=positive_int, default=3,
                 help="step/split: calls dispatched per timed loop and blocked on once, >= 1 (default 3)")
  p.add_argument("--dir", default="/tmp/kda_train_device_runs", help="loss: where the runs go")
  p.add_argument("--corpus", default="", help="loss: the text to train on (default: tinyshakespeare.txt)")
  p.add_argument("--loss-model", nargs="*", default=["demo", "dtype=bfloat16"],
                 help="loss: the model config and its overrides (default: %(default)s)")
  p.add_argument("--loss-set", nargs="*", default=["seq_len=512", "batch_size=8", "max_num_segments=16",
                                                   "learning_rate=2e-3", "warmup_steps=30"],
                 help="loss: key=value of the runs, replacing the default list (default: %(default)s); "
                      "steps, checkpoint_every and output_dir come from their own flags")
  p.add_argument("--loss-steps", type=positive_int, default=300,
                 help="loss: steps of each kda-train run, >= 1 (default 300)")
  p.add_argument("--kill-at", type=positive_int, default=150,
                 help="loss: SIGTERM run A once its metrics reach this step, >= 1 and below --loss-steps (default 150)")
  p.add_argument("--checkpoint-every", type=positive_int, default=50,
                 help="loss: checkpoint_every of the kda-train runs, >= 1 (default 50)")
  p.add_argument("--child-platforms", default="", help="loss: JAX_PLATFORMS of the kda-train runs")
  p.add_argument("--cache-dir", default="", help="jax's persistent cache ('' = the default; none = off)")
  p.add_argument("--profile-top", type=int, default=None,
                 help="step only: after the timing, trace one more step with jax's profiler and report its device "
                      f"time by model part and opcode with this many largest instructions; 0: no trace "
                      f"(default {PROFILE_TOP})")
  p.add_argument("--compiled-step", default="",
                 help="step: run the train step in this file (kda-aot-compile ... mode=train "
                      "compiled_trainstep_file=FILE, for this model, the first of --batches and --seq-len, "
                      "steps=1000 warmup_steps=10) instead of compiling it")
  return p


def check_model_set(args) -> str | None:
  """The error of the step/split model config with `args.set` (keys, values, the config's own checks),
  naming `args.set_source`; None when it loads. Without the project's packages (ml_collections: the
  machine's Python before the install), only the key names are checked, against configs/base.py's text."""
  try:
    from model.config import ConfigError  # noqa: PLC0415  (needs ml_collections: absent before the install)
  except ImportError as e:   # the install has not run yet: the key names, which need no package
    keys, renamed = config_keys_from_text()
    for kv in args.set:
      if "=" not in kv:
        return f"{args.set_source}: override {kv!r} must be written key=value"
      key = kv.split("=", 1)[0].strip().lstrip("-")
      if key not in keys and key not in renamed:   # model.config's message (_unknown_key)
        import difflib  # noqa: PLC0415  (only on this error path)
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
        return (f"{args.set_source}: unknown config key {key!r}" + (f"; did you mean {', '.join(close)}?" if close
                                                                    else "") + " (see configs/base.py for every key)")
    say(f"note: {args.set_source} key names checked only ({e.name or e} is not installed here; the values are "
        f"checked when the phase loads the config)")
    return None
  try:
    step_config(args, args.batch or int(args.batches.split()[0]))
  except ConfigError as e:
    return f"{args.set_source}: {e}"
  return None


def loss_keys(args, corpus) -> list[str]:
  """The kda-train keys of the loss phase's runs (all but output_dir)."""
  return [*args.loss_model, f"train_data={corpus}", f"tokenizer_path={DEMO / 'tokenizer.model'}",
          f"steps={args.loss_steps}", *args.loss_set, "log_every=1", f"eval_every={args.loss_steps}",
          "eval_max_windows=4", f"checkpoint_every={args.checkpoint_every}", f"compilation_cache_dir={args.cache_dir}"]


def check_loss_keys(args) -> str | None:
  """The error of the loss runs' config (--loss-model, --loss-set and the phase's own keys: names, values,
  the training checks kda-train makes before it loads data), naming the flags; None when it loads."""
  from model.config import load_config  # noqa: PLC0415  (the loss phase needs the project anyway)
  from model.errors import UserError  # noqa: PLC0415
  from model.training import steps as train_lib  # noqa: PLC0415
  own = {"steps": "--loss-steps", "checkpoint_every": "--checkpoint-every", "output_dir": "--dir",
         "train_data": "--corpus", "compilation_cache_dir": "--cache-dir", "tokenizer_path": None,
         "log_every": None, "eval_every": None, "eval_max_windows": None}
  for kv in [*args.loss_model[1:], *args.loss_set]:
    key = kv.split("=", 1)[0].strip()
    if key in own:
      return (f"--loss-model / --loss-set: {key} is set by the loss phase itself"
              + (f" (use {own[key]})" if own[key] else " (the check compares runs that log every step)"))
  try:
    train_lib.check_train_config(load_config(loss_keys(args, args.corpus or CORPUS_DEFAULT)))
  except UserError as e:
    return f"--loss-model / --loss-set: {e}"
  return None


def config_keys_from_text() -> tuple[list[str], dict[str, str]]:
  """`(every key of configs/base.py, sorted as ConfigDict lists them; RENAMED: old name -> new)`, read from
  the file's text (its `c.<key> = ...` lines): no package needed."""
  import ast  # noqa: PLC0415  (only where the project's packages are not installed yet)
  tree = ast.parse((REPO / "configs" / "base.py").read_text())
  keys: set[str] = set()
  renamed: dict[str, str] = {}
  for node in ast.walk(tree):
    if not isinstance(node, ast.Assign):
      continue
    for t in node.targets:
      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "c":
        keys.add(t.attr)
      elif isinstance(t, ast.Name) and t.id == "RENAMED":
        renamed = dict(ast.literal_eval(node.value))
  return sorted(keys), renamed


def main(argv=None) -> int:
  p = build_parser()
  args = p.parse_args(argv)
  if args.phase != CHECK_SET and not args.json:
    p.error(f"the following arguments are required: --json (the phase {args.phase} writes its figures there)")
  if args.phase == "loss" and args.corpus and not pathlib.Path(args.corpus).is_file():   # before any file is made
    p.error(f"argument --corpus: no such file: {args.corpus!r} (expected the text to train on)")
  if args.compiled_step and args.phase != "step":
    p.error(f"argument --compiled-step: the step phase's only, got phase {args.phase}")
  if args.compiled_step and not pathlib.Path(args.compiled_step).is_file():
    p.error(f"argument --compiled-step: no such file: {args.compiled_step!r} (expected a step written by "
            f"kda-aot-compile ... mode=train compiled_trainstep_file=FILE)")
  if args.set and args.phase not in ("step", "split", CHECK_SET):
    p.error(f"argument --set: the step and split phases' only (phase {args.phase} takes --loss-model / --loss-set)")
  if args.phase == CHECK_SET and args.json:
    p.error(f"argument --json: {CHECK_SET} runs nothing and writes no figures")
  if args.phase != CHECK_SET and not pathlib.Path(args.json).resolve().parent.is_dir():
    p.error(f"argument --json: the directory of {args.json!r} does not exist (it is not created: give an existing one)")
  if args.profile_top is not None and args.phase != "step":
    p.error(f"argument --profile-top: the step phase's only (it traces one more train step), got phase {args.phase}")
  if args.profile_top is not None and args.profile_top < 0:
    p.error(f"argument --profile-top: expected 0 (no trace) or more, got {args.profile_top}")
  if args.profile_top is None:
    args.profile_top = PROFILE_TOP
  if args.phase == "loss" and args.kill_at >= args.loss_steps:
    p.error(f"argument --kill-at: expected fewer than --loss-steps={args.loss_steps}, got {args.kill_at} "
            f"(run A must be stopped before it ends)")
  if args.phase == "loss":   # the runs' keys, before any directory is made or a run started
    error = check_loss_keys(args)
    if error:
      print(f"error: {error}", file=sys.stderr)
      return 2
  if args.phase == CHECK_SET or (args.phase in ("step", "split") and args.set):
    error = check_model_set(args)   # a bad override is one line now, not a traceback inside the phase
    if error:
      print(f"error: {error}", file=sys.stderr)
      return 2
    if args.phase == CHECK_SET:
      say(f"{args.set_source}: ok")
      return 0
  if args.phase != "loss":   # the runs of the loss phase enable their own (compilation_cache_dir=)
    # imported in the phase that needs it: a missing package fails that phase alone, by name
    from model.engine import compilation_cache
    say(compilation_cache.enable(args.cache_dir))
  t0 = time.perf_counter()
  out = {"phase": args.phase, "smoke": args.smoke}
  from model.errors import UserError  # noqa: PLC0415  (the phases need the project; check-set has returned)
  try:
    PHASES[args.phase](args, out)
  except UserError as e:   # e.g. --compiled-step FILE that is no step, or one for another model
    out["error"] = str(e)
    print(f"error: {e}", file=sys.stderr)
    return 2
  finally:
    out["phase_s"] = round(time.perf_counter() - t0, 2)
    write_json(args.json, out)
  say(f"wrote {args.json}")
  if out.get("failed_runs"):
    print(f"error: loss: run(s) {', '.join(out['failed_runs'])} failed (their last lines above; logs in "
          f"{args.dir})", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
