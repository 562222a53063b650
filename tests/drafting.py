"""The drafters the target-side request options (logit_bias, logprobs, min_tokens) are tested under: an engine on a
tiny target with each, the copy drafters on a random target and the EAGLE head on one it can follow."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from specserve.config import Drafter, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.models.llama import LlamaModel
from specserve.models.tiny import noisy_copy, tiny_config, tiny_model
from specserve.spec_decode.eagle_head import EagleHead
from tests.test_head_drafter import last_token_target, near_head

PROMPT = [5, 9, 13, 21, 2, 7]
SPECS = {
    "plain": SpecConfig(method=SpecMethod.none),
    "chain": SpecConfig(method=SpecMethod.chain, sl=4),
    "eagle2": SpecConfig(method=SpecMethod.eagle2, tree_depth=5, beam_width=2, budget=10),
    "ddd": SpecConfig(method=SpecMethod.ddd, beam_width=2, budget=10),
    "lookup": SpecConfig(method=SpecMethod.chain, sl=6, drafter=Drafter.lookup),
    "head-ddd": SpecConfig(method=SpecMethod.ddd, beam_width=2, budget=10),
}


def drafting_engine(
    name: str, *, tokenizer: PreTrainedTokenizerBase | None = None, eos: frozenset[int] = frozenset()
) -> tuple[LlamaModel, Engine]:
    """(the target, an engine speculating as ``SPECS[name]`` on it); "head-..." names an EAGLE head's."""
    if name.startswith("head"):
        target = last_token_target()
        draft: LlamaModel | EagleHead = near_head(target, 0.01)
    else:
        target = tiny_model(tiny_config(), seed=0)
        draft = noisy_copy(target, 0.02, seed=1)
    engine = Engine(
        target, tokenizer, draft=None if name == "plain" else draft, speculation=SPECS[name], eos_token_ids=set(eos)
    )
    return target, engine
