"""The one settings table: engine settings are dataclass fields carrying their help (and, where
they differ from the field's, their command-line and keyword names) through `setting`; from
the fields the `kvfleet engine` flags (`add_arguments`), `LLM(**kwargs)` (`split_kwargs`) and
the operator's engine arguments (`flags_for`) are derived. Torch-free: the operator uses it."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_KEY = "kvfleet.setting"


def setting(
    help: str,
    *,
    choices: Sequence[str] | None = None,
    kwarg: str | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    render: Callable[[Any], list[str]] | None = None,
    command_line: bool = True,
) -> dict[str, Any]:
    """A field's `metadata=`: its help and choices; `kwarg`: its name in `LLM(**kwargs)` and
    the flag's (default: the field's); `parse`: a flag value into the field's value (applied to
    `LLM` keywords given as text too); `render`: the field's value back into flag values (for
    the operator); `command_line=False`: an `LLM` keyword only."""
    return {
        _KEY: {
            "help": help,
            "choices": tuple(choices) if choices else None,
            "kwarg": kwarg,
            "metavar": metavar,
            "parse": parse,
            "render": render,
            "command_line": command_line,
        }
    }


@dataclass(frozen=True)
class Setting:
    """One engine setting, wherever it is given."""

    name: str  # the field's name
    section: str | None  # the EngineConfig field holding it (cache, scheduler, lora), or None
    kwarg: str  # its name in LLM(**kwargs) and, with dashes, on the command line
    kind: type  # bool, int, float, str, or another type (parsed from text by `parse`)
    default: Any
    help: str
    choices: tuple[str, ...] | None
    metavar: str | None
    parse: Callable[[str], Any] | None
    render: Callable[[Any], list[str]] | None
    command_line: bool

    @property
    def flag(self) -> str:
        """`--block-size`; a switch on by default is turned off by `--no-...` (`--no-prefix-
        caching` for enable_prefix_caching)."""
        if self.kind is bool and self.default is True:
            return "--no-" + self.kwarg.removeprefix("enable_").replace("_", "-")
        return "--" + self.kwarg.replace("_", "-")

    @property
    def dest(self) -> str:
        """The flag's attribute on argparse's namespace (`no_prefix_caching`)."""
        return self.flag.removeprefix("--").replace("-", "_")


def settings_of(config: type, sections: Iterable[str] = ()) -> list[Setting]:
    """The settings of dataclass `config`: its fields marked with `setting`, and those of the
    dataclasses in its `sections` fields."""
    hints = typing.get_type_hints(config)
    found = []
    for item in dataclasses.fields(config):
        if item.name in sections:
            nested = hints[item.name]
            found += [dataclasses.replace(s, section=item.name) for s in settings_of(nested)]
            continue
        meta = item.metadata.get(_KEY)
        if meta is None:
            continue
        kind = _kind(hints[item.name])
        default = item.default if item.default is not dataclasses.MISSING else None
        found.append(
            Setting(
                name=item.name,
                section=None,
                kwarg=meta["kwarg"] or item.name,
                kind=kind,
                default=default,
                help=meta["help"],
                choices=meta["choices"],
                metavar=meta["metavar"],
                parse=meta["parse"],
                render=meta["render"],
                command_line=meta["command_line"],
            )
        )
    return found


def add_arguments(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """One flag per setting, its default the field's (so `--help` shows the real one)."""
    for s in settings:
        if not s.command_line:
            continue
        if s.kind is bool:
            parser.add_argument(s.flag, action="store_true", help=s.help)
            continue
        several = s.kind is tuple  # `--lora-modules a=/x b=/y`, or the flag repeated
        parser.add_argument(
            s.flag,
            # (parsed later, by `split_kwargs`, so a bad value's error names its flag)
            type=str if s.parse is not None else s.kind,
            default=[] if several else s.default,
            nargs="+" if several else None,
            action="extend" if several else "store",
            choices=s.choices,
            metavar=s.metavar,
            help=s.help if s.default in (None, ()) else f"{s.help} (default {s.default})",
        )


def from_namespace(settings: Iterable[Setting], args: argparse.Namespace) -> dict[str, Any]:
    """The settings given by parsed flags (`add_arguments`), by keyword name (text where the
    setting parses its flag's text: `split_kwargs` does)."""
    given = {}
    for s in settings:
        if s.command_line:
            value = getattr(args, s.dest)
            given[s.kwarg] = (not value) if s.kind is bool and s.default is True else value
    return given


def split_kwargs(
    settings: Iterable[Setting], kwargs: Mapping[str, Any], flag_names: bool = False
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Flat keywords (`LLM(block_size=32, ...)`, or parsed flags) as the top-level fields and
    each section's fields; TypeError naming an unknown keyword. Text given where a setting
    takes another type is parsed as its flag would be; a ValueError then names the keyword
    (or, with `flag_names`, the flag)."""
    by_kwarg = {s.kwarg: s for s in settings}
    unknown = sorted(set(kwargs) - set(by_kwarg))
    if unknown:
        raise TypeError(f"unknown engine settings {unknown}; known: {sorted(by_kwarg)}")
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for kwarg, given in kwargs.items():
        s = by_kwarg[kwarg]
        value = given
        if s.parse is not None and _is_text(given):
            try:
                value = s.parse(given)
            except ValueError as exc:
                name = s.flag if flag_names else s.kwarg
                raise ValueError(str(exc) if name in str(exc) else f"{name}: {exc}") from exc
        (sections.setdefault(s.section, {}) if s.section else top)[s.name] = value
    return top, sections


def flags_for(settings: Iterable[Setting], values: Mapping[str, Any]) -> list[str]:
    """Command-line arguments giving `values` (by keyword name; a value may be its flag's
    text): switches where they differ from the default, `--flag=value` for the rest (None
    and empty: left out)."""
    by_kwarg = {s.kwarg: s for s in settings}
    args: list[str] = []
    for kwarg, value in values.items():
        s = by_kwarg[kwarg]
        if s.kind is bool:
            if value != s.default:
                args.append(s.flag)
        elif s.parse is not None and _is_text(value):  # (a flag's own text)
            args += [f"{s.flag}={item}" for item in ([value] if isinstance(value, str) else value)]
        elif value is not None and not (isinstance(value, list | tuple) and not value):
            rendered = s.render(value) if s.render is not None else [str(value)]
            args += [f"{s.flag}={item}" for item in rendered]
    return args


def _is_text(value: Any) -> bool:
    """A flag's text: a string, or the strings of a flag taking several."""
    if isinstance(value, list | tuple):
        return bool(value) and all(isinstance(item, str) for item in value)
    return isinstance(value, str)


def _kind(hint: Any) -> type:
    """The type of a field annotation such as `int | None` (int)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        return _kind(members[0])
    origin = typing.get_origin(hint)
    return origin or hint  # type: ignore[no-any-return]
