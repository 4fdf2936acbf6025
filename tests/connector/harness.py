"""A real vLLM Scheduler on CPU with KvtagConnector, and a CPU "model runner" that drives its worker half.

Built the way vLLM's own connector unit tests build theirs (tests/v1/kv_connector/unit/utils.py):
VllmConfig with DeviceConfig("cpu"), a hand-made KVCacheConfig, Scheduler(...).schedule() /
update_from_output(). Nothing of vLLM or the store is mocked: the worker half is the real connector
class with role WORKER, copying real CPU tensors that this runner fills the way an engine would.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvtag_client.connector import KvtagConnector
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

EOS = 2
ATTN_LAYERS = ("model.layers.0.self_attn.attn", "drafter.layers.0.self_attn.attn")
TARGET_LAYER, DRAFTER_LAYER = ATTN_LAYERS
MAMBA_LAYER = "model.layers.1.linear_attn"
HEADS, HEAD_SIZE = 2, 8
MAMBA_STATE = (4, 8)


def llama_dir(root: Path) -> Path:
    """A model dir with only config.json: enough for ModelConfig(skip_tokenizer_init=True)."""
    path = root / "tiny-llama"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": HEADS,
                "num_hidden_layers": 1,
                "vocab_size": 32000,
                "max_position_embeddings": 4096,
                "torch_dtype": "float32",
                "bos_token_id": 1,
                "eos_token_id": EOS,
            }
        )
    )
    return path


def qwen3_next_dir(root: Path) -> Path:
    path = root / "tiny-qwen3-next"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3NextForCausalLM"],
                "model_type": "qwen3_next",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": HEADS,
                "head_dim": HEAD_SIZE,
                "num_hidden_layers": 2,
                "layer_types": ["linear_attention", "full_attention"],
                "full_attention_interval": 2,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 2,
                "num_experts": 0,
                "decoder_sparse_step": 1,
                "vocab_size": 32000,
                "max_position_embeddings": 4096,
                "torch_dtype": "float32",
                "eos_token_id": EOS,
            }
        )
    )
    return path


@dataclass
class Setup:
    """What one engine config is made of; `build()` gives a scheduler, a worker connector and tensors."""

    model_dir: Path
    endpoint: str
    block_size: int = 16
    extra: dict[str, Any] = field(default_factory=dict)
    eagle_dir: Path | None = None
    hybrid: bool = False
    prefix_match_unit: int | None = None
    num_blocks: int = 64
    max_num_batched_tokens: int = 512
    multi_with: list[dict[str, Any]] | None = None
    kv_role: str = "kv_both"
    hash_algo: str = "sha256"

    def vllm_config(self) -> VllmConfig:
        model_config = ModelConfig(
            model=str(self.model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=4096
        )
        # Each step waits for its Lookups, so a test's step sees their answers even on a loaded
        # machine; test_lookup_wait runs the default budget against a store that does not answer.
        extra = {"endpoint": self.endpoint, "lookup_wait_ms": 60_000, **self.extra}
        if self.multi_with is not None:
            connectors = [
                {
                    "kv_connector": "KvtagConnector",
                    "kv_connector_module_path": "kvtag_client.connector",
                    "kv_role": self.kv_role,
                    "kv_connector_extra_config": extra,
                },
                *self.multi_with,
            ]
            transfer = KVTransferConfig(
                kv_connector="MultiConnector",
                kv_role=self.kv_role,
                kv_connector_extra_config={"connectors": connectors},
            )
        else:
            transfer = KVTransferConfig(
                kv_connector="KvtagConnector",
                kv_connector_module_path="kvtag_client.connector",
                kv_role=self.kv_role,
                kv_connector_extra_config=extra,
            )
        cache = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=True,
            prefix_caching_hash_algo=self.hash_algo,
            **({"mamba_cache_mode": "align"} if self.hybrid else {}),
            **({"prefix_match_unit": self.prefix_match_unit} if self.prefix_match_unit else {}),
        )
        scheduler = SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
        parallel = None
        speculative = None
        vc = VllmConfig(
            model_config=model_config,
            cache_config=cache,
            scheduler_config=scheduler,
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )
        if self.eagle_dir is not None:
            parallel = vc.parallel_config
            speculative = SpeculativeConfig(
                method="eagle",
                model=str(self.eagle_dir),
                num_speculative_tokens=2,
                target_model_config=model_config,
                target_parallel_config=parallel,
            )
            vc = VllmConfig(
                model_config=model_config,
                cache_config=cache,
                scheduler_config=scheduler,
                kv_transfer_config=transfer,
                device_config=DeviceConfig("cpu"),
                speculative_config=speculative,
            )
        return vc

    def kv_cache_config(self, vc: VllmConfig) -> KVCacheConfig:
        attn = FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )
        groups = [KVCacheGroupSpec(list(ATTN_LAYERS), attn)]
        if self.hybrid:
            mamba = MambaSpec(
                block_size=self.block_size,
                shapes=(MAMBA_STATE,),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
                page_size_padded=attn.page_size_bytes,
            )
            groups.append(KVCacheGroupSpec([MAMBA_LAYER], mamba))
        return KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)

    def resolved(self) -> tuple[VllmConfig, KVCacheConfig, int, int]:
        """The configs with the block sizes resolved the way EngineCore does, before the connector (built
        by the Scheduler) reads them: (vllm config, KV cache config, block size, hash block size)."""
        vc = self.vllm_config()
        kvc = self.kv_cache_config(vc)
        vc.cache_config.num_gpu_blocks = self.num_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kvc, vc)
        kvc.hash_block_size = hash_block_size
        kvc.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            kvc, vc, block_size, hash_block_size
        )
        return vc, kvc, block_size, hash_block_size

    def scheduler(self) -> tuple[Any, Any, Scheduler, int, int]:
        """(VllmConfig, KVCacheConfig, the real Scheduler over them, block size, hash block size)."""
        vc, kvc, block_size, hash_block_size = self.resolved()
        scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=kvc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        return vc, kvc, scheduler, block_size, hash_block_size

    def build(self) -> Engine:
        vc, kvc, scheduler, block_size, hash_block_size = self.scheduler()
        worker = _build_worker(vc, kvc, self.multi_with is not None)
        return Engine(vc, kvc, scheduler, worker, block_size, hash_block_size, self.hybrid)


def _build_worker(vc: VllmConfig, kvc: KVCacheConfig, multi: bool) -> Any:
    if multi:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

        return MultiConnector(vc, KVConnectorRole.WORKER, kvc)
    return KvtagConnector(vc, KVConnectorRole.WORKER, kvc)


def engine_block_hasher(vc: VllmConfig, hash_block_size: int) -> Any:
    """The block hasher EngineCore gives requests: with num_hash_lookahead_tokens where vLLM has it."""
    lookahead = int(getattr(vc, "num_hash_lookahead_tokens", 0) or 0)
    if lookahead:
        return get_request_block_hasher(hash_block_size, sha256, lookahead)
    return get_request_block_hasher(hash_block_size, sha256)


def _req_index_field(req_ids: list[str]) -> dict[str, Any]:
    """ModelRunnerOutput's req_id_to_index where it still has one (0.32/0.33; gone in 0.34)."""
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        return {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
    return {}


def position_value(tokens: Sequence[int], position: int, layer: int) -> float:
    """A layer's KV at `position`: a function of the prefix (the drafter's also of the next token)."""
    acc = 0
    for i in range(position + 1):
        acc = (acc * 31 + tokens[i] + 7) % 1_000_003
    if layer == 1:  # the drafter reads the token after the position
        acc = (acc * 17 + tokens[position + 1] + 3) % 1_000_003
    return float(acc % 65_521) + 0.25 * layer


def state_value(tokens: Sequence[int], upto: int) -> float:
    acc = 11
    for i in range(upto):
        acc = (acc * 131 + tokens[i]) % 1_000_003
    return float(acc % 65_521)


class Engine:
    """Steps a real Scheduler and runs the connector's worker half on CPU tensors in engine order."""

    def __init__(
        self,
        vc: VllmConfig,
        kvc: KVCacheConfig,
        scheduler: Scheduler,
        worker: Any,
        block_size: int,
        hash_block_size: int,
        hybrid: bool,
    ) -> None:
        self.vc, self.kvc, self.scheduler, self.worker = vc, kvc, scheduler, worker
        self.block_size, self.hash_block_size, self.hybrid = block_size, hash_block_size, hybrid
        n = kvc.num_blocks
        self.kv = {name: torch.zeros(2, n, block_size, HEADS, HEAD_SIZE) for name in ATTN_LAYERS}
        caches: dict[str, Any] = dict(self.kv)
        if hybrid:
            self.state = torch.zeros(n, *MAMBA_STATE)
            caches[MAMBA_LAYER] = [self.state]
        worker.register_kv_caches(caches)
        self.requests: dict[str, Request] = {}
        self.sampled: dict[str, list[int]] = {}
        self.next_token = 1000
        self.outputs: list[Any] = []
        self.finished_sending_log: list[set[str]] = []
        self.finished_recving_log: list[set[str]] = []
        self.step_log: list[dict[str, Any]] = []
        # req_id -> {block_id: index in the request's group-0 block table}, for tracked requests.
        self.block_index: dict[str, dict[int, int]] = {}
        # No attention layers run here: a sibling connector (ExampleConnector) finds nothing to inject.
        self.forward_context = SimpleNamespace(attn_metadata={}, no_compile_layers={})
        # Called after the target forward (and a post-forward start_load_kv), before the drafter's.
        self.between_forwards: Callable[[Any], None] | None = None

    @property
    def connector(self) -> KvtagConnector:
        conn = self.scheduler.connector
        if isinstance(conn, KvtagConnector):
            return conn
        return next(c for c in conn._connectors if isinstance(c, KvtagConnector))

    @property
    def worker_connector(self) -> KvtagConnector:
        if isinstance(self.worker, KvtagConnector):
            return self.worker
        return next(c for c in self.worker._connectors if isinstance(c, KvtagConnector))

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int = 4, **kwargs: Any) -> Request:
        request = self.make_request(req_id, prompt, max_tokens, **kwargs)
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def external_hit(self, req_id: str, prompt: Sequence[int]) -> int:
        """What the connector reports for a prompt with no local hit, without scheduling it."""
        hit, _ = self.connector.get_num_new_matched_tokens(self.make_request(req_id, prompt, 1), 0)
        assert hit is not None
        return hit

    def make_request(
        self,
        req_id: str,
        prompt: Sequence[int],
        max_tokens: int = 4,
        skip_reading_prefix_cache: bool = False,
        **kwargs: Any,
    ) -> Request:
        """A request hashed as EngineCore hashes it: with the core's lookahead (0.34+ when the connector
        opted in; 0 before)."""
        init_none_hash(sha256)
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            **({"skip_reading_prefix_cache": True} if skip_reading_prefix_cache else {}),
        )
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=engine_block_hasher(self.vc, self.hash_block_size),
            **kwargs,
        )
        return request

    def track_blocks(self, req_id: str) -> None:
        self.block_index[req_id] = {}

    def _record_blocks(self) -> None:
        for req_id, index in self.block_index.items():
            if req_id in self.scheduler.requests:
                for i, block in enumerate(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]):
                    index.setdefault(block, i)

    def sample_for(self, req_id: str) -> int:
        self.next_token += 1
        return self.next_token

    # The engine's order inside one step: sync loads, target forward, [start_load_kv if no sync
    # loads], drafter forward, wait_for_save, get_finished.
    def step(self) -> Any:
        out = self.scheduler.schedule()
        self._record_blocks()
        meta = out.kv_connector_metadata
        req_ids = list(out.num_scheduled_tokens)
        # Draw this step's samples first: the drafter reads them for the last position.
        samples = {
            r: self.sample_for(r)
            for r in req_ids
            if self.requests[r].num_computed_tokens >= self.requests[r].num_prompt_tokens
        }
        w = self.worker
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            w.start_load_kv(self.forward_context)
        self._forward(out, 0, samples)
        if not out.has_sync_kv_loads:
            w.start_load_kv(self.forward_context)
        if self.between_forwards is not None:
            self.between_forwards(out)
        self._forward(out, 1, samples)
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()
        w.clear_connector_metadata()
        self.finished_sending_log.append(set(results.finished_sending))
        self.finished_recving_log.append(set(results.finished_recving))
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            **_req_index_field(req_ids),
            sampled_token_ids=[[samples[r]] if r in samples else [] for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=KVConnectorOutput(
                finished_sending=set(results.finished_sending) or None,
                finished_recving=set(results.finished_recving) or None,
                failed_recving=set(results.failed_recving),
                invalid_block_ids=errors,
                kv_connector_stats=stats,
            ),
        )
        self.step_log.append({"scheduled": dict(out.num_scheduled_tokens), "meta": meta, "samples": samples})
        self.outputs.append(self.scheduler.update_from_output(out, mro))
        return out

    def _forward(self, out: Any, layer: int, samples: dict[str, int]) -> None:
        """Write this step's KV (target layer 0, drafter layer 1) and Mamba states into the tensors."""
        name = ATTN_LAYERS[layer]
        for req_id, count in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            end = req.num_computed_tokens  # advanced by `count` at schedule time
            start = end - count
            tokens = list(req.all_token_ids)
            if req_id in samples:
                tokens.append(samples[req_id])
            ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for pos in range(start, end):
                block = ids[0][pos // self.block_size]
                self.kv[name][:, block, pos % self.block_size] = position_value(tokens, pos, layer)
            if self.hybrid and layer == 0 and end > start:
                slot = (end - 1) // self.block_size
                self.state[ids[1][slot]] = state_value(tokens, end)

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("scheduler did not drain")

    def expected_block(self, tokens: Sequence[int], block: int) -> dict[str, torch.Tensor]:
        """The final contents of a request's block `block` for each attention layer."""
        result = {}
        for layer, name in enumerate(ATTN_LAYERS):
            t = torch.zeros(2, self.block_size, HEADS, HEAD_SIZE)
            for i in range(self.block_size):
                pos = block * self.block_size + i
                t[:, i] = position_value(tokens, pos, layer)
            result[name] = t
        return result

    def step_log_samples(self, req_id: str) -> list[int]:
        """Tokens sampled for a request, in order."""
        return [entry["samples"][req_id] for entry in self.step_log if req_id in entry["samples"]]

    def drain_saves(self, timeout: float = 10.0) -> None:
        """Wait until the worker's background saver has put everything it accepted."""
        worker = self.worker_connector._worker
        assert worker is not None
        assert worker.saver.wait_idle(timeout), "background saves did not finish"

    def shutdown(self) -> None:
        self.worker.shutdown()
        conn = self.scheduler.connector
        if conn is not None:
            conn.shutdown()


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No leaked requests or blocks: what vLLM's own connector tests check after a run."""
    assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
    assert not scheduler.waiting and not scheduler.running
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not manager.req_to_blocks, f"blocks still held: {dict(manager.req_to_blocks)}"
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])
