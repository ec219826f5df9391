"""Block tables of requests over the block pool: prefix lookup, allocation, caching, swap (to swap
space, or with the host tier on, to host blocks it reserves), the tiers' moves.

Check-then-act: `get_computed_blocks` only looks; `allocate_slots` either takes every
block a step needs or changes nothing.

With several KV groups (engine/kv_layout.py) a request's list interleaves the groups' ids of
each logical block, and a sliding group's blocks wholly before its window are released (their
entries become NULL_BLOCK) when a step starts past them. Each group's blocks enter the prefix
cache under their own key; a cached prefix serves when every full-attention group has all its
blocks and every sliding group the blocks of its last window.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

from llmserve.engine.block_pool import BlockKey, BlockPool, SwapPool
from llmserve.engine.kv_disk_reader import DiskReader, ReadRun
from llmserve.engine.kv_disk_store import DiskStore, SlotMeta, chain_digest, group_digest
from llmserve.engine.kv_disk_tier import DiskTier
from llmserve.engine.kv_events import CPU, DISK, GPU, KVEventLog
from llmserve.engine.kv_host_tier import HostTier
from llmserve.engine.kv_layout import NULL_BLOCK, KVLayout, single_group
from llmserve.engine.request import Request
from llmserve.kv_block_hash import block_hash

NO_SWAP = -1  # a swapped-out request's entry for a released (NULL_BLOCK) one
HOST_HIT = -2  # a `get_computed_blocks` entry the host tier holds (a device block is placed at allocation)
DISK_HIT = -3  # one the disk tier holds (read and checked already; a device block is placed at allocation)

_new_tuple = tuple.__new__  # (`_group_key`)


class PrefixHit(list):
    """`get_computed_blocks`' answer: device block ids, HOST_HIT where the host tier holds the block,
    DISK_HIT where the disk tier does; `loads`: (index, host block) of the first, `disk_loads`:
    (index, stage id of the block read back) of the second. `reading`: the request's disk blocks are
    being read in the reader thread (engine/kv_disk_reader.py): it waits, the answer is empty."""

    def __init__(self, reading: bool = False) -> None:
        super().__init__()
        self.loads: list[tuple[int, int]] = []
        self.disk_loads: list[tuple[int, int]] = []
        self.reading = reading


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_cpu_blocks: int = 0,
        layout: KVLayout | None = None,
        num_host_blocks: int = 0,
        events: KVEventLog | None = None,
        disk: DiskStore | None = None,
    ) -> None:
        """`num_host_blocks`: the prefix cache's host tier (engine/kv_host_tier.py);
        `events`: where the cache's changes are told (engine/kv_events.py; one KV group); `disk`:
        the disk tier's file, below the host tier (engine/kv_disk_tier.py)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout or single_group(1)
        self.groups = self.layout.num_groups
        self.pool = BlockPool(num_blocks, reserved=1 if self.layout.sliding else 0)
        self.swap_pool = SwapPool(num_cpu_blocks)
        self.req_blocks: dict[str, list[int]] = {}
        self.req_cpu_blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # full blocks already offered to the cache
        # a request id's count of them (0: none), `cache_full_blocks`'s first test (the scheduler reads it)
        self.num_registered_of = self._num_registered.get
        # sliding groups: (group, window) of each; per request, the logical blocks each group has
        # released, and the position from which a step releases more
        self._sliding = [(g, w) for g, w in enumerate(self.layout.windows) if w is not None]
        self._released: dict[str, list[int]] = {}
        self._release_at: dict[str, int] = {}
        # a request id's position from which a step releases more (0: not yet known), `_behind_windows`'s
        # first test (the scheduler reads it)
        self.release_at_of = self._release_at.get
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.host: HostTier | None = None
        if num_host_blocks:
            self.host = HostTier(num_host_blocks)
            self.pool.record_evictions = True
        self.events = events
        if events is not None:
            if not self.layout.simple:
                raise ValueError("KV events take models of one KV group (no sliding windows) for now")
            self.pool.record_evictions = True
        self.host_hits = 0  # tokens found in the host tier
        self._offloads: list[tuple[int, int]] = []  # (device block, host block) to copy at the step's start
        self._loads: list[tuple[int, int]] = []  # (host block, device block), after the offloads
        self.disk: DiskTier | None = None
        self.disk_store = disk if disk is not None and disk.enabled and self.host is not None else None
        if self.disk_store is not None:
            self.disk = DiskTier(disk.num_slots)
            for r in disk.restored:
                self.disk.restore(r.digest, r.slot)
        self.disk_hits = 0  # tokens found in the disk tier
        self._digest_of: dict[BlockKey, bytes] = {}  # with a disk tier: each device- or host-cached key's digest
        self._req_digests: dict[str, list[bytes]] = {}  # each request's blocks' digests, as far as looked at
        self._offload_targets: dict[int, int] = {}  # host block -> the device block this step's offload copies there
        # (on host, block, slot, its header): spills at the step's start, before the offloads; from a host
        # block, or from the device block of a block stored on the host and evicted in the same step
        self._spills: list[tuple[bool, int, int, SlotMeta]] = []
        self._spilling: set[bytes] = set()  # digests of this step's spills (not yet in the file: a miss)
        self._disk_loads: list[tuple[int, int]] = []  # (stage id, device block), after the host loads
        # one rank alone: the disk reads in a thread of their own (engine/kv_disk_reader.py); per request
        # its read under way, and the blocks read for it not yet staged
        self.disk_reader: DiskReader | None = None
        if self.disk_store is not None and self.disk_store.peers is None:
            self.disk_reader = DiskReader(self.disk_store.read_block)
        self._disk_reads: dict[str, Future[ReadRun]] = {}
        self._disk_ready: dict[str, ReadRun] = {}

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

    @staticmethod
    def _group_key(key: BlockKey, group: int) -> BlockKey:
        """Group `group`'s key of a block (group 0 uses the block's own key): `_group_key_reference`,
        built as a tuple (`_replace` walks the fields in Python: 2.1 µs against 0.3, for every
        group of every block filled or looked up)."""
        return key if group == 0 else _new_tuple(BlockKey, (key[0], key[1], (key[2], group)))

    @staticmethod
    def _group_key_reference(key: BlockKey, group: int) -> BlockKey:
        return key if group == 0 else key._replace(salt=(key.salt, group))

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks holding the longest prefix of `req` (the last token is never
        served from cache: its logits are needed). Keys are made only up to the first
        miss (a fresh 7,680-token prompt makes one, not 480): the rest when its blocks
        are offered to the cache, after the step is launched. An empty PrefixHit marked
        `reading` while the reader thread reads the prefix's disk blocks (the request waits)."""
        salt = self._salt(req)
        if salt is False or req.prompt_logprobs is not None:  # (as vLLM: prompt logprobs need every prompt row)
            return []
        num_full = (req.num_tokens - 1) // self.block_size
        keys = req.block_hashes
        lookup = self.pool.lookup
        if self.groups > 1 or self.layout.sliding:
            return self._computed_groups(req, num_full, salt)
        hits = PrefixHit()
        host = self.host
        on_disk: list[tuple[int, int, SlotMeta]] = []  # (index, slot, header): read together, below
        for i in range(num_full):
            if i == len(keys):
                self._extend_keys(req, i + 1, salt)
            block_id = lookup(keys[i])
            if block_id is None:
                held = host.lookup(keys[i]) if host is not None else None
                if held is not None:
                    hits.loads.append((len(hits), held))
                    block_id = HOST_HIT
                else:
                    found = self._find_on_disk(req, i, keys[i]) if self.disk is not None else None
                    if found is None:
                        break
                    on_disk.append((i, *found))
                    block_id = DISK_HIT
            hits.append(block_id)
        if on_disk:
            return self._read_disk(req, hits, on_disk)
        return hits

    def _computed_groups(self, req: Request, num_full: int, salt: str | None) -> list[int]:
        """`get_computed_blocks` over several groups: walk while every full-attention group hits
        (with none, while any group hits), then take the longest prefix whose sliding groups hold
        the blocks of its last window; their earlier entries are NULL_BLOCK."""
        keys = req.block_hashes
        lookup, layout, bs, groups = self.pool.lookup, self.layout, self.block_size, self.groups
        full = [g for g in range(groups) if layout.windows[g] is None]
        found: list[list[int | None]] = []
        for i in range(num_full):
            if i == len(keys):
                self._extend_keys(req, i + 1, salt)
            ids = [lookup(self._group_key(keys[i], g)) for g in range(groups)]
            if self.host is not None:  # (a tier's block: a HOST_HIT or DISK_HIT entry, see _tier_entry)
                ids = [self._tier_entry(req, i, g, keys[i]) if b is None else b for g, b in enumerate(ids)]
            if (any(ids[g] is None for g in full)) if full else all(b is None for b in ids):
                break
            found.append(ids)
        if self.host is not None:
            return self._groups_from_tiers(req, found)
        for n in range(len(found), 0, -1):
            firsts = [layout.first_needed(g, n * bs, bs) for g in range(groups)]
            if all(found[i][g] is not None for g in range(groups) for i in range(firsts[g], n)):
                return [found[i][g] if i >= firsts[g] else NULL_BLOCK for i in range(n) for g in range(groups)]
        return []

    def _tier_entry(self, req: Request, index: int, group: int, key: BlockKey) -> tuple | None:
        """Where a lower tier holds group `group`'s block `index`: (HOST_HIT, host block), (DISK_HIT,
        slot, header), or None."""
        group_key = self._group_key(key, group)
        held = self.host.lookup(group_key)
        if held is not None:
            return HOST_HIT, held
        found = self._find_on_disk(req, index, group_key, group) if self.disk is not None else None
        return None if found is None else (DISK_HIT, *found)

    def _groups_from_tiers(self, req: Request, found: list[list]) -> PrefixHit:
        """The longest prefix whose every full-attention group has all its blocks and every sliding
        group the blocks of its last window, on the device or a lower tier; the disk blocks it needs
        read back (one run), and the prefix shortened to what remains whole if one did not."""
        layout, bs, groups = self.layout, self.block_size, self.groups

        def longest(usable) -> tuple[int, list[int]]:
            for n in range(len(found), 0, -1):
                firsts = [layout.first_needed(g, n * bs, bs) for g in range(groups)]
                if all(usable(i, g) for g in range(groups) for i in range(firsts[g], n)):
                    return n, firsts
            return 0, []

        n, firsts = longest(lambda i, g: found[i][g] is not None)
        at_disk = [(i * groups + g, found[i][g]) for i in range(n) for g in range(groups)
                   if i >= firsts[g] and isinstance(found[i][g], tuple) and found[i][g][0] == DISK_HIT]  # fmt: skip
        staged: dict[int, int] = {}
        if at_disk:
            ids = self._stage(req, [(slot, meta) for _, (_, slot, meta) in at_disk])
            if ids is None:
                return PrefixHit(reading=True)
            staged = {index: stage for (index, _), stage in zip(at_disk, ids)}
            if len(ids) < len(at_disk):  # torn, corrupt or unreadable (on some rank): recomputed
                self._forget_on_disk(at_disk[len(ids)][1][2])

                def whole(i: int, g: int) -> bool:  # on the device, in host memory, or read back
                    entry = found[i][g]
                    return entry is not None and (not isinstance(entry, tuple) or entry[0] == HOST_HIT
                                                  or i * groups + g in staged)  # fmt: skip

                n, firsts = longest(whole)
        hits = PrefixHit()
        for i in range(n):
            for g in range(groups):
                entry = found[i][g] if i >= firsts[g] else NULL_BLOCK
                if isinstance(entry, tuple):
                    if entry[0] == HOST_HIT:
                        hits.loads.append((len(hits), entry[1]))
                    else:
                        hits.disk_loads.append((len(hits), staged[len(hits)]))
                    entry = entry[0]
                hits.append(entry)
        return hits

    def num_hit_blocks(self, computed: list[int]) -> int:
        """Logical blocks a `get_computed_blocks` answer covers."""
        return len(computed) // self.groups

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (only the global cache is reported)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, req: Request) -> None:
        """Offer the request's computed full blocks to the prefix cache (only blocks whose
        tokens are all known: a token still on the device cannot be hashed yet)."""
        # no block filled up since the last call: the common case, checked first (each running request
        # each step); `_known_full_blocks` inline
        num_full = min(req.num_computed_tokens, len(req.all_token_ids) - req.num_pending) // self.block_size
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start or self._salt(req) is False:
            return
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        groups = self.groups
        num_full = min(num_full, len(blocks) // groups)
        keys = self._block_keys(req, num_full)
        if groups == 1 and not self.layout.sliding:
            for i in range(start, num_full):
                self.pool.register(blocks[i], keys[i])
            if self.disk is not None:
                digests = self._digests(req, num_full)
                for i in range(start, num_full):
                    self._digest_of.setdefault(keys[i], digests[i])
            if self.events is not None:
                self._announce(req, blocks, keys, start, num_full)
        else:
            digests = self._digests(req, num_full) if self.disk is not None else None
            for i in range(start, num_full):
                for g in range(groups):
                    block = blocks[i * groups + g]
                    if block != NULL_BLOCK:  # (released behind its window before it was offered)
                        key = self._group_key(keys[i], g)
                        self.pool.register(block, key)
                        if digests is not None:
                            self._digest_of.setdefault(key, group_digest(digests[i], g))
        self._num_registered[req.request_id] = num_full

    def _known_full_blocks(self, req: Request) -> int:
        """The request's computed full blocks whose tokens are all known on the host."""
        return min(req.num_computed_tokens, req.num_known_tokens) // self.block_size

    def num_cached_blocks(self, req: Request) -> int:
        """How many of the request's blocks are registered in the prefix cache."""
        return self._num_registered.get(req.request_id, 0)

    # -- allocation -------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int, computed: list[int] = ()) -> int:
        """Free blocks this step would consume (new blocks plus free cached hits and hits to load
        from the host tier, less the blocks a sliding group releases first)."""
        groups = self.groups
        have = len(self.req_blocks.get(req.request_id, ())) // groups + len(computed) // groups
        start = req.num_computed_tokens + len(computed) // groups * self.block_size
        total = start + num_new_tokens
        new = max(0, -(-total // self.block_size) - have) * groups
        hits = sum(1 for b in self._held(computed) if b < 0 or self.pool.is_free(b)) if computed else 0
        if self.layout.sliding and not computed:
            new -= len(self._behind_windows(req, start, release=False))
        return new + hits

    def _held(self, blocks: list[int]) -> list[int]:
        """The entries of a block list that hold a block (with a sliding group, not NULL_BLOCK)."""
        return [b for b in blocks if b != NULL_BLOCK] if self._sliding else blocks

    def _behind_windows(self, req: Request, start: int, release: bool) -> list[int]:
        """The sliding groups' held blocks that no step computing tokens from `start` on reads;
        with `release`, freed (their entries become NULL_BLOCK)."""
        rid = req.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks or start < self._release_at.get(rid, 0):
            return []
        groups, bs = self.groups, self.block_size
        released = self._released.get(rid) or [0] * groups
        behind = []
        for g, window in self._sliding:
            upto = max(0, start - window + 1) // bs
            for j in range(released[g] * groups + g, upto * groups + g, groups):
                if blocks[j] != NULL_BLOCK:
                    behind.append(blocks[j])
                    if release:
                        blocks[j] = NULL_BLOCK
            if release:
                released[g] = max(released[g], upto)
        if release:
            self._released[rid] = released
            self._release_at[rid] = min((released[g] + 1) * bs + window - 1 for g, window in self._sliding)
            self.pool.free(behind)
        return behind

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[int] = (), reserve: int = 0) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens (after `computed` cache hits),
        keeping `reserve` blocks free. All or nothing."""
        groups = self.groups
        if not computed:  # the common decode case: the last block still has room
            blocks = self.req_blocks.get(req.request_id)
            if blocks and req.num_computed_tokens + num_new_tokens <= len(blocks) // groups * self.block_size:
                if self._sliding:
                    self._behind_windows(req, req.num_computed_tokens, release=True)
                return True
        needed = self.blocks_needed(req, num_new_tokens, computed)
        if needed > self.pool.num_free - reserve:
            return False
        start = req.num_computed_tokens + len(computed) // groups * self.block_size
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if computed:
            loads, disk_loads = getattr(computed, "loads", None), getattr(computed, "disk_loads", None)
            if loads or disk_loads:  # device blocks for the tiers' hits, registered now, filled at the step's start
                self.pool.touch(b for b in self._held(computed) if b >= 0)  # (first: the allocation cannot take them)
                computed = self._place_loads(req, computed, loads, disk_loads)
            else:
                self.pool.touch(self._held(computed))
            blocks.extend(computed)
            self._num_registered[req.request_id] = len(blocks) // groups
            if self._sliding:  # the hits' entries before each window are NULL_BLOCK already
                self._released[req.request_id] = [self.layout.first_needed(g, start, self.block_size)
                                                  for g in range(groups)]  # fmt: skip
        elif self._sliding:
            self._behind_windows(req, start, release=True)
        total = start + num_new_tokens
        missing = -(-total // self.block_size) - len(blocks) // groups
        if missing > 0:
            blocks.extend(self.pool.allocate(missing * groups))
        if self.pool.record_evictions:
            self._offload_evicted()
        return True

    # -- the host tier ----------------------------------------------------------------------
    def _place_loads(self, req: Request, computed: list[int], loads: list[tuple[int, int]],
                     disk_loads: list[tuple[int, int]]) -> list[int]:  # fmt: skip
        """`computed` with a new device block in each tier hit's place: registered under the hit's
        key, its load queued (a host block pinned for the step, a disk block's bytes claimed)."""
        computed = list(computed)
        loads, disk_loads = loads or [], disk_loads or []
        fresh = iter(self.pool.allocate(len(loads) + len(disk_loads)))
        groups = self.groups
        keys = self._block_keys(req, len(computed) // groups)
        digests = self._digests(req, len(computed) // groups) if self.disk is not None else None
        for medium, hits in ((CPU, loads), (DISK, disk_loads)):
            for index, held in hits:
                computed[index] = block = next(fresh)
                i, g = divmod(index, groups)
                key = self._group_key(keys[i], g)
                self.pool.register(block, key)
                if digests is not None:
                    self._digest_of[key] = group_digest(digests[i], g)
                if self.events is not None and (medium, key) in self.events.hashes:
                    self.events.stored(GPU, key, self.events.hashes[medium, key], None, None)
                if medium == CPU:
                    self.host.pin(held)
                    self._loads.append((held, block))
                else:
                    self.disk_store.claim(held)
                    self._disk_loads.append((held, block))
        # (tokens: the logical blocks loaded, each counted once over its groups)
        self.host_hits += len({index // groups for index, _ in loads}) * self.block_size
        self.disk_hits += len({index // groups for index, _ in disk_loads}) * self.block_size
        if self.disk is not None:
            self.disk.counts.loaded += len(disk_loads)
        return computed

    def _offload_evicted(self) -> None:
        """Cached device blocks just handed out again go to the host tier (copied at the step's
        start), and are told as removed from the device (stored on the host)."""
        pool, host, events = self.pool, self.host, self.events
        for block, key in pool.evictions:
            stored_hash = events.hashes.get((GPU, key)) if events is not None else None
            if events is not None:
                events.removed(GPU, key)
            if host is None:
                continue
            held = host.store(key)
            for gone in host.take_dropped():  # (the host block `held` held it: spilled before the offload)
                self._host_dropped(gone, held)
            if held is not None:
                self._offloads.append((block, held))
                self._offload_targets[held] = block
                if events is not None and stored_hash is not None:
                    events.stored(CPU, key, stored_hash, None, None)
            elif self.disk is not None and key not in host.entries:
                self._forget_digest(key)  # (dropped: every host block pinned)
        pool.evictions.clear()

    def _host_dropped(self, key: BlockKey, host_block: int) -> None:
        """The host tier gave up `key`'s block `host_block` (for another block, or a swap-out): the
        block moves to the disk tier if there is one, and is told as removed from the host."""
        if self.disk is not None:
            self._spill(key, host_block)
        self._offload_targets.pop(host_block, None)
        if self.events is not None:
            self.events.removed(CPU, key)

    # -- the disk tier ----------------------------------------------------------------------
    def _digests(self, req: Request, num_blocks: int) -> list[bytes]:
        """The chained digests of the request's first `num_blocks` blocks (kept while it lives)."""
        digests = self._req_digests.setdefault(req.request_id, [])
        if len(digests) < num_blocks:
            salt, bs, tokens = self._salt(req), self.block_size, req.all_token_ids
            for i in range(len(digests), num_blocks):
                digests.append(chain_digest(digests[-1] if digests else None, tokens[i * bs : (i + 1) * bs], salt))
        return digests

    def _find_on_disk(self, req: Request, index: int, key: BlockKey, group: int = 0) -> tuple[int, SlotMeta] | None:
        """(slot, header) of the request's block `index` (of KV group `group`, whose `key` this is) if
        the disk tier holds it, else None."""
        digest = group_digest(self._digests(req, index + 1)[index], group)
        if digest in self._spilling:
            return None  # its bytes reach the file at the next step's start
        slot = self.disk.lookup(digest)
        return None if slot is None else (slot, SlotMeta(digest, key.token_ids, _persistent(key)))

    def _read_disk(self, req: Request, hits: PrefixHit, on_disk: list[tuple[int, int, SlotMeta]]) -> PrefixHit:
        """The prefix hit with its disk blocks read back and checked (in one go: under tensor
        parallelism one call to every rank), cut before the first that did not read back; an empty
        hit marked `reading` while the reader thread reads them."""
        staged = self._stage(req, [(slot, meta) for _, slot, meta in on_disk])
        if staged is None:
            return PrefixHit(reading=True)
        hits.disk_loads = [(index, stage) for (index, _, _), stage in zip(on_disk, staged)]
        if len(staged) < len(on_disk):  # torn, corrupt or unreadable (on some rank): recomputed
            cut, _, meta = on_disk[len(staged)]
            self._forget_on_disk(meta)
            del hits[cut:]
            hits.loads = [(i, b) for i, b in hits.loads if i < cut]
        return hits

    def _stage(self, req: Request, blocks: list[tuple[int, SlotMeta]]) -> list[int] | None:
        """`DiskStore.stage_run` of the request's disk blocks. With the reader thread, the blocks
        neither read back already nor read for this request are handed to it, and the answer is None
        (the request waits; the scheduler takes others) until it has read them; they are then
        staged without reading again. Without it (tensor parallelism: every rank reads), read here."""
        store = self.disk_store
        if self.disk_reader is None:
            return store.stage_run(blocks)
        rid = req.request_id
        pending = self._disk_reads.get(rid)
        if pending is not None:
            if not pending.done():
                return None
            del self._disk_reads[rid]
            self._disk_ready.setdefault(rid, {}).update(pending.result())
        ready = self._disk_ready.get(rid, {})
        missing = []
        for slot, meta in blocks:
            if meta.digest in ready:
                if ready[meta.digest][0] is None:
                    break  # (did not read back: nothing after it serves)
            elif not store.is_staged(meta.digest):
                missing.append((slot, meta))
        if missing:
            self._disk_reads[rid] = self.disk_reader.submit(missing)
            return None
        self._disk_ready.pop(rid, None)
        return store.stage_run(blocks, ready)

    def reading_disk(self) -> bool:
        """Is a request's disk read under way in the reader thread?"""
        return bool(self._disk_reads)

    def wait_for_disk_reads(self, timeout: float) -> None:
        """Wait (up to `timeout` seconds) until one of the reads under way is done (a schedule that
        had nothing else to do)."""
        if self._disk_reads:
            wait(list(self._disk_reads.values()), timeout, return_when=FIRST_COMPLETED)

    def _forget_on_disk(self, meta: SlotMeta) -> None:
        """A disk block that did not read back whole: its slot is free again."""
        entry = self.disk.forget(meta.digest)
        if self.events is not None and entry is not None and entry.key is not None:
            self.events.removed(DISK, entry.key)

    def _spill(self, key: BlockKey, host_block: int) -> None:
        """A block the host tier evicts from `host_block` goes to a disk slot (written at the step's
        start, before anything overwrites the host block; from its device block when this step
        offloads it to the host block: its bytes are not there yet)."""
        digest = self._forget_digest(key)
        if digest is None:
            return  # (never registered by a request of this engine)
        device_block = self._offload_targets.get(host_block)
        slot = self.disk.store(digest, key)
        events = self.events
        for gone in self.disk.take_dropped():
            if events is not None and gone.key is not None:
                events.removed(DISK, gone.key)
        if slot is None:
            return  # on disk already
        meta = SlotMeta(digest, key.token_ids, _persistent(key))
        if device_block is None:
            self._spills.append((True, host_block, slot, meta))
        else:
            self._spills.append((False, device_block, slot, meta))
        self._spilling.add(digest)
        if events is not None and (CPU, key) in events.hashes:
            events.stored(DISK, key, events.hashes[CPU, key], None, None)

    def _forget_digest(self, key: BlockKey) -> bytes | None:
        """A key's digest, forgotten unless the device cache still holds the key."""
        if self.pool.lookup(key) is not None:
            return self._digest_of.get(key)
        return self._digest_of.pop(key, None)

    def take_disk_copies(self) -> tuple[list[tuple[bool, int, int, SlotMeta]], list[tuple[int, int]]]:
        """The step's disk-tier copies (after `take_copies`): (on host, block, slot, header) spills,
        first, and (stage id, device block) loads, last."""
        copies = self._spills, self._disk_loads
        self._spills, self._disk_loads = [], []
        self._spilling.clear()
        return copies

    def _announce(self, req: Request, blocks: list[int], keys: list[BlockKey], start: int, end: int) -> None:
        """BlockStored for the request's blocks start..end-1 that it registered (not another's copy)."""
        hashes = req.event_hashes
        lora = req.lora_request.key if req.lora_request is not None else None
        for i in range(len(hashes), end):
            hashes.append(block_hash(hashes[-1] if hashes else None, keys[i].token_ids, lora))
        for i in range(start, end):
            if self.pool.lookup(keys[i]) == blocks[i] and (GPU, keys[i]) not in self.events.hashes:
                self.events.stored(GPU, keys[i], hashes[i], hashes[i - 1] if i else None, lora)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's host-tier copies: (device, host) offloads, then (host, device) loads."""
        if self.pool.evictions:
            self._offload_evicted()
        if self.host is None:
            return [], []
        copies = self._offloads, self._loads
        self._offloads, self._loads = [], []
        self._offload_targets.clear()
        self.host.unpin_all()
        return copies

    def free(self, req: Request) -> None:
        """Release the request's blocks; its tail blocks are evicted first. With sliding groups,
        their (window's) blocks are evicted last: a later hit of the whole prefix needs them."""
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks and not self._sliding:
            self.pool.free(reversed(blocks))
        elif blocks:
            groups = self.groups
            full = [g for g in range(groups) if self.layout.windows[g] is None]
            order = [b for i in range(len(blocks) - 1, -1, -1) if i % groups in full and (b := blocks[i]) != NULL_BLOCK]
            order += [
                b for i in range(len(blocks) - 1, -1, -1) if i % groups not in full and (b := blocks[i]) != NULL_BLOCK
            ]
            self.pool.free(order)
            self._refresh_prompt_windows(req)
        cpu_blocks = self.req_cpu_blocks.pop(req.request_id, None)
        if cpu_blocks and self.host is not None:  # swapped out to the host tier: its copies are free
            self.host.release([b for b in cpu_blocks if b != NO_SWAP])
        elif cpu_blocks:
            self.swap_pool.free(b for b in cpu_blocks if b != NO_SWAP)
        self._num_registered.pop(req.request_id, None)
        self._req_digests.pop(req.request_id, None)
        if self._disk_reads or self._disk_ready:  # (a read under way ends by itself; its bytes are dropped)
            self._disk_reads.pop(req.request_id, None)
            self._disk_ready.pop(req.request_id, None)
        self._released.pop(req.request_id, None)
        self._release_at.pop(req.request_id, None)

    def _refresh_prompt_windows(self, req: Request) -> None:
        """The sliding groups' blocks of the window before the prompt's end, released while the
        request decoded and still cached, become the most recently used free blocks: the same
        prompt again (the prompt's hit) needs them beside the full groups' blocks just freed."""
        keys = req.block_hashes
        n = min(len(keys), (req.num_prompt_tokens - 1) // self.block_size)
        lookup, refresh = self.pool.lookup, self.pool.refresh
        for g, _ in self._sliding:
            for i in range(self.layout.first_needed(g, n * self.block_size, self.block_size), n):
                block = lookup(self._group_key(keys[i], g))
                if block is not None:
                    refresh(block)

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks[request_id]

    def num_allocated_blocks(self, request_id: str) -> int:
        """Logical blocks of the request (each of its groups holds one id for each)."""
        blocks = self.req_blocks.get(request_id)
        return len(blocks) // self.groups if blocks else 0

    def blocks_for(self, start: int, end: int) -> int:
        """Block ids a sequence holds over every group while tokens [start, end) are computed
        (one per logical block for a single full-attention group)."""
        if self.layout.simple:
            return -(-end // self.block_size)
        return self.layout.blocks_held(start, end, self.block_size)

    # -- swap -------------------------------------------------------------------------
    @property
    def swap_enabled(self) -> bool:
        """Can a preempted request be swapped out (to swap space, or to the host tier)?"""
        return self.swap_pool.num_blocks > 0 or self.host is not None

    @property
    def num_swapped_blocks(self) -> int:
        """Host blocks holding swapped-out requests' blocks."""
        if self.host is not None:
            return self.host.num_reserved
        return self.swap_pool.num_blocks - self.swap_pool.num_free

    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks (its partial last one too) to CPU swap blocks; None when swap
        space is short. With the host tier, its host blocks are the swap space: the blocks are
        taken out of its LRU (`HostTier.reserve`), the copies go with the tier's offloads
        (`take_copies`) and the answer is []."""
        blocks = self.req_blocks.get(req.request_id, [])
        held = self._held(blocks)
        if not blocks:
            return None
        if self.host is not None:
            taken = self.host.reserve(len(held))
            if taken is None:
                return None
            for host_block, gone in taken:
                if gone is not None:  # a cached block the host tier gave up: to the disk tier, if any
                    self._host_dropped(gone, host_block)
            cpu_held = [b for b, _ in taken]
            self._offloads.extend(zip(held, cpu_held))
            mapping = []
        elif len(held) > self.swap_pool.num_free:
            return None
        else:
            cpu_held = self.swap_pool.allocate(len(held))
            mapping = list(zip(held, cpu_held))
        if self.layout.sliding:
            it = iter(cpu_held)
            cpu_blocks = [NO_SWAP if b == NULL_BLOCK else next(it) for b in blocks]
        else:
            cpu_blocks = cpu_held
        self.pool.free(reversed(held))
        del self.req_blocks[req.request_id]
        self.req_cpu_blocks[req.request_id] = cpu_blocks
        self._num_registered.pop(req.request_id, None)
        return mapping

    def swap_in(self, req: Request, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped request's blocks back to the device; None when blocks are short."""
        cpu_blocks = self.req_cpu_blocks[req.request_id]
        held = [b for b in cpu_blocks if b != NO_SWAP] if self.layout.sliding else cpu_blocks
        if len(held) > self.pool.num_free - reserve:
            return None
        gpu_held = self.pool.allocate(len(held))
        if self.layout.sliding:
            it = iter(gpu_held)
            self.req_blocks[req.request_id] = [NULL_BLOCK if b == NO_SWAP else next(it) for b in cpu_blocks]
        else:
            self.req_blocks[req.request_id] = gpu_held
        del self.req_cpu_blocks[req.request_id]
        if self.host is not None:  # from the host tier, with its loads (after its offloads); free after the step
            self._loads.extend(zip(held, gpu_held))
            self.host.release_after_step(held)
            return []
        self.swap_pool.free(held)
        return list(zip(held, gpu_held))

    def swap_in_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Device blocks a swapped-out request takes to swap in and compute `num_new_tokens`."""
        total = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        if not self._sliding and self.groups == 1:
            return total
        cpu_blocks = self.req_cpu_blocks[req.request_id]
        held = sum(b != NO_SWAP for b in cpu_blocks)
        return held + max(0, total - len(cpu_blocks) // self.groups) * self.groups

    # -- stats ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_usable

    def move_cache_down(self) -> int:
        """The device's cached blocks move down the tiers, as evictions (least recently used first, so
        the most recent stay highest): a level-1 sleep frees the device cache, and a woken engine finds
        the prefixes in host memory or on disk, as far as the tiers hold them. The copies are the next
        `take_copies`/`take_disk_copies`; the device cache then holds nothing. Only when no block is in
        use; returns the number of blocks moved (0 without a host tier: the device cache is reset)."""
        cached = self.pool.cached_free_blocks() if self.host is not None else []
        if not self.pool.reset_cache():
            return 0
        if cached:
            self.pool.evictions.extend(cached)
            self._offload_evicted()
        return len(cached)

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_cache():
            return False
        if self.host is not None:  # the host tier's blocks are the prefix cache's too
            self.host.clear()
        if self.disk is not None:  # and the disk tier's (a reset may follow new weights: none is reused)
            self.disk.clear()
            self.disk_store.clear()
            self._digest_of.clear()
            self._disk_reads.clear()
            self._disk_ready.clear()
        if self.events is not None:
            self.events.cleared()
        return True


def _persistent(key: BlockKey) -> bool:
    """Whether a block may be reused after a restart: of the global cache (no LoRA adapter); a KV
    group's key keeps the block's salt as the first of (salt, group)."""
    salt = key.salt[0] if isinstance(key.salt, tuple) else key.salt
    return salt is None
