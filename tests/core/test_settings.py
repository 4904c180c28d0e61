"""The connector's ``kv_connector_extra_config`` keys: one model, parsed once, located errors, a schema,
and the one builder of ``--kv-transfer-config``. Pure: no vLLM, torch or Mooncake."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from kvpolicy.documents.loader import schemas_dir
from kvpolicy.documents.settings import (
    DEFAULT_PIECE_MIB,
    DEFAULT_READ_FAILURE_TTL_S,
    EXTRA_CONFIG,
    SIDE_FILES,
    KVPolicySettings,
    PolicySelection,
    SettingsError,
    keys_path_beside,
)

REPO = Path(__file__).resolve().parents[2]


def problems(extra_config: dict[str, object]) -> tuple[str, ...]:
    with pytest.raises(SettingsError) as raised:
        KVPolicySettings.parse(extra_config)
    return raised.value.problems


# --- reading ------------------------------------------------------------------------------------


def test_no_kvpolicy_key_gives_the_defaults() -> None:
    settings = KVPolicySettings.parse({})
    assert settings.kvpolicy_read_failure_ttl_s == DEFAULT_READ_FAILURE_TTL_S == 30.0
    assert settings.striped_piece_budget_bytes == int(DEFAULT_PIECE_MIB * 2**20) == 256 * 2**20
    assert settings.kvpolicy_striped_exchange == "gloo"
    assert (settings.kvpolicy, settings.kvpolicy_plan_json, settings.kvpolicy_layout_out) == (None, None, None)


def test_vllms_own_keys_pass_through_unread() -> None:
    # Values kvpolicy would refuse for its own keys: they are not kvpolicy's to check.
    settings = KVPolicySettings.parse({"cache_prefix": 3, "store_tp_size": "x", "kvpolicy": "default"})
    assert settings.policy_name == "default"


def test_each_key_sets_its_field() -> None:
    settings = KVPolicySettings.parse({
        "kvpolicy": {"policy": "no-dedup", "strict": True},
        "kvpolicy_plan_json": "run/plan.json",
        "kvpolicy_keys_json": "run/keys.json",
        "kvpolicy_layout_out": "run/layout.yaml",
        "kvpolicy_read_failure_ttl_s": 5,
        "kvpolicy_striped_piece_mib": 0.5,
        "kvpolicy_striped_exchange": "nccl",
    })
    assert (settings.policy_name, settings.strict) == ("no-dedup", True)
    assert (settings.kvpolicy_plan_json, settings.keys_json_path()) == (Path("run/plan.json"), Path("run/keys.json"))
    assert settings.kvpolicy_layout_out == Path("run/layout.yaml")
    assert (settings.kvpolicy_read_failure_ttl_s, settings.striped_piece_budget_bytes) == (5.0, 2**19)
    assert settings.kvpolicy_striped_exchange == "nccl"


def test_a_ttl_of_zero_is_allowed_and_turns_it_off() -> None:
    assert KVPolicySettings.parse({"kvpolicy_read_failure_ttl_s": 0}).kvpolicy_read_failure_ttl_s == 0.0


def test_the_settings_are_frozen() -> None:
    settings = KVPolicySettings.parse({})
    with pytest.raises(ValueError, match="frozen"):
        settings.kvpolicy_read_failure_ttl_s = 1.0  # type: ignore[misc]


def test_an_empty_path_means_unset() -> None:
    assert KVPolicySettings.parse({"kvpolicy_layout_out": ""}).kvpolicy_layout_out is None


@pytest.mark.parametrize(
    ("plan", "keys"),
    [("run/plan.json", "run/plan.keys.json"), ("run/kvpolicy.plan.json", "run/kvpolicy.plan.keys.json"),
     ("plan.keys.json", "plan.keys.keys.json"), ("plan", "plan.keys.json")],
)
def test_the_key_contract_goes_beside_the_plan_never_onto_it(plan: str, keys: str) -> None:
    assert keys_path_beside(Path(plan)) == Path(keys)
    assert KVPolicySettings.parse({"kvpolicy_plan_json": plan}).keys_json_path() == Path(keys)


def test_no_plan_file_and_no_keys_file_writes_no_key_contract() -> None:
    assert KVPolicySettings.parse({}).keys_json_path() is None


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-0.5, "10", float("nan"), float("inf"), False, [10], None])
def test_a_bad_ttl_is_refused_naming_the_key_and_what_to_write(value: object) -> None:
    assert problems({"kvpolicy_read_failure_ttl_s": value}) == (
        "kv_connector_extra_config.kvpolicy_read_failure_ttl_s: error: "
        f"must be a number of seconds >= 0 (0 turns it off), got {value!r}",
    )


@pytest.mark.parametrize("value", [0, -1, 1e-9, "256", True, float("nan")])
def test_a_bad_piece_size_is_refused_naming_the_key(value: object) -> None:
    (problem,) = problems({"kvpolicy_striped_piece_mib": value})
    assert problem.startswith("kv_connector_extra_config.kvpolicy_striped_piece_mib: error: must be a number of MiB > 0")


def test_an_unknown_exchange_is_refused_with_the_allowed_ones() -> None:
    assert problems({"kvpolicy_striped_exchange": "mpi"}) == (
        "kv_connector_extra_config.kvpolicy_striped_exchange: error: Input should be 'gloo' or 'nccl', got 'mpi'",
    )


def test_a_path_that_is_not_a_string_is_refused() -> None:
    assert problems({"kvpolicy_plan_json": 7}) == ("kv_connector_extra_config.kvpolicy_plan_json: error: must be a file path, got 7",)


# --- side-file paths: by their text always, against this host's files for the writer ------------


@pytest.mark.parametrize("key", SIDE_FILES)
def test_a_side_file_path_holding_a_nul_is_refused_at_its_key(key: str) -> None:
    assert problems({key: "run/plan\0.json"}) == (
        f"{EXTRA_CONFIG}.{key}: error: the path contains a NUL character (run/plan\\x00.json); give a file path without one",
    )


@pytest.mark.parametrize("path", ["run/", ".", "..", "run/.."])
def test_a_side_file_path_spelled_as_a_directory_is_refused(path: str) -> None:
    assert problems({"kvpolicy_discover": path}) == (
        f"{EXTRA_CONFIG}.kvpolicy_discover: error: names a directory ({path}); give the path of a file in it",
    )


def test_two_side_files_on_one_path_are_refused_at_the_later_key() -> None:
    assert problems({"kvpolicy_plan_json": "run/status.json", "kvpolicy_dynamo_json": "run/./status.json"}) == (
        f"{EXTRA_CONFIG}.kvpolicy_dynamo_json: error: it would be written to run/status.json, the file of "
        "kvpolicy_plan_json; give each side file its own path",
    )


def test_a_key_contract_beside_the_plan_on_another_side_file_is_refused_at_the_plan_key() -> None:
    assert problems({"kvpolicy_plan_json": "run/plan.json", "kvpolicy_layout_out": "run/plan.keys.json"}) == (
        f"{EXTRA_CONFIG}.kvpolicy_plan_json: error: its key contract would be written to run/plan.keys.json, the file "
        "of kvpolicy_layout_out; give each side file its own path",
    )


def test_side_files_are_judged_against_this_host_only_when_asked() -> None:
    """A configuration built here for another host, or read by a rank that writes no side file."""
    assert KVPolicySettings.parse({"kvpolicy_plan_json": "/nonexistent/run/plan.json"}).kvpolicy_plan_json == Path(
        "/nonexistent/run/plan.json"
    )


def writer_problems(extra_config: dict[str, object]) -> tuple[str, ...]:
    with pytest.raises(SettingsError) as raised:
        KVPolicySettings.parse(extra_config, check_side_files=True)
    return raised.value.problems


@pytest.mark.parametrize("key", SIDE_FILES)
def test_a_side_file_naming_an_existing_directory_is_refused_on_the_writer(key: str, tmp_path: Path) -> None:
    assert writer_problems({key: str(tmp_path)}) == (
        f"{EXTRA_CONFIG}.{key}: error: names a directory ({tmp_path}); give the path of a file in it",
    )


@pytest.mark.parametrize("key", SIDE_FILES)
def test_a_side_file_in_a_missing_directory_is_refused_on_the_writer(key: str, tmp_path: Path) -> None:
    assert writer_problems({key: str(tmp_path / "missing" / "side.json")}) == (
        f"{EXTRA_CONFIG}.{key}: error: the directory {tmp_path / 'missing'} does not exist; "
        "create it, or give a path in an existing directory",
    )


def test_a_side_file_whose_directory_is_a_file_is_refused_on_the_writer(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert writer_problems({"kvpolicy_layout_out": str(tmp_path / "file" / "layout.yaml")}) == (
        f"{EXTRA_CONFIG}.kvpolicy_layout_out: error: {tmp_path / 'file'} is not a directory; give a path in a directory",
    )


def test_a_side_file_below_a_file_is_refused_on_the_writer(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert writer_problems({"kvpolicy_layout_out": str(tmp_path / "file" / "run" / "layout.yaml")}) == (
        f"{EXTRA_CONFIG}.kvpolicy_layout_out: error: the directory {tmp_path / 'file' / 'run'} cannot exist: "
        "a folder on its path is a file; give a path in a directory",
    )


def test_a_side_file_naming_a_device_is_refused_on_the_writer() -> None:
    """Replacing ``/dev/null`` with a regular file (as root) would break every program that writes to it."""
    assert writer_problems({"kvpolicy_discover": "/dev/null"}) == (
        f"{EXTRA_CONFIG}.kvpolicy_discover: error: names a character device (/dev/null), which writing the side "
        "file would replace; give the path of a regular file",
    )


def test_a_side_file_in_a_directory_this_user_cannot_write_is_refused_on_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tests may run as root, whom a chmod does not stop: the OS's answer is given instead.
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path else access(path, mode))
    assert writer_problems({"kvpolicy_dynamo_json": str(tmp_path / "dynamo.json")}) == (
        f"{EXTRA_CONFIG}.kvpolicy_dynamo_json: error: the directory {tmp_path} is not writable by this user "
        f"(uid {os.geteuid()}); make it writable, or give another",
    )


def test_a_key_contract_beside_the_plan_on_a_directory_is_refused_at_the_plan_key(tmp_path: Path) -> None:
    (tmp_path / "plan.keys.json").mkdir()
    assert writer_problems({"kvpolicy_plan_json": str(tmp_path / "plan.json")}) == (
        f"{EXTRA_CONFIG}.kvpolicy_plan_json: error: the key contract is written beside it, to "
        f"{tmp_path / 'plan.keys.json'}, which is a directory; set kvpolicy_keys_json to another path",
    )


def test_side_files_this_user_can_write_pass_on_the_writer(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text("{}")  # an earlier run's file is replaced
    extra = {key: str(tmp_path / f"{key}.out") for key in SIDE_FILES} | {"kvpolicy_plan_json": str(tmp_path / "plan.json")}
    settings = KVPolicySettings.parse(extra, check_side_files=True)
    assert settings.kvpolicy_discover == tmp_path / "kvpolicy_discover.out"


def test_a_misspelled_key_is_refused_with_the_key_it_resembles() -> None:
    assert problems({"kvpolicy_read_failure_ttl": 5}) == (
        "kv_connector_extra_config.kvpolicy_read_failure_ttl: error: unknown key; did you mean 'kvpolicy_read_failure_ttl_s'?",
    )


def test_an_unknown_key_like_none_of_ours_is_refused_with_the_list() -> None:
    (problem,) = problems({"kvpolicy_xyzzy_plugh": 1})
    assert problem.startswith("kv_connector_extra_config.kvpolicy_xyzzy_plugh: error: unknown key; kvpolicy's keys are kvpolicy, ")


def test_every_problem_is_reported_at_once_one_line_each() -> None:
    found = problems({
        "kvpolicy": 3, "kvpolicy_read_failure_ttl_s": -1, "kvpolicy_striped_exchange": "mpi", "kvpolicy_plan_jsn": "p",
    })
    assert [line.split(": error: ")[0] for line in found] == [
        "kv_connector_extra_config.kvpolicy",
        "kv_connector_extra_config.kvpolicy_read_failure_ttl_s",
        "kv_connector_extra_config.kvpolicy_striped_exchange",
        "kv_connector_extra_config.kvpolicy_plan_jsn",
    ]


def test_a_settings_error_is_a_value_error_whose_text_is_its_lines() -> None:
    with pytest.raises(ValueError) as raised:
        KVPolicySettings.parse({"kvpolicy_striped_piece_mib": 0, "kvpolicy_striped_exchange": "mpi"})
    assert str(raised.value).splitlines() == list(raised.value.problems)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"policy": "default", "strikt": True}, "unknown key 'strikt'; did you mean 'strict'?"),
        ({"policy": "default", "strict": "yes"}, "'strict' must be true or false, got 'yes'"),
        ({"strict": True}, "lacks 'policy'; set it to a shipped policy (default, no-dedup, vllm-compat)"),
        (3, "is a int; set it to a shipped policy"),
    ],
)
def test_a_malformed_policy_setting_is_refused_at_the_kvpolicy_key(setting: object, message: str) -> None:
    (problem,) = problems({"kvpolicy": setting})
    assert problem.startswith(f"kv_connector_extra_config.kvpolicy: error: {message}")


# --- the schema ---------------------------------------------------------------------------------


def connector_schema() -> dict[str, object]:
    return json.loads((schemas_dir() / "connector.schema.json").read_text(encoding="utf-8"))


def test_the_schema_accepts_our_keys_beside_vllms() -> None:
    jsonschema.validate({"kvpolicy": {"policy": "default", "strict": True}, "kvpolicy_read_failure_ttl_s": 0,
                         "cache_prefix": "a", "store_tp_size": 2}, connector_schema())


@pytest.mark.parametrize(
    "document",
    [{"kvpolicy_plan_jsn": "p"}, {"kvpolicy_read_failure_ttl_s": -1}, {"kvpolicy_striped_exchange": "mpi"},
     {"kvpolicy": {"policy": "default", "strikt": True}}],
    ids=["misspelled-key", "negative-ttl", "unknown-exchange", "unknown-mapping-key"],
)
def test_the_schema_refuses_what_the_parser_refuses(document: dict[str, object]) -> None:
    problems(document)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, connector_schema())


def test_every_field_has_a_description_in_the_schema() -> None:
    properties = connector_schema()["properties"]
    assert isinstance(properties, dict)
    assert set(properties) == set(KVPolicySettings.model_fields)
    assert all(entry.get("description") for entry in properties.values())


# --- the builder --------------------------------------------------------------------------------


def test_the_builder_writes_the_connector_the_policy_and_recompute_on_load_failures_when_nothing_else_is_set() -> None:
    assert KVPolicySettings(kvpolicy="default").kv_transfer_config() == {
        "kv_connector": "KVPolicyConnector",
        "kv_connector_module_path": "kvpolicy.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvpolicy": "default"},
    }


def test_the_builder_keeps_a_load_failure_policy_given_explicitly() -> None:
    config = KVPolicySettings(kvpolicy="default").kv_transfer_config(kv_load_failure_policy="fail")
    assert config["kv_load_failure_policy"] == "fail"


def test_the_builder_writes_the_strict_override_as_the_mapping_form() -> None:
    config = KVPolicySettings(kvpolicy=PolicySelection(policy="default", strict=True)).kv_transfer_config(role="kv_producer")
    assert config["kv_role"] == "kv_producer"
    assert config["kv_connector_extra_config"] == {"kvpolicy": {"policy": "default", "strict": True}}


def test_the_builder_adds_upstream_keys_and_fields() -> None:
    settings = KVPolicySettings(kvpolicy="default", kvpolicy_plan_json=Path("run/plan.json"), kvpolicy_read_failure_ttl_s=0)
    config = settings.kv_transfer_config(upstream_extra={"cache_prefix": "a"}, kv_load_failure_policy="recompute")
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {
        "kvpolicy": "default", "kvpolicy_plan_json": "run/plan.json", "kvpolicy_read_failure_ttl_s": 0.0, "cache_prefix": "a",
    }


def test_what_the_builder_writes_parses_back_to_the_same_settings() -> None:
    settings = KVPolicySettings(
        kvpolicy=PolicySelection(policy="no-dedup", strict=False), kvpolicy_layout_out=Path("l.yaml"),
        kvpolicy_striped_piece_mib=4, kvpolicy_striped_exchange="nccl",
    )
    extra = settings.kv_transfer_config(upstream_extra={"store_tp_size": 2})["kv_connector_extra_config"]
    assert KVPolicySettings.parse(json.loads(json.dumps(extra))) == settings


def test_the_builder_refuses_kvpolicy_keys_smuggled_in_as_upstream_keys() -> None:
    with pytest.raises(ValueError, match="kvpolicy_plan_json"):
        KVPolicySettings(kvpolicy="default").kv_transfer_config(upstream_extra={"kvpolicy_plan_json": "p"})


def test_vllm_config_prints_what_the_builder_builds() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpolicy.app.cli", "vllm-config", "--policy", "default", "--strict"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    expected = KVPolicySettings(kvpolicy=PolicySelection(policy="default", strict=True)).kv_transfer_config()
    assert json.loads(result.stdout) == expected


def test_the_settings_module_imports_neither_vllm_torch_nor_mooncake() -> None:
    code = ("import sys, kvpolicy.documents.settings; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'mooncake')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert result.stdout.strip() == "[]"
