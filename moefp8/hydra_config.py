"""The training config from the command line: Hydra composes configs/ with the overrides onto the
dataclass schema (moefp8.config), then `validate`; every failure becomes one `ConfigError` line
naming the override or key (`python -m moefp8.train` prints it as `config error: ...`).

    cfg = load_config(["model=small", "recipe=bf16"])   # what `python -m moefp8.train model=small recipe=bf16` runs
"""

import os
from dataclasses import fields, is_dataclass
from pathlib import Path

import torch

from moefp8.config import Config, validate

# configs/ sits beside the package in the repository (installed editable); MOEFP8_CONFIG_DIR
# points elsewhere (e.g. a non-editable install).
CONFIG_DIR = os.environ.get("MOEFP8_CONFIG_DIR", str(Path(__file__).resolve().parent.parent / "configs"))


class ConfigError(ValueError):
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


def first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


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
    except ValueError as e:  # already `key=value: why`
        raise ConfigError(str(e)) from e
    return cfg


def compose_config(overrides: list[str] = ()) -> Config:
    """load_config without the device-dependent model pick (for tests and tools)."""
    return load_config(overrides)
