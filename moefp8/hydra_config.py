"""The training config from the command line: Hydra composes configs/ with the overrides onto the
dataclass schema (moefp8.config), then `validate`; every failure becomes one `ConfigError` line
naming the override or key (`python -m moefp8.train` prints it as `config error: ...`).

    cfg = load_config(["model=small", "recipe=bf16"])   # what `python -m moefp8.train model=small recipe=bf16` runs

`config_help()` is the text of `python -m moefp8.train --help`: the groups of configs/ and every key
of the schema with its type, default and description, read from moefp8/config.py's comments.
"""

import ast
import functools
import inspect
import io
import json
import os
import textwrap
import tokenize
import types
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import torch

from moefp8.config import Config, validate
from moefp8.errors import UserError, first_line

# configs/ sits beside the package in the repository (installed editable); MOEFP8_CONFIG_DIR
# points elsewhere (e.g. a non-editable install).
CONFIG_DIR = os.environ.get("MOEFP8_CONFIG_DIR", str(Path(__file__).resolve().parent.parent / "configs"))


class ConfigError(UserError):
    """A config that cannot run; the message is one line, `key=value: why`."""


def _unknown_keys(node, schema, prefix: str = "") -> list[str]:
    """Keys of the composed config that the dataclass schema lacks (a `+key=value` override adds
    them silently, and OmegaConf.to_object keeps them as stray attributes)."""
    known = {f.name: f for f in fields(schema)}
    out = []
    for k in node.keys():
        if k not in known:
            out.append(f"{prefix}{k}")
        elif is_dataclass(known[k].type) and hasattr(node[k], "keys"):
            out += _unknown_keys(node[k], known[k].type, f"{prefix}{k}.")
    return out


def describe_config_error(e: BaseException, overrides: list[str]) -> str:
    """One line `key=value: why` for whatever Hydra, OmegaConf, YAML or `validate` raised while
    turning the overrides into a Config."""
    import yaml
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    def override_for(key: str) -> str:  # the command-line override that set key (or under it), else key
        for ov in overrides:
            k = ov.lstrip("+~").split("=", 1)[0]
            if k == key or k.startswith(key + ".") or key.startswith(k + "."):
                return ov
        return key

    if isinstance(e, OverrideParseException):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        for ov in overrides:
            try:
                OverridesParser.create().parse_overrides([ov])
            except OverrideParseException as e1:
                return (f"{ov}: cannot parse the override ({first_line(e1)}); quote values with special "
                        f"characters, e.g. 'train.out_dir=\"a b\"'")
        return f"cannot parse the overrides: {first_line(e)}"
    if isinstance(e, MissingConfigException):
        group = (e.missing_cfg_file or "").split("/")[0]
        if e.options:
            return (f"{override_for(group)}: no such option in configs/{group}/; one of: "
                    f"{', '.join(e.options)}")
        return first_line(e)
    for c in (e, e.__cause__, e.__context__):
        if isinstance(c, yaml.MarkedYAMLError):
            mark = c.problem_mark
            where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark else "a config file"
            return f"{where}: malformed YAML: {c.problem or c.context}"
        if isinstance(c, OmegaConfBaseException) and getattr(c, "full_key", None):
            why = first_line(c.msg if getattr(c, "msg", None) else c)
            hint = " (python -m moefp8.train --cfg job lists the keys)" if "not in" in why else ""
            return f"{override_for(c.full_key)}: {why}{hint}"
    msg = first_line(e) or type(e).__name__
    keyed = [(ov, ov.lstrip("+~").split("=", 1)[0]) for ov in overrides]
    if not any(msg.startswith((ov, k)) for ov, k in keyed if k):  # name the override it is about
        about = [ov for ov, k in keyed if k and f"'{k}'" in msg] or (overrides if len(overrides) == 1 else [])
        if about:
            return f"{about[0]}: {msg}"
    return msg


def _auto_model_overrides(overrides: list[str], device: str) -> list[str]:
    """train.device=auto on a GPU machine with no model= (nor experiment=) on the command line:
    experiment=small_gpu (the small model with its tuned lr and batch; the tiny default is for CPUs)."""
    if device != "auto" or not torch.cuda.is_available():
        return overrides
    if any(ov.lstrip("+~").split("=")[0] in ("model", "experiment") for ov in overrides):
        return overrides
    print("train: a GPU and train.device=auto: using experiment=small_gpu (pass model=tiny to override)")
    return overrides + ["experiment=small_gpu"]


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="config_schema", node=Config)


def load_config(overrides: list[str] = (), auto_model: bool = False) -> Config:
    """The validated Config that `python -m moefp8.train *overrides` runs (Hydra's compose API on
    configs/ and the schema). Any failure, from an override Hydra cannot parse to a value
    `validate` rejects, raises ConfigError with one line naming the key (the CLI prints it as
    `config error: ...`). auto_model: the entry point's experiment=small_gpu on a GPU machine."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    import yaml

    overrides = list(overrides)
    errors = (HydraException, OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError)
    register_schema()
    GlobalHydra.instance().clear()

    def to_object(ovs):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            d = compose(config_name="config", overrides=ovs)
        return d, OmegaConf.to_object(d)

    try:
        dcfg, cfg = to_object(overrides)
        if auto_model:
            ovs = _auto_model_overrides(overrides, cfg.train.device)
            if ovs != overrides:
                overrides = ovs
                dcfg, cfg = to_object(ovs)
    except errors as e:
        msg = describe_config_error(e, overrides)
        if len(overrides) > 1 and not msg.startswith(tuple(overrides)):  # which override is it?
            for ov in overrides:
                try:
                    to_object([ov])
                except errors as e1:
                    msg = describe_config_error(e1, [ov])
                    break
        raise ConfigError(msg) from e
    stray = _unknown_keys(dcfg, Config)
    if stray:
        raise ConfigError(f"{stray[0]}: no such key in the config schema (moefp8/config.py; "
                          f"python -m moefp8.train --cfg job lists the keys)")
    try:
        validate(cfg)
        _check_new_data_path(cfg, overrides)
    except ValueError as e:  # already `key=value: why`
        raise ConfigError(str(e)) from e
    return cfg


def _check_new_data_path(cfg: Config, overrides: list[str]) -> None:
    """A data.path given on the command line that does not exist, with data.prepare_from left at its
    preset's value: most likely a mistyped path to prepared data, which would otherwise be made and
    filled from the preset's source (e.g. the standard library) and trained on. Preparing a new
    folder needs data.prepare_from said as well. ValueError (one line) naming both."""
    keys = {ov.lstrip("+~").split("=", 1)[0] for ov in overrides}
    d = cfg.data
    if "data.path" in keys and "data.prepare_from" not in keys and d.prepare_from and not os.path.exists(d.path):
        raise ValueError(f"data.path={d.path!r} does not exist, and data.prepare_from={d.prepare_from!r} is the "
                         f"data preset's, not given: correct the path to your prepared data, or add "
                         f"data.prepare_from={d.prepare_from} to prepare {d.path} from it")


def compose_config(overrides: list[str] = ()) -> Config:
    """load_config without the device-dependent model pick (for tests and tools)."""
    return load_config(overrides)


# --- `python -m moefp8.train --help` ---------------------------------------------------------------

HELP_WIDTH = 100  # the columns config_help wraps to
_HELP_COL = 38  # where a key's description starts (on the next line when the key, type and default are longer)

_USAGE = """\
usage: python -m moefp8.train [group=option ...] [key=value ...]
       torchrun --nproc_per_node N -m moefp8.train [group=option ...] [key=value ...]
       python -m moefp8.train -m [group=a,b ...] [key=x,y ...]
       python -m moefp8.train --cfg job [group=option ...] [key=value ...]

Trains the MoE transformer on the config that Hydra composes from configs/ (the groups below, each
filling one section) and the overrides, checked against the schema moefp8/config.py (the keys
below). Examples:
  python -m moefp8.train model=small recipe=bf16 train.steps=1000 optim.lr=3e-4
  python -m moefp8.train experiment=tiny_bf16 train.out_dir=outputs/runs/baseline
  python -m moefp8.train -m recipe=fp8,bf16 optim.lr=1e-3,3e-3
-m (multirun): one run per combination of the comma lists, one after another, each in its own run
  dir <train.out_dir>-sweep/<the job's overrides>/ (the same sweep run again resumes each job).
--cfg job: print the composed config (YAML) and exit. --hydra-help: Hydra's own flags."""


def config_groups(config_dir: str = CONFIG_DIR) -> list[tuple[str, list[str], str | None]]:
    """[(group, options, default)] for the folders of config_dir: options are the stems of the
    folder's *.yaml files, sorted; default is the option config.yaml's defaults list picks (None:
    none, e.g. `experiment: null`). In the defaults list's order, then other folders by name."""
    import yaml

    root = Path(config_dir)
    groups = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in root.iterdir() if d.is_dir()}
    picked = {}  # group -> option, from entries like `model: tiny`, `optional data@x: y`, `experiment: null`
    main = root / "config.yaml"
    for entry in (yaml.safe_load(main.read_text()) or {}).get("defaults", []) if main.is_file() else []:
        if isinstance(entry, dict):
            for key, option in entry.items():
                group = key.removeprefix("optional ").split("@")[0].strip()
                if group in groups:
                    picked[group] = option
    order = list(picked) + sorted(g for g in groups if g not in picked)
    return [(g, groups[g], picked.get(g)) for g in order if groups[g]]


@functools.lru_cache(maxsize=None)
def _module_comments(module) -> tuple[ast.Module, dict[int, str], dict[int, str]]:
    """(the module's AST, {line: text} of its comments on lines of their own, {line: text} of its
    comments at the end of a code line), from the module's source (tokenize: no `#` in strings)."""
    src = inspect.getsource(module)
    own, trailing = {}, {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (own if not tok.line[:tok.start[1]].strip() else trailing)[tok.start[0]] = text
    return ast.parse(src), own, trailing


def schema_docs(cls) -> tuple[str, dict[str, str]]:
    """(section description, {field name: description}) of a schema dataclass, read from its source:
    the class docstring, else the `#` lines directly above the class (and its decorators); for a
    field, the `#` lines directly above it followed by the comment at the end of its line(s).
    Whitespace is collapsed; "" where there is none."""
    tree, own, trailing = _module_comments(inspect.getmodule(cls))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)

    def above(line: int) -> list[str]:  # the comment block ending on the line before `line`
        block = []
        while line - 1 in own:
            line -= 1
            block.insert(0, own[line])
        return block

    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    section = ast.get_docstring(node) or " ".join(above(first))
    docs = {}
    for st in node.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            ends = [trailing[n] for n in range(st.lineno, st.end_lineno + 1) if n in trailing]
            docs[st.target.id] = " ".join(above(st.lineno) + ends)
    return " ".join(section.split()), {k: " ".join(v.split()) for k, v in docs.items()}


def _type_name(t) -> str:
    if isinstance(t, str):  # postponed annotations
        return t
    if isinstance(t, type) and not isinstance(t, types.GenericAlias):
        return t.__name__
    return str(t).replace("typing.", "")


def _value_text(v) -> str:
    """A default as it is written in an override or the YAML: true, "fp8", 0.001, ["wo"]."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value_text(x) for x in v) + "]"
    return repr(v)


def schema_keys(schema=Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """[(key, type, default, description)] of every leaf field of the schema, depth first in
    declaration order; key is dotted (`model.hidden`), default as written in an override."""
    _, docs = schema_docs(schema)
    out = []
    for f in fields(schema):
        if is_dataclass(f.type):
            out += schema_keys(f.type, f"{prefix}{f.name}.")
            continue
        if f.default is not MISSING:
            default = _value_text(f.default)
        elif f.default_factory is not MISSING:
            default = _value_text(f.default_factory())
        else:
            default = "???"  # required: OmegaConf's mark for a missing value
        out.append((prefix + f.name, _type_name(f.type), default, docs.get(f.name, "")))
    return out


def config_help(width: int = HELP_WIDTH) -> str:
    """The text `python -m moefp8.train --help` prints: usage, the config groups of CONFIG_DIR with
    their options (config.yaml's defaults marked), then every key of the schema (moefp8.config.Config)
    by section: `key: type = default` and its description from the schema's docstrings and `#`
    comments (schema_docs). Lines of at most `width` columns but for unbreakable words."""
    wrap = functools.partial(textwrap.wrap, break_on_hyphens=False, break_long_words=False)
    out = _USAGE.splitlines() + ["", "Config groups (group=option picks configs/<group>/<option>.yaml):"]
    groups = config_groups()
    pad = max((len(g) for g, _, _ in groups), default=0) + 4
    for group, options, default in groups:
        names = [f"{o} (default)" if o == default else o for o in options]
        if default is None:
            names[-1] += " (default: none)"
        out += wrap(" | ".join(names), width, initial_indent=f"  {group}:".ljust(pad), subsequent_indent=" " * pad)
    out += ["", "Keys (key=value). The defaults shown are the schema's; the groups' YAML files set many of them",
            "(--cfg job prints the composed values):"]
    sections = [f for f in fields(Config) if is_dataclass(f.type)]
    for sec in sections:
        out.append("")
        doc, _ = schema_docs(sec.type)
        out += wrap(doc or sec.type.__name__, width, initial_indent=f"{sec.name}: ", subsequent_indent="    ")
        for key, type_name, default, desc in schema_keys(sec.type, f"{sec.name}."):
            left = f"  {key}: {type_name} = {default}"
            lines = wrap(desc, width - _HELP_COL) or [""]
            if len(left) + 2 <= _HELP_COL:
                out.append((left.ljust(_HELP_COL) + lines.pop(0)).rstrip())
            else:
                out.append(left)
            out += [" " * _HELP_COL + line for line in lines]
    return "\n".join(out) + "\n"
