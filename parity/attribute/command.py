"""`parity attribute`: op-family ablation and layer probe of a case's tokens, printed and written out.

    parity attribute --model tiny-llama --case smoke --axis batch --axis mode --dtype float32 --html a.html
    parity attribute --backend vllm --model tiny-llama --stages layer,logits --versus batch --json e.json
    parity attribute --backend vllm --model tiny-qwen3-moe --replay-routes --html r3.html

The tokens are the case's prompts with responses sampled by the reference engine (invariant
kernels), so every setting scores exactly the same tokens. With `--backend`, the engine samples
them itself with its probe on and is compared, stage by stage, with the training forward on its own
tokens (`--versus train`), or with itself in another setting (`--versus batch`: one request per call
against all in one; `--versus KEY=VALUE`: that backend option on against the engine without it);
`--fillers N` runs the all-in-one call among N uncaptured requests of other lengths (the audit's
batches); `--replay-routes` makes the training forward use the engine's MoE experts (R3).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from parity.attribute.axes import AXES
from parity.attribute.stages import STAGE_KINDS
from parity.backends.borrowed import resolve_device
from parity.backends.registry import parse_option, parse_options
from parity.core.errors import ConfigError
from parity.core.outputs import output_file
from parity.core.schema import DTYPES, KERNEL_MODES, REFERENCE, json_safe
from parity.core.types import Rollout
from parity.render.attribution import attribution_page, engine_text, layers_text, ops_text
from parity.runtime.frame import MODEL_VALUES, Parser, refuse_empty, run_command
from parity.workload.cases import default_case, resolve_case
from parity.workload.resolve import check_case_model, with_logprobs_mode


def _families(text: str) -> list[str] | str:
    """"invariant", "native" or a comma-separated list of families, as given on the command line."""
    return text if text in KERNEL_MODES else [f.strip() for f in text.split(",") if f.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="parity attribute",
        description="Attribute train/infer logprob drift to kernel families (op ablation) and to layers "
                    "(layer probe). Each axis compares two settings that differ in one thing: "
                    + "; ".join(f"{name}: {text}" for name, text in AXES.items()) + ".")
    parser.add_argument("--model", help="built-in checkpoint name or local HF checkpoint directory "
                                        "(default: the case's model)")
    parser.add_argument("--case", help="case TOML file or name in cases/ (default: the built-in workload)")
    parser.add_argument("--axis", action="append", choices=list(AXES),
                        help="setting of interest to attribute along; repeat for several (default: batch)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="dtype of both sides (default: the case's first dtype)")
    parser.add_argument("--device", default="auto",
                        help="device of the forward (default: auto = where parity's engine runs: cpu)")
    parser.add_argument("--families", type=_families, default=None, metavar="F1,F2",
                        help="kernel families to ablate one at a time (default: all)")
    parser.add_argument("--probe-kernels", type=_families, default=None, metavar="KERNELS",
                        help="invariant families of the layer probe: native (default), invariant or F1,F2")
    parser.add_argument("--max-sequences", type=int, default=8, metavar="N",
                        help="score the first N sampled sequences (default: 8)")
    parser.add_argument("--no-ops", action="store_true", help="skip the op-family ablation")
    parser.add_argument("--no-layers", action="store_true", help="skip the layer probe")
    parser.add_argument("--backend", help="look inside this engine (vllm, vllm-server, sglang): its stages "
                                          "against the training forward's, or against the same engine in "
                                          "another setting (--versus)")
    parser.add_argument("--stages", default=None, metavar="K1,K2",
                        help="with --backend: the stage kinds to capture, of " + ", ".join(STAGE_KINDS)
                             + " (default: all)")
    parser.add_argument("--versus", default="train", metavar="train|batch|KEY=VALUE",
                        help="with --backend: side A is the training forward (train, default), the engine "
                             "with one request per call (batch), or the engine without backend option "
                             "KEY=VALUE (side B has it)")
    parser.add_argument("--fillers", type=int, default=0, metavar="N",
                        help="with --backend and --versus batch or train: side B's call runs the requests "
                             "among N uncaptured requests of other prompt lengths (steps that mix prefill "
                             "and decode, as the audit's batch check)")
    parser.add_argument("--replay-routes", action="store_true",
                        help="with --backend and --versus train, MoE models: the training forward replays "
                             "the experts the engine chose (R3)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="with --backend: a backend option of both sides (repeatable)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the section as JSON to OUT")
    parser.add_argument("--html", type=Path, metavar="OUT", help="write an HTML page to OUT")
    return parser


def _sequences(model: str | None, case_spec: str | None, dtype: str | None, device: str,
               limit: int) -> tuple[str, str, list[Rollout]]:
    """(model, dtype, the first `limit` rollouts the reference engine samples for the case)."""
    if limit < 1:
        raise ConfigError(f"--max-sequences must be >= 1, got {limit}")
    if case_spec is None:
        case = default_case(model if model is not None else "tiny-llama")
    else:
        case = resolve_case(case_spec, what="--case")
        check_case_model(model, case, "--model")
    model = model if model is not None else case.model
    dtype = dtype or case.dtypes[0]
    from parity.engine import ReferenceEngine  # torch: after parsing, so that --help stays light

    with ReferenceEngine(model, dtype=dtype, device=device) as engine:
        rollouts = engine.generate(list(case.requests[:limit]))
    return model, dtype, rollouts[:limit]


def main(argv: Sequence[str] | None = None) -> int:
    """Run `parity attribute` on `argv` (the arguments after the subcommand); returns the exit code."""
    return run_command("parity", argv, _parser(), _run)


def _run(args: argparse.Namespace) -> int:
    for option, path in (("--json", args.json), ("--html", args.html)):
        if path is not None:
            output_file(path, option)  # before the engine runs
    if args.json is not None and args.html is not None and args.json.resolve() == args.html.resolve():
        raise ConfigError(f"--json and --html are one file ({args.json}): the page would replace the JSON; "
                          "give each a path of its own")
    refuse_empty("--model", args.model, MODEL_VALUES, "run the case's model")
    args.device = resolve_device(args.device, [REFERENCE])
    if args.backend is not None:
        ablation = [flag for flag, given in (("--axis", args.axis), ("--families", args.families is not None),
                                             ("--probe-kernels", args.probe_kernels is not None),
                                             ("--no-ops", args.no_ops), ("--no-layers", args.no_layers))
                    if given]
        if ablation:
            verb = "goes" if len(ablation) == 1 else "go"
            raise ConfigError(f"{', '.join(ablation)} {verb} with the op ablation and layer probe, which run "
                              "without --backend; the engine probe (--backend) "
                              "takes --stages, --versus, --fillers, --option and --replay-routes: drop "
                              f"{', '.join(ablation)} or --backend")
        return _run_engine(args)
    if args.stages is not None or args.option or args.versus != "train" or args.replay_routes or args.fillers:
        raise ConfigError("--stages, --versus, --option, --fillers and --replay-routes go with --backend "
                          "(the engine probe)")
    for flag, given, part, skip, skipped in (
            ("--families", args.families is not None, "op ablation", "--no-ops", args.no_ops),
            ("--probe-kernels", args.probe_kernels is not None, "layer probe", "--no-layers",
             args.no_layers)):
        if given and skipped:
            raise ConfigError(f"{flag} sets up the {part}, which {skip} skips, so it would have no effect: "
                              f"drop {flag} or {skip}")
    model, dtype, rollouts = _sequences(args.model, args.case, args.dtype, args.device, args.max_sequences)
    from parity.attribute.section import attribution_section  # torch: after parsing (--help stays light)

    section = attribution_section(model, rollouts, axes=args.axis or ["batch"], dtype=dtype,
                                  device=args.device, families=args.families,
                                  probe_kernels="native" if args.probe_kernels is None
                                  else args.probe_kernels, ops=not args.no_ops, layers=not args.no_layers)
    section["model"] = model
    for entry in section["axes"]:
        print(f"== axis {entry['axis']}: {entry['description']}")
        if "ops" in entry:
            print(ops_text(entry["ops"]))
        if "layers" in entry:
            print(layers_text(entry["layers"]))
    if args.json is not None:
        args.json.write_text(_strict_json(section), encoding="utf-8")
        print(f"wrote {args.json}")
    if args.html is not None:
        args.html.write_text(attribution_page(section, f"parity attribute: {model}"), encoding="utf-8")
        print(f"wrote {args.html}")
    return 0


def _run_engine(args: argparse.Namespace) -> int:
    """`parity attribute --backend B`: the engine probe (`parity.attribute.probe.engine_diff`)."""
    case = default_case(args.model or "tiny-llama") if args.case is None else resolve_case(args.case,
                                                                                            what="--case")
    check_case_model(args.model, case, "--model")
    if args.max_sequences < 1:
        raise ConfigError(f"--max-sequences must be >= 1, got {args.max_sequences}")
    model = args.model if args.model is not None else case.model
    dtype = args.dtype or case.dtypes[0]
    options = parse_options(args.option)
    if "logprobs_mode" in options:  # the case's requests in the engine's mode, as `parity compare` does
        case = with_logprobs_mode(case, options["logprobs_mode"])
    # torch and the engine: after parsing, so that --help and bad input stay light
    from parity.attribute.probe import EngineSide, engine_diff
    from parity.attribute.settings import Setting

    if args.fillers and args.versus not in ("batch", "train"):
        raise ConfigError("--fillers goes with --versus batch or train (the all-in-one call among fillers)")
    side, against = EngineSide(options, fillers=args.fillers), None
    if args.versus == "batch":
        against = EngineSide(options, batch=1)
    elif args.versus != "train":
        key, value = parse_option(args.versus)
        if key in options and options[key] == value:
            raise ConfigError(f"--versus {args.versus}: --option gives both sides {key}={value!r} already, "
                              "so the two sides would be one setting; drop it from --option (side A then "
                              "runs without it)")
        side, against = EngineSide({**options, key: value}), EngineSide(options)
    diff = engine_diff(model, list(case.requests[:args.max_sequences]), backend=args.backend, dtype=dtype,
                       side=side, against=against, stages=args.stages,
                       train=Setting(dtype=dtype, device=args.device) if against is None else None,
                       replay_routes=args.replay_routes).to_dict()
    print(engine_text(diff))
    section = {"model": model, "engine": diff}
    if args.json is not None:
        args.json.write_text(_strict_json(section), encoding="utf-8")
        print(f"wrote {args.json}")
    if args.html is not None:
        args.html.write_text(attribution_page(section, f"parity attribute --backend {args.backend}: {model}"),
                             encoding="utf-8")
        print(f"wrote {args.html}")
    return 0


def _strict_json(section: dict[str, object]) -> str:
    """The section as strict JSON: a NaN or infinite error (a stage gone non-finite, its growth) spelled
    as in `parity.core.schema.NONFINITE_JSON`; bare NaN / Infinity are read as null and 1.8e308 by jq."""
    return json.dumps(json_safe(section), indent=2, allow_nan=False)
