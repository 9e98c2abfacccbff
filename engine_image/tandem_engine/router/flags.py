"""The router's serving flags, defined once: `tandem-router` takes them, and `tandem serve`
passes them through to the router it starts. Light on imports (the `tandem` command's
parser is built from it).

* `--max-num-requests N`: generation requests the router has in flight at once; past
  it, 429 with `Retry-After` at once (router/admission.py).
* `--prefix-routing exact|approximate`: how prefix affinity knows what each engine holds
  (router/picker.py).
"""

from __future__ import annotations

import argparse

PREFIX_ROUTING = ("exact", "approximate")
DEFAULT_PREFIX_ROUTING = "exact"


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number (e.g. 256)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be >= 1 (e.g. 256; leave the flag out "
                                         "for no bound)")
    return n


def add_router_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--max-num-requests", type=_positive, default=None, metavar="N",
        help="generation requests the router has in flight at once; past it a request gets "
             "429 with Retry-After at once (engines bound their own queues: "
             "--max-queued-requests). Default: no bound")
    parser.add_argument(
        "--prefix-routing", choices=PREFIX_ROUTING, default=DEFAULT_PREFIX_ROUTING,
        help="how prefix affinity knows what each engine holds: exact (from the engines' KV "
             "events: their evictions and other routers' traffic included) or approximate "
             "(the router's memory of what it sent where, the earlier behaviour; for "
             "comparison) (default %(default)s)")


def router_flag_args(args: argparse.Namespace) -> list[str]:
    """The `tandem-router` arguments for these flags' values in `args`."""
    out = ["--prefix-routing", args.prefix_routing]
    if args.max_num_requests is not None:
        out += ["--max-num-requests", str(args.max_num_requests)]
    return out
