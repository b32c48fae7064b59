"""The attention_sweep section: every candidate attention plan (`parity.kernels.triton.attention.CANDIDATES`).

On the engine's cache at Qwen3-1.7B heads: decode (256 sequences at context 512) and prefill
(256 x 256 causal) times vs SDPA (flash where torch allows it) and vs the baseline's attention
(flash reading the cache in place), per plan decode == prefill and chunked == prefill bit for bit,
and the cross-plan table (may decode run another plan than prefill?); the shipped decode launch
vs SDPA in five interleaved repeats. Times are median device ms per call replayed from a CUDA
graph (no host launch cost).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu.records import failure
from benchmarks.gpu.results import AttentionSweep, DecodeRepeat, Failure, PlanResult, ShippedPair
from benchmarks.gpu.run import Run
from benchmarks.gpu.timing import graph_ms
from parity.kernels.attention import MAX_FLASH_ENTRIES, flash_over_cache, varlen_entries
from parity.kernels.triton.attention import CANDIDATES, attention, shipped_config


def _timed(fn: Callable[[], Any]) -> float:
    return graph_ms(fn, [()])


def measure(run: Run) -> AttentionSweep:
    """See the module docstring."""
    hq, hkv, d, cap, n_seq, plen = 16, 8, 128, 1024, 256, 256
    g = torch.Generator("cuda").manual_seed(3)
    kc = torch.randn(n_seq, hkv, cap, d, device="cuda", generator=g).to(torch.bfloat16)
    vc = torch.randn(n_seq, hkv, cap, d, device="cuda", generator=g).to(torch.bfloat16)
    qp = torch.randn(n_seq * plen, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    seq = torch.arange(n_seq, device="cuda")
    p_slots, p_pos = seq.repeat_interleave(plen), torch.arange(plen, device="cuda").repeat(n_seq)
    last = p_pos == plen - 1
    first_chunk = p_pos < 100
    qd = torch.randn(n_seq, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    d_pos = torch.full((n_seq,), 511, device="cuda")
    scale = d**-0.5

    # SDPA on contiguous per-sequence K/V (no cache gather: the fastest layout SDPA gets)
    qs = qp.view(n_seq, plen, hq, d).transpose(1, 2).contiguous()
    ks, vs = kc[:, :, :plen].contiguous(), vc[:, :, :plen].contiguous()
    kd, vd = kc[:, :, :512].contiguous(), vc[:, :, :512].contiguous()
    section: dict[str, Any] = {
        "shipped": {"decode": shipped_config(n_seq).name, "prefill": shipped_config(n_seq * plen).name},
        "timing": "median device ms per call replayed from a CUDA graph (no host launch cost)",
        "workload": {"decode": "256 sequences x context 512, Hq 16, Hkv 8, D 128, bf16",
                     "prefill": "256 sequences x 256 tokens causal, same heads"}}

    sdpa = F.scaled_dot_product_attention
    section["sdpa_decode_ms"] = _timed(lambda: sdpa(qd[:, :, None], kd, vd, enable_gqa=True))
    section["sdpa_prefill_ms"] = _timed(lambda: sdpa(qs, ks, vs, is_causal=True, enable_gqa=True))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        section["flash_prefill_ms"] = _timed(lambda: sdpa(qs, ks, vs, is_causal=True, enable_gqa=True))
    # the stock attention of the baseline rows (b'): flash reading the slot cache in place, with one
    # entry per token at decode (as the engine's graphs make them) and one per run at prefill (as
    # its eager prefill steps make them)
    section["baseline_decode_ms"] = _timed(lambda: flash_over_cache(qd, kc, vc, seq, d_pos, 1, scale))
    one = slice(0, MAX_FLASH_ENTRIES)
    runs = varlen_entries(p_slots[one], p_pos[one], hkv, cap, compact=True)
    section["baseline_prefill_ms"] = _timed(
        lambda: flash_over_cache(qp[one], kc, vc, p_slots[one], p_pos[one], plen, scale, runs))
    section["baseline_note"] = f"prefill timed over the first {MAX_FLASH_ENTRIES} tokens (one flash launch)"
    shipped_prefill = attention(qp, kc, vc, p_slots, p_pos, scale)
    # the engine's decode steps pass max_run=1 (one-token launch); "decode_runs_ms" is the run kernel
    section["shipped_pair"] = ShippedPair(
        decode_ms=_timed(lambda: attention(qd, kc, vc, seq, d_pos, scale, max_run=1)),
        decode_runs_ms=_timed(lambda: attention(qd, kc, vc, seq, d_pos, scale)),
        prefill_ms=_timed(lambda: attention(qp, kc, vc, p_slots, p_pos, scale)),
        decode_equals_prefill=torch.equal(attention(qp[last], kc, vc, seq, p_pos[last], scale, max_run=1),
                                          shipped_prefill[last]),
        decode_runs_equals_prefill=torch.equal(attention(qp[last], kc, vc, seq, p_pos[last], scale),
                                               shipped_prefill[last]))
    # the decode ratio is close to 1: five interleaved repeats of SDPA, the decode launch, the run kernel
    section["decode_repeats_ms"] = [
        DecodeRepeat(sdpa=_timed(lambda: sdpa(qd[:, :, None], kd, vd, enable_gqa=True)),
                     decode_launch=_timed(lambda: attention(qd, kc, vc, seq, d_pos, scale, max_run=1)),
                     run_kernel=_timed(lambda: attention(qd, kc, vc, seq, d_pos, scale))) for _ in range(5)]
    plans: dict[str, PlanResult | Failure] = {}
    decoded: dict[str, torch.Tensor] = {}
    prefilled: dict[str, torch.Tensor] = {}
    for plan in (c for c in CANDIDATES if not run.args.attention_plans or c.name in run.args.attention_plans):
        try:
            whole = attention(qp, kc, vc, p_slots, p_pos, scale, plan)
            chunks = torch.empty_like(whole)
            chunks[first_chunk] = attention(qp[first_chunk], kc, vc, p_slots[first_chunk], p_pos[first_chunk],
                                            scale, plan)
            chunks[~first_chunk] = attention(qp[~first_chunk], kc, vc, p_slots[~first_chunk],
                                             p_pos[~first_chunk], scale, plan)
            dec = attention(qp[last], kc, vc, seq, p_pos[last], scale, plan)
            decoded[plan.name], prefilled[plan.name] = dec, whole[last]
            decode_ms = _timed(lambda plan=plan: attention(qd, kc, vc, seq, d_pos, scale, plan))
            prefill_ms = _timed(lambda plan=plan: attention(qp, kc, vc, p_slots, p_pos, scale, plan))
            plans[plan.name] = PlanResult(
                decode_ms=decode_ms, prefill_ms=prefill_ms,
                sdpa_over_plan_decode=section["sdpa_decode_ms"] / decode_ms,
                flash_over_plan_prefill=section["flash_prefill_ms"] / prefill_ms,
                decode_equals_prefill=torch.equal(dec, whole[last]),
                chunked_equals_prefill=torch.equal(chunks, whole))
        except Exception:
            plans[plan.name] = failure()
        run.checkpoint("attention_sweep", {**section, "plans": plans})
    cross = {dn: {pn: torch.equal(dv, pv) for pn, pv in prefilled.items()} for dn, dv in decoded.items()}
    return AttentionSweep(**section, plans=plans, cross_decode_equals_prefill=cross)
