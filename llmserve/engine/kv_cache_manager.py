"""Block tables of requests over the block pool: prefix lookup, allocation, caching, swap.

Check-then-act: `get_computed_blocks` only looks; `allocate_slots` either takes every
block a step needs or changes nothing.
"""

from __future__ import annotations

from llmserve.engine.block_pool import BlockKey, BlockPool, SwapPool
from llmserve.engine.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.swap_pool = SwapPool(num_cpu_blocks)
        self.req_blocks: dict[str, list[int]] = {}
        self.req_cpu_blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # full blocks already offered to the cache
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # -- prefix cache -------------------------------------------------------------------
    def _salt(self, req: Request) -> str | None | bool:
        """None: the global cache; a string: a private cache (a LoRA adapter's: two adapters
        never share KV blocks, nor an adapter and the base model); False: no caching."""
        if self.enable_prefix_caching:
            return req.lora_request.key if req.lora_request is not None else None
        if req.share_group is not None:  # n > 1 siblings (of one request, so of one adapter)
            return req.share_group
        return False

    def _block_keys(self, req: Request, num_full_blocks: int) -> list[BlockKey]:
        """The keys of the request's first `num_full_blocks` blocks (kept on the request:
        each block's key is made once)."""
        keys = req.block_hashes
        if len(keys) < num_full_blocks:
            self._extend_keys(req, num_full_blocks, self._salt(req))
        return keys[:num_full_blocks]

    def _extend_keys(self, req: Request, num_full_blocks: int, salt: str | None) -> None:
        keys = req.block_hashes
        bs = self.block_size
        tokens = req.all_token_ids
        for i in range(len(keys), num_full_blocks):
            parent = hash(keys[-1]) if keys else None
            keys.append(BlockKey(parent, tuple(tokens[i * bs : (i + 1) * bs]), salt))

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks holding the longest prefix of `req` (the last token is never
        served from cache: its logits are needed). Keys are made only up to the first
        miss (a fresh 7,680-token prompt makes one, not 480): the rest when its blocks
        are offered to the cache, after the step is launched."""
        salt = self._salt(req)
        if salt is False or req.prompt_logprobs is not None:  # (as vLLM: prompt logprobs need every prompt row)
            return []
        num_full = (req.num_tokens - 1) // self.block_size
        keys = req.block_hashes
        lookup = self.pool.lookup
        hits = []
        for i in range(num_full):
            if i == len(keys):
                self._extend_keys(req, i + 1, salt)
            block_id = lookup(keys[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (only the global cache is reported)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, req: Request) -> None:
        """Offer the request's computed full blocks to the prefix cache (only blocks whose
        tokens are all known: a token still on the device cannot be hashed yet)."""
        if self._salt(req) is False:
            return
        num_full = self._known_full_blocks(req)
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start:
            return  # no block filled up since the last call: the common case, kept cheap
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        num_full = min(num_full, len(blocks))
        keys = self._block_keys(req, num_full)
        for i in range(start, num_full):
            self.pool.register(blocks[i], keys[i])
        self._num_registered[req.request_id] = num_full

    def _known_full_blocks(self, req: Request) -> int:
        """The request's computed full blocks whose tokens are all known on the host."""
        return min(req.num_computed_tokens, req.num_known_tokens) // self.block_size

    def num_cached_blocks(self, req: Request) -> int:
        """How many of the request's blocks are registered in the prefix cache."""
        return self._num_registered.get(req.request_id, 0)

    # -- allocation -------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int, computed: list[int] = ()) -> int:
        """Free blocks this step would consume (new blocks plus free cached hits)."""
        have = len(self.req_blocks.get(req.request_id, ())) + len(computed)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        new = max(0, -(-total // self.block_size) - have)
        return new + sum(1 for b in computed if self.pool.is_free(b))

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[int] = (), reserve: int = 0) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens (after `computed` cache hits),
        keeping `reserve` blocks free. All or nothing."""
        if not computed:  # the common decode case: the last block still has room
            blocks = self.req_blocks.get(req.request_id)
            if blocks and req.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
                return True
        needed = self.blocks_needed(req, num_new_tokens, computed)
        if needed > self.pool.num_free - reserve:
            return False
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            self._num_registered[req.request_id] = len(blocks)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        missing = -(-total // self.block_size) - len(blocks)
        if missing > 0:
            blocks.extend(self.pool.allocate(missing))
        return True

    def free(self, req: Request) -> None:
        """Release the request's blocks; its tail blocks are evicted first."""
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))
        cpu_blocks = self.req_cpu_blocks.pop(req.request_id, None)
        if cpu_blocks:
            self.swap_pool.free(cpu_blocks)
        self._num_registered.pop(req.request_id, None)

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks[request_id]

    def num_allocated_blocks(self, request_id: str) -> int:
        blocks = self.req_blocks.get(request_id)
        return len(blocks) if blocks else 0

    # -- swap -------------------------------------------------------------------------
    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU swap blocks; None when swap space is short."""
        blocks = self.req_blocks.get(req.request_id, [])
        if not blocks or len(blocks) > self.swap_pool.num_free:
            return None
        cpu_blocks = self.swap_pool.allocate(len(blocks))
        mapping = list(zip(blocks, cpu_blocks))
        self.pool.free(reversed(self.req_blocks.pop(req.request_id)))
        self.req_cpu_blocks[req.request_id] = cpu_blocks
        self._num_registered.pop(req.request_id, None)
        return mapping

    def swap_in(self, req: Request, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped request's blocks back to the device; None when blocks are short."""
        cpu_blocks = self.req_cpu_blocks[req.request_id]
        if len(cpu_blocks) > self.pool.num_free - reserve:
            return None
        gpu_blocks = self.pool.allocate(len(cpu_blocks))
        self.req_blocks[req.request_id] = gpu_blocks
        self.swap_pool.free(self.req_cpu_blocks.pop(req.request_id))
        return list(zip(cpu_blocks, gpu_blocks))

    # -- stats ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_cache()
