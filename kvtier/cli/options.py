"""Options declared once, as fields of a dataclass: each field makes its command-line flag, and its
value may also come from a YAML config file (`--config FILE.yaml`) or a `KVTIER_<NAME>` environment
variable.

Precedence, highest first: the flag, the environment variable, the config file, the field's
default. A config file is a flat mapping of option names (`max_num_seqs: 8` or `max-num-seqs: 8`),
as vLLM's `--config`; values are checked as the flag's are, and a bad one is one line and exit 2.

    @dataclass(frozen=True)
    class EngineOptions:
        max_num_seqs: int = option(64, "engine", "most requests in the running batch", type=positive_int)

    add_options(parser, EngineOptions)    # --max-num-seqs N, --config FILE
    apply_sources(args)                   # env and file values where no flag was given
    EngineOptions.from_args(args)         # or read args.max_num_seqs as before

A flag may take other spellings (`option(..., aliases=("--max-num-batched-tokens",))`, vLLM's), and
an on/off option flags that set it back off (`off=("--enable-prefix-caching",)`); --help lists them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_PREFIX = "KVTIER_"
_GIVEN = "_given_options"  # namespace attribute: the dests set by a flag on this command line
_FIELDS = "_option_fields"  # parser default: {dest: Option} of the options this command takes
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A bad config file or environment variable: printed as one line, exit 2."""


@dataclass(frozen=True)
class Option:
    """How one dataclass field appears as a flag (the field's metadata["option"])."""

    group: str  # the --help section
    help: str
    type: Callable[[str], Any] | None = None  # str -> value, raising ValueError/ArgumentTypeError when bad
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    default_text: str | None = None  # what --help says the default is (None: the default itself)
    secret: bool = False  # never shown (its default or value) in --help or errors
    env: bool = True  # False: no KVTIER_<NAME> (the option reads its variable itself, after other sources)
    # Other spellings of the flag, e.g. vLLM's or llama-server's ("--max-num-batched-tokens", "-c"), so
    # a command line written for them runs unchanged where the meaning is the same.
    aliases: tuple[str, ...] = ()
    # An on/off option only: flags that set it back off (vLLM's --enable-prefix-caching against
    # --no-prefix-cache); as a flag, they win over the environment and the config file.
    off: tuple[str, ...] = ()


def option(default: Any, group: str, help: str, **kw: Any) -> Any:
    """A dataclass field that is also a command-line option (see the module docstring).
    `default` may be a zero-argument callable (evaluated per parser, e.g. a path under the home)."""
    meta = {"option": Option(group, help, **kw)}
    if callable(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def fields_of(cls: type) -> dict[str, tuple[dataclasses.Field, Option]]:
    return {f.name: (f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata}


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _is_flag(f: dataclasses.Field) -> bool:
    return f.type in (bool, "bool")


class _Record:
    """Mixed into argparse's store actions: note that the flag was given (so env and file yield)."""

    dest: str

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        super().__call__(parser, namespace, values, option_string)  # type: ignore[misc]
        given = set(getattr(namespace, _GIVEN, ()))
        given.add(self.dest)
        setattr(namespace, _GIVEN, given)


class _StoreAction(_Record, argparse._StoreAction):
    pass


class _StoreTrueAction(_Record, argparse._StoreTrueAction):
    pass


class _StoreFalseAction(_Record, argparse._StoreFalseAction):
    pass


def add_options(parser: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None,
                titles: Mapping[str, str] | None = None) -> None:
    """Add a flag per option field of `cls` (or the ones named in `only`) to `parser`, grouped
    under `titles[group]`, plus `--config FILE` once per parser."""
    groups: dict[str, argparse._ActionsContainer] = {}
    registered = dict(parser.get_default(_FIELDS) or {})
    for name, (f, opt) in fields_of(cls).items():
        if only is not None and name not in only:
            continue
        title = (titles or {}).get(opt.group, opt.group)
        g = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        default = _default(f)
        shown = opt.default_text if opt.default_text is not None else default
        help_text = (opt.help if opt.secret or _is_flag(f) else f"{opt.help} (default: {shown})").replace("%", "%%")
        flag = "--" + name.replace("_", "-")
        if _is_flag(f):
            g.add_argument(flag, *opt.aliases, action=_StoreTrueAction, dest=name, default=default, help=help_text)
            if opt.off:
                g.add_argument(*opt.off, action=_StoreFalseAction, dest=name, default=default,
                               help=f"undo {flag} (the default), e.g. one set by ${ENV_PREFIX}{name.upper()} "
                                    "or --config")
        else:
            if opt.off:
                raise TypeError(f"{name}: only an on/off option takes `off` flags")
            g.add_argument(flag, *opt.aliases, action=_StoreAction, dest=name, default=default,
                           type=opt.type or str, choices=opt.choices, metavar=opt.metavar, help=help_text)
        registered[name] = (f, opt)
    parser.set_defaults(**{_FIELDS: registered})
    if "--config" not in parser._option_string_actions:
        parser.add_argument("--config", metavar="FILE.yaml", type=Path, default=None,
                            help=f"read options from a YAML file (keys: the options' names, e.g. max_num_seqs: 8); "
                                 f"flags win over ${ENV_PREFIX}<OPTION> environment variables, which win over the "
                                 "file")


def load_config_file(path: Path) -> dict[str, Any]:
    """The file's options as {name: value} (dashes in names read as underscores)."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path}: expected a mapping of option names to values, got {type(doc).__name__}")
    return {str(k).replace("-", "_"): v for k, v in doc.items()}


def coerce(f: dataclasses.Field, opt: Option, value: Any, where: str) -> Any:
    """A value from a file or the environment, checked as its flag would be."""
    shown = "(hidden)" if opt.secret else repr(value)
    if _is_flag(f):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {shown}")
    if value is None:
        if _default(f) is None:
            return None
        raise ConfigError(f"{where}: a value is required")
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{where}: expected a single value, got a {type(value).__name__}")
    text = str(value)
    try:
        out = opt.type(text) if opt.type is not None else text
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise ConfigError(f"{where}: {e if not opt.secret else 'invalid value'}") from None
    if opt.choices is not None and out not in opt.choices:
        raise ConfigError(f"{where}: {shown} is not one of {', '.join(opt.choices)}")
    return out


def apply_sources(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                  known: tuple[type, ...] = ()) -> None:
    """Fill each option of this command that no flag set from $KVTIER_<NAME>, else the --config
    file. `known`: every options class of the program, so a file shared by several commands may
    hold another command's options (they are skipped here); a name none of them has is an error."""
    options: dict[str, tuple[dataclasses.Field, Option]] = getattr(args, _FIELDS, None) or {}
    environ = os.environ if environ is None else environ
    path: Path | None = getattr(args, "config", None)
    file = load_config_file(path) if path is not None else {}
    everything = set(options).union(*(fields_of(c) for c in known))
    unknown = sorted(set(file) - everything)
    if unknown:
        raise ConfigError(f"config file {path}: unknown option(s) {', '.join(unknown)} (see --help for the names)")
    given: set[str] = getattr(args, _GIVEN, set())
    for name, (f, opt) in options.items():
        if name in given:
            continue
        env = ENV_PREFIX + name.upper()
        if opt.env and env in environ:
            setattr(args, name, coerce(f, opt, environ[env], f"${env}"))
        elif name in file:
            setattr(args, name, coerce(f, opt, file[name], f"config file {path}: {name}"))


def from_args(cls: type, args: argparse.Namespace, **override: Any) -> Any:
    """An instance of the options class `cls` from parsed (and `apply_sources`-filled) args; fields
    this command did not take keep their defaults."""
    values = {name: getattr(args, name) for name in fields_of(cls) if hasattr(args, name)}
    return cls(**{**values, **override})
