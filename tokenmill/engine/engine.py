"""LLMEngine: add requests, step, get outputs. The one loop everything else drives."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch

from tokenmill.config import EngineConfig, resolve_device, resolve_dtype
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.kv_cache import BlockPool, KVCacheManager, cdiv
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler
from tokenmill.errors import InvalidRequestError, PromptTooLongError
from tokenmill.loader import build_model, load_model_source
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GiB = 1 << 30
_CPU_DEFAULT_KV_CAP = 4 * _GiB  # like vLLM's CPU backend default KV space
_CPU_DEFAULT_FRACTION = 0.25
_GPU_DEFAULT_FRACTION = 0.9

PromptInput = str | Sequence[int] | dict


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        source = load_model_source(config.model)
        self.model_name = source.name
        self.hf_config = source.hf_config
        self.tokenizer = source.tokenizer
        self.eos_token_ids = frozenset(source.eos_token_ids)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.dtype = resolve_dtype(config.model.dtype, self.device, source.checkpoint_dtype)

        model_max = getattr(self.hf_config, "max_position_embeddings", None) or getattr(self.hf_config, "n_positions")
        max_model_len = config.model.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {model_max}")

        model = build_model(source, self.device, self.dtype, max_model_len)
        block_size = config.cache.block_size
        self.runner = ModelRunner(model, self.device, self.dtype, block_size)
        num_blocks = self._num_kv_blocks(max_model_len)
        self.runner.allocate_kv_cache(num_blocks)

        capacity = (num_blocks - 1) * block_size
        if capacity < max_model_len:
            if config.model.max_model_len is not None:
                raise ValueError(
                    f"max_model_len {max_model_len} needs more KV cache than the {capacity} tokens allocated; "
                    "raise kv_cache_memory or lower max_model_len"
                )
            logger.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity, max_model_len)
            max_model_len = capacity
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({sched.max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len})"
            )
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(sched, KVCacheManager(BlockPool(num_blocks), block_size))
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._rng = random.Random(config.model.seed)
        self._ids = itertools.count()
        logger.info(
            "loaded %s (%s, %s on %s); KV cache: %d blocks of %d tokens",
            self.model_name, self.hf_config.architectures[0], self.dtype, self.device, num_blocks, block_size,
        )

    def _num_kv_blocks(self, max_model_len: int) -> int:
        cache = self.config.cache
        per_block = self.runner.kv_bytes_per_block()
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * (cache.memory_fraction or _GPU_DEFAULT_FRACTION))
        else:
            available = psutil.virtual_memory().available
            if cache.memory_fraction is not None:
                budget = int(available * cache.memory_fraction)
            else:
                budget = min(int(available * _CPU_DEFAULT_FRACTION), _CPU_DEFAULT_KV_CAP)
        # No point holding more than every sequence at full length could use.
        useful = cdiv(max_model_len, cache.block_size) * self.config.scheduler.max_num_seqs + 1
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 2:
            raise ValueError(f"the KV cache budget of {budget} bytes holds fewer than 2 blocks of {per_block} bytes; raise kv_cache_memory")
        return int(num_blocks)

    # -- requests ---------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model was loaded without a tokenizer: give prompt_token_ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        return None, self._check_token_ids(prompt)

    def _check_token_ids(self, token_ids) -> list[int]:
        try:
            ids = [int(t) for t in token_ids]
        except (TypeError, ValueError):
            raise InvalidRequestError("prompt_token_ids must be a list of integers") from None
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        _reject_unimplemented(params)
        text, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens, but the context length is {self.max_model_len} "
                "tokens, which must also hold at least one generated token"
            )
        request_id = str(next(self._ids)) if request_id is None else request_id
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            sampling_seed=seed,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            prompt=text,
        )
        self.scheduler.add_request(request)
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        output = self._make_output(request)
        self._detokenizers.pop(request_id, None)
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        pool = self.scheduler.kv_cache.pool
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=pool.usage(),
            num_free_blocks=pool.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
        )

    # -- the loop ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, and return an output for each request that got a token."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self.scheduler.num_waiting and not self.scheduler.num_running:
                # Every request fits the cache alone (max_model_len <= capacity), so this is a bug, not a wait.
                raise RuntimeError("the scheduler could not admit any waiting request into an empty batch")
            return []
        sampled = self.runner.execute(scheduled.chunks)
        updated, _ = self.scheduler.update(scheduled, sampled)
        outputs = []
        for request in updated:
            detok = self._detokenizers.get(request.request_id)
            if detok is not None:
                detok.add_token(request.output_token_ids[-1])
            outputs.append(self._make_output(request))
            if request.is_finished:
                self._detokenizers.pop(request.request_id, None)
        return outputs

    def _make_output(self, request: Request) -> RequestOutput:
        detok = self._detokenizers.get(request.request_id)
        completion = CompletionOutput(
            index=0,
            text=detok.text if detok is not None else "",
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
        )


def _reject_unimplemented(params: SamplingParams) -> None:
    """Parameters that validate but have no implementation yet are refused, never silently ignored."""
    unimplemented = {
        "n > 1 / best_of": params.num_sequences > 1,
        "presence_penalty / frequency_penalty / repetition_penalty": bool(
            params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
        ),
        "logit_bias": bool(params.logit_bias),
        "allowed_token_ids": params.allowed_token_ids is not None,
        "bad_words": bool(params.bad_words),
        "logprobs": params.logprobs is not None,
        "prompt_logprobs": params.prompt_logprobs is not None,
        "stop": bool(params.stop),
        "structured_outputs": params.structured_outputs is not None,
    }
    missing = [name for name, used in unimplemented.items() if used]
    if missing:
        raise InvalidRequestError(f"not supported yet: {', '.join(missing)}")
