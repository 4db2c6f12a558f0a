r"""Perplexity of a checkpoint on a corpus, with documents packed and long documents carried across windows.

Usage:
  python -m tools.perplexity load_parameters_path=DIR eval_data=FILE [eval_format=text|jsonl|ids]
      [tokenizer_path=FILE] [max_target_length=512] [attention=kda_native] [compare_attention=NAME]
      [compare_tolerance=X] [dump_logprobs=true] [output_json=FILE [overwrite=true]]

The model config comes from the checkpoint (DIR/config.json); any key=value of configs/base.py given
here overrides it, and the job keys apply to this run (e.g. matmul_precision=highest: float32 matmuls
on a TPU, whose default is one bfloat16 pass).

Keys:
  load_parameters_path  checkpoint directory. Required.
  eval_data             the corpus; every document in it is scored (no held-out split is taken).
  eval_format           text: documents are blocks of non-blank lines separated by blank lines;
                        jsonl: one JSON string or {"text": ...} per line; ids: one document of token
                        ids (spaces/commas) per line. text/jsonl need a tokenizer.
  tokenizer_path        sentencepiece .model; default: the checkpoint's copy, if any.
  eval_add_bos, eval_add_eos   frame text/jsonl documents with BOS / EOS (default both, as training
                        does; the EOS prediction is scored). ids documents are scored verbatim.
  max_target_length     T, tokens per window row. Documents are packed with segment IDs (they never
                        see each other); a document that does not fit continues in the next window
                        from its carried state (KDA state, conv windows, MLA latents): never truncated.
                        Documents of more than 2T tokens are scored in passes of their own whose MLA
                        cache is sized to their length (its power of two), one document per row, so a
                        book-length document costs memory for itself only (model/engine/scoring.py).
  eval_batch_size       rows (independent document streams) per window (a long-document pass has at
                        most as many rows as it has documents).
  max_num_segments      documents per row (the model's packing slots).
  compare_attention     also score with this attention backend; report the max |log-prob difference|
                        and the perplexity difference; exit status 1 when the former exceeds
                        compare_tolerance.
  dump_logprobs         add every document's token ids and per-token log-probs to output_json
                        (needs output_json).
  output_json           write the figures (and dumps) to this file, atomically (a temporary file
                        renamed over it). An existing file is refused before any work unless
                        overwrite=true.
  overwrite             true: replace an existing output_json (default false).
  ici_*_parallelism     with several devices: the mesh to score on (data, fsdp, expert, tensor; -1 =
                        the rest; default all devices on data), parameters restored sharded
                        (model/partitioning.py), window rows split over the batch axes (a window of
                        eval_batch_size rows that they do not divide is replicated there);
                        distributed_init=true starts a multi-host job (every host reads the corpus).

Reports perplexity = exp(mean negative log-likelihood per scored token), bits per byte (text/jsonl:
total NLL in bits / UTF-8 bytes of the documents), the token count and tokens/s (compilation
excluded), with a progress bar over windows. Bad input prints one `error:` line and exits with 2;
so does running out of memory, naming only the keys that lower the memory of the pass that ran out.
"""

from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm

import jax

from model import partitioning, registry
from model.config import matmul_precision
from model.data.pipeline import FORMATS, DataFormatError, read_documents, tokenize_documents
from model.engine.scoring import Scorer
from model.data.tokenizer import TokenizerError
from model.errors import UsageError
from tools import cli as common

# The scorer's names of its sizes, as this tool's keys: its out-of-memory line names those that lower
# the memory of the pass that failed (model.engine.scoring.Scorer.memory_advice).
SCORER_KEYS = {"seq_len": "max_target_length", "batch_size": "eval_batch_size", "num_slots": "max_num_segments"}
# Out of memory anywhere else (loading the parameters): no key of this tool sizes that.
OUTSIDE_SCORING = "outside the scoring windows (e.g. loading the parameters): no key of this tool lowers that"


def load_documents(cfg, tokenizer, vocab_size: int):
  """`(token documents, UTF-8 byte count or None)` of eval_data.

  Raises:
    UsageError: no eval_data, a bad eval_format, an empty corpus, BOS/EOS framing the tokenizer
      cannot do. FileNotFoundError, DataFormatError (file and line), TokenizerError.
  """
  if not cfg.eval_data:
    raise UsageError("eval_data is required: the corpus file to score")
  if cfg.eval_format not in FORMATS:
    raise UsageError(f"eval_format must be one of {list(FORMATS)}, got {cfg.eval_format!r}")
  if cfg.eval_format != "ids" and tokenizer.ids_only:
    raise TokenizerError(f"eval_format={cfg.eval_format} needs a tokenizer: pass tokenizer_path=FILE "
                                f"(or use eval_format=ids)")
  try:
    docs = read_documents(cfg.eval_data, cfg.eval_format, vocab_size=vocab_size)
  except FileNotFoundError:
    raise FileNotFoundError(f"eval_data={cfg.eval_data!r} does not exist (or is not a file)") from None
  except DataFormatError as e:
    raise DataFormatError(f"eval_data: {e}") from None
  if not docs:
    raise UsageError(f"eval_data={cfg.eval_data!r} holds no document")
  if cfg.eval_format == "ids":
    ids = [np.asarray(d, np.int32) for d in docs]
    _check_scorable(cfg, ids)
    return ids, None
  for key, tok_id, want in (("eval_add_bos", tokenizer.bos_id, cfg.eval_add_bos),
                            ("eval_add_eos", tokenizer.eos_id, cfg.eval_add_eos)):
    if want and tok_id is None:
      raise UsageError(f"{key}=true but the tokenizer has no such token; pass {key}=false")
  ids = tokenize_documents(docs, tokenizer, add_bos=cfg.eval_add_bos, add_eos=cfg.eval_add_eos)
  _check_scorable(cfg, ids)
  return ids, sum(len(d.encode("utf-8")) for d in docs)


def _check_scorable(cfg, ids) -> None:
  """UsageError when no document has a token to predict (each needs at least 2 tokens)."""
  if sum(max(int(np.size(d)) - 1, 0) for d in ids) == 0:
    raise UsageError(f"eval_data={cfg.eval_data!r}: nothing to score: every document has fewer than 2 "
                            f"tokens (the first token of a document is never predicted)")


def _progress(desc):
  return lambda it, total: tqdm(it, total=total, desc=desc, unit="window", file=sys.stderr, leave=False)


def check_windows(cfg) -> None:
  """UsageError naming max_target_length / eval_batch_size when they cannot make a window."""
  if cfg.max_target_length < 2:
    raise UsageError(f"max_target_length must be >= 2, got {cfg.max_target_length}")
  if cfg.eval_batch_size < 1:
    raise UsageError(f"eval_batch_size must be >= 1, got {cfg.eval_batch_size}")


def score(model, cfg, mcfg, docs, desc, mesh=None):
  """`ScoreResult` of `docs` under `model` with the tool's window settings (on `mesh` when given,
  with `mcfg`'s logical_axis_rules); `check_windows(cfg)` has passed."""
  pad = int(mcfg.pad_token_id) if 0 <= int(mcfg.pad_token_id) < int(mcfg.vocab_size) else 0
  scorer = Scorer(model, seq_len=cfg.max_target_length, batch_size=cfg.eval_batch_size,
                  num_slots=int(mcfg.max_num_segments), pad_id=pad, cache_multiple=cfg.prefill_length_multiple,
                  mesh=mesh, rules=None if mesh is None else mcfg, names=SCORER_KEYS)
  return scorer.score(docs, progress=_progress(desc))


def _figures(res, num_bytes):
  out = {"perplexity": res.perplexity, "num_tokens": res.num_tokens, "total_logprob": res.total_logprob,
         "tokens_per_s": res.tokens_per_s, "seconds": res.seconds, "compile_s": res.compile_s,
         "num_windows": res.num_windows}
  if num_bytes is not None:
    out["bits_per_byte"] = res.bits_per_byte(num_bytes)
    out["num_bytes"] = num_bytes
  return out


def _report(name, figs):
  bpb = f", {figs['bits_per_byte']:.4f} bits/byte" if "bits_per_byte" in figs else ""
  print(f"[{name}] perplexity {figs['perplexity']:.4f}{bpb} | {figs['num_tokens']} tokens in "
        f"{figs['num_windows']} windows, {figs['tokens_per_s']:.1f} tokens/s (compile {figs['compile_s']:.1f} s)")


def _is_writer() -> bool:
  """True in process 0: in a multi-host job every process computes the same figures, and only the
  first writes output_json (another's write would find the file there and refuse it)."""
  return jax.process_index() == 0


def run(argv: list[str]) -> int:
  """Scores as the `key=value` arguments say (see the module docstring); raises on bad input."""
  overrides, cfg = common.parse_args(argv)
  with matmul_precision(cfg.matmul_precision):   # on while the scoring programs are traced
    return _score(overrides, cfg)


def _score(overrides: list[str], cfg) -> int:
  if cfg.output_json:
    common.check_output_path(cfg.output_json, overwrite=cfg.overwrite)  # before any work, not after it
  if cfg.compare_attention:
    registry.get_backend(cfg.compare_attention, key="compare_attention")  # an unknown name fails now, not after the first pass
  if cfg.dump_logprobs and not cfg.output_json:  # the dump goes into output_json only: never drop it silently
    raise UsageError("dump_logprobs=true needs output_json=FILE (the per-token log-probs are written there)")
  if cfg.compare_tolerance < 0:
    raise UsageError(f"compare_tolerance must be >= 0, got {cfg.compare_tolerance}")
  check_windows(cfg)
  # Everything the checkpoint's config.json can judge (tokenizer, corpus) is checked before the load.
  stored = common.checkpoint_config(cfg, overrides)  # config.json read and validated once
  tokenizer = common.tokenizer_for(stored)
  docs, num_bytes = load_documents(cfg, tokenizer, int(stored.vocab_size))
  model, mcfg, mesh = common.load(stored)  # mesh None on one device
  if mesh is not None:
    print(f"scoring on {partitioning.describe_mesh(mesh)}", file=sys.stderr)
  print(f"model {mcfg.model_name} from {mcfg.load_parameters_path}: attention={mcfg.attention}, dtype={mcfg.dtype}; "
        f"{len(docs)} documents, {sum(d.size for d in docs)} tokens, windows of {cfg.eval_batch_size} x "
        f"{cfg.max_target_length}", file=sys.stderr)
  res = score(model, cfg, mcfg, docs, mcfg.attention, mesh)
  refuse_non_finite(res, mcfg.attention)
  figs = _figures(res, num_bytes)
  _report(mcfg.attention, figs)
  result = {"checkpoint": str(mcfg.load_parameters_path), "eval_data": cfg.eval_data, "eval_format": cfg.eval_format,
            "attention": mcfg.attention, "dtype": mcfg.dtype, "max_target_length": cfg.max_target_length,
            "eval_batch_size": cfg.eval_batch_size, "num_documents": len(docs), **figs}
  status = 0
  if cfg.compare_attention:
    other, ocfg, omesh = common.load(stored, [f"attention={cfg.compare_attention}"])
    ores = score(other, cfg, ocfg, docs, cfg.compare_attention, omesh)
    refuse_non_finite(ores, cfg.compare_attention)
    ofigs = _figures(ores, num_bytes)
    _report(cfg.compare_attention, ofigs)
    a = np.concatenate([lp for lp in res.logprobs] + [np.zeros(0)])
    b = np.concatenate([lp for lp in ores.logprobs] + [np.zeros(0)])
    max_diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    ppl_diff = ofigs["perplexity"] - figs["perplexity"]
    ok = max_diff <= cfg.compare_tolerance
    print(f"compare {mcfg.attention} vs {cfg.compare_attention}: max |log-prob diff| {max_diff:.3e}, "
          f"perplexity diff {ppl_diff:+.3e} -> {'OK' if ok else 'FAIL'} (tolerance {cfg.compare_tolerance:g})")
    result["compare"] = {"attention": cfg.compare_attention, **ofigs, "max_abs_logprob_diff": max_diff,
                         "perplexity_diff": ppl_diff, "tolerance": cfg.compare_tolerance, "within_tolerance": ok}
    status = 0 if ok else 1
  if cfg.dump_logprobs:
    result["documents"] = [{"index": i, "token_ids": d.tolist(), "logprobs": lp.tolist()}
                           for i, (d, lp) in enumerate(zip(docs, res.logprobs))]
  if cfg.output_json and _is_writer():
    common.write_json_atomic(cfg.output_json, result, overwrite=cfg.overwrite)
    print(f"wrote {cfg.output_json}", file=sys.stderr)
  return status


def refuse_non_finite(res, attention: str) -> None:
  """Raises UsageError naming the first document and token whose log-probability is NaN or
  infinite (a perplexity computed from it would print `nan` or `inf`, with exit status 0)."""
  for i, lp in enumerate(res.logprobs):
    bad = np.flatnonzero(~np.isfinite(lp))
    if bad.size:
      t = int(bad[0]) + 1  # entry t-1 scores token t
      raise UsageError(f"perplexity is not finite: the log-probability of token {t} of document {i} (0-based) is "
                       f"{lp[bad[0]]} with attention={attention} ({bad.size} such token(s) in that document); "
                       f"the model's logits are not finite there (`python -m tools.verify_checkpoint` checks the "
                       f"weights)")


main = common.tool_main(run, __doc__, memory_advice=lambda: OUTSIDE_SCORING)
command = common.command(main)

if __name__ == "__main__":
  command()
