"""Load policy and layout files into models, reporting every problem with its line and column.

``check_text`` never raises on bad input: it returns the document (or None) and every diagnostic.
``load_policy`` / ``load_layout`` raise :class:`DocumentError` carrying all of them.
"""

from __future__ import annotations

import difflib
import itertools
import os
import stat
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from importlib import resources
from pathlib import Path as FilePath
from types import MappingProxyType
from typing import Any, Literal, Union

from pydantic import BaseModel, ValidationError

from kvpolicy.evidence.discovery import DiscoveryReport
from kvpolicy.evidence.routers import KEYED_KEYS_UNREADABLE, keyed_keys_fix, template_router_problems
from kvpolicy.language import catalog
from kvpolicy.language.diagnostics import CHECKS_BY_NAME, Diagnostic, DocumentError, printable_path
from kvpolicy.language.expressions import Expression, ExpressionError
from kvpolicy.language.models import (
    SPEC_VARIABLES,
    AuditMode,
    FieldExpression,
    Keyed,
    Layout,
    Policy,
    expression_variables,
    field_expressions,
)
from kvpolicy.language.yamlsource import MAX_DOCUMENT_BYTES, Path, SourceMap, parse

_NOTHING_DECLARED: Mapping[str, str] = MappingProxyType({})
"""No spec class declared besides vLLM's (a policy checked on its own)."""

Document = Policy | Layout | DiscoveryReport
"""One top-level document, as a file holds it: a replication policy, a model layout, or a discovery
report (``kvpolicy discover``, the connector's ``kvpolicy_discover``)."""
KINDS: dict[str, type[Policy] | type[Layout] | type[DiscoveryReport]] = {
    "ReplicationPolicy": Policy,
    "ModelLayout": Layout,
    "DiscoveryReport": DiscoveryReport,
}


# --- finding files -----------------------------------------------------------------------------


def _bundled_dir(name: str) -> FilePath:
    """A data directory shipped inside the wheel, or the repository's own when running from a checkout.

    The wheel carries ``policies/``, ``schemas/`` and ``examples/layouts/`` inside the package
    (``kvpolicy/examples_layouts``); an editable install or a checkout reads them in place.
    """
    packaged = FilePath(str(resources.files("kvpolicy"))) / name
    if packaged.is_dir():
        return packaged
    return FilePath(__file__).resolve().parents[2] / name.replace("_", "/")


def policies_dir() -> FilePath:
    return _bundled_dir("policies")


def layouts_dir() -> FilePath:
    return _bundled_dir("examples_layouts")


def schemas_dir() -> FilePath:
    return _bundled_dir("schemas")


def shipped_policy_names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in policies_dir().glob("*.yaml")))


def shipped_layout_names() -> tuple[str, ...]:
    """The example layouts shipped with kvpolicy, by the name ``--layout`` takes (``llama-3.1-70b``)."""
    return tuple(sorted(path.stem for path in layouts_dir().glob("*.yaml")))


EMPTY_PATH = "<empty path>"
"""What a diagnostic names as its file when the path given was empty (an empty location prefix,
``:1:1:``, would read as a formatting slip)."""


def _empty_path(give: str) -> DocumentError:
    return DocumentError([Diagnostic(EMPTY_PATH, 1, 1, "error", f"the path is empty; give {give}", "KVP001")])


def resolve_policy_path(name_or_path: str) -> FilePath:
    """A shipped policy's name (``default``) or a path to a policy file."""
    return _resolve(name_or_path, "policy", policies_dir(), shipped_policy_names())


def resolve_layout_path(name_or_path: str) -> FilePath:
    """A shipped example layout's name (``llama-3.1-70b``) or a path to a layout file."""
    return _resolve(name_or_path, "layout", layouts_dir(), shipped_layout_names(), shipped_as="shipped example layout")


def _resolve(
    name_or_path: str, what: str, directory: FilePath, names: tuple[str, ...], *, shipped_as: str | None = None
) -> FilePath:
    """``name_or_path`` as a file path (it names a YAML file, an existing file or a path with a folder
    in it), else the shipped document of that name in ``directory``; :class:`DocumentError` naming
    what was typed, the nearest shipped name and every shipped one when it is neither."""
    shipped_as = shipped_as or f"shipped {what}"
    if not name_or_path:
        raise _empty_path(f"a {shipped_as} name ({', '.join(names)}) or a {what} file")
    path = FilePath(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists() or "/" in name_or_path:
        return path
    shipped = directory / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise DocumentError(
        [
            Diagnostic(
                name_or_path, 1, 1, "error",
                f"no {what} file or {shipped_as} named '{name_or_path}'{hint} (shipped: {', '.join(names)})",
                "KVP001",
            )
        ]
    )


# --- loading -----------------------------------------------------------------------------------


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words (``a FIFO``), from its ``st_mode``."""
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


class FileRefused(Exception):
    """A file :func:`read_regular_file` did not read, or not whole: ``reason`` says why, in words that
    complete "cannot read file: ..." (``it is a FIFO``, ``No such file or directory``); ``kind`` says
    which refusal it is, so that each reader can add its own fix."""

    def __init__(self, kind: Literal["empty", "special", "os", "nul", "large"], reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them, whatever ``path`` names.

    Its type is checked before it is opened: a FIFO, a device, a directory or a socket is never
    opened, so it never blocks (a FIFO without a writer) or streams (``/dev/zero``). It is opened with
    ``O_NONBLOCK`` and checked again, should it have turned into a FIFO in between, and one byte past
    ``limit`` is read only to tell a larger file. Raises :class:`FileRefused`: ``empty`` (the path is
    the empty string), ``special`` (not a regular file), ``os`` (the OS's reason), ``nul`` (a NUL in
    the path, which the OS cannot even be asked about), ``large`` (more than ``limit`` bytes)."""
    if not os.fspath(path):
        raise FileRefused("empty", "the path is empty")
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise FileRefused("special", f"it is {file_kind(mode)}")
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        with os.fdopen(descriptor, "rb") as stream:
            opened = os.fstat(stream.fileno()).st_mode
            if not stat.S_ISREG(opened):
                raise FileRefused("special", f"it is {file_kind(opened)}")
            data = stream.read(limit + 1)
    except OSError as error:
        raise FileRefused("os", error.strerror or str(error)) from None
    except ValueError:
        raise FileRefused("nul", "the path contains a NUL character") from None
    if len(data) > limit:
        raise FileRefused("large", f"it is larger than {limit} bytes")
    return data


class _Unreadable(Exception):
    """A file that is not read at all, with a diagnostic saying why."""

    def __init__(self, diagnostic: Diagnostic) -> None:
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


def _read_bounded(path: str | FilePath) -> str:
    """The text of a policy, layout or discovery report file, read within bounds whatever ``path`` is
    (:func:`read_regular_file`: only a regular file, at most
    :data:`~kvpolicy.language.yamlsource.MAX_DOCUMENT_BYTES`), UTF-8. Raises :class:`_Unreadable`."""
    name = str(path)

    def unreadable(message: str, line: int = 1, column: int = 1) -> _Unreadable:
        return _Unreadable(Diagnostic(name, line, column, "error", message, "KVP001"))

    try:
        data = read_regular_file(path, MAX_DOCUMENT_BYTES)
    except FileRefused as refused:
        if refused.kind == "empty":
            raise _Unreadable(Diagnostic(
                EMPTY_PATH, 1, 1, "error", "the path is empty; give a policy, layout or discovery report file", "KVP001"
            )) from None
        if refused.kind == "special":
            raise unreadable(f"cannot read file: {refused.reason}; give a YAML file") from None
        if refused.kind == "nul":
            raise unreadable("cannot read file: the path contains a NUL character; give a file name without one") from None
        if refused.kind == "large":
            raise unreadable(
                f"file is larger than {MAX_DOCUMENT_BYTES} bytes; a policy, layout or discovery report is a few KiB"
            ) from None
        raise unreadable(f"cannot read file: {refused.reason}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        before = data[: error.start].decode("utf-8", errors="replace")
        line = before.count("\n") + 1
        column = len(before) - (before.rfind("\n") + 1) + 1
        raise unreadable(f"file is not UTF-8 text (byte 0x{data[error.start]:02x}); save it as UTF-8", line, column) from None


def read_text(path: str | FilePath) -> str:
    """A document file's text, read within the same bounds as :func:`check_file`; :class:`DocumentError`
    saying why it cannot be read."""
    try:
        return _read_bounded(path)
    except _Unreadable as error:
        raise DocumentError([error.diagnostic]) from None


def check_file(
    path: str | FilePath, *, declared_classes: Mapping[str, str] = _NOTHING_DECLARED
) -> tuple[Document | None, list[Diagnostic]]:
    """:func:`check_text` of a file, read within bounds (:func:`_read_bounded`)."""
    try:
        text = _read_bounded(path)
    except _Unreadable as error:
        return None, [error.diagnostic]
    return check_text(text, str(path), declared_classes=declared_classes)


MAX_DIAGNOSTICS_PER_FILE = 100
"""Problems reported per file; the rest are counted in one last diagnostic."""


def check_text(
    text: str, path: str = "<string>", *, declared_classes: Mapping[str, str] = _NOTHING_DECLARED
) -> tuple[Document | None, list[Diagnostic]]:
    """Parse and validate one document; never raises on bad input. At most
    :data:`MAX_DIAGNOSTICS_PER_FILE` problems are listed, then how many more there are."""
    document, problems, undescribed = _check_text(text, path, declared_classes)
    shown = problems[:MAX_DIAGNOSTICS_PER_FILE]
    hidden = len(problems) - len(shown) + undescribed
    if hidden:
        line, column = (shown[-1].line, shown[-1].column) if shown else (1, 1)
        problems = [
            *shown,
            Diagnostic(path, line, column, "error" if document is None else "warning",
                       f"{hidden} more problems in this file not shown; fix these first", "KVP901"),
        ]
    return document, problems


def _check_text(text: str, path: str, declared_classes: Mapping[str, str]) -> tuple[Document | None, list[Diagnostic], int]:
    """(document or None, problems, how many more problems were found but not described)."""
    data, source, problems = parse(text, path)
    if data is None and problems:
        return None, problems, 0
    if not isinstance(data, dict):
        return None, [*problems, source.diagnostic((), "expected a mapping with 'version' and 'kind' at the top level", code="KVP101")], 0
    model = _model_for(data, source, problems)
    if model is None:
        return None, problems, 0
    if not (isinstance(data.get("kind"), str) and data["kind"] in KINDS):
        # Kind missing or wrong, already reported: check the rest as the kind its content says,
        # so every other problem is reported in this run too.
        data = {**data, "kind": next(kind for kind, known in KINDS.items() if known is model)}
    try:
        document = model.model_validate(data)
    except ValidationError as error:
        described, undescribed = _validation_diagnostics(error, model, source, MAX_DIAGNOSTICS_PER_FILE + 1 - len(problems))
        problems.extend(described)
        # Expression names in a document that failed elsewhere (the model checks them only once the
        # rest validates); the same problem found both ways is reported once.
        problems.extend(itertools.islice(_warnings_for_raw(data, model, source), MAX_DIAGNOSTICS_PER_FILE + 1))
        return None, sorted(set(problems)), undescribed
    document_problems = list(_semantic_checks(document, source, declared_classes))
    problems.extend(document_problems)
    problems.sort()
    if any(problem.severity == "error" for problem in problems):
        return None, problems, 0
    if isinstance(document, Policy):
        document = document.with_origins(
            tuple(f"{path}:{source.locate(('rules', index)).line}" for index in range(len(document.rules))),
            tuple(_expression_origins(path, source, index, rule) for index, rule in enumerate(document.rules)),
            _origin(path, source, ("strict",)),
        )
    elif isinstance(document, Layout):
        origins = _spec_origins(path, source, document)
        if origins:
            document = document.with_spec_origins(origins)
    return document, problems, 0


def _origin(path: str, source: SourceMap, location: Path) -> str | None:
    """``file:line:col`` where the value at ``location`` starts (inside its quotes), or None."""
    position = source.value_position(location)
    if position is None:
        return None
    return f"{path}:{position.line}:{position.column + (1 if position.quoted else 0)}"


def _spec_origins(path: str, source: SourceMap, layout: Layout) -> dict[tuple[int, int, tuple[str, ...]], str]:
    """Where each expression of the layout's specs that reads the topology stands, by (group, member,
    attribute as :class:`~kvpolicy.language.models.SpecExpressionError` names it): only those can fail at plan
    time (the others were evaluated here)."""
    origins: dict[tuple[int, int, tuple[str, ...]], str] = {}
    for group_index, group in enumerate(layout.groups):
        for member_index, member in enumerate(group.members):
            base: Path = ("groups", group_index, "spec") if group.uniform is None else (
                "groups", group_index, "uniform", member_index, "spec"
            )
            spec = member.spec
            places: list[tuple[str, ...]] = [
                (name,) for name in ("block_size", "page_size_bytes") if getattr(spec, name).names
            ]
            for name, value in spec.fields.items():
                if isinstance(value, FieldExpression) and value.expr.names:
                    places.append(("fields", name, "expr"))
                elif isinstance(value, tuple) and any(expression.names for expression in field_expressions(value)):
                    places.append(("fields", name))
            for attribute in places:
                origin = _origin(path, source, (*base, *attribute))
                if origin is not None:
                    origins[(group_index, member_index, attribute)] = origin
    return origins


def _expression_origins(path: str, source: SourceMap, index: int, rule: Any) -> dict[str, str]:
    """``file:line:col`` where each expression of rule ``index`` starts (inside its quotes)."""
    origins = {}
    for field in ("when", "factor", "shards"):
        position = source.value_position(("rules", index, field)) if getattr(rule, field) is not None else None
        if position is not None:
            origins[field] = f"{path}:{position.line}:{position.column + (1 if position.quoted else 0)}"
    return origins


def load(path: str | FilePath) -> Document:
    document, problems = check_file(path)
    if document is None:
        raise DocumentError(problems)
    return document


def load_policy(name_or_path: str | FilePath) -> Policy:
    """Load a policy by shipped name or path; raise :class:`DocumentError` with every problem."""
    path = resolve_policy_path(str(name_or_path))
    document = load(path)
    if not isinstance(document, Policy):
        raise DocumentError(
            [Diagnostic(str(path), 1, 1, "error", f"expected a ReplicationPolicy, found a {document.kind}", "KVP101")]
        )
    return document


def load_layout(name_or_path: str | FilePath) -> Layout:
    path = resolve_layout_path(str(name_or_path))
    document = load(path)
    if not isinstance(document, Layout):
        raise DocumentError(
            [Diagnostic(str(path), 1, 1, "error", f"expected a ModelLayout, found a {document.kind}", "KVP101")]
        )
    return document


def _model_for(
    data: dict[str, Any], source: SourceMap, problems: list[Diagnostic]
) -> type[Policy] | type[Layout] | type[DiscoveryReport] | None:
    """The model ``data`` is checked as: its ``kind``'s, else (with a diagnostic about the kind) the
    one its content looks like (``rules``: a policy; ``groups``: a layout), else None."""
    kind = data.get("kind")
    if isinstance(kind, str) and kind in KINDS:  # a list or mapping is not even hashable
        return KINDS[kind]
    guessed = Policy if "rules" in data else Layout if "groups" in data else None
    if kind is None:
        expected = f"kind: {'ReplicationPolicy' if guessed is Policy else 'ModelLayout'}" if guessed else "kind"
        problems.append(source.diagnostic((), f"missing 'kind'; add '{expected}'", code="KVP101"))
    else:
        close = difflib.get_close_matches(str(kind), KINDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; expected one of {', '.join(KINDS)}"
        problems.append(source.diagnostic(("kind",), f"unknown kind '{kind}'{hint}", code="KVP101"))
    return guessed


# --- turning pydantic errors into located diagnostics -------------------------------------------


_DESCRIBED_PER_LISTED = 20
"""Pydantic errors described at most per problem listed (most of them are repeated by aliases)."""


def _validation_diagnostics(
    error: ValidationError, model: type[BaseModel], source: SourceMap, limit: int
) -> tuple[list[Diagnostic], int]:
    """The first ``limit`` distinct problems pydantic found, located, and how many of its errors were
    left undescribed: a file of a hundred thousand errors costs no more than a hundred lines (each
    costs a did-you-mean, a walk of the source)."""
    seen: set[tuple[Path, str]] = set()
    located: set[Diagnostic] = set()  # aliases repeat a problem at one place: it counts once
    items = error.errors(include_url=False, include_input=False)
    locations = [tuple(part for part in item["loc"] if _is_data_key(part)) for item in items]
    # Where some error stands below: a too_short there only counts the items that failed inside.
    above = {location[:end] for location in locations for end in range(len(location))}
    found: list[Diagnostic] = []
    for position, (item, location) in enumerate(zip(items, locations, strict=True)):
        # Errors that aliases repeat at one place are described to find that out: a bounded number.
        if len(found) >= limit or position >= _DESCRIBED_PER_LISTED * limit:
            return found, len(items) - position
        if item["type"] == "too_short" and location in above:
            continue  # pydantic counts only the items that validated; the real error is reported inside
        message, prefer_key, offset, code = _describe(item, location, model)
        if (location, message) in seen:
            continue
        seen.add((location, message))
        diagnostic = source.diagnostic(location, message, code=code, prefer_key=prefer_key, offset=offset)
        if diagnostic not in located:
            located.add(diagnostic)
            found.append(diagnostic)
    return found, 0


def _is_data_key(part: Any) -> bool:
    # Union branches and validators add loc entries such as 'int' or 'function-after[...]'.
    return isinstance(part, int) or (isinstance(part, str) and "[" not in part and part not in _TYPE_TAGS)


_TYPE_TAGS = {"int", "str", "bool", "none", "list", "tuple", "dict", "float", "constrained-str", "is-instance"}


_YAML_WORDS = {
    "tuple_type": "expected a list",
    "dict_type": "expected a mapping",
    "int_type": "expected a whole number (not quoted)",
    "bool_type": "expected true or false (not quoted)",
    "string_type": "expected a string",
}
"""Pydantic's wording for a wrong type, in the words of a YAML file (it quotes Python types)."""


def _describe(item: Mapping[str, Any], location: Path, model: type[BaseModel]) -> tuple[str, bool, int | None, str]:
    """(message, locate at the key rather than the value, column offset in the value, check code)."""
    kind = item["type"]
    name = str(location[-1]) if location else "document"
    if kind == "extra_forbidden":
        known = _fields_at(model, location[:-1])
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else (f"; allowed: {', '.join(known)}" if known else "")
        return f"unknown field '{name}'{hint}", True, None, "KVP102"
    if kind == "missing":
        return f"missing required field '{name}'", False, None, "KVP103"
    message = item["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    # YAML has lists, not tuples: say what to write.
    message = _YAML_WORDS.get(kind, message)
    offset = None
    context = item.get("ctx", {})
    cause = context.get("error")
    if isinstance(cause, BaseException) and isinstance(cause.__cause__, ExpressionError):
        offset = cause.__cause__.column
    elif isinstance(context.get("column"), int):  # a model validator's located expression error
        offset = context["column"]
    code = "KVP104"
    if offset is not None or isinstance(cause, ExpressionError) or (
        isinstance(cause, BaseException) and isinstance(cause.__cause__, ExpressionError)
    ):
        code = "KVP105"
    named = CHECKS_BY_NAME.get(kind)  # a model validator's PydanticCustomError names its check
    if named is not None:
        code = named.code
    if kind == "literal_error" and name in ("version", "kind"):
        message = f"{name}: {message}"
    elif location and isinstance(location[-1], str):
        message = f"{name}: {message[0].lower()}{message[1:]}" if message else name
    return message, False, offset, code


def _fields_at(model: type[BaseModel], location: Path) -> list[str]:
    """Field names of the model found at ``location`` (for did-you-mean on unknown fields)."""
    current: list[type[BaseModel]] = [model]
    for part in location:
        if isinstance(part, int):
            continue
        following: list[type[BaseModel]] = []
        for cls in current:
            field = cls.model_fields.get(part)
            if field is not None:
                following.extend(_models_in(field.annotation))
        if not following:
            # a dict value (e.g. fields: {...}) keeps no model below it
            return []
        current = following
    return sorted({name for cls in current for name in cls.model_fields})


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, tuple, list, typing.Annotated) or origin is not None:
        args = typing.get_args(annotation)
        if isinstance(origin, type) and issubclass(origin, Mapping):  # dict, FrozenMapping: skip the key type
            args = args[1:]
        return [model for arg in args for model in _models_in(arg)]
    return []


def _warnings_for_raw(data: dict[str, Any], model: type[BaseModel], source: SourceMap) -> Iterator[Diagnostic]:
    """Expression name checks that still make sense when the document as a whole failed validation."""
    if model is not Policy or not isinstance(data.get("rules"), list):
        return
    spec_fields = data.get("spec_fields")
    extra = spec_fields if isinstance(spec_fields, list) else []
    known = expression_variables(str(name) for name in extra)
    for index, rule in enumerate(data["rules"]):
        if not isinstance(rule, dict):
            continue
        for key in ("when", "factor", "shards"):
            text = rule.get(key)
            if not isinstance(text, (str, int)) or isinstance(text, bool):
                continue
            try:
                expression = Expression(str(text))
            except ValueError:  # ExpressionError, or str() of a huge integer
                continue  # already reported by validation
            try:
                expression.check_names(known)
            except ExpressionError as error:
                yield source.diagnostic(("rules", index, key), f"{key}: {error.message}", code="KVP105", offset=error.column)


# --- checks that need the whole document ---------------------------------------------------------


def _semantic_checks(document: Document, source: SourceMap, declared_classes: Mapping[str, str]) -> Iterator[Diagnostic]:
    if isinstance(document, Policy):
        yield from _policy_checks(document, source, declared_classes)
    elif isinstance(document, Layout):
        yield from _layout_checks(document, source)


def declared_spec_classes(layouts: Iterable[tuple[str, Layout]]) -> dict[str, str]:
    """Spec class name → the first of ``layouts`` (path, layout) that declares it (as a spec's class or
    one of its bases): what a policy checked beside them may name besides vLLM's own classes."""
    declared: dict[str, str] = {}
    for path, layout in layouts:
        for group in layout.groups:
            for member in group.members:
                for name in (member.spec.type, *member.spec.bases):
                    declared.setdefault(name, path)
    return declared


def _policy_checks(policy: Policy, source: SourceMap, declared_classes: Mapping[str, str]) -> Iterator[Diagnostic]:
    shadows = _ShadowIndex()
    field_names = catalog.SPEC_FIELDS | frozenset(SPEC_VARIABLES) | frozenset(policy.spec_fields)
    for index, rule in enumerate(policy.rules):
        for class_name in rule.match.spec or ():
            if class_name not in catalog.SPEC_CLASSES and class_name not in declared_classes:
                close = difflib.get_close_matches(class_name, [*declared_classes, *catalog.SPEC_CLASSES], n=1)
                whose = f" (declared by {printable_path(declared_classes[close[0]])})" if close and close[0] in declared_classes else ""
                hint = f"; did you mean '{close[0]}'{whose}?" if close else " (fine for a plugin's spec class)"
                yield source.diagnostic(
                    ("rules", index, "match", "spec"),
                    f"'{class_name}' is not a spec class of vLLM 0.32{hint}",
                    code="KVP201",
                    severity="warning",
                )
        for field_name in rule.match.fields:
            if field_name not in field_names:
                close = difflib.get_close_matches(field_name, field_names, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else "; declare it in 'spec_fields' if a plugin adds it"
                yield source.diagnostic(
                    ("rules", index, "match", "fields", field_name),
                    f"'{field_name}' is not a field of any known spec class{hint}",
                    code="KVP202",
                    severity="warning",
                    prefer_key=True,
                )
        shadow = shadows.shadowing(rule)
        shadows.add(index, rule)
        if shadow is not None:
            yield source.diagnostic(
                ("rules", index),
                f"rule '{rule.name}' is unreachable: rule '{policy.rules[shadow].name}' "
                f"(line {source.locate(('rules', shadow)).line}) matches everything it matches; "
                "move it up or remove it",
                code="KVP203",
                severity="warning",
            )
    yield from _router_checks(policy, source)



def _router_checks(policy: Policy, source: SourceMap) -> Iterator[Diagnostic]:
    """``KVP205``: a key template whose keys the routers that read vLLM store keys would not read as
    the key contract states them (:func:`kvpolicy.evidence.routers.template_router_problems`), at the
    template, at the field at fault where one is. A policy without a template keeps vLLM's keys,
    which routers were written for."""
    if policy.key.keyed is Keyed.REQUIRED:
        yield source.diagnostic(
            ("key", "keyed"),
            f"the policy requires keyed namespaces: {KEYED_KEYS_UNREADABLE}; {keyed_keys_fix(policy_requires=True)}",
            code="KVP206",
            severity="warning",
        )
    location: Path = ("key", "template")
    if source.value_position(location) is None:
        return
    template = policy.key.template
    for problem in template_router_problems(template, audited=policy.audit.mode is not AuditMode.OFF):
        at = template.find("{" + problem.field + "}") if problem.field else -1
        yield source.diagnostic(
            location,
            f"key template: {problem.message}",
            code="KVP205",
            severity="warning",
            offset=at if at >= 0 else None,
        )


class _ShadowIndex:
    """The earlier rules that could make a later one unreachable, indexed so that checking every rule
    is linear in the policy's size: only rules without ``when`` or ``layers`` shadow, and a rule
    shadows a later one when its field conditions are a subset of the later one's and its spec
    classes cover every class the later one lists."""

    MAX_FIELD_SUBSETS = 64
    """A later rule is checked against earlier rules whose conditions are a subset of its own; with
    more than 6 field conditions only the empty and the full set are tried (a bounded, sound miss)."""

    def __init__(self) -> None:
        # key: the earlier rule's field conditions; value: (first rule with any spec, class -> rules listing it or a base)
        self._any_spec: dict[frozenset[tuple[str, Any]], int] = {}
        self._by_class: dict[frozenset[tuple[str, Any]], dict[str, list[int]]] = {}

    @staticmethod
    def _conditions(rule: Any) -> frozenset[tuple[str, Any]] | None:
        try:
            return frozenset(rule.match.fields.items())
        except TypeError:  # an unhashable condition value: such a rule is never indexed
            return None

    def shadowing(self, rule: Any) -> int | None:
        """The first earlier rule that matches everything ``rule`` matches, or None."""
        conditions = self._conditions(rule)
        if conditions is None:
            return None
        items = sorted(conditions, key=repr)
        subsets: list[frozenset[tuple[str, Any]]]
        if 2 ** len(items) <= self.MAX_FIELD_SUBSETS:
            subsets = [frozenset(combo) for size in range(len(items) + 1) for combo in itertools.combinations(items, size)]
        else:
            subsets = [frozenset(), conditions]
        found: list[int] = []
        for subset in subsets:
            if subset in self._any_spec:
                found.append(self._any_spec[subset])
            by_class = self._by_class.get(subset)
            if by_class is None or rule.match.spec is None:
                continue
            # An earlier rule covering every listed class: one in each class's candidate list.
            candidates: set[int] | None = None
            for name in rule.match.spec:
                covering = set(by_class.get(name, ()))
                candidates = covering if candidates is None else candidates & covering
                if not candidates:
                    break
            if candidates:
                found.append(min(candidates))
        return min(found) if found else None

    def add(self, index: int, rule: Any) -> None:
        if rule.when is not None or rule.match.layers is not None:
            return
        conditions = self._conditions(rule)
        if conditions is None:
            return
        if rule.match.spec is None:
            self._any_spec.setdefault(conditions, index)
            return
        by_class = self._by_class.setdefault(conditions, {})
        for ancestor in rule.match.spec:
            by_class.setdefault(ancestor, []).append(index)
            for name, bases in catalog.SPEC_CLASSES.items():  # the known subclasses it covers too
                if ancestor in bases:
                    by_class.setdefault(name, []).append(index)




def _layout_checks(layout: Layout, source: SourceMap) -> Iterator[Diagnostic]:
    """Lint warnings of a valid layout (what is invalid, the model refuses)."""
    for group_index, group in enumerate(layout.groups):
        for member_index, member in enumerate(group.members):
            base: Path = ("groups", group_index) if group.uniform is None else ("groups", group_index, "uniform", member_index)
            spec = member.spec
            expected = catalog.SPEC_CLASSES.get(spec.type)
            if expected is not None and tuple(spec.bases) != expected:
                yield source.diagnostic(
                    (*base, "spec", "bases"),
                    f"{spec.type}'s bases in vLLM 0.32 are [{', '.join(expected)}]; rules for a missing base will not match",
                    code="KVP204",
                    severity="warning",
                )
