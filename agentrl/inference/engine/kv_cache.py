"""A preallocated, paged KV cache with prefix reuse (the embedded engine's fast path).

- **Pages.** Keys and values of every layer live in two tensors ``(layers, pages * page_size,
  kv_heads, head_dim)`` allocated once; a sequence owns a list of pages (its block table), so
  rows join and leave the running batch without copying anyone's cache. Page 0 is a scratch
  page: the padded rows of a captured decode step write there.
- **Prefix reuse.** When a sequence is released, each of its *full* pages is registered under a
  hash chained over the tokens it holds and every page before it (as vLLM's prefix caching and,
  at page granularity, SGLang's radix cache). A later sequence that starts with the same tokens
  (the next turn of an episode, another sample of the same prompt) takes those pages instead of
  prefilling them again. Registered pages nobody uses wait in an LRU list and are evicted, least
  recently used first, only when free pages run out: memory stays bounded by the budget.
- **Weights change → prefixes go.** :meth:`clear_prefixes` forgets every registered page (KV
  computed by old weights must not serve new requests).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

SCRATCH_PAGE = 0


def page_bytes(
    *, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
) -> int:
    """Bytes of one page: keys and values of ``page_size`` tokens in every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize


class PagedKVCache:
    """KV tensors, a page allocator with reference counts, and the prefix (hash → page) index.

    Not thread-safe: the engine touches the bookkeeping only on its event loop, between steps;
    the worker thread only reads and writes the tensors.

    Args:
        num_layers: decoder layers.
        num_kv_heads: key/value heads per layer.
        head_dim: size of one head.
        num_pages: pages in all, the scratch page included.
        page_size: tokens per page (the granularity of prefix reuse).
        dtype: dtype of the cached keys and values.
        device: where the tensors live.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages: expected >= 2 (one is scratch), got {num_pages}")
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        self._free: list[int] = []
        self._hash_of: dict[int, int] = {}  # registered page -> its chained hash
        self._page_of: dict[int, int] = {}  # chained hash -> registered page
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered pages nobody uses
        self.reset()

    def reset(self) -> None:
        """Free every page and forget every prefix (the tensors keep their contents)."""
        self._refs = [0] * self.num_pages
        self._free = list(range(self.num_pages - 1, SCRATCH_PAGE, -1))  # pop() gives page 1 first
        self._hash_of.clear()
        self._page_of.clear()
        self._lru.clear()

    def available(self) -> int:
        """Pages that :meth:`allocate` can hand out now (free or evictable)."""
        return len(self._free) + len(self._lru)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` pages owned by the caller (evicting least recently used prefixes), or ``None``."""
        if n > self.available():
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def _chain(self, tokens: list[int], count: int) -> list[int]:
        size, h, out = self.page_size, 0, []
        for i in range(count):
            h = hash((h, tuple(tokens[i * size : (i + 1) * size])))
            out.append(h)
        return out

    def match(self, tokens: list[int]) -> list[int]:
        """Registered pages holding the longest cached prefix of ``tokens``, now shared.

        At least the last token is left out, so the caller still computes its logits.
        """
        pages = []
        for h in self._chain(tokens, (len(tokens) - 1) // self.page_size):
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._refs[page] == 0:
                del self._lru[page]
            self._refs[page] += 1
        return pages

    def release(self, pages: list[int], tokens: list[int] | None = None, kv_len: int = 0) -> None:
        """Drop the caller's reference to ``pages``; register the full ones for reuse.

        Args:
            pages: the sequence's pages, in order.
            tokens: the tokens whose keys and values the pages hold; ``None`` registers nothing.
            kv_len: how many of ``tokens`` have their keys and values in the pages.
        """
        full = min(kv_len // self.page_size, len(pages)) if tokens is not None else 0
        hashes = self._chain(tokens, full) if tokens is not None else []
        for page, h in zip(pages, hashes, strict=False):
            if page not in self._hash_of and h not in self._page_of:
                self._hash_of[page], self._page_of[h] = h, page
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._lru[page] = None  # most recently used last
                else:
                    self._free.append(page)

    def clear_prefixes(self) -> None:
        """Forget every registered prefix (pages in use stay with their owners)."""
        for page in self._lru:
            self._free.append(page)
        self._lru.clear()
        self._hash_of.clear()
        self._page_of.clear()
