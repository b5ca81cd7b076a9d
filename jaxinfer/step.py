"""Step inputs: one ragged, fixed-shape batch that serves prefill chunks and decodes alike, and its buckets.

A step packs the new tokens of up to `num_seqs` sequences into one token axis:
    token_ids, positions, slot_mapping   i32[T]      (padding: token 0, position 0, slot -1 = not written)
    page_table                           i32[S, P]   pages of each sequence (rows >= num_seqs are padding)
    context_lens                         i32[S]      KV length of each sequence after this step's tokens
    query_start_loc                      i32[S + 1]  cumulative count of new tokens per sequence
    num_seqs                             i32[]
    logits_indices                       i32[S]      packed index of each sequence's last new token
    target_ids                           i32[T]      the next prompt token after each token (prompt_logprobs), or -1
Sampling parameters travel beside these, in `jaxinfer.sampling.SamplingTensors` with the same S rows.
T and S are rounded up to buckets, so a steady workload reuses a small, fixed set of compiled programs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    page_table: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    num_seqs: np.ndarray
    logits_indices: np.ndarray
    target_ids: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.context_lens.shape[0]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {f.name: getattr(self, f.name).shape for f in fields(self)}


def power_of_two_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, ... up to and including hi (hi itself is always a bucket)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


@dataclass(frozen=True)
class BucketTable:
    """The shapes a runner compiles. decode: S (= T) rows; mixed: T tokens over S rows, S one of `mixed_rows(T)`."""

    seq_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    mixed_seq_buckets: tuple[int, ...]  # rows of a mixed step before the cap at T; the last is max_num_seqs

    def mixed_rows(self, num_tokens: int) -> tuple[int, ...]:
        """The row counts the mixed step of token bucket `num_tokens` compiles for, ascending: a step holds at
        most one sequence per token, so no row count passes T."""
        return tuple(sorted({min(s, num_tokens) for s in self.mixed_seq_buckets}))


# Per backend: (extra small decode batches, smallest power-of-two decode batch, smallest token bucket, smaller row
# counts of a mixed step). CPU: a single stream decodes at batch 1 (a padded row costs its full share of the attention
# and sampler there; 2-7 rows cost about what 8 do, the step being bound by reading the weights). A mixed step of up
# to 8 sequences (a prompt arriving while few others decode) runs on 8 rows instead of max_num_seqs: the LM head and
# sampler of 128 rows were 20 ms of a 32-token prompt's 55 ms step on 2 cores (benchmarks/README.md). Accelerators
# run the LM head of 128 rows at the pace of reading its weights, so they compile no smaller mixed step. Each bucket
# is one more compile (the server compiles the smaller mixed steps while idle).
BUCKET_TABLE: dict[str, tuple[tuple[int, ...], int, int, tuple[int, ...]]] = {
    "cpu": ((1,), 8, 32, (8,)),
    "gpu": ((), 8, 32, ()),
    "tpu": ((), 8, 32, ()),
}


def bucket_table(backend: str, max_num_seqs: int, max_num_batched_tokens: int) -> BucketTable:
    """The bucket sets for this backend (an unknown backend gets the GPU row)."""
    seq_extra, seq_lo, tok_lo, mixed_small = BUCKET_TABLE.get(backend, BUCKET_TABLE["gpu"])
    seqs = power_of_two_buckets(min(seq_lo, max_num_seqs), max_num_seqs)
    return BucketTable(
        tuple(sorted({*(b for b in seq_extra if b < seqs[0]), *seqs})),
        power_of_two_buckets(min(tok_lo, max_num_batched_tokens), max_num_batched_tokens),
        tuple(sorted({*(b for b in mixed_small if b < max_num_seqs), max_num_seqs})),
    )


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class SeqChunk:
    """One sequence's part of a step: its new tokens start at `start` (tokens before are already cached)."""

    token_ids: list[int]  # the new tokens
    start: int  # absolute position of the first new token
    pages: list[int]  # the sequence's pages, covering start + len(token_ids) tokens
    target_ids: list[int] | None = None  # per new token, the prompt token that follows it (-1: none)


def pack(chunks: list[SeqChunk], num_tokens: int, max_seqs: int, pages_per_seq: int, page_size: int) -> StepInputs:
    """Packs chunks into padded numpy StepInputs of exactly (num_tokens, max_seqs, pages_per_seq) (one-off; the
    engine keeps a `StepPacker`, whose buffers and page tables live across steps)."""
    return StepPacker(pages_per_seq, page_size, max(1, len(chunks))).pack(chunks, num_tokens, max_seqs)


class PageTables:
    """Host page tables that live across steps: one row per sequence, written when its pages grow, so a step
    copies rows (one gather) instead of converting every sequence's page list again.

    A sequence is known by its page list object: the scheduler extends it in place as pages are allocated and
    replaces it when the pages are released (finish, preemption), which gives the sequence a fresh row.
    """

    def __init__(self, num_rows: int, pages_per_seq: int):
        self.table = np.zeros((num_rows, pages_per_seq), np.int32)
        self._rows: dict[int, list] = {}  # id(page list) -> [row, pages written, the list, last use]
        self._free = list(range(num_rows - 1, -1, -1))
        self._clock = 0

    def rows(self, page_lists: list[list[int]]) -> np.ndarray:
        """The table row of each page list, written up to date."""
        self._clock += 1
        out = np.empty(len(page_lists), np.int64)
        for i, pages in enumerate(page_lists):
            ent = self._rows.get(id(pages))
            if ent is None or ent[2] is not pages:
                ent = self._rows[id(pages)] = [self._take_row(), 0, pages, 0]
                self.table[ent[0]] = 0  # a recycled row: entries past the pages are 0, as a fresh table's
            row, written = ent[0], ent[1]
            if written < len(pages):
                self.table[row, written : len(pages)] = pages[written:]
                ent[1] = len(pages)
            ent[3] = self._clock
            out[i] = row
        return out

    def _take_row(self) -> int:
        if not self._free:  # recycle the rows of the lists unused the longest (gone, or not scheduled lately)
            stale = sorted(self._rows.items(), key=lambda kv: kv[1][3])[: max(1, len(self._rows) // 2)]
            for key, ent in stale:
                if ent[3] == self._clock:
                    break  # never a row of this step
                self._free.append(ent[0])
                del self._rows[key]
        return self._free.pop()


class StepPacker:
    """Packs SeqChunks into StepInputs in buffers allocated once per (T, S) bucket and reused every step (the
    transfer to the device copies them: jaxinfer.engine.transfer.to_flat)."""

    def __init__(self, pages_per_seq: int, page_size: int, max_seqs: int):
        self.pages_per_seq, self.page_size = pages_per_seq, page_size
        # Twice the live sequences: rows of finished or preempted sequences are recycled lazily.
        self.tables = PageTables(2 * max_seqs, pages_per_seq)
        self._buffers: dict[tuple[int, int], StepInputs] = {}

    def _buffer(self, num_tokens: int, max_seqs: int) -> StepInputs:
        buf = self._buffers.get((num_tokens, max_seqs))
        if buf is None:
            i32 = np.int32
            buf = self._buffers[(num_tokens, max_seqs)] = StepInputs(
                np.zeros(num_tokens, i32), np.zeros(num_tokens, i32), np.zeros(num_tokens, i32),
                np.zeros((max_seqs, self.pages_per_seq), i32), np.zeros(max_seqs, i32), np.zeros(max_seqs + 1, i32),
                np.int32(0), np.zeros(max_seqs, i32), np.zeros(num_tokens, i32),
            )  # fmt: skip
        buf.token_ids.fill(0)
        buf.positions.fill(0)
        buf.slot_mapping.fill(-1)
        buf.context_lens.fill(0)
        buf.query_start_loc.fill(0)
        buf.logits_indices.fill(0)
        buf.target_ids.fill(-1)
        return buf

    def pack(self, chunks: list[SeqChunk], num_tokens: int, max_seqs: int) -> StepInputs:
        """Padded StepInputs of exactly (num_tokens, max_seqs, pages_per_seq); valid until the next call."""
        total = sum(len(c.token_ids) for c in chunks)
        if total > num_tokens or len(chunks) > max_seqs:
            raise ValueError(f"{len(chunks)} sequences / {total} tokens do not fit bucket ({max_seqs}, {num_tokens})")
        b = self._buffer(num_tokens, max_seqs)
        rows = self.tables.rows([c.pages for c in chunks])
        b.page_table[: len(chunks)] = self.tables.table[rows]
        b.page_table[len(chunks) :] = 0
        ps, off = self.page_size, 0
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            p = np.arange(c.start, c.start + n, dtype=np.int32)
            b.token_ids[off : off + n] = c.token_ids
            b.positions[off : off + n] = p
            b.slot_mapping[off : off + n] = b.page_table[i, p // ps] * ps + p % ps
            b.context_lens[i] = c.start + n
            b.query_start_loc[i + 1] = off + n
            b.logits_indices[i] = off + n - 1
            if c.target_ids is not None:
                b.target_ids[off : off + n] = c.target_ids
            off += n
        b.query_start_loc[len(chunks) + 1 :] = off
        b.num_seqs = np.int32(len(chunks))
        return b
