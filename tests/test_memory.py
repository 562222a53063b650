"""Device memory: the arithmetic of specserve/models/memory.py against real allocations, KV sizing from free
memory, loading straight to the serving dtype, and the shipped GPU configs against the GPUs they run on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pydantic
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from deployments.app_args import AppArgs, WorkerRole
from specserve.config import EngineConfig, ModelSpec, SpecConfig, SpecMethod, derived_draft
from specserve.errors import CorruptModelError, KVCapacityError, ModelSourceError, SettingsError, UnsupportedModelError
from specserve.limits import context_limits, model_shape
from specserve.models.batch import ForwardBatch
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_model_dir
from specserve.models.memory import GIB, ModelShape, kv_bytes_per_slot, kv_slots_that_fit, plan, weight_bytes
from specserve.models.tiny import hf_state_dict, tiny_config, tiny_head, tiny_model

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20

# The models cluster/serve-gpu.yaml serves are gated on the hub (not downloadable here): their shapes as published
# in each repo's config.json (meta-llama/Llama-3.1-8B-Instruct, meta-llama/Llama-3.2-1B-Instruct).
HUB_SHAPES: dict[str, ModelShape] = {
    "meta-llama/Llama-3.1-8B-Instruct": ModelShape(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_positions=131072,
    ),
    "meta-llama/Llama-3.2-1B-Instruct": ModelShape(
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_positions=131072,
    ),
}
# GPU memory per GPU of the instance types cluster/gpu-cluster.yaml names (None: no GPU), as CUDA reports it
# (torch.cuda.mem_get_info total): g5 = NVIDIA A10G 24 GB, p4d = NVIDIA A100-SXM4 40 GB.
INSTANCE_GPU_BYTES: dict[str, int | None] = {
    "m6i.2xlarge": None,
    "g5.2xlarge": 23028 * MIB,
    "p4d.24xlarge": 40536 * MIB,
}


def test_parameter_count_matches_the_models_and_the_published_sizes() -> None:
    biased = [
        tiny_config(attention_bias=True),
        tiny_config(mlp_bias=True),
        tiny_config(attention_bias=True, mlp_bias=True),
    ]
    for model in (
        tiny_model(),
        tiny_model(tiny_config(tie_word_embeddings=True)),
        tiny_model(tiny_config("qwen2")),
        *(tiny_model(cfg) for cfg in biased),  # o_proj and MLP biases were not counted
    ):
        assert model_shape(model).num_params == sum(p.numel() for p in model.parameters())
    assert round(HUB_SHAPES["meta-llama/Llama-3.1-8B-Instruct"].num_params / 1e9, 2) == 8.03  # "8B": 8.03e9
    assert round(HUB_SHAPES["meta-llama/Llama-3.2-1B-Instruct"].num_params / 1e9, 2) == 1.24  # "1B": 1.24e9


def test_kv_bytes_match_the_cache_allocation() -> None:
    for model in (tiny_model().to(torch.bfloat16), tiny_head(tiny_model())):
        cache = model.new_cache(3, 40)
        allocated = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
        dtype_bytes = cache.k[0].element_size()
        assert 3 * kv_bytes_per_slot(model_shape(model), dtype_bytes, 40) == allocated


def test_slots_that_fit_follow_the_utilisation_setting() -> None:
    common = {"slot_bytes": GIB, "activation_bytes_per_slot": GIB // 2}
    # 80 GiB device, 30 GiB used by weights: 0.9 * 80 - 30 = 42 GiB -> 28 slots of 1.5 GiB
    assert kv_slots_that_fit(total_bytes=80 * GIB, free_bytes=50 * GIB, utilization=0.9, requested=64, **common) == 28
    assert kv_slots_that_fit(total_bytes=80 * GIB, free_bytes=50 * GIB, utilization=0.9, requested=16, **common) == 16
    assert kv_slots_that_fit(total_bytes=80 * GIB, free_bytes=10 * GIB, utilization=0.9, requested=4, **common) == 1
    with pytest.raises(KVCapacityError, match="not even one KV slot fits"):  # 72 - 71 = 1 GiB < 1.5 GiB
        kv_slots_that_fit(total_bytes=80 * GIB, free_bytes=9 * GIB, utilization=0.9, requested=4, **common)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_slots_that_fit(total_bytes=GIB, free_bytes=GIB, utilization=1.5, requested=1, **common)


def test_actors_sharing_a_gpu_count_their_own_memory_against_their_share() -> None:
    """Each of two actors at num_gpus 0.5 paid for both actors' weights out of its half: an 8B bf16 target (16 GiB)
    and a 1B draft (3 GiB) on a 40 GiB GPU at 0.9 found "not even one KV slot" with 20 GiB free."""
    common = {"slot_bytes": GIB // 2, "activation_bytes_per_slot": GIB // 4, "requested": 64}
    device = {"total_bytes": 40 * GIB, "free_bytes": 20 * GIB, "utilization": 0.9, "fraction": 0.5}
    with pytest.raises(KVCapacityError):  # counted as if alone: 18 - 20 GiB
        kv_slots_that_fit(**device, **common)
    assert kv_slots_that_fit(**device, own_bytes=16 * GIB, **common) == 2  # the target: 18 - 16 = 2 GiB, 0.75 a slot
    assert kv_slots_that_fit(**device, own_bytes=3 * GIB, **common) == 20  # the draft: 15 GiB, then 16 GiB free - 4
    # another process took the free memory: the device keeps its (1 - 0.9) * 40 = 4 GiB free whatever the share
    assert kv_slots_that_fit(**{**device, "free_bytes": 5 * GIB}, own_bytes=3 * GIB, **common) == 1
    # alone on the device (fraction 1), the two rules agree: 0.9 * 80 - 30 = 50 - 8 = 42 GiB
    alone = {"total_bytes": 80 * GIB, "free_bytes": 50 * GIB, "utilization": 0.9}
    assert kv_slots_that_fit(**alone, **common) == kv_slots_that_fit(**alone, own_bytes=30 * GIB, **common) == 56


def test_cpu_keeps_max_batch_size_slots() -> None:
    from specserve.engine import Engine

    engine = Engine(
        tiny_model(), None, max_batch_size=5, max_model_len=64, eos_token_ids=set(), gpu_memory_utilization=0.5
    )
    assert engine.loop.target.cache.num_slots == 5  # the setting sizes CUDA devices only


def _write_hf_dir(model: LlamaModel, path: Path) -> Path:
    path.mkdir()
    save_file(hf_state_dict(model), path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(model.hf_config.to_dict()))
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
def test_loading_builds_the_serving_dtype_directly(tmp_path: Path, dtype: str, tied: bool) -> None:
    model = tiny_model(tiny_config(tie_word_embeddings=tied), seed=3)
    # the Python layer loop and BLAS on both sides: this compares weights; the C++ stack and kernel have their own tests
    spec = ModelSpec(source=str(tmp_path / "m"), dtype=dtype, native_stack=False, small_gemm=False)  # type: ignore[arg-type]
    loaded = load_model_dir(_write_hf_dir(model, tmp_path / "m"), spec, max_positions=256)
    want = model.to(spec.dtype.torch)  # the old path: a float32 model, then .to(dtype)
    assert {p.dtype for p in loaded.parameters()} == {spec.dtype.torch}
    assert loaded.rope_cos.dtype == want.rope_cos.dtype
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied
    for (name, p), (_, q) in zip(loaded.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(_logits(loaded, [3, 4, 5, 6]), _logits(want, [3, 4, 5, 6]))


def test_a_named_pipe_called_safetensors_is_not_read_as_weights(tmp_path: Path) -> None:
    """open() on a FIFO blocks until a writer comes, past Ctrl-C: a folder holding one loaded for ever."""
    from specserve.models.loader import weight_files
    from specserve.models.sources import validate_hf_dir

    path = _write_hf_dir(tiny_model(tiny_config(num_hidden_layers=1), seed=3), tmp_path / "m")
    os.mkfifo(path / "zz.safetensors")
    assert weight_files(path) == [path / "model.safetensors"]
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match=r"no \*\.safetensors weights"):
        validate_hf_dir(path)


def test_a_cpu_kernel_model_on_another_device_is_refused_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``generate --draft smollm2-int8 --device cuda`` loaded the target, then ended in the loader's ValueError:
    a traceback, not the CLI's one-line error. The engine's config now refuses it before any load."""
    path = _write_hf_dir(tiny_model(tiny_config(num_hidden_layers=1), seed=3), tmp_path / "m")
    with pytest.raises(UnsupportedModelError, match="int8_dynamic models run on the CPU"):
        load_model_dir(path, ModelSpec(source=str(path), int8_dynamic=True), device="cuda")
    monkeypatch.setattr("specserve.config.device_problem", lambda device: None)  # as on a machine with CUDA
    for kind in ("int8", "q4"):
        with pytest.raises(pydantic.ValidationError, match=r"runs on the CPU, not on cuda"):
            EngineConfig(device="cuda", draft=derived_draft(ModelSpec(), kind))
        for cpu in ("cpu", "cpu:0"):  # ("cpu:0" was refused as "not the CPU")
            assert EngineConfig(device=cpu, draft=derived_draft(ModelSpec(), kind)).draft is not None
    assert EngineConfig(device="cuda", draft=derived_draft(ModelSpec(), "bf16")).device == "cuda"


def test_only_the_indexed_shards_are_read_and_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    """Every *.safetensors was opened and a later file's tensor silently won: a stale unsharded model.safetensors
    sorts after model-00001-of-00002.safetensors, and Mistral repositories carry consolidated.safetensors too."""
    model = tiny_model(tiny_config(num_hidden_layers=2), seed=3)
    spec = ModelSpec(source=str(tmp_path / "m"), native_stack=False, small_gemm=False)
    path = _write_hf_dir(model, tmp_path / "m")
    sd = hf_state_dict(model)
    stale = {"model.norm.weight": sd["model.norm.weight"] * 2}
    save_file(stale, path / "zz-stale.safetensors")
    with pytest.raises(CorruptModelError, match=r"'model\.norm\.weight' is in both model\.safetensors and zz-stale"):
        load_model_dir(path, spec)
    (path / "zz-stale.safetensors").rename(path / "consolidated.safetensors")  # skipped by name
    assert torch.equal(load_model_dir(path, spec).norm, model.norm)
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    save_file(stale, path / "model.safetensors")  # a stale file beside the shard the index names
    weight_map = dict.fromkeys(sd, "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(load_model_dir(path, spec).norm, model.norm)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(ModelSourceError, match=r"names weight files that are not there: model-00002\."):
        load_model_dir(path, spec)


def test_a_checkpoint_deeper_or_shallower_than_its_config_or_with_non_finite_weights_is_refused(tmp_path: Path) -> None:
    model = tiny_model(tiny_config(num_hidden_layers=3), seed=3)
    spec = ModelSpec(source=str(tmp_path / "m"), native_stack=False, small_gemm=False)
    path = _write_hf_dir(model, tmp_path / "m")
    load_model_dir(path, spec)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 2}))
    with pytest.raises(
        UnsupportedModelError, match=r"hold 3 decoder layers, numbered up to 2; its config\.json names 2$"
    ):
        load_model_dir(path, spec)  # it ran the first two layers before
    (path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 100_000}))
    with pytest.raises(
        UnsupportedModelError, match=r"hold 3 decoder layers, numbered up to 2; its config\.json names 100000"
    ):
        load_model_dir(path, spec)  # it built 100000 layers first (85 s) and then missed a tensor of the fourth
    (path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 10_000_000}))
    sd = load_file(path / "model.safetensors")
    sparse = {k.replace("model.layers.2.", "model.layers.9999999."): v for k, v in sd.items()}
    save_file(sparse, path / "model.safetensors")  # the highest index alone agreed with the count: 10 M layers built
    with pytest.raises(UnsupportedModelError, match=r"hold 3 decoder layers, numbered up to 9999999; its config"):
        load_model_dir(path, spec)
    save_file(sd, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    sd = load_file(path / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(sd, path / "model.safetensors")
    with pytest.raises(CorruptModelError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' holds NaN or infinite"):
        load_model_dir(path, spec)


def test_checkpoints_this_runner_does_not_run_are_refused_for_what_they_are(tmp_path: Path) -> None:
    """A GPT-2 was refused for holding "0 decoder layers", a bare LlamaModel's tensors likewise, a float8 checkpoint
    with torch's NotImplementedError, and a bitsandbytes one only after its int8 weights were built in as floats."""
    from transformers import GPT2Config, GPT2LMHeadModel

    spec = ModelSpec(source=str(tmp_path / "m"), native_stack=False, small_gemm=False)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
        tmp_path / "gpt2"
    )
    with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt2' is not supported"):
        load_model_dir(tmp_path / "gpt2", spec)
    path = _write_hf_dir(tiny_model(tiny_config(num_hidden_layers=2), seed=3), tmp_path / "m")
    config, sd = json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in sd.items()}, path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"names 2; its tensors lack the 'model\.' prefix"):
        load_model_dir(path, spec)
    for dtype in (torch.float8_e4m3fn, torch.int8):
        save_file(
            sd | {"model.layers.0.mlp.up_proj.weight": torch.zeros(32, 16, dtype=dtype)}, path / "model.safetensors"
        )
        with pytest.raises(UnsupportedModelError, match=rf"up_proj\.weight' is {dtype}; the weights must be float32"):
            load_model_dir(path, spec)
    save_file(sd, path / "model.safetensors")
    load_model_dir(path, spec)
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    with pytest.raises(UnsupportedModelError, match=r"quantised checkpoint \(quantization_config: gptq\)"):
        load_model_dir(path, spec)


def test_generation_stops_at_the_eos_ids_generation_config_names_and_at_no_class_default(tmp_path: Path) -> None:
    """generation_config.json's EOS ids were never read (an instruct model may name its end of turn there alone,
    and ran past it), and a config.json without eos_token_id stopped at Llama's class default, id 2."""
    from specserve.engine import Engine
    from specserve.sampling import SamplingParams
    from specserve.sequence import FinishReason

    model = tiny_model(tiny_config(num_hidden_layers=2), seed=3)
    spec = ModelSpec(source=str(tmp_path / "m"), native_stack=False, small_gemm=False)
    path = _write_hf_dir(model, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "eos_token_id"}))
    assert load_model_dir(path, spec).eos_token_ids == frozenset()
    params = SamplingParams(max_tokens=24)

    def generate(loaded: LlamaModel) -> tuple[list[int], FinishReason | None]:
        out = Engine(loaded, None, max_model_len=64, max_batch_size=1).generate([[5, 9, 13]], params)[0]
        return out.token_ids, out.finish_reason

    plain, reason = generate(load_model_dir(path, spec))
    assert reason == FinishReason.length and len(set(plain)) > 2
    stop = plain[len(plain) // 2]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [config["eos_token_id"], stop]}))
    loaded = load_model_dir(path, spec)
    assert loaded.eos_token_ids == {config["eos_token_id"], stop}
    assert generate(loaded) == (plain[: plain.index(stop)], FinishReason.stop)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(CorruptModelError, match=r"generation_config\.json: eos_token_id must be a token id"):
        load_model_dir(path, spec)


def _logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 32)
    return model(ForwardBatch.build(cache, [cache.allocate()], [tokens]), cache)


def test_weights_are_the_loaded_tensors_not_copies() -> None:
    """``from_hf_weights`` assigns what the loader hands it: no second (e.g. float32 host) model exists."""
    sd = {k: v.to(torch.bfloat16) for k, v in hf_state_dict(tiny_model(seed=4)).items()}
    handed: dict[str, int] = {}

    def get(name: str) -> torch.Tensor:
        handed[name] = sd[name].data_ptr()
        return sd[name]

    model = LlamaModel.from_hf_weights(tiny_config(), get, dtype=torch.bfloat16, device="cpu")
    assert model.embed_tokens.weight.data_ptr() == handed["model.embed_tokens.weight"]
    assert model.layers[0].down.weight.data_ptr() == handed["model.layers.0.mlp.down_proj.weight"]
    assert all(p.device.type == "cpu" for p in model.parameters())  # nothing left on the meta device


def _shipped_apps() -> list[tuple[str, AppArgs]]:
    out = []
    for path in ("cluster/serve-gpu.yaml", "cluster/rayservice.yaml"):
        doc = yaml.safe_load((REPO / path).read_text())
        if doc.get("kind") == "RayService":
            doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
        out += [(path, AppArgs.model_validate(app["args"])) for app in doc["applications"]]
    return out


def _gpu_node_bytes() -> dict[str, int]:
    cluster = yaml.safe_load((REPO / "cluster/gpu-cluster.yaml").read_text())
    types = [node["node_config"]["InstanceType"] for node in cluster["available_node_types"].values()]
    assert set(types) <= set(INSTANCE_GPU_BYTES), f"add the GPU size of {set(types) - set(INSTANCE_GPU_BYTES)}"
    return {t: b for t in types if (b := INSTANCE_GPU_BYTES[t]) is not None}


def _worker_bytes(args: AppArgs, role: WorkerRole) -> int:
    """Weights + KV + activations + CUDA context of one worker actor of ``args`` (one GPU each)."""
    recipe = args.recipe(role)
    assert recipe is not None and isinstance(recipe.spec, ModelSpec)
    target = args.recipe(WorkerRole.target)
    draft = args.recipe(WorkerRole.draft)
    assert target is not None and target.spec is not None
    t_shape = HUB_SHAPES[target.spec.source]
    d_shape = None if draft is None or draft.spec is None else HUB_SHAPES[draft.spec.source]
    limits = context_limits(
        max_model_len=args.max_model_len,
        spec_headroom=args.spec_headroom,
        speculation=args.speculation,
        target_positions=t_shape.max_positions,
        target_vocab=t_shape.vocab_size,
        draft_positions=None if d_shape is None else d_shape.max_positions,
        draft_vocab=None if d_shape is None else d_shape.vocab_size,
    )
    shape = HUB_SHAPES[recipe.spec.source]
    return plan(
        shape,
        recipe.spec.dtype.torch.itemsize,
        num_slots=args.max_batch_size,
        max_len=limits.kv_len,
        step_tokens=limits.spec_headroom,
        prefill_tokens=limits.max_model_len,
    ).total


def test_shipped_gpu_configs_fit_every_gpu_node_type() -> None:
    nodes = _gpu_node_bytes()
    assert nodes, "cluster/gpu-cluster.yaml names no GPU node type"
    for path, args in _shipped_apps():
        for role in args.roles:
            resources = args.resources(role)
            assert resources.num_gpus == 1, f"{path}: {role.value} is sized for a GPU of its own"
            need = _worker_bytes(args, role)
            util = args.gpu_memory_utilization or 1.0
            for instance, gpu_bytes in nodes.items():
                assert need <= util * gpu_bytes, (
                    f"{path}: the {role.value} needs {need / GIB:.1f} GiB at {args.max_batch_size} x "
                    f"{args.max_model_len} tokens; {instance} has {util:.2f} x {gpu_bytes / GIB:.1f} GiB"
                )


def test_the_fit_check_rejects_the_old_sizing() -> None:
    """The check can fail: batch 64 at 8192 tokens (the configs before sizing) needs 64 GiB of KV alone."""
    _, args = _shipped_apps()[0]
    old = args.model_copy(update={"max_batch_size": 64, "max_model_len": 8192})
    assert _worker_bytes(old, WorkerRole.target) > max(_gpu_node_bytes().values())
    target = HUB_SHAPES["meta-llama/Llama-3.1-8B-Instruct"]
    assert 64 * kv_bytes_per_slot(target, 2, 8192) == 64 * GIB
    assert weight_bytes(target, 2) > 14.9 * GIB  # bf16 8B


def test_speculation_that_leaves_no_context_is_refused() -> None:
    with pytest.raises(SettingsError, match="no context"):
        context_limits(
            max_model_len=2048,
            spec_headroom=64,
            speculation=SpecConfig(method=SpecMethod.chain, sl=8),
            target_positions=48,  # fewer positions than a step's headroom
            target_vocab=512,
        )


def test_a_cpu_kv_cache_larger_than_the_host_can_give_is_refused_before_it_is_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An 8B float32 target at batch 16 and 32k tokens (137 GB) was ended by the kernel's OOM killer, without a
    word, as its cache was zeroed (which commits the pages). The slots' shares of a step's activations count too:
    a cache that alone fit was ended at its first full batch of whole-prompt prefills."""
    from specserve import limits
    from specserve.engine import Engine
    from specserve.errors import KVCapacityError

    model = tiny_model(tiny_config(), seed=0)
    per_token = 2 * model.cfg.num_layers * model.cfg.num_kv_heads * model.cfg.head_dim * 4  # K and V, float32
    monkeypatch.setattr(limits, "host_available_bytes", lambda: 4 * 64 * per_token)  # the KV of 4 slots of 64
    with pytest.raises(KVCapacityError, match=r"4 slots x 64 tokens needs .* GiB and .* GiB for a step's activ"):
        Engine(model, None, max_batch_size=4, max_model_len=48, spec_headroom=16, eos_token_ids=set())
    # half a MiB a slot for this tiny model's activations (a prefill of 64 tokens: 0.3 MiB, mostly logits)
    monkeypatch.setattr(limits, "host_available_bytes", lambda: 4 * (64 * per_token + GIB // 2048))
    Engine(model, None, max_batch_size=4, max_model_len=48, spec_headroom=16, eos_token_ids=set())
    with pytest.raises(KVCapacityError, match=r"a KV cache of 9 slots x 64 tokens needs"):
        Engine(model, None, max_batch_size=9, max_model_len=48, spec_headroom=16, eos_token_ids=set())
    # a worker actor's cache, sized by the deployment's geometry rather than by device_kv_slots, is checked too
    from specserve import host_memory
    from specserve.workers import TargetWorker

    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: 4 * 64 * per_token)
    TargetWorker(model, num_slots=4, max_len=64)
    with pytest.raises(KVCapacityError, match="a KV cache of 4 slots x 65 tokens"):
        TargetWorker(model, num_slots=4, max_len=65)


def test_cpu_workers_on_one_node_are_refused_when_their_caches_together_do_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deployment checked a CPU worker's cache only inside its own ``start`` (never awaited, and counting the
    cache alone), and only with ``gpu_memory_utilization`` set (not in app.yaml) its activations: a cache that fit
    alone was ended by the OOM killer at its first full batch. Lanes packed on one host were each checked as if
    alone."""
    import asyncio
    import dataclasses
    from types import SimpleNamespace

    from deployments import actors
    from deployments.actors import HostNeed, KVGeometry, TargetActor
    from deployments.router import Router, hosts_fit

    model = tiny_model(tiny_config(), seed=0)
    per_token = 2 * model.cfg.num_layers * model.cfg.num_kv_heads * model.cfg.head_dim * 4  # K and V, float32
    geometry = KVGeometry(num_slots=4, max_len=64)
    monkeypatch.setattr(actors, "host_available_bytes", lambda: 10 * GIB)
    monkeypatch.setattr(actors.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-a"))
    host = TargetActor.__new__(TargetActor)
    host.model = model
    need = host.host_need(geometry, 16)
    assert need is not None and need.node_id == "node-a" and need.available == 10 * GIB
    assert need.kv_bytes == 4 * 64 * per_token and 0 < need.activation_bytes < GIB

    alone = dataclasses.replace(need, available=need.kv_bytes + need.activation_bytes)  # one worker's, exactly
    hosts_fit([alone, None], geometry)  # (None: a worker on a GPU)
    hosts_fit([alone, dataclasses.replace(alone, node_id="node-b")], geometry)  # one a node
    with pytest.raises(KVCapacityError, match=r"the 2 CPU workers on node node-a together: .* 4 slots x 64 tokens"):
        hosts_fit([alone, alone], geometry)
    with pytest.raises(KVCapacityError, match="GiB for a step's activations"):  # the cache alone fits
        hosts_fit([dataclasses.replace(alone, available=need.kv_bytes)], geometry)

    cls = Router.func_or_class
    router = cls.__new__(cls)
    router.args = SimpleNamespace(gpu_memory_utilization=None, worker_start_timeout_s=5.0)  # app.yaml's default

    async def answer(host_need: HostNeed) -> HostNeed:
        return host_need

    def worker(host_need: HostNeed) -> SimpleNamespace:
        return SimpleNamespace(handle=SimpleNamespace(host_need=SimpleNamespace(remote=lambda g, t: answer(host_need))))

    limits = SimpleNamespace(spec_headroom=16)
    one_lane = [{WorkerRole.target: worker(alone)}]
    assert asyncio.run(router._fit_geometry(one_lane, geometry, limits)) == geometry  # type: ignore[arg-type]
    two_lanes = [{WorkerRole.target: worker(alone)}, {WorkerRole.target: worker(alone)}]
    with pytest.raises(KVCapacityError, match="2 CPU workers"):
        asyncio.run(router._fit_geometry(two_lanes, geometry, limits))  # type: ignore[arg-type]
