"""`specserve generate | models pull|list | bench ...`"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pydantic

from specserve.arg_types import finite_float, logit_bias_arg, non_negative_int, positive_int, present_device_arg
from specserve.config import (
    BUILTIN_HEADS_DIR,
    DEFAULT_PAIR,
    MODEL_PAIRS,
    SERVING_MAX_STEP_TOKENS,
    SERVING_THROUGHPUT_GUARD,
    DraftSpec,
    DType,
    EngineConfig,
    HeadSpec,
    ModelSpec,
    SpecConfig,
    SpecMethod,
    serving_speculation,
)
from specserve.console import console_safe
from specserve.errors import ModelSourceError, SettingsError, SpecServeError, settings_problems
from specserve.sampling import SamplingParams
from specserve.structured import FormatKind, GrammarCompiler, OutputFormat


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, HF dir, .gguf file or hub id")
    p.add_argument("--dtype", default="float32", choices=[d.value for d in DType])
    p.add_argument("--device", default="cpu", type=present_device_arg)


def _generate(args: argparse.Namespace) -> int:
    from specserve.engine import Engine
    from specserve.models.loader import load_tokenizer

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        stop_token_ids=frozenset(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        logit_bias=tuple(args.logit_bias),
        output_format=_output_format(args),
    )
    target = ModelSpec(source=args.model, dtype=DType(args.dtype))
    draft = _draft_for(args.draft, target)
    pair = _pair_for(args.draft, target)
    speculation = serving_speculation(pair, args.device) if draft is not None else SpecConfig(method=SpecMethod.none)
    if draft is None and args.method is not None:
        raise SettingsError(f"--method {args.method} needs a draft; --draft {args.draft} gives none for this model")
    if draft is None and args.draft == "auto":  # said, not silent: the README promises speculation by default
        print(f"--draft auto: no built-in pair has this target ({target.source}, {target.dtype.value} on "
              f"{args.device}); generating without speculation", file=sys.stderr)  # fmt: skip
    if draft is not None and args.method is not None:
        speculation = speculation.model_copy(update={"method": SpecMethod(args.method)})
    config = EngineConfig(  # (checked before the tokenizer's model is fetched: a bad --max-model-len said at once)
        target=target,
        draft=draft,
        speculation=speculation,
        throughput_guard=draft is not None and SERVING_THROUGHPUT_GUARD,
        max_step_tokens=SERVING_MAX_STEP_TOKENS if draft is not None else None,
        device=args.device,
        max_batch_size=1,
        freeze_gc=True,  # this process serves one engine until it exits
        **({} if args.max_model_len is None else {"max_model_len": args.max_model_len}),
    )
    tokenizer = load_tokenizer(target)
    if not args.no_chat and tokenizer.chat_template is None:  # (before the models load, not after)
        raise SettingsError(
            f"{args.model}'s tokenizer has no chat template: pass --no-chat to send the prompt as it is"
        )
    if params.output_format is not None:  # a format its grammar compiler refuses: said before the models load too
        eos = [t for t in (tokenizer.eos_token_id,) if t is not None]
        GrammarCompiler(tokenizer, eos).compile(params.output_format)
    # (the tokenizer loaded once: a GGUF source's is hashed whole to find its conversion)
    engine = Engine.from_config(config, tokenizer=tokenizer)
    last = None
    for out in engine.stream(args.prompt, params, chat=not args.no_chat):
        sys.stdout.write(out.text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if last is not None:
        reason = last.finish_reason.value if last.finish_reason else None
        print(f"[{last.num_output_tokens} tokens, finish_reason={reason}]", file=sys.stderr)
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _output_format(args: argparse.Namespace) -> OutputFormat | None:
    """--json, --json-schema, --regex, --choice or --grammar (at most one: argparse's group) as the answer's
    format."""
    if args.json:
        return OutputFormat(kind=FormatKind.json_object, param="--json")
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{") and text.strip() not in ("true", "false"):  # a file's name
            if not Path(text).exists() and _is_json(text):  # ('[1]' was "cannot read '[1]'")
                raise SettingsError("--json-schema: a JSON schema is an object (or true / false)")
            text = _read_file(text, "--json-schema")
        try:
            json.loads(text)
        except ValueError as e:
            raise SettingsError(f"--json-schema: not JSON: {e}") from None
        return OutputFormat(kind=FormatKind.json_schema, schema_text=text, param="--json-schema")
    if args.regex is not None:
        return OutputFormat(kind=FormatKind.regex, pattern=args.regex, param="--regex")
    if args.choice:
        return OutputFormat(kind=FormatKind.choice, choices=tuple(args.choice), param="--choice")
    if args.grammar is not None:
        text = args.grammar
        if ":" not in text or _names(Path(text), Path.is_file):  # a file's name (every Lark or GBNF rule has a colon)
            text = _read_file(text, "--grammar")
        return OutputFormat(kind=FormatKind.grammar, grammar_text=text, param="--grammar")
    return None


def _names(path: Path, kind: Callable[[Path], bool]) -> bool:
    """Whether ``path`` names a file or directory (``kind``): an inline text too long for a path (a grammar), or one
    this process may not look into, names none (``Path.is_file`` raises for those)."""
    try:
        return kind(path)
    except OSError:
        return False


def _read_file(name: str, flag: str) -> str:
    try:
        return Path(name).read_text(encoding="utf-8")
    except OSError as e:
        raise SettingsError(f"{flag}: cannot read {name!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SettingsError(f"{flag}: {name!r} is not UTF-8 text ({e.reason})") from None


def _pair_for(name: str, target: ModelSpec) -> str | None:
    """The built-in pair a --draft value names: 'auto' is the default pair when its target is this one; None for
    'none', a head directory, or another target."""
    if name == "auto":
        return DEFAULT_PAIR if MODEL_PAIRS[DEFAULT_PAIR][0] == target else None
    return name if name in MODEL_PAIRS else None


def _draft_for(name: str, target: ModelSpec) -> DraftSpec | None:
    """'auto': the default pair's draft when its target is this one (else none); 'none'; a pair
    name; or a head directory."""
    if name in ("none", "auto") or name in MODEL_PAIRS:
        pair = _pair_for(name, target)
        return None if pair is None else MODEL_PAIRS[pair][1]
    head = HeadSpec(head=name)
    try:
        found = _names(head.path(), Path.is_dir)
    except ModelSourceError:  # (a ~user of no user, a part too long for a path: the list below says more)
        found = False
    if not found:
        shipped = sorted(p.name for p in BUILTIN_HEADS_DIR.iterdir() if p.is_dir())
        raise SettingsError(
            f"--draft {name!r} is not 'auto', 'none', a built-in pair ({', '.join(sorted(MODEL_PAIRS))}), a shipped "
            f"head ({', '.join(shipped)}) or a head directory"
        )
    return head


def _models(args: argparse.Namespace) -> int:
    from specserve.models import sources

    if args.models_cmd == "pull":
        path = sources.resolve(ModelSpec(source=args.name), force=args.force)
        print(path)
    elif args.models_cmd == "prune":
        removed: list[sources.Conversion] = []

        def said(c: sources.Conversion) -> None:
            removed.append(c)
            made = f"converted from {c.source}" if c.source else "left by a conversion that did not finish"
            print(f"removed {c.path} ({c.size / 1e9:.2f} GB), {made}", flush=True)

        try:
            sources.prune_conversions(said)
        finally:
            print(f"{len(removed)} conversion(s) removed, {sum(c.size for c in removed) / 1e9:.2f} GB freed")
    else:
        for name, cached, path in sources.list_models():
            print(f"{name:28s} {'cached' if cached else 'not pulled':10s} {path}")
        for c in sources.gguf_conversions():
            state = "source not recorded" if c.source is None else f"from {c.source}"
            state += " (gone or changed)" if c.stale else ""
            print(f"{'GGUF conversion':28s} {c.size / 1e9:7.2f} GB {c.path}  {state}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from specserve.bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream a completion to the terminal")
    g.add_argument("prompt")
    _model_args(g)
    g.add_argument("--max-tokens", type=positive_int, default=256)
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="the context: prompt and answer, in tokens (default 2048, within the model's positions)",
    )
    g.add_argument("--temperature", type=finite_float, default=0.0)
    g.add_argument("--top-k", type=positive_int, default=None)
    g.add_argument("--top-p", type=finite_float, default=1.0)
    g.add_argument("--min-p", type=finite_float, default=0.0, help="drop tokens below min-p x the likeliest's chance")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="a string that ends the answer (repeatable)")
    g.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        type=non_negative_int,
        action="append",
        default=[],
        help="a token id that ends the answer (repeatable)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens through EOS")
    g.add_argument(
        "--min-tokens", type=non_negative_int, default=0, help="tokens before EOS, a stop id or a stop string ends it"
    )
    g.add_argument(
        "--logit-bias",
        type=logit_bias_arg,
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100 to 100) to token ID's logit (repeatable)",
    )
    held = g.add_mutually_exclusive_group()
    held.add_argument("--json", action="store_true", help="the answer is a JSON object")
    held.add_argument("--json-schema", metavar="SCHEMA", help="the answer is JSON valid against this schema (or file)")
    held.add_argument("--regex", help="the answer matches this regular expression, whole")
    held.add_argument("--choice", action="append", default=[], help="the answer is one of these (repeatable)")
    held.add_argument("--grammar", help="the answer is derived by this Lark or GBNF grammar (or file)")
    g.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    g.add_argument(
        "--draft",
        default="auto",
        help="'auto' (the default pair for the built-in target), 'none', a pair, a head dir",
    )
    g.add_argument(
        "--method",
        default=None,
        choices=[m.value for m in SpecMethod if m != SpecMethod.none],
        help="the drafts' shape (default: the pair's measured one); who drafts stays the pair's (smollm2-eagle on a "
        "CPU: prompt lookup, the head where lookup finds nothing)",
    )
    g.set_defaults(func=_generate)

    m = sub.add_parser("models", help="pull, list or prune models in the cache")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    pull = msub.add_parser("pull", help="download, verify and convert a model into the cache")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="convert again (a builtin's verified download is reused)")
    msub.add_parser("list", help="list built-in models and whether they are cached, and cached GGUF conversions")
    msub.add_parser("prune", help="remove cached GGUF conversions whose GGUF file is gone or changed")
    m.set_defaults(func=_models)

    t = sub.add_parser("train-draft", help="train an EAGLE draft head for a target on this machine")
    from specserve.train import pipeline

    pipeline.add_args(t)
    t.set_defaults(func=pipeline.run)

    b = sub.add_parser("bench", help="benchmarks (print a table, write CSV)")
    from specserve.bench import add_bench_args

    add_bench_args(b)
    b.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    with console_safe():
        return _main(argv)


def _flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's destination -> its long flag, over ``parser`` and its subcommands (a setting named by its flag)."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags(sub)
        elif longs := [o for o in action.option_strings if o.startswith("--")]:
            flags.setdefault(action.dest, longs[0])
    return flags


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = ["specserve", *(sys.argv[1:] if argv is None else argv)]  # as given (provenance records it)
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # (a reader gone away shows here, not at the interpreter's exit)
        return status
    except SpecServeError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except pydantic.ValidationError as e:  # an argument out of a setting's range (--max-tokens 0, --top-p 2)
        print(f"specserve: error: invalid arguments: {settings_problems(e, flags=_flags(parser))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error when Python flushes)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: stop as shells expect (128 + SIGINT), without a traceback
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
