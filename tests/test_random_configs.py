"""Losslessness over the configuration space: random speculation settings (every method, drafter, SL policy, tree
shape, floor, catch-up window), mixed per request in one batch, with draft models and random EAGLE heads, contexts
near their limit and EOS inside drafts. Greedy output must equal plain greedy decoding for every request."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.config import ChainDraft, Drafter, KLDMode, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy, tiny_model
from specserve.sampling import SamplingParams
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


@pytest.mark.parametrize("seed", range(4))
def test_random_settings_per_request_stay_greedy_equal(
    models: tuple[LlamaModel, dict[str, torch.nn.Module]], seed: int
) -> None:
    target, drafts = models
    r = random.Random(seed)
    for trial in range(20):
        batch, context = r.randint(1, 4), r.choice([40, 64, 128])
        prompts = [[r.randrange(3, VOCAB) for _ in range(r.randint(1, 30))] for _ in range(batch)]
        eos = {r.randrange(3, VOCAB)} if r.random() < 0.5 else set()
        params = [SamplingParams(temperature=0.0, max_tokens=r.randint(1, 60), ignore_eos=r.random() < 0.5)
                  for _ in prompts]  # fmt: skip
        plain = Engine(target, None, max_batch_size=1, max_model_len=context, eos_token_ids=eos)
        want = [plain.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
        default, name = random_spec(r), r.choice(list(drafts))
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
        specs = [r.choice([None, default, random_spec(r)]) for _ in prompts]  # None: the engine's default
        ids = [engine.submit(p, q, speculation=s) for p, q, s in zip(prompts, params, specs, strict=True)]
        got = [c.token_ids for c in engine.collect(ids)]
        settings = [s and s.model_dump(exclude_defaults=True) for s in specs]
        assert got == want, f"trial {trial}: {name}, context {context}, EOS {eos}, {settings}"
