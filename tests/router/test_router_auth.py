"""The router's closed surface, as a client meets it: API keys (`--api-key`,
`--api-key-file`, $TANDEM_API_KEY, `tandem serve --api-key-file`, kept out of `ps`) checked
by the real router against the openai client, with the probes left open; and the
header-read timeout cutting a slowloris client (raw sockets) while normal requests keep
working."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from tandem_engine.cli.serve import die_with_parent, free_port
from tandem_engine.router.auth import API_KEY_ENV, resolve_api_keys

ENV_KEYS = ["sk-env-one", "sk-env-two"]
FLAG_KEY = "sk-flag"
FILE_KEY = "sk-file"
HEADER_TIMEOUT = 1.0

pytestmark = pytest.mark.slow


def test_keys_come_from_flags_files_and_the_environment(tmp_path: Path) -> None:
    assert resolve_api_keys(None, {}) == ()
    assert resolve_api_keys(["a", "b"], {API_KEY_ENV: " b, c ,,"}) == ("a", "b", "c")
    assert resolve_api_keys([], {API_KEY_ENV: ""}) == ()
    for bad in (["a b"], ["a\tb"], ["x\x00"]):
        with pytest.raises(ValueError, match="--api-key"):
            resolve_api_keys(bad, {})
    keys = tmp_path / "keys"
    keys.write_text("  sk-one\n\nsk-two  \r\nsk-one\n")
    assert resolve_api_keys(None, {API_KEY_ENV: "sk-env"}, [keys]) == ("sk-one", "sk-two",
                                                                     "sk-env")
    (tmp_path / "blank").write_text("\n  \n")
    (tmp_path / "spaced").write_text("sk one\n")
    for name, why in (("blank", "holds no key"), ("missing", "cannot be read"),
                      ("spaced", "is not one of tenant=")):
        with pytest.raises(ValueError, match=why) as refused:
            resolve_api_keys(None, {}, [tmp_path / name])
        assert why == "is not one of tenant=" or f"--api-key-file {tmp_path / name}" in str(
            refused.value)


@contextlib.contextmanager
def keyed_router(cluster, logs: Path, keys: list[str], *flags: str) -> Iterator[str]:
    """A second router over `cluster`'s engines, its keys in $TANDEM_API_KEY (and any
    `flags`), with a 1 s header timeout; yields its URL."""
    from test_router_e2e import _router_cmd, _stop, _wait_ready

    port = free_port()
    cmd = [*_router_cmd(cluster.model_dir, cluster.engine_keys, port),
           "--header-timeout", str(HEADER_TIMEOUT), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           API_KEY_ENV: ",".join(keys)}
    log = logs / f"router-keyed-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=die_with_parent)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(f"{url}/readyz", proc, log)
        yield url
    finally:
        _stop([proc])


@pytest.fixture(scope="module")
def routers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, str, Path]]:
    """One engine; an open router and a keyed one over it: (open URL, keyed URL, logs)."""
    from test_router_e2e import run_cluster

    logs = tmp_path_factory.mktemp("router-auth")
    (logs / "api-keys").write_text(f"{FILE_KEY}\n")
    for cluster in run_cluster(tiny_llama, logs, ("mixed",)):
        with keyed_router(cluster, logs, ENV_KEYS, "--api-key", FLAG_KEY,
                          "--api-key-file", str(logs / "api-keys")) as keyed_url:
            yield cluster.router_url, keyed_url, logs


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def test_every_configured_key_works_and_no_other(routers) -> None:
    _, url, _ = routers
    for key in [*ENV_KEYS, FLAG_KEY, FILE_KEY]:
        client = _client(url, key)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        got = client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        assert got.usage.completion_tokens == 2
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert chat.choices[0].finish_reason == "length"
    for wrong in ("sk-wrong", ENV_KEYS[0] + "x", ENV_KEYS[0][:-1], ",".join(ENV_KEYS)):
        with pytest.raises(openai.AuthenticationError) as exc:
            _client(url, wrong).completions.create(model="tiny", prompt="x", max_tokens=1)
        assert exc.value.status_code == 401
        assert exc.value.code == "invalid_api_key"
        assert exc.value.body["type"] == "invalid_request_error"
        assert wrong not in exc.value.message  # never echoed back
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and error["param"] is None
    assert "Authorization: Bearer" in error["message"]
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Basic {FLAG_KEY}"}
                     ).status_code == 401


def test_probes_are_open_and_everything_else_needs_a_key(routers) -> None:
    open_url, url, _ = routers
    for path in ("/healthz", "/readyz", "/metrics", "/health"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    auth = {"Authorization": f"Bearer {ENV_KEYS[1]}"}
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/v1/engines", None),
                               ("GET", "/version", None), ("GET", "/openapi.json", None),
                               ("POST", "/tokenize", {"prompt": "hi"}),
                               ("POST", "/detokenize", {"tokens": [1]}),
                               ("POST", "/v1/chat/completions", {})]:
        r = httpx.request(method, f"{url}{path}", json=body)
        assert r.status_code == 401, (path, r.text)
        assert httpx.request(method, f"{url}{path}", json=body, headers=auth
                             ).status_code in (200, 400), path
        assert httpx.request(method, f"{open_url}{path}", json=body
                             ).status_code in (200, 400), path
    # An unknown path tells a client without a key nothing either.
    assert httpx.get(f"{url}/v1/secret").status_code == 401
    assert httpx.get(f"{url}/v1/secret", headers=auth).status_code == 404


def test_the_open_router_warns_and_the_env_keys_stay_out_of_ps(routers) -> None:
    _, url, logs = routers
    assert "the API is open to anyone" in (logs / "router.log").read_text()
    keyed_log = next(logs.glob("router-keyed-*.log")).read_text()
    assert "open to anyone" not in keyed_log
    port = url.rsplit(":", 1)[1]
    for pid in map(int, subprocess.run(["pgrep", "-f", "--", f"--port {port}"],
                                       capture_output=True, text=True).stdout.split()):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert all(k not in cmdline for k in (*ENV_KEYS, FILE_KEY))


# ---- slowloris --------------------------------------------------------------------------------


def _closed_after(sock: socket.socket, trickle: bytes, limit: float, start: float) -> float:
    """Send `trickle` a byte every 0.2 s; return the seconds from `start` until the server
    closed the connection."""
    sock.settimeout(0.2)
    for byte in trickle:
        # A close with our bytes still unread reaches us as a reset, not an end of stream.
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except ConnectionResetError:
            return time.monotonic() - start
        except TimeoutError:
            pass
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start
        assert time.monotonic() - start < limit, "the slow client is still connected"
    raise AssertionError("trickle ran out before the server closed the connection")


def test_a_slow_client_is_cut_at_the_header_timeout(routers) -> None:
    _, url, _ = routers
    host, port = url.removeprefix("http://").split(":")
    auth = {"Authorization": f"Bearer {FLAG_KEY}"}
    slow = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
            + b"a" * 200)  # never ends its headers
    bound = HEADER_TIMEOUT + 1.5  # the timeout, plus slack for a busy machine
    # The clock starts when the connection opens.
    with socket.create_connection((host, int(port))) as s1, \
            socket.create_connection((host, int(port))) as s2:
        opened = time.monotonic()
        # Meanwhile, normal requests keep working (on their own connections).
        with httpx.Client(base_url=url, headers=auth, timeout=10) as http:
            assert http.get("/v1/models").status_code == 200
            took = _closed_after(s1, slow, bound, opened)
            assert HEADER_TIMEOUT * 0.9 <= took < bound, took
            assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200
        # A connection that never sends anything is cut too.
        s2.settimeout(bound)
        assert s2.recv(1) == b""
        assert time.monotonic() - opened < bound
    # The kept-alive case: tests/server/test_http_guard.py, on every port.


def test_an_unreadable_key_file_is_refused_before_the_model_is_pulled(
        tmp_path: Path) -> None:
    """`tandem serve MODEL --api-key-file MISSING` with an empty model cache: refused
    naming the flag and the file, and nothing was downloaded into the cache."""
    cache = tmp_path / "cache"
    missing = tmp_path / "no-such-keys"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tandem_engine.cli.main", "serve", "--model",
         "smollm2-135m-instruct", "--port", str(free_port()), "--api-key-file",
         str(missing)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TANDEM_CACHE_DIR": str(cache)})
    assert done.returncode != 0
    assert "--api-key-file" in done.stderr and str(missing) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not cache.exists() or not any(cache.rglob("*"))
    assert time.monotonic() - started < 30


def test_tandem_serve_keeps_its_api_key_out_of_ps(tmp_path: Path) -> None:
    """`tandem serve --demo --api-key-file F`, started in `tmp_path` (the default
    --demo-dir): the key is in no process's command line, its own included, and reaches
    the router in its environment; refits may load from the demo folder only, not from
    the directory `serve` was started in."""
    from test_serve import stop_serve, wait_for_url

    port = free_port()
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{FLAG_KEY}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem_engine.cli.main", "serve", "--demo", "--port",
         str(port), "--api-key-file", str(key_file)], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**{k: v for k, v in os.environ.items() if k != API_KEY_ENV},
             "TMPDIR": str(tmp_path)})
    try:
        wait_for_url(proc)
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(openai.AuthenticationError):
            _client(url, "sk-wrong").models.list()
        assert _client(url, FLAG_KEY).models.list().data[0].id == "demo-model"
        stack = json.loads((tmp_path / f"tandem-{port}" / "stack.json").read_text())
        assert stack["weights_roots"] == [str((tmp_path / ".demo-model").resolve())]
        processes = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
        assert len(processes) >= 3  # serve, its engine and its router
        routers = 0
        for pid in (p.pid for p in processes):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert FLAG_KEY.encode() not in cmdline and stack["admin_token"].encode() \
                not in cmdline, cmdline
            if b"tandem_engine.router.main" in cmdline:
                routers += 1
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert f"{API_KEY_ENV}={FLAG_KEY}".encode() in environ
        assert routers == 1
        stop_serve(proc)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
