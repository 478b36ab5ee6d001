"""The ``polyrl`` command line: ``train``, ``config``, ``sft``, ``export``, ``plot``, ``view``, ``profile``,
``serve``, ``models``, ``plugins``, ``new-plugin``.

Errors that a user can fix (:class:`polyrl.errors.PolyrlError`) print as one
message on stderr with exit code 2; ``--traceback`` or ``POLYRL_DEBUG=1`` shows
the traceback too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from polyrl.__about__ import __version__
from polyrl.errors import PolyrlError


def cmd_plugins(args: argparse.Namespace) -> int:
    """List every plugin that would load, its hooks and the names it registers, by kind."""
    from polyrl.manifest import Manifest
    from polyrl.plugins import PluginManager

    manifest = Manifest.load(args.manifest) if args.manifest else None
    pm = PluginManager(manifest)
    info = pm.describe()
    if args.json:
        doc = {"polyrl_version": __version__, "manifest": args.manifest, "plugins": info}
        print(json.dumps(doc, indent=2, sort_keys=False))
        return 0
    print(format_plugins(info, manifest=args.manifest, verbose=args.verbose))
    return 0


def format_plugins(info: list[dict], *, manifest: str | None = None, verbose: bool = False) -> str:
    """The human-readable listing of :meth:`polyrl.plugins.PluginManager.describe`."""
    source = f"manifest {manifest}" if manifest else "every installed plugin (no manifest)"
    lines = [f"polyrl {__version__}: {len(info)} plugins from {source}"]
    for p in info:
        if p["distribution"] == "polyrl":
            origin = f"polyrl {p['version']}, built-in"
        elif p["distribution"]:
            origin = f"{p['distribution']} {p['version']}, entry point {p['module']}"
        else:
            origin = "manifest modules entry"
        lines += ["", f"{p['name']}  ({origin})", f"  hooks: {', '.join(p['hooks']) or '-'}"]
        width = max((len(k) for k in p["entries"]), default=0)
        for kind, entries in p["entries"].items():
            if verbose:
                lines.append(f"  {kind}:")
                for e in entries:
                    alias = f" (aliases: {', '.join(e['aliases'])})" if e["aliases"] else ""
                    desc = f"  ({e['description']})" if e["description"] else ""
                    lines.append(f"    {e['name']}{alias} -> {e['target']}{desc}")
            else:
                shown = [e["name"] + (f" ({', '.join(e['aliases'])})" if e["aliases"] else "") for e in entries]
                lines.append(f"  {kind + ':':<{width + 1}} {', '.join(shown)}")
    return "\n".join(lines)


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", "-m", help="plugin manifest (TOML); default: every installed plugin")
    p.add_argument("--config", "-c", action="append", default=[], help="YAML config file (repeatable)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, dotted (trainer.total_steps=10)")


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-format", choices=["auto", "native", "verl"], default="auto",
                   help="the config's layout: polyrl's, verl's (docs/from_verl.md), or auto (verl's when it has "
                        "actor_rollout_ref at the top level)")
    p.add_argument("--config-path", help="verl layout: a folder of verl configs (Hydra's --config-path)")
    p.add_argument("--config-name", help="verl layout: the trainer config to start from (ppo_trainer, "
                                         "ppo_megatron_trainer, or one in --config-path)")


def _train_args(p: argparse.ArgumentParser) -> None:
    _run_args(p)
    _layout_args(p)
    p.add_argument("--dry-run", action="store_true", help="run every start-up check (plugins, model paths, data, "
                   "rewards, layouts, placement) and stop before any worker starts")


def cmd_train(args: argparse.Namespace) -> int:
    """RL post-training."""
    from polyrl.trainer.commands import train
    from polyrl.trainer.interrupt import stopped_by_ctrl_c

    train(args.manifest, args.config, args.overrides, config_format=args.config_format,
          config_path=args.config_path, config_name=args.config_name, dry_run=args.dry_run)
    return 130 if stopped_by_ctrl_c() else 0  # stopped at a step boundary by Ctrl-C: resumable, but not done


def cmd_config(args: argparse.Namespace) -> int:
    """``polyrl config show``: the resolved config in polyrl's layout, each non-default value with its source."""
    from polyrl.config.show import show

    sys.stdout.write(show(args.manifest, args.config, args.overrides, config_format=args.config_format,
                          config_path=args.config_path, config_name=args.config_name))
    return 0


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show"], help="show: print the resolved config (polyrl's layout) with the "
                   "source of every non-default value")
    _run_args(p)
    _layout_args(p)


def cmd_sft(args: argparse.Namespace) -> int:
    """Supervised warm start."""
    from polyrl.trainer.commands import sft

    sft(args.manifest, args.config, args.overrides)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a checkpoint's actor as an HF folder."""
    from polyrl.trainer.commands import export

    out = export(args.checkpoint, args.to, args.manifest, args.overrides, trust_remote_code=args.trust_remote_code,
                 allow_run_modules=args.allow_run_modules)
    logging.getLogger("polyrl.cli").info("exported %s to %s", args.checkpoint, out)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw a run's curves to PNG."""
    from polyrl.trainer.commands import plot

    print(plot(args.run_dir, args.out))
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    """Write a run's HTML report (curves, validation samples, images, config) and print its path."""
    from polyrl.report import write_report

    out = write_report(args.run_dir, args.out)
    print(out)
    if args.open:
        import webbrowser

        webbrowser.open(out.resolve().as_uri())
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Where a run's step time went: driver phases and, per worker process, calls and top operators."""
    from polyrl.profiling import summarize_profile

    print(summarize_profile(args.run_dir, step=args.step, top=args.top))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible server over an HF folder, a checkpoint or a run's newest checkpoint."""
    import shlex

    from polyrl.serving import serve

    return serve(args.path, host=args.host, port=args.port, backend=args.backend, name=args.name,
                 manifest=args.manifest, trust_remote_code=args.trust_remote_code, max_model_len=args.max_model_len,
                 vllm_args=shlex.split(args.vllm_args or ""), max_request_bytes=args.max_request_bytes)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="an HF model folder, a checkpoint (RUN_DIR/checkpoints/step_N) or a run directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                   "0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--backend", default="auto", choices=["auto", "vllm", "hf"],
                   help="vllm (fast; when installed), hf (transformers, one request at a time), auto (default)")
    p.add_argument("--name", help="the model name clients send (default: the folder's or run's name)")
    p.add_argument("--manifest", "-m", help="manifest for exporting a checkpoint (default: the run's)")
    p.add_argument("--max-model-len", type=int, help="longest prompt plus completion, in tokens")
    p.add_argument("--trust-remote-code", action="store_true", help="run the model folder's own Python code")
    p.add_argument("--max-request-bytes", type=int, help="largest request body (hf backend; default 8 MiB): a larger "
                   "one is answered 413 unread")
    p.add_argument("--vllm-args", help="more arguments for vLLM's server, one string: --vllm-args '--dtype float16'")


def cmd_models(args: argparse.Namespace) -> int:
    """Model files: ``convert FILE.gguf --to DIR`` writes a GGUF file as an HF folder (dequantized)."""
    from polyrl.models.gguf import convert_gguf

    out = convert_gguf(args.file, args.to, "FILE")
    print(out)
    return 0


def _models_args(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    convert = actions.add_parser("convert", help="write a .gguf file as an HF folder (safetensors in float32, "
                                 "tokenizer, chat template), dequantized through transformers",
                                 description="Write a .gguf file as an HF folder (safetensors in float32, tokenizer, "
                                 "chat template), dequantized through transformers (docs/real_models.md).")
    convert.add_argument("file", help="the .gguf file")
    convert.add_argument("--to", required=True, help="the folder to write (replaced whole if it exists)")


def cmd_new_plugin(args: argparse.Namespace) -> int:
    """Write a new plugin package (pyproject, hooks, component, tests) that passes its tests as generated."""
    from polyrl.plugin_template import create_plugin

    root = create_plugin(args.name, args.kind, args.dest, description=args.description)
    sys.stdout.write(f"{root}\n")
    sys.stderr.write(f"created {root}: a {args.kind} plugin. Next:\n  cd {root}\n  pip install -e '.[test]'\n"
                     "  pytest              # polyrl's conformance suite for it, as generated\n"
                     "  polyrl plugins      # it is listed once installed\n")
    return 0


#: verb -> (handler, help, argument adder)
COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str, Callable[[argparse.ArgumentParser], None]]] = {
    "train": (cmd_train, "RL post-training (PPO, GRPO and family)", _train_args),
    "config": (cmd_config, "show the resolved config and each value's source",
               _config_args),
    "sft": (cmd_sft, "supervised fine-tuning with the same engines", _run_args),
    "export": (cmd_export, "write a checkpoint as an HF folder", lambda p: (
        p.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_N"),
        p.add_argument("--to", required=True, help="output folder"),
        p.add_argument("--manifest", "-m", help="manifest (default: the run's manifest.lock.toml)"),
        p.add_argument("--trust-remote-code", action="store_true", help="allow the run's config to set "
                       "actor.model.trust_remote_code (runs Python files shipped with the model; refused otherwise)"),
        p.add_argument("--allow-run-modules", action="store_true", help="allow the run's manifest.lock.toml to "
                       "import the modules it names (refused otherwise)"),
        p.add_argument("overrides", nargs="*", help="key=value changes to the run's config for the export, e.g. "
                       "actor.fsdp.lora_export=adapter actor.fsdp.export_max_shard_size=2GB"))),
    "plot": (cmd_plot, "PNG curves of a run", lambda p: (
        p.add_argument("run_dir"), p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)"))),
    "view": (cmd_view, "write a run's HTML report (curves, samples, images, config)", lambda p: (
        p.add_argument("run_dir"), p.add_argument("--out", help="HTML path (default RUN_DIR/report.html)"),
        p.add_argument("--open", action="store_true", help="open it in the default browser"))),
    "profile": (cmd_profile, "where a run's step time went (per phase and process)", lambda p: (
        p.add_argument("run_dir"), p.add_argument("--step", type=int, help="one profiled step (default: every one)"),
        p.add_argument("--top", type=int, default=10, help="operators shown per process (default 10)"))),
    "serve": (cmd_serve, "an OpenAI-compatible server over a model, checkpoint or run", _serve_args),
    "models": (cmd_models, "model files: convert a GGUF file to an HF folder", _models_args),
    "new-plugin": (cmd_new_plugin, "create a plugin package from a template", lambda p: (
        p.add_argument("name", help="the plugin's name, e.g. my-reward (the distribution becomes polyrl-my-reward)"),
        p.add_argument("--kind", "-k", required=True, choices=["engine", "rollout", "reward", "estimator", "platform",
                                                              "tool", "environment"], help="what the plugin adds"),
        p.add_argument("--dest", "-d", default=".", help="folder to create the package in (default: here)"),
        p.add_argument("--description", help="one line for the package metadata and README"))),
    "plugins": (cmd_plugins, "list plugins, their hooks and registered names", lambda p: (
        p.add_argument("--manifest", "-m", help="show what this manifest loads (default: every installed plugin)"),
        p.add_argument("--json", action="store_true", help="machine-readable output (PluginManager.describe())"),
        p.add_argument("--verbose", "-v", action="store_true", help="one line per name: target and description"))),
    # A new verb is one function `cmd_NAME(args) -> int` and one line here.
}


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with one subcommand per verb in :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="polyrl", description="RL post-training with plugins.")
    parser.add_argument("--version", action="version", version=f"polyrl {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show tracebacks of polyrl errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (handler, help_text, add_args) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        # accepted after the verb too; SUPPRESS keeps a flag given before the verb
        p.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``polyrl`` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`polyrl export CKPT --to DIR key=value`): argparse leaves them
        if not isinstance(getattr(args, "overrides", None), list) or any(
                e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    if not getattr(args, "handler", None):
        parser.print_help()
        return 1
    from polyrl.logs import setup_console_logging

    setup_console_logging()  # polyrl's log records on stderr, above a live progress bar
    try:
        return args.handler(args)
    except BrokenPipeError:  # `polyrl plugins | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops `train` at a step boundary): one line, no traceback
        _ignore_further_ctrl_c()
        resumes = " (started again, the run resumes from its last checkpoint)" if args.command == "train" else ""
        print(f"polyrl {args.command}: aborted by Ctrl-C{resumes}", file=sys.stderr)
        return 130
    except Exception as exc:
        verbose = args.traceback or os.environ.get("POLYRL_DEBUG") == "1"
        remote = worker_error(exc)
        if remote is not None:  # raised in a Ray worker: one line with its rank, the traceback to the log
            where, text, user_error, remote_tb = remote
            logging.getLogger("polyrl").debug("error in %s:\n%s", where, remote_tb)  # RUN_DIR/train.log
            if verbose:
                print(remote_tb, file=sys.stderr)
            print(f"polyrl {args.command}: error in {where}: {text}", file=sys.stderr)
            return 2 if user_error else 1
        if not isinstance(exc, PolyrlError):
            raise
        if verbose:
            traceback.print_exc()
        print(f"polyrl {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _ignore_further_ctrl_c() -> None:
    """Once a command is aborted, a later SIGINT (a third Ctrl-C, or one that lands while the interpreter shuts
    Ray down: by then Python has put back the default disposition, which kills the process) must not turn exit
    code 130 into death by signal or a traceback half-way through the clean-up."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def worker_error(exc: BaseException) -> tuple[str, str, bool, str] | None:
    """``(where, one-line message, is a PolyrlError, remote traceback)`` when ``exc`` is (or wraps) an error
    raised inside a Ray worker, method or constructor; ``where`` names the worker's rank. None otherwise."""
    import re

    from polyrl import errors

    rex = sys.modules.get("ray.exceptions")
    if rex is None:
        return None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (rex.RayTaskError, rex.RayActorError)):
            text = str(exc)
            rank = re.search(r"Worker\(rank=(\d+)", text)
            where = f"worker rank {rank.group(1)}" if rank else "a worker"
            cause = getattr(exc, "cause", None)
            if isinstance(cause, BaseException) and not isinstance(cause, rex.RayError):
                first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
                user = isinstance(cause, PolyrlError)
                return where, first if user else f"{type(cause).__name__}: {first}", user, text
            # an actor that died in its constructor: the original error is the traceback's last "Name: message"
            last = None
            for line in text.splitlines():
                match = re.match(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.*)$", line.strip())
                if match:
                    last = match
            if last is None:
                return where, text.strip().splitlines()[0] if text.strip() else type(exc).__name__, False, text
            cls = getattr(errors, last.group(1), None)
            user = isinstance(cls, type) and issubclass(cls, PolyrlError)
            return where, last.group(2) if user else f"{last.group(1)}: {last.group(2)}", user, text
        exc = exc.__cause__ or exc.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
