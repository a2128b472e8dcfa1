"""The ``tune`` command: ``run``, ``ls``, ``cp``, ``validate``, ``plan``, ``migrate``, ``generate``.

Exit status: 0 success, 2 user error (one short message on stderr, no traceback), 1 internal failure
(traceback) or a process of a multi-process run killed (one line naming it); a run that stopped early says why in
one line: 143 stopped by SIGTERM or a first Ctrl-C after writing a checkpoint, 3 stopped on a non-finite loss or
gradient norm (nothing saved), 130 aborted by a second Ctrl-C; 141 (silently) when the reader of stdout went away, as in ``tune ls | head -1``. ``--debug`` or ``TUNE_DEBUG=1`` shows tracebacks for user errors too.

A recipe is a Python file that defines ``CONFIG_SCHEMA`` (a dataclass), ``preflight(cfg, *, strict=True,
world_size=1) -> list[tuple[str, str]]`` (the run's plan and the checks' findings, as ``tune validate`` prints them;
with ``strict=False`` what is missing on this machine is a warning) and ``run(cfg)``; optionally ``plan`` (``tune
plan``) and ``check_launch`` (what the launcher checks before starting N processes; see ``registry.py``). Run as a
script (under PyTorch's elastic launcher) it calls :func:`recipe_main`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import shutil
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Callable, NoReturn, Optional, Sequence

from torchtune_ac.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    RunStopped,
    UserError,
)
from torchtune_ac.observability.third_party_noise import filter_known_noise
from torchtune_ac.runtime.allocator import use_expandable_segments_by_default
from torchtune_ac.runtime.cpu_threads import set_thread_defaults
from torchtune_ac.runtime.launcher import (
    LAUNCHER_FLAGS,
    int_at_least,
    launch_elastic,
    launched_rank,
    launched_world_size,
    leave_worker,
    lost_peer,
    report_worker_error,
    report_worker_failure,
    report_worker_lost,
)

DEBUG_ENV_VAR = "TUNE_DEBUG"


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but usage errors become ``UserError`` (exit 2 through the same path as every user error)."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message}")


def _debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV_VAR, "") not in ("", "0", "false", "False")


def _report_user_error(err: UserError) -> None:
    if _debug_enabled():
        traceback.print_exc()
    # A worker of a multi-process run hands its line to the launcher, which prints each distinct one once.
    if launched_world_size() > 1 and report_worker_error(str(err)):
        return
    prefix = "tune: error: "
    if launched_world_size() > 1:
        prefix += f"[rank {launched_rank()}] "
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
    names = [r.name for r in RECIPES]
    # torchtune's recipe names (full_finetune_single_device, lora_finetune_distributed) are one recipe here.
    prefix = [name for name in names if recipe.startswith(f"{name}_")]
    near = difflib.get_close_matches(recipe, names, n=1)
    hint = (f"did you mean {prefix[0]}? It runs on one device and on many; " if prefix
            else f"did you mean {near[0]}? " if near else "")
    raise UserError(f"recipe {recipe}: not a built-in recipe ({', '.join(names)}) and not a .py file ({hint}see "
                    "`tune ls`)")


def recipe_of(args: argparse.Namespace) -> str:
    """``tune validate`` and ``tune plan``'s recipe: ``--recipe``, else the one the config's launch comment names
    (``#   tune run full_dpo --config ...``), else ``full_finetune``.

    Raises:
        UserError: the config is neither a file nor a built-in config.
    """
    from torchtune_ac.config import resolve_config_path
    from torchtune_ac.registry import config_recipe

    if args.recipe is not None:
        return args.recipe
    return config_recipe(resolve_config_path(args.config)) or "full_finetune"


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
    from torchtune_ac.registry import RECIPE_INTERFACE

    missing = [name for name in RECIPE_INTERFACE if not hasattr(module, name)]
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


_OVERRIDES_HELP = ("overrides: config keys to change, in Hydra's grammar: key=value, a.b=value, +new.key=value, ~key, "
                   "key=[1,2]; before or after --config")


def _add_overrides_to_usage(parser: argparse.ArgumentParser) -> None:
    """Show ``[overrides ...]`` in the usage line of a command that takes them (they are collected by
    :func:`parse_with_overrides`, not declared to argparse), and say what they are below the flags."""
    parser.usage = parser.format_usage().removeprefix("usage: ").rstrip() + " [overrides ...]"
    parser.epilog = _OVERRIDES_HELP


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
    use_expandable_segments_by_default()
    if recipe_file is None:  # the process's entry point (started by torchrun, not by tune run's launcher)
        set_thread_defaults()
    filter_known_noise()

    def _main() -> None:
        parser = _ArgumentParser(prog=f"tune run {path.stem}")
        _add_config_arguments(parser)
        parser.set_defaults(overrides=[])
        args = parse_with_overrides(parser, list(sys.argv[1:] if argv is None else argv))
        recipe = load_recipe(path)
        recipe.run(load_recipe_config(recipe, args.config, args.overrides, args.allow_component, to_run=True))

    if launched_world_size() <= 1:
        return guarded(_main)
    try:
        status = guarded(_main)
    except BaseException as err:  # noqa: BLE001 - a bug, or the machine failing (a CUDA OOM): say so now, and leave
        # Now, not after a teardown: the other ranks may be waiting in a collective this rank will never join,
        # and destroying the process group under them can hang (NCCL). The launcher ends them. A rank whose peer
        # died says so in a line; the launcher names the process that died.
        text, lost = traceback.format_exc(), lost_peer(err)
        said = lost is not None and not _debug_enabled() and report_worker_lost(lost)
        if not said and not report_worker_failure(text):
            print(text, file=sys.stderr, flush=True)
        status = 1
    leave_worker(status)


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
    # Only what the processes would report differently from one another: everything else rank 0 checks and every
    # rank reports alike, once (the launcher prints each distinct line once).
    from torchtune_ac.registry import LaunchCheckedRecipe

    nnodes = str(launcher.get("nnodes", "1"))
    nproc_per_node = launcher.get("nproc_per_node", 1)
    if isinstance(recipe, LaunchCheckedRecipe):
        recipe.check_launch(cfg, world_size=nproc_per_node * int(nnodes) if nnodes.isdigit() else None,
                            nproc_per_node=nproc_per_node)
    from torchtune_ac.config import resolve_config_path

    recipe_argv = ["--config", str(resolve_config_path(args.config))]
    for prefix in args.allow_component:
        recipe_argv += ["--allow-component", prefix]
    return launch_elastic(launcher, path, [*recipe_argv, *args.overrides])


def cmd_validate(args: argparse.Namespace) -> int:
    from torchtune_ac.config import resolve_config_path

    path = resolve_recipe_path(recipe_of(args))
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
    from torchtune_ac.registry import PlannedRecipe
    from torchtune_ac.run.memory_table import draw_memory_table

    path = resolve_recipe_path(recipe_of(args))
    recipe = load_recipe(path)
    if not isinstance(recipe, PlannedRecipe):
        raise UserError(f"tune plan: recipe {path.stem} declares no workload for the memory planner (it defines "
                        "no plan(cfg, *, world_size, budget_gib); full_finetune does)")
    cfg = load_recipe_config(recipe, args.config, args.overrides, args.allow_component)
    png = Path(args.png).expanduser() if args.png is not None else None
    if png is not None and png.suffix.lower() != ".png":
        # matplotlib would pick the format from the suffix: "plan" became plan.png (reported as "wrote plan"),
        # "plan.txt" a traceback.
        raise UserError(f"--png {png}: the file name must end in .png")
    table = recipe.plan(cfg, world_size=args.nproc, budget_gib=args.budget_gib)
    print("\n".join(table.lines()))
    if png is not None:
        print(f"wrote {draw_memory_table(table, png)}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from torchtune_ac.compat.torchtune.migrate import migrate_file

    migration = migrate_file(args.source, args.output, force=args.force)
    print(f"wrote {args.output} from the torchtune config {args.source}")
    for note in migration.notes:
        print(f"  {note}")
    print(f"check it with: tune validate --config {args.output}{migration.flags()}")
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
    _add_overrides_to_usage(run)

    ls = sub.add_parser("ls", help="list built-in recipes and their configs")
    ls.set_defaults(handler=cmd_ls)

    cp = sub.add_parser("cp", help="copy a built-in config or recipe to edit it")
    cp.add_argument("source", help="built-in config (llama3/8B_full) or recipe (full_finetune)")
    cp.add_argument("destination", help="file or directory to copy to")
    cp.add_argument("--force", "-f", action="store_true", help="overwrite an existing file")
    cp.add_argument("--make-parents", action="store_true", help="create missing parent directories")
    cp.set_defaults(handler=cmd_cp)

    validate = sub.add_parser("validate", help="check a config without running it")
    validate.add_argument("--recipe", default=None, help="recipe whose schema applies (default: the one the config's "
                          "launch comment names, else full_finetune)")
    _add_config_arguments(validate)
    validate.set_defaults(handler=cmd_validate, overrides=[])
    _add_overrides_to_usage(validate)

    plan = sub.add_parser("plan", help="estimate memory per process for every activation checkpointing setting",
                          description="Estimate the memory per process of a training step for every AC setting "
                          "(a step simulated under fake tensors: no weights, no memory), and which one fits a budget.")
    plan.add_argument("--recipe", default=None, help="recipe whose schema applies (default: the one the config's "
                      "launch comment names, else full_finetune)")
    plan.add_argument("--nproc", type=int_at_least(1), default=None,
                      help="processes the run will use (default: the fewest the config's parallel degrees need, "
                      "1 without any)")
    plan.add_argument("--budget-gib", dest="budget_gib", type=_positive_float, default=None,
                      help="memory per process to fit in (default: the config's ac_memory_budget_gib)")
    plan.add_argument("--png", default=None, metavar="PATH", help="also draw the estimates as a PNG at PATH")
    _add_config_arguments(plan)
    plan.set_defaults(handler=cmd_plan, overrides=[])
    _add_overrides_to_usage(plan)

    migrate = sub.add_parser("migrate", help="convert a torchtune config to a torchtune_ac config")
    migrate.add_argument("source", help="torchtune YAML config (full fine-tuning)")
    migrate.add_argument("--output", "-o", required=True, help="YAML file to write")
    migrate.add_argument("--force", "-f", action="store_true", help="overwrite an existing file")
    migrate.set_defaults(handler=cmd_migrate)

    generate = sub.add_parser("generate", help="generate text with a fine-tuned checkpoint",
                              description="Continue a prompt with a checkpoint's model (transformers' own generation; "
                              "greedy by default) and print only the generated text on stdout.")
    generate.add_argument("--checkpoint", required=True,
                          help="a Hugging Face checkpoint folder, or a run's output_dir (its latest checkpoint); a LoRA "
                               "run's checkpoint: its merged/ model (adapter.save_merged)")
    generate.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    layout = generate.add_mutually_exclusive_group()
    layout.add_argument("--chat", action="store_true",
                        help="render the prompt as a user turn with the saved chat template")
    layout.add_argument("--alpaca", action="store_true",
                        help="lay the prompt out as instruct_dataset's Alpaca template does (its default)")
    generate.add_argument("--max-new-tokens", dest="max_new_tokens", type=int_at_least(1), default=256,
                          help="at most this many new tokens (default: 256)")
    generate.add_argument("--temperature", type=_non_negative_float, default=0.0,
                          help="0 (default): greedy; above 0: sample at this temperature")
    generate.add_argument("--seed", type=int_at_least(0), default=0, help="seed for sampling (default: 0)")
    generate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                          help="auto (default): CUDA when present")
    generate.set_defaults(handler=cmd_generate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``tune`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    use_expandable_segments_by_default()
    filter_known_noise()
    if "--debug" in argv:
        argv.remove("--debug")
        os.environ[DEBUG_ENV_VAR] = "1"
    if argv[:1] == ["run"] and "torch" not in sys.modules:
        # Before torch is imported, for libgomp to read; a caller that imported torch keeps its own threads.
        set_thread_defaults()

    def _main() -> int:
        args = parse_with_overrides(build_parser(), argv)
        return args.handler(args)

    return guarded(_main)


if __name__ == "__main__":
    sys.exit(main())
