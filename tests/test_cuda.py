"""The GPU path on a real CUDA device (every test skips without one):

    .venv/bin/pytest -q tests/test_cuda.py

workers on CUDA, plain and speculative greedy equality, the engine-level chi-square of sampled outputs, DDD tree
drafting, EAGLE heads (EAGLE-1/2 and EAGLE-3) drafting and training on the device (a draft vocabulary set there too),
the synthetic acceptance mode, a head's features leaving the target actor on the host, flash-attn chain verification,
KV sizing from free memory, loading straight to the device, a deployment's tiny head built on its actor's device, and
the Serve app with ``num_gpus``. Tiny random models (specserve/models/tiny.py) keep it to a minute or two.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specserve.config import PAIR_SPECULATION, ChainDraft, ModelSpec, SLPolicyKind, SpecConfig, SpecMethod
from specserve.engine import Engine
from specserve.errors import KVCapacityError
from specserve.limits import MemoryShare, device_kv_slots
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_model_dir
from specserve.models.tiny import hf_state_dict, noisy_copy, tiny_model
from specserve.sampling import SamplingParams
from specserve.spec_decode.eagle_head import HeadKind
from specserve.train.distill import Sample, generate_with_features, target_features
from specserve.train.trainer import TrainConfig, train_head
from specserve.workers import DraftWorker, HeadDraftWorker, TargetWorker
from tests.conftest import greedy_reference
from tests.ports import serve_app
from tests.test_head_drafter import random_head
from tests.test_speculative import METHODS as SPECULATIVE_METHODS
from tests.test_speculative import PROMPTS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
METHODS = {  # the CPU suite's methods (tests/test_speculative.py), by name, and plain decoding
    "plain": SpecConfig(method=SpecMethod.none),
    **dict(zip(("chain", "chain-greedy", "eagle2", "ddd"), SPECULATIVE_METHODS, strict=True)),
}


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model(seed=0).to(CUDA)


@pytest.fixture(scope="module")
def draft(target: LlamaModel) -> LlamaModel:
    return noisy_copy(target, 0.05, seed=3).to(CUDA)


@pytest.mark.parametrize("name", ["chain", "chain-sampled", "eagle2"])
def test_workers_run_every_request_kind_on_the_device(target: LlamaModel, draft: LlamaModel, name: str) -> None:
    """Greedy, seeded and unseeded sampled requests in one batch: caches, generators and drafts on CUDA."""
    spec = METHODS.get(name) or SpecConfig(method=SpecMethod.chain, sl=3, chain_draft=ChainDraft.sampled)
    engine = Engine(target, None, draft=draft, speculation=spec, max_batch_size=3, eos_token_ids=set())
    t_worker, d_worker = engine.loop.target, engine.loop.draft
    assert isinstance(t_worker, TargetWorker) and isinstance(d_worker, DraftWorker)
    assert t_worker.cache.k[0].device.type == d_worker.cache.k[0].device.type == "cuda"
    params = [
        SamplingParams(max_tokens=10),
        SamplingParams(temperature=0.8, seed=1, max_tokens=10),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10),
    ]
    t_worker.add(99, params[2], 0)
    assert t_worker.generators[99].device.type == "cuda"
    t_worker.release([99])
    outs = engine.generate(PROMPTS[:3], params)
    assert [len(o.token_ids) for o in outs] == [10, 10, 10]
    assert t_worker.cache.num_free == 3


@pytest.mark.parametrize("name", list(METHODS))
def test_greedy_output_equals_plain_greedy(target: LlamaModel, draft: LlamaModel, name: str) -> None:
    spec = METHODS[name]
    engine = Engine(
        target, None, draft=None if name == "plain" else draft, speculation=spec, max_batch_size=3, eos_token_ids=set()
    )
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=16))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 16)
    if name != "plain":
        assert sum(o.stats.accepted for o in outs) > 0  # a close draft gets tokens accepted


def test_ddd_trees_stop_by_their_mass_and_stay_lossless(target: LlamaModel) -> None:
    """DDD with a draft far from the target: shallow trees (H falls early), still the target's greedy output."""
    spec = SpecConfig(method=SpecMethod.ddd, beam_width=4, budget=16, ddd_max_depth=8, ddd_check_steps=(1, 2, 4))
    far = noisy_copy(target, 0.5, seed=5).to(CUDA)
    engine = Engine(target, None, draft=far, speculation=spec, max_batch_size=4, eos_token_ids=set())
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 12)
        assert out.stats.drafted > 0


HEAD_METHODS = {
    "chain": METHODS["chain-greedy"],
    "eagle2": METHODS["eagle2"],
    "ddd": METHODS["ddd"],
    "ddd-dsde": METHODS["ddd"].model_copy(update={"policy": SLPolicyKind.dsde}),
    "shipped-default": PAIR_SPECULATION["smollm2-eagle"],  # the CPU's: lookup's trees, else the head's shallow ones
}


@pytest.mark.parametrize("kind", [HeadKind.eagle, HeadKind.eagle3])
@pytest.mark.parametrize("name", list(HEAD_METHODS))
def test_eagle_heads_draft_on_the_device_and_stay_greedy_equal(target: LlamaModel, kind: HeadKind, name: str) -> None:
    """The head's weights, its KV cache and the target's features it drafts from all on CUDA; every method lossless."""
    head = random_head(target, kind).to(CUDA)
    assert {p.device.type for p in head.parameters()} == {"cuda"} and head.draft_ids.device.type == "cuda"
    engine = Engine(target, None, draft=head, speculation=HEAD_METHODS[name], max_batch_size=3, eos_token_ids=set())
    worker = engine.loop.draft
    assert isinstance(worker, HeadDraftWorker) and worker.cache.k[0].device.type == "cuda"
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=16))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 16)
    assert all(o.stats.drafted > 0 for o in outs)


def test_a_head_with_its_own_copies_of_the_targets_weights_loads_and_drafts_on_the_device(
    target: LlamaModel, tmp_path: Path
) -> None:
    """A checkpoint's own embedding and LM head (published EAGLE-1/2 heads carry the embedding) were compared with
    the target's across devices (a raw RuntimeError), and once bound stayed on the CPU after the head moved."""
    from specserve.config import HeadSpec
    from specserve.models.loader import load_draft
    from specserve.spec_decode.eagle_head import EagleHead
    from tests.test_eagle_head import eagle1_tensors, write_head

    emb, lm = target.embed_tokens.weight.detach().cpu(), target.lm_head.weight.detach().cpu()
    g = torch.Generator().manual_seed(9)
    own = {
        "embed_tokens.weight": emb + 0.05 * emb.std() * torch.randn(emb.shape, generator=g),
        "lm_head.weight": lm + 0.05 * lm.std() * torch.randn(lm.shape, generator=g),
    }
    head = load_draft(
        HeadSpec(head=str(write_head(tmp_path / "e1", eagle1_tensors(4, fc_bias=True) | own, {}))), target, device=CUDA
    )
    assert isinstance(head, EagleHead) and head.own_embed is not None and head.own_lm_head is not None
    assert head.embed_weight is not None and head.embed_weight.device.type == "cuda"
    assert head.target_lm_head is not None and head.target_lm_head.device.type == "cuda"
    engine = Engine(target, None, draft=head, speculation=HEAD_METHODS["ddd"], max_batch_size=3, eos_token_ids=set())
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 12)


def test_a_draft_vocabulary_set_on_the_device_drafts_there(target: LlamaModel) -> None:
    """The loader sets a head's draft vocabulary after moving it, from CPU ids (they stayed on the CPU)."""
    head = random_head(target).to(CUDA)
    head.set_draft_vocab(torch.arange(0, target.cfg.vocab_size, 2))
    assert head.draft_ids.device.type == "cuda"
    engine = Engine(target, None, draft=head, speculation=HEAD_METHODS["ddd"], max_batch_size=3, eos_token_ids=set())
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == greedy_reference(target, prompt, 12)


def test_synthetic_acceptance_runs_on_the_device(target: LlamaModel, draft: LlamaModel) -> None:
    """The synthetic mode's draws (load/straggler --workloads synthetic) came from CPU calls on the device's
    generators."""
    spec = SpecConfig(method=SpecMethod.chain, sl=4, synthetic_accept=0.7)
    engine = Engine(target, None, draft=draft, speculation=spec, max_batch_size=3, eos_token_ids=set())
    params = [SamplingParams(max_tokens=10), SamplingParams(temperature=0.8, seed=1, max_tokens=10)]
    outs = engine.generate(PROMPTS[:2], params)
    assert [len(o.token_ids) for o in outs] == [10, 10] and sum(o.stats.accepted for o in outs) > 0


def test_the_target_actor_sends_a_heads_features_from_the_host(target: LlamaModel) -> None:
    """Features crossed to the router as CUDA tensors: it reserves no GPU, so it opened a context on the node's
    first one, or failed to unpickle them on a node without a GPU."""
    pytest.importorskip("ray")  # deployments.actors imports Ray; the H200 image has none (2026-11-30)
    from deployments.actors import TargetActor
    from deployments.wire import attach_features
    from specserve.messages import FeatureRequest, VerifyItem

    actor = TargetActor.__new__(TargetActor)  # the actor's class in-process: no Ray
    actor.model = target
    actor.worker = TargetWorker(target, num_slots=1, max_len=32)
    actor.worker.add(0, SamplingParams(max_tokens=4), 0)
    (out,) = attach_features(*actor.verify([VerifyItem(0, [5, 9, 33, 71], features=FeatureRequest())]))
    assert out.features is not None and out.features.device.type == "cpu" and out.features.shape[0] == 4


@pytest.mark.parametrize("name", ["chain-keyed", "chain-sampled", "tree"])
def test_sampled_outputs_have_the_targets_distribution(target: LlamaModel, name: str) -> None:
    """tests/test_seeded_sampling.py's engine-level chi-square, with the models on the GPU."""
    from tests.test_seeded_sampling import CHI_SPECS, _engine_pairs, _exact_pairs, _pvalue

    engine = Engine(
        target,
        None,
        draft=noisy_copy(target, 0.5, seed=4).to(CUDA),
        speculation=CHI_SPECS[name],
        eos_token_ids=set(),
        max_batch_size=64,
    )
    assert _pvalue(_engine_pairs(engine), _exact_pairs(target)) > 1e-3


def test_flash_attn_chain_verification_matches_sdpa() -> None:
    pytest.importorskip("flash_attn")
    model = tiny_model(seed=11).to(CUDA, torch.bfloat16)
    prompts, chains = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]], [[1, 2], [3], [4, 5, 6]]

    def run(flash: bool) -> torch.Tensor:
        model.use_flash_attn = flash
        cache = model.new_cache(4, 64)
        cache.allocate()  # the batch's slots are not 0..B-1
        slots = [cache.allocate() for _ in prompts]
        model(ForwardBatch.build(cache, slots, prompts, device=CUDA), cache)
        batch = ForwardBatch.build(cache, slots[::-1], chains, device=CUDA)
        assert batch.causal
        return model(batch, cache)

    assert (run(True) - run(False)).abs().max() < 5e-2
    model.use_flash_attn = True


def test_kv_slots_are_sized_from_free_memory(target: LlamaModel) -> None:
    assert device_kv_slots([target], requested=4, max_len=256, step_tokens=16, share=MemoryShare(0.9)) == 4  # fits
    assert device_kv_slots([target], requested=4, max_len=256, step_tokens=16, share=None) == 4
    assert device_kv_slots([target], requested=4, max_len=256, step_tokens=16, share=MemoryShare(0.9, 0.5)) == 4
    free = torch.cuda.mem_get_info()[0]
    huge = int(free / (2 * target.cfg.num_layers * target.cfg.num_kv_heads * target.cfg.head_dim * 4)) + 1
    with pytest.raises(KVCapacityError, match="not even one KV slot fits"):  # one slot longer than the free memory
        device_kv_slots([target], requested=1, max_len=huge, step_tokens=16, share=MemoryShare(1.0))
    engine = Engine(target, None, max_batch_size=4, max_model_len=128, gpu_memory_utilization=0.9)
    assert engine.loop.target.cache.num_slots == 4


def test_loading_goes_straight_to_the_device(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny_model(seed=7)
    (tmp_path / "m").mkdir()
    save_file(hf_state_dict(model), tmp_path / "m" / "model.safetensors")
    (tmp_path / "m" / "config.json").write_text(json.dumps(model.hf_config.to_dict()))
    spec = ModelSpec(source=str(tmp_path / "m"), dtype="bfloat16")  # type: ignore[arg-type]
    loaded = load_model_dir(tmp_path / "m", spec, device=CUDA)
    assert {(p.device.type, p.dtype) for p in loaded.parameters()} == {("cuda", torch.bfloat16)}
    want = model.to(CUDA, torch.bfloat16)
    for (name, p), (_, q) in zip(loaded.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(p, q), name


@pytest.fixture(scope="module")
def gpu_app_url() -> Iterator[str]:
    pytest.importorskip("ray")  # a GPU image without Ray (the H200's, 2026-11-26) still runs the rest
    from deployments.app import app_builder

    args = {
        "tiny": {"seed": 0, "draft_noise": 0.05, "draft_seed": 3},
        "speculation": {"method": "chain", "sl": 3},
        "max_batch_size": 4,
        "gpu_memory_utilization": 0.9,
        "router_resources": {"num_cpus": 0.5},
        "target_resources": {"num_cpus": 0.5, "num_gpus": 0.5},  # both actors on the one GPU
        "draft_resources": {"num_cpus": 0.5, "num_gpus": 0.5},
    }
    with serve_app(app_builder(args), name="gpu", route_prefix="/gpu", num_cpus=4, num_gpus=1) as url:
        yield url


def test_a_deployments_tiny_head_is_built_on_its_actors_device() -> None:
    """``tiny.draft_head`` on a GPU draft actor: the head was made on the host beside its target's tensors on the
    device, and every propose failed in its embedding."""
    from deployments.app_args import AppArgs, WorkerRole
    from deployments.recipe_models import build_model

    args = AppArgs.model_validate({"tiny": {"seed": 0, "draft_head": True, "draft_seed": 3}})
    recipe = args.recipe(WorkerRole.draft)
    assert recipe is not None
    head = build_model(recipe, CUDA)
    assert head.device.type == "cuda" and all(p.device.type == "cuda" for p in head.parameters())
    target = tiny_model(seed=0).to(CUDA)
    engine = Engine(target, None, draft=head, speculation=METHODS["eagle2"], eos_token_ids=set())
    params = SamplingParams(max_tokens=12)
    assert [c.token_ids for c in engine.generate(PROMPTS[:2], params)] == [
        greedy_reference(target, p, 12) for p in PROMPTS[:2]
    ]


def test_serve_app_on_gpus_answers_like_the_engine(gpu_app_url: str) -> None:
    import httpx

    from deployments.tiny_tokenizer import tiny_tokenizer

    body = {"model": "tiny", "prompt": "the cache", "max_tokens": 12, "temperature": 0}
    reply = httpx.post(f"{gpu_app_url}/v1/completions", json=body, timeout=120.0)
    assert reply.status_code == 200, reply.text
    target = tiny_model(seed=0).to(CUDA)
    engine = Engine(
        target,
        tiny_tokenizer(),
        draft=noisy_copy(tiny_model(seed=0), 0.05, seed=3).to(CUDA),
        speculation=SpecConfig(method=SpecMethod.chain, sl=3),
        max_batch_size=4,
    )
    want = engine.generate(["the cache"], SamplingParams(max_tokens=12))[0].text
    assert reply.json()["choices"][0]["text"] == want


@pytest.mark.parametrize("kind", [HeadKind.eagle, HeadKind.eagle3])
def test_a_head_trains_on_the_device_from_the_devices_features(tmp_path: Path, kind: HeadKind) -> None:
    target = tiny_model(seed=0).to(CUDA)
    for p in target.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9, 2, 7, 4, 6)]
    aux_layers = (0, 1) if kind == HeadKind.eagle3 else ()
    convs, feats = generate_with_features(target, prompts, 16, set(), aux_layers)
    alone = [generate_with_features(target, [p], 16, set())[0][0].tokens for p in prompts]
    assert [c.tokens for c in convs] == alone  # the batch's greedy answers are each prompt's own
    ref = target_features(target, convs, aux_layers)
    for f, rf in zip(feats.final, ref.final, strict=True):
        assert f.device.type == "cpu" and f.dtype == torch.float16  # kept on the host for the data files
        torch.testing.assert_close(f, rf, atol=2e-2, rtol=1e-2)
    aux = feats.aux if feats.aux is not None else [None] * len(convs)
    rows = zip(convs, feats.final, aux, strict=True)
    samples = [Sample(torch.tensor(c.tokens), f, c.prompt_len, a) for c, f, a in rows]
    ids = torch.arange(0, 512, 2)
    cfg = TrainConfig(
        kind=kind,
        aux_layers=aux_layers,
        epochs=3,
        batch_tokens=96,
        max_len=64,
        warmup_steps=2,
        checkpoint_every=3,
        noise=0.1,
    )
    losses: list[float] = []
    head = train_head(target, samples, ids, cfg, tmp_path / "a", system_len=2, log=lambda s, t, x, st: losses.append(x))
    assert head.device == target.device and losses[-1] < losses[0]
    train_head(target, samples, ids, cfg, tmp_path / "b", system_len=2, max_steps=4)  # interrupted on the device ...
    resumed = train_head(target, samples, ids, cfg, tmp_path / "b", system_len=2)  # ... and resumed
    for x, y in zip(head.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)  # (cuBLAS may pick other kernels on a resume)
    engine = Engine(target, None, draft=head, speculation=PAIR_SPECULATION["smollm2-eagle"], eos_token_ids=set())
    params = SamplingParams(max_tokens=16, temperature=0.0)
    for prompt in PROMPTS:
        assert engine.generate([prompt], params)[0].token_ids == greedy_reference(target, prompt, 16)


def test_keyed_noise_is_the_same_stream_on_the_device_as_on_the_host() -> None:
    """The draws of docs/algorithms.md §1.4: the same 64-bit stream (only the device's log may round apart)."""
    from specserve.sampling import keyed_exponentials

    positions = [0, 7, 7, 123_456]
    host = keyed_exponentials(2**63 + 5, positions, 4099, "cpu")
    assert torch.allclose(keyed_exponentials(2**63 + 5, positions, 4099, "cuda").cpu(), host, rtol=1e-6, atol=0)


def test_a_masked_step_with_grouped_heads_runs_in_the_memory_efficient_kernel() -> None:
    """SDPA's grouped heads run only in flash attention (no mask) or the math kernel, which holds the fp32 scores
    [B, H_q, Q, K]: a masked step (a ragged batch, a tree) expands K/V so the memory-efficient kernel takes it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specserve.models.attention import attention
    from specserve.models.kv_cache import KVCache

    gen = torch.Generator(device=CUDA).manual_seed(0)
    cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, num_slots=2, max_len=96, dtype=torch.float32,
                    device=CUDA)  # fmt: skip
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen, device=CUDA))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen, device=CUDA))
    slots = [cache.allocate() for _ in range(2)]
    cache.begin_append(slots, [40, 70])
    batch = ForwardBatch.build(cache, slots, [[1] * 5, [1] * 3])  # ragged: a mask
    assert batch.attn_mask is not None
    q = torch.randn(8, 8, 64, generator=gen, device=CUDA)  # 8 query heads over 2 KV heads
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # no math fallback: it would raise "No available kernel"
        out = attention(q, cache.k[0], cache.v[0], batch, use_flash=False)
    with sdpa_kernel([SDPBackend.MATH]):
        k, v = (t[batch.slots, :, : batch.kv_len] for t in (cache.k[0], cache.v[0]))
        q_pad = q.new_zeros(2 * 5, 8, 64)
        q_pad[batch.write_from] = q
        ref = torch.nn.functional.scaled_dot_product_attention(
            q_pad.view(2, 5, 8, 64).transpose(1, 2), k, v, attn_mask=batch.attn_mask, enable_gqa=True
        )
    assert torch.allclose(out, ref.transpose(1, 2).reshape(10, 8, 64)[batch.write_from], atol=1e-4)


def test_a_float32_prefill_of_one_sequence_with_grouped_heads_runs_in_the_memory_efficient_kernel() -> None:
    """No mask (one sequence, causal), but float32, which flash attention does not take: it fell to the math
    kernel's fp32 scores [1, H_q, L, L], which the memory plan does not count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specserve.models.attention import attention
    from specserve.models.kv_cache import KVCache

    gen = torch.Generator(device=CUDA).manual_seed(0)
    cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, num_slots=1, max_len=64, dtype=torch.float32,
                    device=CUDA)  # fmt: skip
    slot = cache.allocate()
    batch = ForwardBatch.build(cache, [slot], [[1] * 48])
    assert batch.attn_mask is None and batch.kv_len == 48
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen, device=CUDA))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen, device=CUDA))
    q = torch.randn(48, 8, 64, generator=gen, device=CUDA)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # no math fallback: it would raise "No available kernel"
        out = attention(q, cache.k[0], cache.v[0], batch, use_flash=False)
    with sdpa_kernel([SDPBackend.MATH]):
        k, v = (t[[slot], :, :48] for t in (cache.k[0], cache.v[0]))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.view(1, 48, 8, 64).transpose(1, 2), k, v, is_causal=True, enable_gqa=True
        )
    assert torch.allclose(out, ref.transpose(1, 2).reshape(48, 8, 64), atol=1e-4)
