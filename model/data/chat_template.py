"""A checkpoint's chat template: Jinja rendered as transformers' `apply_chat_template` renders it, and
encoded so that no text a user sends can become a control token.

Rendering: jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks` and the
`loopcontrols` extension; the names transformers gives a template: `messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer's `bos_token` / `eos_token` / `unk_token` / `pad_token`,
`raise_exception(msg)`, `strftime_now(fmt)`, `namespace` (no underscore-prefixed attributes), `dict`,
the `tojson` filter (`json.dumps` with `ensure_ascii=False`, `indent`, `separators`, `sort_keys`: not
jinja's HTML-escaping one) and a `{% generation %}` block (rendered as its body). Messages are passed as
transformers passes them (keys whose value is None dropped). A template is compiled once per process
(cached by its source).

Input checks (`normalize_messages`): every problem is a `ChatMessageError` whose `field` names it
("messages", "messages[2].role", "messages[0].content[1].type", "tools"), for the server's 400. Content
may be a string or a list of {"type": "text", "text": ...} parts, which are joined ("" between them, as
Kimi's template joins them); other parts (images, audio) are refused, as are tool calls or tool turns
when the template renders none. A template that raises (its `raise_exception`, or any error while
rendering) or does not compile is a `ChatTemplateError`, never a crash.

Safe encoding (`ChatTemplate.encode`): before rendering, every special-token string inside the user's
strings (message values, names, tools, documents, extra template arguments; dict keys too) is wrapped
in two private-use marker characters (markers the user sent are removed first). The rendered text is
then cut at the special-token strings: one with no marker on either side came from the template itself
and becomes its control id; one with a marker (or a JSON-escaped marker, from a `tojson(ensure_ascii=
True)`) came from the user and stays text. The text between control tokens, markers removed, is encoded
whole as plain text (`encode_text`, which must not recognise special tokens), so a user's literal
`<|im_end|>` tokenizes exactly as the same characters do in any other text. Without special tokens in
the user's strings nothing is marked, so the text is exactly what transformers renders.

Limits (documented, not checked): a template that assembles a special token from pieces of user text
(`'<|' + role + '|>'`), or that cuts a marked token out of its markers by slicing, could still form a
control token; Kimi's templates do neither.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from model.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
# Private-use characters around a special-token string that came from the user (plane 16, which no
# tokenizer gives a meaning; transformers' own sanitizer uses plane 15).
MARK_OPEN = "\U0010fff0"
MARK_CLOSE = "\U0010fff1"
_MARKS_RE = re.compile(f"[{MARK_OPEN}{MARK_CLOSE}]")
# The same markers as `tojson(ensure_ascii=True)` writes them (surrogate-pair escapes).
_OPEN_ESC = json.dumps(MARK_OPEN)[1:-1]
_CLOSE_ESC = json.dumps(MARK_CLOSE)[1:-1]


class ChatError(UserError):
  """Chat input the template cannot render. `field` names what is at fault (an OpenAI `param`)."""

  def __init__(self, message: str, field: str | None):
    super().__init__(message)
    self.field = field


class ChatMessageError(ChatError):
  """Bad messages (or tools): unknown role, empty list, content of the wrong type or kind, ..."""


class ChatTemplateError(ChatError):
  """The template raised while rendering (`raised_by_template`: its own `raise_exception`, i.e. it refused
  these messages) or failed (a broken template: syntax, undefined names, type errors)."""

  def __init__(self, message: str, field: str | None = "messages", *, raised_by_template: bool = False):
    super().__init__(message, field)
    self.raised_by_template = raised_by_template


class _TemplateRaised(jinja2.exceptions.TemplateError):
  """What the template's `raise_exception(message)` raises."""


def _raise_exception(message):
  raise _TemplateRaised(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers' filter: plain json.dumps (jinja's own escapes <, >, &, ' for HTML).
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.now().strftime(fmt)


class _TemplateDict:
  """`dict(...)` and `dict.fromkeys(...)` for templates, without the type object itself."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
  """jinja's namespace without underscore-prefixed attributes (no way to CPython internals)."""

  def __init__(*args, **kwargs):  # jinja's signature trick: `namespace(self=...)` still works
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r} of a namespace")


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask block): renders its body."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                     namespace=_Namespace)
  return env


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
  """The compiled template of `source`, once per process per source string.

  Raises:
    ChatTemplateError: the source does not compile (line and jinja's message).
  """
  try:
    return _environment().from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ChatTemplateError(f"the chat template does not compile: line {e.lineno}: {e.message}") from None


def _check_text(value: str, field: str) -> None:
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ChatMessageError(f"{field} is not valid Unicode text: a lone surrogate {value[e.start]!r} at "
                           f"character {e.start}", field) from None


def _kind(value) -> str:
  return "null" if value is None else {str: "a string", list: "a list", dict: "an object", bool: "a boolean",
                                       int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _content_text(content, field: str) -> str:
  """The text of a message's content: a string, or the joined text of a list of text parts."""
  if isinstance(content, str):
    _check_text(content, field)
    return content
  if not isinstance(content, (list, tuple)):
    raise ChatMessageError(f"{field} must be a string or a list of content parts, got {_kind(content)}", field)
  texts = []
  for j, part in enumerate(content):
    where = f"{field}[{j}]"
    if not isinstance(part, Mapping):
      raise ChatMessageError(f"{where} must be an object with a type, got {_kind(part)}", where)
    kind = part.get("type")
    if kind is None:
      raise ChatMessageError(f"{where}.type is missing (a content part is {{\"type\": \"text\", \"text\": ...}})",
                             f"{where}.type")
    if kind != "text":
      raise ChatMessageError(f"{where}.type is {kind!r}: this model takes text only (content parts of type "
                             f"'text')", f"{where}.type")
    text = part.get("text")
    if not isinstance(text, str):
      raise ChatMessageError(f"{where}.text must be a string, got {_kind(text)}", f"{where}.text")
    _check_text(text, f"{where}.text")
    texts.append(text)
  return "".join(texts)


def _check_tool_calls(calls, field: str) -> None:
  if not isinstance(calls, (list, tuple)):
    raise ChatMessageError(f"{field} must be a list, got {_kind(calls)}", field)
  for k, call in enumerate(calls):
    where = f"{field}[{k}]"
    if not isinstance(call, Mapping):
      raise ChatMessageError(f"{where} must be an object, got {_kind(call)}", where)
    fn = call.get("function")
    if not isinstance(fn, Mapping):
      raise ChatMessageError(f"{where}.function must be an object with a name and arguments, got {_kind(fn)}",
                             f"{where}.function")
    if not isinstance(fn.get("name"), str) or not fn.get("name"):
      raise ChatMessageError(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    if not isinstance(fn.get("arguments"), (str, Mapping)):
      raise ChatMessageError(f"{where}.function.arguments must be a string (JSON) or an object, got "
                             f"{_kind(fn.get('arguments'))}", f"{where}.function.arguments")
    if "id" in call and not isinstance(call["id"], str):
      raise ChatMessageError(f"{where}.id must be a string, got {_kind(call['id'])}", f"{where}.id")


def normalize_messages(messages, *, template_source: str | None = None,
                       roles: Iterable[str] = ROLES) -> list[dict]:
  """Checks chat messages and returns fresh dicts the template gets: None values dropped, list content
  joined into one string.

  Args:
    messages: a non-empty list of {"role", "content", optional "name", "tool_calls", "tool_call_id", ...}.
    template_source: the template's source; tool calls and "tool" turns are refused when it never
      mentions them (it would drop or garble them silently).
    roles: the accepted roles.

  Raises:
    ChatMessageError: naming the field (`messages`, `messages[i].role`, `messages[i].content[j].type`, ...).
  """
  if not isinstance(messages, (list, tuple)):
    raise ChatMessageError(f"messages must be a list of messages, got {_kind(messages)}", "messages")
  if not messages:
    raise ChatMessageError("messages is empty: a chat needs at least one message", "messages")
  roles = tuple(roles)
  source = template_source or ""
  out = []
  for i, message in enumerate(messages):
    at = f"messages[{i}]"
    if not isinstance(message, Mapping):
      raise ChatMessageError(f"{at} must be an object with a role and content, got {_kind(message)}", at)
    message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role")
    if role is None:
      raise ChatMessageError(f"{at}.role is missing (one of {', '.join(roles)})", f"{at}.role")
    if not isinstance(role, str) or role not in roles:
      raise ChatMessageError(f"{at}.role {role!r} is not supported: use one of {', '.join(roles)}", f"{at}.role")
    if role == "tool" and not any(s in source for s in ("'tool'", '"tool"', "tool_call_id")):
      raise ChatMessageError(f"{at}.role 'tool': this model's chat template renders no tool results",
                             f"{at}.role")
    for key in ("name", "tool_call_id"):
      if key in message:
        if not isinstance(message[key], str):
          raise ChatMessageError(f"{at}.{key} must be a string, got {_kind(message[key])}", f"{at}.{key}")
        _check_text(message[key], f"{at}.{key}")
    if "tool_calls" in message:
      if role != "assistant":
        raise ChatMessageError(f"{at}.tool_calls: only assistant messages carry tool calls", f"{at}.tool_calls")
      if "tool_calls" not in source:
        raise ChatMessageError(f"{at}.tool_calls: this model's chat template renders no tool calls",
                               f"{at}.tool_calls")
      _check_tool_calls(message["tool_calls"], f"{at}.tool_calls")
    if "content" in message:
      message["content"] = _content_text(message["content"], f"{at}.content")
    elif not (role == "assistant" and message.get("tool_calls")):
      raise ChatMessageError(f"{at}.content is missing", f"{at}.content")
    out.append(message)
  return out


def _check_tools(tools, source: str):
  if tools is None:
    return None
  if not isinstance(tools, (list, tuple)):
    raise ChatMessageError(f"tools must be a list of tool definitions, got {_kind(tools)}", "tools")
  for i, tool in enumerate(tools):
    if not isinstance(tool, Mapping):
      raise ChatMessageError(f"tools[{i}] must be an object, got {_kind(tool)}", f"tools[{i}]")
  if tools and "tools" not in source:
    raise ChatMessageError("tools: this model's chat template renders no tool definitions", "tools")
  return [dict(t) for t in tools]


def _plain(value):
  """A copy made of JSON types only (str/int/float/bool/None, dict, list): what the sandbox sees."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, str):   # subclasses (enums, numpy scalars): back to the base type
    return str.__str__(value)
  if isinstance(value, bool):
    return bool(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  return f"<{type(value).__name__}>"


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
  """An encoded chat: `text` as rendered (what transformers renders), `ids` its tokens."""

  text: str
  ids: list[int]


class ChatTemplate:
  """A chat template bound to its tokenizer's special tokens.

  Args:
    source: the Jinja source.
    special_tokens: every special token string -> id (the strings the template may emit as control tokens).
    template_vars: the tokenizer's names the template sees (bos_token, eos_token, unk_token, pad_token).

  Raises:
    ChatTemplateError: the source does not compile.
  """

  def __init__(self, source: str, special_tokens: Mapping[str, int], template_vars: Mapping[str, Any] = ()):
    if not isinstance(source, str) or not source.strip():
      raise ChatTemplateError("the chat template is empty", None)
    self.source = source
    self.special_tokens = dict(special_tokens)
    self.template_vars = dict(template_vars)
    self._template = compile_template(source)
    # Longest first: a token wins over the tokens it contains.
    alternatives = "|".join(re.escape(t) for t in sorted(self.special_tokens, key=len, reverse=True)) or "(?!)"
    self._special_re = re.compile(alternatives)

  def __repr__(self) -> str:
    return f"ChatTemplate({len(self.source)} characters, {len(self.special_tokens)} special tokens)"

  def _mark(self, obj):
    if isinstance(obj, str):
      return self._special_re.sub(lambda m: MARK_OPEN + m.group() + MARK_CLOSE, _MARKS_RE.sub("", obj))
    if isinstance(obj, dict):
      return {self._mark(k): self._mark(v) for k, v in obj.items()}
    if isinstance(obj, list):
      return [self._mark(v) for v in obj]
    return obj

  def _render(self, messages, *, add_generation_prompt: bool, tools, documents, kwargs: dict, mark: bool) -> str:
    messages = normalize_messages(messages, template_source=self.source)
    tools = _check_tools(tools, self.source)
    if documents is not None and (not isinstance(documents, (list, tuple)) or
                                  not all(isinstance(d, Mapping) for d in documents)):
      raise ChatMessageError("documents must be a list of objects", "documents")
    user = _plain({"messages": messages, "tools": tools, "documents": documents, "kwargs": kwargs})
    if mark:
      user = self._mark(user)
    variables = {**self.template_vars, **user["kwargs"]}   # the caller's arguments win, as in transformers
    try:
      return self._template.render(messages=user["messages"], tools=user["tools"], documents=user["documents"],
                                   add_generation_prompt=bool(add_generation_prompt), **variables)
    except _TemplateRaised as e:
      raise ChatTemplateError(f"the chat template refused the messages: {e.message}",
                              raised_by_template=True) from None
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    except RecursionError:
      raise ChatTemplateError("the chat template failed: it recursed too deeply") from None
    except Exception as e:  # a template can raise anything Python can (TypeError on `1 + 'a'`, ...)
      raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None

  def render(self, messages, *, add_generation_prompt: bool = False, tools=None, documents=None, **kwargs) -> str:
    """The prompt text, exactly as transformers' `apply_chat_template(..., tokenize=False)` renders it.

    Raises:
      ChatMessageError: bad messages/tools/documents (`field` names them). ChatTemplateError: the template raised.
    """
    return self._render(messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
                        kwargs=kwargs, mark=False)

  def encode(self, messages, encode_text: Callable[[str], list[int]], *, add_generation_prompt: bool = True,
             tools=None, documents=None, **kwargs) -> ChatPrompt:
    """Renders and encodes: the template's own special tokens become their ids, all other text (the
    user's special-token strings included) goes through `encode_text` (plain text, no special tokens).

    Raises: as `render`.
    """
    marked = self._render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                          documents=documents, kwargs=kwargs, mark=True)
    ids: list[int] = []
    shown: list[str] = []    # the whole prompt text, markers removed
    at = 0                   # start of the text since the last control token
    for m in self._special_re.finditer(marked):
      start, end = m.span()
      if (marked.endswith(MARK_OPEN, 0, start) or marked.endswith(_OPEN_ESC, 0, start) or
          marked.startswith(MARK_CLOSE, end) or marked.startswith(_CLOSE_ESC, end)):
        continue                                   # the user's: stays in the text
      chunk = _MARKS_RE.sub("", marked[at:start])  # the template's own: a control token
      if chunk:
        ids.extend(encode_text(chunk))
      shown += [chunk, m.group()]
      ids.append(self.special_tokens[m.group()])
      at = end
    chunk = _MARKS_RE.sub("", marked[at:])
    if chunk:
      ids.extend(encode_text(chunk))
    shown.append(chunk)
    return ChatPrompt("".join(shown), ids)
