"""The ``tune`` command: ``run``, ``ls``, ``cp``, ``validate``, ``plan``, ``migrate``, ``generate``.

Exit status: 0 success, 2 user error (one short message on stderr, no traceback), 1 internal failure
(traceback); a run that stopped early says why in one line: 143 stopped by SIGTERM or a first Ctrl-C after
writing a checkpoint, 3 stopped on a non-finite loss or gradient norm (nothing saved), 130 aborted by a second
Ctrl-C; 141 (silently) when the reader of stdout went away, as in ``tune ls | head -1``. ``--debug`` or ``TUNE_DEBUG=1`` shows tracebacks for user errors too.

A recipe is a Python file that defines ``CONFIG_SCHEMA`` (a dataclass), ``preflight(cfg, *, strict=True,
world_size=1) -> list[tuple[str, str]]`` (cheap checks and a summary: builds the model on the meta device, resolves the AC plan,
checks files; with ``strict=False`` file problems are reported as warnings) and ``run(cfg)``;
run as a script (under PyTorch's elastic launcher) it calls :func:`recipe_main`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, NoReturn, Optional, Sequence

from torchtune_ac.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_NON_FINITE,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    RunStopped,
    UserError,
)

DEBUG_ENV_VAR = "TUNE_DEBUG"


def _int_at_least(minimum: int, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in [minimum, maximum] (a bad value is a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _nnodes(text: str) -> str:
    """``N`` or ``MIN:MAX`` (an elastic range), as torch.distributed.run takes it."""
    bounds = text.split(":")
    if len(bounds) > 2 or not all(b.isdigit() and int(b) >= 1 for b in bounds) or int(bounds[0]) > int(bounds[-1]):
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return text


# Launcher flags forwarded to torch.distributed.run (the elastic launcher), with how argparse reads them.
LAUNCHER_FLAGS = {
    "nproc_per_node": (("--nproc_per_node", "--nproc-per-node"), _int_at_least(1)),
    "nnodes": (("--nnodes",), _nnodes),
    "node_rank": (("--node_rank", "--node-rank"), _int_at_least(0)),
    "rdzv_endpoint": (("--rdzv_endpoint", "--rdzv-endpoint"), str),
    "rdzv_backend": (("--rdzv_backend", "--rdzv-backend"), str),
    "master_addr": (("--master_addr", "--master-addr"), str),
    "master_port": (("--master_port", "--master-port"), _int_at_least(1, 65535)),
}


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but usage errors become ``UserError`` (exit 2 through the same path as every user error)."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message}")


def _debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV_VAR, "") not in ("", "0", "false", "False")


def _report_user_error(err: UserError) -> None:
    prefix = "tune: error: "
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        prefix += f"[rank {os.environ.get('RANK', '?')}] "
    if _debug_enabled():
        traceback.print_exc()
    print(prefix + str(err), file=sys.stderr, flush=True)


def guarded(fn: Callable[[], int | None]) -> int:
    """Run ``fn`` and turn its outcome into an exit status (see the module docstring)."""
    try:
        return fn() or 0
    except UserError as err:
        _report_user_error(err)
        return EXIT_USER_ERROR
    except RunStopped as err:
        if err.announce:
            print(f"tune: {err}", file=sys.stderr, flush=True)
        return err.exit_status
    except KeyboardInterrupt:
        print("tune: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Stop quietly, as other commands in a pipeline do; stdout goes to /dev/null so that the interpreter's
        # final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


# ---------------------------------------------------------------------------------------------- recipes


def resolve_recipe_path(recipe: str) -> Path:
    """A built-in recipe name (``full_finetune``) or a path to a recipe ``.py`` file.

    Raises:
        UserError: neither.
    """
    from torchtune_ac.registry import RECIPES, find_recipe

    builtin = find_recipe(recipe)
    if builtin is not None:
        return builtin.path
    path = Path(recipe).expanduser()
    if path.suffix == ".py":
        if not path.is_file():
            raise UserError(f"recipe {recipe}: no such file")
        return path.resolve()
    names = ", ".join(r.name for r in RECIPES)
    raise UserError(f"recipe {recipe}: not a built-in recipe ({names}) and not a .py file; see `tune ls`")


def load_recipe(path: Path) -> ModuleType:
    """Import the recipe file at ``path`` and check it has the recipe interface.

    Raises:
        UserError: the file is not valid Python, or lacks ``CONFIG_SCHEMA``, ``preflight`` or ``run``.
    """
    spec = importlib.util.spec_from_file_location(f"torchtune_ac_recipe_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UserError(f"recipe {path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:  # the user's own file (a built-in recipe is tested): name the line
        raise UserError(f"recipe {path}:{err.lineno}: invalid Python: {err.msg}") from None
    missing = [name for name in ("CONFIG_SCHEMA", "preflight", "run") if not hasattr(module, name)]
    if missing:
        raise UserError(f"recipe {path}: not a recipe (missing {', '.join(missing)})")
    return module


def load_recipe_config(recipe: ModuleType, config: str, overrides: Sequence[str], allow_components: Sequence[str],
                       *, to_run: bool = False):
    """Load ``config`` with ``overrides`` and validate it against the recipe's schema (typed config back).

    ``to_run``: the config is about to run, so create the embedded checkpoint if it names it (only ``tune run``
    writes; for anything else the embedded checkpoint is a path like any other).
    """
    from torchtune_ac.config import load_config, resolve_config_path, validate_config
    from torchtune_ac.config.loading import create_embedded_checkpoint_if_named

    cfg = load_config(config, overrides)
    validated = validate_config(
        cfg,
        recipe.CONFIG_SCHEMA,
        source=str(resolve_config_path(config)),
        extra_allowed_components=allow_components,
        overrides=overrides,
    )
    if to_run:
        create_embedded_checkpoint_if_named(cfg)
    return validated


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", required=True, help="built-in config name (see `tune ls`) or a YAML path")
    parser.add_argument(
        "--allow-component",
        action="append",
        default=[],
        metavar="PREFIX",
        help="also allow _component_ paths under this module prefix (repeatable)",
    )


def parse_with_overrides(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; the arguments argparse does not know become ``args.overrides`` (Hydra overrides).

    Leftovers are collected this way (rather than with a ``nargs="*"`` positional) so overrides may come
    before or after ``--config``.
    """
    args, leftovers = parser.parse_known_args(argv)
    flags = [arg for arg in leftovers if arg.startswith("-")]
    if flags:
        parser.error(f"unrecognized arguments: {' '.join(flags)}")
    if leftovers and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(leftovers)}")
    if hasattr(args, "overrides"):
        args.overrides = leftovers
    return args


def recipe_main(argv: Optional[Sequence[str]] = None, recipe_file: Optional[str] = None) -> int:
    """Entry point of a recipe run as a script (each process under the elastic launcher)."""
    path = Path(recipe_file or sys.argv[0]).resolve()

    def _main() -> None:
        parser = _ArgumentParser(prog=f"tune run {path.stem}")
        _add_config_arguments(parser)
        parser.set_defaults(overrides=[])
        args = parse_with_overrides(parser, list(sys.argv[1:] if argv is None else argv))
        recipe = load_recipe(path)
        recipe.run(load_recipe_config(recipe, args.config, args.overrides, args.allow_component, to_run=True))

    status = guarded(_main)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _leave_worker(status)
    return status


def _leave_worker(status: int) -> NoReturn:
    """End a worker of a multi-process run with ``status``, skipping the interpreter's teardown.

    By the time a recipe returns, its work is done and closed: the checkpoint written, ``metrics.jsonl`` and the
    trackers closed, the process group destroyed after a barrier. FSDP2's device mesh still holds the gloo
    process group, though, and it is freed during interpreter finalisation, where a C++ destructor race in
    gloo's threads ("terminate called without an active exception") has killed a finished worker with SIGABRT
    about once in a hundred runs: the launcher then reports a successful run as failed (or hides the real
    status, 143 or 3, behind -6). Leaving with ``os._exit`` after flushing is what makes the status exact.
    """
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


# ---------------------------------------------------------------------------------------------- commands


def _print_summary(lines: Sequence[tuple[str, str]]) -> None:
    width = max((len(label) for label, _ in lines), default=0)
    for label, value in lines:
        print(f"  {label:<{width}}  {value}")


def cmd_run(args: argparse.Namespace) -> int:
    path = resolve_recipe_path(args.recipe)
    recipe = load_recipe(path)
    cfg = load_recipe_config(recipe, args.config, args.overrides, args.allow_component, to_run=True)
    launcher = {name: getattr(args, name) for name in LAUNCHER_FLAGS if getattr(args, name) is not None}
    if not launcher or launcher == {"nproc_per_node": 1}:
        recipe.run(cfg)
        return 0
    # Check everything cheap here, once, before starting N processes that would each fail the same way.
    nnodes = str(launcher.get("nnodes", "1"))
    world_size = launcher.get("nproc_per_node", 1) * int(nnodes) if nnodes.isdigit() else None
    recipe.preflight(cfg, world_size=world_size)
    return _launch_elastic(launcher, path, args)


def _launch_elastic(launcher: dict, recipe_path: Path, args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from torchtune_ac.config import resolve_config_path

    torchrun_argv = []
    for name, value in launcher.items():
        torchrun_argv += [f"--{name}", str(value)]
    # Single node and no rendezvous flag: let the launcher pick a free port. (--standalone would override a
    # --master_port or --rdzv_backend the user gave.)
    rendezvous_flags = {"rdzv_endpoint", "rdzv_backend", "master_addr", "master_port"}
    if not rendezvous_flags & launcher.keys() and launcher.get("nnodes", "1") == "1":
        torchrun_argv.append("--standalone")
    recipe_argv = ["--config", str(resolve_config_path(args.config))]
    for prefix in args.allow_component:
        recipe_argv += ["--allow-component", prefix]
    torchrun_argv += [str(recipe_path), *recipe_argv, *args.overrides]
    # Workers run the recipe file as a script: make sure they import this same torchtune_ac.
    package_root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    torchrun_args = get_args_parser().parse_args(torchrun_argv)
    if hasattr(torchrun_args, "signals_to_handle"):
        # SIGTERM and SIGINT are ours to forward (see _forward_stop_signals); the launcher keeps the others.
        torchrun_args.signals_to_handle = ",".join(
            name for name in torchrun_args.signals_to_handle.split(",") if name.strip() not in ("SIGTERM", "SIGINT")
        )
    try:
        with _forward_stop_signals():
            run(torchrun_args)
    except ChildFailedError as err:
        return _status_of_failed_workers({rank: failure.exitcode for rank, failure in err.failures.items()})
    return 0


_STATUSES_OF_WORKERS = (EXIT_USER_ERROR, EXIT_NON_FINITE, EXIT_STOPPED)


def _status_of_failed_workers(exit_codes: dict[int, int]) -> int:
    """The launcher's exit status from its workers' (a negative code: killed by that signal)."""
    # When one worker fails, the launcher terminates the others (negative codes: killed by a signal); the status
    # that matters is that of the workers that exited on their own.
    exited = {rank: code for rank, code in exit_codes.items() if code > 0}
    codes = sorted(set(exited.values()))
    if codes == [EXIT_STOPPED]:
        return EXIT_STOPPED  # rank 0 said where the checkpoint is and how to resume
    if not codes and set(exit_codes.values()) == {-signal.SIGINT}:
        print("tune: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"tune: error: process(es) {sorted(exited) or sorted(exit_codes)} failed with exit status "
          f"{codes or sorted(set(exit_codes.values()))}; see their messages above", file=sys.stderr)
    return codes[0] if len(codes) == 1 and codes[0] in _STATUSES_OF_WORKERS else 1


@contextlib.contextmanager
def _forward_stop_signals() -> Iterator[None]:
    """While the workers run, the launcher passes SIGTERM and SIGINT on to each of them, so they stop after their
    current step with a checkpoint (a second SIGINT: at once), and keeps waiting for them to exit with their own
    status. The workers run in sessions of their own, so a Ctrl-C at the terminal reaches only the launcher, and
    each signal reaches each worker once. Before any worker exists, there is nothing to save: the signal ends the
    launch."""
    import psutil

    def forward(signum: int, frame: object) -> None:
        workers = psutil.Process().children()
        if not workers:
            raise RunStopped(f"stopped by {signal.Signals(signum).name} before the processes started: nothing to save; "
                             "to continue, run the same command with resume_from_checkpoint=true",
                             exit_status=EXIT_STOPPED)
        for worker in workers:
            try:
                os.kill(worker.pid, signum)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_validate(args: argparse.Namespace) -> int:
    from torchtune_ac.config import resolve_config_path

    path = resolve_recipe_path(args.recipe)
    recipe = load_recipe(path)
    cfg = load_recipe_config(recipe, args.config, args.overrides, args.allow_component)
    summary = recipe.preflight(cfg, strict=False, world_size=None)  # validate cannot know how it will be launched
    print(f"config {resolve_config_path(args.config)} is valid for recipe {path.stem}")
    _print_summary(summary)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from torchtune_ac.registry import RECIPES

    width = max(len("RECIPE"), *(len(r.name) for r in RECIPES))
    print(f"{'RECIPE':<{width}}  CONFIG")
    for recipe in RECIPES:
        for i, config in enumerate(recipe.configs):
            print(f"{recipe.name if i == 0 else '':<{width}}  {config}")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    from torchtune_ac.registry import builtin_config_path, find_recipe

    recipe = find_recipe(args.source)
    source = recipe.path if recipe is not None else builtin_config_path(args.source)
    if source is None:
        raise UserError(f"tune cp: {args.source} is not a built-in recipe or config; see `tune ls`")
    dest = Path(args.destination).expanduser()
    # `dir/` names a directory even before it exists (Path drops the trailing slash).
    if dest.is_dir() or args.destination.endswith(("/", os.sep)):
        dest = dest / source.name
    elif dest.suffix == "":
        dest = dest.with_suffix(source.suffix)
    if dest.exists() and not args.force:
        raise UserError(f"tune cp: {dest} already exists; pass --force to overwrite it")
    if not dest.parent.exists():
        if not args.make_parents:
            raise UserError(f"tune cp: directory {dest.parent} does not exist; pass --make-parents to create it")
        dest.parent.mkdir(parents=True)
    try:
        shutil.copyfile(source, dest)
    except OSError as err:
        raise UserError(f"tune cp: cannot write {dest}: {err.strerror}") from None
    print(f"copied {args.source} to {dest}")
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def cmd_plan(args: argparse.Namespace) -> int:
    from torchtune_ac.config.planning import draw_plan, plan_table
    from torchtune_ac.config.schema import FullFinetuneConfig

    path = resolve_recipe_path(args.recipe)
    recipe = load_recipe(path)
    cfg = load_recipe_config(recipe, args.config, args.overrides, args.allow_component)
    if not isinstance(cfg, FullFinetuneConfig):
        raise UserError(f"tune plan: recipe {path.stem} has no memory planner (full_finetune has)")
    png = Path(args.png).expanduser() if args.png is not None else None
    if png is not None and png.suffix.lower() != ".png":
        # matplotlib would pick the format from the suffix: "plan" became plan.png (reported as "wrote plan"),
        # "plan.txt" a traceback.
        raise UserError(f"--png {png}: the file name must end in .png")
    budget = args.budget_gib if args.budget_gib is not None else cfg.ac.ac_memory_budget_gib
    table = plan_table(cfg, world_size=args.nproc, budget_gib=budget)
    print("\n".join(table.lines()))
    if png is not None:
        print(f"wrote {draw_plan(table, png)}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from torchtune_ac.migrate import migrate_file

    migration = migrate_file(args.source, args.output, force=args.force)
    print(f"wrote {args.output} from the torchtune config {args.source}")
    for note in migration.notes:
        print(f"  {note}")
    print(f"check it with: tune validate --config {args.output}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from torchtune_ac.generate import generate_command

    return generate_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="tune", description="Fine-tune Llama-style models from YAML configs.")
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks for user errors (or {DEBUG_ENV_VAR}=1)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    run = sub.add_parser("run", help="run a recipe", description="Run a recipe; N>1 processes use torch.distributed.run.")
    for name, (flags, kind) in LAUNCHER_FLAGS.items():
        run.add_argument(*flags, dest=name, type=kind, default=None, help="passed to torch.distributed.run")
    run.add_argument("recipe", help="built-in recipe name (see `tune ls`) or a path to a recipe .py file")
    _add_config_arguments(run)
    run.set_defaults(handler=cmd_run, overrides=[])

    ls = sub.add_parser("ls", help="list built-in recipes and their configs")
    ls.set_defaults(handler=cmd_ls)

    cp = sub.add_parser("cp", help="copy a built-in config or recipe to edit it")
    cp.add_argument("source", help="built-in config (llama3/8B_full) or recipe (full_finetune)")
    cp.add_argument("destination", help="file or directory to copy to")
    cp.add_argument("--force", "-f", action="store_true", help="overwrite an existing file")
    cp.add_argument("--make-parents", action="store_true", help="create missing parent directories")
    cp.set_defaults(handler=cmd_cp)

    validate = sub.add_parser("validate", help="check a config without running it")
    validate.add_argument("--recipe", default="full_finetune", help="recipe whose schema applies (default: full_finetune)")
    _add_config_arguments(validate)
    validate.set_defaults(handler=cmd_validate, overrides=[])

    plan = sub.add_parser("plan", help="estimate memory per process for every activation checkpointing setting",
                          description="Estimate the memory per process of a training step for every AC setting "
                          "(a step simulated under fake tensors: no weights, no memory), and which one fits a budget.")
    plan.add_argument("--recipe", default="full_finetune", help="recipe whose schema applies (default: full_finetune)")
    plan.add_argument("--nproc", type=_int_at_least(1), default=1, help="processes the run will use (FSDP2)")
    plan.add_argument("--budget-gib", dest="budget_gib", type=_positive_float, default=None,
                      help="memory per process to fit in (default: the config's ac_memory_budget_gib)")
    plan.add_argument("--png", default=None, metavar="PATH", help="also draw the estimates as a PNG at PATH")
    _add_config_arguments(plan)
    plan.set_defaults(handler=cmd_plan, overrides=[])

    migrate = sub.add_parser("migrate", help="convert a torchtune config to a torchtune_ac config")
    migrate.add_argument("source", help="torchtune YAML config (full fine-tuning)")
    migrate.add_argument("--output", "-o", required=True, help="YAML file to write")
    migrate.add_argument("--force", "-f", action="store_true", help="overwrite an existing file")
    migrate.set_defaults(handler=cmd_migrate)

    generate = sub.add_parser("generate", help="generate text with a fine-tuned checkpoint",
                              description="Continue a prompt with a checkpoint's model (transformers' own generation; "
                              "greedy by default) and print only the generated text on stdout.")
    generate.add_argument("--checkpoint", required=True,
                          help="a Hugging Face checkpoint folder, or a run's output_dir (its latest checkpoint)")
    generate.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    layout = generate.add_mutually_exclusive_group()
    layout.add_argument("--chat", action="store_true",
                        help="render the prompt as a user turn with the saved chat template")
    layout.add_argument("--alpaca", action="store_true",
                        help="lay the prompt out as instruct_dataset's Alpaca template does (its default)")
    generate.add_argument("--max-new-tokens", dest="max_new_tokens", type=_int_at_least(1), default=256,
                          help="at most this many new tokens (default: 256)")
    generate.add_argument("--temperature", type=_non_negative_float, default=0.0,
                          help="0 (default): greedy; above 0: sample at this temperature")
    generate.add_argument("--seed", type=_int_at_least(0), default=0, help="seed for sampling (default: 0)")
    generate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                          help="auto (default): CUDA when present")
    generate.set_defaults(handler=cmd_generate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``tune`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv.remove("--debug")
        os.environ[DEBUG_ENV_VAR] = "1"

    def _main() -> int:
        args = parse_with_overrides(build_parser(), argv)
        return args.handler(args)

    return guarded(_main)


if __name__ == "__main__":
    sys.exit(main())
