"""DataParallelEngine: LLMEngine's offline interface over N replica processes (LLM(data_parallel_size=N)).

add_request / step / has_unfinished_requests / abort_request / stats work as LLMEngine's do (what
`tokenmill bench throughput` drives), except that step() returns the outputs that have arrived from
any replica, waiting for the first, and an abort's final output arrives through a later step().
run() is the batch path of LLM.generate / chat / beam_search: the whole batch split over the replicas
by estimated work, only final outputs sent back, results in prompt order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from tokenmill.engine.dp.front_end import DataParallelFrontEnd
from tokenmill.engine.dp.messages import ReplicaDied, ReplicaFatal, ReplicaUpdate
from tokenmill.engine.dp.routing import balanced_assignment, estimated_cost
from tokenmill.engine.engine import PromptInput
from tokenmill.errors import EngineDeadError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams


class DataParallelEngine(DataParallelFrontEnd):
    def __init__(self, config) -> None:
        super().__init__(config)
        self._pending: list[RequestOutput] = []  # outputs received with an error, handed out by the next step()
        self.num_outputs_made = 0  # outputs the replicas made, sent or not (a rate for progress bars)

    # -- LLMEngine's interface ------------------------------------------------------------------
    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        request_id = self.new_request_id(request_id)
        self.dispatch(prompt, params or SamplingParams(), request_id, stream=True)
        return request_id

    def add_beam_search_request(self, prompt: PromptInput, params: BeamSearchParams, request_id: str | None = None) -> str:
        request_id = self.new_request_id(request_id)
        self.dispatch(prompt, params, request_id, stream=False, beam_search=True)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Abort a request; unlike LLMEngine's, its final output comes through a later step()."""
        self.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """The outputs that have arrived from the replicas (waiting for the first while any request is out).

        Raises what a request's replica raised for it (InvalidRequestError, RequestFailedError), or
        EngineDeadError once a replica has died (its requests are forgotten); outputs that came with the
        error are returned by the next call."""
        if self._pending:
            outputs, self._pending = self._pending, []
            return outputs
        if not self.has_unfinished_requests():
            return []
        outputs: list[RequestOutput] = []
        errors: list[BaseException] = []
        while not outputs and not errors and self.has_unfinished_requests():
            for replica, message in self.pool.poll(timeout=None):
                if isinstance(message, ReplicaUpdate):
                    taken = self.take_update(replica, message)
                    self.num_outputs_made += message.num_outputs
                    outputs.extend(taken.outputs)
                    errors.extend(dict.fromkeys(taken.errors.values()))  # one error per failure, in order
                elif isinstance(message, (ReplicaDied, ReplicaFatal)):
                    reason = message.reason if isinstance(message, ReplicaDied) else f"its engine failed: {message.error!r}"
                    _, error = self.take_death(replica, reason)
                    errors.append(error)
        if errors:
            self._pending = outputs
            raise errors[0]
        return outputs

    # -- the batch path -------------------------------------------------------------------------
    def add_requests(self, prompts: Sequence[PromptInput], params: Sequence, *, beam_search: bool = False) -> list[str]:
        """Send a whole batch, split by estimated work (balanced_assignment), in prompt order per replica;
        only final outputs come back. All or nothing: if a send fails, the requests sent are aborted."""
        self.check_alive()
        costs = [estimated_cost(p, sp, self.max_model_len) for p, sp in zip(prompts, params)]
        assignment = balanced_assignment(costs, self.num_replicas)
        ids: list[str] = []
        try:
            for prompt, sp, replica in zip(prompts, params, assignment):
                request_id = self.new_request_id(None)
                self.dispatch(prompt, sp, request_id, stream=False, beam_search=beam_search, replica=replica)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:
                self.abort(request_id)
            raise
        return ids

    def run(self, prompts: list[PromptInput], params: list, use_tqdm: bool, beam_search: bool = False) -> list[RequestOutput]:
        """Every prompt to the end; the final outputs in prompt order (LLM._run's data-parallel path)."""
        ids = self.add_requests(prompts, params, beam_search=beam_search)
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        made_before = self.num_outputs_made
        try:
            with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True) as bar:
                while len(finished) < len(ids):
                    if not self.has_unfinished_requests():
                        raise EngineDeadError("the replicas lost requests of this batch")  # a bug: never wait forever
                    for output in self.step():
                        if output.finished and output.request_id in wanted:
                            finished[output.request_id] = output
                            bar.update(1)
                    elapsed = time.perf_counter() - start
                    rate = (self.num_outputs_made - made_before) / max(elapsed, 1e-9)
                    bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        except BaseException:
            # Interrupted (Ctrl-C, an error): leave no request holding blocks for the next call.
            for request_id in ids:
                self.abort(request_id)
            raise
        return [finished[i] for i in ids]
