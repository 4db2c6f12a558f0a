"""Every configuration key of the `model` host, with its default and a one-line meaning.

The defaults are the dimensions of Kimi-Linear-48B-A3B (docs/checkpoints.md section 'HF config.json to
project keys'; the
Hugging Face `config.json` of moonshotai/Kimi-Linear-48B-A3B-Instruct) so that each comment can name
the real value. Per-model modules in this package start from `get_config()` and override values.

The returned ConfigDict is locked: overrides may change values (type-checked by
`model.config.load_config`) but never add keys. To add a key, add one line to the right section
below with a comment; `NULLABLE` lists the keys that may be `None`.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

# Keys whose value may be None (typed placeholders: their type is given below).
NULLABLE = {"q_lora_rank": int, "kda_gate_lower_bound": float}

# Keys renamed since checkpoints were first written: old name -> new name. Stored config.json files
# are read with the new name; a command-line override with the old name works with a DeprecationWarning.
RENAMED = {"kda_impl": "kda_implementation"}

# Sections of the keys (`model.config.section`). A checkpoint's config.json stores the model section
# only (every key not listed below): the others steer one job of one tool, not the model.
# tools.generate / tools.perplexity (and output_json/overwrite, shared with the others).
SERVING_KEYS = (
    "prompt", "prompts_file", "prompt_ids", "chat", "system", "messages", "messages_file", "max_new_tokens",
    "decode_sampling_strategy",
    "decode_sampling_temperature", "decode_sampling_top_k", "decode_sampling_nucleus_p", "seed",
    "decode_stop_at_eos", "generate_add_bos", "generate_batch_size", "prefill_length_multiple",
    "eval_data", "eval_format", "max_target_length", "eval_add_bos", "eval_add_eos",
    "compare_attention", "compare_tolerance", "dump_logprobs", "output_json", "overwrite",
) + (  # tools.serve (the HTTP server; model/server/, model/engine/config.py EngineConfig)
    "engine", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "max_num_partial_prefills", "max_waiting",
    "prefix_cache_bytes", "min_bucket_tokens", "host", "port", "uds",
)
# tools.train.
TRAIN_KEYS = (
    "train_data", "train_data_format", "heldout_fraction", "seq_len", "batch_size", "data_seed",
    "split_long", "steps", "learning_rate", "warmup_steps", "lr_final_fraction", "weight_decay",
    "adam_b1", "adam_b2", "adam_eps", "grad_clip_norm", "train_seed", "router_bias_update_rate",
    "output_dir", "checkpoint_every", "checkpoint_keep", "resume", "stop_at_step", "eval_every",
    "eval_batch_size", "eval_max_windows", "log_every", "export_every", "export_dtype",
    "compiled_trainstep_file",
)
# The job's mesh and multi-host start-up (a loaded checkpoint takes them from the command line).
MESH_KEYS = (
    "ici_data_parallelism", "ici_fsdp_parallelism", "ici_expert_parallelism",
    "ici_tensor_parallelism", "dcn_data_parallelism", "dcn_fsdp_parallelism", "dcn_expert_parallelism",
    "dcn_tensor_parallelism", "logical_axis_rules", "distributed_init", "coordinator_address",
    "num_processes", "process_id",
) + (  # how this job loads a checkpoint (model/loading.py): job keys too, never stored
    "allow_non_finite", "verify_checksums", "allow_large_model",
) + (  # how this job compiles the model (model/nn/scan.py): same parameters and numerics, never stored
    "scan_layers", "remat_policy", "compilation_cache_dir",
) + (  # how this job's float32 matmuls run (model/config.py matmul_precision): numerics, never stored
    "matmul_precision",
)
TOOL_KEYS = SERVING_KEYS + TRAIN_KEYS + MESH_KEYS


def get_config() -> ml_collections.ConfigDict:
  """Returns the locked base ConfigDict (Kimi-Linear-48B-A3B architecture, float32 numerics)."""
  c = ml_collections.ConfigDict()

  # ---- Identity ---------------------------------------------------------------------------------
  c.model_name = "base"  # name printed by tools and stored in checkpoints

  # ---- Transformer dimensions ---------------------------------------------------------------------
  c.vocab_size = 163840  # token vocabulary (embedding rows and lm_head columns; lm_head is untied)
  c.hidden_size = 2304  # d, the residual width
  c.num_hidden_layers = 27  # decoder blocks
  c.intermediate_size = 9216  # width of the dense SwiGLU FFN (layers < first_k_dense_replace)
  c.rms_norm_eps = 1e-5  # epsilon of every block RMSNorm, the final norm and KDA's o_norm
  c.hidden_act = "silu"  # FFN activation; only "silu" (SwiGLU) is implemented

  # ---- Layer layout (1-indexed, as in the HF `linear_attn_config`) --------------------------------
  c.kda_layers = [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]  # KDA mixers
  c.full_attn_layers = [4, 8, 12, 16, 20, 24, 27]  # MLA mixers; with kda_layers: exactly 1..L

  # ---- KDA mixer (Kimi Delta Attention) -----------------------------------------------------------
  c.kda_num_heads = 32  # H of the KDA layers
  c.kda_head_dim = 128  # K = V per KDA head
  c.kda_conv_kernel_size = 4  # W, width of the depthwise causal q/k/v short convolutions
  c.kda_gate_lower_bound = config_dict.placeholder(float)  # None: softplus gate (Kimi); else bounded gate in [-5, 0)
  c.kda_implementation = "auto"  # kernel of kda_inference: auto, xla, pallas_tpu, pallas_gpu (kda_native only; was kda_impl)

  # ---- MLA mixer (multi-head latent attention, no positional encoding) ----------------------------
  c.num_attention_heads = 32  # MLA heads
  c.q_lora_rank = config_dict.placeholder(int)  # None: plain q_proj; else q_a_proj -> norm -> q_b_proj
  c.kv_lora_rank = 512  # r, the compressed latent width cached per token
  c.qk_nope_head_dim = 128  # per-head key/query width taken from the latent
  c.qk_rope_head_dim = 64  # per-token shared key width (named rope; Kimi-Linear applies no rotation)
  c.v_head_dim = 128  # per-head value width
  c.mla_kv_norm_eps = 1e-6  # epsilon of kv_a_layernorm / q_a_layernorm (HF KimiLinearRMSNorm default)
  c.mla_impl = "auto"  # MLA attention without [T,T] scores: auto (splash on TPU, else tiled), splash, tiled, dense (model/nn/attention.py)

  # ---- Mixture of experts -------------------------------------------------------------------------
  c.first_k_dense_replace = 1  # layers [0, k) (0-indexed) use the dense FFN, the rest MoE
  c.num_experts = 256  # routed experts E
  c.num_experts_per_tok = 8  # top-k experts per token
  c.moe_intermediate_size = 1024  # width of each routed expert (and of each shared expert)
  c.num_shared_experts = 1  # shared experts, fused into one SwiGLU of width moe_intermediate_size * n
  c.routed_scaling_factor = 2.446  # multiplies the renormalised routing weights
  c.norm_topk_prob = True  # renormalise the chosen (unbiased) sigmoid scores to sum to 1
  c.n_group = 1  # expert groups for group-limited routing (1: plain top-k)
  c.topk_group = 1  # groups kept per token
  # auto (megablox on one TPU device, dense elsewhere: model.nn.moe.resolve_moe_impl), dense (every expert on every
  # token, masked: E/k times the FLOPs), ragged (sorted rows through jax.lax.ragged_dot, which XLA on TPU expands
  # over every group) or megablox (sorted rows through jax's Pallas TPU grouped matmul; one device only: a mesh refuses it)
  c.moe_impl = "auto"

  # ---- Special tokens -----------------------------------------------------------------------------
  c.bos_token_id = 163584  # beginning of sequence
  c.eos_token_id = 163586  # end of sequence
  c.pad_token_id = 163839  # padding (its embedding is never special-cased by the model)

  # ---- Attention backend --------------------------------------------------------------------------
  c.attention = "kda_native"  # registered attention backend name (model.registry; entry points)

  # ---- Numerics -----------------------------------------------------------------------------------
  c.dtype = "float32"  # compute dtype of activations ("float32" or "bfloat16"); KDA state is float32
  c.weight_dtype = "float32"  # storage dtype of the parameters (A_log, dt_bias, router bias: float32)
  c.matmul_precision = "default"  # float32 matmuls (jax.default_matmul_precision): default (one bfloat16 pass on TPU), high (3 passes), highest (float32); never stored

  # ---- Initialisation -----------------------------------------------------------------------------
  c.init_seed = 0  # PRNG seed of the random initialisation
  c.initializer_range = 0.02  # std of the normal init of projection, expert and embedding weights

  # ---- Packing and caches -------------------------------------------------------------------------
  c.max_num_segments = 8  # N, static document slots per packed row (labels 1..N)
  c.max_cache_length = 256  # L, MLA latent cache length per decode sequence

  # ---- Checkpoint and tokenizer -------------------------------------------------------------------
  c.load_parameters_path = ""  # parameters to load instead of random init ("" = random)
  c.tokenizer_path = ""  # tokenizer model file or directory ("" = none)
  # How a checkpoint is loaded (model/loading.py; job keys, never stored in a checkpoint):
  c.allow_non_finite = False  # true: load parameters holding NaN/Inf (for debugging); default refuses them
  c.verify_checksums = True  # check each parameter's CRC-32 against DIR/checksums.json; false skips it
  # true: build (random init or restore) a model whose parameters exceed the device's memory (the host's
  # MemAvailable on CPU); default refuses it in one line before allocating (model/memory.py)
  c.allow_large_model = False
  # How a job compiles the model (model/nn/scan.py; parameters and numerics unchanged, never stored).
  c.scan_layers = False  # true: one jax.lax.scan over the repeated layer groups (48B: layers 2-25, 6 x [KDA, KDA, MLA, KDA])
  # Training rematerialisation (MaxText's names): none, full (= nothing_saveable), minimal, dots_saveable.
  # Default full, as MaxText's: each layer keeps only its input and recomputes the rest in the backward
  # pass; the 0.4B test model's 8 x 2048 step fits one v5e only so (docs/performance.md, "Training
  # memory on v5e:1x1 (compiled ahead of time)"). Forward-only modes ignore it.
  c.remat_policy = "full"
  c.compilation_cache_dir = ""  # jax's persistent compilation cache (train/serve/generate/benchmarks): "" = $KDA_COMPILATION_CACHE_DIR or ~/.cache/kda_plugin/jax; "none" = off

  # ---- Serving: generation and perplexity (tools.generate, tools.perplexity; model/engine/generator.py,
  # model/engine/scoring.py). The model config comes from the checkpoint; these keys only steer the tools.
  c.prompt = ""  # tools.generate: one text prompt (needs a tokenizer); exactly one of prompt/prompts_file/prompt_ids
  c.prompts_file = ""  # tools.generate: UTF-8 file, one prompt per non-blank line (text, or ids without a tokenizer)
  c.prompt_ids = ""  # tools.generate: one prompt as token ids "1,2,3" (no tokenizer needed, used verbatim)
  # tools.generate chat mode: the messages rendered with the checkpoint's chat template (a Kimi tokenizer's).
  c.chat = False  # true: chat; prompt= is then the user's message (system= may precede it)
  c.system = ""  # chat: a system message before prompt= ("" = none: the template's default, if any)
  c.messages = ""  # chat: the whole chat as a JSON list of {"role": ..., "content": ...} (instead of prompt=)
  c.messages_file = ""  # chat: a UTF-8 JSON file holding that list, or {"messages": [...]} (instead of prompt=)
  c.max_new_tokens = 32  # tools.generate: tokens to generate per prompt (fewer when EOS comes first)
  c.decode_sampling_strategy = "greedy"  # "greedy", "weighted" (softmax draw), "topk" or "nucleus" (model/engine/sampling.py)
  c.decode_sampling_temperature = 1.0  # > 0; logits are divided by it before a draw (ignored by greedy)
  c.decode_sampling_top_k = 40  # candidates kept by the "topk" strategy (>= 1)
  c.decode_sampling_nucleus_p = 0.9  # probability mass kept by the "nucleus" strategy, in (0, 1]
  c.seed = 0  # PRNG seed of the random sampling strategies
  c.decode_stop_at_eos = True  # end a sequence at the tokenizer's (else eos_token_id) EOS; false: always max_new_tokens
  c.generate_add_bos = True  # prepend BOS to text prompts when the tokenizer has one (id prompts are used verbatim)
  c.generate_batch_size = 8  # prompts packed into one prefill row and decoded together (more run in groups)
  c.prefill_length_multiple = 64  # prefill rows and MLA caches are rounded up to this many tokens (fewer recompiles)
  c.eval_data = ""  # tools.perplexity: the corpus file to score (every document of it)
  c.eval_format = "text"  # "text" (blank-line separated documents), "jsonl" ({"text": ...} per line) or "ids" (one id list per line)
  c.max_target_length = 512  # tools.perplexity: T, tokens per evaluation window row (longer documents carry state across windows)
  c.eval_add_bos = True  # frame text/jsonl documents with BOS (as training does); ids documents are scored verbatim
  c.eval_add_eos = True  # ... and with EOS (scored: the model predicts the document's end)
  c.compare_attention = ""  # tools.perplexity: also score with this attention backend and compare ("" = no)
  c.compare_tolerance = 1e-4  # largest allowed max |log-prob difference| against compare_attention (else exit 1)
  c.dump_logprobs = False  # tools.perplexity: write every document's per-token log-probs to output_json
  c.output_json = ""  # tools.generate / tools.perplexity: write the results here as JSON ("" = no file)
  c.overwrite = False  # replace an existing output_json (generate/perplexity); tools.train: use an output_dir holding other files
  # tools.serve: the OpenAI-compatible server (names as vLLM's). Job keys: never stored in a checkpoint.
  c.engine = "continuous"  # "continuous" (slot pool, mixed prefill+decode steps) or "static" (Generator groups, the baseline)
  c.max_num_seqs = 8  # requests decoding at once (slots of the engine)
  c.max_model_len = 2048  # prompt + output tokens of one request (the MLA cache rows per slot)
  c.max_num_batched_tokens = 2048  # tokens one engine step may process (prefill chunk budget)
  c.max_num_partial_prefills = 0  # continuous: prompts prefilled in one step, in [1, max_num_seqs] (0 = min(4, max_num_seqs))
  c.max_waiting = 128  # requests waiting for a slot at which new ones get HTTP 503
  c.prefix_cache_bytes = 1 << 30  # byte budget of the prefix cache of KDA/MLA state snapshots (0 = off)
  c.min_bucket_tokens = 0  # continuous: smallest compiled row bucket (0 = auto: 128 on a TPU, 16 elsewhere)
  c.host = "127.0.0.1"  # address the server listens on
  c.port = 8000  # TCP port the server listens on (0 = any free port, printed at start-up)
  c.uds = ""  # listen on this unix-domain socket path instead of host/port ("" = TCP)

  # ---- Training (tools.train; model/training/steps.py) ------------------------------------------------
  # Data: the train side of the held-out split of `train_data`, tokenised with `tokenizer_path`
  # (format "ids" may leave it empty), packed into [batch_size, seq_len] rows with segment ids.
  c.train_data = ""  # corpus file to train on (required by tools.train)
  c.train_data_format = "text"  # "text" (blank-line separated documents), "jsonl" ({"text": ...}) or "ids"
  c.heldout_fraction = 0.1  # last share of the corpus bytes, cut at a line start, never trained on
  c.seq_len = 256  # T, tokens per packed training row and per held-out evaluation window
  c.batch_size = 8  # B, packed rows per optimizer step
  c.data_seed = 0  # seed of the document shuffle before packing and of the per-epoch row shuffle
  c.split_long = "long"  # documents longer than seq_len: "long" cut into seq_len pieces, "fill" pack rows full, "none" error
  # Optimizer: AdamW (optax), linear warmup then cosine decay, global-norm gradient clipping.
  c.steps = 1000  # total optimizer steps; the cosine schedule ends here (must match on resume)
  c.learning_rate = 1e-3  # peak learning rate, reached after warmup_steps
  c.warmup_steps = 100  # linear warmup from 0 to learning_rate over these steps (< steps)
  c.lr_final_fraction = 0.1  # the cosine decay ends at learning_rate * lr_final_fraction at `steps`
  c.weight_decay = 0.1  # AdamW decoupled weight decay, applied to matrices and embeddings only
  c.adam_b1 = 0.9  # AdamW first-moment decay
  c.adam_b2 = 0.95  # AdamW second-moment decay
  c.adam_eps = 1e-8  # AdamW epsilon
  c.grad_clip_norm = 1.0  # clip gradients to this global L2 norm (0 = no clipping)
  c.train_seed = 0  # seed of the training PRNG key (split every step; saved in checkpoints)
  # Auxiliary-loss-free MoE load balancing (DeepSeek-V3 sec. 2.1.2): after each optimizer step every MoE
  # layer's router e_score_correction_bias[i] += rate * sign(mean load - load[i]), load[i] = non-padding
  # tokens the step routed to expert i (never a gradient update; saved in checkpoints). 0 = off (bias frozen).
  c.router_bias_update_rate = 0.0  # bias step per optimizer step, in sigmoid-score units (DeepSeek-V3: 1e-3)
  # Run directory, checkpoints, evaluation, logs and the exported parameters.
  c.output_dir = ""  # run directory: checkpoints/, metrics.jsonl, params/ (required by tools.train)
  c.checkpoint_every = 100  # save the full train state every N steps and at the last step (Orbax)
  c.checkpoint_keep = 3  # keep the last K train-state checkpoints
  c.resume = True  # continue from the latest checkpoint in output_dir; false refuses a dir that has one
  # The train step compiled ahead of time (MaxText's key): kda-aot-compile mode=train writes it, kda-train
  # runs it instead of compiling (model/training/compiled_step.py); "" = compile as usual.
  c.compiled_trainstep_file = ""
  c.stop_at_step = 0  # end this run (checkpointed) at this step, to resume later; 0 = run to `steps`
  c.eval_every = 100  # held-out loss/perplexity every N steps and at the last step (0 = never)
  c.eval_batch_size = 8  # rows per held-out evaluation window
  c.eval_max_windows = 0  # held-out windows per evaluation, from the start (0 = all)
  c.log_every = 10  # steps between metrics.jsonl records / progress lines
  c.export_every = 0  # also export parameters to output_dir/params-STEP every N steps (0 = only at the end)
  c.export_dtype = "float32"  # dtype of exported matrices/embeddings ("bfloat16" halves the size); vectors stay float32

  # ---- Device mesh and sharding (model/partitioning.py) -----------------------------------------------
  # Mesh axes, outermost first: data, fsdp, expert, tensor. Each size >= 1, or -1 for "every device
  # left" (at most one -1); the product must equal the device count (all processes together).
  c.ici_data_parallelism = -1  # "data": batch split, parameters replicated (pure data parallel)
  c.ici_fsdp_parallelism = 1  # "fsdp": batch split and parameters sharded on `embed` (ZeRO-3 style)
  c.ici_expert_parallelism = 1  # "expert": MoE experts split; must divide num_experts
  c.ici_tensor_parallelism = 1  # "tensor": KDA/MLA heads, FFN width and vocab split; must divide both head counts
  # Across slices (multi-slice over DCN, as MaxText): each mesh axis is ici size x dcn size; the dcn
  # sizes multiply to the number of slices (>= 1 each, no -1). Only `data` is cheap over DCN.
  c.dcn_data_parallelism = 1  # "data" split across slices
  c.dcn_fsdp_parallelism = 1  # "fsdp" split across slices
  c.dcn_expert_parallelism = 1  # "expert" split across slices
  c.dcn_tensor_parallelism = 1  # "tensor" split across slices (slow: every layer all-reduces over DCN)
  # Logical axis -> mesh axes, one "logical:axis+axis" string per rule ("logical:" = replicated).
  # Logical axes left out are replicated; parameters use embed/heads/kv/mlp/expert/vocab (model/nn/layers.py).
  c.logical_axis_rules = [
      "activation_batch:data+fsdp",  # batch rows of activations and decode sequences of caches
      "activation_length:",  # the token axis (no sequence parallelism)
      "activation_embed:",  # the residual width of activations
      "activation_heads:tensor",  # KDA/MLA heads of activations and caches (KDA kernel runs per shard)
      "activation_vocab:tensor",  # logits' vocabulary axis
      "embed:fsdp",  # parameters' residual-width axis
      "heads:tensor",  # parameters' heads x head-dim axis
      "kv:",  # MLA latent width
      "mlp:tensor",  # dense FFN / expert width
      "expert:expert",  # stacked experts
      "vocab:tensor",  # embedding rows and lm_head columns
  ]
  # Multi-host start-up: jax.distributed.initialize() before any device is touched (one process per host).
  c.distributed_init = False  # true: call jax.distributed.initialize (needed on >1 host)
  c.coordinator_address = ""  # "host:port" of process 0; "" = auto-detect (TPU pods, SLURM, Open MPI, ...)
  c.num_processes = -1  # processes in the job; -1 = auto-detect
  c.process_id = -1  # this process's index in [0, num_processes); -1 = auto-detect

  c.lock()
  return c
