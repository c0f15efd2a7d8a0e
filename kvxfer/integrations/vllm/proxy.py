"""A small disaggregation proxy for trying vLLM with kvxfer by hand (not a production router).

    python -m kvxfer.integrations.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        [--host 127.0.0.1] [--port 8000]

For each ``POST /v1/completions`` or ``POST /v1/chat/completions`` it does what every vLLM router does
(vLLM's toy proxy, llm-d, Dynamo): the request goes to the prefill with one output token, no stream and
``"kv_transfer_params": {"do_remote_decode": true}``; the prefill's answer carries the params that name
its KV; the client's request goes to the decode with those params, and the decode's answer (streamed
or not) goes back to the client as it comes. A prefill that refuses answers the client with its own
status and body (the decode is not asked); so does a decode that refuses (400 ``prompt_mismatch``,
403 ``untrusted_prefill``: docs/vllm.md). ``GET /v1/models`` and ``GET /health`` go to the decode.

Invariants: the client's body reaches the decode unchanged but for ``kv_transfer_params``; no request
reaches the decode without params from the prefill; every error names which server it came from.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ...core.arguments import check_host, parse_port
from ...errors import InvalidArgument

ROUTES = ("/v1/completions", "/v1/chat/completions")
TIMEOUT = 600.0


def _post(url: str, body: dict[str, Any]) -> Any:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    return urllib.request.urlopen(request, timeout=TIMEOUT)


class _Handler(BaseHTTPRequestHandler):
    server: _Proxy
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # one line per request on stderr, as http.server does
        sys.stderr.write("kvxfer vllm proxy: %s\n" % (fmt % args))

    def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, where: str, message: str) -> None:
        self._reply(status, json.dumps({"error": {"message": f"{where}: {message}", "code": status}}).encode())

    def _relay(self, response: Any) -> None:
        """The upstream answer as it comes (chunked, so a stream reaches the client token by token)."""
        self.send_response(response.status)
        self.send_header("Content-Type", response.headers.get("Content-Type", "application/json"))
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
            if not chunk:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _upstream_error(self, where: str, exc: Exception) -> None:
        if isinstance(exc, urllib.error.HTTPError):
            return self._reply(exc.code, exc.read() or json.dumps({"error": f"{where}: HTTP {exc.code}"}).encode())
        return self._error(502, where, str(getattr(exc, "reason", exc)))

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path not in ("/v1/models", "/health"):
            return self._error(404, "proxy", f"no route {self.path}")
        try:
            with urllib.request.urlopen(self.server.decode + self.path, timeout=30) as response:
                self._reply(response.status, response.read(), response.headers.get("Content-Type", "application/json"))
        except (urllib.error.URLError, OSError) as exc:
            self._upstream_error("decode", exc)

    def do_POST(self) -> None:  # noqa: N802
        if self.path not in ROUTES:
            return self._error(404, "proxy", f"no route {self.path} (routes: {', '.join(ROUTES)})")
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as exc:
            return self._error(400, "proxy", f"invalid JSON body: {exc}")
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        try:
            with _post(self.server.prefill + self.path, first) as response:
                answer = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return self._upstream_error("prefill", exc)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not params:
            return self._error(502, "prefill", "its answer carries no kv_transfer_params (is it a kv_producer "
                                               "with the KvxferConnector?)")
        try:
            with _post(self.server.decode + self.path, dict(body, kv_transfer_params=params)) as response:
                self._relay(response)
        except (urllib.error.URLError, OSError) as exc:
            self._upstream_error("decode", exc)


class _Proxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        super().__init__(address, _Handler)


def _url(value: str, flag: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise InvalidArgument(f"{flag} {value!r} is not an http:// or https:// URL")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvxfer.integrations.vllm.proxy",
                                     description="Route OpenAI-style requests through a vLLM prefill and a vLLM "
                                                 "decode joined by kvxfer (for trying it by hand).")
    parser.add_argument("--prefill", required=True, metavar="URL", help="the prefill server (kv_role kv_producer)")
    parser.add_argument("--decode", required=True, metavar="URL", help="the decode server (kv_role kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1", help="where the proxy listens (default 127.0.0.1)")
    parser.add_argument("--port", default="8000", help="its port (default 8000)")
    args = parser.parse_args(argv)
    try:
        prefill, decode = _url(args.prefill, "--prefill"), _url(args.decode, "--decode")
        address = (check_host(args.host, "--host"), parse_port(args.port, "--port"))
        proxy = _Proxy(address, prefill, decode)
    except InvalidArgument as exc:
        print(f"kvxfer vllm proxy: {exc.detail}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvxfer vllm proxy: --port {args.port}: cannot listen on {args.host}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"kvxfer vllm proxy: listening on http://{args.host}:{proxy.server_address[1]} "
          f"(prefill {prefill}, decode {decode})", flush=True)
    try:
        proxy.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
