from specserve.runtime.mem_cache.allocator import OutOfSlotsError, TokenSlotAllocator
from specserve.runtime.mem_cache.kv_pool import KVPool
from specserve.runtime.mem_cache.req_table import ReqToTokenTable

__all__ = ["KVPool", "OutOfSlotsError", "ReqToTokenTable", "TokenSlotAllocator"]
