"""Losslessness over the configuration space: random speculation settings (every method, drafter, SL policy, tree
shape, floor, catch-up window), mixed per request in one batch, with draft models and random EAGLE heads, contexts
near their limit and EOS inside drafts. Greedy output must equal plain greedy decoding for every request, and a
seeded sampled request must emit plain decoding's tokens for the same seed (docs/algorithms.md §1.4)."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.config import ChainDraft, Drafter, KLDMode, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy, tiny_model
from specserve.sampling import SamplingParams
from specserve.sequence import FinishReason
from specserve.spec_decode.eagle_head import HeadKind
from tests.test_head_drafter import random_head

VOCAB = 512


def random_spec(r: random.Random) -> SpecConfig:
    settings = {
        "method": r.choice(list(SpecMethod)),
        "drafter": r.choice(list(Drafter)),
        "model_fallback": r.random() < 0.7,
        "policy": r.choice(list(SLPolicyKind)),
        "sl": r.randint(1, 8),
        "tree_depth": r.randint(1, 8),
        "beam_width": r.randint(1, 6),
        "budget": r.randint(2, 40),
        "ddd_max_depth": r.randint(1, 10),
        "ddd_check_steps": tuple(sorted(r.sample(range(1, 8), r.randint(1, 3)))),
        "ddd_threshold": -0.5 * r.random(),
        "ddd_check_every_step": r.random() < 0.3,
        "ddd_count_first_forward": r.random() < 0.7,
        "tree_min_prob": r.choice([0.0, 0.0, 0.05, 0.3]),
        "adaptive_floor": r.random() < 0.3,
        "floor_beam": r.random() < 0.8,
        "catch_up_window": r.choice([1, 2, 4, 64]),
        "chain_draft": r.choice(list(ChainDraft)),
        "q_top_k": r.choice([1, 4, 64]),
        "kld_mode": r.choice(list(KLDMode)),
        "max_sl": r.choice([None, None, 1, 3]),
    }
    return SpecConfig(**settings)


@pytest.fixture(scope="module")
def models() -> tuple[LlamaModel, dict[str, torch.nn.Module]]:
    target = tiny_model(seed=0)
    drafts = {
        "close copy": noisy_copy(target, 0.02, seed=1),  # accepts most drafts: long accepted runs, EOS inside them
        "noisy copy": noisy_copy(target, 0.3, seed=2),
        "EAGLE head": random_head(target),
        "EAGLE-3 head": random_head(target, HeadKind.eagle3),
    }
    return target, drafts


def random_params(r: random.Random, *, sampled: bool) -> SamplingParams:
    """Greedy, or sampled with a seed (draws keyed by position, docs/algorithms.md §1.4) and random processing."""
    limits = {"max_tokens": r.randint(1, 60), "ignore_eos": r.random() < 0.5}
    if not sampled:
        return SamplingParams(temperature=0.0, **limits)
    return SamplingParams(
        temperature=r.choice([0.0, 0.3, 0.8, 1.0, 1.5]),
        top_p=r.choice([1.0, 0.9, 0.5]),
        top_k=r.choice([None, None, 5, 50]),
        seed=r.randrange(2**63),
        **limits,
    )


def keyed_spec(r: random.Random) -> SpecConfig:
    """A random setting whose sampled requests draw by position: every route but the sampled chain of §1.1, whose
    uniforms depend on the batch (docs/algorithms.md §1.1)."""
    spec = random_spec(r)
    if spec.chain_draft is ChainDraft.sampled:
        return spec.model_copy(update={"chain_draft": r.choice([ChainDraft.keyed, ChainDraft.greedy])})
    return spec


def run_trials(models: tuple[LlamaModel, dict[str, torch.nn.Module]], seed: int, *, sampled: bool) -> None:
    """20 batches of random requests and settings; each request's tokens must equal plain decoding's alone."""
    target, drafts = models
    r = random.Random(seed)
    spec = (lambda: keyed_spec(r)) if sampled else (lambda: random_spec(r))
    for trial in range(20):
        batch, context = r.randint(1, 4), r.choice([40, 64, 128])
        prompts = [[r.randrange(3, VOCAB) for _ in range(r.randint(1, 30))] for _ in range(batch)]
        eos = {r.randrange(3, VOCAB)} if r.random() < 0.5 else set()
        params = [random_params(r, sampled=sampled) for _ in prompts]
        plain = Engine(target, None, max_batch_size=1, max_model_len=context, eos_token_ids=eos)
        plain_done = [plain.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
        want = [c.token_ids for c in plain_done]
        default, name = spec(), r.choice(list(drafts))
        engine = Engine(
            target,
            None,
            draft=drafts[name],
            speculation=default,
            max_batch_size=r.randint(1, batch),
            max_model_len=context,
            eos_token_ids=eos,
            throughput_guard=r.random() < 0.3,
        )
        specs = [r.choice([None, default, spec()]) for _ in prompts]  # None: the engine's default
        ids = [engine.submit(p, q, speculation=s) for p, q, s in zip(prompts, params, specs, strict=True)]
        done = engine.collect(ids)
        got = [c.token_ids for c in done]
        settings = [s and s.model_dump(exclude_defaults=True) for s in specs]
        assert got == want, f"trial {trial}: {name}, context {context}, EOS {eos}, {params}, {settings}"
        # why each ended, and the counts usage reports: a forward emits one token of the target's besides the
        # drafts it accepts (an EOS that ends a request is emitted, not returned), and nothing accepted was not drafted
        assert [c.finish_reason for c in done] == [c.finish_reason for c in plain_done], f"trial {trial}"
        for c in done:
            ended_by_eos = c.finish_reason == FinishReason.stop
            assert c.stats.accepted + c.stats.target_forwards == len(c.token_ids) + ended_by_eos, f"trial {trial}"
            assert 0 <= c.stats.accepted <= c.stats.drafted, f"trial {trial}"


@pytest.mark.parametrize("seed", range(4))
def test_random_settings_per_request_stay_greedy_equal(
    models: tuple[LlamaModel, dict[str, torch.nn.Module]], seed: int
) -> None:
    run_trials(models, seed, sampled=False)


@pytest.mark.parametrize("seed", range(4))
def test_seeded_sampled_requests_emit_plain_decodings_tokens_under_random_settings(
    models: tuple[LlamaModel, dict[str, torch.nn.Module]], seed: int
) -> None:
    """Keyed draws make a seeded request's text a function of the request alone: the same tokens as plain decoding
    with the same seed, whatever drafter, tree or batch (an off-by-one draw position under speculation fails this,
    while a chi-square over the outputs would still pass)."""
    run_trials(models, 1000 + seed, sampled=True)
