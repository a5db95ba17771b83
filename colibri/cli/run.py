"""`colibri [run]`: generate from one prompt (or one chat turn with --chat) and print the text.

    colibri [run] --model M.coli --prompt "Hello" -n 64 --ctx-size 1024 --threads 2

stdout carries only generated text; banner, logs and stats go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ..errors import ColibriError
from .common import HelpFormatter, add_engine_args, bounded, engine_from_args, nonneg, number, positive, setup_logging
from .specflags import add_spec_args, apply_spec_args

log = logging.getLogger("colibri")


def run_parser() -> argparse.ArgumentParser:
    from . import SUBCOMMANDS  # the registry lives in the package; imported late to avoid a cycle

    p = argparse.ArgumentParser(
        prog="colibri",
        description="Run a Mixture-of-Experts model from a .coli container (models larger than RAM welcome). "
                    f"Subcommands: {', '.join(SUBCOMMANDS)} (run is the default). "
                    "'colibri SUBCOMMAND --help' for each.",
        formatter_class=HelpFormatter)
    from .. import __version__

    p.add_argument("--version", action="version", version=f"colibri {__version__}")
    g = p.add_argument_group("prompt")
    g.add_argument("--prompt", "-p", help="the prompt text")
    g.add_argument("--file", "-f", help="read the prompt from this file instead of --prompt")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template as one user turn (see 'colibri chat')")
    g.add_argument("-n", "--n-predict", type=positive("-n"), default=128, help="number of tokens to generate")
    g.add_argument("--prompt-cache", metavar="FILE", default=None,
                   help="load the K/V of an earlier run's prompt from FILE (the part this prompt shares is not "
                        "computed again), and save this run's to it")
    add_sampling_args(p)
    add_spec_args(p)
    add_engine_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--no-stats", action="store_true", help="do not print the stats line at the end")
    o.add_argument("--stats", action="store_true",
                   help="also print the memory-tier stats: expert cache hit rate, bytes read per token, "
                        "prefetch precision, resident bytes")
    return p


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.8) -> None:
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", "--temp", type=number("--temperature", 0), default=temperature,
                   help="0 = greedy decoding")
    s.add_argument("--top-k", type=nonneg("--top-k"), default=40, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=number("--top-p", 0, 1, lo_open=True), default=0.95,
                   help="nucleus sampling mass (1.0 = off)")
    s.add_argument("--min-p", type=number("--min-p", 0, 1), default=0.05,
                   help="drop tokens less likely than this fraction of the most likely one (0 = off)")
    s.add_argument("--repeat-penalty", type=number("--repeat-penalty", 0, lo_open=True), default=1.0,
                   help="penalise tokens already seen (1.0 = off)")
    s.add_argument("--repeat-last-n", type=bounded("--repeat-last-n", -1, 2**31 - 1), default=64, metavar="N",
                   help="the repeat penalty's window: the last N tokens (-1 = all, 0 = none; llama.cpp's default 64)")
    # The engine's seed range (engine/request.py: SamplingParams.validate).
    s.add_argument("--seed", type=bounded("--seed", 0, 2**63 - 1), default=None,
                   help="random seed for sampling (reproducible output)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence (benchmarks)")
    g = p.add_argument_group("structured output (llguidance; llama.cpp's flags)")
    g.add_argument("-j", "--json-schema", metavar="SCHEMA", default=None,
                   help="the text must be JSON following this JSON schema ('{}': any JSON value)")
    g.add_argument("--json-schema-file", metavar="FILE", default=None, help="--json-schema read from FILE")
    g.add_argument("--grammar", metavar="GRAMMAR", default=None,
                   help="the text must follow this GBNF (root rule 'root') or Lark grammar")
    g.add_argument("--grammar-file", metavar="FILE", default=None, help="--grammar read from FILE")


def grammar_from_args(a: argparse.Namespace) -> str | None:
    """The llguidance grammar of --json-schema / --grammar (or their -file forms), or None."""
    import json

    from ..engine.grammar import gbnf_grammar, json_grammar

    given = [(f, v) for f, v in (("--json-schema", a.json_schema), ("--json-schema-file", a.json_schema_file),
                                 ("--grammar", a.grammar), ("--grammar-file", a.grammar_file)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ColibriError(f"give one of {', '.join(f for f, _ in given)}, not several")
    flag, value = given[0]
    if flag.endswith("-file"):
        try:
            value = Path(value).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ColibriError(f"cannot read {flag} {value}: {getattr(e, 'strerror', None) or e}") from None
    if flag.startswith("--grammar"):
        return gbnf_grammar(value)
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as e:
        raise ColibriError(f"{flag}: not JSON: {e}") from None
    return json_grammar(schema)


def validate_sampling(a: argparse.Namespace) -> None:
    """The same ranges as the flag types, for namespaces built without this parser."""
    import math

    for flag, v in (("--temperature", a.temperature), ("--top-p", a.top_p), ("--min-p", a.min_p),
                    ("--repeat-penalty", a.repeat_penalty)):
        if not math.isfinite(v):
            raise ColibriError(f"{flag} must be a finite number, got {v}")
    if a.temperature < 0:
        raise ColibriError(f"--temperature must be >= 0, got {a.temperature}")
    if not 0 < a.top_p <= 1:
        raise ColibriError(f"--top-p must be in (0, 1], got {a.top_p}")
    if not 0 <= a.min_p <= 1:
        raise ColibriError(f"--min-p must be in [0, 1], got {a.min_p}")
    if a.repeat_penalty <= 0:
        raise ColibriError(f"--repeat-penalty must be > 0, got {a.repeat_penalty}")


def _read_prompt(a: argparse.Namespace) -> str:
    if a.file:
        try:
            return Path(a.file).read_text()
        except OSError as e:
            raise ColibriError(f"cannot read prompt file {a.file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ColibriError(f"prompt file {a.file} is not UTF-8 text") from None
    if a.prompt is None:
        raise ColibriError("no prompt: give --prompt TEXT or --file PATH")
    return a.prompt


def main(argv: list[str] | None = None) -> int:
    a = run_parser().parse_args(argv)
    setup_logging(a.log_level)
    validate_sampling(a)
    prompt = _read_prompt(a)
    if a.prompt is not None and a.file:
        raise ColibriError("give either --prompt or --file, not both")
    check_prompt_cache(a)
    grammar = grammar_from_args(a)  # (before loading: a bad schema is one line, not a wait)
    t0 = time.perf_counter()
    llm = engine_from_args(a)
    apply_spec_args(llm, a)
    log.info("loaded %s (%s, %s, %d layers) in %.2fs; KV cache %.1f MiB (%s) for ctx %d", a.model,
             llm.container.model_type, llm.scheme, llm.n_layers, time.perf_counter() - t0,
             llm.kv_bytes() / 2**20, llm.kv_types, a.ctx_size)
    try:
        if a.prompt_cache:
            load_prompt_cache(llm, a.prompt_cache)
        _generate(a, llm, prompt, grammar)
        if a.prompt_cache:
            save_prompt_cache(llm, a.prompt_cache)
    finally:
        llm.close()  # in-process callers (tests, the fuzz worker) must not keep the engine thread
    return 0


def check_prompt_cache(a: argparse.Namespace) -> None:
    """--prompt-cache's conditions, before the model loads (`run` and `chat`)."""
    if a.prompt_cache and not a.cache_prompt:
        raise ColibriError("--prompt-cache needs prompt caching (drop --no-cache-prompt)")
    if a.prompt_cache and Path(a.prompt_cache).is_dir():
        raise ColibriError(f"--prompt-cache {a.prompt_cache} is a directory, not a file")


def save_prompt_cache(llm, path: str) -> None:
    n = llm.save_prompt_cache(path)
    log.info("prompt cache %s: %d positions saved", path, n)


def load_prompt_cache(llm, path: str) -> None:
    """A missing file is created at the end; one of another model (or damaged) is replaced, with a warning. A
    model whose layers keep no positions (linear attention) is refused now, before anything is generated."""
    if not llm.slots.rewindable:
        raise ColibriError(f"--prompt-cache {path}: this model's linear-attention layers keep a state, not K/V "
                           "positions: prompt cache files do not apply to it (drop --prompt-cache)")
    if not Path(path).exists():
        return
    try:
        n = llm.load_prompt_cache(path)
    except ColibriError as e:
        log.warning("colibri: ignoring the prompt cache: %s (it will be overwritten)", e)
        return
    log.info("prompt cache %s: %d positions loaded", path, n)


def _generate(a: argparse.Namespace, llm, prompt: str, grammar: str | None) -> None:
    recorder = None
    if a.usage_file:  # learned hot set: count this run's routing (colibri/analysis/usage.py)
        from ..analysis.usage import Recorder

        recorder = Recorder(llm)
    if a.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = llm.tokenizer.encode(prompt, add_special_tokens=not a.chat)  # a chat template writes its own
    if len(ids) >= a.ctx_size:  # one message, not a warning followed by the engine's refusal
        raise ColibriError(f"the prompt has {len(ids)} tokens, which does not fit ctx-size {a.ctx_size} "
                           "(raise --ctx-size or shorten the prompt)")
    warned = len(ids) + a.n_predict > a.ctx_size
    if warned:
        log.warning("colibri: prompt (%d tokens) + -n %d exceeds --ctx-size %d: generation stops when the "
                    "context is full", len(ids), a.n_predict, a.ctx_size)
    pieces = llm.generate(prompt, a.n_predict, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n, seed=a.seed,
                          ignore_eos=a.ignore_eos,
                          add_special_tokens=not a.chat, grammar=grammar)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if recorder is not None:
        total = recorder.usage().save(a.usage_file)
        log.info("usage file %s: %d routed tokens recorded in total", a.usage_file, total.total_tokens())
    st = llm.last_stats
    if st.stop_reason == "ctx" and not warned:
        print(f"colibri: stopped: the context is full (--ctx-size {a.ctx_size}); raise --ctx-size to go on",
              file=sys.stderr)
    if not a.no_stats:
        print(stats_line(st), file=sys.stderr)
    if a.stats:
        print(tier_stats_line(st), file=sys.stderr)
        if llm.cluster:
            print(cluster_stats_line(llm.metrics()["cluster"], max(st.generated, 1)), file=sys.stderr)


def cluster_stats_line(c: dict, tokens: int) -> str:
    """The --stats line of a cluster (whole run): where the layers or experts are, what crossed, the bubble."""
    if c.get("mode") == "experts":
        return (f"[colibri] cluster: {c['workers']} expert workers ({', '.join(c['nodes'])}) | {c['calls']} calls, "
                f"{c['bytes_moved'] / 1024:.1f} KiB crossed ({c['bytes_moved'] / tokens / 1024:.1f} KiB a token)")
    where = ", ".join(f"layers {lo}-{hi - 1} on {n}" for (lo, hi), n in zip(c["layers"], c["nodes"]))
    return (f"[colibri] cluster: {c['stages']} stages ({where}) | {c['steps']} steps in {c['micro_batches']} "
            f"micro-batches, bubble {c['bubble']:.2f} | {c['bytes_moved'] / 1024:.1f} KiB crossed "
            f"({c['bytes_moved'] / tokens / 1024:.1f} KiB a token)")


def stats_line(st) -> str:
    rss = st.extra.get("peak_rss_mib", 0.0)
    cached = f" ({st.cached_tokens} cached)" if st.cached_tokens else ""
    spec = (f" | drafts {st.accepted}/{st.drafted} accepted ({st.acceptance:.0%}), "
            f"{st.tokens_per_forward:.2f} tok/forward") if st.drafted else ""
    return (f"[colibri] prompt {st.prompt_tokens} tok{cached}, prefill {st.prefill_tps:.1f} tok/s | "
            f"generated {st.generated} tok, decode {st.decode_tps:.2f} tok/s{spec} | "
            f"TTFT {st.ttft_s * 1000:.0f} ms | peak RSS {rss:.0f} MiB")


def tier_stats_line(st) -> str:
    """The --stats line: speeds, then what the memory tiers did during this run."""
    s = st.extra.get("store", {})
    mib = 2**20
    line = (f"[colibri] tiers: {s.get('placement', '?')} | prefill {st.prefill_tps:.1f} tok/s, decode "
            f"{st.decode_tps:.2f} tok/s, TTFT {st.ttft_s * 1000:.0f} ms | peak RSS "
            f"{st.extra.get('peak_rss_mib', 0.0):.0f} MiB, weights resident "
            f"{s.get('resident_bytes', 0) / mib:.0f} MiB")
    if (huge := st.extra.get("huge_pages_mib")) is not None:  # (0: THP `never` here, docs/TIERS.md "Loading")
        line += f", {huge:.0f} MiB in huge pages"
    if s.get("cache_slots"):
        line += (f" | expert cache {s['cache_slots']} slots ({s['cache_bytes'] / mib:.0f} MiB): hit rate "
                 f"{s['hit_rate']:.1%}, read {s['bytes_read'] / mib:.1f} MiB = "
                 f"{s['bytes_per_token'] / mib:.2f} MiB/token "
                 f"(decode {s['decode_bytes_per_token'] / mib:.2f}), "
                 f"I/O wait {s['io_wait_s']:.2f} s, {'O_DIRECT' if s['direct_io'] else 'buffered'}")
        if s.get("prefetch"):
            line += (f" | prefetch precision {s['prefetch_precision']:.1%}, "
                     f"recall {s['prefetch_recall']:.1%}, used {s['prefetch_used']}/{s['prefetch_issued']}")
    if st.experts_own:
        # Batching: the experts this request routed to alone vs its share of what its steps' batches fetched.
        line += (f" | experts: {st.experts_own} routed, {st.experts_fetched_share:.0f} fetched as its share "
                 f"of the batches ({st.experts_own / max(st.experts_fetched_share, 1e-9):.2f}x batching gain), "
                 f"{st.bytes_read_share / mib:.1f} MiB read as its share")
    if s.get("decode_tokens"):
        from ..store.limit import decode_limit, limit_text

        line += " | " + limit_text(decode_limit(s, st.decode_s, max(st.generated - 1, 0)))
    return line
