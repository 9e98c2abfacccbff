"""`tandem-router`: the OpenAI-compatible router in front of a pool of engines.

    tandem-router --engine 127.0.0.1:5555 --engine 127.0.0.1:5556 --model DIR
    tandem-router --discover-pool NAME [--namespace NS] --model DIR   # in Kubernetes

The engines are a static list (`--engine`), or the engine pods of an InferencePool,
followed through the Kubernetes API (`--discover-pool`, see `router/discovery.py`).

`--model` (a checkpoint folder or GGUF file) is read for the tokenizer, the chat
template and the sampling defaults only (no weights, no torch). As in vLLM, a request's
left-out sampling parameters take the model's defaults (`--generation-config auto`: its
generation_config.json, or a known GGUF's registry entry; `generation_config.py`), and
`--override-generation-config JSON` lays values over them.
`--api-key-file` (one key a line), $TANDEM_API_KEY (comma-separated) and `--api-key` (shown
in `ps`: for tests) set the keys clients must send (`router/auth.py`); without any, the API
is open to anyone who reaches the port. `--admin-token-file` (else $TANDEM_ADMIN_TOKEN), the
pool's admin token, opens vLLM's LoRA adapter calls, which the router does on every engine
(`router/adapters.py`); without it they are refused.
A client gets `--header-timeout` seconds to send a request's headers (slowloris) and
`--body-timeout` more for its body; a refused request is read to its end before the
connection closes, so every client reads its answer (`http_guard.py`).
`--engine-metrics-url` (repeatable; `tandem serve` sets it) makes `/metrics` also carry
those engines' series (`router/metrics.py`). $TANDEM_ROUTER_ID names the router to its
engines and in `/v1/engines` (`tandem serve` sets a fresh one per stack and trusts only
the router that reports it); default: a random one.
SIGTERM or SIGINT stops accepting connections, gives open requests
`--shutdown-grace` seconds, then closes the engine connections and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import prometheus_client
import uvicorn

from tandem_engine import zmq_auth
from tandem_engine.cli_help import ArgumentParser
from tandem_engine.errors import TandemError
from tandem_engine.generation_config import (
    GENERATION_CONFIG_MODES,
    SAMPLING_KEYS,
    GenerationDefaults,
    serving_defaults,
)
from tandem_engine.http_guard import add_deadline_flags, protocol_class
from tandem_engine.router import auth
from tandem_engine.router import openai_format as fmt
from tandem_engine.router.admission import Admission
from tandem_engine.router.api_params import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_PROMPT_CHARS,
    RequestLimits,
)
from tandem_engine.router.dispatch import DispatchConfig, Dispatcher
from tandem_engine.router.engines import EnginePool
from tandem_engine.router.flags import add_router_flags
from tandem_engine.router.metrics import RouterMetrics
from tandem_engine.router.openai_api import build_app
from tandem_engine.tokenizer import Tokenizer
from tandem_engine.weights import resolve_checkpoint

log = logging.getLogger("tandem_engine.router")

ROUTER_ID_ENV = "TANDEM_ROUTER_ID"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="tandem-router", description=__doc__.split("\n")[0])
    engines = p.add_mutually_exclusive_group(required=True)
    engines.add_argument("--engine", action="append", metavar="HOST:PORT",
                         help="an engine's ZMQ address (repeat for every engine)")
    engines.add_argument("--discover-pool", metavar="NAME",
                         help="follow the engine pods of this InferencePool (label "
                              "tandem.dev/pool=NAME) through the Kubernetes API")
    p.add_argument("--namespace", default=None,
                   help="the pool's namespace, with --discover-pool (default: $POD_NAMESPACE, "
                        "else the service account's namespace, else default)")
    p.add_argument("--model", required=True, type=Path,
                   help="checkpoint folder or GGUF file: its tokenizer and chat template are used")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the folder name, as the engines)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="where the default sampling parameters (what a request leaves out) "
                        f"come from ({', '.join(SAMPLING_KEYS)}): auto, the model's "
                        "generation_config.json (for a GGUF known to `tandem models`, its "
                        "recommended values); vllm, the neutral defaults (temperature 1, "
                        "top_p 1); or a folder holding a generation_config.json. vLLM's "
                        f"flag and values ({', '.join(GENERATION_CONFIG_MODES)})")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="default sampling parameters laid over --generation-config's, as a "
                        "JSON object, e.g. '{\"temperature\": 0.5}'")
    p.add_argument("--host", default="127.0.0.1", help="address the OpenAI API listens on")
    p.add_argument("--port", type=int, default=8000, help="port of the OpenAI API")
    p.add_argument("--heartbeat-deadline", type=float, default=2.0,
                   help="seconds without a message after which an engine is dead")
    p.add_argument("--handshake-timeout", type=float, default=1.0,
                   help="seconds to wait for an engine's WELCOME before saying HELLO again")
    p.add_argument("--first-output-timeout", type=float, default=120.0,
                   help="seconds a RUNNING engine may take to produce a request's first "
                        "output before the request moves to another engine")
    p.add_argument("--output-timeout", type=float, default=60.0,
                   help="seconds a RUNNING engine may go silent mid-request")
    p.add_argument("--failover-timeout", type=float, default=30.0,
                   help="seconds to find an engine of the same weight version to continue "
                        "a request whose engine died")
    add_router_flags(p)
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted; a larger one gets 413 before it is "
                        "read or parsed (default %(default)s, 4 MiB: a 128k-token prompt as "
                        "text or as token ids, with room for JSON escaping)")
    p.add_argument("--max-prompt-chars", type=int, default=DEFAULT_MAX_PROMPT_CHARS,
                   help="longest prompt (a completions prompt, or a chat's messages together) "
                        "in characters; a longer one gets 400 before it is tokenized (default "
                        "%(default)s: about twice a 128k-token context of English text)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a key clients must send (Authorization: Bearer KEY); repeat for "
                        "several. Visible in `ps` to every user of the machine: prefer "
                        f"--api-key-file or ${auth.API_KEY_ENV} (comma-separated), which "
                        "keep keys out of `ps`. Any configured key is accepted. Default: "
                        "none, the API is open")
    p.add_argument("--api-key-file", action="append", default=None, type=Path,
                   metavar="FILE", help="a file of keys clients may send, one a line "
                        "(repeatable); safe: keys stay out of `ps`")
    p.add_argument("--admin-token-file", type=Path, default=None, metavar="FILE",
                   help="the pool's admin token (the engines'; else "
                        f"${auth.ADMIN_TOKEN_ENV}): POST /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter need it and load or unload the adapter on "
                        "every engine. Default: none, those calls are refused")
    add_deadline_flags(p)
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="tokenize chat message content that spells a special token "
                        "(<|im_start|>, say) as that control token. Unsafe: a user can then "
                        "forge turns and roles (role injection). Default: content is text")
    p.add_argument("--engine-metrics-url", action="append", default=[], metavar="URL",
                   help="an engine's read-only /metrics (its --metrics-port) whose series "
                        "this router's /metrics also serves, fetched at each scrape (repeat "
                        "for every engine; `tandem serve` sets it). Default: none, the "
                        "router's own series only (in Kubernetes Prometheus scrapes each pod)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds open requests get after SIGTERM")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="log verbosity")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.model = resolve_checkpoint(args.model)  # a model image's /model: its .gguf
    if args.namespace is not None and args.discover_pool is None:
        parser.error("--namespace goes with --discover-pool, not --engine")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prometheus_client.disable_created_metrics()  # no `_created` series (docs/metrics.md)
    try:
        tokenizer = Tokenizer.from_path(args.model)
        defaults = serving_defaults(args.model, args.generation_config,
                                    args.override_generation_config)
        pool, engines = _engine_pool(args)
        config = DispatchConfig(first_output_timeout=args.first_output_timeout,
                                output_timeout=args.output_timeout,
                                failover_timeout=args.failover_timeout,
                                prefix_routing=args.prefix_routing)
        limits = RequestLimits(max_body_bytes=args.max_body_bytes,
                               max_prompt_chars=args.max_prompt_chars)
        policies = auth.resolve_key_policies(args.api_key, key_files=args.api_key_file)
        api_keys = tuple(policies)
        admission = Admission(policies, max_num_requests=args.max_num_requests)
        admin_token = auth.resolve_admin_token(args.admin_token_file)
        http = protocol_class(args.header_timeout, args.body_timeout, _error_body)
    except (TandemError, ValueError, OSError) as exc:
        print(f"tandem-router: error: {exc}", file=sys.stderr)
        return 2
    served = args.served_model_name or args.model.name or args.model.resolve().name
    dispatcher = Dispatcher(pool, config, RouterMetrics(args.engine_metrics_url))
    app = build_app(pool, tokenizer, served, dispatcher, limits, api_keys,
                    args.allow_special_tokens_in_content, generation_defaults=defaults,
                    admin_token=admin_token, admission=admission)
    _log_defaults(defaults, args.generation_config)
    if not api_keys:
        log.warning("the API is open to anyone who reaches port %d: no API key configured "
                    "(--api-key-file, --api-key or $%s)", args.port, auth.API_KEY_ENV)
    server = _Server(uvicorn.Config(
        app, host=args.host, port=args.port, http=http, log_level="warning", access_log=False,
        timeout_graceful_shutdown=max(1, round(args.shutdown_grace))))
    log.info("router %s serving %r on http://%s:%d for engines %s", pool.router_id, served,
             args.host, args.port, engines)
    # SIGTERM/SIGINT: stop listening, finish or cut open requests after the grace period,
    # then run the lifespan's shutdown (closing every engine socket), and exit 0.
    server.run()
    log.info("router stopped")
    return 0


def _error_body(status: int, message: str) -> dict:
    """The OpenAI shape for the HTTP layer's own 4xx answers (http_guard.py)."""
    return fmt.error_body(message)


def _log_defaults(defaults: GenerationDefaults, mode: str) -> None:
    """Say at start which defaults requests get, in vLLM's words."""
    if not defaults.sampling_kwargs():
        log.info("default sampling parameters: the neutral ones (%s)", defaults.source)
        return
    if mode == "auto":
        log.warning("Default sampling parameters have been overridden by the model's "
                    "generation config recommended from the model creator. If this is not "
                    "intended, please relaunch with `--generation-config vllm`.")
    log.info("Using default sampling params from %s: %s", defaults.source,
             defaults.sampling_kwargs())


def _engine_pool(args: argparse.Namespace) -> tuple[EnginePool, str]:
    """The pool the flags ask for, and how to name its engines in the log."""
    curve = zmq_auth.router_curve()  # ZmqAuthError (a ValueError): exit 2 naming the variable
    if curve is None:
        log.warning("ZMQ unauthenticated: engines that require CURVE will refuse this "
                    "router; set $%s and $%s to authenticate", zmq_auth.SERVER_PUBLIC_KEY,
                    zmq_auth.CLIENT_SECRET_KEY)
    timing = {"heartbeat_deadline": args.heartbeat_deadline,
              "handshake_timeout": args.handshake_timeout, "curve": curve,
              "router_id": os.environ.get(ROUTER_ID_ENV) or None}
    if args.engine:
        return EnginePool(args.engine, **timing), ", ".join(args.engine)
    # Only a discovering router needs the Kubernetes client (0.5 s of every start).
    from tandem_engine import kubeclient
    from tandem_engine.router import discovery

    namespace = discovery.resolve_namespace(args.namespace)
    # Read now (an exec credential plugin runs once): a bad kubeconfig stops the router here.
    config = asyncio.run(kubeclient.load_configuration())
    pool = discovery.DiscoveredEnginePool(args.discover_pool, namespace, config, **timing)
    return pool, f"of pool {args.discover_pool} in namespace {namespace} (discovered)"


class _Server(uvicorn.Server):
    """uvicorn's server, except that a handled SIGTERM/SIGINT ends in exit status 0
    (uvicorn itself re-raises the signal after its graceful shutdown)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        log.info("signal %d: shutting down", sig)
        if self.should_exit:  # a second signal: stop waiting for open requests
            self.force_exit = True
        self.should_exit = True


if __name__ == "__main__":
    sys.exit(main())
