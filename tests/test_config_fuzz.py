"""Fuzz of the Hydra config surface: random command-line overrides (keys from the schema and
made-up ones, values of the right type, the wrong type, out of range, non-finite, random text
with Hydra's special characters; group options real and made-up; `+`, `++` and `~` prefixes) go
through the real Hydra compose and `validate` (`moefp8.hydra_config.load_config`) and the launch checks.
Every outcome is a Config or a ConfigError/ValueError of one line naming a key: never another
exception type, never a multi-line message. A config that passes and changed the model builds
it and runs one finite forward (when the model is small enough).

CI draws 150 examples (derandomized: the same ones every run; ~10 s in all, Hydra's compose);
MOEFP8_FUZZ_EXAMPLES=2000 python -m pytest tests/test_config_fuzz.py explores further with fresh
draws."""

import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moefp8.config import Config
from moefp8.model import Transformer, param_counts
from moefp8.recipe import Recipe
from moefp8.hydra_config import ConfigError, load_config
from moefp8.launch import check_launch

N = int(os.environ.get("MOEFP8_FUZZ_EXAMPLES", "0"))
SETTINGS = settings(max_examples=N or 150, deadline=None, derandomize=not N, database=None,
                    suppress_health_check=list(HealthCheck))
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in CONFIGS.iterdir() if g.is_dir()}
KEYS = {f"{sec.name}.{f.name}": f.type for sec in fields(Config) for f in fields(sec.type)}
SPECIAL = "=,[]{}()$'\":\\%@!#&*?~+ \t/."

words = st.text(st.characters(min_codepoint=32, max_codepoint=126) | st.sampled_from(list(SPECIAL) + ["é", "∞"]),
                max_size=12)
ints = st.one_of(st.integers(-3, 300), st.integers(-2**70, 2**70), st.sampled_from([0, 1, 2, 3, 7, 8, 16, 128, 256]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e-30, 1e30]))
texts = st.sampled_from(["inf", "-inf", "nan", "1e400", "true", "null", "''", "[]", "{}", "[1,2]", "${train.steps}",
                         "${nope}", "0x10", "1_000", "abc", "a b", "'quoted'", "\"x\""])


def render(v) -> str:
    return repr(v) if isinstance(v, float) else ("true" if v is True else "false" if v is False else str(v))


@st.composite
def override(draw) -> str:
    kind = draw(st.sampled_from(["value", "value", "value", "group", "unknown", "prefixed"]))
    if kind == "group":
        g = draw(st.sampled_from(sorted(GROUPS)))
        return f"{g}={draw(st.sampled_from(GROUPS[g]) | words)}"
    if kind == "unknown":
        return f"{draw(st.sampled_from(sorted(GROUPS)) | words)}.{draw(words)}={draw(words)}"
    key = draw(st.sampled_from(sorted(KEYS)))
    typ = KEYS[key]
    names = st.lists(st.sampled_from(["wqkv", "wo", "dense_mlp"]) | words, max_size=3)  # list[str] fields
    right = {int: ints, float: floats | ints, bool: st.booleans(), str: words,
             list[str]: names.map(lambda xs: "[" + ",".join(xs) + "]"),
             Any: st.sampled_from([False, True, "auto"]) | words}[typ]  # dispatch.overlap: false | true | auto
    value = draw(st.one_of(right, right, ints, floats, st.booleans(), words, texts))
    if kind == "prefixed":
        prefix = draw(st.sampled_from(["+", "++", "~"]))
        return f"~{key}" if prefix == "~" and draw(st.booleans()) else f"{prefix}{key}={render(value)}"
    return f"{key}={render(value)}"


def one_line(e: BaseException, overrides: list[str]) -> None:
    """One line that starts by naming what it is about: an override, a schema key (validate's
    `key=value: why`), a config group or a config file (malformed YAML)."""
    msg = str(e)
    assert msg and "\n" not in msg and "Traceback" not in msg, repr(msg)
    head = msg.split(": ")[0]
    name = head.split("=")[0].split("*")[0]
    keys = {o.lstrip("+~").split("=")[0] for o in overrides}
    assert (msg.startswith(tuple(o + ": " for o in overrides)) or name in KEYS or name in GROUPS or name in keys
            or head.endswith(".yaml")), msg


@SETTINGS
@given(st.lists(override(), min_size=1, max_size=3))
def test_random_overrides_give_a_config_or_one_line(overrides):
    try:
        cfg = load_config(overrides)
    except ConfigError as e:
        one_line(e, overrides)
        return
    try:
        check_launch(cfg, {})
    except ValueError as e:  # e.g. train.device=cuda on a CPU machine, dispatch=all_to_all on one process
        one_line(e, overrides)
        return
    assert isinstance(cfg, Config)
    touched_model = any(o.lstrip("+~").startswith("model") for o in overrides)
    if touched_model and param_counts(cfg.model)["total"] < 3e6 and cfg.model.n_layers <= 4:
        model = Transformer(cfg.model, Recipe(cfg.recipe.recipe, cfg.recipe.scale_fmt))
        x = torch.randint(0, 256, (1, 8))
        loss = model(x, x).out
        assert math.isfinite(loss.item()), f"{overrides}: a validated config gives loss {loss.item()} at init"
