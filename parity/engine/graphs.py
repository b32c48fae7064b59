"""Fixed-size engine steps, replayed from CUDA graphs: one launch instead of thousands per step.

A step of T tokens (up to the largest bucket: every decode step) is padded to the next bucket
and, on CUDA, replayed from that bucket's graph; on CPU the padded forward runs eagerly. Pad
tokens use their own slot (`pad_slot`) at position 0 and invariant kernels compute rows
independently, so padding changes no real token. Buckets have a decode graph and a mixed graph;
gathered SDPA is captured per power-of-two `span`. MoE routes recorded inside a graph are
overwritten by each replay and read back like an eager step's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.engine import forward
from parity.engine.overlap import Fill
from parity.kernels.attention import KVCache, native_reads_span
from parity.models import routing
from parity.models.loading import LoadedModel


def bucket_sizes(max_tokens: int) -> tuple[int, ...]:
    """Powers of two below max_tokens, then max_tokens: a step pads to at most 2x its tokens."""
    sizes = []
    size = 1
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return (*sizes, max_tokens)


@dataclass
class _Bucket:
    """One fixed step size (and span, longest run): inputs [3, size] int64 (token ids, positions,
    slots); on CUDA its graph and the graph's outputs: hidden [size, H] and, when routes are
    recorded, routes [size, moe_layers, top_k] int32 (None on CPU)."""

    inputs: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None
    routes: torch.Tensor | None = None


class StepGraphs:
    """Padded fixed-size forwards over one KV cache; captured as CUDA graphs on a CUDA device.

    The cache must not be reallocated while this object is used (graphs hold its addresses).
    """

    def __init__(self, lm: LoadedModel, cache: KVCache, pad_slot: int, max_tokens: int, stock_attention: bool,
                 record_routes: bool = False) -> None:
        self.lm = lm
        self.record_routes = record_routes
        self.cache = cache
        self.pad_slot = pad_slot
        self.sizes = bucket_sizes(max_tokens)
        self.device = cache.keys[0].device
        self.span_buckets = stock_attention and native_reads_span(self.device, cache.keys[0].dtype)
        self.run_buckets = self.device.type == "cuda" and not self.span_buckets
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.failure: str | None = None

    @property
    def status(self) -> str:
        """"cuda graphs", "eager (cpu)" or "eager (capture failed: <error>)"."""
        if self.failure is not None:
            return f"eager (capture failed: {self.failure})"
        return "cuda graphs" if self._pool is not None else "eager (cpu)"

    def fits(self, tokens: int) -> bool:
        """Whether a step of `tokens` packed tokens runs here."""
        return tokens <= self.sizes[-1]

    def run(self, ids: list[int], positions: list[int], slots: list[int], longest_run: int,
            fill: Fill | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [size, H] of one step (rows past len(ids) are padding), size >= len(ids), and
        its routes [size, moe_layers, top_k] int32 when recorded (else None); longest_run: most
        consecutive tokens of one slot in it; `fill`: ids already on the device."""
        size = next(s for s in self.sizes if s >= len(ids))
        span = self._span(max(positions))
        max_run = 1 if self.run_buckets and longest_run == 1 else size
        key = (size, span, max_run)
        bucket = self._buckets.get(key) or self._make(*key)
        pad = size - len(ids)
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [self.pad_slot] * pad])
        if bucket.graph is None:
            bucket.inputs.copy_(host)
            if fill is not None:
                fill.apply(bucket.inputs[0])
            return self._forward(bucket.inputs, span, max_run)
        # pinned staging: the copy is queued behind the previous step's work without a host sync
        bucket.inputs.copy_(host.pin_memory(), non_blocking=True)
        if fill is not None:
            fill.apply(bucket.inputs[0])
        bucket.graph.replay()
        return bucket.hidden, bucket.routes

    def warm(self) -> int:
        """Capture every bucket a step can use (each size; a decode and a mixed graph, or each span),
        so no later step pays a compile or a capture; returns the number of buckets made."""
        spans = [self.cache.capacity]
        if self.span_buckets:
            spans = sorted({self._span(p) for p in range(0, self.cache.capacity, self.cache.block)})
        made = 0
        for size in self.sizes:
            for span in spans:
                for max_run in ({1, size} if self.run_buckets else {size}):
                    if (size, span, max_run) not in self._buckets:
                        self._make(size, span, max_run)
                        made += 1
        return made

    def _span(self, position: int) -> int:
        """Cached positions a step whose highest position is `position` reads."""
        if not self.span_buckets:
            return self.cache.capacity
        blocks = position // self.cache.block + 1
        return min(self.cache.capacity, self.cache.block * 2 ** (blocks - 1).bit_length())

    def _forward(self, inputs: torch.Tensor, span: int, max_run: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return routing.run_routed(
            lambda: forward.final_hidden(self.lm, inputs[0:1], inputs[1:2], self.cache, inputs[2], span=span,
                                         max_run=max_run),
            self.lm.num_moe_layers, record=self.record_routes)

    def _make(self, size: int, span: int, max_run: int) -> _Bucket:
        """A bucket's input buffer and, on CUDA, its graph (captured on pad inputs: the pad slot only)."""
        bucket = _Bucket(inputs=torch.zeros((3, size), dtype=torch.int64, device=self.device))
        bucket.inputs[2] = self.pad_slot
        if self._pool is not None:
            # Warm up on a side stream (Triton compiles, cuBLAS sets up its workspace), as capture needs.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(bucket.inputs, span, max_run)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            try:
                bucket.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(bucket.graph, pool=self._pool):
                    bucket.hidden, bucket.routes = self._forward(bucket.inputs, span, max_run)
            except RuntimeError as error:
                # An op that cannot be captured (a host sync in some model's code): run every
                # bucket eagerly from now on and say so in `status`; the numbers are the same.
                self.failure = f"{type(error).__name__}: {error}"[:500]
                self._pool, bucket.graph, bucket.hidden, bucket.routes = None, None, None, None
        self._buckets[size, span, max_run] = bucket
        return bucket
