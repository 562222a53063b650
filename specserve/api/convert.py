"""API requests -> engine objects (SamplingParams, SpecConfig), engine results -> API usage."""

from __future__ import annotations

from pydantic import ValidationError

from specserve.api.error_bodies import APIError
from specserve.api.schemas import GenerationRequest, SpeculationOptions, SpeculationUsage, Usage
from specserve.config import SpecConfig, SpecMethod
from specserve.sampling import SamplingParams
from specserve.sequence import RequestOutput
from specserve.structured import OutputFormat


def sampling_params_for(request: GenerationRequest, *, max_tokens: int) -> SamplingParams:
    """The request's sampling values; values the engine rejects become a 400 naming the parameter.

    A sampled request without a seed gets one here (and the response names it): its output is then a function of
    the request alone, which is what lets a cut stream resume (docs/algorithms.md §1.4).
    """
    try:
        return SamplingParams(
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            min_p=request.min_p,
            seed=request.seed,
            max_tokens=max_tokens,
            stop=(request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ()),
            ignore_eos=request.ignore_eos,
            stop_token_ids=frozenset(request.stop_token_ids or ()),
            include_stop_str_in_output=request.include_stop_str_in_output,
            logit_bias=tuple((int(t), b) for t, b in (request.logit_bias or {}).items()),
            logprobs=request.logprob_count,
            prompt_logprobs=request.logprob_count if request.echoes else None,
            min_tokens=request.min_tokens,
            output_format=request.output_format(),
        ).seeded()
    except ValidationError as e:  # (a format's own fields, or a field beside it, are named as the request's)
        first = e.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        if param in ("output_format", *OutputFormat.model_fields) or e.title == OutputFormat.__name__:
            param = request.format_param
        raise APIError(f"{param}: {first['msg']}" if param else first["msg"], param=param) from e


def speculation_for(options: SpeculationOptions | None, default: SpecConfig) -> SpecConfig | None:
    """A request's speculation options applied to the server default; None keeps the default.

    ``enabled: false``, ``policy: none`` or ``method: none`` turn speculation off; ``method`` picks chains or trees,
    ``drafter`` who drafts (the deployment's draft model, or the model-free lookup / suffix drafters);
    ``static`` / ``dsde`` select the SL policy; ``max_sl`` caps the speculation length (chain length, tree depth)
    below the server's own ceiling. Asking for speculation where the default is plain decoding selects chains.
    """
    if options is None:
        return None
    if not options.enabled or options.method == SpecMethod.none:
        return SpecConfig(method=SpecMethod.none)
    update: dict[str, object] = {}
    if default.method == SpecMethod.none:
        update["method"] = SpecMethod.chain
    if options.method is not None:
        update["method"] = options.method
    if options.drafter is not None:
        update["drafter"] = options.drafter
    if options.model_fallback is not None:
        update["model_fallback"] = options.model_fallback
    if options.policy is not None:
        update["policy"] = options.policy
    if options.max_sl is not None:
        update["max_sl"] = options.max_sl if default.max_sl is None else min(default.max_sl, options.max_sl)
    spec = default.model_copy(update=update)
    return None if spec == default else spec


def usage_for(out: RequestOutput, *more: RequestOutput, prompt_tokens: int | None = None) -> Usage:
    """A request's usage from its last output; with ``more``, its other choices' last outputs: the completion tokens
    and speculation counts summed, the prompt counted once (as OpenAI's) or as ``prompt_tokens`` (a batch's)."""
    prompt = out.num_prompt_tokens if prompt_tokens is None else prompt_tokens
    stats = sum((o.stats for o in more), out.stats)
    completion = out.num_output_tokens + sum(o.num_output_tokens for o in more)
    speculation = SpeculationUsage(
        target_forwards=stats.target_forwards,
        drafted=stats.drafted,
        accepted=stats.accepted,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.tokens_per_forward,
    )
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        speculation=speculation,
    )
