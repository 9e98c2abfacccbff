"""What a benchmark sends: a list of `BenchRequest`s (text prompt, output length).

Prompts are text, so any OpenAI-compatible server takes them whatever its tokenizer.
Lengths are asked for in tokens: a `TextSource` turns a token count into words drawn
from Tandem's bundled English corpus, using a tokens-per-word ratio measured once on the
server's `/tokenize` when it has one (else 1 token per word), so a "256-token prompt" is
close to 256 tokens on that server. The exact counts a report shows always come from the
server's `usage`, never from this estimate.

A trace (`save_trace` / `load_trace`, JSON Lines: `arrival_s`, `prompt`, `output_len`)
holds exactly what was sent and when, and replays as the same requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
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


def save_trace(path: Path, requests: list[BenchRequest], send_times: list[float]) -> None:
    """One JSON line per request, in send order: what was sent and when."""
    order = sorted(range(len(requests)), key=lambda i: send_times[i])
    with open(path, "w") as f:
        f.write(json.dumps({"tandem_bench_trace": TRACE_VERSION}) + "\n")
        for i in order:
            f.write(json.dumps({"arrival_s": round(send_times[i], 6),
                                "prompt": requests[i].prompt,
                                "output_len": requests[i].output_len}) + "\n")


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
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"--trace {path}:{number}: a row needs arrival_s (s), "
                                f"prompt (text) and output_len (tokens): {exc}") from exc
        if arrival < 0 or length < 1:
            raise WorkloadError(f"--trace {path}:{number}: arrival_s must be >= 0 and "
                                "output_len >= 1")
        out.append(BenchRequest(prompt, length, arrival_s=arrival))
    if not out:
        raise WorkloadError(f"--trace {path}: no requests in it")
    return out
