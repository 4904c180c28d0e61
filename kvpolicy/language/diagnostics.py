"""Located problems in policy and layout files, printed like a compiler's: ``path:line:col: error: ...``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

from kvpolicy.language.keys import UPSTREAM_KEY_TEMPLATE

Severity = Literal["error", "warning"]

MAX_MESSAGE_CHARS = 500
"""A message longer than this (one quoting a huge value) is cut, so output stays bounded."""


@dataclass(frozen=True)
class Example:
    """A command that reports one check: the files it reads, written into an empty directory, and
    the ``kvpolicy`` arguments run there. Shown by ``kvpolicy rule`` and the documentation, and run by
    the tests, so an example that stops producing its code fails them."""

    files: tuple[tuple[str, str], ...]
    """(file name, text) of each file the command reads."""
    argv: tuple[str, ...]
    """The arguments after ``kvpolicy``; file names are relative to the directory the files are in."""


@dataclass(frozen=True)
class Check:
    """One kind of problem ``kvpolicy validate`` reports, under a stable code."""

    code: str
    """``KVP`` and three digits; the first digit is the family (0 file, 1 format, 2 lint, 3 plan, 4 discovery,
    9 output)."""
    name: str
    """Kebab-case name, the SARIF rule's ``name``."""
    severity: Severity
    """An error makes the document unusable; a warning is advice (``--warnings-as-errors`` promotes it)."""
    summary: str
    """What the check finds, in one sentence."""
    explanation: str
    """What it does, in detail, and how to fix it: what ``kvpolicy rule CODE`` and the documentation print."""
    example: Example
    """A command that reports this check."""
    why: str
    """Why it matters: what goes wrong, and where, if the problem is not fixed."""
    fixed: Example
    """The example fixed ("use instead"): the same command on the corrected files (or the corrected command),
    which reports nothing of this check; the tests run both."""


_POLICY_HEAD = "version: 1\nkind: ReplicationPolicy\nname: my-policy\n"
_LAYOUT_HEAD = "version: 1\nkind: ModelLayout\nmodel: my-model\ntotal_num_kv_heads: 8\ngroups:\n"
_ATTENTION_SPEC = "{type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 65536}"


_CONV_SPEC = "{type: ConvStateSpec, bases: [MambaSpec, KVCacheSpec], block_size: 16, page_size_bytes: 4096}"
"""A state class vLLM 0.32 does not ship (a plugin's), for KVP404."""


def _report(*, tp: int = 2, partition: str = "[[0, 1]]",
            evidence: str = "{steps: 2, blocks: 8, zero_blocks: 0, distinct_blocks: 8}",
            spec: str = _ATTENTION_SPEC, layer: str = "layers.0.attn") -> str:
    """A discovery report of one layer (a 1-KV-head attention layer unless told), as the connector writes one."""
    return (
        f"version: 1\nkind: DiscoveryReport\nmodel: my-model\nsource: engine\ntopology: {{tp_size: {tp}}}\nsteps: 2\n"
        f"groups:\n  - index: 0\n    partition: {partition}\n    evidence: {evidence}\n    layers:\n"
        f"      - name: {layer}\n        partition: {partition}\n        evidence: {evidence}\n"
        "layout:\n  version: 1\n  kind: ModelLayout\n  model: my-model\n  total_num_kv_heads: 1\n  groups:\n"
        f"    - spec: {spec}\n      layers: [{layer}]\n"
    )


_GROUP_IN_NAMESPACE = UPSTREAM_KEY_TEMPLATE.replace("{store_namespace}", "@g{group}@plan:{fingerprint}")
"""The upstream key template with the group also in the namespace (KVP205's example), spelled from
:mod:`kvpolicy.language.keys`, the one module that spells key fields."""
_PLAN_IN_NAMESPACE = UPSTREAM_KEY_TEMPLATE.replace("{store_namespace}", "{store_namespace}@plan:{fingerprint}")
"""KVP205's example fixed: the plan in the namespace, the group where routers read it (``default``'s template)."""


def _validate(text: str, name: str = "policy.yaml") -> Example:
    return Example(files=((name, text),), argv=("validate", name))


CHECKS: tuple[Check, ...] = (
    Check(
        "KVP001", "unreadable-file", "error",
        "The path is not a regular file that can be read, within the size limit, as UTF-8 text.",
        "kvpolicy opens only regular files (a directory, FIFO, socket or device is refused before it is read, so "
        "nothing blocks or streams), of at most 1 MiB, decoded as UTF-8. A policy named on the command line that is "
        "neither a file nor a shipped policy's name is reported here too, with the closest shipped name. Fix the "
        "path, or save the file as UTF-8.",
        Example(files=(("policy.yaml", _POLICY_HEAD + "rules: []\n"),), argv=("validate", "polcy.yaml")),
        why=(
            "A policy that cannot be read cannot be judged, and the connector refuses to start with one: a misspelled "
            "path in a deployment would stop the engine at start-up. Refusing special files before reading them keeps "
            "`validate` from hanging on a FIFO or streaming a device."
        ),
        fixed=Example(files=(("policy.yaml", _POLICY_HEAD + "rules: []\n"),), argv=("validate", "policy.yaml")),
    ),
    Check(
        "KVP002", "yaml-syntax", "error",
        "The text is not exactly one well-formed YAML document of plain values (control characters, bad "
        "indentation, '---', a tag such as !!binary or !custom).",
        "A policy or layout is one YAML document of strings, numbers, booleans, nulls, lists and mappings. A tag "
        "that names a core type is honoured (`!!str 1` is the string \"1\"); any other tag (`!!binary`, `!!set`, "
        "`!!python/...`, a local `!tag`) is refused where it stands, as are merge keys (`<<`), a second document "
        "after `---` and an empty file. Write the value out plainly.",
        _validate(_POLICY_HEAD + "description: !!binary aGVsbG8=\nrules: []\n"),
        why=(
            "A tag is an instruction to the YAML loader: `!!python/...` runs code in loaders that honour it, and "
            "`!!binary` or a custom tag turns a value into something other than what the file shows. A policy is read "
            "by CI, the connector and routers alike, so it must mean the same plain values to every reader."
        ),
        fixed=_validate(_POLICY_HEAD + "description: hello\nrules: []\n"),
    ),
    Check(
        "KVP003", "too-large", "error",
        "The document exceeds a bound: nodes, characters once aliases are expanded, layer names, an expression's "
        "size or a value's magnitude.",
        "Inputs are bounded so that any file is judged in bounded time and memory: at most 1 MiB and 100,000 YAML "
        "nodes, at most 1 MiB of keys and values once aliases are expanded, layer names of at most 1,000 characters "
        "each and 32 MiB in all, expressions of at most 1,000 characters and 32 levels of nesting, integers of at "
        "most 2**63 - 1. Split the document or write smaller values.",
        _validate(_POLICY_HEAD + "rules: []\naudit: {mode: warn, steps: 99999999999999999999}\n"),
        why=(
            "Policies and layouts come from anyone who can open a pull request or write a config map. Without bounds "
            "one small file (an alias bomb, a huge range, a deep expression) could take `validate`, the connector or "
            "CI minutes and gigabytes; with them, any file is judged in about a second."
        ),
        fixed=_validate(_POLICY_HEAD + "rules: []\naudit: {mode: warn, steps: 4}\n"),
    ),
    Check(
        "KVP004", "duplicate-key", "error", "A mapping repeats a key (YAML loaders silently keep one).",
        "Most YAML loaders keep the last of two equal keys without a word, so the file would not mean what one of "
        "its lines says. The message names the line of the first one; remove one of them.",
        _validate(_POLICY_HEAD + "rules: []\nname: other-name\n"),
        why=(
            "Two values for one key make the file say two things, and which one a reader keeps depends on the reader: "
            "the policy reviewed in a pull request would not be the one the connector runs."
        ),
        fixed=_validate(_POLICY_HEAD + "rules: []\n"),
    ),
    Check(
        "KVP101", "document-kind", "error",
        "The top level is not a mapping, or 'kind' is missing, unknown or not what the command expects.",
        "Every document says what it is: `kind: ReplicationPolicy` for a policy, `kind: ModelLayout` for a layout, "
        "beside `version: 1`. The rest is checked as the kind its content suggests, so one run reports every "
        "problem. `kvpolicy plan --policy` refuses a layout and `--layout` a policy.",
        _validate("version: 1\nname: my-policy\nrules: []\n"),
        why=(
            "The kind decides which fields apply and what the file does. A layout given where a policy is expected "
            "(or the reverse) would otherwise be judged by the wrong format and fail with a flood of unrelated "
            "errors."
        ),
        fixed=_validate("version: 1\nkind: ReplicationPolicy\nname: my-policy\nrules: []\n"),
    ),
    Check(
        "KVP102", "unknown-field", "error", "A field the format does not have, typos included.",
        "Every mapping of a policy or layout has a fixed set of fields (the format references list them); an "
        "unknown one is a typo more often than not, and ignoring it would silently drop what it meant. The message "
        "suggests the closest field, or lists the allowed ones.",
        _validate(
            _POLICY_HEAD + "rules:\n  - name: state\n    reason: Recurrent state is split over the ranks.\n"
            "    match: {spec: MambaSpec}\n    replicaton: sharded\n"
        ),
        why=(
            "An ignored field is a silent change of meaning: `replicaton: sharded` dropped would leave the rule "
            "without a replication, and a misspelled `when` would make a conditional rule apply everywhere."
        ),
        fixed=_validate(
            _POLICY_HEAD + "rules:\n  - name: state\n    reason: Recurrent state is split over the ranks.\n"
            "    match: {spec: MambaSpec}\n    replication: sharded\n"
        ),
    ),
    Check(
        "KVP103", "missing-field", "error", "A required field is absent.",
        "Some fields have no default: a document's `version`, `kind` and `name` (a layout's `model`, "
        "`total_num_kv_heads` and `groups`), a rule's `name` and `reason`. A rule must say why it holds, so that "
        "the plan and the audit's messages can quote it. Add the field.",
        _validate(_POLICY_HEAD + "rules:\n  - name: state\n    match: {spec: MambaSpec}\n    replication: sharded\n"),
        why=(
            "Without the field the document is incomplete. A rule without its `reason` is the rule nobody can review: "
            "the plan, `explain` and the audit's demotion messages quote it to say why bytes are, or are not, shared "
            "between ranks."
        ),
        fixed=_validate(
            _POLICY_HEAD + "rules:\n  - name: state\n    reason: Recurrent state is split over the ranks.\n"
            "    match: {spec: MambaSpec}\n    replication: sharded\n"
        ),
    ),
    Check(
        "KVP104", "invalid-value", "error",
        "A value of the wrong type, outside its range or pattern, or inconsistent with another field.",
        "Types are what they are written as (`1` is an integer, `\"1\"` a string, `1.0` a float, which no integer "
        "field accepts), ranges and patterns are the format's (see the references), and some fields exclude each "
        "other (a rule has exactly one of `replication`, `factor` and `shards`). The message says what is expected.",
        _validate(_POLICY_HEAD + "rules: []\naudit: {mode: warn, steps: -1}\n"),
        why=(
            "A value outside its range would reach the connector as a number it cannot use (a negative step count, a "
            "factor of zero). Refusing it at `validate` moves the failure from an engine's start-up to the pull "
            "request."
        ),
        fixed=_validate(_POLICY_HEAD + "rules: []\naudit: {mode: warn, steps: 4}\n"),
    ),
    Check(
        "KVP105", "invalid-expression", "error",
        "An expression that does not parse, uses syntax outside the sandbox, or reads an unknown variable.",
        "`when`, `factor`, `shards`, a layout's `block_size`, `page_size_bytes` and `{expr: ...}` fields are "
        "expressions: integers, strings, booleans, None, arithmetic, comparisons, `and`/`or`/`not`, `a if c else "
        "b`, `min`, `max`, `cdiv` and the topology and spec variables. They are parsed with `ast` and walked by a "
        "whitelist evaluator, never `eval`; anything else is refused at its column, an unknown variable with the "
        "closest known one.",
        _validate(
            _POLICY_HEAD + "rules:\n  - name: kv-heads\n    reason: Ranks past the KV-head count repeat heads.\n"
            "    match: {spec: AttentionSpec}\n    factor: max(1, tp_size // total_num_kv_head)\n"
        ),
        why=(
            "Expressions decide the replication factor, so an expression that fails at run time would fail the plan "
            "on the serving host. The sandbox also means a policy can never run code: only arithmetic over the listed "
            "variables."
        ),
        fixed=_validate(
            _POLICY_HEAD + "rules:\n  - name: kv-heads\n    reason: Ranks past the KV-head count repeat heads.\n"
            "    match: {spec: AttentionSpec}\n    factor: max(1, tp_size // total_num_kv_heads)\n"
        ),
    ),
    Check(
        "KVP106", "duplicate-layer", "error", "A layer listed in more than one group.",
        "vLLM puts each layer in one KV-cache group; a layout listing a layer twice (often through overlapping "
        "`{a..b}` ranges) describes no model vLLM builds. The same holds for `layer_kv_heads`. Remove the layer "
        "from one group.",
        _validate(
            _LAYOUT_HEAD + f"  - spec: {_ATTENTION_SPEC}\n    layers: \"model.layers.{{0..3}}.self_attn.attn\"\n"
            f"  - spec: {_ATTENTION_SPEC}\n    layers: \"model.layers.3.self_attn.attn\"\n",
            "layout.yaml",
        ),
        why=(
            "A layout is the model as vLLM builds it; one that lists a layer twice describes another model, and its "
            "plan (which group a layer's bytes go to, how many objects a prompt writes) would not be the engine's."
        ),
        fixed=_validate(
            _LAYOUT_HEAD + f"  - spec: {_ATTENTION_SPEC}\n    layers: \"model.layers.{{0..2}}.self_attn.attn\"\n"
            f"  - spec: {_ATTENTION_SPEC}\n    layers: \"model.layers.3.self_attn.attn\"\n",
            "layout.yaml",
        ),
    ),
    Check(
        "KVP201", "unknown-spec-class", "warning", "A rule matches a spec class vLLM 0.32 does not define.",
        "`match.spec` names vLLM's KV-cache spec classes (or their base classes). A name vLLM 0.32 does not define "
        "is a typo, or a class of a plugin or a later vLLM: the rule then matches nothing on this vLLM. Fix the "
        "name, or `--ignore KVP201` for a plugin's class.",
        _validate(
            _POLICY_HEAD + "rules:\n  - name: state\n    reason: Recurrent state is split over the ranks.\n"
            "    match: {spec: MambaSpc}\n    replication: sharded\n"
        ),
        why=(
            "A rule that matches nothing leaves the layers it was written for to a later rule or to `unmatched`. For "
            "a state class that is the difference between writing it once and writing it on every rank, or, for a "
            "rule meant to shard, between sharding and a broader rule replicating it."
        ),
        fixed=_validate(
            _POLICY_HEAD + "rules:\n  - name: state\n    reason: Recurrent state is split over the ranks.\n"
            "    match: {spec: MambaSpec}\n    replication: sharded\n"
        ),
    ),
    Check(
        "KVP202", "unknown-spec-field", "warning", "A rule matches a field no known spec class has.",
        "`match.fields` compares a spec's fields; a field no vLLM 0.32 spec class has never matches, so the rule is "
        "dead. Fix the name, or declare a plugin's field in the policy's `spec_fields:`.",
        _validate(
            _POLICY_HEAD + "rules:\n  - name: replicated-state\n    reason: vLLM marks this state identical on every rank.\n"
            "    match: {spec: MambaSpec, fields: {tp_replicatd: true}}\n    replication: replicated\n"
        ),
        why=(
            "A field condition that can never hold makes its rule dead: here the replicated Mamba state would fall "
            "through to the next rule and be written on every rank, and a rule meant to exclude some specs would "
            "exclude none."
        ),
        fixed=_validate(
            _POLICY_HEAD + "rules:\n  - name: replicated-state\n    reason: vLLM marks this state identical on every rank.\n"
            "    match: {spec: MambaSpec, fields: {tp_replicated: true}}\n    replication: replicated\n"
        ),
    ),
    Check(
        "KVP203", "unreachable-rule", "warning", "An earlier rule matches everything this rule matches.",
        "Rules are tried in order and the first match wins, so a rule after a broader one never applies: here "
        "every `MLAAttentionSpec` is an `AttentionSpec`. Move the narrower rule up, or remove it.",
        _validate(
            _POLICY_HEAD + "rules:\n  - name: attention\n    reason: Heads are split over the ranks.\n"
            "    match: {spec: AttentionSpec}\n    replication: sharded\n"
            "  - name: mla-latent\n    reason: The MLA latent cache has no head dimension.\n"
            "    match: {spec: MLAAttentionSpec}\n    replication: replicated\n"
        ),
        why=(
            "The author meant the second rule to decide some layers; it never does. Here the MLA latent cache, "
            "identical on every rank, would be sharded by the broader attention rule: written `tp_size` times, and "
            "never the dedup the policy was written for."
        ),
        fixed=_validate(
            _POLICY_HEAD + "rules:\n  - name: mla-latent\n    reason: The MLA latent cache has no head dimension.\n"
            "    match: {spec: MLAAttentionSpec}\n    replication: replicated\n"
            "  - name: attention\n    reason: Heads are split over the ranks.\n"
            "    match: {spec: AttentionSpec}\n    replication: sharded\n"
        ),
    ),
    Check(
        "KVP204", "unexpected-bases", "warning", "A spec's base classes differ from vLLM 0.32's for that class.",
        "Rules match a spec by its class or any of its base classes, so a layout whose bases differ from vLLM's "
        "would match rules vLLM's real spec does not, or miss rules it does. The message gives vLLM 0.32's bases; "
        "write those (a layout the connector captured has them right).",
        _validate(
            _LAYOUT_HEAD + "  - spec: {type: FullAttentionSpec, bases: [KVCacheSpec], block_size: 16, "
            "page_size_bytes: 65536}\n    layers: \"model.layers.{0..3}.self_attn.attn\"\n",
            "layout.yaml",
        ),
        why=(
            "Plans are made from the layout, and rules match by class and bases. A layout whose bases are not vLLM's "
            "plans a model the engine does not run: the connector would then decide differently from `kvpolicy plan`."
        ),
        fixed=_validate(
            _LAYOUT_HEAD + "  - spec: {type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, "
            "page_size_bytes: 65536}\n    layers: \"model.layers.{0..3}.self_attn.attn\"\n",
            "layout.yaml",
        ),
    ),
    Check(
        "KVP205", "router-unreadable-keys", "warning",
        "Routers reading vLLM store keys (Mooncake Conductor's grammar) would not read the key template's keys as the "
        "key contract states them.",
        "Routers find where a prefix lives by parsing store keys. The check runs the template's keys through a port "
        "of Mooncake Conductor's parser and warns, at the field at fault, of keys it refuses, a field it reads in "
        "another's place, a rank or group field in the namespace (everything before the TP rank field), a "
        "namespace without the model, and, under an audit, a template without `{fingerprint}` (a demoted group's "
        "keys would end in a demotion suffix, which Conductor refuses). The shipped templates pass.",
        _validate(
            _POLICY_HEAD + f"key:\n  template: \"{_GROUP_IN_NAMESPACE}\"\nrules: []\n"
        ),
        why=(
            "Routers (Mooncake Conductor, Dynamo) decide where to send a request by reading store keys. Keys they "
            "cannot read, or read wrongly, mean requests are routed away from the instance holding the prefix: no "
            "error, just hits lost."
        ),
        fixed=_validate(_POLICY_HEAD + f"key:\n  template: \"{_PLAN_IN_NAMESPACE}\"\nrules: []\n"),
    ),
    Check(
        "KVP206", "keyed-keys", "warning",
        "The policy requires keyed namespaces, whose keys no router can read.",
        "With `key.keyed: required` every deployment of the policy names a secret, and each chunk key ends in an "
        "HMAC under it instead of vLLM's block hash. Nobody without the secret can compute, probe or pre-write a "
        "key; routers that read store keys (Mooncake Conductor, Dynamo) cannot either, so `kvpolicy keys --format "
        "dynamo` refuses and Conductor's view of the keys is meaningless. Keep it where the store must resist "
        "poisoning more than it must be routed; otherwise keep keys plain and verify objects instead.",
        _validate(_POLICY_HEAD + "key:\n  keyed: required\nrules: []\n"),
        why=(
            "A router that cannot read keys routes blindly: no error, just hits lost. Whether that is the right "
            "price for a store nobody can poison is a deployment's decision, so the policy says it out loud."
        ),
        fixed=_validate(_POLICY_HEAD + "key:\n  keyed: \"off\"\n  verified: required\nrules: []\n"),
    ),
    Check(
        "KVP301", "plan-refused", "error",
        "The engine cannot prove a plan consistent for this layout and topology (or vLLM refuses the topology).",
        "`plan`, `explain`, `keys` and the connector refuse a plan they cannot prove safe: a `strict: true` policy "
        "meeting a spec no rule matches, a factor that does not divide the ranks, an expression that fails at this "
        "topology, sizes vLLM would refuse together. Every reason is listed, each naming its group, layers and "
        "rule, located at the policy's or layout's line where one is at fault.",
        Example(
            files=((
                "policy.yaml",
                "version: 1\nkind: ReplicationPolicy\nname: mla-only\nstrict: true\nrules:\n  - name: mla-latent\n"
                "    reason: The MLA latent cache has no head dimension.\n    match: {spec: MLAAttentionSpec}\n"
                "    replication: replicated\n",
            ),),
            argv=("plan", "--policy", "policy.yaml", "--layout", "llama-3.1-70b", "--tp", "2"),
        ),
        why=(
            "A plan the engine cannot prove consistent could store one rank's bytes under a key another rank reads: a "
            "warm hit would load another rank's state. The connector refuses such a plan at start-up, so refusing it "
            "in CI first keeps a deployment from failing on its hosts."
        ),
        fixed=Example(
            files=((
                "policy.yaml",
                (
                    "version: 1\nkind: ReplicationPolicy\nname: mla-only\nrules:\n  - name: mla-latent\n"
                    "    reason: The MLA latent cache has no head dimension.\n    match: {spec: MLAAttentionSpec}\n"
                    "    replication: replicated\n"
                ),
            ),),
            argv=("plan", "--policy", "policy.yaml", "--layout", "llama-3.1-70b", "--tp", "2"),
        ),
    ),
    Check(
        "KVP401", "thin-evidence", "error",
        "A discovery report's layer rests on too few compared blocks to conclude a rule from.",
        "`kvpolicy discover --propose` concludes a rule only from layers whose ranks compared at least 4 blocks of "
        "2 distinct contents, every rank holding non-zero bytes: an unwritten (all-zero) cache is identical on every "
        "rank, and one repeated content says little about the next. Observe more steps (`kvpolicy_discover_steps`) "
        "with prompts of several blocks, or offline `kvpolicy discover --steps`. Nothing is proposed while any "
        "layer is refused.",
        Example(files=(("report.yaml", _report(evidence="{steps: 1, blocks: 2, zero_blocks: 6, distinct_blocks: 1}")),),
                argv=("discover", "--propose", "report.yaml")),
        why=(
            "A rule that replicates what ranks only seemed to share makes every warm hit load another rank's state. "
            "All-zero blocks and a single repeated content look identical on every rank whatever the model holds, so "
            "they cannot show that a state is replicated."
        ),
        fixed=Example(files=(("report.yaml", _report()),), argv=("discover", "--propose", "report.yaml")),
    ),
    Check(
        "KVP402", "inexpressible-partition", "error",
        "A discovery report's layer held equal bytes in classes of ranks no replication factor gives.",
        "A plan repeats a layer's bytes over runs of consecutive TP ranks of one size (under decode-context "
        "parallelism, those of equal dcp rank among them). Ranks 0 and 2 equal while 1 and 3 are equal too, or "
        "classes of different sizes, are no such runs, so no rule can express them and none is proposed. Such an "
        "observation usually means the layer's bytes are not what the model computes (padding, a cache written "
        "elsewhere); look at the layer before writing a rule for it by hand.",
        Example(files=(("report.yaml", _report(tp=4, partition="[[0, 2], [1, 3]]")),),
                argv=("discover", "--propose", "report.yaml")),
        why=(
            "A rule can only say \"this many consecutive ranks hold the same bytes\". Writing one for a partition no "
            "factor gives would either share bytes between ranks that differ (a warm hit loading another rank's "
            "state) or hide what the observation says about the layer."
        ),
        fixed=Example(files=(("report.yaml", _report(tp=4, partition="[[0, 1], [2, 3]]")),),
                argv=("discover", "--propose", "report.yaml")),
    ),
    Check(
        "KVP403", "contradicting-observations", "error",
        "Two discovery reports saw one layer of one model at one TP size with different partitions.",
        "Observations of the same layer at the same TP size must agree; when they do not (two models whose layers "
        "share names but not their heads, a report of another model version), `kvpolicy discover --propose` does "
        "not pick one. Propose from the reports of one model version at a time, and write one policy per model "
        "where their layers disagree.",
        Example(files=(("a.yaml", _report()), ("b.yaml", _report(partition="[[0], [1]]"))),
                argv=("discover", "--propose", "a.yaml", "b.yaml")),
        why=(
            "Picking one of two contradicting observations would pick the replication of one model for another: the "
            "one with more heads would then share bytes its ranks do not hold alike."
        ),
        fixed=Example(files=(("a.yaml", _report()), ("b.yaml", _report())),
                argv=("discover", "--propose", "a.yaml", "b.yaml")),
    ),
    Check(
        "KVP404", "unsimulated-spec-class", "error",
        "`kvpolicy discover --layout` names a spec class the offline simulation holds no bytes for (a plugin's "
        "class, or one vLLM 0.32 does not ship).",
        "The simulation builds every layer from vLLM's own spec classes (`vllm.v1.kv_cache_interface`) and holds, "
        "per rank, the bytes `kvpolicy.sim.archetypes.physical_factor` states for them. For any other class it would "
        "have to guess what each rank holds, and a guess is what discovery must not report, so the layout is refused "
        "at that class's line before anything is started. Observe such a class on an engine: serve the model with "
        "the connector's `kvpolicy_discover` setting (rank 0 writes the report), then `kvpolicy discover --propose` "
        "the reports.",
        Example(files=(("layout.yaml", _LAYOUT_HEAD + "  - spec: {type: ConvStateSpec, bases: [MambaSpec, KVCacheSpec], "
                        "block_size: 16, page_size_bytes: 4096}\n    layers: [layers.0.conv]\n"),),
                argv=("discover", "--layout", "layout.yaml", "--tp", "2")),
        why=(
            "Discovery exists to replace guesses with evidence. A simulation guessing what a new class holds would "
            "report its guess as an observation, and `--propose` would turn it into a rule deciding what real ranks "
            "share."
        ),
        fixed=Example(files=(("report.yaml", _report(spec=_CONV_SPEC, layer="layers.0.conv")),),
                argv=("discover", "--propose", "report.yaml")),
    ),
    Check(
        "KVP901", "too-many-problems", "error", "More problems than are listed for one file; fix these first.",
        "At most 100 problems are listed per file, and only those are described, so a file of 90,000 errors is "
        "still judged in about 1.5 s; the last line counts the rest. It is an error when the document is invalid "
        "and a warning when only warnings were cut. Fix the problems listed and run again.",
        _validate(
            _POLICY_HEAD + "rules:\n  - {name: r, reason: x, replication: sharded,\n"
            + "".join("     " + ", ".join(f"k{row * 20 + column}: 0" for column in range(20)) + ",\n" for row in range(5))
            + "     k100: 0}\n"
        ),
        why=(
            "A generated or badly broken file can hold tens of thousands of problems; printing them all would bury "
            "the first ones, which usually cause the rest, and take unbounded time. The listed problems are the ones "
            "to fix first."
        ),
        fixed=_validate(_POLICY_HEAD + "rules:\n  - {name: r, reason: x, replication: sharded}\n"),
    ),
)
"""Every check, by code: the documentation's diagnostics reference, ``kvpolicy rule`` and the SARIF ``rules``."""

CHECKS_BY_CODE: dict[str, Check] = {check.code: check for check in CHECKS}
CHECKS_BY_NAME: dict[str, Check] = {check.name: check for check in CHECKS}


def _printable(character: str) -> str:
    """``character``, or its escape where it is not printable (a control character, a line or
    record separator, a lone surrogate that a file name undecodable as UTF-8 leaves)."""
    if character.isprintable():
        return character
    if "\ud800" <= character <= "\udfff":
        return f"\\u{ord(character):04x}"  # unicode_escape cannot encode a lone surrogate
    return character.encode("unicode_escape").decode()


def printable_path(path: str) -> str:
    """``path`` as a diagnostic line shows it: one line, printable on any output encoding (a newline
    in a file name is ``\\n``, a byte not decodable as UTF-8 ``\\udcXX``), unchanged when it is plain."""
    if path.isprintable():
        return path
    return "".join(_printable(character) for character in path)


@dataclass(frozen=True, order=True)
class Diagnostic:
    """One problem at one place in one file."""

    path: str
    line: int
    """1-based line."""
    column: int
    """1-based column."""
    severity: Severity
    message: str
    """What is wrong and, where there is one, the fix; at most :data:`MAX_MESSAGE_CHARS` characters,
    on one line."""
    code: str
    """The :class:`Check` this is, e.g. ``KVP102``."""

    def __post_init__(self) -> None:
        if self.code not in CHECKS_BY_CODE:
            raise ValueError(f"unknown diagnostic code {self.code!r}")
        # Cut before escaping, so a message quoting a megabyte costs no more than a short one.
        cut = max(0, len(self.message) - MAX_MESSAGE_CHARS)
        # One line whatever the input quoted: a newline becomes a space, any other character that is
        # not printable (a record separator splits lines too) its escape.
        message = "".join(
            " " if character in "\r\n" else _printable(character) for character in self.message[:MAX_MESSAGE_CHARS]
        )
        if len(message) > MAX_MESSAGE_CHARS:  # escapes made it longer
            cut += len(message) - MAX_MESSAGE_CHARS
            message = message[:MAX_MESSAGE_CHARS]
        if cut:
            message = f"{message}... ({cut} more characters)"
        object.__setattr__(self, "message", message)

    def __str__(self) -> str:
        return f"{printable_path(self.path)}:{self.line}:{self.column}: {self.severity}: {self.message} [{self.code}]"

    @property
    def check(self) -> Check:
        return CHECKS_BY_CODE[self.code]

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class DocumentError(ValueError):
    """A document that cannot be used; carries every problem found, not just the first."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics = tuple(sorted(diagnostics))
        super().__init__("\n".join(str(diagnostic) for diagnostic in self.diagnostics))

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "error")


@dataclass(frozen=True)
class PlanProblem:
    """One reason the engine refuses a plan."""

    message: str
    """What is refused and why, naming the group, layer and rule."""
    location: str | None = None
    """``path:line:col`` of the expression or rule at fault, when the policy was loaded from a file."""

    def __str__(self) -> str:
        return f"{printable_path(self.location)}: error: {self.message}" if self.location else self.message


class PlanError(ValueError):
    """The engine refuses a plan it cannot prove consistent: every reason found (each failing group
    and layer, alike layers once), each naming its group and rule and, where it has one, located."""

    def __init__(self, problems: str | Iterable[PlanProblem], location: str | None = None) -> None:
        found = (PlanProblem(problems, location),) if isinstance(problems, str) else tuple(problems)
        self.problems: tuple[PlanProblem, ...] = tuple(dict.fromkeys(found))
        super().__init__("\n".join(str(problem) for problem in self.problems))
