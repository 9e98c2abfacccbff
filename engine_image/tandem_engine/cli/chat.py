"""`tandem chat MODEL`: a conversation with a model in the terminal, as `ollama run MODEL`.

The model runs in this process, as in `tandem generate`. Each turn renders the whole
conversation with the checkpoint's chat template through the router's renderer
(router/chat.py), so a turn is tokenized exactly as the same messages sent to
/v1/chat/completions. The answer is shown as the engine releases its text: the engine's
one text owner (text.py) detokenizes it incrementally and holds back what may begin a
stop string, so what is printed is never taken back.

`tandem generate` reads a model the same way: its prompts go through the same template
(`ChatRenderer`) and its sampling starts from the same defaults (`sampling_params`).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tandem_engine.config import context_room, speculative_from_flags
from tandem_engine.errors import TandemError
from tandem_engine.generation_config import generation_defaults
from tandem_engine.router.api_params import InvalidRequest
from tandem_engine.router.chat import ChatEncoder, ChatPrompt, ChatTemplate, ChatTemplateError
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tandem_engine.engine.llm import LLM
    from tandem_engine.engine.outputs import CompletionOutput

EXIT_COMMANDS = ("/exit", "/bye")
CLEAR_COMMAND = "/clear"
HELP_COMMANDS = ("/?", "/help")
MULTILINE_QUOTE = '"""'
HELP = "\n".join(f"  {keys:<17}{what}" for keys, what in (
    (" or ".join(EXIT_COMMANDS), "leave (Ctrl-D too)"),
    (CLEAR_COMMAND, "forget the conversation (the --system prompt stays)"),
    (" or ".join(HELP_COMMANDS), "this help"),
    (f"{MULTILINE_QUOTE} ... {MULTILINE_QUOTE}", "a message of several lines"),
    ("Ctrl-C", "stop the answer being written")))
_request_ids = itertools.count()


def plural(n: int, word: str) -> str:
    """`1 token`, `2 tokens`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class ChatRenderer:
    """Messages -> prompt token ids with a checkpoint's chat template, as the router
    renders them (only the template's own special tokens are special)."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self._template = template
        self._encoder = ChatEncoder(tokenizer)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ChatRenderer | None:
        """The model's renderer; None when its tokenizer has no chat template."""
        template = ChatTemplate.from_tokenizer(tokenizer)
        return cls(template, tokenizer) if template is not None else None

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            return self._encoder.encode(self._template, ChatPrompt(messages))
        except (InvalidRequest, ChatTemplateError) as exc:
            raise ValueError(str(exc)) from None


def sampling_params(args: argparse.Namespace, model: Path, *,
                    default_max_tokens: int) -> SamplingParams:
    """The flags the user gave, over the model's own generation defaults
    (generation_config.json, or the known model's recorded ones: temperature, top_p,
    top_k, min_p, repetition_penalty), over the engine's."""
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    params: dict[str, Any] = {"max_tokens": default_max_tokens}
    params.update(generation_defaults(model).sampling_kwargs())
    params.update({k: v for k, v in given.items() if v is not None})
    params.update(stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)
    return SamplingParams(**params)


def load_llm(args: argparse.Namespace, model: Path, **engine_options: object) -> LLM:
    """The model in this process, with the device, dtype and speculative flags given."""
    import torch

    from tandem_engine.engine.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    return LLM(model=str(model), dtype=args.dtype, quantization=args.quantization,
               device=args.device,
               gpu_memory_utilization=args.gpu_memory_utilization,
               speculative=speculative_from_flags(args), **engine_options)


class _Interrupt:
    """Ctrl-C while an answer is written stops that answer, between two engine steps (an
    interrupt inside a step could leave the engine half-way through it)."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupt:
        self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _press(self, signum: int, frame: object) -> None:
        self.pressed = True


def stream_answer(llm: LLM, prompt_ids: list[int], params: SamplingParams,
                  write: Callable[[str], None]) -> CompletionOutput:
    """Generate one answer, writing its text as the engine releases it; returns the
    finished completion (finish_reason "abort" when Ctrl-C stopped it)."""
    engine = llm.engine
    request_id = f"chat-{next(_request_ids)}"
    engine.add_request(request_id, prompt_ids, params)
    shown = 0
    with _Interrupt() as interrupt:
        while True:
            if interrupt.pressed:
                engine.abort(request_id)
                interrupt.pressed = False
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                completion = out.outputs[0]
                if len(completion.text) > shown:
                    write(completion.text[shown:])
                    shown = len(completion.text)
                if out.finished:
                    if completion.error:
                        raise RuntimeError(completion.error)
                    return completion


@dataclass
class Conversation:
    """The messages so far; the system prompt survives /clear."""

    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def clear(self) -> None:
        self.messages.clear()

    def with_user(self, text: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.messages, {"role": "user", "content": text}]

    def add_turn(self, user: str, assistant: str) -> None:
        self.messages += [{"role": "user", "content": user},
                          {"role": "assistant", "content": assistant}]


def read_messages(stdin: IO[str], stderr: IO[str], tty: bool) -> Iterator[str]:
    """The user's messages: a line each, or the lines between two `\"\"\"`; ends at EOF.
    On a terminal, with a `>>> ` prompt and line editing."""
    def read(prompt: str) -> str | None:
        if tty:
            try:
                return input(prompt)
            except EOFError:
                return None
        line = stdin.readline()
        return line.rstrip("\n") if line else None

    def message() -> str | None:
        line = read(">>> ")
        if line is None or not line.lstrip().startswith(MULTILINE_QUOTE):
            return line
        body: str | None = line.lstrip()[len(MULTILINE_QUOTE):]
        lines = []
        while body is not None:
            if body.rstrip().endswith(MULTILINE_QUOTE):  # the closing quotes
                lines.append(body.rstrip().removesuffix(MULTILINE_QUOTE))
                break
            lines.append(body)
            body = read("... ")
        return "\n".join(lines).strip("\n")

    while True:
        try:
            text = message()
        except KeyboardInterrupt:  # at the prompt: as ollama, say how to leave
            print(f"\nUse Ctrl-D or {EXIT_COMMANDS[1]} to exit.", file=stderr)
            continue
        if text is None:
            return
        yield text


def chat(llm: LLM, renderer: ChatRenderer, params: SamplingParams, conversation: Conversation,
         stdin: IO[str], stdout: IO[str], stderr: IO[str], *, tty: bool,
         verbose: bool = False) -> int:
    """The conversation loop: a message in, the answer streamed out, until /exit or EOF."""
    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    for text in read_messages(stdin, stderr, tty):
        command = text.strip()
        if not command:
            continue
        if command in EXIT_COMMANDS:
            break
        if command == CLEAR_COMMAND:
            conversation.clear()
            print("Cleared the conversation.", file=stderr)
            continue
        if command in HELP_COMMANDS:
            print(HELP, file=stderr)
            continue
        if command.startswith("/") and " " not in command:
            print(f"Unknown command {command!r}. Type /? for help.", file=stderr)
            continue
        try:
            prompt_ids = renderer.encode(conversation.with_user(text))
            limit = llm.engine.stats.max_model_len
            room = context_room(len(prompt_ids), limit)
            if room < 1:
                print(f"error: the conversation is now {plural(len(prompt_ids), 'token')}, "
                      f"and this engine holds at most {limit}: {CLEAR_COMMAND} starts a new "
                      "one", file=stderr)
                continue
            started = time.perf_counter()
            answer = stream_answer(llm, prompt_ids,
                                   replace(params, max_tokens=min(params.max_tokens, room)),
                                   write)
        except (TandemError, ValueError) as exc:
            print(f"error: {exc}", file=stderr)
            continue
        elapsed = time.perf_counter() - started
        write("\n\n")
        if answer.finish_reason == "abort":
            continue  # a stopped answer is not kept: the next turn is asked afresh
        conversation.add_turn(text, answer.text)
        if verbose:
            n = len(answer.token_ids)
            print(f"[{plural(len(prompt_ids), 'prompt token')}, {plural(n, 'token')}, "
                  f"finish_reason={answer.finish_reason}, {elapsed:.2f} s, "
                  f"{n / elapsed if elapsed > 0 else 0.0:.1f} tok/s]", file=stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """`tandem chat`: load the model, then talk until /exit or EOF."""
    from tandem_engine.cli.models import resolve_model

    if not args.verbose:  # the terminal holds the conversation, not the engine's log
        logging.getLogger("tandem_engine").setLevel(logging.WARNING)
    model = resolve_model(args.model, what="MODEL")
    # Refuse a model that cannot chat before the (slow) load, not after it.
    renderer = ChatRenderer.of(Tokenizer.from_path(model))
    if renderer is None:
        raise ValueError(f"MODEL {args.model}: no chat template (tokenizer_config.json "
                         "chat_template, or the GGUF's tokenizer.chat_template), so it "
                         "cannot hold a conversation: use `tandem generate --no-chat` for "
                         "plain completions")
    tty = sys.stdin.isatty()
    started = time.monotonic()
    llm = load_llm(args, model, max_num_seqs=1)
    # A turn may run to the end of the context unless --max-tokens says otherwise.
    params = sampling_params(args, model,
                             default_max_tokens=llm.engine.stats.max_model_len)
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"{args.model} loaded in {time.monotonic() - started:.1f} s. Type a message; "
              f"/? for help, {EXIT_COMMANDS[1]} to exit.", file=sys.stderr)
    return chat(llm, renderer, params, Conversation(args.system), sys.stdin, sys.stdout,
                sys.stderr, tty=tty, verbose=args.verbose)
