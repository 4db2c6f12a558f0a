r"""Generate text (or token ids) from a checkpoint: packed prefill of every prompt, then cached decoding.

Usage:
  python -m tools.generate load_parameters_path=DIR [tokenizer_path=FILE] [attention=kda_native]
      (prompt="text" | prompts_file=FILE | prompt_ids="1,2,3") max_new_tokens=N
      decode_sampling_strategy=greedy|weighted|topk|nucleus [decode_sampling_temperature=T]
      [decode_sampling_top_k=K] [decode_sampling_nucleus_p=P] [seed=S] [output_json=FILE [overwrite=true]]
  python -m tools.generate load_parameters_path=DIR --chat [system="..."] prompt="the user's message" ...
  python -m tools.generate load_parameters_path=DIR --chat messages='[{"role": "user", "content": "Hi"}]' ...
  python -m tools.generate load_parameters_path=DIR --chat messages_file=chat.json ...

Chat (`chat=true`, or `--chat`): the messages are rendered with the checkpoint's own chat template (a
Kimi checkpoint converted with its tokenizer carries it in DIR/tokenizer/; model/data/chat_template.py
renders it as transformers' apply_chat_template does, with the assistant's generation prompt) and the
reply stops at any of the tokenizer's stop ids: <|im_end|> and the EOS ids of generation_config.json.
Only the reply is printed. Special-token text inside a message (a literal "<|im_end|>") stays text.
Errors, each one `error:` line naming the key, exit status 2: a checkpoint whose tokenizer has no chat
template, JSON that does not parse, a role other than system/user/assistant/tool, content that is not
text, prompts_file= or prompt_ids= with chat.

The model config comes from the checkpoint (DIR/config.json); any key=value of configs/base.py given
here overrides it (e.g. attention=kda_reference, max_cache_length=4096, dtype=bfloat16), and the job
keys apply to this run (e.g. matmul_precision=highest: float32 matmuls on a TPU, whose default is one
bfloat16 pass).

Keys:
  load_parameters_path  checkpoint directory (tools.convert_checkpoint or training output). Required.
  tokenizer_path        sentencepiece .model file or Kimi tokenizer directory (tiktoken.model +
                        tokenizer_config.json); default: the checkpoint's copy, if any (DIR/tokenizer.model
                        or DIR/tokenizer/). Without a tokenizer the tool works on token ids only.
  prompt                one text prompt (needs a tokenizer); BOS is prepended when generate_add_bos
                        is true and the tokenizer has one. Its text streams to stdout as it is made.
  prompts_file          UTF-8 file, one prompt per non-blank line: text with a tokenizer, else token
                        ids separated by spaces or commas.
  prompt_ids            one prompt as token ids "1,2,3" (used verbatim: no BOS added).
  chat                  true (or the bare flag --chat): chat mode (above); prompt= is the user's message.
  system                chat: a system message before prompt= (default none: the template's own default).
  messages              chat: the whole chat as a JSON list of {"role": "system"|"user"|"assistant", "content": ...}.
  messages_file         chat: a UTF-8 JSON file holding that list (or {"messages": [...]}).
  max_new_tokens        tokens to generate per prompt; a sequence stops earlier at EOS (any of the
                        tokenizer's stop ids: for Kimi also <|im_end|> and generation_config.json's EOS ids)
                        when decode_stop_at_eos is true (the EOS token is part of its output).
  decode_sampling_strategy   greedy (argmax) | weighted (softmax draw) | topk | nucleus.
  decode_sampling_temperature  > 0, divides the logits before a draw (ignored by greedy, where 0 is accepted).
  decode_sampling_top_k       candidates of topk.   decode_sampling_nucleus_p  mass of nucleus, (0, 1].
  seed                  PRNG seed of the random strategies (each prompt draws with its own key).
  generate_batch_size   prompts packed into one prefill row and decoded together (default 8).
  max_cache_length      the model's limit: prompt + max_new_tokens must fit (MLA cache per sequence).
  output_json           write, per prompt, the prompt ids, generated ids, text (with a tokenizer) and
                        finish reason, plus the timings, to this file (atomically: a temporary file
                        renamed over it). An existing file is refused before any work unless
                        overwrite=true.
  overwrite             true: replace an existing output_json (default false).
  ici_*_parallelism     with several devices: the mesh to serve on (data, fsdp, expert, tensor; -1 =
                        the rest; default all devices on data), parameters restored sharded
                        (model/partitioning.py); distributed_init=true starts a multi-host job.

Prints the generated text (or ids), then the time to first token, prefill tokens/s and decode
tokens/s (compilation is done first and reported apart). The decode figures count generated tokens
only: tokens of sequences still running (EOS included), never the masked steps of sequences that have
finished; the first token of each sequence comes from the prefill and is not among them. Bad input (missing checkpoint or tokenizer,
an empty prompt, a prompt longer than the model's limit, a file that is not UTF-8, ids outside the
vocabulary, an unknown sampling strategy, ...) prints one `error:` line and exits with status 2.
"""

from __future__ import annotations

import json
import sys

from model import partitioning
from model.config import matmul_precision
from model.data.chat_template import ChatMessageError, ChatTemplateError
from model.data.pipeline import DataFormatError, parse_ids_documents, read_text_file
from model.engine import compilation_cache, sampling
from model.engine.api import GenerationError, SamplingParams
from model.engine.generator import Generator, check_max_new_tokens
from model.data.tokenizer import TokenizerError
from model.errors import UsageError
from tools import cli as common

_PROMPT_KEYS = ("prompt", "prompts_file", "prompt_ids")
# What sizes the prefill and the cache: named in the one-line error when XLA runs out of memory.
MEMORY_KEYS = "generate_batch_size, max_new_tokens or the prompt length"


# The config key behind each argument of `sampling.check_sampling_args`.
SAMPLING_KEYS = {"strategy": "decode_sampling_strategy", "temperature": "decode_sampling_temperature",
                 "top_k": "decode_sampling_top_k", "top_p": "decode_sampling_nucleus_p"}


def sampling_params(cfg, vocab_size: int | None = None) -> SamplingParams:
  """The `SamplingParams` of the decode_sampling_* keys, checked against `vocab_size` (the model's,
  when known: top_k may not exceed it). Raises GenerationError naming the bad key."""
  strategy = cfg.decode_sampling_strategy
  top_k = cfg.decode_sampling_top_k if strategy == "topk" else None
  top_p = cfg.decode_sampling_nucleus_p if strategy == "nucleus" else None
  try:  # validated here first so that the error names the config key, not the library argument
    sampling.check_sampling_args(strategy, cfg.decode_sampling_temperature, top_k, top_p, names=SAMPLING_KEYS)
  except ValueError as e:
    raise GenerationError(str(e)) from None
  params = SamplingParams(strategy, cfg.decode_sampling_temperature, top_k=top_k, top_p=top_p)
  if top_k is not None and vocab_size is not None and top_k > int(vocab_size):
    raise GenerationError(f"decode_sampling_top_k={top_k} exceeds the model's vocabulary size {int(vocab_size)}; "
                          f"pass decode_sampling_top_k <= {int(vocab_size)}")
  return params


def read_prompts(cfg, given: set[str], tokenizer, vocab_size: int) -> tuple[list[str | None], list[list[int]]]:
  """`(texts, ids)` of the prompts named by exactly one of prompt / prompts_file / prompt_ids.

  Raises:
    UsageError: none or several of the three keys; GenerationError: an empty prompt or file;
    TokenizerError: text without a tokenizer; DataFormatError: non-UTF-8 or malformed ids;
    FileNotFoundError: a missing prompts_file.
  """
  chosen = [k for k in _PROMPT_KEYS if k in given or cfg[k]]
  if len(chosen) != 1:
    raise UsageError(f"give exactly one of prompt=, prompts_file= or prompt_ids= (got "
                            f"{', '.join(chosen) if chosen else 'none'})")
  key = chosen[0]
  bos = [tokenizer.bos_id] if cfg.generate_add_bos and tokenizer.bos_id is not None else []
  if key == "prompt":
    if not cfg.prompt.strip():
      what = "is empty" if not cfg.prompt else "is whitespace only"
      raise GenerationError(f"prompt {what}: give some text, e.g. prompt=\"Once upon a time\"")
    if tokenizer.ids_only:
      raise TokenizerError("prompt= (text) needs a tokenizer: pass tokenizer_path=FILE, or give token ids "
                           "with prompt_ids=")
    return [cfg.prompt], [bos + tokenizer.encode(cfg.prompt)]
  if key == "prompt_ids":
    docs = parse_ids_documents(cfg.prompt_ids, "prompt_ids", vocab_size=vocab_size)
    if not docs:
      raise GenerationError("prompt_ids is empty: give token ids, e.g. prompt_ids=\"1,2,3\"")
    if len(docs) > 1:
      raise UsageError("prompt_ids holds one prompt on one line; put several in prompts_file=")
    return [None], [docs[0].tolist()]
  path = cfg.prompts_file
  if not path:
    raise GenerationError("prompts_file is empty: give the path of a prompts file")
  try:
    text = read_text_file(path)
  except FileNotFoundError:
    raise FileNotFoundError(f"prompts_file={path!r} does not exist (or is not a file)") from None
  except DataFormatError as e:
    raise DataFormatError(f"prompts_file: {e}") from None
  if tokenizer.ids_only:
    ids = [d.tolist() for d in parse_ids_documents(text, path, vocab_size=vocab_size)]
    texts = [None] * len(ids)
  else:
    texts = [line for line in text.split("\n") if line.strip()]
    texts = [t.removesuffix("\r") for t in texts]
    ids = [bos + tokenizer.encode(t) for t in texts]
  if not ids:
    raise GenerationError(f"prompts_file={path!r} holds no prompt (every line is blank)")
  return texts, ids


_CHAT_SOURCES = ("prompt", "messages", "messages_file")


def _parse_messages(text: str, key: str):
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise UsageError(f"{key} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (expected a list of "
                     f"{{\"role\": ..., \"content\": ...}} messages)") from None
  if isinstance(data, dict) and "messages" in data:
    data = data["messages"]
  return data


def read_chat(cfg, given: set[str], tokenizer) -> tuple[list, str, list[int], str]:
  """`(messages, the key they came from, prompt ids, rendered prompt text)` of chat mode: the messages of
  prompt= (with system=), messages= or messages_file=, rendered with the tokenizer's chat template
  (`encode_chat`, generation prompt added; no BOS: the template decides).

  Raises:
    UsageError (exit 2) naming the key: no chat template, none or several message sources, prompts_file= or
    prompt_ids= in chat mode, system= without prompt=, JSON that does not parse, a bad message (its
    field: `messages[1].role`), a template that raised. GenerationError: an empty prompt=.
    FileNotFoundError / DataFormatError: a missing or non-UTF-8 messages_file.
  """
  if getattr(tokenizer, "chat_template", None) is None:
    where = (f"the tokenizer {tokenizer.path!r} has no chat template" if getattr(tokenizer, "path", None)
             else "the checkpoint has no tokenizer")
    raise UsageError(f"chat=true needs the checkpoint's chat template, but {where} (convert a Kimi checkpoint "
                     f"with its tokenizer: kda-convert copies it into DIR/tokenizer/)")
  for key in ("prompts_file", "prompt_ids"):
    if key in given or cfg[key]:
      raise UsageError(f"{key}= does not apply to chat=true: give the user's message as prompt=, or the chat as "
                       f"messages= or messages_file=")
  chosen = [k for k in _CHAT_SOURCES if k in given or cfg[k]]
  if len(chosen) != 1:
    raise UsageError(f"chat=true takes exactly one of prompt= (the user's message), messages= or messages_file= "
                     f"(got {', '.join(chosen) if chosen else 'none'})")
  key = chosen[0]
  if ("system" in given or cfg.system) and key != "prompt":
    raise UsageError(f"system= goes with prompt=; with {key}= put the system message into the messages")
  if key == "prompt":
    if not cfg.prompt.strip():
      raise GenerationError("prompt is empty: give the user's message, e.g. prompt=\"Hello\"")
    messages = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [
        {"role": "user", "content": cfg.prompt}]
  elif key == "messages":
    messages = _parse_messages(cfg.messages, "messages")
  else:
    if not cfg.messages_file:
      raise UsageError("messages_file is empty: give the path of a JSON file of messages")
    try:
      text = read_text_file(cfg.messages_file)
    except FileNotFoundError:
      raise FileNotFoundError(f"messages_file={cfg.messages_file!r} does not exist (or is not a file)") from None
    except DataFormatError as e:
      raise DataFormatError(f"messages_file: {e}") from None
    messages = _parse_messages(text, f"messages_file={cfg.messages_file!r}")
  try:
    prompt = tokenizer.encode_chat(messages, add_generation_prompt=True)
  except ChatMessageError as e:
    raise UsageError(f"{key}: {e}") from None
  except ChatTemplateError as e:
    raise UsageError(f"chat=true: the checkpoint's chat template failed on the messages of {key}=: {e}") from None
  return messages, key, list(prompt.ids), prompt.text


class _Streamer:
  """Prints one prompt and its continuation as it is produced (to `out`, default stdout).

  The text is decoded from prompt + generated ids together, so pieces that start a word keep their
  leading space, and only the new suffix of that text is written. A character made of several
  byte-fallback pieces (<0xE6><0x97><0xA5> for "日") decodes to U+FFFD replacement characters until
  its last byte arrives: trailing U+FFFD are held back until a later token completes (or follows)
  them, and `finish` writes whatever is still held. The streamed text is therefore exactly the
  decoded text, each character written once.
  """

  def __init__(self, tokenizer, stop_ids, prompt_ids, out=None, *, show_prompt: bool = True):
    # stop_ids: the ids not shown (an id, e.g. the eos id, or a set of them; None: none)
    self.tokenizer = tokenizer
    self.stop_ids = frozenset() if stop_ids is None else (
        frozenset({int(stop_ids)}) if isinstance(stop_ids, int) else frozenset(stop_ids))
    self.out = out if out is not None else sys.stdout
    self.ids: list[int] = list(prompt_ids)
    self.printed = ""
    self.shown_from = 0
    if show_prompt:
      self._emit(self._render(), final=False)
    else:   # chat: the reply only (its text still decoded together with the prompt's)
      self.printed = self._render().rstrip("\ufffd")
      self.shown_from = len(self.printed)

  @property
  def reply(self) -> str:
    """What was written (without the prompt when it was not shown)."""
    return self.printed[self.shown_from:]

  def _render(self) -> str:
    shown = [t for t in self.ids if t not in self.stop_ids]
    return self.tokenizer.decode(shown) if not self.tokenizer.ids_only else " ".join(map(str, shown))

  def _emit(self, text: str, final: bool) -> None:
    if not final:
      text = text.rstrip("\ufffd")  # an incomplete multi-byte character: wait for its last byte
    if not text.startswith(self.printed):
      # Decoding is prefix-stable for this project's tokenizers once incomplete bytes are held back;
      # should an earlier piece still change, write only what lies beyond the printed length.
      text = self.printed + text[len(self.printed):]
    if len(text) > len(self.printed):
      self.out.write(text[len(self.printed):])
      self.out.flush()
      self.printed = text

  def __call__(self, start, tokens, live):
    if not live[0]:
      return
    self.ids.append(int(tokens[0]))
    self._emit(self._render(), final=False)

  def finish(self) -> None:
    """Writes the text still held back (replacement characters no later byte completed)."""
    self._emit(self._render(), final=True)


def _text(tokenizer, ids, stop_ids):
  if tokenizer.ids_only:
    return None
  return tokenizer.decode([t for t in ids if t not in stop_ids])


def run(argv: list[str]) -> int:
  """Generates as the `key=value` arguments say (see the module docstring); raises on bad input."""
  argv = ["chat=true" if a == "--chat" else a for a in argv]   # the bare flag
  overrides, cfg = common.parse_args(argv)
  with matmul_precision(cfg.matmul_precision):   # on while the prefill and decode programs are traced
    return _generate(argv, overrides, cfg)


def _generate(argv: list[str], overrides: list[str], cfg) -> int:
  given = common.given_keys(argv)
  if cfg.output_json:
    common.check_output_path(cfg.output_json, overwrite=cfg.overwrite)  # before any work, not after it
  params = sampling_params(cfg)
  check_max_new_tokens(cfg.max_new_tokens)
  for key in ("generate_batch_size", "prefill_length_multiple"):
    if cfg[key] < 1:
      raise UsageError(f"{key} must be an integer >= 1, got {cfg[key]}")
  # Checks that need the model's config (vocabulary size) but not its parameters: before the load.
  stored = common.checkpoint_config(cfg, overrides)  # config.json read and validated once
  compilation_cache.enable(cfg.compilation_cache_dir)   # jax's persistent cache, before the first compilation
  params = sampling_params(cfg, vocab_size=stored.vocab_size)
  tokenizer = common.tokenizer_for(stored)
  vocab = int(stored.vocab_size)
  chat = cfg.chat or any(k in given or cfg[k] for k in ("system", "messages", "messages_file"))
  messages = rendered = None
  if chat:
    messages, _, ids, rendered = read_chat(cfg, given, tokenizer)
    texts, prompts = [None], [ids]
  else:
    texts, prompts = read_prompts(cfg, given, tokenizer, vocab)
  model, mcfg, mesh = common.load(stored)  # mesh None on one device
  if mesh is not None:
    print(f"serving on {partitioning.describe_mesh(mesh)}", file=sys.stderr)
  eos = tokenizer.eos_id if tokenizer.eos_id is not None else None
  # Kimi: <|im_end|> and generation_config.json's EOS ids besides [EOS]; else the eos id alone.
  stops = frozenset(getattr(tokenizer, "stop_ids", None) or ([] if eos is None else [eos]))
  pad = tokenizer.pad_id if tokenizer.pad_id is not None and tokenizer.pad_id < vocab else 0
  gen = Generator(model, max_length=int(mcfg.max_cache_length), eos_id=eos, pad_id=pad,
                  batch_size=cfg.generate_batch_size, prefill_multiple=cfg.prefill_length_multiple,
                  cache_multiple=cfg.prefill_length_multiple, vocab_limit=min(vocab, tokenizer.vocab_size),
                  mesh=mesh, rules=mcfg, stop_ids=stops)
  gen.check_request(prompts, cfg.max_new_tokens)
  print(f"model {mcfg.model_name} from {mcfg.load_parameters_path}: attention={mcfg.attention}, "
        f"dtype={mcfg.dtype}; {len(prompts)} prompt(s), {sum(map(len, prompts))} prompt tokens; "
        f"sampling {params.strategy}", file=sys.stderr)
  stream = _Streamer(tokenizer, stops, prompts[0], show_prompt=not chat) if len(prompts) == 1 else None
  try:
    results, timings = gen.generate(prompts, cfg.max_new_tokens, sampling_params=params, seed=cfg.seed,
                                    stop_at_eos=cfg.decode_stop_at_eos, on_tokens=stream)
  except KeyboardInterrupt:
    if stream is not None and stream.reply:  # end the streamed line, so "interrupted" starts its own
      sys.stdout.write("\n")
      sys.stdout.flush()
    raise
  if stream is not None:
    stream.finish()
    sys.stdout.write("\n")
  else:
    for i, r in enumerate(results):
      shown = _text(tokenizer, r.token_ids, stops)
      print(f"[{i}] {texts[i] if texts[i] is not None else ' '.join(map(str, r.prompt_ids))}")
      print(f"  -> {shown if shown is not None else ' '.join(map(str, r.token_ids))}  ({r.finish_reason})")
  t = timings
  print(f"compile {t.compile_s:.2f} s | time to first token {t.time_to_first_token_s * 1e3:.1f} ms | "
        f"prefill {t.prefill_tokens} tokens, {t.prefill_tokens_per_s:.1f} tokens/s | decode {t.decode_tokens} "
        f"generated tokens in {t.decode_steps} steps, {t.decode_tokens_per_s:.1f} generated tokens/s")
  if cfg.output_json:
    common.write_json_atomic(cfg.output_json, overwrite=cfg.overwrite, data={
        "checkpoint": str(mcfg.load_parameters_path), "attention": mcfg.attention, "dtype": mcfg.dtype,
        "tokenizer": mcfg.tokenizer_path or None, "max_new_tokens": cfg.max_new_tokens,
        "sampling": {"strategy": params.strategy, "temperature": params.temperature, "top_k": params.top_k,
                     "top_p": params.top_p, "seed": cfg.seed},
        "stop_at_eos": cfg.decode_stop_at_eos, "eos_id": eos, "stop_ids": sorted(stops),
        "timings": t.as_dict(),
        "results": [{"prompt": texts[i] if not chat else rendered, "prompt_ids": r.prompt_ids,
                     "generated_ids": r.token_ids, "text": _text(tokenizer, r.token_ids, stops),
                     "finish_reason": r.finish_reason, **({"messages": messages} if chat else {})}
                    for i, r in enumerate(results)],
    })
    print(f"wrote {cfg.output_json}", file=sys.stderr)
  return 0


main = common.tool_main(run, __doc__)
command = common.command(main)

if __name__ == "__main__":
  command()
