"""The official `openai` client over a unix-domain socket (`kda-serve --uds PATH`): where TCP cannot be
opened (the lent TPU machine), the client talks HTTP through httpx's unix-socket transport.

openai 1.x and 2.x use the `httpx` package, newer releases its successor `httpx2` (same API): the
transport is taken from the module the installed openai imports, so its type check accepts it.
"""

from __future__ import annotations


def httpx_module():
  """The httpx module the installed openai client is built on (`httpx2` or `httpx`)."""
  from openai import _base_client   # noqa: PLC0415  (openai is a test/bench extra)
  module = getattr(_base_client, "httpx2", None) or getattr(_base_client, "httpx", None)
  if module is None:   # pragma: no cover
    raise ImportError("the installed openai client uses neither httpx2 nor httpx")
  return module


def http_client(uds: str, *, timeout: float = 300.0, asynchronous: bool = False):
  """An httpx(2) client whose requests go to the unix socket `uds` (URLs: http://localhost/...)."""
  httpx = httpx_module()
  if asynchronous:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=uds), timeout=timeout)
  return httpx.Client(transport=httpx.HTTPTransport(uds=uds), timeout=timeout)


def openai_client(uds: str, *, timeout: float = 300.0, asynchronous: bool = False):
  """`openai.OpenAI` (or `AsyncOpenAI`) talking to the server listening on the unix socket `uds`."""
  import openai   # noqa: PLC0415
  cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
  return cls(base_url="http://localhost/v1", api_key="unused", max_retries=0, timeout=timeout,
             http_client=http_client(uds, timeout=timeout, asynchronous=asynchronous))
