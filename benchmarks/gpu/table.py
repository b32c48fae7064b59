"""The short summary printed at the end of a run, read from the sections' typed results.

One line per measured row (a failed row says ERROR; a failed section says so once, with the
traceback in gpu_results.json), then the ratios that compare rows of one run side by side.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.gpu.results import (
    AttentionSweep,
    CublasLtSection,
    E2ESection,
    Failure,
    KernelsResult,
    MoESection,
    ParitySection,
    ProbedSection,
    ProbeResult,
    ProfileResult,
    RooflineResult,
    RowInvariance,
    StepSplit,
    Throughput,
    TPSection,
    TPSimRow,
    TPSimSection,
)


def _invariance_line(key: str, entries: list[RowInvariance]) -> str:
    bad = [e.shape for e in entries if not e.invariant]
    return f"{key}: {'all row-invariant' if not bad else f'NOT invariant at {bad}'}"


def kernels_lines(k: Any) -> list[str]:
    """Matmul speed vs cuBLAS, cuBLASLt speed, row invariance of each path, attention vs SDPA."""
    if not isinstance(k, KernelsResult):
        return []
    lines = []
    for shape, entry in k.matmul.items():
        for m, c in entry.cublas.graph.items():
            t = entry.triton.graph[m]
            lines.append(f"matmul {shape} M={m:<5} triton {t:7.1f} TFLOP/s  cuBLAS {c:7.1f}  "
                         f"ratio {t / c:5.2f}")
    lt = k.cublaslt_nosplitk
    if not isinstance(lt, Failure):
        for shape, speed in lt.tflops.items():
            lines.append(f"cuBLASLt no-split-K {shape}: "
                         + "  ".join(f"M={m} {v:.1f}" for m, v in speed.graph.items()))
    lines.append(_invariance_line("triton_invariance", k.triton_invariance))
    lines.append(_invariance_line("cublas_default_invariance", k.cublas_default_invariance))
    if not isinstance(lt, Failure):
        lines.append(_invariance_line("cublaslt_nosplitk_invariance", lt.invariance))
    for name, a in k.attention.items():
        lines.append(f"attention {name}: triton {a.triton_ms:.3f} ms  SDPA {a.sdpa_ms:.3f} ms  "
                     f"SDPA/triton {a.ratio_sdpa_over_triton:.2f}")
    return lines


def parity_lines(parity: Any, label: str) -> list[str]:
    """The sampling grid's differing tokens, then each bitwise check (with the engine's graph status)."""
    if not isinstance(parity, ParitySection):
        return []
    lines = []
    for name, grid in parity.sampling_grid.items():
        verdict = "ERROR" if isinstance(grid, Failure) else \
            f"{grid.differing} of {grid.tokens} tokens differ (max {grid.max_abs_diff:.2e})"
        lines.append(f"sampling grid{label} {name}: {verdict}")
    for name, check in parity.checks.items():
        if isinstance(check, Failure):
            verdict = "ERROR"
        else:
            graphs = "; ".join(sorted({c.step_graphs for c in check.compositions}))
            verdict = f"bitwise equal: {check.all_bitwise_equal} [{graphs}]"
        lines.append(f"parity{label} {name}: rollout vs train_forward {verdict}")
    return lines


def _throughput(row: Throughput | Failure, graphs: bool) -> str:
    if isinstance(row, Failure):
        return "ERROR"
    status = f" [{row.step_graphs}]" if graphs and row.step_graphs else ""
    runs = ""
    if row.runs_tok_s and len(row.runs_tok_s) > 1:
        runs = f"; runs {', '.join(f'{r:.0f}' for r in row.runs_tok_s)}, spread {row.spread:.1%}"
    cold = f"; cold start {row.cold_start_s:.1f} s" if row.cold_start_s is not None else ""
    return f"{row.output_tok_s:.0f} output tok/s ({row.seconds:.1f} s{runs}{cold}){status}"


def e2e_lines(e2e: Any, label: str) -> list[str]:
    """One line per end-to-end row."""
    if not isinstance(e2e, E2ESection):
        return []
    return [f"e2e{label} {name}: {_throughput(row, graphs=True)}" for name, row in e2e.rows.items()]


def _rates(section: Any, names: tuple[str, ...]) -> dict[str, float]:
    """Output tok/s of the finished rows `names` of an e2e section."""
    if not isinstance(section, E2ESection):
        return {}
    return {n: row.output_tok_s for n in names if isinstance(row := section.rows.get(n), Throughput)}


def ratio_lines(results: Mapping[str, Any]) -> list[str]:
    """The invariant engine (and its cuBLASLt run) over the native engine and over hf generate."""
    ok = _rates(results.get("e2e"), ("engine_invariant", "engine_native", "hf_generate"))
    sub = results.get("cublaslt")
    if isinstance(sub, CublasLtSection):
        lt = _rates(sub.e2e, ("engine_invariant",))
        if lt:
            ok["engine_invariant_cublaslt"] = lt["engine_invariant"]
    pairs = [(a, b) for a in ("engine_invariant", "engine_invariant_cublaslt")
             for b in ("engine_native", "hf_generate")]
    return [f"e2e ratio {a} / {b}: {ok[a] / ok[b]:.2f}" for a, b in pairs if a in ok and b in ok]


def probe_lines(probe: Any) -> list[str]:
    """Per family: shapes on cuBLASLt, the spot check, probe seconds; TFLOP/s routed vs Triton."""
    if not isinstance(probe, ProbeResult):
        return []
    lines = []
    for family, entry in probe.families.items():
        fast = sum(1 for path, _ in entry.routes.values() if path == "cublaslt")
        verdict = "row-invariant" if all(s.invariant for s in entry.spot_check) else "NOT row-invariant"
        cold, cached = entry.probe_cold_s, entry.probe_cached_s
        lines.append(f"probe {family}: {fast} of {len(entry.routes)} shapes on cuBLASLt, spot check "
                     f"{verdict}, probe {cold:.2f} s cold / {cached:.3f} s cached")
        for shape, speed in entry.tflops_graph.items():
            r, t = speed.routed.graph, speed.triton.graph
            lines.append(f"  {shape} routed/triton TFLOP/s: "
                         + "  ".join(f"M={m} {r[m]:.0f}/{t[m]:.0f}" for m in r))
    return lines


def attention_lines(sweep: Any) -> list[str]:
    """The shipped plans vs SDPA and flash (with the decode repeats), the baseline's attention, each plan."""
    if not isinstance(sweep, AttentionSweep):
        return []
    pair = sweep.shipped_pair
    decode, prefill = pair.decode_ms, pair.prefill_ms
    lines = [f"attention shipped {sweep.shipped}: decode {decode:.3f} ms (SDPA/plan "
             f"{sweep.sdpa_decode_ms / decode:.2f})  prefill {prefill:.3f} ms (flash/plan "
             f"{sweep.flash_prefill_ms / prefill:.2f})  decode==prefill "
             f"{pair.decode_equals_prefill}; run kernel at decode {pair.decode_runs_ms:.3f} ms"]
    for rep in sweep.decode_repeats_ms:
        lines.append(f"  decode repeat: SDPA {rep.sdpa:.4f} ms, decode launch {rep.decode_launch:.4f} ms "
                     f"({rep.sdpa / rep.decode_launch:.3f}x), run kernel {rep.run_kernel:.4f} ms "
                     f"({rep.sdpa / rep.run_kernel:.3f}x)")
    lines.append(f"attention of the baseline (b', flash over the cache): decode "
                 f"{sweep.baseline_decode_ms:.3f} ms, prefill {sweep.baseline_prefill_ms:.3f} ms")
    for name, plan in sweep.plans.items():
        if isinstance(plan, Failure):
            lines.append(f"attention plan {name}: ERROR")
            continue
        lines.append(f"attention plan {name}: decode {plan.decode_ms:.3f} ms (SDPA/plan "
                     f"{plan.sdpa_over_plan_decode:.2f})  prefill {plan.prefill_ms:.3f} ms (flash/plan "
                     f"{plan.flash_over_plan_prefill:.2f})  decode==prefill "
                     f"{plan.decode_equals_prefill}  chunked==prefill {plan.chunked_equals_prefill}")
    return lines


def moe_lines(moe: Any, label: str) -> list[str]:
    """One line per MoE row."""
    if not isinstance(moe, MoESection):
        return []
    return [f"moe{label} {name}: {_throughput(row, graphs=False)}" for name, row in moe.rows.items()]


def step_split_lines(split: Any, label: str) -> list[str]:
    """Wall seconds, host seconds per part with call counts, and each graph bucket's device ms."""
    if not isinstance(split, StepSplit):
        return []
    return [f"step split{label} ({split.workload}): wall {split.wall_s:.2f} s",
            *(f"  {part}: {sec:.3f} s over {split.calls[part]} calls" for part, sec in split.host_s.items()),
            *(f"  graph {bucket}: {ms:.3f} ms device" for bucket, ms in split.bucket_device_ms.items())]


def tp_lines(tp: Any) -> list[str]:
    """Each row, TP=1 over the whole model and TP=2 over TP=1 per group count, TP=2 == TP=1 bitwise."""
    if not isinstance(tp, TPSection):
        return []
    rates = {k: v.output_tok_s for k, v in tp.rows.items() if isinstance(v, Throughput)}
    lines = [f"tp ({tp.workload}): {name} {rate:.0f} tok/s" for name, rate in rates.items()]
    for groups in tp.reduction_groups:
        for a, b in ((f"tp1_g{groups}", "whole_model"), (f"tp2_g{groups}", f"tp1_g{groups}")):
            if a in rates and b in rates:
                lines.append(f"tp ratio {a} / {b}: {rates[a] / rates[b]:.3f}")
        if groups in tp.tp2_equals_tp1:
            equal = tp.tp2_equals_tp1[groups]
            lines.append(f"tp: TP=2 rollouts equal TP=1 bit for bit ({groups} groups): "
                         f"{'ERROR' if isinstance(equal, Failure) else equal}")
    if tp.tp2_skipped:
        lines.append(f"tp: TP=2 skipped ({tp.tp2_skipped})")
    return lines


def tp_sim_lines(sim: Any) -> list[str]:
    """Per group count: the rank's own tok/s, its exchange per output token, TP=2 projected per link."""
    if not isinstance(sim, TPSimSection):
        return []
    lines = []
    for label, row in sim.rows.items():
        if not isinstance(row, TPSimRow):
            continue
        projected = ", ".join(f"{link} {rate:.0f}" for link, rate in row.projected_tp2_tok_s.items())
        alone, per_token = row.output_tokens / row.rank_seconds, row.received_bytes / row.output_tokens / 1e6
        lines.append(f"tp_sim {label} ({sim.workload}): rank alone {alone:.0f} tok/s, {per_token:.2f} MB "
                     f"received per output token, {row.collectives} collectives; "
                     f"TP=2 projected tok/s: {projected}")
    return lines


def table(results: Mapping[str, Any]) -> str:
    """The short summary of a run's typed results (section name -> its result or Failure)."""
    sub = results.get("cublaslt")
    sub = sub if isinstance(sub, CublasLtSection) else None
    probed = results.get("probed")
    probed = probed if isinstance(probed, ProbedSection) else None
    lines = kernels_lines(results.get("kernels"))
    for label, parity, e2e in (("", results.get("parity"), results.get("e2e")),
                               (" [cuBLASLt]", sub and sub.parity, sub and sub.e2e)):
        lines += parity_lines(parity, label) + e2e_lines(e2e, label)
    lines += ratio_lines(results)
    lines += probe_lines(results.get("probe"))
    lines += attention_lines(results.get("attention_sweep"))
    lines += parity_lines(results.get("parity_shapes"), "")
    lines += parity_lines(probed and probed.parity_shapes, " [probed]")
    lines += moe_lines(results.get("moe_e2e"), "") + moe_lines(probed and probed.moe_e2e, " [probed]")
    lines += e2e_lines(probed and probed.e2e, " [probed]")
    roofline = results.get("roofline")
    if isinstance(roofline, RooflineResult):
        lines += [f"roofline {label}: {row.output_tok_s:.0f} of {row.bound_tok_s:.0f} tok/s bound "
                  f"({row.fraction_of_bound:.0%})" for label, row in roofline.rows.items()]
    prof = results.get("profile")
    if isinstance(prof, ProfileResult):
        lines.append(f"profile ({prof.workload}): wall {prof.wall_s:.2f} s, GPU busy {prof.gpu_busy_s:.2f} "
                     f"s, idle between kernels {prof.idle_s:.2f} s; "
                     + ", ".join(f"{name} {s:.2f} s" for name, s in prof.top_kernels.items()))
        gaps = ", ".join(f"{k} {s:.3f} s" for k, s in prof.idle_by_gap.items())
        lines.append(f"profile idle by gap: {gaps}; around: "
                     + ", ".join(f"{k} {s:.3f} s" for k, s in prof.idle_top.items()))
    lines += step_split_lines(results.get("step_split"), "")
    lines += step_split_lines(probed and probed.step_split, " [probed]")
    lines += tp_lines(results.get("tp"))
    lines += tp_sim_lines(results.get("tp_sim"))
    lines += [f"{section}: ERROR (see gpu_results.json)" for section, result in results.items()
              if isinstance(result, Failure)]
    return "\n".join(lines)
