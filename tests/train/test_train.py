"""tools.train end to end on the tiny config: exact resume, falling loss, held-out evaluation,
checkpoint retention, the exported parameter checkpoint, and the optimizer schedule."""

from __future__ import annotations

import json
import math
import pathlib

import jax
import numpy as np
import pytest

from flax import nnx

from model import loading
from model.checkpoint import format as checkpointing
from model.training import steps as train_lib
from model.config import load_config
from model.data.pipeline import split_heldout
from tests.train.helpers import FIRST_ID, VOCAB, counting_documents, tiny_config, write_ids_corpus
from model.training import trainer
from model.training.trainer import train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus") / "count.ids"
  write_ids_corpus(path, counting_documents(300, seed=0))
  return path


def _leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def _metrics(out):
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_matches_an_uninterrupted_run(corpus, tmp_path, monkeypatch, capsys):
  real, taken = train_lib.train_step_fn, []

  def recording(*args, **kwargs):
    fn = real(*args, **kwargs)

    def step(state, batch):
      taken.append(state)
      return fn(state, batch)
    step.compile = fn.compile
    return step
  monkeypatch.setattr(trainer.train_lib, "train_step_fn", recording)
  full = train(tiny_config(corpus, tmp_path / "full", "steps=6", "checkpoint_every=0"), progress=False)
  monkeypatch.setattr(trainer.train_lib, "train_step_fn", real)
  # kda-train donates the train state to each step (one state live, not two): every state it passed
  # in was taken by the step, the last one included
  assert len(taken) == 6 and all(x.is_deleted() for s in taken for x in jax.tree.leaves(s))
  capsys.readouterr()
  part = train(tiny_config(corpus, tmp_path / "split", "steps=6", "stop_at_step=3"), progress=False)
  assert part["step"] == 3 and part["export"] is None
  assert "resuming" not in capsys.readouterr().err   # a fresh run says nothing of the kind
  rest = train(tiny_config(corpus, tmp_path / "split", "steps=6"), progress=False)
  assert rest["start_step"] == 3 and rest["step"] == 6
  # the resumed run says where it starts from, before the compile
  err = capsys.readouterr().err.splitlines()
  line = f"resuming from step 3 (checkpoint {tmp_path / 'split' / 'checkpoints' / '3'})"
  assert line in err and err.index(line) < next(i for i, x in enumerate(err) if x.startswith("compiling the train step"))

  # Same losses step by step (the interrupted run's first three, the resumed run's last three) and
  # the same final train state, bit for bit: params, optimizer moments, step and PRNG key.
  joined = {**part["losses"], **rest["losses"]}
  assert sorted(joined) == list(range(1, 7))
  assert [joined[s] for s in range(1, 7)] == [full["losses"][s] for s in range(1, 7)]
  a, b = _leaves(full["state"]), _leaves(rest["state"])
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert int(rest["state"]["step"]) == 6
  # The run was not trivial: parameters moved away from the init.
  cfg = tiny_config(corpus, tmp_path / "x", "steps=6")
  init = train_lib.create_train_state(cfg, train_lib.optimizer_hparams(cfg))[1]
  moved = [not np.array_equal(x, y) for x, y in zip(_leaves(init["params"]), _leaves(full["state"]["params"]))]
  assert sum(moved) > len(moved) // 2

  # metrics.jsonl of the resumed run holds each step once, with the uninterrupted run's losses.
  recs = _metrics(tmp_path / "split")
  assert [r["step"] for r in recs] == list(range(1, 7))
  assert [r["loss"] for r in recs] == [r["loss"] for r in _metrics(tmp_path / "full")]
  # Checkpoints every 2 steps plus the stop step and the last one, the last 3 kept (checkpoint_keep
  # default); the uninterrupted run (checkpoint_every=0) saved only its last step.
  steps = sorted(int(p.name) for p in (tmp_path / "split" / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [3, 4, 6]
  assert [p.name for p in (tmp_path / "full" / "checkpoints").iterdir() if p.name.isdigit()] == ["6"]


def test_loss_falls_and_heldout_is_scored(corpus, tmp_path):
  cfg = tiny_config(corpus, tmp_path / "run", "steps=40", "learning_rate=1e-2", "warmup_steps=4",
                    "eval_every=20", "checkpoint_every=0")
  res = train(cfg, progress=False)
  losses = [res["losses"][s] for s in range(1, 41)]
  # At init the logits are near zero, so the first loss is about log(vocab).
  assert abs(losses[0] - math.log(VOCAB)) < 0.1
  # The documents count upward: only the first token of each is unpredictable. A model that learns
  # the successor rule beats the unigram entropy of the corpus (about log 60) by a wide margin.
  docs = counting_documents(300, seed=0)
  counts = np.bincount(np.concatenate(docs), minlength=VOCAB)[FIRST_ID:].astype(np.float64)
  p = counts / counts.sum()
  unigram_entropy = float(-(p * np.log(p)).sum())
  assert np.mean(losses[-5:]) < 0.6 * unigram_entropy, (losses[:3], losses[-5:], unigram_entropy)

  # Held-out evaluation at steps 20 and 40: finite, improving, perplexity = exp(loss), and every
  # held-out target counted once. Held-out documents are the lines after the byte cut; each is
  # framed with bos/eos, so it contributes len + 1 targets.
  text = corpus.read_text()
  heldout_docs = [line.split() for line in split_heldout(text, 0.1)[1].splitlines() if line.strip()]
  expected_tokens = sum(len(d) + 1 for d in heldout_docs)
  evals = res["evals"]
  assert sorted(evals) == [20, 40]
  for rec in evals.values():
    assert rec["heldout_tokens"] == expected_tokens
    assert rec["heldout_ppl"] == pytest.approx(math.exp(rec["heldout_loss"]), rel=1e-12)
  assert evals[40]["heldout_loss"] < evals[20]["heldout_loss"] < losses[0]
  assert [r["step"] for r in _metrics(tmp_path / "run") if "heldout_loss" in r] == [20, 40]

  # The exported parameters load with load_parameters_path alone (model.checkpoint.format's format) and
  # are the trained ones, every Variable bit for bit.
  model, loaded_cfg = loading.load_model(res["export"])
  trained = nnx.state(nnx.merge(res["graphdef"], res["state"]["params"], res["state"]["rest"]))
  got, want = checkpointing.flatten(nnx.state(model)), checkpointing.flatten(trained)
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
  assert loaded_cfg.num_hidden_layers == cfg.num_hidden_layers and loaded_cfg.tokenizer_path == ""

  # load_parameters_path starts a new run from those parameters: the first update has learning
  # rate 0 (warmup starts at 0), so after it the parameters are still exactly the loaded ones.
  tuned = train(tiny_config(corpus, tmp_path / "tune", "steps=10", "stop_at_step=1",
                            f"load_parameters_path={res['export']}"), progress=False)
  got = checkpointing.flatten(nnx.state(nnx.merge(tuned["graphdef"], tuned["state"]["params"],
                                                  tuned["state"]["rest"])))
  for name in want:
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
  assert tuned["losses"][1] < losses[0] - 1.0  # it starts from the trained model, not from scratch


def test_a_checkpoint_without_a_model_config_trains_its_own_model():
  """`kda-train load_parameters_path=DIR` and no MODEL_CONFIG: the model is DIR's config.json and the
  tokenizer its copy (it was the base 48B model with no tokenizer: three errors before a user found the
  right keys); the training keys come from the base defaults and the command line."""
  from tools.train import training_config
  demo = pathlib.Path(__file__).resolve().parents[2] / "kda_plugin" / "assets" / "demo"
  stored = json.loads((demo / "config.json").read_text())
  cfg = training_config([f"load_parameters_path={demo}", "train_data=corpus.txt", "steps=7"])
  for key in ("model_name", "hidden_size", "num_hidden_layers", "vocab_size", "kda_layers", "num_experts"):
    assert cfg[key] == stored[key], key
  assert cfg.tokenizer_path == str(demo / "tokenizer.model") and cfg.load_parameters_path == str(demo)
  assert cfg.steps == 7 and cfg.learning_rate == load_config([]).learning_rate
  assert training_config([f"load_parameters_path={demo}", "tokenizer_path=/x/t.model"]).tokenizer_path == "/x/t.model"
  named = training_config(["tiny", f"load_parameters_path={demo}"])   # a named config is the model
  assert named.model_name == load_config(["tiny"]).model_name and named.tokenizer_path == ""


def test_fine_tuning_a_checkpoint_of_another_model_names_the_config(corpus, tmp_path):
  """A named config that is not the checkpoint's: the mismatch, then what to do; nothing written."""
  demo = pathlib.Path(__file__).resolve().parents[2] / "kda_plugin" / "assets" / "demo"
  with pytest.raises(train_lib.TrainError) as e:
    train(tiny_config(corpus, tmp_path / "run", f"load_parameters_path={demo}"), progress=False)
  message = str(e.value)
  assert "the checkpoint does not match the model: " in message
  # the keys named with both values, from the checkpoint's config.json
  assert "keys that differ from its config.json: " in message
  assert "hidden_size=32 (checkpoint: 256)" in message and "model_name='tiny' (checkpoint: 'demo')" in message
  assert "kda_layers=[1] (checkpoint: [1, 2, 4, 5])" in message
  assert message.endswith("name the checkpoint's own config or none (kda-train load_parameters_path=DIR then "
                          "reads DIR/config.json), without overriding those keys")
  assert not (tmp_path / "run").exists()


def test_the_data_line_says_how_full_the_packed_rows_are(tmp_path, capsys):
  """Each row holds at most max_num_segments documents: 300 documents of 20 ids (+ bos, eos) in rows of
  1024 tokens and 4 segments fill 88 of each 1024 tokens; the line says so and what to change."""
  path = tmp_path / "short.ids"
  write_ids_corpus(path, [np.arange(FIRST_ID, FIRST_ID + 20)] * 300)
  cfg = tiny_config(path, tmp_path / "run", "seq_len=1024", "max_num_segments=4", "eval_every=0")
  it, _ = trainer.build_data(cfg, trainer._tokenizer(cfg))
  docs = int(np.sum(it.rows.segment_ids.max(axis=1)))   # the train split's documents, 4 a row
  assert it.num_rows == -(-docs // 4) and docs > 200
  filled = docs * 22 / (it.num_rows * 1024)
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"train data: {it.num_rows} packed rows of seq_len=1024, {filled:.0%} of their tokens from documents (at "
      f"most max_num_segments=4 documents a row); most rows hold the most documents a row may: raise "
      f"max_num_segments or lower seq_len to pack more")


def test_schedule_warmup_then_cosine():
  # Independent formula: linear warmup from 0, then lr_end + (lr - lr_end) (1 + cos(pi t)) / 2.
  steps, lr, warmup, final = 100, 2e-3, 10, 0.1
  sched = train_lib.learning_rate_schedule((steps, lr, warmup, final, 0.1, 0.9, 0.95, 1e-8, 1.0))
  for s in [0, 1, 5, 10, 11, 40, 77, 100]:
    if s <= warmup:
      want = lr * s / warmup
    else:
      t = (s - warmup) / (steps - warmup)
      want = lr * final + (lr - lr * final) * (1 + math.cos(math.pi * t)) / 2
    assert float(sched(s)) == pytest.approx(want, rel=1e-5, abs=1e-12), s


def _adamw_oracle(w, grads, hp):
  """NumPy float64 AdamW (Loshchilov & Hutter 2019, as optax.adamw with eps_root=0) with global-norm
  clipping, decay on ndim >= 2 only and the warmup-cosine schedule: the parameters after each step."""
  steps, lr, warmup, final, wd, b1, b2, eps, clip = hp

  def lr_at(s):
    if s <= warmup:
      return lr * s / warmup if warmup else lr
    t = (s - warmup) / (steps - warmup)
    return lr * final + (lr - lr * final) * (1 + math.cos(math.pi * t)) / 2

  w = {k: v.astype(np.float64) for k, v in w.items()}
  m = {k: np.zeros_like(v) for k, v in w.items()}
  v2 = {k: np.zeros_like(v) for k, v in w.items()}
  out = []
  for t, g in enumerate(grads, 1):
    g = {k: x.astype(np.float64) for k, x in g.items()}
    norm = math.sqrt(sum(float((x ** 2).sum()) for x in g.values()))
    if clip > 0 and norm > clip:
      g = {k: x * clip / norm for k, x in g.items()}
    for k in w:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
      u = (m[k] / (1 - b1 ** t)) / (np.sqrt(v2[k] / (1 - b2 ** t)) + eps)
      if w[k].ndim >= 2:
        u = u + wd * w[k]
      w[k] = w[k] - lr_at(t - 1) * u
    out.append({k: x.copy() for k, x in w.items()})
  return out


@pytest.mark.parametrize("clip", [0.0, 0.3])
def test_optimizer_matches_a_numpy_adamw_with_clipping_and_decay_mask(clip):
  import optax
  hp = (6, 0.05, 2, 0.2, 0.3, 0.9, 0.95, 1e-8, clip)
  rng = np.random.default_rng(3)
  w = {"mat": rng.normal(size=(3, 4)).astype(np.float32), "vec": rng.normal(size=(4,)).astype(np.float32)}
  # Gradients of very different norms, so that clipping (at 0.3) acts on some steps only.
  grads = [{k: (rng.normal(size=x.shape) * scale).astype(np.float32) for k, x in w.items()}
           for scale in (2.0, 0.01, 1.0, 0.05, 3.0)]
  tx = train_lib.make_optimizer(hp)
  state, params = tx.init(w), dict(w)
  want = _adamw_oracle(w, grads, hp)
  for g, expected in zip(grads, want):
    upd, state = tx.update(g, state, params)
    params = optax.apply_updates(params, upd)
    for k in w:
      np.testing.assert_allclose(np.asarray(params[k], np.float64), expected[k], rtol=2e-5, atol=2e-6)
  # The oracle itself distinguishes the cases: clipping and the decay mask change the result.
  if clip:
    assert not np.allclose(_adamw_oracle(w, grads, hp[:-1] + (0.0,))[-1]["mat"], want[-1]["mat"], atol=1e-4)


def test_sigterm_checkpoints_the_current_step_and_resume_continues(corpus, tmp_path, monkeypatch):
  import os
  import signal

  import tools.train as train_tool

  real = train_lib.train_step_fn

  def killing_step_fn(*args, **kwargs):
    fn = real(*args, **kwargs)

    def step(state, batch):
      if int(state["step"]) == 3:  # a scheduler preempts the job as the fourth update starts
        os.kill(os.getpid(), signal.SIGTERM)
      return fn(state, batch)
    return step

  monkeypatch.setattr(trainer.train_lib, "train_step_fn", killing_step_fn)
  out = tmp_path / "run"
  with pytest.raises(KeyboardInterrupt):
    train(tiny_config(corpus, out, "steps=6", "checkpoint_every=0"), progress=False)
  # held while the step takes the donated state: raised once step 4's state is bound, which is checkpointed
  saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
  assert saved == [4]
  assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
  monkeypatch.setattr(trainer.train_lib, "train_step_fn", real)
  rest = train(tiny_config(corpus, out, "steps=6", "checkpoint_every=0"), progress=False)
  assert rest["start_step"] == 4 and sorted(rest["losses"]) == [5, 6]
  full = train(tiny_config(corpus, tmp_path / "full", "steps=6", "checkpoint_every=0"), progress=False)
  assert [r["loss"] for r in _metrics(out)] == [full["losses"][s] for s in range(1, 7)]
  assert signal.getsignal(signal.SIGTERM) is not trainer._raise_interrupt  # handler restored


@pytest.mark.parametrize("existing", [False, True])
def test_sigterm_before_the_first_step_says_nothing_was_saved(corpus, tmp_path, monkeypatch, capsys, existing):
  import os
  import signal

  import tools.train as train_tool

  def killing_step_fn(*args, **kwargs):
    def step(state, batch):  # preempted while the first step compiles: no step completes
      os.kill(os.getpid(), signal.SIGTERM)
      raise AssertionError("SIGTERM did not interrupt")
    return step

  monkeypatch.setattr(trainer.train_lib, "train_step_fn", killing_step_fn)
  out = tmp_path / "run"
  if existing:
    out.mkdir()
    (out / "notes.txt").write_text("mine")
  with pytest.raises(KeyboardInterrupt):
    # overwrite=true: a directory holding other files is only used when asked for (tools.train refuses it otherwise)
    train(tiny_config(corpus, out, "steps=3", *(["overwrite=true"] if existing else [])), progress=False)
  err = capsys.readouterr().err
  assert "no step was completed and nothing was saved" in err, err
  # What the run created is gone; a directory that was there before keeps only what it held.
  assert (sorted(os.listdir(out)) == ["notes.txt"]) if existing else not out.exists()
  assert signal.getsignal(signal.SIGTERM) is not trainer._raise_interrupt


def _oom_at(real, at_step):
  """A `train_step_fn` whose step raises XLA's RESOURCE_EXHAUSTED (nothing allocated) when the state
  is at step `at_step`, and runs the real step otherwise."""
  def step_fn(*args, **kwargs):
    fn = real(*args, **kwargs)

    def step(state, batch):
      if int(state["step"]) == at_step:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 123456789 bytes.\ndetail")
      return fn(state, batch)
    return step
  return step_fn


def _argv(corpus, out, *extra):
  from tests.train.helpers import BATCH, SEQ_LEN, TWO_LAYERS
  return ["tiny", *TWO_LAYERS, f"train_data={corpus}", "train_data_format=ids", f"output_dir={out}",
          f"seq_len={SEQ_LEN}", f"batch_size={BATCH}", "warmup_steps=2", "log_every=1", "eval_every=0",
          "checkpoint_every=2", "learning_rate=3e-3", *extra]


# slow (about 50 s of CPU): make test keeps the pre-step memory check (test_step_memory_is_checked_before_the_first_step).
@pytest.mark.slow
def test_out_of_memory_is_one_error_line_and_keeps_the_last_checkpoint(corpus, tmp_path, monkeypatch, capsys):
  """XLA's RESOURCE_EXHAUSTED in a step (simulated: the step raises it) is one `error:` line with exit 2
  (the shared tools.cli wording, then the keys to lower and the last checkpoint); the
  checkpoint written before it is untouched: resuming from it gives the uninterrupted run."""
  import tools.train as train_tool

  real = train_lib.train_step_fn
  xla = "RESOURCE_EXHAUSTED: Out of memory allocating 123456789 bytes."
  monkeypatch.setattr(trainer.train_lib, "train_step_fn", _oom_at(real, 3))  # steps 1-3 done, 2 saved
  out = tmp_path / "run"
  assert train_tool.main(_argv(corpus, out, "steps=4")) == 2
  err = capsys.readouterr().err.strip().splitlines()
  advice = trainer.memory_advice(load_config(_argv(corpus, out, "steps=4")))
  # remat_policy=full is the default: the advice names only the keys left to change
  assert advice.startswith(f"lower {train_tool.MEMORY_KEYS}, or set moe_impl=") and "remat_policy" not in advice
  assert err[-1] == (f"error: out of memory ({xla}): {advice}; nothing was lost beyond the "
                     f"last checkpoint, step 2 in {out / 'checkpoints'}, which is intact (resuming needs the same "
                     f"batch_size and seq_len; eval_batch_size may change)"), err
  assert not any("Traceback" in line for line in err)
  assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [2]

  monkeypatch.setattr(trainer.train_lib, "train_step_fn", real)
  rest = train(tiny_config(corpus, out, "steps=4"), progress=False)
  assert rest["start_step"] == 2 and sorted(rest["losses"]) == [3, 4]
  full = train(tiny_config(corpus, tmp_path / "full", "steps=4"), progress=False)
  assert [rest["losses"][s] for s in (3, 4)] == [full["losses"][s] for s in (3, 4)]
  for x, y in zip(_leaves(full["state"]), _leaves(rest["state"])):
    np.testing.assert_array_equal(x, y)


def test_out_of_memory_in_the_first_step_says_there_is_no_checkpoint(corpus, tmp_path, monkeypatch, capsys):
  import tools.train as train_tool

  monkeypatch.setattr(trainer.train_lib, "train_step_fn", _oom_at(train_lib.train_step_fn, 0))
  out = tmp_path / "run"
  assert train_tool.main(_argv(corpus, out, "steps=4")) == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith("error: out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 123456789 bytes.): "
                        "lower batch_size or seq_len"), err
  assert err.endswith("; no checkpoint had been written yet, so there is nothing to resume"), err
  assert not out.exists()  # the run created it and completed nothing

  def other(*args, **kwargs):
    def step(state, batch):
      raise jax.errors.JaxRuntimeError("INTERNAL: not a memory error")
    return step
  monkeypatch.setattr(trainer.train_lib, "train_step_fn", other)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # anything else is not hidden
    train_tool.main(_argv(corpus, out, "steps=4"))


def test_step_memory_is_checked_before_the_first_step(corpus, tmp_path, monkeypatch, capsys):
  """Was: seq_len=100000 failed only after 10 dispatched steps (a 7 TB allocation) and left an empty
  checkpoints/ and metrics.jsonl. Now XLA's compile-time memory_analysis() of the step is compared with the
  device's memory (here made 1 kB) before any step runs; the run directory it created is removed."""
  import tools.train as train_tool

  real = train_lib.train_step_fn
  ran = []

  def counting(*args, **kwargs):
    fn = real(*args, **kwargs)

    def step(state, batch):
      ran.append(1)
      return fn(state, batch)
    step.compile = fn.compile
    return step
  monkeypatch.setattr(trainer.train_lib, "train_step_fn", counting)
  monkeypatch.setattr(trainer.train_lib, "available_memory_bytes", lambda device: (1000, True))
  out = tmp_path / "run"
  assert train_tool.main(_argv(corpus, out, "steps=4", "remat_policy=none")) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len([ln for ln in err if ln.startswith("error:")]) == 1, err
  assert err[-1].startswith("error: out of memory (a train step needs ") and "the host has 0.0 MiB available" in err[-1]
  advice = trainer.memory_advice(load_config(_argv(corpus, out, "steps=4", "remat_policy=none")))
  assert f"{advice}; checked before the first step, nothing was run" in err[-1], err
  # the keys to change beyond the batch: remat (none here) and the experts (dense on a CPU)
  # remat_policy=none here (the default is full), so the advice names it
  assert "remat_policy=full (now none;" in advice and "moe_impl=megablox on one TPU device or ragged elsewhere (now auto" in advice
  assert ran == [] and not out.exists()
  out.mkdir()  # a directory that existed (empty) is left empty: no checkpoints/ or metrics.jsonl
  assert train_tool.main(_argv(corpus, out, "steps=4", "remat_policy=none")) == 2
  assert list(out.iterdir()) == [] and ran == []


def test_step_memory_figure_is_xla_s():
  """The figure compared is XLA's: temporaries + outputs (+ arguments on an accelerator) of a compiled step."""
  c = jax.jit(lambda x: (x @ x).sum(0)).lower(jax.ShapeDtypeStruct((256, 256), jax.numpy.float32)).compile()
  ma = c.memory_analysis()
  assert train_lib.step_bytes_needed(c, arguments_resident=True) == (
      ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)
  assert train_lib.step_bytes_needed(c, arguments_resident=False) >= 256 * 256 * 4
  have, resident = train_lib.available_memory_bytes(jax.devices()[0])
  assert resident and have > 0


def test_a_swallowed_sigterm_is_raised_again_and_a_held_one_on_release():
  """A SIGTERM's KeyboardInterrupt raised where Python discards exceptions (jax's gc callback: the
  run went on to its last step and exited 0) is raised again by `check` before the next step; one that
  lands in a held block (a checkpoint write, a step taking the donated state) is raised as it ends,
  even when the block failed."""
  import signal

  ints = trainer._Interrupts()
  try:
    ints.handler(signal.SIGTERM, None)
  except KeyboardInterrupt:
    pass   # swallowed, as in a gc callback
  with pytest.raises(KeyboardInterrupt, match="signal 15"):
    ints.check()
  ints.check()   # raised once
  ran = []
  with pytest.raises(KeyboardInterrupt, match="signal 15"):
    with ints.hold():
      ints.handler(signal.SIGTERM, None)   # held: not raised here
      ran.append(1)
  assert ran == [1]
  with pytest.raises(KeyboardInterrupt):
    with ints.hold():
      ints.handler(signal.SIGTERM, None)
      raise ValueError("the held block failed")
  ints.check()   # a held interrupt is not raised a second time
