"""INF²: batched decoding with the KV cache on storage (docs/design.md §1), one module per job.

files: KVFile, one preallocated O_DIRECT file of token rows. store: KVShard, one shard's K/V files with the
delayed-writeback buffer. attention: ShardAttention, block-wise attention over a shard (what runs near storage).
worker: the shard worker process and its shared-memory channel. near_storage: NearStorageAttention, the host side.
traffic: byte counters per layer, step and shard. link: token-bucket bandwidth emulation. baseline:
HostKVAttention, FlexGen-style host attention over the same store. xcache: XCacheAttention and choose_alpha.
hf: Hugging Face Llama-family / OPT models generating with their KV on storage.
"""

from flashllm_ext.kv.attention import ShardAttention
from flashllm_ext.kv.baseline import HostKVAttention
from flashllm_ext.kv.files import IOCounters, KVFile
from flashllm_ext.kv.link import Link
from flashllm_ext.kv.near_storage import NearStorageAttention
from flashllm_ext.kv.store import KVShard, KVView, ShardInUseError, SpillError, default_writeback, split_pairs
from flashllm_ext.kv.traffic import PREFILL, Traffic, TrafficLog
from flashllm_ext.kv.worker import LocalShard, ShardSpec, ShardWorker, WorkerError
from flashllm_ext.kv.xcache import AlphaChoice, XCacheAttention, choose_alpha, linear_projector

__all__ = [
    "AlphaChoice",
    "HostKVAttention",
    "IOCounters",
    "KVFile",
    "KVShard",
    "KVView",
    "Link",
    "LocalShard",
    "NearStorageAttention",
    "PREFILL",
    "ShardAttention",
    "ShardInUseError",
    "ShardSpec",
    "ShardWorker",
    "SpillError",
    "Traffic",
    "TrafficLog",
    "WorkerError",
    "XCacheAttention",
    "choose_alpha",
    "default_writeback",
    "linear_projector",
    "split_pairs",
]
