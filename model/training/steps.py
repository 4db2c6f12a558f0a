"""Training building blocks for `tools.train`: the train state, the optimizer, the jitted train and
eval steps, the Orbax train-state checkpoints and the resume-compatibility check.

The train state is a plain dict pytree (what Orbax saves and restores as one item)::

  {"params":    nnx.State of the model's nnx.Param leaves (float arrays, the model's weight_dtype),
   "rest":      nnx.State of every other Variable (the MoE RouterBias; never touched by gradients),
   "opt_state": the optax state of `make_optimizer(cfg)` over "params",
   "step":      int32 scalar, optimizer steps taken,
   "rng":       uint32 key data of the training PRNG key (`jax.random.key_data`)}

Together with the data iterator's position (`BatchIterator.state`, saved beside it as JSON) this is
everything a run depends on, so resuming from a checkpoint continues bit-for-bit like the run that
wrote it (same batches, same updates; XLA on one device is deterministic).

Loss: token-level cross entropy `-log softmax(logits)[target]` in float32, summed where
`loss_mask` is True (padding and the last token of each document are excluded, see
`model.data.pipeline`) and divided by the number of such tokens.

Optimizer (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019; optax.adamw):
`clip_by_global_norm(grad_clip_norm)` then AdamW with learning rate
`optax.warmup_cosine_decay_schedule(0 -> learning_rate over warmup_steps, cosine to
learning_rate * lr_final_fraction at steps)`; weight decay only on parameters with ndim >= 2
(matrices, stacked experts, embeddings), never on norm scales, biases, A_log or dt_bias.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from model.errors import UserError
from model import loading, memory, partitioning
from model.nn import moe
from model.nn.kimi_linear import KimiLinearForCausalLM

STATE_ITEM, DATA_ITEM, META_ITEM = "state", "data", "meta"

# Keys that may change between a run and its resumption: where files live, how often to log,
# evaluate, checkpoint or export, and implementation choices that compute the same function.
# Every other key (model shape, data, optimizer, seeds, steps) must match the checkpoint.
RESUME_FREE_KEYS = frozenset({
    "output_dir", "overwrite", "resume", "stop_at_step", "checkpoint_every", "checkpoint_keep", "eval_every",
    "eval_batch_size", "eval_max_windows", "log_every", "export_every", "export_dtype", "train_data",
    "tokenizer_path", "load_parameters_path", "attention", "kda_implementation", "kda_impl", "moe_impl", "mla_impl", "model_name",
    "logical_axis_rules", "distributed_init", "coordinator_address", "num_processes", "process_id",
})
_RESUME_FREE_PREFIXES = ("ici_", "dcn_")


class TrainError(UserError):
  """A training run that cannot start or continue (bad data, config or checkpoint); the message
  names the config key or path at fault and what was expected."""


# ------------------------------------------------------------------------------------------------
# Optimizer
# ------------------------------------------------------------------------------------------------

def optimizer_hparams(cfg) -> tuple:
  """The hashable tuple of config values that define the optimizer (a cache key for jitted steps)."""
  return (int(cfg.steps), float(cfg.learning_rate), int(cfg.warmup_steps), float(cfg.lr_final_fraction),
          float(cfg.weight_decay), float(cfg.adam_b1), float(cfg.adam_b2), float(cfg.adam_eps),
          float(cfg.grad_clip_norm))


def check_train_config(cfg) -> None:
  """Range checks of the training keys (the model keys are checked by `model.config`).

  Raises:
    TrainError: naming the key, its value and the expected range.
  """
  def need(cond, key, expected):
    if not cond:
      raise TrainError(f"{key}={cfg[key]!r} is invalid: expected {expected}")
  for key in ("steps", "seq_len", "batch_size", "eval_batch_size", "log_every", "checkpoint_keep"):
    need(cfg[key] >= 1, key, "an integer >= 1")
  for key in ("warmup_steps", "checkpoint_every", "eval_every", "eval_max_windows", "export_every",
              "stop_at_step"):
    need(cfg[key] >= 0, key, "an integer >= 0")
  need(cfg.seq_len >= 2, "seq_len", "an integer >= 2 (a token and its target)")
  need(cfg.warmup_steps < cfg.steps, "warmup_steps", f"fewer than steps={cfg.steps}")
  need(cfg.learning_rate > 0, "learning_rate", "a number > 0")
  need(0.0 <= cfg.lr_final_fraction <= 1.0, "lr_final_fraction", "a number in [0, 1]")
  need(cfg.weight_decay >= 0, "weight_decay", "a number >= 0")
  need(0.0 <= cfg.adam_b1 < 1.0, "adam_b1", "a number in [0, 1)")
  need(0.0 <= cfg.adam_b2 < 1.0, "adam_b2", "a number in [0, 1)")
  need(cfg.adam_eps > 0, "adam_eps", "a number > 0")
  need(cfg.grad_clip_norm >= 0, "grad_clip_norm", "a number >= 0 (0 = no clipping)")
  need(math.isfinite(cfg.router_bias_update_rate) and cfg.router_bias_update_rate >= 0, "router_bias_update_rate",
       "a finite number >= 0 (0 = no load balancing)")
  need(0.0 < cfg.heldout_fraction < 1.0, "heldout_fraction", "a number in (0, 1)")
  need(cfg.train_data_format in ("text", "jsonl", "ids"), "train_data_format", "'text', 'jsonl' or 'ids'")
  need(cfg.split_long in ("long", "fill", "none"), "split_long", "'long', 'fill' or 'none'")
  need(cfg.export_dtype in ("float32", "bfloat16"), "export_dtype", "'float32' or 'bfloat16'")


def learning_rate_schedule(hparams: tuple) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine decay to peak * lr_final_fraction at `steps`."""
  steps, lr, warmup, final, *_ = hparams
  return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=lr, warmup_steps=warmup,
                                            decay_steps=steps, end_value=lr * final)


def _decay_mask(params):
  return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def make_optimizer(hparams: tuple) -> optax.GradientTransformation:
  """Gradient clipping + AdamW with the warmup-cosine schedule (see the module docstring).

  Args:
    hparams: `optimizer_hparams(cfg)`.
  """
  _, _, _, _, wd, b1, b2, eps, clip = hparams
  adamw = optax.adamw(learning_rate_schedule(hparams), b1=b1, b2=b2, eps=eps, weight_decay=wd,
                      mask=_decay_mask)
  return optax.chain(optax.clip_by_global_norm(clip), adamw) if clip > 0 else adamw


# ------------------------------------------------------------------------------------------------
# Train state
# ------------------------------------------------------------------------------------------------

def split_model(model: KimiLinearForCausalLM):
  """`(graphdef, params, rest)`: trainable `nnx.Param`s and every other Variable."""
  return nnx.split(model, nnx.Param, ...)


def init_train_state(model: KimiLinearForCausalLM, hparams: tuple, seed: int, mesh=None):
  """`(graphdef, state)` of `model` with a fresh optimizer state at step 0 and the PRNG key of `seed`.

  With a `mesh` (the model's arrays already live on it), the optimizer moments, made with
  `zeros_like`, follow the parameters, and the step, key and optimizer counts are replicated on the
  mesh too (a restore keeps these placements)."""
  graphdef, params, rest = split_model(model)
  state = {"params": params, "rest": rest, "opt_state": make_optimizer(hparams).init(params),
           "step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(jax.random.key(int(seed)))}
  return graphdef, (state if mesh is None else partitioning.replicate_off_mesh(state, mesh))


def create_train_state(cfg, hparams: tuple, mesh=None):
  """`(graphdef, state)` of a model randomly initialised from `cfg.init_seed`, a fresh optimizer
  state and the PRNG key of `cfg.train_seed`.

  Runs eagerly: on CPU, compiling the whole initialisation as one program takes longer than
  running its ops one by one. With a `mesh` (`model.partitioning.create_mesh(cfg)`), the parameters
  are placed by their logical axes (`cfg.logical_axis_rules`) and the optimizer moments, made with
  `zeros_like`, follow them; trace the step inside `model.partitioning.mesh_context(mesh, cfg)`.
  """
  model = loading.create(cfg)  # eager, on one device
  if mesh is not None:
    nnx.update(model, loading.shard_state(nnx.state(model), cfg, mesh))
  return init_train_state(model, hparams, int(cfg.train_seed), mesh)


def masked_nll(logits, targets, loss_mask):
  """Summed cross entropy and token count over `loss_mask`.

  Args:
    logits: `[B, T, V]` (any float dtype; computed in float32).
    targets: int32 `[B, T]`. loss_mask: bool `[B, T]`.

  Returns:
    `(sum_nll float32 [], count float32 [])` in nats.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  mask = loss_mask.astype(jnp.float32)
  return jnp.sum(nll * mask), jnp.sum(mask)


# Tokens (batch rows x positions) per block of the training loss (`blocked_nll`): the logits of one
# block, their float32 log-softmax and its gradient are all the loss holds at once (2048 x 32000
# float32 is 250 MiB; the whole 8 x 2048 batch would be 2 GiB each).
LOSS_BLOCK_TOKENS = 2048


def blocked_nll(head, hidden, targets, loss_mask, *, block_tokens: int = LOSS_BLOCK_TOKENS):
  """`masked_nll(head(hidden), targets, loss_mask)`, formed one block of positions at a time.

  The positions are cut into blocks of `max(1, block_tokens // B)` (the last padded, masked out) and
  a `lax.scan` sums each block's `masked_nll`; each block is a `jax.checkpoint`, so the backward pass
  recomputes that block's logits from its hidden states instead of keeping `[B, T, vocab]` logits,
  their float32 log-softmax and its gradient for the whole batch. The batch axis is never split
  (it stays sharded as the hidden states are). Equal to the unblocked loss up to the order of the
  float32 sums.

  Args:
    head: `[B, P, d] -> [B, P, V]` logits (the model's `head`).
    hidden: `[B, T, d]` the LM head's input. targets: int32 `[B, T]`. loss_mask: bool `[B, T]`.
    block_tokens: tokens per block (>= 1); one block (no scan) when the batch fits in it.

  Returns:
    `(sum_nll float32 [], count float32 [])` in nats, as `masked_nll`.
  """
  b, t, _ = hidden.shape
  per = max(1, min(t, int(block_tokens) // max(b, 1)))
  if per >= t:
    return masked_nll(head(hidden), targets, loss_mask)
  n = -(-t // per)
  pad = n * per - t
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    loss_mask = jnp.pad(loss_mask, ((0, 0), (0, pad)))
  blocks = lambda x: jnp.moveaxis(x.reshape((b, n, per) + x.shape[2:]), 1, 0)     # [n, B, per, ...]
  one = jax.checkpoint(lambda h, tg, m: masked_nll(head(h), tg, m), prevent_cse=False)

  def body(acc, xs):
    s, c = one(*xs)
    return (acc[0] + s, acc[1] + c), None

  zero = jnp.zeros((), jnp.float32)
  (total, count), _ = jax.lax.scan(body, (zero, zero), (blocks(hidden), blocks(targets), blocks(loss_mask)))
  return total, count


def _moe_blocks(model) -> list:
  """`(path, block)` of the model's `moe.SparseMoeBlock`s, in layer order."""
  return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, moe.SparseMoeBlock)]


def _forward_with_load(model, inputs, segment_ids, num_slots: int):
  """`(hidden, load)`: the forward in mode "train" of `model` up to the LM head (`final_hidden`;
  merged inside the step, or eagerly),
  with every MoE block recording its expert choices (`nnx.capture` of the `routed_experts`
  intermediates); `load` float32 `[L_moe, E]` counts the (non-padding token, choice) pairs each block
  routed to each expert (`moe.expert_load`)."""
  blocks = _moe_blocks(model)
  for _, b in blocks:
    b.record_routing = True
  hidden, inter = nnx.capture(lambda m, *a, **k: m.final_hidden(*a, **k), nnx.Intermediate)(
      model, inputs, segment_ids, mode="train", max_num_segments=num_slots)
  flat = dict(nnx.to_flat_state(inter))
  mask = jnp.reshape(segment_ids > 0, (-1,))
  loads = [moe.expert_load(flat[tuple(path) + ("routed_experts",)].get_value()[0], mask,
                           b.gate.e_score_correction_bias.shape[0]) for path, b in blocks]
  return hidden, jnp.stack(loads)


def expert_load(graphdef, state, batch, num_slots: int):
  """float32 `[L_moe, E]`: tokens the model of train state `state` routes to each expert of each MoE
  layer on `batch` (a forward in mode "train", no update; padding, segment id 0, not counted).
  Eager (not jitted): a diagnostic for tests and tools, e.g. the imbalance `max(load) / mean(load)`."""
  get = batch.get if isinstance(batch, dict) else functools.partial(getattr, batch)
  model = nnx.merge(graphdef, state["params"], state["rest"])
  return _forward_with_load(model, jnp.asarray(get("inputs")), jnp.asarray(get("segment_ids")), num_slots)[1]


@functools.lru_cache(maxsize=8)
def train_step_fn(graphdef, hparams: tuple, num_slots: int, router_bias_update_rate: float = 0.0, *,
                  donate: bool = False):
  """The jitted step `(state, batch) -> (new_state, metrics)`; cached so that runs of the same
  model and optimizer (a resumed run in the same process, tests) reuse one compilation.

  `donate`: the step takes `state`'s buffers for the new state (updated in place), so one train state
  is live instead of two; the `state` passed in is deleted by the call and must not be used again
  (kda-train donates; callers that step one state twice, as tests comparing two steps do, do not).

  `batch` holds `inputs, targets, loss_mask, segment_ids` `[B, T]` (a `model.data.pipeline.Batch`
  or a dict). The forward runs in mode "train", i.e. through the backend's differentiable op
  (`kda_chunked` for kda_native). metrics: loss (mean nats per target token), tokens (targets in
  the batch), grad_norm (global L2 norm before clipping), lr (the rate used for this update).

  `router_bias_update_rate` > 0 turns on auxiliary-loss-free load balancing (`model.nn.moe`): with the
  loads `[L_moe, E]` of this step's routing (top-k of the biased scores, non-padding tokens), every
  MoE layer's `e_score_correction_bias` (in state["rest"], not seen by the optimizer) becomes
  `moe.balanced_bias(bias, load, rate)`, and metrics gain "expert_load" (the loads). 0 (the default)
  traces exactly the step without balancing: nothing is recorded and "rest" is passed through.
  """
  rate = float(router_bias_update_rate)
  tx = make_optimizer(hparams)
  schedule = learning_rate_schedule(hparams)

  def step(state, inputs, targets, loss_mask, segment_ids):
    def loss_fn(params):
      model = nnx.merge(graphdef, params, state["rest"])
      load = None
      if rate > 0:
        hidden, load = _forward_with_load(model, inputs, segment_ids, num_slots)
      else:
        hidden = model.final_hidden(inputs, segment_ids, mode="train", max_num_segments=num_slots)
      total, count = blocked_nll(model.head, hidden, targets, loss_mask)
      return total / jnp.maximum(count, 1.0), (count, load)

    (loss, (count, load)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    # The key advances every step (reserved for stochastic layers; the model has none today), so a
    # resumed run continues the same key sequence.
    rng, _ = jax.random.split(jax.random.wrap_key_data(state["rng"]))
    rest = state["rest"]
    if load is not None:  # load balancing: outside gradient descent, from this step's routing
      model = nnx.merge(graphdef, state["params"], rest)
      for (_, block), block_load in zip(_moe_blocks(model), load):
        bias = block.gate.e_score_correction_bias
        bias[...] = moe.balanced_bias(bias[...], block_load, rate)
      rest = split_model(model)[2]
    new = {"params": params, "rest": rest, "opt_state": opt_state, "step": state["step"] + 1,
           "rng": jax.random.key_data(rng)}
    metrics = {"loss": loss, "tokens": count, "grad_norm": optax.tree.norm(grads),
               "lr": schedule(state["step"])}
    if load is not None:
      metrics["expert_load"] = load
    return new, metrics

  jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
  compiled = {}

  def fields(batch):
    get = batch.get if isinstance(batch, dict) else functools.partial(getattr, batch)
    return tuple(jnp.asarray(get(k)) for k in BATCH_FIELDS)

  def run(state, batch):
    args = fields(batch)
    exe = compiled.get("exe")
    if exe is not None:  # the executable `compile` built (and measured): one compilation, not two
      return exe(state, *args)
    return jitted(state, *args)

  # The un-jitted step `(state, inputs, targets, loss_mask, segment_ids) -> (new_state, metrics)`, for
  # callers that jit it their own way (model/aot.py: donated state, abstract sharded arguments).
  run.step = step

  def compile_step(state, batch, *, reuse: bool = True):
    """Compiles the step for these arrays and returns the `jax.stages.Compiled` (its
    `memory_analysis()` is what one step needs); with `reuse` later calls run this executable."""
    exe = jitted.lower(state, *fields(batch)).compile()
    compiled["exe"] = exe if reuse else None
    return exe

  def install(exe):
    """Later calls run `exe` (e.g. a step compiled ahead of time, `model.training.compiled_step`)."""
    compiled["exe"] = exe

  run.compile = compile_step
  run.install = install
  return run


def step_bytes_needed(compiled, *, arguments_resident: bool) -> int | None:
  """Bytes one call of `compiled` needs by XLA's compile-time `memory_analysis()`: temporaries plus
  outputs not aliased to inputs, plus the arguments unless they are already `arguments_resident`
  (counted in the memory the caller compares against). None when the backend reports no analysis."""
  try:
    ma = compiled.memory_analysis()
  except (NotImplementedError, jax.errors.JaxRuntimeError):
    return None
  if ma is None:
    return None
  need = int(ma.temp_size_in_bytes) + int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes)
  if not arguments_resident:
    need += int(ma.argument_size_in_bytes) + int(ma.generated_code_size_in_bytes)
  return need


available_memory_bytes = memory.available_memory_bytes  # the step's budget (model/memory.py)


BATCH_FIELDS = ("inputs", "targets", "loss_mask", "segment_ids")


def feed_on_mesh(it, mesh, rules_or_cfg=None):
  """Makes batch iterator `it` build only this process's rows of each global batch and returns
  `to_global(batch) -> dict` of the global `[B, T]` arrays of `BATCH_FIELDS` for `train_step_fn`.

  Each process gathers only its rows (`model.partitioning.process_rows` of the batch sharding: with the
  `data` axis across hosts, 1/P of the batch) and `model.partitioning.global_batch`
  (`jax.make_array_from_process_local_data`) assembles the global array from every process's block.
  On one process the whole batch, placed by the batch sharding, with the same values.

  Args:
    it: a `model.data.pipeline.BatchIterator` (its `process_rows` is set). mesh: the job's mesh.
    rules_or_cfg: logical_axis_rules (a config or parsed rules; default the base rules).

  Raises:
    model.config.ConfigError: a mesh whose batch axes give this process non-contiguous rows.
  """
  shape = (it.batch_size, int(it.rows.inputs.shape[1]))
  it.process_rows = partitioning.process_rows(mesh, shape, rules_or_cfg=rules_or_cfg)

  def to_global(batch):
    return {k: partitioning.global_batch(getattr(batch, k), mesh, shape, rules_or_cfg=rules_or_cfg) for k in BATCH_FIELDS}

  return to_global


@functools.lru_cache(maxsize=8)
def eval_step_fn(graphdef, num_slots: int):
  """The jitted `(params, rest, window) -> (sum_nll, count)` over one held-out window.

  The forward runs in mode "train" (forward only): the held-out loss is then measured with the
  very op the gradients go through, whatever state the inference kernels are in; the model has no
  dropout, so train and eval modes compute the same function. Each window is scored on its own: a
  document continued from the previous window starts without that window's state, so this loss is
  slightly pessimistic (`tools.perplexity` carries the state across windows)."""

  @jax.jit
  def step(params, rest, inputs, targets, loss_mask, segment_ids):
    model = nnx.merge(graphdef, params, rest)
    logits = model(inputs, segment_ids, mode="train", max_num_segments=num_slots)
    return masked_nll(logits, targets, loss_mask)

  def run(params, rest, window):
    return step(params, rest, *(jnp.asarray(getattr(window, k))
                                for k in ("inputs", "targets", "loss_mask", "segment_ids")))

  return run


def evaluate(graphdef, state, windows, num_slots: int) -> dict:
  """Held-out loss over `windows` (`EvalWindow`s): {"heldout_loss" (nats/token), "heldout_ppl",
  "heldout_tokens"}."""
  fn = eval_step_fn(graphdef, num_slots)
  total, count = 0.0, 0.0
  for w in windows:
    s, c = fn(state["params"], state["rest"], w)
    total += float(s)
    count += float(c)
  loss = total / max(count, 1.0)
  return {"heldout_loss": loss, "heldout_ppl": float(np.exp(loss)), "heldout_tokens": int(count)}


# ------------------------------------------------------------------------------------------------
# Train-state checkpoints (Orbax CheckpointManager)
# ------------------------------------------------------------------------------------------------

def file_sha256(path: str | os.PathLike | None) -> str:
  """Hex SHA-256 of a file's bytes ("" for no path): identifies the corpus and tokenizer on resume."""
  if not path:
    return ""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


class TrainCheckpointer:
  """Orbax `CheckpointManager` over `directory`: one step directory per save holding the train
  state (`StandardSave`), the data iterator state and run metadata (JSON). Orbax writes each step
  into a temporary directory and renames it when complete, so an interrupted save leaves no
  partial step behind; only the last `keep` steps are kept.

  Args:
    directory: where the step directories live (created when missing).
    keep: checkpoints to keep (>= 1).
  """

  def __init__(self, directory: str | os.PathLike, keep: int):
    import orbax.checkpoint as ocp  # local: orbax is heavy to import
    self._ocp = ocp
    self.directory = pathlib.Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(max_to_keep=int(keep), create=True,
                                           enable_async_checkpointing=False)
    self._mgr = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def save(self, step: int, state, data_state: dict, meta: dict) -> None:
    """Saves (synchronously) the train state, the iterator's JSON state and `meta` as `step`."""
    ocp = self._ocp
    self._mgr.save(int(step), args=ocp.args.Composite(**{
        STATE_ITEM: ocp.args.StandardSave(state), DATA_ITEM: ocp.args.JsonSave(data_state),
        META_ITEM: ocp.args.JsonSave(meta)}), force=True)
    self._mgr.wait_until_finished()

  def read_meta(self, step: int) -> dict:
    """The run metadata of checkpoint `step` (without reading any array).

    Raises:
      TrainError: the step directory holds no readable metadata (`_incomplete`).
    """
    ocp = self._ocp
    try:
      return self._mgr.restore(int(step), args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
      raise self._incomplete(step, META_ITEM, e) from None

  def _incomplete(self, step: int, item: str, e: BaseException) -> TrainError:
    """The error of a step directory that lacks `item` or cannot be read: not a kda-train checkpoint,
    or one damaged after it was written (Orbax renames a step into place only once it is whole)."""
    where = self.directory / str(step)
    return TrainError(f"checkpoint {where} is incomplete or not a kda-train checkpoint ({item!r} cannot be read: "
                      f"{type(e).__name__}: {str(e)[:200]}); move it away to resume from an earlier step, or "
                      f"choose another output_dir")

  def restore(self, step: int, target_state):
    """`(state, data_state)` of checkpoint `step`, restored into the structure, shapes and dtypes
    of `target_state` (a train state built the same way, e.g. by `init_train_state`).

    Raises:
      TrainError: the stored arrays do not fit `target_state` (names the checkpoint).
    """
    ocp = self._ocp
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
    try:
      out = self._mgr.restore(int(step), args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardRestore(abstract), DATA_ITEM: ocp.args.JsonRestore()}))
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
      missing = [i for i in (STATE_ITEM, DATA_ITEM) if not (self.directory / str(step) / i).exists()]
      if missing or isinstance(e, FileNotFoundError):
        raise self._incomplete(step, missing[0] if missing else STATE_ITEM, e) from None
      raise TrainError(f"checkpoint {self.directory / str(step)} does not fit this model/optimizer: "
                       f"{type(e).__name__}: {str(e)[:300]}") from None
    return out[STATE_ITEM], out[DATA_ITEM]

  def close(self) -> None:
    self._mgr.close()


def resume_mismatches(saved: dict, current: dict) -> list[str]:
  """`"key: checkpoint=X, now=Y"` for each trajectory-defining key that differs.

  Compared: every key of `current` present in `saved` except `RESUME_FREE_KEYS` and the mesh
  (`ici_*`, `dcn_*`) keys; plus the pseudo keys `train_data_sha256` / `tokenizer_sha256` when both
  sides have them. Floats compare exactly (they come from the same JSON text or the same parse).
  """
  out = []
  for key in sorted(current):
    if key in RESUME_FREE_KEYS or key.startswith(_RESUME_FREE_PREFIXES) or key not in saved:
      continue
    a, b = saved[key], current[key]
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
      a, b = list(a), list(b)
    if a != b:
      out.append(f"{key}: checkpoint={a!r}, now={b!r}")
  return out
