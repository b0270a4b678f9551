"""Paged storage and ``PagedCache``: fixed-size pages in one pool, per-row block tables.

Shapes use the package alphabet (L layers, B rows, H kv heads, T new tokens, D head dim)
plus P pages in the pool, ``ps`` tokens per page, M pages per row at most (``max_length /
ps``) and D' for the stored last axis (D, or D / 2 for int4 codes).

A row's token at position ``p`` lives in page ``block_table[b, p // ps]`` at offset
``p % ps``, in every layer: one block table per row serves all layers (the pool is
``[L, P, H, ps, D']``, so a page id names the same slot range in every layer). Pages are
taken from the pool when a write first reaches them, so memory follows the tokens stored,
not ``max_length``, and rows of very different lengths share one budget.

Everything is arrays, so allocation happens inside ``jit``:

* ``refcount: int32[P]`` counts the holders of each page (rows' block tables, plus pins
  taken by a host-side prefix index with :meth:`PagedCache.retain`); a page is free iff
  its count is 0. A write that needs new pages takes the lowest free ids (``_first_free``:
  a static number of them); crop, reset and row selection release pages.
* Forking shares pages: ``batch_repeat_interleave``, ``reorder_cache``,
  ``batch_select_indices`` copy block-table entries and bump counts, never page data.
  A write into a page held by more than one row first copies that page (all layers) to a
  fresh one: copy-on-write. Only the page being written is copied, once; full pages of a
  shared prompt stay shared for ever.
* Running out of pages is never silent: eagerly the write raises ``ValueError`` naming
  the row and the pages it needs; under ``jit`` the rows that do not fit (served in row
  order, first come first served) store none of their new tokens, keep their length and
  get ``OUT_OF_PAGES``.
  Rows that fit are written normally. Tokens past ``max_length`` follow the container's
  overflow policy (dropped, ``OVERFLOW``).

Attention reads a :class:`~jaxkv.caches.views.PagedView` (block by block through the
block table, dequantizing int8/int4 pages in the loop), cost O(tokens stored).

The quantized variant (``bits=8`` or ``4``) stores codes and per-token scales like
:class:`~jaxkv.caches.QuantizedCache` (same codec) without its full-precision residual.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import register_dataclass

from jaxkv.caches._bits import from_bits, stored_dtype, to_bits
from jaxkv.caches._checks import (
    INVALID,
    _check_row_indices,
    _distinct_entries,
    _check_sizes,
    _floating_dtype,
    _is_traced,
    _static_int,
    _widen,
)
from jaxkv.caches.container import KVCache, storage_field
from jaxkv.caches.views import PagedView

Array = jax.Array

__all__ = ["NO_PAGE", "PagedCache", "PagedStorage"]

#: Block-table entry of a block that holds no page.
NO_PAGE = -1

_POOL_FIELDS = ("keys", "values", "key_scales", "value_scales")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _differentiable_plan(planned, pools, refcount, plan_inputs):
    """``planned(pools, refcount, plan_inputs)``: a write's page plan and copy-on-write, a
    loop of 0 or 1 trips that carries the pools (see ``_write``). Reverse mode cannot go
    through a loop whose trip count is computed, so ``jax.grad`` through a paged cache of two
    or more layers failed (review 68: from the second layer on, the pools carry the first
    layer's keys). The derivative of the copy is the same copy of the tangent pools, written
    as a plain gather and scatter (no copy: every destination dropped), which transposes.
    ``planned`` closes over static sizes only: every array it reads comes in as an operand
    (a closure over the write's arrays leaked them under remat or a scan over layers, where
    the rule runs in another trace: review 80)."""
    return planned(pools, refcount, plan_inputs)


@_differentiable_plan.defjvp
def _differentiable_plan_jvp(planned, primals, tangents):
    pools, refcount, plan_inputs = primals
    out = planned(pools, refcount, plan_inputs)
    src, dst = out[-2], out[-1]

    def copied(t):
        if t.dtype == jax.dtypes.float0:  # integer codes of quantized pages: no derivative
            return t
        # Each page not copied to gets its own index past the pool (dropped), so the indices
        # are unique: JAX transposes a scatter only then.
        pages = t.shape[1]
        unique = jnp.where(dst < pages, dst, pages + jnp.arange(dst.shape[0], dtype=dst.dtype))
        return t.at[:, unique].set(t[:, jnp.minimum(src, pages - 1)], mode="drop", unique_indices=True)

    tangent_pools = {f: copied(t) for f, t in tangents[0].items()}
    zeros = [np.zeros(x.shape, jax.dtypes.float0) for x in out[1:]]  # the plan: integers and masks
    return out, (tangent_pools, *zeros)


def _admit_one(left: Array, n: Array) -> tuple[Array, Array]:
    ok = n <= left
    return jnp.where(ok, left - n, left), ok


def _admit(need: Array, num_free: Array) -> Array:
    """bool[B]: rows that get their ``need[b]`` pages, first come first served (a row that
    does not fit takes nothing, and later rows may still fit); need 0 always fits. (The scan
    body is one module-level function: a closure made per call was a new program to compile
    on every eager ``put_rows``; review 81.)"""
    return jax.lax.scan(_admit_one, num_free, need)[1]


def _first_free(refcount: Array, n: int) -> tuple[Array, Array]:
    """``(ids, num_free)``: the ``n`` lowest ids of pages with count 0 (``num_pages`` past the
    last one), and how many there are. In blocks of up to 256 pages: one pass counts each
    block's free pages, a cumulative sum over the blocks finds the block of the k-th free page
    and a search inside that block its place (``jnp.nonzero(size=n)``, used before, runs a
    cumulative sum over every page; ``bench_paged.py --sections pool_rows``)."""
    num_pages = refcount.shape[0]
    width = min(256, num_pages)
    blocks = -(-num_pages // width)
    free = jnp.pad(refcount == 0, (0, blocks * width - num_pages)).reshape(blocks, width)
    per_block = jnp.sum(free, axis=1, dtype=jnp.int32)
    through = jnp.cumsum(per_block)  # free pages in blocks 0..j
    k = jnp.arange(1, n + 1, dtype=jnp.int32)  # the k-th free page, k = 1..n
    block = jnp.searchsorted(through, k, side="left").astype(jnp.int32)  # `blocks`: fewer than k free
    safe = jnp.minimum(block, blocks - 1)
    before = jnp.where(block > 0, through[jnp.maximum(block - 1, 0)], 0)
    inside = jnp.cumsum(free[safe].astype(jnp.int32), axis=1)  # [n, width]
    offset = jnp.argmax(inside >= (k - before)[:, None], axis=1).astype(jnp.int32)
    ids = jnp.where(block < blocks, block * width + offset, num_pages)
    return ids, through[-1]


def _page_counts(table: Array, num_pages: int) -> Array:
    """int32[P]: how many block-table entries name each page."""
    ids = jnp.where(table >= 0, table, num_pages).reshape(-1)
    return jnp.zeros((num_pages,), jnp.int32).at[ids].add(1, mode="drop")


@dataclasses.dataclass(frozen=True)
class PagedStorage:
    """A page pool shared by all rows, with per-row block tables and page refcounts.

    Attributes:
      keys: [L, P, H, ps, D'] key pages, as stored (16-bit floats as uint16 bits; int8 or
        packed-int4 codes when quantized).
      values: [L, P, H, ps, D'] value pages.
      key_scales: [L, P, H, ps] per-token key scales when quantized (stored like the
        pages), else [L, P, H, 0].
      value_scales: the same for values.
      block_table: int32[B, M] page of each row's block (``NO_PAGE``: none).
      refcount: int32[P] holders of each page (0: free).
      bits: static None (float pages), 8 or 4.
      dtype: static, the float dtype attention reads.
      scale_dtype: static dtype of the scales (quantized only).
    """

    keys: Array
    values: Array
    key_scales: Array
    value_scales: Array
    block_table: Array
    refcount: Array
    bits: int | None  # static
    dtype: Any  # static
    scale_dtype: Any  # static

    LEAF_AXES: ClassVar[dict] = {
        "keys": ("layer", "pages", "heads", "page", "packed"),
        "values": ("layer", "pages", "heads", "page", "packed"),
        "key_scales": ("layer", "pages", "heads", "page"),
        "value_scales": ("layer", "pages", "heads", "page"),
        "block_table": ("batch", "blocks"),
        "refcount": ("pages",),
    }

    @classmethod
    def zeros(cls, num_layers, batch_size, num_kv_heads, head_dim, num_pages, page_size, max_pages, bits, dtype,
              scale_dtype) -> PagedStorage:
        lead = (num_layers, num_pages, num_kv_heads, page_size)
        if bits is None:
            pages, codes = stored_dtype(dtype), head_dim
            scales = (num_layers, num_pages, num_kv_heads, 0)
        else:
            pages, codes = (jnp.int8 if bits == 8 else jnp.uint8), (head_dim if bits == 8 else head_dim // 2)
            scales = lead
        return cls(
            keys=jnp.zeros((*lead, codes), pages),
            values=jnp.zeros((*lead, codes), pages),
            key_scales=jnp.zeros(scales, stored_dtype(scale_dtype)),
            value_scales=jnp.zeros(scales, stored_dtype(scale_dtype)),
            block_table=jnp.full((batch_size, max_pages), NO_PAGE, jnp.int32),
            refcount=jnp.zeros((num_pages,), jnp.int32),
            bits=bits,
            dtype=jnp.dtype(dtype),
            scale_dtype=jnp.dtype(scale_dtype),
        )

    num_layers = property(lambda self: self.keys.shape[0])
    num_pages = property(lambda self: self.keys.shape[1])
    num_kv_heads = property(lambda self: self.keys.shape[2])
    page_size = property(lambda self: self.keys.shape[3])
    max_pages = property(lambda self: self.block_table.shape[-1])
    capacity = property(lambda self: self.block_table.shape[-1] * self.keys.shape[3])
    head_dim = property(lambda self: self.keys.shape[4] * (2 if self.bits == 4 else 1))

    # ---- pool access

    def _pools(self) -> dict:
        return {f: getattr(self, f) for f in _POOL_FIELDS}

    def _encode(self, states: Array) -> tuple[Array, Array | None]:
        """[B, H, T, D] states -> (stored codes [B, H, T, D'], stored scales [B, H, T] or None)."""
        if self.bits is None:
            return to_bits(states, self.dtype), None
        from jaxkv.caches.quantized import quantize  # the codec lives with its storage

        codes, scales = quantize(states, self.bits, scale_dtype=self.scale_dtype)
        return codes, to_bits(scales, self.scale_dtype)

    # ---- the storage protocol

    #: The container passes every layer's lengths (``all_lengths`` [L, B]) to ``write``.
    WANTS_ALL_LENGTHS: ClassVar[bool] = True

    def write(self, read_layer, write_layer, layer_ok, keys, values, old, count, *, all_lengths):
        del read_layer, layer_ok  # a bad layer has count 0 and writes at `write_layer` == L: dropped
        args = (write_layer, keys, values, old, count, all_lengths)
        if _is_traced(self.block_table, self.refcount, self.keys, *args):
            new, count, _ = self._write(*args)
            return new, None, count
        # Eagerly: one compiled program for the whole write (op by op, the first write of a
        # shape compiled ~150 small programs: 4.3 s against 0.2 s for a static cache), then
        # the out-of-pages check on what it returns; raising discards the new storage.
        new, count, (per_row, fits, num_free) = _write_program(self, jnp.asarray(write_layer, jnp.int32), *args[1:])
        host_fits = np.asarray(fits)
        if not host_fits.all():
            host_need = np.asarray(per_row)
            row = int(np.argmax(~host_fits))
            raise ValueError(
                f"PagedCache.update: out of pages: row {row} needs {int(host_need[row])} new page(s) of "
                f"{self.page_size} tokens, but the pool has {int(num_free)} free of {self.num_pages} (rows before "
                f"it take {int(np.sum(host_need[:row][host_fits[:row]]))}). Free pages (reset or "
                "batch_select_indices finished rows, crop, release prefix pins) or allocate a larger num_pages."
            )
        return new, None, count

    @staticmethod
    def _plan_pages(sizes, table, refcount, all_lengths, old, blk, cur, touched, held, holders, shared, rows):
        """The pages a write takes: ``(need, shared, fresh, per_row, fits, num_free)``, where
        ``need`` [B, K] marks blocks that get a fresh page (none yet, or copy-on-write),
        ``shared`` [B, K] those whose current page is copied into it, ``fresh`` [B * K] the
        page ids (``num_pages``: none), ``fits`` [B] the rows whose pages are all available.
        ``shared`` comes in as the touched blocks whose page has other holders. ``sizes``:
        ``(page_size, max_pages, num_pages)``."""
        ps, max_pages, num_pages = sizes
        batch = table.shape[0]
        # A writer may keep a shared page and write into it in place when no other holder
        # sees any slot of that page at or past where it writes (in every layer) and no pin
        # (a prefix index) holds it. Holders are table entries (row, block): a page attached
        # at another block of another row (attach_prefix) is compared slot by slot within
        # the page, not by position. Forked rows taking their next token: n holders, n - 1
        # copies. One keeper per page.
        def keepers(_):
            extent = jnp.max(all_lengths, axis=0)  # [B] tokens each row holds in its longest layer
            entries = jnp.where(table >= 0, table, num_pages).reshape(-1)
            entry_id = jnp.arange(batch * max_pages, dtype=jnp.int32)
            entry_block = entry_id % max_pages
            entry_seen = jnp.clip(extent[entry_id // max_pages] - entry_block * ps, 0, ps)  # slots of the page it sees
            row_holders = jnp.zeros((num_pages,), jnp.int32).at[entries].add(1, mode="drop")
            # The two entries seeing most of each page: the most any *other* entry sees.
            top = jnp.full((num_pages,), -1, jnp.int32).at[entries].max(entry_seen, mode="drop")
            top_entry = jnp.full((num_pages,), batch * max_pages, jnp.int32).at[
                jnp.where(entry_seen == top[jnp.minimum(entries, num_pages - 1)], entries, num_pages)
            ].min(entry_id, mode="drop")
            second = jnp.full((num_pages,), -1, jnp.int32).at[
                jnp.where(entry_id == top_entry[jnp.minimum(entries, num_pages - 1)], num_pages, entries)
            ].max(entry_seen, mode="drop")
            safe_cur = jnp.maximum(cur, 0)
            own_entry = rows * max_pages + jnp.minimum(blk, max_pages - 1)
            others = jnp.where(top_entry[safe_cur] == own_entry, second[safe_cur], top[safe_cur])  # [B, K]
            write_from = jnp.clip(old[:, None] - blk * ps, 0, ps)  # the first slot of the page it writes
            eligible = shared & (row_holders[safe_cur] == holders) & (others <= write_from)
            first = jnp.full((num_pages,), batch, jnp.int32).at[jnp.where(eligible, cur, num_pages)].min(
                jnp.broadcast_to(rows, blk.shape), mode="drop"
            )
            keeps = eligible & (first[safe_cur] == rows)
            return keeps

        # Only a write into a page with other holders needs the holders' analysis ([P]-sized
        # scatters): forks and prefix hits, not a batch of rows each taking a fresh page.
        keeps = jax.lax.cond(jnp.any(shared), keepers, lambda _: jnp.zeros(shared.shape, bool), None)
        shared = shared & ~keeps
        need = touched & (~held | shared)  # a fresh page: none yet, or copy-on-write
        free_ids, num_free = _first_free(refcount, need.size)
        per_row = jnp.sum(need, axis=1, dtype=jnp.int32)
        fits = _admit(per_row, num_free)
        need = need & fits[:, None]
        shared = shared & fits[:, None]
        flat = need.reshape(-1)
        rank = jnp.cumsum(flat.astype(jnp.int32)) - 1
        fresh = jnp.where(flat, free_ids[jnp.clip(rank, 0, flat.shape[0] - 1)], num_pages)  # [B*K]

        return need, shared, fresh, per_row, fits, num_free

    def _write(self, write_layer, keys, values, old, count, all_lengths):
        """The write as a pure function: ``(storage, count stored [B], (pages each row needs
        [B], rows that fit [B], free pages))``. Rows that do not fit store nothing."""
        ps, max_pages, num_pages = self.page_size, self.max_pages, self.num_pages
        batch, _, new_tokens, _ = keys.shape
        table, refcount = self.block_table, self.refcount
        rows = jnp.arange(batch, dtype=jnp.int32)[:, None]

        # The blocks a row's new tokens land in: at most this many per row (static).
        span = min(max_pages, (new_tokens - 1 + ps - 1) // ps + 1)
        end = old + count
        blk = (old // ps)[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]  # [B, K]
        in_range = blk < max_pages
        # A row that writes nothing touches no page (a partial shared page is not copied for it:
        # a padding row of take_rows, counted by no refcount, would take a holder's count away).
        touched = in_range & (count[:, None] > 0) & (blk * ps < end[:, None])
        cur = jnp.where(in_range, jnp.take_along_axis(table, jnp.minimum(blk, max_pages - 1), axis=1), NO_PAGE)
        held = cur >= 0
        holders = refcount[jnp.maximum(cur, 0)]
        shared = touched & held & (holders > 1)
        # The page plan below reads per-page arrays ([P]: refcounts, holders, free ids): O(pool)
        # work. A step whose rows all write into pages they alone hold (a decode step, save
        # one in every page_size tokens, and every layer after the first of a step) needs
        # none of it: a loop of 0 trips skips it (with the plan on every write, the decode step
        # of ``bench_paged.py --sections pool`` was 1.84x slower over a 128K-token pool than
        # over 1K, 5.73x over 1M).
        needs_plan = jnp.any(touched & (~held | shared))
        # Tie the copy-on-write to this layer's new keys (``dst`` is unchanged: it is at most
        # ``num_pages``). Without a data dependence XLA may run the pool copy before the
        # previous layer's attention has read the pool, and then keeps that read valid by
        # copying the whole pool: 4 pool copies per 2-layer decode step, measured.
        sign = jax.lax.bitcast_convert_type(jnp.sum(keys.reshape(-1)[:1].astype(jnp.float32)), jnp.uint32) >> 31

        sizes = (ps, max_pages, num_pages)
        plan_pages = self._plan_pages

        def plan_and_copy(inputs, _, carry):
            # The plan and the copy-on-write are a loop of 0 or 1 trips carrying the pools
            # (not lax.cond, which would copy the pool into its branches): one trip count per
            # write, as the copy alone had, so a device runs no more conditionals than before.
            # The counts come through the carry and change in it: XLA hoists what a body
            # computes from values the loop does not change (loop-invariant code motion), and
            # the plan would run on every write again.
            table, all_lengths, old, blk, cur, touched, held, holders, shared, rows, sign = inputs
            counts = carry[1]
            need, copied, fresh, per_row, fits, num_free = plan_pages(
                sizes, table, counts, all_lengths, old, blk, cur, touched, held, holders, shared, rows)
            src = jnp.where(copied.reshape(-1), cur.reshape(-1), num_pages)
            dst = jnp.minimum(jnp.where(copied.reshape(-1), fresh, num_pages), num_pages + sign.astype(jnp.int32))

            def copy_pages(_, pools):  # every layer of each shared page at once
                safe = jnp.minimum(src, num_pages - 1)
                return {f: x.at[:, dst].set(x[:, safe], mode="drop") for f, x in pools.items()}

            counts = counts.at[fresh].add(1, mode="drop").at[src].add(-1, mode="drop")  # pages taken and left
            pools = jax.lax.fori_loop(0, jnp.any(copied).astype(jnp.int32), copy_pages, carry[0])
            return pools, counts, need, fresh, per_row, fits, num_free, src, dst

        # Without a plan: nothing to allocate or copy (num_free is only read when a row does not fit).
        def planned(pools, refcount, plan_inputs):  # closes over static sizes only (see _differentiable_plan)
            needs_plan, inputs = plan_inputs
            unplanned = jnp.full((batch * span,), num_pages, jnp.int32)
            carry = (pools, refcount, jnp.zeros((batch, span), bool), unplanned, jnp.zeros((batch,), jnp.int32),
                     jnp.ones((batch,), bool), jnp.int32(-1), unplanned, unplanned)
            return jax.lax.fori_loop(0, needs_plan.astype(jnp.int32), functools.partial(plan_and_copy, inputs), carry)

        plan_inputs = (needs_plan, (table, all_lengths, old, blk, cur, touched, held, holders, shared, rows, sign))
        pools, refcount, need, fresh, per_row, fits, num_free, _, _ = _differentiable_plan(
            planned, self._pools(), refcount, plan_inputs)
        fresh = fresh.reshape(batch, span)
        table = table.at[rows, jnp.where(in_range, blk, max_pages)].set(
            jnp.where(need, fresh, cur), mode="drop"
        )

        # The tokens themselves, through the new table.
        count = jnp.where(fits, count, 0)
        t = jnp.arange(new_tokens, dtype=jnp.int32)[None, :]
        pos = old[:, None] + t  # [B, T]
        valid = (t < count[:, None]) & (pos < self.capacity)
        page = jnp.take_along_axis(table, jnp.clip(pos // ps, 0, max_pages - 1), axis=1)
        page = jnp.where(valid & (page >= 0), page, num_pages)  # `num_pages`: dropped
        offset = pos % ps
        for name, states in (("keys", keys), ("values", values)):
            codes, scales = self._encode(states)
            pools[name] = pools[name].at[write_layer, page, :, offset].set(jnp.moveaxis(codes, 2, 1), mode="drop")
            if scales is not None:
                scale_name = "key_scales" if name == "keys" else "value_scales"
                pools[scale_name] = pools[scale_name].at[write_layer, page, :, offset].set(
                    jnp.moveaxis(scales, 2, 1), mode="drop"
                )
        new = dataclasses.replace(self, **pools, block_table=table, refcount=refcount)
        return new, count, (per_row, fits, num_free)

    def view(self, layer: Any, lengths: Array) -> PagedView:
        return PagedView(
            self.keys, self.values, self.key_scales, self.value_scales, self.block_table, layer, lengths,
            self.bits, self.dtype, self.scale_dtype,
        )

    def _release(self, drop: Array) -> PagedStorage:
        """Releases the block-table entries where ``drop`` (bool[B, M]) is true."""
        gone = jnp.where(drop, self.block_table, NO_PAGE)
        return dataclasses.replace(
            self,
            block_table=jnp.where(drop, NO_PAGE, self.block_table),
            # a scatter of the table's entries onto the counts: O(B * M), not O(pool) (a crop
            # every speculative step would otherwise scan the pool's counts)
            refcount=self.refcount.at[jnp.where(gone >= 0, gone, self.num_pages).reshape(-1)].add(-1, mode="drop"),
        )

    def crop(self, old: Array, new: Array, **_: Any):
        # Pages wholly past every layer's new length go back to the pool.
        keep = (jnp.max(new, axis=0) + self.page_size - 1) // self.page_size  # [B]
        blocks = jnp.arange(self.max_pages, dtype=jnp.int32)[None, :]
        return self._release(blocks >= keep[:, None]), jnp.zeros(new.shape, bool)

    def reset_rows(self, rows: Array) -> PagedStorage:
        return self._release(jnp.broadcast_to(rows[:, None], self.block_table.shape))

    def map_rows(self, fn) -> PagedStorage:
        """Row gather/repeat: block tables move, pages are shared (counts follow)."""
        table = fn(self.block_table, 0)
        refcount = self.refcount + _page_counts(table, self.num_pages) - _page_counts(self.block_table, self.num_pages)
        return dataclasses.replace(self, block_table=table, refcount=refcount)

    def put_rows(self, idx: Array, other: PagedStorage) -> tuple[PagedStorage, Array]:
        """Copies the rows of ``other`` (their pages, every layer) into rows ``idx`` of this
        pool, taking fresh pages; returns ``(storage, stored bool[N])`` (rows that did not
        fit store nothing)."""
        if (other.page_size, other.max_pages, other.bits) != (self.page_size, self.max_pages, self.bits):
            raise ValueError(
                "PagedCache.put_rows: the other cache has page_size/max_pages/bits "
                f"{(other.page_size, other.max_pages, other.bits)}, this one "
                f"{(self.page_size, self.max_pages, self.bits)}; they must agree."
            )
        n, num_pages = idx.shape[0], self.num_pages
        # A row named twice: the last one wins (as a scatter would); earlier ones store nothing.
        later = jnp.triu(idx[:, None] == idx[None, :], k=1).any(axis=1)
        target = jnp.zeros((self.block_table.shape[0],), bool).at[idx].set(True, mode="drop")
        base = self.reset_rows(target)
        theirs = jnp.where(later[:, None], NO_PAGE, other.block_table)  # [N, M]
        need = theirs >= 0
        free = base.refcount == 0
        fits = _admit(jnp.sum(need, axis=1, dtype=jnp.int32), jnp.sum(free, dtype=jnp.int32))
        # A dropped (out-of-range, traced) row takes no page: its pages would be held by no row.
        fits = fits & (idx < self.block_table.shape[0])
        # (Skipped entries of a masked put_rows come as idx == B: they raise nothing.)
        short = None if _is_traced(fits) else ~np.asarray(fits) & (np.asarray(idx) < self.block_table.shape[0])
        if short is not None and short.any():
            row = int(np.argmax(short))
            raise ValueError(
                f"PagedCache.put_rows: out of pages: row {int(np.asarray(idx)[row])} needs "
                f"{int(np.sum(np.asarray(need)[row]))} page(s), the pool has {int(np.sum(np.asarray(free)))} free "
                f"of {num_pages}. Free rows first or allocate a larger num_pages."
            )
        need = need & fits[:, None]
        flat = need.reshape(-1)
        rank = jnp.cumsum(flat.astype(jnp.int32)) - 1
        free_ids, _ = _first_free(base.refcount, flat.shape[0])
        fresh = jnp.where(flat, free_ids[jnp.clip(rank, 0, flat.shape[0] - 1)], num_pages)
        src = jnp.where(flat, theirs.reshape(-1), 0)
        pools = {
            f: getattr(base, f).at[:, fresh].set(getattr(other, f)[:, src].astype(getattr(base, f).dtype), mode="drop")
            for f in _POOL_FIELDS
        }
        stored = fits & ~later
        table = base.block_table.at[jnp.where(stored, idx, self.block_table.shape[0])].set(
            jnp.where(need, fresh.reshape(need.shape), NO_PAGE), mode="drop"
        )
        refcount = base.refcount.at[fresh].add(1, mode="drop")
        return dataclasses.replace(base, **pools, block_table=table, refcount=refcount), stored | later

    def one_row_filled(self, num_tokens: int) -> PagedStorage:
        """A one-row storage (host or concrete arrays) cut to the row's own filled part: a
        pool of just the pages holding its first ``num_tokens`` tokens, renumbered 0, 1, ..
        in block order, with the slots past ``num_tokens`` zeroed (a page shared with a
        fork may hold the other row's tokens there). What ``save_sequence`` writes: the
        rest of the pool is other rows' data, and its size is the pool's, not the row's."""
        table = np.asarray(self.block_table)
        if table.shape[0] != 1:
            raise ValueError(f"PagedStorage.one_row_filled: expected one row, got {table.shape[0]}")
        ps = self.page_size
        used = -(-int(num_tokens) // ps)
        pages = table[0, :used]
        if used > self.max_pages or (pages < 0).any() or (pages >= self.num_pages).any():
            raise ValueError(
                f"PagedStorage.one_row_filled: the row's block table {table[0].tolist()} does not hold "
                f"{num_tokens} tokens in pages of {ps}"
            )
        filled = (np.arange(used * ps) < num_tokens).reshape(used, 1, ps)  # [used, 1 (heads), ps]
        pools = {}
        for f in _POOL_FIELDS:
            x = np.asarray(getattr(self, f))[:, pages]  # [L, used, H, ps, ...]
            keep = filled.reshape(filled.shape + (1,) * (x.ndim - 4))
            pools[f] = np.where(keep, x, np.zeros((), x.dtype)) if x.size else x
        new_table = np.full(table.shape, NO_PAGE, np.int32)
        new_table[0, :used] = np.arange(used, dtype=np.int32)
        return dataclasses.replace(self, **pools, block_table=new_table, refcount=np.ones((used,), np.int32))

    # ---- pages held outside the rows (a prefix index)

    def pinned(self, pages: Array, delta: int) -> PagedStorage:
        ids = jnp.where(pages >= 0, pages, self.num_pages)
        return dataclasses.replace(self, refcount=self.refcount.at[ids].add(delta, mode="drop"))


def _rows_or(x: Any, stop: int, fill: int) -> Array:
    """Integer ``x`` as int32, every entry outside ``[0, stop)`` replaced by ``fill``.

    The range is tested in ``x``'s own dtype (on the host when ``x`` is concrete), so a
    wide value such as an int64 ``2**32 + 1`` is never wrapped into range by the narrowing.
    """
    if _is_traced(x):
        x = _widen(x)
        return jnp.where((x >= 0) & (x < stop), x.astype(jnp.int32), jnp.int32(fill))
    host = np.asarray(x)
    if host.size == 0:
        return jnp.zeros(host.shape, jnp.int32)
    if not np.issubdtype(host.dtype, np.integer):
        raise TypeError(f"PagedCache: expected integer rows, pages or counts, got dtype {host.dtype}.")
    return jnp.asarray(np.where((host >= 0) & (host < stop), host, fill).astype(np.int32))


def _distinct_rows(rows: Any, batch_size: int, who: str) -> Array:
    """:func:`_rows_or` for take/merge: padding is ``batch_size``, and a row named again
    after its first entry is an error (concrete rows) or padding (traced)."""
    idx = _rows_or(rows, batch_size, batch_size)  # 2**32 + 1 is padding, never row 1
    # Checked on the host in the rows' own dtype (inside a trace ``idx`` is staged into it).
    checked = _distinct_entries(rows if not _is_traced(rows) else idx, batch_size, who,
                                f"pad with {batch_size} or more: padding rows hold nothing")
    return idx if not _is_traced(rows) else checked


@jax.jit
def _write_program(store, write_layer, keys, values, old, count, all_lengths):
    return store._write(write_layer, keys, values, old, count, all_lengths)


register_dataclass(
    PagedStorage,
    data_fields=["keys", "values", "key_scales", "value_scales", "block_table", "refcount"],
    meta_fields=["bits", "dtype", "scale_dtype"],
)


class PagedCache(KVCache):
    """Cache whose tokens live in fixed-size pages of one pool, shared across rows.

    One :class:`PagedStorage`; the container policy and every op are those of
    :class:`jaxkv.caches.container.KVCache`. Rows take pages as they grow, so a pool
    sized for the tokens actually stored serves many more rows than per-row capacity
    would; forks share pages (copy-on-write). See the module docstring.

    Example:
      >>> cache = PagedCache.init(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=4,
      ...                         max_length=64, page_size=16, num_pages=6)
      >>> k = jnp.ones((2, 1, 20, 4))
      >>> cache, keys, values = cache.update(k, k, 0, num_new=jnp.array([20, 3]))
      >>> cache.free_pages, cache.seq_lengths(0).tolist()
      (3, [20, 3])
      >>> forked = cache.batch_repeat_interleave(2)   # shares pages: still 3 free
      >>> forked.free_pages
      3
    """

    @classmethod
    def init(
        cls,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        page_size: int = 16,
        num_pages: int | None = None,
        bits: int | None = None,
        dtype: Any = jnp.float32,
        scale_dtype: Any = jnp.bfloat16,
        sharding: jax.sharding.NamedSharding | None = None,
    ) -> PagedCache:
        """Allocates an empty paged cache.

        Args:
          num_layers, batch_size, num_kv_heads, head_dim: sizes (ints >= 1).
          max_length: tokens one row may hold (its block table has
            ``ceil(max_length / page_size)`` entries; capacity rounds up to whole pages).
          page_size: tokens per page, a power of two (16 by default, as vLLM).
          num_pages: pages in the pool shared by all rows (all layers of a page together).
            Default: enough for every row at ``max_length`` (no saving; size it for the
            tokens you expect to hold at once).
          bits: None for float pages, 8 or 4 for int8 / int4 codes with per-token scales.
          dtype: the float dtype attention reads (and float pages store).
          scale_dtype: dtype of the scales of quantized pages.
          sharding: optional ``NamedSharding`` of one layer's ``[B, H, S, D]``: the pool
            follows its heads axis, block tables and lengths its batch axis.

        Raises:
          ValueError: a size < 1, a page size that is not a power of two, bits not
            None/8/4, an odd head_dim with int4.
          TypeError: a non-floating dtype.
        """
        who = "PagedCache.init"
        _check_sizes(
            who, num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
            max_length=max_length, page_size=page_size,
        )
        if page_size & (page_size - 1):
            raise ValueError(f"{who}: page_size must be a power of two (attention reads whole pages), got {page_size}.")
        max_pages = -(-max_length // page_size)
        if num_pages is None:
            num_pages = batch_size * max_pages
        _check_sizes(who, num_pages=num_pages)
        if bits is not None:
            if _static_int(bits) not in (8, 4):  # an int or NumPy int: not a bool, not 8.0
                raise ValueError(f"{who}: bits must be None (float pages), 8 or 4, got {bits!r}.")
            bits = _static_int(bits)  # a Python int: it is static metadata (saved in file headers)
        if bits == 4 and head_dim % 2:
            raise ValueError(f"{who}: int4 packs two values per byte, so head_dim must be even, got {head_dim}.")
        dtype = _floating_dtype(dtype, who)
        scale_dtype = _floating_dtype(scale_dtype, who)
        return cls._allocate(
            lambda: [PagedStorage.zeros(num_layers, batch_size, num_kv_heads, head_dim, num_pages, page_size,
                                        max_pages, bits, dtype, scale_dtype)],
            num_layers=num_layers, batch_size=batch_size, groups=(0,) * num_layers, sharding=sharding,
        )

    # ---- the pool

    keys = storage_field("keys", "[L, P, H, ps, D'] key pages (16-bit floats: from the stored bits; int8 / int4 "
                         "pages: their codes as stored, scales in stores[0].key_scales).", dtype_of="dtype")
    values = storage_field("values", "[L, P, H, ps, D'] value pages (as keys).", dtype_of="dtype")
    block_table = storage_field("block_table", "int32[B, M]: page of each block of each row (-1: none).")
    refcount = storage_field("refcount", "int32[P]: holders of each page (0: free).")
    page_size = storage_field("page_size", "Tokens per page.")
    num_pages = storage_field("num_pages", "Pages in the pool.")
    max_pages = storage_field("max_pages", "Block-table entries per row.")
    max_length = storage_field("capacity", "Tokens one row can hold (max_pages * page_size).")
    bits = storage_field("bits", "None, 8 or 4.")

    def get_max_length(self) -> int:
        return self.max_length

    @property
    def free_pages(self) -> int | Array:
        """Pages no row or pin holds: an int eagerly, an int32 scalar under jit."""
        n = jnp.sum(self.refcount == 0, dtype=jnp.int32)
        return n if _is_traced(n) else int(n)

    @property
    def out_of_pages(self) -> Array:
        """bool[B]: rows that lost a write because the pool had no free page (sticky)."""
        from jaxkv.caches._checks import OUT_OF_PAGES

        return (self.flags & OUT_OF_PAGES) != 0

    def row_pages(self, row: int) -> list[int]:
        """The pages row ``row`` holds, in position order (host)."""
        table = np.asarray(self.block_table[_check_row_indices(jnp.asarray([row]), self.batch_size, "row_pages")[0]])
        return [int(p) for p in table if p >= 0]

    def retain(self, pages: Any) -> PagedCache:
        """Pins ``pages`` (int[N], ``-1`` ignored): they stay allocated with no row holding
        them (a prefix index keeping a shared prompt). Undo with :meth:`release`."""
        return self._pinned(pages, 1, "PagedCache.retain")

    def release(self, pages: Any) -> PagedCache:
        """Drops one pin from each of ``pages`` (a page with no holder left is free).

        Releasing a page more times than it is pinned (a row's own page, a free page) is a
        ValueError eagerly; under ``jax.jit`` that page is not released and every row is
        flagged ``INVALID``, as are ids outside ``[0, num_pages)`` other than ``-1`` (for
        :meth:`retain` too)."""
        return self._pinned(pages, -1, "PagedCache.release")

    def take_rows(self, rows: Any) -> PagedCache:
        """A cache of just ``rows`` (int32[N]) that shares this one's pool: no page data
        moves and no count changes. Run a step on it, then :meth:`merge_rows` it back; in
        between, use only the sub-cache (its pool and counts are the live ones). Entries
        outside ``[0, batch_size)`` (negative ones too) are padding: empty rows (no pages,
        length 0) that should write nothing (``num_new`` 0); merging drops them and releases
        any page they took. A serving loop steps only its busy rows
        this way. A row named twice is an error eagerly; under ``jax.jit`` its later entries
        are padding (two entries holding one row's pages would let a step write in place
        into a page a row outside the sub-cache reads).
        """
        idx = _distinct_rows(rows, self.batch_size, "PagedCache.take_rows")
        safe = jnp.clip(idx, 0, self.batch_size - 1)
        pad = idx >= self.batch_size
        store = self.stores[0]
        # Padding holds no page: a copy of a real row's table would count as a second holder
        # of its pages, and the copy-on-write rule (which lets a page's only holders in the
        # step write in place) then let that row overwrite a page a row outside the
        # sub-cache still reads.
        table = jnp.where(pad[:, None], jnp.int32(NO_PAGE), store.block_table[safe])
        sub = dataclasses.replace(store, block_table=table)
        lengths = jnp.where(pad[None, :], 0, self.lengths[:, safe])
        flags = jnp.where(pad, 0, self.flags[safe])  # an empty row has no error of its own
        # laid out like every other op's result (a sharded cache: the pool stays as it is)
        return dataclasses.replace(self, stores=(sub,), lengths=lengths, flags=flags)._constrained()

    def merge_rows(self, rows: Any, sub: PagedCache) -> PagedCache:
        """Puts a :meth:`take_rows` sub-cache back: its pool and counts, and its rows'
        block tables, lengths and flags at ``rows`` (padding entries, outside ``[0,
        batch_size)``, dropped: a page one of them took is released, never held by no row).
        ``rows`` are those the sub-cache was taken with."""
        who = "PagedCache.merge_rows"
        if not isinstance(sub, PagedCache):
            raise TypeError(f"{who}: sub must be the PagedCache take_rows returned, got {type(sub).__name__}.")
        idx = _distinct_rows(rows, self.batch_size, who)
        if idx.shape != (sub.batch_size,):
            # One entry per sub row: a 1-row sub merged at 2 rows was copied onto both (the
            # second row read the first's tokens, its own page leaked; review 84).
            raise ValueError(f"{who}: rows must name one entry per row of sub ({sub.batch_size}), got shape "
                             f"{list(idx.shape)}; pass the rows take_rows was given.")
        mine, theirs = self.stores[0], sub.stores[0]
        # A sub row merged as padding (a write into a padding row, or rows merged to other
        # entries than they were taken from) held its pages alone: they stayed counted with
        # no row holding them, lost to the pool for good (review 77).
        dropped = jnp.where((idx >= self.batch_size)[:, None], theirs.block_table, NO_PAGE)
        released = theirs.pinned(dropped.reshape(-1), -1).refcount
        table = mine.block_table.at[idx].set(theirs.block_table, mode="drop")
        # Never below what the merged rows hold: merged at other entries than it was taken from
        # (rows [0, 1] taken, [0, padding] merged), a sub row shares its pages with the parent
        # row left as it was, which take_rows counted once (releasing them freed a page row 1
        # still read; review 82).
        refcount = jnp.maximum(released, _page_counts(table, self.num_pages))
        store = dataclasses.replace(theirs, block_table=table, refcount=refcount)
        return dataclasses.replace(
            self, stores=(store,), lengths=self.lengths.at[:, idx].set(sub.lengths, mode="drop"),
            flags=self.flags.at[idx].set(sub.flags, mode="drop"),
        )._constrained()

    def attach_prefix(self, row: Any, pages: Any, num_tokens: Any) -> PagedCache:
        """Makes the empty row ``row`` start with the tokens held in ``pages`` (int[N],
        full pages in position order, ``-1`` padding at the end): ``num_tokens`` tokens in
        every layer, sharing the pages (no copy). The prefill of a request whose prompt
        starts with a cached prefix then writes only the rest.

        Under ``jax.jit`` the same conditions are checked on the device: a call that breaks
        one attaches and pins nothing and flags the row ``INVALID`` (when the row itself is
        in range).

        Raises:
          ValueError: (eagerly) the row is not empty, ``num_tokens`` is not
            ``len(pages) * page_size``, a page is free (not held by a row or pin), or a
            ``-1`` comes before a page (a gap).
        """
        who = "PagedCache.attach_prefix"
        store = self.stores[0]
        # Concrete values are checked on the host in their own dtype (narrowing an int64
        # 2**32 + 1 to int32 first would make it row, page or count 1).
        pages = (pages if _is_traced(pages) else np.asarray(pages)).reshape(-1)
        if pages.shape[0] > store.max_pages:
            raise ValueError(f"{who}: {pages.shape[0]} pages exceed the {store.max_pages} a row can hold.")
        if not _is_traced(pages, row, num_tokens):
            r, host_pages, n = int(np.asarray(row)), np.asarray(pages), int(np.asarray(num_tokens))
            if not 0 <= r < self.batch_size:
                raise ValueError(f"{who}: row {r} is out of range for batch size {self.batch_size}.")
            if np.asarray(self.lengths[:, r]).any() or (np.asarray(store.block_table[r]) >= 0).any():
                raise ValueError(f"{who}: row {r} is not empty; reset it first.")
            used = host_pages[host_pages >= 0]
            if ((host_pages[:-1] < 0) & (host_pages[1:] >= 0)).any():
                raise ValueError(f"{who}: pages {host_pages.tolist()} have a gap; -1 may only pad the end (the row "
                                 "would read the gap's positions from another page).")
            if n != used.size * store.page_size:
                raise ValueError(
                    f"{who}: num_tokens={n} must be the pages' tokens ({used.size} full pages of {store.page_size})."
                )
            if ((host_pages < -1) | (host_pages >= store.num_pages)).any():
                raise ValueError(f"{who}: page ids {host_pages.tolist()} include one outside [0, {store.num_pages}).")
            if used.size and (np.asarray(store.refcount)[used] <= 0).any():
                raise ValueError(f"{who}: pages {used.tolist()} include a free page; retain cached pages first.")
        # Traced, the same checks as above: a call that fails one attaches and pins nothing,
        # and an in-range row is flagged INVALID (a count beyond the pages' tokens would
        # otherwise read the missing pages as page 0). Tested in each value's own dtype.
        pages = _widen(jnp.asarray(pages))
        bad_id = jnp.any((pages < -1) | (pages >= store.num_pages))
        row = _rows_or(row, self.batch_size, self.batch_size)
        in_range = row < self.batch_size
        num_tokens = _rows_or(num_tokens, store.max_pages * store.page_size + 1, -1)
        pages = _rows_or(pages, store.num_pages, -1)
        used = pages >= 0
        safe_row = jnp.minimum(row, self.batch_size - 1)
        empty = ~jnp.any(self.lengths[:, safe_row] != 0) & ~jnp.any(store.block_table[safe_row] >= 0)
        held = jnp.all(jnp.where(used, store.refcount[jnp.maximum(pages, 0)] > 0, True))
        count_ok = num_tokens == jnp.sum(used, dtype=jnp.int32) * store.page_size
        gap = jnp.any(~used[:-1] & used[1:])  # -1 only as padding at the end
        ok = in_range & empty & held & count_ok & ~bad_id & ~gap
        flags = self.flags.at[row].set(
            jnp.where(ok, self.flags[safe_row], self.flags[safe_row] | INVALID), mode="drop"
        )
        row = jnp.where(ok, row, self.batch_size)
        pages = jnp.where(ok, pages, -1)
        entries = jnp.full((store.max_pages,), NO_PAGE, jnp.int32).at[: pages.shape[0]].set(pages)
        table = store.block_table.at[row].set(entries, mode="drop")
        store = dataclasses.replace(store, block_table=table).pinned(pages, 1)
        lengths = self.lengths.at[:, row].set(num_tokens, mode="drop")
        return dataclasses.replace(self, stores=(store,), lengths=lengths, flags=flags)._constrained()

    def _pinned(self, pages: Any, delta: int, who: str) -> PagedCache:
        traced = _is_traced(pages)
        pages = pages if traced else np.asarray(pages)  # checked in its own dtype, never narrowed first
        if not traced and pages.size == 0:  # [] is float64 to NumPy: no pages, not a dtype error (review 84)
            pages = pages.astype(np.int32)
        if not jnp.issubdtype(pages.dtype, jnp.integer):
            raise TypeError(f"{who}: pages must be integer page ids, got dtype {pages.dtype}.")
        pages = pages.reshape(-1)
        store = self.stores[0]
        if not traced:
            bad = pages[(pages >= store.num_pages) | (pages < -1)]
            if bad.size:
                raise ValueError(f"{who}: page ids {bad.tolist()} are outside [0, {store.num_pages}).")
        pages = _widen(pages)
        ids = _rows_or(pages, store.num_pages, -1)  # traced ids outside [0, num_pages): -1
        refused = jnp.any((pages != -1) & (ids < 0)) if traced else False
        eager = not traced and not _is_traced(store.refcount)  # else the checks become a flag
        if delta < 0:
            # Only pins are released: a row's own reference is not a pin, and a page released
            # more times than it is pinned is not released at all (a row's own page would
            # become free while the row still reads it; the next write would hand it on).
            pins = store.refcount - _page_counts(store.block_table, store.num_pages)
            asked = jnp.zeros((store.num_pages,), jnp.int32).at[jnp.where(ids >= 0, ids, store.num_pages)].add(
                1, mode="drop")
            over = asked > pins
            if eager and bool(jnp.any(over)):
                under = np.flatnonzero(np.asarray(over))
                raise ValueError(
                    f"{who}: pages {under.tolist()} are not pinned (held {np.asarray(pins)[under].tolist()} time(s) "
                    "by a pin); release only what retain pinned. A row's own pages are freed by reset or crop."
                )
            skip = (ids >= 0) & over[jnp.maximum(ids, 0)]
            refused = refused | jnp.any(skip)
            ids = jnp.where(skip, -1, ids)
        if eager:
            return dataclasses.replace(self, stores=(store.pinned(ids, delta),))._constrained()
        # Under jit the errors above become a flag on every row (the op belongs to no row).
        flags = jnp.where(refused, self.flags | INVALID, self.flags)
        return dataclasses.replace(self, stores=(store.pinned(ids, delta),), flags=flags)._constrained()
