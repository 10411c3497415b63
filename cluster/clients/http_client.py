"""A small streaming client of the OpenAI-compatible HTTP API, on the standard library
(used by `pdserve generate --target http://host:port`)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.engine.sampling import SamplingParams


class HttpApiError(Exception):
    """The server answered with an OpenAI-shaped error (or something that is not the API)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def stream_text(base_url: str, prompt: str, params: SamplingParams, chat: bool = False,
                timeout_s: float | None = None, credentials: ClientCredentials | None = None) -> Iterator[str]:
    """Yields the text of one completion (chat completion with `chat`) as the server streams it.
    `credentials`: the TLS files for an https:// URL and the server's bearer token."""
    credentials = credentials or ClientCredentials()
    body: dict[str, object] = {
        "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
        "top_k": params.top_k, "min_p": params.min_p, "stream": True, "ignore_eos": params.ignore_eos,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    structured = params.structured
    if structured is not None and structured.kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif structured is not None:
        schema = json.loads(structured.json_schema)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **credentials.http_headers()}
    req = urllib.request.Request(base_url.rstrip("/") + path, json.dumps(body).encode(), headers)
    context = credentials.ssl_context()
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s, context=context)
    except urllib.error.HTTPError as e:
        raise HttpApiError(e.code, _message(e.read())) from e
    except urllib.error.URLError as e:
        raise HttpApiError(0, f"cannot reach {base_url}: {e.reason}") from e
    except (http.client.HTTPException, OSError) as e:
        # E.g. a TLS 1.3 server that refuses our certificate closes the connection after the
        # handshake: the client sees it only as the response that never comes.
        raise HttpApiError(0, f"connection to {base_url} failed: {type(e).__name__}: {e}") from e
    with resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise HttpApiError(resp.status, event["error"].get("message", ""))
            for choice in event.get("choices", []):
                yield (choice.get("delta", {}).get("content") if chat else choice.get("text")) or ""


def _message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]
