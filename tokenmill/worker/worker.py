"""Worker: one rank's models and KV caches (the target's runner, and the draft model's when speculative
decoding drafts with one), built from the engine's config.

Rank 0 lives in the engine's process and does everything the engine asks (the executor's calls).
With tensor parallelism each other rank runs `follow`: it waits for what rank 0 announces (a forward
pass, the logits of some rows, a KV cache to allocate or blocks to copy) and runs the same on its
shards, so the layers' collectives meet. Only rank 0 samples (the LM head gathers the logits there):
the other ranks need no request state at all, only each step's batch inputs (token ids of this step,
positions, slots, block tables), never token histories or sampling parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import psutil
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.communicator import TPCommunicator
from tokenmill.engine.messages import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from tokenmill.layers.quantization import get_quantization_config
from tokenmill.loader import ModelSource, build_model, load_model_source
from tokenmill.loader.eagle import load_eagle_head
from tokenmill.loader.medusa import load_medusa_heads
from tokenmill.worker.draft_proposer import DraftModelProposer
from tokenmill.worker.eagle_proposer import EagleProposer
from tokenmill.worker.medusa_proposer import MedusaProposer
from tokenmill.worker.model_runner import Followers, ModelRunner

logger = logging.getLogger(__name__)

_GiB = 1 << 30
_CPU_DEFAULT_KV_CAP = 4 * _GiB  # like vLLM's CPU backend default KV space (per rank)
_CPU_DEFAULT_FRACTION = 0.25
_GPU_DEFAULT_FRACTION = 0.9


@dataclass
class WorkerSpec:
    """What a rank builds its models from (picklable: sent to spawned ranks)."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int


class Worker:
    def __init__(self, spec: WorkerSpec, comm: TPCommunicator | None = None, source: ModelSource | None = None) -> None:
        """source: the target's, when the caller has loaded it already (rank 0 in the engine's process)."""
        self.spec = spec
        self.comm = comm or TPCommunicator()
        config = spec.config
        if source is None:
            source = load_model_source(ModelConfig(**{**vars(config.model), "skip_tokenizer_init": True}))
        followers = Followers(self.comm) if self.comm.size > 1 and self.comm.is_driver else None
        quant = get_quantization_config(config.model.quantization, config.model.quantization_options, spec.device, spec.dtype,
                                        source.hf_config)
        model = build_model(source, spec.device, spec.dtype, spec.max_model_len, quant, self.comm)
        # One rank: the target's weights move into huge pages in the background (the first token does not wait
        # for it); with tensor parallelism every rank moves its shard before its first pass, as the ranks start together.
        self.runner = ModelRunner(model, spec.device, spec.dtype, config.cache.block_size, followers, "target",
                                  config.cache.kv_cache_dtype, config.cache.cascade_attention, defer_weight_move=self.comm.size == 1)
        self.drafter = self._make_drafter(source, followers)

    def _make_drafter(self, source: ModelSource, followers: Followers | None) -> DraftModelProposer | MedusaProposer | EagleProposer | None:
        """The proposer that drafts on this side: the draft_model proposer's model, built beside the
        target's ("self" is the target's own weights under the draft's quantization), or Medusa heads
        reading the target's hidden states (on rank 0: only rank 0 samples), or an EAGLE head."""
        spec, draft = self.spec, self.spec.config.speculative
        if draft is None or draft.method not in ("draft_model", "medusa", "eagle"):
            return None
        if draft.method == "eagle":
            if self.comm.size > 1:
                raise ValueError('speculative method "eagle" runs without tensor parallelism (tensor_parallel_size 1)')
            head = load_eagle_head(draft.model, source.hf_config, spec.device, spec.dtype, spec.max_model_len, draft.quantization)
            runner = ModelRunner(head, spec.device, spec.dtype, spec.config.cache.block_size, None, "eagle",
                                 spec.config.cache.kv_cache_dtype, spec.config.cache.cascade_attention)
            proposer = EagleProposer(head, self.runner.model, runner, draft.num_speculative_tokens, draft.token_tree(),
                                     draft.min_draft_probability, draft.stop_draft_probability)
            self.runner.hidden_observer = proposer.observe
            return proposer
        if draft.method == "medusa":
            if not self.comm.is_driver:
                return None
            heads = load_medusa_heads(draft.model, int(source.hf_config.hidden_size), int(source.hf_config.vocab_size),
                                      spec.device, spec.dtype)
            proposer = MedusaProposer(heads, draft.num_speculative_tokens, draft.token_tree())
            if heads.shared_lm_head:  # the heads' rows ride along the target's logits matmul
                self.runner.extra_logits_rows = proposer.logits_rows
                self.runner.extra_logits_observer = proposer.observe_logits
            else:
                self.runner.hidden_observer = proposer.observe
            return proposer
        draft_source = source
        if draft.model != "self":
            draft_source = load_model_source(ModelConfig(model=draft.model, skip_tokenizer_init=True))
            draft_vocab, vocab = int(draft_source.hf_config.vocab_size), int(source.hf_config.vocab_size)
            if draft_vocab != vocab:
                raise ValueError(f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's ({vocab}): "
                                 "a draft model must share the target's tokenizer")
            draft_max = draft_source.context_length
            if draft_max < spec.max_model_len:
                raise ValueError(f"the draft model's context ({draft_max} tokens) is shorter than max_model_len ({spec.max_model_len}); "
                                 "lower max_model_len")
        quant = get_quantization_config(draft.quantization, draft.quantization_options, spec.device, spec.dtype,
                                        draft_source.hf_config)
        model = build_model(draft_source, spec.device, spec.dtype, spec.max_model_len, quant, self.comm)
        # "self": the target's own layers, quantized, so the draft reads the target's KV cache (exact, where
        # the target has computed it) and writes only this step's slots, which the target's pass rewrites.
        return DraftModelProposer(ModelRunner(model, spec.device, spec.dtype, spec.config.cache.block_size, followers, "draft",
                                                   spec.config.cache.kv_cache_dtype, spec.config.cache.cascade_attention),
                                  shares_target_kv=draft.model == "self")

    def _runners(self) -> dict[str, ModelRunner]:
        """The models this rank runs: the target's, and a draft's or an EAGLE head's."""
        runners = {"target": self.runner}
        if isinstance(self.drafter, (DraftModelProposer, EagleProposer)):
            runners["draft"] = self.drafter.runner
        return runners

    def _kv_owners(self) -> list[ModelRunner]:
        """The runners with a KV cache of their own (a "self" draft shares the target's)."""
        return [r for name, r in self._runners().items() if name == "target" or not self._draft_shares_kv()]

    def _draft_shares_kv(self) -> bool:
        return isinstance(self.drafter, DraftModelProposer) and self.drafter.shares_target_kv

    def _share_draft_kv(self) -> None:
        if self._draft_shares_kv():
            self.drafter.runner.share_kv_cache(self.runner)

    def idle(self) -> None:
        """Between steps, with none to run: the target's weights onto their huge-page copy once it is made
        (else both copies stay in memory until the next step)."""
        self.runner.weight_move.repoint_if_copied()

    def finish_weight_move(self) -> None:
        """The target's weights in huge pages now (the benchmarks, before timing)."""
        self.runner.finish_weight_move()

    def kv_prefaults(self) -> list:
        """Each KV cache's prefault on this rank (worker/cpu_memory.py's KVPrefault): the target's, and a draft's."""
        return [runner.kv_prefault for runner in self._kv_owners()]

    # -- the executor's calls -------------------------------------------------------------------
    def num_kv_blocks(self) -> int:
        """The KV blocks this rank can hold (both caches, with a draft model) within its budget."""
        config, spec = self.spec.config, self.spec
        cache = config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = sum(r.kv_bytes_per_block() for r in self._kv_owners())
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif spec.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(spec.device)
            budget = int(free * (cache.memory_fraction or _GPU_DEFAULT_FRACTION))
        else:
            available = psutil.virtual_memory().available
            if cache.memory_fraction is not None:
                budget = int(available * cache.memory_fraction)
            else:
                budget = min(int(available * _CPU_DEFAULT_FRACTION), _CPU_DEFAULT_KV_CAP)
            budget = int(budget * cache.memory_share)  # data-parallel replicas split one machine's budget
        # No point holding more than every sequence at full length could use.
        useful = -(-spec.max_model_len // cache.block_size) * config.scheduler.max_num_seqs + 1
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 2:
            raise ValueError(f"the KV cache budget of {budget} bytes holds fewer than 2 blocks of {per_block} bytes; raise kv_cache_memory")
        return int(num_blocks)

    def init_kv_cache(self, num_blocks: int) -> None:
        for runner in self._kv_owners():  # the same block ids: the draft's KV lives where the target's does
            runner.allocate_kv_cache(num_blocks)
        self._share_draft_kv()

    def prepare_step(self, scheduled: SchedulerOutput) -> None:
        """Before the step's forward pass: copy-on-write copies, and the draft model's drafts written into
        the slots the scheduler reserved for them."""
        for runner in self._kv_owners():
            runner.copy_blocks(scheduled.block_copies)
        if self.drafter is not None:
            self.drafter.forget(scheduled.preempted_request_ids)
            self.drafter.fill(scheduled.chunks)

    def execute_model(self, chunks: list[ScheduledChunk], grammar_bitmask: torch.Tensor | None = None) -> ModelRunnerOutput:
        return self.runner.execute(chunks, grammar_bitmask=grammar_bitmask)

    def forget(self, request_ids: Iterable[str]) -> None:
        if self.drafter is not None:
            self.drafter.forget(request_ids)

    def keep_only(self, request_ids: Collection[str]) -> None:
        if self.drafter is not None:
            self.drafter.keep_only(request_ids)

    # -- the other ranks ------------------------------------------------------------------------
    @torch.inference_mode()
    def follow(self) -> None:
        """Run what rank 0 announces, until it says stop (ranks > 0)."""
        runners = self._runners()
        hidden: dict[str, torch.Tensor] = {}
        device = self.spec.device
        while True:
            op, *args = self.comm.broadcast_object()
            if op == "stop":
                return
            if op == "num_kv_blocks":
                self.comm.min_int(self.num_kv_blocks())
                continue
            name, *args = args
            runner = runners[name]
            if op == "forward":
                batch = args[0] if device.type == "cpu" else args[0].to(device)
                hidden[name] = runner.model(batch.input_ids, batch.positions, batch)
            elif op == "logits":
                rows, extra = args
                selected = hidden[name][rows.to(device)]
                runner.model.compute_logits(selected if extra is None else torch.cat([selected, extra.to(device, selected.dtype)]))
            elif op == "init_kv":
                runner.allocate_kv_cache(args[0])
                if name == "target":
                    self._share_draft_kv()
            elif op == "copy_blocks":
                runner.copy_blocks(args[0])
            elif op == "move_kv":
                runner.move_kv(*args)
            else:
                raise RuntimeError(f"unknown operation {op!r} from rank 0")
