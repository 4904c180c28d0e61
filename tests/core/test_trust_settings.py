"""The trust settings of ``kv_connector_extra_config`` (``kvpolicy_secret``, ``kvpolicy_previous_secret``,
``kvpolicy_previous_secret_until``, ``kvpolicy_keyed_namespaces``, ``kvpolicy_verify_objects``), what they
give the store traffic under a policy's ``key.keyed`` / ``key.verified`` (:meth:`KVPolicySettings.protection`),
and those two policy keys as the loader reads them. Pure: no vLLM, torch or Mooncake."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kvpolicy.documents.loader import check_text, load_policy
from kvpolicy.documents.settings import KVPolicySettings, SecretSource, SettingsError, StoreProtection
from kvpolicy.language.diagnostics import DocumentError
from kvpolicy.language.models import Keyed, KeyFormat, Verified

AT = "kv_connector_extra_config."
SECRET = {"kvpolicy_secret": "env:KVPOLICY_SECRET"}


def problems(extra_config: dict[str, object]) -> tuple[str, ...]:
    with pytest.raises(SettingsError) as raised:
        KVPolicySettings.parse(extra_config)
    return raised.value.problems


def keys_at_fault(lines: tuple[str, ...]) -> list[str]:
    return [line.split(": error: ")[0].removeprefix(AT) for line in lines]


def protection(key: KeyFormat, **extra_config: object) -> StoreProtection:
    return KVPolicySettings.parse(extra_config).protection(key)


def protection_problems(key: KeyFormat, **extra_config: object) -> tuple[str, ...]:
    settings = KVPolicySettings.parse(extra_config)
    with pytest.raises(SettingsError) as raised:
        settings.protection(key)
    return raised.value.problems


# --- reading the keys ------------------------------------------------------------------------------


def test_no_trust_key_protects_nothing() -> None:
    settings = KVPolicySettings.parse({})
    assert (settings.kvpolicy_secret, settings.kvpolicy_previous_secret, settings.kvpolicy_previous_secret_until) == (None,) * 3
    assert (settings.kvpolicy_keyed_namespaces, settings.kvpolicy_verify_objects) == (None, False)
    assert settings.protection(KeyFormat()) == StoreProtection(keyed=False, verified=False)


def test_every_trust_key_sets_its_field() -> None:
    settings = KVPolicySettings.parse({
        "kvpolicy_secret": "file:/run/secrets/kv",
        "kvpolicy_previous_secret": "env:OLD_SECRET",
        "kvpolicy_previous_secret_until": "2030-01-02T03:04:05+02:00",
        "kvpolicy_keyed_namespaces": False,
        "kvpolicy_verify_objects": True,
    })
    assert settings.secret_sources == (SecretSource("file", "/run/secrets/kv"), SecretSource("env", "OLD_SECRET"))
    assert settings.kvpolicy_previous_secret_until == datetime(2030, 1, 2, 1, 4, 5, tzinfo=UTC)
    assert (settings.kvpolicy_keyed_namespaces, settings.kvpolicy_verify_objects) == (False, True)


@pytest.mark.parametrize(
    ("text", "source"),
    [("env:KV_SECRET", SecretSource("env", "KV_SECRET")), ("env:_x9", SecretSource("env", "_x9")),
     ("file:/etc/kv:secret", SecretSource("file", "/etc/kv:secret")), ("file:relative/s", SecretSource("file", "relative/s"))],
)
def test_a_secret_source_is_env_and_a_variable_name_or_file_and_a_path(text: str, source: SecretSource) -> None:
    assert SecretSource.parse(text) == source
    assert str(source) == text


@pytest.mark.parametrize(
    ("text", "complaint"),
    [("KV_SECRET", "names no secret source"), ("vault:kv", "names no secret source"), ("env:", "'env:' names nothing"),
     ("file:", "'file:' names nothing"), ("env:9LIVES", "not an environment variable name"),
     ("env:A-B", "not an environment variable name"), ("file:/a\0b", "NUL character")],
)
def test_a_malformed_secret_source_is_refused_at_its_key_saying_what_to_write(text: str, complaint: str) -> None:
    for key in ("kvpolicy_secret", "kvpolicy_previous_secret"):
        found = problems({"kvpolicy_secret": "env:S", key: text} if key != "kvpolicy_secret" else {key: text})
        (line,) = [line for line in found if line.startswith(f"{AT}{key}: error: ")]
        assert complaint in line


def test_a_secret_source_that_is_not_text_is_refused_without_showing_it() -> None:
    (line,) = problems({"kvpolicy_secret": ["s3cr3t-in-a-list-0123456789"]})
    assert line.startswith(f"{AT}kvpolicy_secret: error: ") and "s3cr3t" not in line


@pytest.mark.parametrize(
    "value",
    ["s3cr3t-0123456789abcdef0123456789", "vault:s3cr3t-0123456789abcdef", "env:0123456789abcdef-s3cr3t",
     "env:s3cr3t 0123456789", "file:\0s3cr3t-0123456789"],
    ids=["bare", "unknown-kind", "bad-name", "space", "nul"],
)
@pytest.mark.parametrize("key", ["kvpolicy_secret", "kvpolicy_previous_secret"])
def test_a_secret_written_in_place_of_its_source_is_refused_without_showing_it(key: str, value: str) -> None:
    found = problems({**SECRET, key: value})
    assert keys_at_fault(found) == [key]
    assert not any("s3cr3t" in line for line in found)


def test_a_secret_given_to_a_misspelled_key_is_not_shown() -> None:
    (line,) = problems({"kvpolicy_secrte": "s3cr3t-0123456789abcdef"})
    assert "did you mean 'kvpolicy_secret'?" in line and "s3cr3t" not in line


# --- cross-checks ----------------------------------------------------------------------------------


def test_verifying_objects_without_a_secret_is_refused_at_kvpolicy_verify_objects() -> None:
    (line,) = problems({"kvpolicy_verify_objects": True})
    assert line.startswith(f"{AT}kvpolicy_verify_objects: error: ") and "needs kvpolicy_secret" in line


def test_a_previous_secret_without_a_secret_is_refused_at_kvpolicy_previous_secret() -> None:
    (line,) = problems({"kvpolicy_previous_secret": "env:OLD"})
    assert line.startswith(f"{AT}kvpolicy_previous_secret: error: ") and "needs kvpolicy_secret" in line


def test_keyed_namespaces_without_a_secret_are_refused_at_kvpolicy_keyed_namespaces() -> None:
    (line,) = problems({"kvpolicy_keyed_namespaces": True})
    assert line.startswith(f"{AT}kvpolicy_keyed_namespaces: error: ") and "needs kvpolicy_secret" in line


def test_keyed_namespaces_turned_off_need_no_secret() -> None:
    assert KVPolicySettings.parse({"kvpolicy_keyed_namespaces": False}).kvpolicy_keyed_namespaces is False


def test_a_previous_secret_from_the_same_source_as_the_secret_is_refused_at_kvpolicy_previous_secret() -> None:
    (line,) = problems({"kvpolicy_secret": "file:/run/s", "kvpolicy_previous_secret": "file:/run/s"})
    assert line.startswith(f"{AT}kvpolicy_previous_secret: error: ") and "same source" in line


def test_a_previous_secret_from_another_source_is_taken() -> None:
    settings = KVPolicySettings.parse({"kvpolicy_secret": "env:NEW", "kvpolicy_previous_secret": "env:OLD"})
    assert settings.secret_sources == (SecretSource("env", "NEW"), SecretSource("env", "OLD"))


def test_a_grace_period_without_a_previous_secret_is_refused_at_kvpolicy_previous_secret_until() -> None:
    (line,) = problems({**SECRET, "kvpolicy_previous_secret_until": "2030-01-01T00:00:00Z"})
    assert line.startswith(f"{AT}kvpolicy_previous_secret_until: error: ") and "kvpolicy_previous_secret" in line.split(": error: ")[1]


def test_a_grace_period_without_a_timezone_is_refused_at_kvpolicy_previous_secret_until() -> None:
    (line,) = problems({**SECRET, "kvpolicy_previous_secret": "env:OLD", "kvpolicy_previous_secret_until": "2030-01-01T00:00:00"})
    assert line.startswith(f"{AT}kvpolicy_previous_secret_until: error: ") and "timezone" in line


def test_a_grace_period_with_an_offset_is_the_instant_it_names() -> None:
    settings = KVPolicySettings.parse({**SECRET, "kvpolicy_previous_secret": "env:OLD",
                                       "kvpolicy_previous_secret_until": "2030-01-01T00:00:00-05:00"})
    assert settings.kvpolicy_previous_secret_until == datetime(2030, 1, 1, 5, tzinfo=UTC)
    assert settings.kvpolicy_previous_secret_until.utcoffset() == timedelta(hours=-5)


def test_every_trust_problem_is_reported_at_once_each_at_its_key() -> None:
    found = problems({
        "kvpolicy_previous_secret": "env:OLD",
        "kvpolicy_verify_objects": True,
        "kvpolicy_keyed_namespaces": True,
    })
    assert sorted(keys_at_fault(found)) == ["kvpolicy_keyed_namespaces", "kvpolicy_previous_secret", "kvpolicy_verify_objects"]


def test_trust_problems_come_with_an_unknown_keys_problem() -> None:
    found = problems({"kvpolicy_verify_objects": True, "kvpolicy_plan_jsn": "p"})
    assert sorted(keys_at_fault(found)) == ["kvpolicy_plan_jsn", "kvpolicy_verify_objects"]


# --- what a policy's key section asks of them ---------------------------------------------------------


def key(keyed: Keyed = Keyed.OPTIONAL, verified: Verified = Verified.OPTIONAL) -> KeyFormat:
    return KeyFormat(keyed=keyed, verified=verified)


def test_a_policy_requiring_keyed_keys_refuses_settings_without_a_secret_at_kvpolicy_secret() -> None:
    (line,) = protection_problems(key(Keyed.REQUIRED))
    assert line.startswith(f"{AT}kvpolicy_secret: error: ") and "'required'" in line


def test_a_policy_requiring_keyed_keys_refuses_keyed_namespaces_turned_off() -> None:
    (line,) = protection_problems(key(Keyed.REQUIRED), **SECRET, kvpolicy_keyed_namespaces=False)
    assert line.startswith(f"{AT}kvpolicy_secret: error: ") and "kvpolicy_keyed_namespaces is false" in line


def test_a_policy_requiring_keyed_keys_is_keyed_by_a_secret() -> None:
    assert protection(key(Keyed.REQUIRED), **SECRET) == StoreProtection(keyed=True, verified=False)


def test_a_policy_requiring_verified_objects_refuses_settings_that_do_not_verify() -> None:
    (line,) = protection_problems(key(verified=Verified.REQUIRED), **SECRET)
    assert line.startswith(f"{AT}kvpolicy_verify_objects: error: ") and "'required'" in line


def test_a_policy_requiring_verified_objects_takes_settings_that_verify() -> None:
    found = protection(key(verified=Verified.REQUIRED), **SECRET, kvpolicy_verify_objects=True)
    assert found == StoreProtection(keyed=True, verified=True)


def test_a_policy_requiring_both_reports_both_missing_at_once() -> None:
    found = protection_problems(key(Keyed.REQUIRED, Verified.REQUIRED))
    assert keys_at_fault(found) == ["kvpolicy_secret", "kvpolicy_verify_objects"]


def test_a_policy_whose_keys_are_off_refuses_keyed_namespaces_asked_for() -> None:
    (line,) = protection_problems(key(Keyed.OFF), **SECRET, kvpolicy_keyed_namespaces=True)
    assert line.startswith(f"{AT}kvpolicy_keyed_namespaces: error: ") and "'off'" in line


def test_a_policy_whose_keys_are_off_keeps_them_plain_under_a_secret() -> None:
    assert protection(key(Keyed.OFF), **SECRET).keyed is False


def test_a_policy_whose_keys_are_off_still_verifies_objects_the_settings_seal() -> None:
    assert protection(key(Keyed.OFF), **SECRET, kvpolicy_verify_objects=True) == StoreProtection(keyed=False, verified=True)


def test_a_secret_keys_the_default_policys_keys() -> None:
    assert protection(load_policy("default").key, **SECRET) == StoreProtection(keyed=True, verified=False)


def test_a_secret_keys_an_optional_policys_keys() -> None:
    assert protection(key(), **SECRET).keyed is True


def test_keyed_namespaces_turned_off_keep_keys_plain_under_a_secret() -> None:
    assert protection(key(), **SECRET, kvpolicy_keyed_namespaces=False).keyed is False


def test_without_a_secret_an_optional_policys_keys_stay_plain() -> None:
    assert protection(key()) == StoreProtection(keyed=False, verified=False)


# --- the policy's key section in a policy file ----------------------------------------------------------

POLICY = "version: 1\nkind: ReplicationPolicy\nname: guarded\nrules: []\n"


def test_a_policy_file_requiring_keyed_keys_and_verified_objects_loads_with_both(tmp_path: Path) -> None:
    path = tmp_path / "guarded.yaml"
    path.write_text(POLICY + "key: {keyed: required, verified: required}\n", encoding="utf-8")
    policy = load_policy(str(path))
    assert (policy.key.keyed, policy.key.verified) == (Keyed.REQUIRED, Verified.REQUIRED)


def test_a_policy_file_without_a_key_section_leaves_both_optional() -> None:
    document, found = check_text(POLICY, "p.yaml")
    assert document is not None and not found
    assert (document.key.keyed, document.key.verified) == (Keyed.OPTIONAL, Verified.OPTIONAL)


@pytest.mark.parametrize(
    ("line", "column", "allowed"),
    [("  keyed: maybe", 10, "'optional', 'required' or 'off'"), ("  verified: off", 13, "'optional' or 'required'")],
)
def test_an_unknown_requirement_is_located_and_lists_the_allowed_ones(line: str, column: int, allowed: str) -> None:
    document, found = check_text(POLICY + "key:\n" + line + "\n", "p.yaml")
    errors = [problem for problem in found if problem.severity == "error"]
    assert document is None and len(errors) == 1
    assert (errors[0].line, errors[0].column) == (6, column) and allowed in errors[0].message


def test_an_unknown_requirement_stops_load_policy(tmp_path: Path) -> None:
    path = tmp_path / "maybe.yaml"
    path.write_text(POLICY + "key: {keyed: maybe}\n", encoding="utf-8")
    with pytest.raises(DocumentError) as raised:
        load_policy(str(path))
    (error,) = raised.value.errors
    assert error.line == 5 and "keyed" in error.message


def test_a_policy_requiring_keyed_keys_warns_that_routers_cannot_read_them() -> None:
    document, found = check_text(POLICY + "key: {keyed: required}\n", "p.yaml")
    assert document is not None
    (warning,) = found
    assert (warning.severity, warning.code, warning.line) == ("warning", "KVP206", 5)


def test_the_fix_the_keyed_keys_warning_names_is_one_the_settings_then_take() -> None:
    # Settings cannot override a policy's requirement, so the fix must loosen the policy first.
    document, found = check_text(POLICY + "key: {keyed: required}\n", "p.yaml")
    assert document is not None
    (warning,) = found
    assert "key.keyed to 'optional'" in warning.message and "kvpolicy_keyed_namespaces: false" in warning.message
    with pytest.raises(SettingsError):
        protection(document.key, **SECRET, kvpolicy_keyed_namespaces=False)
    fixed, _ = check_text(POLICY + "key: {keyed: optional}\n", "p.yaml")
    assert fixed is not None
    assert protection(fixed.key, **SECRET, kvpolicy_keyed_namespaces=False).keyed is False


def test_a_secret_setting_of_the_wrong_type_is_refused_without_echoing_it() -> None:
    secret = 7_391_023_884_519_002_317
    with pytest.raises(SettingsError) as raised:
        KVPolicySettings.parse({"kvpolicy_secret": secret})
    assert raised.value.problems and str(secret) not in " ".join(raised.value.problems)
