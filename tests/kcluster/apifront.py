"""An https front for the test API server, so pods of the image mode reach it as real pods do.

A pod's in-cluster configuration (kubernetes_asyncio's loader, which `tandem_engine.kubeclient`
uses when KUBECONFIG is unset) insists on https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
verified against the service account's ca.crt, while the test API server speaks plain http.
`HttpsFront` terminates TLS with a throw-away self-signed certificate (made by the openssl
command; valid for 127.0.0.1 and the kubernetes service names) and pipes the bytes to the
server, so watches stream through unchanged. It runs its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import threading
from pathlib import Path
from urllib.parse import urlsplit

HOST = "127.0.0.1"
NAMES = "IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"


class HttpsFront:
    """`front = HttpsFront(cluster.url, folder).start()`; `front.port`, `front.ca_file`;
    `front.close()`."""

    def __init__(self, upstream_url: str, folder: Path) -> None:
        upstream = urlsplit(upstream_url)
        self.upstream = (upstream.hostname or HOST, upstream.port or 80)
        self.ca_file = folder / "apiserver.crt"
        self._key_file = folder / "apiserver.key"
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> HttpsFront:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                        "/CN=kubernetes", "-addext", f"subjectAltName={NAMES}",
                        "-keyout", str(self._key_file), "-out", str(self.ca_file)],
                       check=True, capture_output=True, timeout=30)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca_file, self._key_file)
        started = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(context, started),),
                                        name="apiserver-https", daemon=True)
        self._thread.start()
        if not started.wait(30) or not self.port:
            raise RuntimeError("the https front of the test API server did not start")
        return self

    def close(self) -> None:
        loop, self._loop = self._loop, None  # a second close() is a no-op
        if loop is not None and self._stop is not None:
            loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    async def _serve(self, context: ssl.SSLContext, started: threading.Event) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            server = await asyncio.start_server(self._relay, HOST, 0, ssl=context)
            self.port = server.sockets[0].getsockname()[1]
        finally:
            started.set()
        async with server:
            await self._stop.wait()

    async def _relay(self, client_in: asyncio.StreamReader,
                     client_out: asyncio.StreamWriter) -> None:
        try:
            server_in, server_out = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_out.close()
            return
        await asyncio.gather(_pipe(client_in, server_out), _pipe(server_in, client_out))
        for writer in (client_out, server_out):
            writer.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copies until end of stream, then passes the half-close on (TLS cannot: it closes)."""
    with contextlib.suppress(OSError, ssl.SSLError):
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
        else:
            sink.close()
