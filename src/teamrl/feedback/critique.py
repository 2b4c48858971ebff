"""A critique of a joint action from an external model over an OpenAI-compatible chat API (optional).

Between turns the coding environments can ask a stronger model to review the team's code. Any server
that speaks the OpenAI chat-completions protocol works (OpenAI, vLLM, llama.cpp's server, Ollama...):
the client POSTs ``{"model", "messages", "max_tokens", "temperature"}`` to ``<base_url>/chat/completions``
and reads ``choices[0].message.content``. It uses only the standard library.

Nothing here may stop training: :meth:`CritiqueClient.critique` returns None on any failure (after the
configured retries) and logs a warning, and the caller falls back to its static feedback. Only a wrong
configuration (an unknown field, an API-key variable that is not set) is an error, raised at once.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You review Python code written by a team of two programmers: a helper writes the function `aux`, "
    "and the main programmer writes the required function, which may call `aux`. Given the problem, "
    "their combined code and the automatic checks, say in a few short sentences what is wrong and how "
    "to fix it. Do not write the full solution."
)

#: HTTP statuses worth another try: rate limiting and server-side failures.
_RETRY_STATUSES = frozenset({408, 409, 425, 429}) | frozenset(range(500, 600))


class CritiqueError(RuntimeError):
    """The critique model gave no usable answer (after the retries, where retrying made sense)."""


class _Transient(CritiqueError):
    """A failure that another try may not have: a timeout, a refused connection, a 429 or 5xx."""


@dataclass(frozen=True)
class CritiqueConfig:
    """Where the critique model is and how patiently to ask it.

    Attributes:
        base_url: the API root, e.g. ``http://localhost:8000/v1`` (requests go to ``<base_url>/chat/completions``).
        model: the model name the server expects.
        api_key_env: name of the environment variable holding the API key (sent as a Bearer token);
            None sends no key (typical for a local server).
        timeout_s: seconds to wait for one HTTP response.
        max_retries: further tries after a transient failure (timeout, connection error, HTTP 429/5xx);
            other failures (HTTP 4xx, an answer that is not a chat completion) are not retried.
        backoff_s: wait before the first retry; it doubles for each further one.
        max_tokens: most tokens the critique may have.
        temperature: sampling temperature of the critique.
        max_chars: the critique is cut to this many characters.
        system_prompt: what the critique model is told to do.
    """

    base_url: str
    model: str
    api_key_env: str | None = None
    timeout_s: float = 30.0
    max_retries: int = 2
    backoff_s: float = 1.0
    max_tokens: int = 256
    temperature: float = 0.0
    max_chars: int = 1500
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"critique.base_url: must be an http(s) URL such as http://localhost:8000/v1 "
                             f"(got {self.base_url!r})")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"critique.model: must name the model the server serves (got {self.model!r})")
        for name in ("timeout_s", "max_tokens", "max_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"critique.{name}: must be > 0 (got {getattr(self, name)!r})")
        for name in ("max_retries", "backoff_s", "temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"critique.{name}: must be >= 0 (got {getattr(self, name)!r})")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "critique") -> CritiqueConfig:
        """Build from plain data (a config's mapping); unknown or missing fields name ``where``."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        missing = [name for name in ("base_url", "model") if name not in data]
        if missing:
            raise ValueError(f"{where}: missing required field(s) {missing}")
        return cls(**data)


def api_key(config: CritiqueConfig) -> str | None:
    """The API key named by ``config.api_key_env`` (None when no variable is named).

    Raises:
        ValueError: the variable is named but not set (or empty).
    """
    if config.api_key_env is None:
        return None
    key = os.environ.get(config.api_key_env)
    if not key:
        raise ValueError(f"critique.api_key_env: environment variable {config.api_key_env!r} is not set; "
                         "export it or set api_key_env to null for a server without keys")
    return key


def parse_chat_completion(body: bytes) -> str:
    """``choices[0].message.content`` of a chat-completion response body, stripped.

    Raises:
        CritiqueError: the body is not JSON, lacks that field, or the content is empty.
    """
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise CritiqueError(f"the answer is not a chat completion ({type(err).__name__}: {err}): "
                            f"{body[:200]!r}") from None
    if not isinstance(content, str) or not content.strip():
        raise CritiqueError(f"the chat completion has no text content: {body[:200]!r}")
    return content.strip()


def _post_once(url: str, payload: bytes, headers: dict[str, str], timeout_s: float) -> bytes:
    request = urllib.request.Request(url, data=payload, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as err:
        kind = _Transient if err.code in _RETRY_STATUSES else CritiqueError
        raise kind(f"HTTP {err.code} {err.reason} from {url}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as err:
        # URLError wraps refused connections and connect timeouts; a timeout while reading the body is a
        # bare TimeoutError, a connection cut mid-answer an HTTPException (e.g. IncompleteRead).
        raise _Transient(f"no answer from {url}: {getattr(err, 'reason', err)}") from None


def chat_completion(config: CritiqueConfig, messages: Sequence[Mapping[str, str]], key: str | None = None) -> str:
    """Ask the model for a chat completion of ``messages``; its text.

    Transient failures are retried up to ``config.max_retries`` times, waiting ``backoff_s``,
    ``2 * backoff_s``, ``4 * backoff_s``... between tries.

    Raises:
        CritiqueError: no usable answer; the message says what happened on the last try.
    """
    url = config.base_url.rstrip("/") + "/chat/completions"
    payload = json.dumps({"model": config.model, "messages": list(messages), "max_tokens": config.max_tokens,
                          "temperature": config.temperature}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    attempt = 0
    while True:
        try:
            return parse_chat_completion(_post_once(url, payload, headers, config.timeout_s))
        except _Transient as err:
            if attempt == config.max_retries:
                raise CritiqueError(f"{err} (gave up after {attempt + 1} tries)") from None
            time.sleep(config.backoff_s * 2 ** attempt)
            attempt += 1


def critique_messages(config: CritiqueConfig, problem: str, program: str, checks: str) -> list[dict[str, str]]:
    """The chat messages asking for a review of ``program`` (the team's joined code) for ``problem``."""
    user = (f"Problem:\n{problem}\n\nThe team's combined code:\n```python\n{program}```\n\n"
            f"Automatic checks:\n{checks}")
    return [{"role": "system", "content": config.system_prompt}, {"role": "user", "content": user}]


class CritiqueClient:
    """Asks the configured model to review a joint action; never raises once built.

    Raises (at construction):
        ValueError: ``config.api_key_env`` names a variable that is not set.
    """

    def __init__(self, config: CritiqueConfig):
        self.config = config
        self._key = api_key(config)

    def critique(self, problem: str, program: str, checks: str) -> str | None:
        """The model's review (cut to ``max_chars``), or None after logging a warning when it failed."""
        try:
            text = chat_completion(self.config, critique_messages(self.config, problem, program, checks), self._key)
        except CritiqueError as err:
            _log.warning("critique model %r failed, using static feedback only: %s", self.config.model, err)
            return None
        return text[: self.config.max_chars]
