"""Structured outputs: xgrammar vs llguidance as the grammar backend, on this machine's CPU.

Issue 30 adds constrained decoding (JSON schema, regex, grammar) and must pick one library.
The engine fills a token mask for every constrained row between two forward passes, on the
CPU, so a backend's cost lands on every step of every constrained request. Each library is
measured the same way, one after the other, on the real model's tokenizer (SmolLM2-135M-
Instruct, built from the pulled GGUF by `tandem_engine.tokenizer.Tokenizer`):

1. tokenizer setup: the per-model object each library needs (paid once per engine);
2. compile of a small schema (4 typed fields), a generated large schema (`--schema-props`
   properties over nested objects, arrays, enums, bounded numbers, string patterns, required
   fields), a regex and a Lark grammar (the same text for both). Cold is the first request
   for a grammar: compile, make a matcher, fill its first mask (llguidance builds its lexer
   lazily, so compile time alone would flatter it). Warm is a second request for the same
   grammar: xgrammar hits its compiler cache, llguidance (no cache) compiles again;
3. per-step mask cost at batch 1 and `--batch`: that many matchers over the large schema
   (made as a server would, one per request), advanced in lockstep along a valid document
   (our tokenizer's encoding of it, each token checked to be allowed by the mask), every
   row's mask filled each step serially and with the library's parallel batch API, plus the
   token-accept cost;
4. rollback of N tokens (speculative decoding rejects drafted tokens), checked to restore
   the same mask after the tokens are accepted again.

    .venv/bin/python benchmarks/grammar_backends.py [--schema-props 200] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib.metadata import version

try:
    import xgrammar as xgr
except ImportError as exc:
    sys.exit(f"xgrammar is not importable ({exc}); install it with: "
             "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi")
import llguidance
import llguidance.torch as llt
import torch
import transformers

SMALL = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
    "active": {"type": "boolean"}}, "required": ["name", "age", "score", "active"],
    "additionalProperties": False}
REGEX = (r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]T[0-2][0-9]:[0-5][0-9](:[0-5][0-9])?Z"
         r"|[a-z][a-z0-9._]{0,30}@[a-z0-9]{1,20}\.(com|org|net)")
LARK = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | NAME | NAME "(" expr ("," expr)* ")" | "(" expr ")"
NUMBER: /[0-9]+(\.[0-9]+)?/
NAME: /[a-z_][a-z0-9_]*/
"""


def leaf(i: int) -> tuple[dict, object]:
    """The i-th leaf property's schema and a value valid under it."""
    k = i % 6
    if k == 0:
        return {"type": "integer", "minimum": 0, "maximum": 1000 + i}, (i * 37) % 1000
    if k == 1:
        return {"type": "number", "minimum": -50, "maximum": 50}, (i % 97) / 4 - 20
    if k == 2:
        return {"type": "string", "maxLength": 40}, f"value number {i}"
    if k == 3:
        return {"type": "string", "enum": ["red", "green", "blue", f"c{i}"]}, f"c{i}"
    if k == 4:
        return {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{4}$"}, f"ABC-{i:04d}"
    return {"type": "boolean"}, i % 2 == 0


def large_schema(n: int) -> tuple[dict, dict]:
    """A deterministic schema of `n` properties (every fifth an object nested up to two deep,
    every seventh an array; two in three required) and a document valid under it."""
    made = 0

    def obj(width: int, depth: int) -> tuple[dict, dict]:
        nonlocal made
        props, doc = {}, {}
        for j in range(width):
            if made >= n:
                break
            name, made = f"field_{made}", made + 1
            if depth < 2 and j % 5 == 4:
                props[name], doc[name] = obj(6, depth + 1)
            elif j % 7 == 6:
                item, value = leaf(made)
                props[name] = {"type": "array", "items": item, "minItems": 1, "maxItems": 4}
                doc[name] = [value, value]
            else:
                props[name], doc[name] = leaf(made)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [k for i, k in enumerate(props) if i % 3 != 2]}, doc

    return obj(n, 0)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, threads: int) -> None:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._backend,
                                                  eos_token=tok.eos_token)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size,
                                                  stop_token_ids=list(tok.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)

    def matcher(self, kind: str, src):
        c = self.compiler
        compiled = {"json": c.compile_json_schema, "regex": c.compile_regex,
                    "lark": c.compile_lark}[kind](src)
        return xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, row):
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms, bitmask):
        self.batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m, t):
        return m.accept_token(t)

    def accept_batch(self, ms, t):
        return all(xgr.BatchGrammarMatcher.batch_accept_token(ms, [t] * len(ms)))

    def rollback(self, m, n):
        m.rollback(n)  # returns nothing; raises past what it can undo
        return True


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, threads: int) -> None:
        self.tok = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=tok.vocab_size,
                                          eos_token=list(tok.eos_token_ids))
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def matcher(self, kind: str, src):
        grammar = {"json": llguidance.LLMatcher.grammar_from_json_schema,
                   "regex": llguidance.LLMatcher.grammar_from_regex,
                   "lark": llguidance.LLMatcher.grammar_from_lark}[kind](src)
        m = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(f"llguidance rejected the {kind} grammar: {m.get_error()}")
        return m

    def fill(self, m, bitmask, row):
        llt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms, bitmask):
        rows = [(m, i) for i, m in enumerate(ms)]
        llt.fill_next_token_bitmask_par(self.executor, rows, bitmask)

    def accept(self, m, t):
        return m.consume_token(t)

    def accept_batch(self, ms, t):
        return all(llt.consume_token_par(self.executor, [(m, t) for m in ms]))

    def rollback(self, m, n):
        return m.rollback(n)


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def stats(us: list[float], batch: int = 1) -> dict:
    s = sorted(us)
    med, p99 = statistics.median(s), s[min(len(s) - 1, int(0.99 * len(s)))]
    return {"median_us": med, "p99_us": p99, "mean_us": statistics.fmean(s),
            "median_us_per_row": med / batch, "p99_us_per_row": p99 / batch,
            "mean_us_per_row": statistics.fmean(s) / batch}


def walk(lib, large: str, seq: list[int], batch: int, parallel: bool, vocab: int) -> dict:
    """`batch` fresh matchers advanced along `seq`; fill and accept timed per step."""
    ms = [lib.matcher("json", large) for _ in range(batch)]
    bitmask = torch.zeros((batch, (vocab + 31) // 32), dtype=torch.int32)
    fill_us, accept_us = [], []
    for step, t in enumerate(seq):
        t0 = time.perf_counter()
        if parallel:
            lib.fill_batch(ms, bitmask)
        else:
            for i, m in enumerate(ms):
                lib.fill(m, bitmask, i)
        t1 = time.perf_counter()
        if not all(allowed(bitmask, i, t) for i in range(batch)):
            raise RuntimeError(f"{lib.name}: token {t} at step {step} not allowed by the mask")
        ok = lib.accept_batch(ms, t) if parallel else all(lib.accept(m, t) for m in ms)
        t2 = time.perf_counter()
        if not ok:
            raise RuntimeError(f"{lib.name}: token {t} at step {step} not accepted")
        fill_us.append((t1 - t0) * 1e6)
        accept_us.append((t2 - t1) * 1e6)
    return {"fill": stats(fill_us, batch), "accept": stats(accept_us, batch)}


def rollback_cost(lib, large: str, seq: list[int], vocab: int, reps: int = 30) -> dict:
    m, bm = lib.matcher("json", large), torch.zeros((2, (vocab + 31) // 32), dtype=torch.int32)
    k = len(seq) // 2
    for t in seq[:k]:
        lib.accept(m, t)
    lib.fill(m, bm, 0)
    out = {}
    for n in (1, 4, 16):
        us, same = [], True
        for _ in range(reps):
            t0 = time.perf_counter()
            ok = lib.rollback(m, n)
            us.append((time.perf_counter() - t0) * 1e6)
            ok = ok and all(lib.accept(m, t) for t in seq[k - n:k])
            lib.fill(m, bm, 1)
            same = same and ok and torch.equal(bm[0], bm[1])
        out[n] = {"median_us": statistics.median(us), "restores_mask": same}
    return out


def measure(cls, tok, seq, large: str, args) -> dict:
    r: dict = {"version": version(cls.name)}
    t0 = time.perf_counter()
    lib = cls(tok, args.threads)
    r["setup_ms"] = (time.perf_counter() - t0) * 1e3
    vocab, bm = tok.vocab_size, torch.zeros((1, (tok.vocab_size + 31) // 32), dtype=torch.int32)
    grammars = {"small schema": ("json", json.dumps(SMALL)), "large schema": ("json", large),
                "regex": ("regex", REGEX), "lark": ("lark", LARK)}
    r["compile"] = {}
    for label, (kind, src) in grammars.items():
        row = {}
        for temp in ("cold", "warm"):
            t0 = time.perf_counter()
            m = lib.matcher(kind, src)
            t1 = time.perf_counter()
            lib.fill(m, bm, 0)
            t2 = time.perf_counter()
            row[temp] = {"compile_ms": (t1 - t0) * 1e3, "first_mask_ms": (t2 - t1) * 1e3}
        r["compile"][label] = row
    r["batch1"] = walk(lib, large, seq, 1, False, vocab)
    r["serial"] = walk(lib, large, seq, args.batch, False, vocab)
    r["parallel"] = walk(lib, large, seq, args.batch, True, vocab)
    r["rollback"] = rollback_cost(lib, large, seq, vocab)
    return r


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    return names[0] if names else "unknown"


def table(res: dict, args, n_tokens: int) -> str:
    libs = list(res)
    rows = [("version", lambda r: r["version"]),
            ("tokenizer setup (ms)", lambda r: f"{r['setup_ms']:.0f}")]
    for g in res[libs[0]]["compile"]:
        for temp in ("cold", "warm"):
            rows.append((f"{g}, {temp}: compile + first mask (ms)",
                         lambda r, g=g, t=temp: "{compile_ms:.2f} + {first_mask_ms:.2f}"
                         .format(**r["compile"][g][t])))
    B = args.batch
    for key, label in (("batch1", "batch 1"), ("serial", f"batch {B}, serial"),
                       ("parallel", f"batch {B}, parallel API")):
        for what in ("fill", "accept"):
            rows.append((f"{what}, {label}: median / p99 / mean µs per step (per row)",
                         lambda r, k=key, w=what: "{median_us:.0f} / {p99_us:.0f} / {mean_us:.0f}"
                         " ({median_us_per_row:.1f} / {p99_us_per_row:.1f} / {mean_us_per_row:.1f})"
                         .format(**r[k][w])))
    for n in (1, 4, 16):
        rows.append((f"rollback {n} tokens: median µs (mask restored)",
                     lambda r, n=n: "{median_us:.1f} ({restores_mask})".format(**r["rollback"][n])))
    out = [f"CPU: {cpu_model()}, {args.threads} threads (os.cpu_count() {os.cpu_count()}), "
           f"torch {torch.__version__}, transformers {transformers.__version__}; large schema "
           f"{args.schema_props} properties, document {n_tokens} tokens; load average at "
           f"start {args.load}",
           "", "| | " + " | ".join(libs) + " |", "|---|" + "---|" * len(libs)]
    out += [f"| {label} | " + " | ".join(f(res[x]) for x in libs) + " |" for label, f in rows]
    return "\n".join(out) + "\n\n" + verdict(res, n_tokens, B)


def verdict(res: dict, n_tokens: int, B: int) -> str:
    """Per-request CPU cost at batch B: a new schema's (cold) or a repeated schema's (warm)
    compile + first mask, plus n_tokens steps of per-row mask and accept (means, so the slow
    steps count) with the faster of the library's two APIs."""
    cost = {}
    for lib, r in res.items():
        step = min(r[k]["fill"]["mean_us_per_row"] + r[k]["accept"]["mean_us_per_row"]
                   for k in ("serial", "parallel")) * n_tokens / 1e3
        start = {t: sum(r["compile"]["large schema"][t].values()) for t in ("cold", "warm")}
        cost[lib] = {t: start[t] + step for t in start} | {"steps": step}
    def pick(t: str) -> str:
        a, b = sorted(cost, key=lambda x: cost[x][t])
        return f"{a} for a {'new' if t == 'cold' else 'repeated'} schema " \
               f"({cost[a][t]:.0f} vs {cost[b][t]:.0f} ms)"
    rb = {lib: all(v["restores_mask"] for v in r["rollback"].values()) for lib, r in res.items()}
    return (f"Verdict (CPU per {n_tokens}-token large-schema request at batch {B}, compile + "
            f"mask + accept): {pick('cold')}, {pick('warm')}; decode steps alone "
            + " vs ".join(f"{x} {c['steps']:.0f} ms" for x, c in cost.items()) + "; rollback "
            + ", ".join(f"{x} {'works' if ok else 'FAILS'}" for x, ok in rb.items()) + ".")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schema-props", type=int, default=200)
    ap.add_argument("--steps", type=int, default=0,
                    help="decode steps to time (default 0: the whole document)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for each library's compiler and batch API")
    ap.add_argument("--json-out", default=None, help="write the results here")
    args = ap.parse_args(argv)
    with open("/proc/loadavg") as f:  # other work on the machine shows here
        args.load = f.read().split()[0]

    from tandem_engine.cli.models import SMOLLM2_135M_INSTRUCT, pull
    from tandem_engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(pull(SMOLLM2_135M_INSTRUCT))
    schema, doc = large_schema(args.schema_props)
    large = json.dumps(schema)
    seq = [*tok.encode(json.dumps(doc), add_special_tokens=False), tok.eos_token_ids[0]]
    if args.steps:
        seq = seq[:args.steps]
    res = {}
    for cls in (Xgrammar, Llguidance):
        print(f"measuring {cls.name} ...", file=sys.stderr, flush=True)
        res[cls.name] = measure(cls, tok, seq, large, args)
    print(table(res, args, len(seq)))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"cpu": cpu_model(), "threads": args.threads, "tokens": len(seq),
                       "args": vars(args), "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
