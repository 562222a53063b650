"""`specserve bench agreement`: how often an EAGLE head's top-1 draft is the target's own next token, per draft
depth, teacher-forced on answers the target wrote greedily (MT-bench first turns, held-out seed prompts, held-out
lexicon prompts). Depth d is the head's d-th unrolled step from a root whose earlier pairs are the target's: what
a chain or tree node at depth d drafts. A position whose target token lies outside the head's draft vocabulary
counts as a miss; the table also gives how often the target's token is in that vocabulary.

    .venv/bin/specserve bench agreement --heads smollm2-eagle3 /path/to/other/head --per-set 10
    .venv/bin/specserve bench agreement --sets mt-bench --by-category --per-set 5   # a row per MT-bench category
    .venv/bin/specserve bench agreement --by-confidence   # depth 0 by how sure the target is of its token

With ``--by-confidence`` a second table splits the answer positions by the target's probability of its own greedy
token: it tells a head short where the target is unsure (a limit no head escapes) from one short where the target
is certain (the head lacks what the target knows: data, not luck).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable
from pathlib import Path

import torch

from specserve.arg_types import non_negative_int, out_dir_arg, positive_int
from specserve.bench.prompt_sets import mt_bench_prompts, per_category
from specserve.bench.stats import markdown_table, write_csv
from specserve.config import MAX_BATCH_SIZE, MODEL_PAIRS, HeadSpec
from specserve.engine import Engine
from specserve.errors import InvalidRequestError
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_draft, load_model, load_tokenizer
from specserve.sampling import SamplingParams
from specserve.spec_decode.eagle_head import EagleHead, dense_weight
from specserve.train.distill import Conversation, Features, chat_ids, target_features
from specserve.train.lexicon_prompts import lexicon_prompts
from specserve.train.seed_prompts import seed_prompts
from specserve.train.trainer import TrainConfig, prompts_seen, ttt_loss

SETS = ("mt-bench", "seeds", "lexicon")
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99)  # lower edges of the target-probability buckets
FIRST_HELD_OUT = {"seeds": 3900, "lexicon": 9600}  # the least offsets, for heads whose data is not on record
MAX_GENERATED_PROMPTS = 200_000  # seed_prompts(100_000) takes ~11 s to enumerate; the offsets' upper bound


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", nargs="+", default=["smollm2-eagle3"], help="shipped head names or head directories")
    p.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    p.add_argument("--per-set", type=positive_int, default=10, help="prompts per set (per category: --by-category)")
    p.add_argument(
        "--by-category",
        action="store_true",
        help="MT-bench: --per-set first turns of each category, and a row for each category besides the set's",
    )
    p.add_argument(
        "--by-confidence",
        action="store_true",
        help="a second table: depth-0 agreement by the target's probability of its own token",
    )
    p.add_argument("--max-tokens", type=positive_int, default=128, help="greedy answer tokens per prompt")
    p.add_argument("--depths", type=positive_int, default=3)
    held_out = (
        "; default: past every compared head's training prompts (its provenance.json; seed 0's, and a head that drew "
        "them with another data seed is refused)"
    )
    p.add_argument(
        "--seed-offset", type=non_negative_int, default=None, help="held-out seed prompts start here" + held_out
    )
    p.add_argument(
        "--lexicon-offset", type=non_negative_int, default=None, help="held-out lexicon prompts start here" + held_out
    )
    p.add_argument("--out", type=out_dir_arg, default=Path("bench_out/agreement"))


@torch.inference_mode()
def depth_agreement(
    head: EagleHead,
    lm_full: torch.Tensor,  # [V, H] the target's LM head
    tokens: torch.Tensor,  # [n] long: prompt + answer
    final: torch.Tensor,  # [n, H] the target's final-norm hidden states
    aux: torch.Tensor | None,  # [n, A*H] EAGLE-3 aux features
    prompt_len: int,
    depths: int,
) -> tuple[float, list[float]]:
    """(share of answer positions whose target token is in the draft vocabulary, agreement at depth 0..depths-1)
    over the answer tokens after the first."""
    n = tokens.shape[0]
    target_next = (final.float() @ lm_full.t()).argmax(-1)  # [n] the target's token after position i
    in_vocab = torch.zeros(lm_full.shape[0], dtype=torch.bool)
    in_vocab[head.draft_ids] = True
    inv = in_vocab[target_next].float()  # [n]
    weight = torch.zeros(1, n)
    # row j predicts token j + 2: the answer's tokens after its first (row prompt_len - 2 predicts the first, which
    # the target gives at prefill: no head ever drafts it)
    weight[0, prompt_len - 1 : n - 2] = 1.0
    weight[0, : n - 1] *= inv[1:]  # scored where the target's token is one the head can draft
    feats = None if aux is None else aux.float()[None]
    _, stats = ttt_loss(
        head, tokens[None], final.float()[None], weight, lm_full[head.draft_ids], TrainConfig(unroll=depths), aux=feats
    )
    rate = float(inv[prompt_len : n - 1].mean())
    return rate, [stats[f"acc{d}"] * rate for d in range(depths)]


@torch.inference_mode()
def confidence_agreement(
    head: EagleHead,
    lm_full: torch.Tensor,  # [V, H]
    tokens: torch.Tensor,  # [n] long: prompt + answer
    final: torch.Tensor,  # [n, H]
    aux: torch.Tensor | None,  # [n, A*H]
    prompt_len: int,
    edges: tuple[float, ...] = CONFIDENCE_EDGES,
) -> list[tuple[int, float]]:
    """Per bucket of the target's probability of its own token (bucket b: ``edges[b] <= p < edges[b + 1]``, the
    last open above): (answer positions, depth-0 hits), over the positions ``depth_agreement`` scores; a token
    outside the draft vocabulary is a position and a miss."""
    n = tokens.shape[0]
    probs = torch.softmax(final.float() @ lm_full.t(), dim=-1)  # [n, V]
    p_top, target_next = probs.max(-1)  # [n], [n]: the target's token after position i, and its probability
    in_vocab = torch.zeros(lm_full.shape[0], dtype=torch.bool)
    in_vocab[head.draft_ids] = True
    scored = torch.zeros(n, dtype=torch.bool)
    scored[prompt_len - 1 : n - 2] = True  # row j predicts token j + 2, which the target chose at position j + 1
    bucket = torch.bucketize(p_top[1:], torch.tensor(edges[1:]), right=True)  # [n-1]: row j's bucket
    feats = None if aux is None else aux.float()[None]
    out = []
    for b in range(len(edges)):
        rows = scored[: n - 1] & (bucket == b)  # [n-1]
        weight = torch.zeros(1, n)
        weight[0, : n - 1] = (rows & in_vocab[target_next[1:]]).float()
        hits = 0.0
        if weight.sum() > 0:
            _, stats = ttt_loss(
                head, tokens[None], final.float()[None], weight, lm_full[head.draft_ids], TrainConfig(unroll=1),
                aux=feats,
            )  # fmt: skip
            hits = stats["acc0"] * float(weight.sum())
        out.append((int(rows.sum()), hits))
    return out


def confidence_rows(
    name: str, head: str, per_conv: list[list[tuple[int, float]]], edges: tuple[float, ...] = CONFIDENCE_EDGES
) -> list[dict[str, object]]:
    """A row per bucket: its share of the set's answer positions and its depth-0 agreement."""
    total = sum(count for conv in per_conv for count, _ in conv)
    rows = []
    for b, lo in enumerate(edges):
        count = sum(conv[b][0] for conv in per_conv)
        hits = sum(conv[b][1] for conv in per_conv)
        upper = f"< {edges[b + 1]}" if b + 1 < len(edges) else "<= 1"
        rows.append(
            {
                "set": name,
                "head": head,
                "target_p": f"{lo} <= p {upper}",
                "positions": count,
                "share": count / max(total, 1),
                "agree_d0": hits / count if count else float("nan"),
            }
        )
    return rows


def trained_prompts(heads: list[str], sets: Iterable[str] = ("seeds", "lexicon")) -> dict[str, int]:
    """How many of the seed and lexicon prompts (each set's first n, seed 0) any of ``heads`` trained on, from
    their provenance.json (``prompts_seen``). A head that drew them with another data seed is refused where ``sets``
    reads them: seed 0's prompts past its count are not held out from it."""
    counts = {"seeds": 0, "lexicon": 0}
    for h in heads:
        seen = prompts_seen(HeadSpec(head=h).path())
        if seen["seed"] != 0 and (reads := [k for k in counts if k in sets and seen[k]]):
            drawn = "several data seeds" if seen["seed"] is None else f"data seed {seen['seed']}"
            raise InvalidRequestError(
                f"head {h} trained on {' and '.join(reads)} prompts of {drawn}; the held-out sets are seed 0's, "
                "which may hold them: compare it on --sets mt-bench"
            )
        counts = {k: max(v, seen[k] or 0) for k, v in counts.items()}
    return counts


def held_out_offsets(args: argparse.Namespace) -> dict[str, int]:
    """Where each held-out set starts: past every compared head's training prompts (a prompt set's first k prompts
    are the same for any size >= k) and ``FIRST_HELD_OUT``, or the offset given, which may not reach into them."""
    trained = trained_prompts(args.heads, args.sets)
    given = {"seeds": args.seed_offset, "lexicon": args.lexicon_offset}
    for name, offset in given.items():
        if offset is not None and offset < trained[name]:
            raise InvalidRequestError(
                f"--{'seed' if name == 'seeds' else name}-offset {offset} is inside a compared head's "
                f"{trained[name]} training prompts: those prompts are not held out"
            )
    offsets = {
        name: max(trained[name], FIRST_HELD_OUT[name]) if offset is None else offset for name, offset in given.items()
    }
    for name in set(args.sets) & set(offsets):
        if offsets[name] + args.per_set > MAX_GENERATED_PROMPTS:
            raise InvalidRequestError(
                f"{name} prompts {offsets[name]}..{offsets[name] + args.per_set - 1}: the generated sets are "
                f"enumerated from their start, and this command reads at most their first {MAX_GENERATED_PROMPTS}"
            )
    return offsets


def set_prompts(name: str, n: int, offsets: dict[str, int], by_category: bool = False) -> list[tuple[str, str]]:
    """(prompt, group) pairs of a set: the group is the MT-bench category with ``by_category`` (then ``n`` first
    turns of each), else the set's name."""
    if name == "mt-bench":
        if by_category:
            return [(p.text, p.category) for p in per_category(mt_bench_prompts(), n)]
        turns = [p.text for p in mt_bench_prompts()]
        return [(t, name) for t in turns[:: max(1, len(turns) // n)][:n]]
    make = seed_prompts if name == "seeds" else lexicon_prompts
    picked = [(t, name) for t in make(offsets[name] + n, 0)[offsets[name] :]]
    if len(picked) < n:
        raise InvalidRequestError(f"the {name} set has fewer than {offsets[name] + n} distinct prompts")
    return picked


def agreement_rows(
    name: str, head: str, groups: list[str], per_conv: list[tuple[float, list[float]]]
) -> list[dict[str, object]]:
    """The set's row (means over its conversations), then one per group where the set has several."""
    rows = []
    for group in [name] + (sorted(set(groups)) if len(set(groups)) > 1 else []):
        picked = [r for g, r in zip(groups, per_conv, strict=True) if group in (name, g)]
        row: dict[str, object] = {"set": group if group == name else f"{name}: {group}", "head": head}
        row["prompts"] = len(picked)
        row["in_vocab"] = statistics.mean(rate for rate, _ in picked)
        for d in range(len(picked[0][1])):
            row[f"agree_d{d}"] = statistics.mean(agree[d] for _, agree in picked)
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    if args.per_set > MAX_BATCH_SIZE:  # one batch a set: it failed after the loads, naming max_batch_size
        raise InvalidRequestError(
            f"--per-set {args.per_set}: a set's prompts run as one batch of at most {MAX_BATCH_SIZE}"
        )
    if "mt-bench" in args.sets and not args.by_category and args.per_set > (n := len(mt_bench_prompts())):
        raise InvalidRequestError(f"--per-set {args.per_set}: MT-bench has {n} first turns")  # (it ran those)
    offsets = held_out_offsets(args)
    # every set's prompts before the loads: a set that cannot be made (WordNet not installed) is refused up front,
    # not after the sets before it ran
    sets = {name: set_prompts(name, args.per_set, offsets, args.by_category) for name in args.sets}
    target_spec = MODEL_PAIRS["smollm2-eagle"][0]
    target: LlamaModel = load_model(target_spec)
    tokenizer = load_tokenizer(target_spec)
    heads = {h: load_draft(HeadSpec(head=h, draft_vocab=None), target) for h in args.heads}
    engine = Engine(target, tokenizer, max_batch_size=args.per_set, max_model_len=1024)
    lm_full = dense_weight(target.lm_head).float()
    rows: list[dict[str, object]] = []
    by_confidence: list[dict[str, object]] = []
    for name, prompts in sets.items():
        ids = [chat_ids(tokenizer, p) for p, _ in prompts]
        done = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        convs = [Conversation(p + c.token_ids, len(p)) for p, c in zip(ids, done, strict=True)]
        features: dict[tuple[int, ...], Features] = {}  # one prefill per set and kind of feature, for all heads
        for label, head in heads.items():
            assert isinstance(head, EagleHead)
            aux_layers = head.cfg.aux_layers
            if aux_layers not in features:
                features[aux_layers] = target_features(target, convs, aux_layers)
            feats = features[aux_layers]
            inputs = [
                (torch.tensor(c.tokens), feats.final[i], None if feats.aux is None else feats.aux[i], c.prompt_len)
                for i, c in enumerate(convs)
            ]  # per conversation: tokens, final features, aux features, prompt length
            per_conv = [depth_agreement(head, lm_full, *conv, args.depths) for conv in inputs]
            found = agreement_rows(name, label, [g for _, g in prompts], per_conv)
            rows += found
            print(markdown_table(found[:1]).splitlines()[-1], flush=True)
            if args.by_confidence:
                by_conf = [confidence_agreement(head, lm_full, *conv) for conv in inputs]
                by_confidence += confidence_rows(name, label, by_conf)
    print(markdown_table(rows))
    write_csv(args.out / "agreement.csv", rows)
    if by_confidence:
        print(markdown_table(by_confidence))
        write_csv(args.out / "agreement_by_confidence.csv", by_confidence)
    return 0
