"""Page (KV block) allocation for the paged KV cache, with optional automatic prefix caching.
Pure Python: ids only, no tensors.

Every KV-cache group (target full-attention layers, target sliding-window layers, the drafter's
layers) indexes its own tensors with the same page ids, so one block table per request serves all
groups. Ref counts are kept per page so that shared (prefix) pages need no change to the free list.

Prefix caching (vLLM V1's `enable_prefix_caching`): a FULL page whose KV (target and drafter) is
computed by a committed step gets a chained hash, hash(parent page's hash, the page's token ids),
so equal hashes mean equal whole prefixes. A later request whose leading pages hash alike reuses
them instead of recomputing them. Freed pages keep their hash while they sit in the free list
(ref count 0) and are evicted least recently freed first: allocating a page pops the front of the
free list and drops its hash.

Hash collisions: the hash is only the lookup index. Each registration of a page gets a serial
number never reused, and the page stores its key (serial of its parent page's registration, its
token tuple). A hit walks the chain comparing keys, so page i matches only if its tokens are equal
and its parent is exactly the registration matched at page i - 1: by induction the whole prefix is
equal token for token. A collision is a miss, never wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from blockdraft.engine.request import Request

_ROOT_HASH = 0  # parent hash of a request's first page
_ROOT_SERIAL = 0  # parent serial of a request's first page


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the engine started, in tokens (vLLM's prefix_cache_queries /
    prefix_cache_hits): queries = prompt (+ output, after preemption) tokens looked up at admission,
    hits = of those, tokens whose KV came from cached pages."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """A pool of `num_blocks` pages of `kv_block_size` tokens with a free list and ref counts.

    Invariants: a page is in the free list iff its ref count is 0. With prefix caching, a page is
    in `_cached` iff it has a hash in `_page_hash`; such a page holds the computed KV of the whole
    prefix its hash names and is never written again until it is evicted (allocated afresh).
    """

    def __init__(self, num_blocks: int, kv_block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.kv_block_size = kv_block_size
        self.enable_prefix_caching = enable_prefix_caching
        # free pages, least recently freed first; an OrderedDict so a hit can take a page out of the
        # middle in O(1) (values unused)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._cached: dict[int, int] = {}  # page hash -> page id
        self._page_hash: dict[int, int] = {}  # page id -> its hash
        self._page_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # page id -> (parent serial, tokens)
        self._page_serial: dict[int, int] = {}  # page id -> its registration's serial
        self._next_serial = _ROOT_SERIAL + 1
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of pages in use, in [0, 1] (cached pages with ref count 0 count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.kv_block_size)

    def allocate_slots(self, request: Request, num_tokens: int) -> bool:
        """Grow `request.block_ids` so that it holds `num_tokens` tokens in total.

        Returns False (allocating nothing) when the pool has too few free pages. A page taken from
        the free list loses its prefix hash (LRU eviction): it is about to be overwritten.
        """
        extra = self.blocks_needed(num_tokens) - len(request.block_ids)
        if extra <= 0:
            return True
        if extra > len(self._free):
            return False
        for _ in range(extra):
            page, _ = self._free.popitem(last=False)
            self._evict(page)
            self._ref_counts[page] = 1
            request.block_ids.append(page)
        return True

    def free(self, request: Request) -> None:
        """Release every page of `request` (pages shared by others stay allocated).

        Pages go to the back of the free list last page first, so that a request's tail pages are
        evicted before its head pages (the head is the prefix other requests are likelier to share).
        """
        for page in reversed(request.block_ids):
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free[page] = None
        request.block_ids = []
        request.num_registered_pages, request.prefix_serial = 0, _ROOT_SERIAL

    # -- prefix caching -------------------------------------------------------------------------

    def page_hashes(self, request: Request, num_pages: int) -> list[int]:
        """Chained hashes of the request's first `num_pages` full pages (cached on the request:
        its tokens never change, so they survive preemption).

        Raises:
            ValueError: the request holds fewer than `num_pages` full pages of tokens.
        """
        size, hashes = self.kv_block_size, request.page_hashes
        if num_pages * size > request.num_tokens:
            raise ValueError(f"{request.num_tokens} tokens hold fewer than {num_pages} full pages of {size} tokens")
        for i in range(len(hashes), num_pages):
            hashes.append(hash((hashes[-1] if hashes else _ROOT_HASH, self._page_tokens(request, i))))
        return hashes[:num_pages]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Page ids of the longest cached prefix of the request's tokens (prompt, and output after
        a preemption), in full pages, leaving at least the last token uncached: it must be
        computed to give logits and the drafter's features.

        Takes nothing and counts nothing: the caller passes the result to `take_cached` once the
        request is admitted. [] when prefix caching is off.
        """
        if not self.enable_prefix_caching:
            return []
        max_pages = (request.num_tokens - 1) // self.kv_block_size
        pages: list[int] = []
        parent = _ROOT_SERIAL
        for i, h in enumerate(self.page_hashes(request, max_pages)):
            page = self._cached.get(h)
            # the key is compared too (module docstring): a hash collision is a miss, never wrong KV
            if page is None or self._page_key[page] != (parent, self._page_tokens(request, i)):
                break
            pages.append(page)
            parent = self._page_serial[page]
        return pages

    def take_cached(self, request: Request, pages: list[int]) -> None:
        """Make cached `pages` (from `find_cached_prefix`) the first pages of `request`, which must
        hold none: bump their ref counts, taking free ones out of the free list.

        Raises:
            ValueError: the request already holds pages.
        """
        if request.block_ids:
            raise ValueError(f"request {request.request_id!r} already holds {len(request.block_ids)} pages")
        for page in pages:
            if self._ref_counts[page] == 0:
                del self._free[page]
            self._ref_counts[page] += 1
        request.block_ids = list(pages)
        request.num_registered_pages = len(pages)
        request.prefix_serial = self._page_serial[pages[-1]] if pages else _ROOT_SERIAL

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup in `stats` (tokens). The scheduler calls it once the
        request is admitted, so a lookup retried after a failed allocation counts once."""
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    def cache_full_pages(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full pages among its first `num_computed_tokens` tokens.

        `num_computed_tokens` must count only committed positions whose target AND drafter KV are
        written (the DFlash runner writes the drafter's context KV of a position in the same step
        as the target's, for committed rows only); it is capped at the request's known tokens, so
        rejected drafts never enter a cached page. A page whose prefix is already cached in
        another page stays uncached (the first copy serves hits), and so does one whose hash
        collides with another prefix's. No-op when caching is off.
        """
        if not self.enable_prefix_caching:
            return
        num_pages = min(num_computed_tokens, request.num_tokens) // self.kv_block_size
        num_pages = min(num_pages, len(request.block_ids))
        first = request.num_registered_pages
        if num_pages <= first:
            return
        hashes = self.page_hashes(request, num_pages)
        for i in range(first, num_pages):
            key = (request.prefix_serial, self._page_tokens(request, i))
            request.prefix_serial = self._register(request.block_ids[i], hashes[i], key)
        request.num_registered_pages = num_pages

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`: after a weight update, or to
        time a cold cache). Only while no request holds a page: returns False, changing nothing,
        when one does; True when the cache is empty afterwards. `stats` keep counting (they are
        totals since the engine started, as /metrics exports them)."""
        if any(self._ref_counts):
            return False
        for page in list(self._page_hash):
            self._evict(page)
        return True

    def _register(self, page: int, h: int, key: tuple[int, tuple[int, ...]]) -> int:
        """Register `page` (whose prefix has hash `h` and key `key`) unless it or an equal prefix
        already is -> the serial of the registration that now names this prefix."""
        if page in self._page_serial:  # a page this request got from a hit
            return self._page_serial[page]
        other = self._cached.get(h)
        if other is not None:
            if self._page_key[other] == key:  # the same prefix, computed twice: the first copy serves hits
                return self._page_serial[other]
            serial = self._next_serial  # a collision: stays uncached; its successors get an orphan parent
            self._next_serial += 1
            return serial
        serial = self._next_serial
        self._next_serial += 1
        self._cached[h], self._page_hash[page] = page, h
        self._page_key[page], self._page_serial[page] = key, serial
        return serial

    def _page_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        size = self.kv_block_size
        return tuple(request.token_slice(index * size, (index + 1) * size))

    def _evict(self, page: int) -> None:
        h = self._page_hash.pop(page, None)
        if h is not None:
            del self._cached[h]
            del self._page_key[page]
            del self._page_serial[page]
