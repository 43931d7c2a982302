"""`python -m moefp8.train --help` (moefp8.hydra_config.config_help): every key of the schema with a
description read from moefp8/config.py, the groups of configs/ as they are on disk, 100 columns."""

import dataclasses
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import yaml

from moefp8.config import Config
from moefp8.hydra_config import CONFIG_DIR, HELP_WIDTH, config_groups, config_help, schema_docs

ROOT = Path(__file__).resolve().parent.parent


def leaf_keys(schema=Config, prefix=""):
    """The dotted keys of every non-dataclass field under schema, with the field."""
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.type):
            yield from leaf_keys(f.type, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f


def key_entry(lines: list[str], key: str) -> tuple[str, str]:
    """(`key: type = default`, description) of key's entry in the help: the description starts on
    the key's line after two or more spaces, or on the next line, and goes on over indented lines."""
    [i] = [i for i, line in enumerate(lines) if line.startswith(f"  {key}: ")]
    left, _, desc = lines[i].strip().partition("  ")
    more = []
    for line in lines[i + 1:]:
        if not line.startswith(" " * 8):  # the next key, a blank line or a section
            break
        more.append(line.strip())
    return left, " ".join([desc.strip()] + more).strip()


def test_config_help_describes_every_schema_key():
    text = config_help()
    lines = text.splitlines()
    keys = dict(leaf_keys())
    assert len(keys) > 60  # the walk found the sections' fields
    for key, f in keys.items():
        left, desc = key_entry(lines, key)
        assert left.startswith(f"{key}: "), left
        assert " = " in left, left  # type = default
        assert len(desc.split()) >= 2, f"{key}: no description in the help (add a # comment in moefp8/config.py)"
    type_default = {key: key_entry(lines, key)[0] for key in ("model.hidden", "recipe.bf16_linears",
                                                               "train.out_dir", "dispatch.overlap")}
    assert type_default == {"model.hidden": "model.hidden: int = 128",
                            "recipe.bf16_linears": "recipe.bf16_linears: list[str] = []",
                            "train.out_dir": 'train.out_dir: str = "outputs/runs/default"',
                            "dispatch.overlap": "dispatch.overlap: Any = false"}
    listed = [m[1] for m in map(re.compile(r"  (\S+): ").match, lines) if m and m[1] in keys]
    assert listed == list(keys)  # each once, in the schema's order
    for sec in dataclasses.fields(Config):  # each section: a header line with a description
        [header] = [line for line in lines if line.startswith(f"{sec.name}: ")]
        assert len(header.split()) >= 4, header
    assert "--cfg job" in text and "torchrun" in text and " -m " in text
    assert max(len(line) for line in lines) <= HELP_WIDTH


def test_config_help_lists_the_groups_of_configs():
    """One line per folder of configs/: its *.yaml files, config.yaml's default marked."""
    lines = config_help().splitlines()
    root = Path(CONFIG_DIR)
    defaults = {}
    for entry in yaml.safe_load((root / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            defaults.update(entry)
    groups = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in root.iterdir() if d.is_dir()}
    assert {"model", "recipe", "dispatch", "optim", "data", "experiment"} <= set(groups)
    for group, files in groups.items():
        [i] = [i for i, line in enumerate(lines) if line.startswith(f"  {group}: ")]
        text = lines[i].split(":", 1)[1]
        for line in lines[i + 1:]:  # wrapped onto indented lines when long
            if not line.startswith(" " * (len(group) + 4)):
                break
            text += " " + line.strip()
        options = [o.strip() for o in text.split(" | ")]
        marked = [o.split()[0] for o in options if o.endswith("(default)")]
        assert sorted(o.split()[0] for o in options) == files
        assert marked == ([defaults[group]] if defaults.get(group) else []), (group, text)
    assert "  model:      dsv3_layer | moe3b | small | tiny (default) | v2_lite" in lines


def test_config_groups_follow_the_folders(tmp_path):
    """A new option file or group folder shows up; non-YAML files (a README) do not."""
    (tmp_path / "config.yaml").write_text("defaults:\n  - config_schema\n  - b: two\n  - a: null\n  - _self_\n"
                                          "  - override hydra/job_logging: stdout\n")
    for group, names in {"a": ["x.yaml", "README.md"], "b": ["one.yaml", "two.yaml"], "c": ["z.yaml"],
                         "empty": []}.items():
        (tmp_path / group).mkdir()
        for name in names:
            (tmp_path / group / name).write_text("{}\n")
    assert config_groups(str(tmp_path)) == [("b", ["one", "two"], "two"), ("a", ["x"], None), ("c", ["z"], None)]


def test_schema_docs_reads_comments_with_tokenize(tmp_path, monkeypatch):
    """Comments directly above a field and at the end of its line(s); a `#` inside a string or
    docstring is not a comment; a blank line ends a block; the docstring, else the comments above
    the class, describe the section."""
    src = '''
from dataclasses import dataclass, field


# not this one: a blank line follows

# Section of B: the comment block above the decorator.
@dataclass
class B:
    plain: int = 1  # trailing # with a hash
    # above, line 1
    # above, line 2
    both: str = "a # not a comment"  # and trailing
    # separated by a blank line: not above

    none: int = 0
    multi: list = field(
        default_factory=list)  # on its last line


@dataclass
class A:
    """Docstring # of A,
    two lines."""
    b: B = field(default_factory=B)
'''
    path = tmp_path / "schema_mod.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("schema_mod", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "schema_mod", mod)  # inspect finds a class's module there
    spec.loader.exec_module(mod)
    assert schema_docs(mod.B) == ("Section of B: the comment block above the decorator.",
                                  {"plain": "trailing # with a hash", "none": "", "multi": "on its last line",
                                   "both": "above, line 1 above, line 2 and trailing"})
    assert schema_docs(mod.A) == ("Docstring # of A, two lines.", {"b": ""})


def test_cli_help_prints_config_help():
    """`python -m moefp8.train --help` prints config_help() and exits 0 (moefp8/train.py's _main,
    before Hydra, whose own --help describes none of the keys)."""
    r = subprocess.run([sys.executable, "-m", "moefp8.train", "--help"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert config_help() in r.stdout, r.stdout[:1000]
