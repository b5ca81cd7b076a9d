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
    """Packs chunks into padded numpy StepInputs of exactly (num_tokens, max_seqs, pages_per_seq)."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > max_seqs:
        raise ValueError(f"{len(chunks)} sequences / {total} tokens do not fit bucket ({max_seqs}, {num_tokens})")
    tok = np.zeros(num_tokens, np.int32)
    pos = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    table = np.zeros((max_seqs, pages_per_seq), np.int32)
    ctx = np.zeros(max_seqs, np.int32)
    qsl = np.zeros(max_seqs + 1, np.int32)
    logits_idx = np.zeros(max_seqs, np.int32)
    targets = np.full(num_tokens, -1, np.int32)
    off = 0
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        p = np.arange(c.start, c.start + n, dtype=np.int32)
        pages = np.asarray(c.pages, np.int32)
        tok[off : off + n] = c.token_ids
        pos[off : off + n] = p
        slots[off : off + n] = pages[p // page_size] * page_size + p % page_size
        table[i, : len(pages)] = pages
        ctx[i] = c.start + n
        qsl[i + 1] = off + n
        logits_idx[i] = off + n - 1
        if c.target_ids is not None:
            targets[off : off + n] = c.target_ids
        off += n
    qsl[len(chunks) + 1 :] = off
    return StepInputs(tok, pos, slots, table, ctx, qsl, np.int32(len(chunks)), logits_idx, targets)
