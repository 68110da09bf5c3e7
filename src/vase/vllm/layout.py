"""How an attention backend lays a layer's KV blocks out, read and written through one object.

vLLM hands each attention layer one tensor, logically ``[num_blocks, H_kv, block_size, C]`` (block, KV head, token,
content; vLLM 0.32's ``KVCacheLayout`` names the physical order of those axes), and each backend reads its bytes its
own way:

* vLLM's CPU backend (``cpu_attn.py``) packs each (block, KV head) as its ISA wants: ``vec`` / ``vec16`` store the
  keys transposed, ``[D, block_size]``, then the values ``[block_size, D]``; ``amx`` (bfloat16 on CPUs with AMX)
  packs them for its tiles. vase does not assume any of these: :func:`probe` writes marked tokens through the
  backend's own cache write and reads where each key and value element lands (:class:`ProbedLayout`), so every ISA
  the write supports is read back exactly;
* the GPU backends (Triton, FlashAttention: ``triton_attn.py`` / ``flash_attn.py``) keep ``C = 2 D``, a token's key
  then its value (they read ``kv_cache.transpose(1, 2).split(D, -1)``) in whatever physical order the strides give
  (token-major ``[blocks, block_size, H, 2D]`` in memory, or head-major): :class:`SplitKV` reads and writes through
  the logical view, so it holds for any order.

Everything vase does to a request's entries in the paged cache goes through a layout: the gather that feeds scoring
and compaction (:meth:`PagedLayout.gather`), the write-back of the kept entries to a row's first slots
(:meth:`PagedLayout.write_front`) and the writes at physical slots (:meth:`PagedLayout.write_slots`: a dense row's
scratch cache). The compaction itself (:mod:`vase.vllm.compact`) is written once, for every layout. No vLLM import:
the backend's write comes in as a function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# writer(kv_cache, slots [T] int64, keys [T, H, D], values [T, H, D]): the backend's own cache write (slots < 0 skipped)
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


_BASE = 128  # the marks of a probe: integers 1..128, exact in bfloat16 (8 significant bits)


class LayoutError(ValueError):
    """A backend's cache write that does not store each key and value element once, as given (a layout vase cannot
    read back)."""


class PagedLayout:
    """The paged layout of one backend's KV cache (see the module docstring).

    Args:
        writer: the backend's own cache write, or None to write with torch indexing (:meth:`views`).
    """

    name = "paged"

    def __init__(self, writer: Writer | None = None):
        self.writer = writer

    def read(self, kv_cache: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[*ids.shape, H, block_size, D]`` of the blocks ``ids`` (int64, any shape)."""
        keys, values = self.views(kv_cache)
        return keys[ids], values[ids]

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - interface
        """Keys and values of every slot as views of ``kv_cache``, ``[num_blocks, H, block_size, D]`` each."""
        raise NotImplementedError(f"the {self.name} layout is written through its backend's cache write only")

    # --------------------------------------------------------------------------------------------- reads
    def gather(self, kv_cache: torch.Tensor, block_rows: torch.Tensor, length: int):
        """Keys and values ``[B, H, length, D]`` of the first ``length`` physical slots of each row (copies).

        Args:
            kv_cache: one layer's cache (the backend's tensor, logically ``[num_blocks, H, block_size, C]``).
            block_rows: ``[B, nb]`` int64 block ids of each row, in order (at least ``ceil(length / block_size)``).
            length: slots to read (tokens).
        """
        bs = kv_cache.shape[2]
        nb = -(-length // bs)
        keys, values = self.read(kv_cache, block_rows[:, :nb])
        b, _, h, _, d = keys.shape

        def rows(t):  # [B, nb, H, bs, D] -> [B, H, nb * bs, D]
            return t.permute(0, 2, 1, 3, 4).reshape(b, h, nb * bs, d)[:, :, :length]

        return rows(keys), rows(values)

    # -------------------------------------------------------------------------------------------- writes
    def write_slots(self, kv_cache, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write tokens' ``keys`` / ``values`` ``[T, H, D]`` at physical ``slots`` ``[T]`` (int64; < 0: skipped)."""
        if self.writer is not None:
            self.writer(kv_cache, slots, keys, values)
            return
        keep = slots >= 0
        slots, keys, values = slots[keep], keys[keep], values[keep]
        bs = kv_cache.shape[2]
        block, offset = slots // bs, slots % bs
        k, v = self.views(kv_cache)
        # [T, H, D] into [blocks, H, bs, D] at (block[t], :, offset[t]): advanced indexing puts the T axis first
        k[block, :, offset] = keys.to(k.dtype)
        v[block, :, offset] = values.to(v.dtype)

    def write_front(self, kv_cache, block_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys`` / ``values`` ``[B, H, K, D]`` into physical slots ``0 .. K-1`` of each row's blocks.

        Each KV head may hold a different token in the same slot (heads keep different tokens): slot ``j`` of a row
        receives ``keys[:, :, j]``, one vector per head, as if it were one token. ``keys`` must not be a view of
        ``kv_cache`` (a compaction gathers copies first, so moves that overlap in place are safe).
        """
        b, h, k, d = keys.shape
        bs = kv_cache.shape[2]
        j = torch.arange(k, device=block_rows.device)
        slots = (block_rows[:, j // bs] * bs + j % bs).reshape(-1)
        self.write_slots(
            kv_cache,
            slots,
            keys.permute(0, 2, 1, 3).reshape(b * k, h, d).contiguous(),
            values.permute(0, 2, 1, 3).reshape(b * k, h, d).contiguous(),
        )


class HeadMajorKT(PagedLayout):
    """vLLM's CPU backend with ISA ``vec`` / ``vec16``, as its source lays it out: per (block, KV head), keys
    transposed ``[D, block_size]`` then values ``[block_size, D]``, read through views (no index gather). Used where
    :func:`probe` finds this layout (:func:`vase.vllm.paged.cpu_layout`), and the reference the probe is tested
    against."""

    name = "cpu-vec"

    def views(self, kv_cache):
        nb, h, bs, d2 = kv_cache.shape
        d = d2 // 2
        flat = kv_cache.reshape(nb, h, bs * d2)  # a view: the cache is contiguous
        keys = flat[..., : bs * d].view(nb, h, d, bs).transpose(2, 3)  # [nb, H, bs, D] over the transposed keys
        values = flat[..., bs * d :].view(nb, h, bs, d)
        return keys, values


class SplitKV(PagedLayout):
    """The GPU backends' layout (Triton, FlashAttention): the last axis is a token's key then its value, ``D`` each,
    in whatever physical order the strides give (token-major ``[blocks, block_size, H, 2D]`` in memory, or
    head-major)."""

    name = "split"

    def views(self, kv_cache):
        d = kv_cache.shape[-1] // 2
        return kv_cache[..., :d], kv_cache[..., d:]


class ProbedLayout(PagedLayout):
    """A layout read off the backend's own cache write (:func:`probe`): where each key and value element of a
    (block, KV head) lands among its ``block_size x C`` elements.

    Args:
        writer: the backend's cache write (every write goes through it).
        key_map, value_map: ``[block_size, D]`` int64: the element of a (block, KV head) holding slot ``i``'s
            element ``d``, for keys and for values.
    """

    def __init__(self, writer: Writer, key_map: torch.Tensor, value_map: torch.Tensor, name: str = "probed"):
        super().__init__(writer)
        self.key_map, self.value_map, self.name = key_map, value_map, name

    def read(self, kv_cache, ids):
        nb, h, bs, c = kv_cache.shape
        blocks = kv_cache.reshape(nb, h, bs * c)[ids]  # [*ids, H, bs * C], the rows' blocks only
        return blocks[..., self.key_map], blocks[..., self.value_map]


def probe(writer: Writer, heads: int, block_size: int, head_dim: int, dtype: torch.dtype, name: str) -> ProbedLayout:
    """The layout of a backend's cache, read off its own write: marked tokens written into a scratch block of
    ``heads`` KV heads, ``block_size`` slots, head dim ``head_dim`` in ``dtype``, then found among its elements.

    Each element is marked by small integers (1 to 128: exact in any float dtype, bfloat16 included), one pass per
    base-128 digit of one coordinate: the slot, then the element's index within the head, for keys (values zero)
    and then for values (keys zero). The layout found is then checked on random entries written the same way.

    Raises:
        LayoutError: the write does not put every key and value element in one element of its own, as given (it
            transforms the values, or drops some): a layout vase cannot read back.
    """
    c = 2 * head_dim
    slots = torch.arange(block_size, dtype=torch.long)

    def written(side: str, marks: torch.Tensor) -> torch.Tensor:
        """The block's elements, head by head (``[H, block_size * C]``), after writing ``marks`` as one side."""
        cache = torch.zeros(1, heads, block_size, c, dtype=dtype)
        full = marks.expand(block_size, heads, head_dim).to(dtype).contiguous()
        zero = torch.zeros(block_size, heads, head_dim, dtype=dtype)
        writer(cache, slots, *((full, zero) if side == "key" else (zero, full)))
        return cache.reshape(heads, block_size * c).float()

    found = {}
    for side in ("key", "value"):
        held = torch.ones(heads, block_size * c, dtype=torch.bool)  # elements every pass of this side wrote
        coords = []
        for size, shape in ((block_size, (block_size, 1, 1)), (head_dim, (1, 1, head_dim))):
            coord, scale = torch.zeros(heads, block_size * c, dtype=torch.long), 1
            while scale == 1 or scale < size:
                got = written(side, (torch.arange(size) // scale % _BASE + 1).view(shape))
                held &= got > 0
                coord += (got.round().long() - 1).clamp_min(0) * scale
                scale *= _BASE
            coords.append(coord)
        slot, dim = coords
        if not bool((held.sum(-1) == block_size * head_dim).all()):
            raise LayoutError(f"{name}: the cache write does not store each {side} element once")
        index = torch.full((heads, block_size, head_dim), -1, dtype=torch.long)
        for h in range(heads):
            pos = held[h].nonzero().squeeze(1)
            index[h, slot[h, pos], dim[h, pos]] = pos
        if bool((index < 0).any()):
            raise LayoutError(f"{name}: the cache write does not store every {side} element of a head")
        if not bool((index == index[:1]).all()):
            raise LayoutError(f"{name}: the KV heads of a block are laid out differently")
        found[side] = index[0]
    layout = ProbedLayout(writer, found["key"], found["value"], name)
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(block_size, heads, head_dim, generator=g).to(dtype) for _ in range(2))
    cache = torch.zeros(1, heads, block_size, c, dtype=dtype)
    writer(cache, slots, keys, values)
    k, v = layout.read(cache, torch.zeros(1, dtype=torch.long))
    if not (torch.equal(k[0].transpose(0, 1), keys) and torch.equal(v[0].transpose(0, 1), values)):
        raise LayoutError(f"{name}: the cache write does not store the entries as given")
    return layout
