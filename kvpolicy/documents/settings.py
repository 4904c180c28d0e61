"""The connector's own ``kv_connector_extra_config`` keys, as one frozen model parsed once.

``KVPolicyConnector`` reads the keys that start with ``kvpolicy``; every other key of
``kv_connector_extra_config`` (``cache_prefix``, ``store_tp_size``, ...) is vLLM's Mooncake store
connector's and passes through untouched. :meth:`KVPolicySettings.parse` refuses a bad value and
an unknown ``kvpolicy*`` key with one located line each, all at once::

    kv_connector_extra_config.kvpolicy_read_failure_ttl_s: error: must be a number of seconds >= 0 ...

The side files rank 0 writes (:data:`SIDE_FILES`) are judged by their text on every parse, and against
this host's files (:meth:`KVPolicySettings.side_file_problems`) where the writer asks; one that still
cannot be written when it is written is one log line there, never a stopped rank
(:func:`kvpolicy.runtime.policy.write_side_file`).

:meth:`KVPolicySettings.kv_transfer_config` is the one builder of vLLM's ``--kv-transfer-config``
for the connector (what ``kvpolicy vllm-config`` prints). Pure: usable by the CLI without vLLM.
"""

from __future__ import annotations

import difflib
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from kvpolicy.language.diagnostics import printable_path
from kvpolicy.language.models import Keyed, KeyFormat, Verified

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "DEFAULT_PIECE_MIB",
    "DEFAULT_READ_FAILURE_TTL_S",
    "EXTRA_CONFIG",
    "KVPolicySettings",
    "PolicySelection",
    "SIDE_FILES",
    "SecretSource",
    "SettingsError",
    "StoreProtection",
    "keys_path_beside",
    "policy_usage",
]

EXTRA_CONFIG = "kv_connector_extra_config"
"""Where the keys live in vLLM's ``--kv-transfer-config``; the start of every error's location."""
CONNECTOR_CLASS = "KVPolicyConnector"
"""``kv_connector``: the connector's class name."""
CONNECTOR_MODULE = "kvpolicy.vllm"
"""``kv_connector_module_path``: where vLLM's factory imports the connector from."""
DEFAULT_READ_FAILURE_TTL_S = 30.0
"""Three times Mooncake's default ``client_ttl``: past the window in which the master still lists a
dead host's objects."""
DEFAULT_DISCOVER_STEPS = 16
"""Save steps the connector observes under ``kvpolicy_discover`` unless told otherwise."""
DEFAULT_PIECE_MIB = 256.0
"""MiB one rank stages per exchange of a striped load unless ``kvpolicy_striped_piece_mib`` says."""
SIDE_FILES = ("kvpolicy_plan_json", "kvpolicy_keys_json", "kvpolicy_dynamo_json", "kvpolicy_layout_out", "kvpolicy_discover")
"""The keys naming a file rank 0 writes (an observability side file: one it cannot write is logged, and
the instance serves on)."""
KEY_PREFIX = "kvpolicy"
"""Keys starting with this are the connector's own: an unknown one is a misspelling, not vLLM's."""


class SettingsError(ValueError):
    """``kv_connector_extra_config`` holds bad kvpolicy settings: one located line per problem."""

    def __init__(self, problems: tuple[str, ...]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _problem(message: str) -> PydanticCustomError:
    return PydanticCustomError("kvpolicy_setting", message)


class PolicySelection(BaseModel):
    """The mapping form of ``kvpolicy``: a policy and an override of its ``strict`` setting."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    policy: str = Field(min_length=1)
    """A shipped policy name or a policy file path."""
    strict: bool | None = None
    """Overrides the policy file's ``strict``; unset keeps the file's."""


def policy_usage() -> str:
    """What ``kvpolicy`` may be set to."""
    # Imported here: the loader reads the shipped policies' directory, the model needs no files.
    from kvpolicy.documents.loader import shipped_policy_names

    return (
        f"set it to a shipped policy ({', '.join(shipped_policy_names())}), a policy file path, "
        "or {'policy': <name or path>, 'strict': <true|false>}"
    )


def _selection_from_mapping(setting: Mapping[Any, Any]) -> PolicySelection:
    allowed = tuple(PolicySelection.model_fields)
    unknown = [str(key) for key in setting if key not in allowed]
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(allowed)}"
        raise _problem(f"unknown key '{unknown[0]}'; {hint}")
    name = setting.get("policy")
    if not isinstance(name, (str, os.PathLike)) or not os.fspath(name):
        raise _problem(f"lacks 'policy'; {policy_usage()}")
    strict = setting.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _problem(f"'strict' must be true or false, got {strict!r}")
    return PolicySelection(policy=os.fspath(name), strict=strict)


class KVPolicySettings(BaseModel):
    """The connector's own ``kv_connector_extra_config`` keys (field name = key)."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        title="KVPolicyConnectorSettings",
        json_schema_extra=lambda schema: _open_to_vllm_keys(schema),
    )

    kvpolicy: str | PolicySelection | None = None
    """The policy: a shipped policy name, a policy file path, or ``{"policy": <name or path>, "strict":
    <bool>}``. The connector needs it; a worker built without the connector takes its policy directly."""
    kvpolicy_plan_json: Path | None = None
    """A file rank 0 writes the plan to, as JSON (rewritten after every audited step that changes a
    group's audit status)."""
    kvpolicy_keys_json: Path | None = None
    """A file rank 0 writes the key contract to (what ``kvpolicy keys --format json`` prints), at
    start-up and whenever the audit changes the plan. Unset, an instance given ``kvpolicy_plan_json``
    writes it beside the plan as ``<plan file stem>.keys.json``."""
    kvpolicy_dynamo_json: Path | None = None
    """A file rank 0 writes Dynamo's router descriptor to (what ``kvpolicy keys --format dynamo``
    prints: every group's kind, geometry and exact key prefixes), with the key contract and whenever
    it is rewritten. A plan Dynamo's format cannot describe (an MLA group, say) writes none and
    removes one left from before, saying why in the log."""
    kvpolicy_layout_out: Path | None = None
    """A file rank 0 writes, at start-up, the layout it planned (the ``ModelLayout`` of its
    ``KVCacheConfig``), for ``kvpolicy validate`` / ``kvpolicy plan --layout``."""
    kvpolicy_discover: Path | None = None
    """A file rank 0 writes a discovery report to (``kind: DiscoveryReport``): for the first
    ``kvpolicy_discover_steps`` steps that save blocks, every rank digests, per layer and block, what
    it saves for every group, and rank 0 records which TP ranks held identical bytes. Rewritten after
    observed steps 1, 2, 4, 8 ... and the last; never changes what is stored or loaded. ``kvpolicy discover --propose`` turns
    reports into a policy."""
    kvpolicy_discover_steps: int = Field(default=DEFAULT_DISCOVER_STEPS, ge=1, le=10_000, strict=True)
    """Save steps observed under ``kvpolicy_discover`` (each costs one digest pass and one gather)."""
    kvpolicy_read_failure_ttl_s: float = Field(default=DEFAULT_READ_FAILURE_TTL_S, ge=0)
    """Seconds a key whose read failed stays missing to lookups (``0`` turns this off)."""
    kvpolicy_striped_piece_mib: float = Field(default=DEFAULT_PIECE_MIB, gt=0)
    """MiB one rank stages per exchange of a striped load, at most."""
    kvpolicy_striped_exchange: Literal["gloo", "nccl"] = "gloo"
    """The collective a striped load's stripes travel over: ``gloo`` (host staging) or ``nccl``
    (device buffers; not yet run on a GPU)."""
    kvpolicy_secret: str | None = None
    """Where the deployment's secret is: ``env:NAME`` (an environment variable) or ``file:PATH`` (a file
    only its owner may read), never the secret itself. With it, store keys are keyed (a client without
    the secret cannot compute, probe or pre-write them) unless ``kvpolicy_keyed_namespaces`` is false.
    Instances with one secret share their cache; instances with different secrets share nothing."""
    kvpolicy_previous_secret: str | None = None
    """The secret before a rotation (same form as ``kvpolicy_secret``): lookups and loads also read what it
    stored, saves never write with it, until ``kvpolicy_previous_secret_until``."""
    kvpolicy_previous_secret_until: AwareDatetime | None = None
    """When the rotation's grace period ends (ISO 8601 with a UTC offset): from then on the previous secret
    is not read. Unset: read for as long as ``kvpolicy_previous_secret`` is set."""
    kvpolicy_keyed_namespaces: bool | None = None
    """Key chunk keys with the secret. Unset: keyed exactly when ``kvpolicy_secret`` is set (and the
    policy's ``key.keyed`` is not ``off``); ``false`` keeps keys readable by routers, the secret then seals
    objects only."""
    kvpolicy_verify_objects: bool = False
    """Seal every object with a MAC of its key and bytes under the secret and check it on every load; a
    mismatch is a load failure (recomputed, counted, logged once per key), never loaded KV. Needs
    ``kvpolicy_secret`` and KV caches in host memory (the CPU path; see the trust-boundary page)."""

    @field_validator("kvpolicy", mode="before")
    @classmethod
    def _policy_setting(cls, setting: object) -> object:
        if setting is None or isinstance(setting, PolicySelection):
            return setting
        if isinstance(setting, Mapping):
            return _selection_from_mapping(setting)
        if isinstance(setting, (str, os.PathLike)):
            return os.fspath(setting) or None
        raise _problem(f"is a {type(setting).__name__}; {policy_usage()}")

    @field_validator(*SIDE_FILES, mode="before")
    @classmethod
    def _path(cls, value: object) -> object:
        if value is None or value == "":
            return None
        if not isinstance(value, (str, os.PathLike)):
            raise _problem(f"must be a file path, got {_shown(value)}")
        text = os.fspath(value)
        if not isinstance(text, str):
            raise _problem(f"must be a file path as text, got {_shown(value)}")
        if "\0" in text:
            raise _problem(f"the path contains a NUL character ({_shown(text)}); give a file path without one")
        if text.endswith(("/", os.sep)) or os.path.basename(text) in (".", ".."):
            raise _problem(f"names a directory ({_shown(text)}); give the path of a file in it")
        return value

    @field_validator("kvpolicy_secret", "kvpolicy_previous_secret", mode="before")
    @classmethod
    def _secret_source(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, str):
            raise _problem(f"must be 'env:NAME' or 'file:PATH' as text, got a {type(value).__name__} (not shown)")
        try:
            SecretSource.parse(value)
        except ValueError as error:
            raise _problem(str(error)) from None
        return value

    @field_validator("kvpolicy_read_failure_ttl_s", mode="before")
    @classmethod
    def _ttl(cls, value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise _problem(f"must be a number of seconds >= 0 (0 turns it off), got {value!r}")
        return float(value)

    @field_validator("kvpolicy_striped_piece_mib", mode="before")
    @classmethod
    def _piece_mib(cls, value: object) -> object:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value * 2**20 < 1
        ):
            raise _problem(f"must be a number of MiB > 0 (default {DEFAULT_PIECE_MIB:g}), got {value!r}")
        return float(value)

    # --- reading ---------------------------------------------------------------------------------

    @classmethod
    def parse(cls, extra_config: Mapping[str, Any], *, check_side_files: bool = False) -> KVPolicySettings:
        """The settings in ``extra_config`` (vLLM's ``kv_connector_extra_config``); keys not starting
        with ``kvpolicy`` are vLLM's and ignored. :class:`SettingsError` with every problem.

        A side-file path is judged by its text always (a NUL, a directory's spelling, two settings
        naming one file); with ``check_side_files`` also against this host's files
        (:meth:`side_file_problems`): for the process that writes them (global rank 0), not for a
        configuration built here to run elsewhere, nor for ranks on other hosts, which write none."""
        ours = {key: value for key, value in extra_config.items() if str(key).startswith(KEY_PREFIX)}
        known = tuple(cls.model_fields)
        problems = [_unknown_key(str(key), known) for key in ours if key not in known]
        settings = None
        try:
            settings = cls(**{key: value for key, value in ours.items() if key in known})
        except ValidationError as error:
            problems[:0] = [_located(entry) for entry in error.errors()]
        if settings is not None:
            problems.extend(settings._shared_side_files())
            problems.extend(settings._trust_problems())
            if check_side_files:
                problems.extend(settings.side_file_problems())
        if problems:
            raise SettingsError(tuple(problems))
        assert settings is not None
        return settings

    def side_files(self) -> tuple[tuple[str, Path], ...]:
        """(key, path) of every file rank 0 writes, in key order; the key contract beside the plan
        (:meth:`keys_json_path`) under ``kvpolicy_plan_json`` when ``kvpolicy_keys_json`` is unset."""
        found = [(key, getattr(self, key)) for key in SIDE_FILES if getattr(self, key) is not None]
        if self.kvpolicy_keys_json is None and self.kvpolicy_plan_json is not None:
            found.append(("kvpolicy_plan_json", keys_path_beside(self.kvpolicy_plan_json)))
        return tuple(found)

    def side_file_problems(self) -> tuple[str, ...]:
        """What keeps rank 0 from writing a side file on this host, one located line each: the path
        names a directory or a special file (a device would be replaced whole), or its directory is
        missing, not a directory or not writable by this user. Nothing is created or changed."""
        problems: list[str] = []
        for key, path in self.side_files():
            if getattr(self, key) == path:
                reason = _unwritable(path)
            else:  # the key contract beside the plan: the plan's own line says what is wrong with its directory
                try:
                    occupied = _occupied(path)
                except OSError:
                    occupied = None
                reason = None if occupied is None else (
                    f"the key contract is written beside it, to {_shown(str(path))}, which is {occupied}; "
                    "set kvpolicy_keys_json to another path"
                )
            if reason is not None:
                problems.append(f"{EXTRA_CONFIG}.{key}: error: {reason}")
        return tuple(problems)

    def _shared_side_files(self) -> list[str]:
        """Two side files on one path: each rewrite would replace the other's document."""
        seen: dict[str, str] = {}
        problems = []
        for key, path in self.side_files():
            spelled = os.path.normpath(path)
            earlier = seen.setdefault(spelled, key)
            if earlier != key:
                what = "its key contract" if key == "kvpolicy_plan_json" else "it"
                problems.append(
                    f"{EXTRA_CONFIG}.{key}: error: {what} would be written to {_shown(spelled)}, the file of "
                    f"{earlier}; give each side file its own path"
                )
        return problems

    def _trust_problems(self) -> list[str]:
        """Trust settings that contradict each other: one line each, at the key at fault."""
        problems = []
        lacking = "needs kvpolicy_secret (the secret it is made with); set it to 'env:NAME' or 'file:PATH'"
        if self.kvpolicy_secret is None:
            for key in ("kvpolicy_previous_secret", "kvpolicy_verify_objects"):
                if getattr(self, key):
                    problems.append(f"{EXTRA_CONFIG}.{key}: error: {lacking}")
            if self.kvpolicy_keyed_namespaces:
                problems.append(f"{EXTRA_CONFIG}.kvpolicy_keyed_namespaces: error: {lacking}")
        elif self.kvpolicy_previous_secret == self.kvpolicy_secret:
            problems.append(
                f"{EXTRA_CONFIG}.kvpolicy_previous_secret: error: names the same source as kvpolicy_secret; "
                "a rotation reads the old secret from another variable or file"
            )
        if self.kvpolicy_previous_secret_until is not None and self.kvpolicy_previous_secret is None:
            problems.append(
                f"{EXTRA_CONFIG}.kvpolicy_previous_secret_until: error: ends the grace period of no previous secret; "
                "set kvpolicy_previous_secret too, or remove it"
            )
        return problems

    def protection(self, key: KeyFormat) -> StoreProtection:
        """What the store traffic gets under these settings and a policy's ``key`` section;
        :class:`SettingsError` where the policy requires what the settings do not give, or forbids what
        they ask."""
        secret = self.kvpolicy_secret is not None
        problems = []
        if key.keyed is Keyed.OFF and self.kvpolicy_keyed_namespaces:
            problems.append(
                f"{EXTRA_CONFIG}.kvpolicy_keyed_namespaces: error: the policy's key.keyed is 'off' (its keys stay "
                "readable by routers); remove the setting, or use a policy that allows keyed keys"
            )
        keyed = secret and key.keyed is not Keyed.OFF and self.kvpolicy_keyed_namespaces is not False
        if key.keyed is Keyed.REQUIRED and not keyed:
            why = "kvpolicy_keyed_namespaces is false" if secret else "no kvpolicy_secret is set"
            problems.append(
                f"{EXTRA_CONFIG}.kvpolicy_secret: error: the policy's key.keyed is 'required' but {why}; "
                "name the deployment's secret ('env:NAME' or 'file:PATH')"
            )
        if key.verified is Verified.REQUIRED and not self.kvpolicy_verify_objects:
            problems.append(
                f"{EXTRA_CONFIG}.kvpolicy_verify_objects: error: the policy's key.verified is 'required'; "
                "set it to true (with kvpolicy_secret)"
            )
        if problems:
            raise SettingsError(tuple(problems))
        return StoreProtection(keyed=keyed, verified=self.kvpolicy_verify_objects)

    @property
    def secret_sources(self) -> tuple[SecretSource | None, SecretSource | None]:
        """(current, previous) secret sources, as set."""
        return (
            None if self.kvpolicy_secret is None else SecretSource.parse(self.kvpolicy_secret),
            None if self.kvpolicy_previous_secret is None else SecretSource.parse(self.kvpolicy_previous_secret),
        )

    @property
    def policy_name(self) -> str | None:
        """The policy's shipped name or file path; None when no policy is selected."""
        return self.kvpolicy.policy if isinstance(self.kvpolicy, PolicySelection) else self.kvpolicy

    @property
    def strict(self) -> bool | None:
        """The override of the policy's ``strict``; None keeps the policy file's."""
        return self.kvpolicy.strict if isinstance(self.kvpolicy, PolicySelection) else None

    @property
    def striped_piece_budget_bytes(self) -> int:
        """``kvpolicy_striped_piece_mib`` in bytes."""
        return int(self.kvpolicy_striped_piece_mib * 2**20)

    def keys_json_path(self) -> Path | None:
        """Where rank 0 writes the key contract: ``kvpolicy_keys_json``, else beside the plan file."""
        if self.kvpolicy_keys_json is not None:
            return self.kvpolicy_keys_json
        plan = self.kvpolicy_plan_json
        return None if plan is None else keys_path_beside(plan)

    # --- writing ---------------------------------------------------------------------------------

    def extra_config(self, upstream_extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``kv_connector_extra_config``: the settings that differ from their defaults, then
        ``upstream_extra`` (vLLM's Mooncake store connector's own keys)."""
        upstream = dict(upstream_extra or {})
        ours_there = sorted(key for key in upstream if str(key).startswith(KEY_PREFIX))
        if ours_there:
            raise ValueError(
                f"upstream_extra holds kvpolicy's own keys ({', '.join(ours_there)}): set them on KVPolicySettings"
            )
        ours = self.model_dump(mode="json", exclude_defaults=True, exclude_none=True)
        return {**ours, **upstream}

    def kv_transfer_config(
        self, *, role: str = "kv_both", upstream_extra: Mapping[str, Any] | None = None, **upstream_fields: Any
    ) -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config`` running the connector with these settings; ``upstream_extra``
        adds the Mooncake store connector's ``kv_connector_extra_config`` keys, ``upstream_fields``
        other ``KVTransferConfig`` fields. ``kv_load_failure_policy`` is ``recompute`` unless given: the
        store may lose an object between a lookup's hit and its load (eviction, a lost segment host), and
        vLLM's default, ``fail``, would fail the request (vLLM 0.32 and 0.33 both have the field)."""
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            **upstream_fields,
            EXTRA_CONFIG: self.extra_config(upstream_extra),
        }


@dataclass(frozen=True)
class StoreProtection:
    """What the deployment's secret does to the store traffic (:meth:`KVPolicySettings.protection`)."""

    keyed: bool = False
    """Chunk keys end in an HMAC under the secret instead of vLLM's block hash."""
    verified: bool = False
    """Every object carries a MAC of its key and bytes, checked on load."""


@dataclass(frozen=True)
class SecretSource:
    """Where a secret lives: ``env:NAME`` (an environment variable) or ``file:PATH``; never the secret."""

    kind: Literal["env", "file"]
    name: str

    @classmethod
    def parse(cls, text: str) -> SecretSource:
        """:class:`ValueError` saying what is wrong and the fix."""
        kind, colon, name = text.partition(":")
        if not colon or kind not in ("env", "file"):
            # The value is never shown: it may be the secret itself.
            raise ValueError(
                "names no secret source (the value is not shown: it may be the secret itself); write 'env:NAME' "
                "(an environment variable) or 'file:PATH' (a file only its owner may read), never the secret"
            )
        if not name:
            raise ValueError(f"'{kind}:' names nothing; write '{kind}:{'NAME' if kind == 'env' else 'PATH'}'")
        if "\0" in name:
            raise ValueError(f"the {'name' if kind == 'env' else 'path'} contains a NUL character")
        if kind == "env" and (not (name[0].isalpha() or name[0] == "_") or not all(c.isalnum() or c == "_" for c in name)):
            raise ValueError(
                "the text after 'env:' is not an environment variable name (a letter or '_', then letters, digits "
                "and '_'; not shown: it may be the secret itself)"
            )
        return cls("env" if kind == "env" else "file", name)

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


def keys_path_beside(plan_path: Path) -> Path:
    """Where the key contract goes without ``kvpolicy_keys_json``: ``<plan file stem>.keys.json`` beside
    the plan (``plan.json`` -> ``plan.keys.json``), never the plan file itself."""
    return plan_path.with_name(f"{plan_path.stem}.keys.json")


def _occupied(path: Path) -> str | None:
    """What stands at ``path`` that a side file must not replace ("a directory", "a FIFO"), or None
    (nothing, a regular file or a link, which the write replaces as a link). Raises ``OSError``."""
    from kvpolicy.documents.loader import file_kind  # the loader reads the shipped documents, the model needs no files

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISLNK(mode) else file_kind(mode)


def _unwritable(path: Path) -> str | None:
    """Why rank 0 could not write ``path`` as a side file here (it replaces it whole, through a fresh
    file beside it), or None. Looks only: creates nothing."""
    shown = _shown(str(path))
    parent = path.parent
    where = _shown(str(parent))
    try:
        parent_mode = os.stat(parent).st_mode
    except FileNotFoundError:
        return f"the directory {where} does not exist; create it, or give a path in an existing directory"
    except NotADirectoryError:
        return f"the directory {where} cannot exist: a folder on its path is a file; give a path in a directory"
    except OSError as error:  # a name too long, a folder not searchable, a loop of links
        return f"cannot reach the directory {where}: {error.strerror or error}"
    if not stat.S_ISDIR(parent_mode):
        return f"{where} is not a directory; give a path in a directory"
    try:
        occupied = _occupied(path)
    except OSError as error:
        return f"cannot write {shown}: {error.strerror or error}"
    if occupied == "a directory":
        return f"names a directory ({shown}); give the path of a file in it"
    if occupied is not None:
        return f"names {occupied} ({shown}), which writing the side file would replace; give the path of a regular file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the directory {where} is not writable by this user (uid {os.geteuid()}); make it writable, or give another"
    return None


def _shown(value: object, limit: int = 200) -> str:
    """``value`` in an error line: a path printable on one line, anything else its repr, cut to ``limit``."""
    text = printable_path(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _open_to_vllm_keys(schema: dict[str, Any]) -> None:
    """The document is all of ``kv_connector_extra_config``: vLLM's keys are allowed, a ``kvpolicy*``
    key must be one of ours."""
    schema["additionalProperties"] = True
    schema["propertyNames"] = {"anyOf": [{"enum": list(schema["properties"])}, {"not": {"pattern": f"^{KEY_PREFIX}"}}]}


def _unknown_key(key: str, known: tuple[str, ...]) -> str:
    # A key with a suffix ("kvpolicy_x") resembles the bare "kvpolicy" more than it means it.
    candidates = [name for name in known if "_" in name] if "_" in key else list(known)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.7)
    hint = f"did you mean '{close[0]}'?" if close else f"kvpolicy's keys are {', '.join(known)}"
    return f"{EXTRA_CONFIG}.{key}: error: unknown key; {hint}"


def _located(entry: Mapping[str, Any]) -> str:
    where = ".".join(str(part) for part in (EXTRA_CONFIG, *entry["loc"]))
    message = entry["msg"]
    if entry["type"] != "kvpolicy_setting" and not set(entry["loc"][:1]) & _NEVER_ECHOED:
        message = f"{message}, got {_quoted(entry['input'])}"
    return f"{where}: error: {message}"


_NEVER_ECHOED = frozenset({"kvpolicy_secret", "kvpolicy_previous_secret"})  # what they hold may be the secret
_ECHO_LIMIT = 120


def _quoted(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _ECHO_LIMIT else f"{text[:_ECHO_LIMIT]}... ({len(text) - _ECHO_LIMIT} more characters)"
