"""LLM: the offline facade, vLLM's API (generate / chat) over LLMEngine, with a tqdm progress bar."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.dp.engine import DataParallelEngine
from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """LLM(model=None) loads the embedded default model (SmolLM2-135M-Instruct).

    Keyword arguments are the engine's settings: dtype, max_model_len, block_size,
    kv_cache_memory, kv_cache_dtype, memory_fraction, num_kv_blocks, max_num_batched_tokens, max_num_seqs,
    enable_chunked_prefill, device, seed, tokenizer, skip_tokenizer_init, quantization,
    quantization_options, tensor_parallel_size, data_parallel_size.

    data_parallel_size=N runs N engine replicas, each a process with its share of the cores; a batch
    is split over them by estimated work, and the outputs come back in prompt order. (Replicas are
    spawned processes: a script that makes one needs the `if __name__ == "__main__":` guard.)
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.llm_engine = _make_engine(EngineConfig.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """An LLM on an engine built from a whole EngineConfig (the command line's spelling)."""
        llm = cls.__new__(cls)
        llm.llm_engine = _make_engine(config)
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        inputs = _normalize_prompts(prompts, prompt_token_ids)
        return self._run(inputs, _per_prompt_params(sampling_params, len(inputs)), use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or several."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer, and this model was loaded without one")
        if not tokenizer.chat_template and chat_template is None:
            raise InvalidRequestError("this model has no chat template; pass chat_template=... or use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptInput] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            # The template already holds the special tokens (BOS and the like): don't add them twice.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self._run(prompts, _per_prompt_params(sampling_params, len(prompts)), use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search, as vLLM's LLM.beam_search: one BeamSearchOutput per prompt, in prompt order, each with
        the beam_width best sequences (best first; tokens and text include the prompt)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search needs BeamSearchParams, got {type(params).__name__}")
        inputs = _normalize_prompts(prompts, None)
        outputs = self._run(inputs, [params] * len(inputs), use_tqdm, beam_search=True)
        tokenizer = self.get_tokenizer()
        results = []
        for out in outputs:
            sequences = []
            for c in out.outputs:
                tokens = list(out.prompt_token_ids) + list(c.token_ids)
                sequences.append(
                    BeamSearchSequence(
                        tokens=tokens,
                        cum_logprob=c.cumulative_logprob,
                        text=tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
            results.append(BeamSearchOutput(sequences=sequences))
        return results

    def _run(self, prompts: list[PromptInput], params: list, use_tqdm: bool, beam_search: bool = False) -> list[RequestOutput]:
        engine = self.llm_engine
        if isinstance(engine, DataParallelEngine):
            return engine.run(prompts, params, use_tqdm, beam_search=beam_search)
        add_request = engine.add_beam_search_request if beam_search else engine.add_request
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(add_request(prompt, p))
        except Exception:
            for request_id in ids:  # all or nothing: a bad prompt leaves no request behind
                engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        generated = 0
        try:
            with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        generated += 1
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"output {generated / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
        except BaseException:
            # Interrupted (Ctrl-C, an error): leave no request holding blocks for the next call.
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]


def _make_engine(config: EngineConfig) -> LLMEngine | DataParallelEngine:
    """One engine, or N replicas behind a data-parallel front end."""
    if config.parallel.data_parallel_size > 1:
        return DataParallelEngine(config)
    return LLMEngine(config)


def _normalize_prompts(prompts, prompt_token_ids) -> list[PromptInput]:
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("give either prompts or prompt_token_ids, not both")
    if prompt_token_ids is not None:
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        return [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
    if prompts is None:
        raise ValueError("generate() needs prompts or prompt_token_ids")
    if isinstance(prompts, (str, dict)):
        return [prompts]
    return list(prompts)


def _per_prompt_params(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one, or one per prompt")
    return params
