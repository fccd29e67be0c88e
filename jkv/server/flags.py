"""`python -m jkv.server`'s command line: the server's own flags, then one per LLM option
(`jkv.config.OPTIONS`), with help that names other options by their flags."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jkv.config import OPTIONS, Option
from jkv.config_checks import parse_bytes
from jkv.server.admission import MAX_MESSAGES, MAX_PROMPT_CHARS

_OPTION_REF = re.compile(r"`(\w+)`")  # `name` in an option's help: another option


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def flag_names(text: str, quote: str = "") -> str:
    """`name` references to options in help text as --flag-name (between `quote`s)."""
    names = {o.name for o in OPTIONS}
    return _OPTION_REF.sub(lambda m: quote + "--" + m[1].replace("_", "-") + quote
                           if m[1] in names else m[0], text)


def _flag_text(text: str) -> str:
    """Help text for argparse: option references as flags, % escaped."""
    return flag_names(text).replace("%", "%%")  # argparse formats help with %


def _flag_help(option: Option) -> str:
    """An option's help as a flag's, with a default resolved at start shown as it is here."""
    note = "" if option.default_note is None else f" ({option.default_note()})"
    return _flag_text(option.help + note)


def _bytes_flag(text: str) -> int:
    """A byte flag's value: an integer or a size such as 512MiB or 8GiB."""
    try:
        return parse_bytes(text, "the value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per `jkv.config.OPTIONS` entry, one group per config: --flag-name, its type,
    default, choices and help; a bool is --x/--no-x."""
    groups = {}
    for o in OPTIONS:
        if o.config not in groups:
            summary = " ".join((o.config.__doc__ or "").split("\n\n")[0].split())
            groups[o.config] = parser.add_argument_group(f"{o.config.__name__} options",
                                                         _flag_text(summary))
        kw: dict[str, Any] = {"default": o.default, "help": _flag_help(o)}
        if o.value_type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif o.name.endswith("_bytes"):
            kw["type"] = _bytes_flag
            kw["help"] += " (a size: 536870912, 512MiB or 8GiB)"
        else:
            kw["type"] = o.value_type
            if o.choices is not None:
                kw["choices"] = list(o.choices)
        groups[o.config].add_argument(o.flag, **kw)


def _add_admission_flags(p: argparse.ArgumentParser) -> None:
    """What a request may ask and how long it may wait: checked before any expensive work."""
    p.add_argument("--max-queue", type=int, default=None,
                   help="most requests waiting, to be tokenized or in the scheduler's queue; "
                        "more are refused with 503 and Retry-After (GET /ready answers 503 "
                        "queue_full meanwhile); default: no limit")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take, arrival to last token (tokenizing "
                        "included), before it is aborted (503); default: no limit")
    p.add_argument("--max-messages", type=int, default=MAX_MESSAGES,
                   help="most messages in a chat; more are refused (400 naming messages) "
                        "before any is rendered or tokenized, so a long session's client drops "
                        "its oldest turns itself past this")
    p.add_argument("--max-prompt-chars", type=int, default=MAX_PROMPT_CHARS,
                   help="most characters of a prompt or rendered chat (a chat as its "
                        "template renders it, the whole history in session mode); more are "
                        "refused (400 naming prompt or messages) before tokenizing, which "
                        "bounds the tokenizer's work per request")


def build_parser() -> argparse.ArgumentParser:
    """The server's command line: its own flags, then one per LLM option (`add_option_flags`)."""
    p = argparse.ArgumentParser(
        prog="python -m jkv.server",
        description="Serve a model over an OpenAI-compatible HTTP API "
                    "(/v1/chat/completions, /v1/completions, /v1/models; /health for liveness, "
                    "/ready for readiness, /metrics).",
        formatter_class=_HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients name in requests; default: the model's file or "
                        "directory name")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every step shape before listening (with a progress bar), so "
                        "no request waits on a compilation; --no-precompile starts at once and "
                        "compiles each shape when it first occurs. Default: on with a GPU "
                        "(about a minute); on CPU (where the xla backend has several times "
                        "more shapes) the server listens at once and warms the shapes a first "
                        "request takes in the background, while no request runs (logged: "
                        "'warming step shapes k/n'), so a request arriving meanwhile waits "
                        "for one shape's compilation at most. Compiled shapes persist in "
                        "--compilation-cache-dir either way")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="where compiled steps persist between runs (JAX's persistent "
                        "compilation cache), so a restart compiles little; '' turns it off; "
                        "default: xla in jkv's cache directory ($JKV_CACHE_DIR, default "
                        "~/.cache/jkv)")
    p.add_argument("--api-key", default=None,
                   help="an API key that /v1 routes require (as 'Authorization: Bearer "
                        "<key>'; 401 otherwise); visible in ps: prefer --api-key-file or "
                        "JKV_API_KEY; default: no key")
    p.add_argument("--api-key-file", default=None,
                   help="file holding the API key (its first line), instead of --api-key")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="the API key guards every route but /health and /ready (/metrics, "
                        "/docs and /openapi.json too)")
    _add_admission_flags(p)
    p.add_argument("--ttft-slo-ms", type=float, default=None,
                   help="time-to-first-token target, for requests that set no ttft_slo_ms: "
                        "the queue is ordered by it, and misses are counted "
                        "(jkv_slo_violations_total{kind=\"ttft\"}); default: none")
    p.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="time-per-output-token target, for requests that set no tpot_slo_ms: "
                        "prefill work per step is capped to keep it, and misses are counted "
                        "(jkv_slo_violations_total{kind=\"tpot\"}); default: none")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to drain on SIGTERM or SIGINT: requests in flight may "
                        "finish (new ones get 503) before they are aborted and the server "
                        "exits")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="logging level of the server and of uvicorn")
    add_option_flags(p)
    return p


def api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The key from --api-key, else --api-key-file's first line, else JKV_API_KEY; None:
    no key. ValueError for both flags, an unreadable or empty file, or
    --metrics-require-key without a key."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("--api-key and --api-key-file: give one")
    key = args.api_key
    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text().split("\n")[0].strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: the first line is empty")
    key = key if key is not None else environ.get("JKV_API_KEY") or None
    if args.metrics_require_key and key is None:
        raise ValueError("--metrics-require-key needs a key (--api-key-file, JKV_API_KEY)")
    return key
