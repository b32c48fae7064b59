"""The one script for the GPU machine: invariance checks, kernel microbenchmarks, end-to-end throughput.

Run from the repository root (parity need not be installed):

    PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --out $OUT \
        [--sections kernels,parity,e2e,profile,cublaslt,tp]

Sections (`sections.SECTIONS`, one module each in `sections/`, whose docstring says what it
measures; each runs independently: a failure is recorded and the next section still runs):
- kernels: bitwise row invariance of the Triton linear, cuBLASLt without split-K and default
  cuBLAS; matmul, attention, RMSNorm and log-softmax kernels against torch.
- parity: reference-engine rollouts vs `train_forward` bit for bit over batch compositions, with
  the native negative control; the sampling grid, with torch's CUDA scan as a negative control.
- e2e: output tok/s of the invariant engine, the "baseline" (b') and "native" engines and
  transformers `generate` on a Qwen3-1.7B-shaped model, side by side in one run.
- profile: torch.profiler over a few decode steps of the invariant engine, dense or (`--profile-model
  moe`) the MoE shape with routes recorded ($OUT/profile.txt).
- step_split: where one decode step's wall time goes (host parts, each CUDA-graph bucket's device time).
- tp: invariant-engine tok/s without tensor parallelism, at TP=1 per `--tp-groups` K-group count,
  and at TP=2 with two GPUs, with TP=2 == TP=1 bit for bit.
- tp_sim: TP=2 simulated on one GPU: rank 0's shard timed under CUDA graphs with a loopback
  exchange that counts the bytes and collectives a rank makes, TP=2 projected at stated link figures.
- cublaslt: parity and the invariant e2e row again in a child process set up for cuBLASLt.
- probe: the load-time matmul probe over three model families' shapes (routes, time, spot check).
- attention_sweep: every candidate attention plan's times and bitwise checks, and the shipped pair.
- parity_shapes: rollout == train_forward bit for bit on three other families' shapes.
- moe_e2e: output tok/s on a Qwen3-30B-A3B-shaped model, with and without route recording.
- probed: `--probed-sections` again in a child process set up for cuBLASLt (every shape probed).
- roofline: each end-to-end row of the run against its workload's lower bound from shapes.

The package: `cli` (flags, the run loop), `results` (typed results), `records` (them as JSON and
back), `timing` (CUDA-event timing and row-invariance probes), `settings` (settings a measurement
changes, restored when it ends, failed or not), `workloads` (models, requests, engine variants),
`run` (one run's results and child processes), `table` (the summary). Full numbers go to
$OUT/gpu_results.json (each section's results as JSON, saved after every section); the short
table, read from the typed results, is printed last.
"""
