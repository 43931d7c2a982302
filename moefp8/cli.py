"""`python -m moefp8.train`'s command line: Hydra's arguments, `--help` (the config reference),
the config composed and checked once before Hydra (a bad override, launch or run dir is one line,
on rank 0), `--multirun`, and how the run's end becomes the exit status: a UserError one line, a
lost peer one line and exit 1 without a shutdown that could hang, a stop by signal EXIT_STOPPED.
The training itself is the `train` function passed in (moefp8.train)."""

import os
import sys
from typing import Callable

from moefp8.config import Config, validate
from moefp8.errors import EXIT_INTERRUPTED, EXIT_STOPPED, UserError, first_line, report
from moefp8.hydra_config import CONFIG_DIR, config_help, load_config, register_schema
from moefp8.launch import check_launch, comm_failure, job_dir_name
from moefp8.rundir import open_run_dir


def _main(train: Callable[[Config], dict]) -> None:
    import hydra
    from hydra._internal.utils import get_args_parser
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    args = get_args_parser().parse_args()  # what @hydra.main parses (exits with usage on a bad flag)
    env, pre = os.environ, None
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    quiet = rank != 0  # what every rank finds alike (the config, the run dir) is reported by rank 0
    if args.help:
        try:
            print(config_help(), flush=True)
        except BrokenPipeError:  # `--help | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    if not (args.hydra_help or args.cfg or args.info or args.shell_completion or args.multirun):
        try:  # compose once here: any config problem is one line, before Hydra's own (multi-line) report
            pre = load_config(args.overrides, auto_model=True)
            check_launch(pre, env)
        except ValueError as e:
            report(f"config error: {e}", quiet=quiet)
        try:  # before Hydra creates it (hydra.run.dir): a file, a folder that cannot be written, ...
            open_run_dir(pre.train.out_dir, pre.train.resume)
        except UserError as e:
            report(f"error: {e}", quiet=quiet)
    register_schema()
    OmegaConf.register_new_resolver("moefp8_job_dir", job_dir_name, replace=True)

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
    def entry(dcfg) -> None:  # --cfg/--info are answered by Hydra before this runs
        cfg = pre
        try:
            if cfg is None:  # --multirun: one job per composed config, each in its own run dir
                cfg = OmegaConf.to_object(dcfg)
                validate(cfg)
                check_launch(cfg, env)
                hc = HydraConfig.get()
                if hc.mode == RunMode.MULTIRUN:
                    cfg.train.out_dir = hc.runtime.output_dir
                    print(f"multirun job {hc.job.num}: run dir {cfg.train.out_dir}")
        except ValueError as e:
            report(f"config error: {e}", quiet=quiet)
        try:
            out = train(cfg)
        except UserError as e:
            report(f"error: {e}", quiet=e.quiet)
        except Exception as e:
            if world == 1 or not comm_failure(e):
                raise
            # a peer is gone: no clean shutdown of the process group is possible (it could hang)
            print(f"error: rank {rank}: a collective failed, a peer rank died or hangs (collectives wait "
                  f"at most train.dist_timeout_s={cfg.train.dist_timeout_s:g} s): {first_line(e)}",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        if out.get("stopped"):
            sys.stdout.flush()
            sys.exit(EXIT_STOPPED)

    entry()


def main(train: Callable[[Config], dict]) -> None:
    """The command line around `train` (moefp8.train.train), with a Ctrl-C before training began
    (no handler yet) as one line."""
    try:
        _main(train)
    except KeyboardInterrupt:
        report("interrupted before training began; nothing was written", EXIT_INTERRUPTED,
               quiet=os.environ.get("RANK", "0") != "0")
