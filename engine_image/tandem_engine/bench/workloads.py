"""What a benchmark sends: a list of `BenchRequest`s (text prompt, output length).

Prompts are text, so any OpenAI-compatible server takes them whatever its tokenizer.
Lengths are asked for in tokens: a `TextSource` turns a token count into words drawn
from Tandem's bundled English corpus, using a tokens-per-word ratio measured once on the
server's `/tokenize` when it has one (else 1 token per word), so a "256-token prompt" is
close to 256 tokens on that server. The exact counts a report shows always come from the
server's `usage`, never from this estimate.

A multi-adapter workload (`assign_models`, vLLM's `--lora-modules`) names in each
request's `model` one of several served names (LoRA adapters, the base model among them if
asked), drawn at random by the seed alone, so the same seed sends each request index to the
same adapter whatever the workload, sweep point or warm-up.

A trace (`save_trace` / `load_trace`, JSON Lines: `arrival_s`, `prompt`, `output_len` and,
for a multi-adapter workload, `model`) holds exactly what was sent and when, and replays
as the same requests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

WORKLOADS = ("random", "fixed", "shared-prefix", "sharegpt", "trace")
DISTRIBUTIONS = ("uniform", "normal", "fixed")
TRACE_VERSION = 1


class WorkloadError(ValueError):
    """Bad workload input: the message names the flag or file, the limit and the fix."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    output_len: int
    arrival_s: float | None = None  # a trace's send time, seconds after the run's start
    group: int | None = None  # shared-prefix: the system prompt this request shares
    model: str | None = None  # the served name it asks for (an adapter); None: --model


@dataclass(frozen=True)
class LengthSpec:
    """Token lengths: `mean` with `spread` (uniform: +-spread; normal: stddev)."""
    mean: int
    spread: int = 0
    distribution: str = "uniform"

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise WorkloadError(f"unknown length distribution {self.distribution!r}: "
                                f"use one of {', '.join(DISTRIBUTIONS)}")
        if self.mean < 1 or self.spread < 0:
            raise WorkloadError(f"lengths need mean >= 1 and spread >= 0 (got mean "
                                f"{self.mean}, spread {self.spread})")

    def sample(self, rng: random.Random) -> int:
        if self.distribution == "fixed" or self.spread == 0:
            return self.mean
        if self.distribution == "uniform":
            return max(1, rng.randint(self.mean - self.spread, self.mean + self.spread))
        return max(1, round(rng.gauss(self.mean, self.spread)))


class TextSource:
    """Deterministic English text of a given token length (see the module docstring)."""

    def __init__(self, tokens_per_word: float = 1.0) -> None:
        if tokens_per_word <= 0:
            raise WorkloadError(f"tokens per word must be > 0 (got {tokens_per_word})")
        self.tokens_per_word = tokens_per_word
        text = (resources.files("tandem_engine") / "data" / "corpus.txt").read_text()
        self.words = text.split()

    def text(self, tokens: int, rng: random.Random) -> str:
        words = max(1, round(tokens / self.tokens_per_word))
        start = rng.randrange(len(self.words))
        picked = [self.words[(start + i) % len(self.words)] for i in range(words)]
        return " ".join(picked)

    @staticmethod
    def sample_text() -> str:
        """The text whose /tokenize count gives `tokens_per_word` (its word count known)."""
        return (resources.files("tandem_engine") / "data" / "paragraph.txt").read_text()


def _rngs(seed: int, variant: int) -> tuple[random.Random, random.Random]:
    """Separate generators for lengths (`seed`) and text (`seed` and `variant`): variants
    of a workload have the same lengths and different words, so a sweep's later points
    do not find the earlier points' prompts in a prefix cache."""
    return random.Random(seed), random.Random(f"{seed}/text/{variant}")


def random_workload(n: int, source: TextSource, prompt: LengthSpec, output: LengthSpec,
                    seed: int, variant: int = 0) -> list[BenchRequest]:
    lengths, words = _rngs(seed, variant)
    out = []
    for _ in range(n):
        tokens = prompt.sample(lengths)
        out.append(BenchRequest(source.text(tokens, words), output.sample(lengths)))
    return out


def shared_prefix_workload(n: int, source: TextSource, groups: int, prefix_len: int,
                           suffix: LengthSpec, output: LengthSpec, seed: int,
                           variant: int = 0) -> list[BenchRequest]:
    """`groups` system prompts of `prefix_len` tokens; request i uses group i % groups and
    a unique suffix, so a prefix cache can serve every request after a group's first."""
    if groups < 1 or prefix_len < 1:
        raise WorkloadError(f"--prefix-groups and --prefix-len must be >= 1 (got {groups}, "
                            f"{prefix_len})")
    lengths, words = _rngs(seed, variant)
    prefixes = [source.text(prefix_len, words) for _ in range(groups)]
    out = []
    for i in range(n):
        g = i % groups
        prompt = f"{prefixes[g]}\n\n{source.text(suffix.sample(lengths), words)}"
        out.append(BenchRequest(prompt, output.sample(lengths), group=g))
    return out


def sharegpt_workload(path: Path, n: int, output: LengthSpec | None, seed: int,
                      tokens_per_word: float = 1.0) -> list[BenchRequest]:
    """ShareGPT JSON: a list of {"conversations": [{"from": ..., "value": ...}, ...]}. Each
    conversation's first human turn is a prompt; its output length is the first reply's
    length (estimated tokens) unless `output` overrides it. Shuffled by `seed`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"--dataset {path}: cannot read a ShareGPT JSON file ({exc})"
                            ) from exc
    if not isinstance(data, list):
        raise WorkloadError(f"--dataset {path}: expected a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(reply, dict)):
            continue
        prompt, answer = str(first.get("value", "")), str(reply.get("value", ""))
        if prompt.strip() and answer.strip():
            pairs.append((prompt, max(1, round(len(answer.split()) * tokens_per_word))))
    if not pairs:
        raise WorkloadError(f"--dataset {path}: no conversation with a prompt and a reply "
                            "(ShareGPT format: [{\"conversations\": [{\"from\": \"human\", "
                            "\"value\": ...}, {\"from\": \"gpt\", \"value\": ...}]}])")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    picked = [pairs[i % len(pairs)] for i in range(n)]
    return [BenchRequest(p, output.sample(rng) if output else k) for p, k in picked]


def model_names(values: Sequence[str]) -> list[str]:
    """`--lora-modules` as given (`a b`, `a,b` or both) as a list of names, in order, a
    name given twice kept twice (it is then drawn twice as often)."""
    names = [name.strip() for value in values for name in value.split(",")]
    if not names or not all(names):
        raise WorkloadError(f"--lora-modules {' '.join(values)!r}: give served model names "
                            "(LoRA adapters) separated by spaces or commas, e.g. "
                            "--lora-modules sql support")
    return names


def assign_models(requests: Sequence[BenchRequest], models: Sequence[str], seed: int
                  ) -> list[BenchRequest]:
    """Each request's `model` drawn uniformly from `models` (vLLM's `--lora-modules`: a
    random adapter per request), from its own generator of `seed`: request i gets the
    same name whatever the lengths, words or variant."""
    if not models:
        raise WorkloadError("--lora-modules: give at least one name")
    rng = random.Random(f"{seed}/models")
    return [replace(r, model=rng.choice(models)) for r in requests]


def save_trace(path: Path, requests: list[BenchRequest], send_times: list[float]) -> None:
    """One JSON line per request, in send order: what was sent and when."""
    order = sorted(range(len(requests)), key=lambda i: send_times[i])
    with open(path, "w") as f:
        f.write(json.dumps({"tandem_bench_trace": TRACE_VERSION}) + "\n")
        for i in order:
            row = {"arrival_s": round(send_times[i], 6), "prompt": requests[i].prompt,
                   "output_len": requests[i].output_len}
            if requests[i].model is not None:
                row["model"] = requests[i].model
            f.write(json.dumps(row) + "\n")


def load_trace(path: Path) -> list[BenchRequest]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"--trace {path}: cannot read it ({exc})") from exc
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"--trace {path}:{number}: not JSON ({exc})") from exc
        if "tandem_bench_trace" in row:
            if row["tandem_bench_trace"] != TRACE_VERSION:
                raise WorkloadError(f"--trace {path}: trace version "
                                    f"{row['tandem_bench_trace']}, this tandem reads "
                                    f"{TRACE_VERSION}")
            continue
        try:
            arrival, prompt, length = (float(row["arrival_s"]), str(row["prompt"]),
                                       int(row["output_len"]))
            model = row.get("model")
            if model is not None and not (isinstance(model, str) and model):
                raise ValueError(f"model {model!r} is not a name")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise WorkloadError(f"--trace {path}:{number}: a row needs arrival_s (s), "
                                f"prompt (text) and output_len (tokens), and may name a "
                                f"model: {exc}") from exc
        if arrival < 0 or length < 1:
            raise WorkloadError(f"--trace {path}:{number}: arrival_s must be >= 0 and "
                                "output_len >= 1")
        out.append(BenchRequest(prompt, length, arrival_s=arrival, model=model))
    if not out:
        raise WorkloadError(f"--trace {path}: no requests in it")
    return out
