"""INF²: batched decoding with the KV cache on storage (DESIGN.md §1), one module per job.

files: KVFile, one preallocated O_DIRECT file of token rows. store: KVShard, a shard's K/V files with the
delayed-writeback buffer, and split_pairs.
"""
from .files import IOCounters, KVFile
from .store import KVShard, KVView, SpillError, default_writeback, split_pairs

__all__ = ["IOCounters", "KVFile", "KVShard", "KVView", "SpillError", "default_writeback", "split_pairs"]
