"""The checks every request passes before it may reach the engine loop.

One function, used by the engine (offline API) and by the HTTP front end (so a bad request is
answered 4xx there and never crosses to the engine process).
"""

from __future__ import annotations

import math

from phaseflip.errors import ContextLengthError, InvalidRequestError
from phaseflip.sampling.params import SamplingParams


def kv_tokens_needed(prompt_len: int, max_new_tokens: int, page_size: int) -> int:
    """KV slots a request needs at most: prompt plus output, in whole pages."""
    return math.ceil((prompt_len + max_new_tokens) / page_size) * page_size


def validate_request(
    prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_context: int,
    max_logprobs: int, kv_capacity_tokens: int, page_size: int, build_grammar: bool = True,
) -> None:
    """Raises InvalidRequestError / ContextLengthError (naming the field) for anything the
    engine cannot run: an empty or out-of-vocabulary prompt, bad sampling parameters, more
    tokens than the context, or more KV than the whole pool. `build_grammar=False`: the
    grammar's shape only (`SamplingParams.validate`)."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    bad = [t for t in prompt_ids  # (a bool is an int to Python, never a token)
           if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}", "prompt")
    params.validate(vocab_size, max_logprobs, build_grammar)
    total = len(prompt_ids) + params.max_new_tokens
    if total > max_context:
        raise ContextLengthError(
            f"This model's maximum context length is {max_context} tokens, but {total} were "
            f"requested ({len(prompt_ids)} in the prompt, {params.max_new_tokens} to generate): "
            f"{total - max_context} too many. Shorten the prompt or lower max_new_tokens.",
            param="max_new_tokens")
    if kv_tokens_needed(len(prompt_ids), params.max_new_tokens, page_size) > kv_capacity_tokens:
        raise ContextLengthError(
            f"the request needs {total} tokens of KV cache but the pool holds only "
            f"{kv_capacity_tokens}; raise max_total_tokens/mem_fraction or shorten it",
            param="max_new_tokens")
