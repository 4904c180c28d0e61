"""Examples of every ``kvpolicy`` command, for the command-line reference (:mod:`kvpolicy.app.reference`).

Each command has one to three. Those that need only kvpolicy's core run in-process from the checkout's root
while the site is built, and the page shows what they printed; those that need vLLM, Mooncake or an engine
(``audit``, ``demo``, ``doctor``, ``discover`` observing) are shown as commands. The documentation's tests run
the first kind, hold each to its exit code, and parse every one with the real parser.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommandExample:
    """One example of a command."""

    what: str
    """What it shows, as a sentence ending in a colon."""
    command: str
    """The command line, starting with ``kvpolicy``; paths are relative to the checkout's root."""
    exit_code: int | None = 0
    """What it exits with; ``None``: not run while the site is built (it needs vLLM, Mooncake or an engine)."""


EXAMPLE_REPORT = "examples/discovery/my-model-tp2.yaml"
"""A discovery report as an engine writes one (the discovery format reference shows it whole)."""

COMMAND_EXAMPLES: dict[str, tuple[CommandExample, ...]] = {
    "validate": (
        CommandExample("Check a policy and a layout:", "kvpolicy validate policies/default.yaml examples/layouts/deepseek-v3.yaml"),
        CommandExample(
            "A CI gate: every shipped policy, warnings counted as errors:",
            "kvpolicy validate --warnings-as-errors policies/default.yaml policies/no-dedup.yaml policies/vllm-compat.yaml",
        ),
    ),
    "rule": (
        CommandExample("Every code, one line each:", "kvpolicy rule --all"),
        CommandExample("One code's page, by its code or its name:", "kvpolicy rule unreachable-rule"),
    ),
    "schema": (
        CommandExample("Check that `schemas/` is what the code generates (no output, exit 0):", "kvpolicy schema --check"),
    ),
    "plan": (
        CommandExample("DeepSeek-V3's MLA latent at TP 8: written once instead of eight times:",
                       "kvpolicy plan --policy default --layout deepseek-v3 --tp 8"),
        CommandExample("A hybrid at TP 4, with the store objects a 4,096-token prompt writes and reads:",
                       "kvpolicy plan --policy default --layout qwen3-next-80b-a3b --tp 4 --prompt-tokens 4096"),
    ),
    "explain": (
        CommandExample("Why each layer of a hybrid got its rule:",
                       "kvpolicy explain --policy default --layout qwen3-next-80b-a3b --tp 4"),
    ),
    "keys": (
        CommandExample("The keys each rank of a dense model writes at TP 2:",
                       "kvpolicy keys --policy default --layout llama-3.1-70b --tp 2"),
        CommandExample("The key contract as JSON, for a router:",
                       "kvpolicy keys --policy vllm-compat --layout llama-3.1-70b --tp 2 --format json"),
    ),
    "diff": (
        CommandExample("Moving DeepSeek-V3 at TP 8 from vLLM's rules to `default` (exit 1: it changes):",
                       "kvpolicy diff vllm-compat default --layout deepseek-v3 --tp 8", exit_code=1),
    ),
    "vllm-config": (
        CommandExample("The line to pass to `vllm serve --kv-transfer-config`:", "kvpolicy vllm-config --policy default"),
        CommandExample("For a prefill instance that only stores:",
                       "kvpolicy vllm-config --policy default --role kv_producer"),
    ),
    "doctor": (
        CommandExample("On a serving host, before starting vLLM:", "kvpolicy doctor --policy default", exit_code=None),
        CommandExample("As JSON, for a deployment's readiness check:", "kvpolicy doctor --format json", exit_code=None),
    ),
    "list": (CommandExample("The shipped policies:", "kvpolicy list"),),
    "audit": (
        CommandExample("A correct policy on a hybrid layout passes:",
                       "kvpolicy audit --policy default --layout qwen3-next-80b-a3b --tp 4", exit_code=None),
        CommandExample("A policy that replicates sharded recurrent state is caught (exit 1):",
                       "kvpolicy audit --policy examples/policies/wrong-recurrent-replicated.yaml --archetype gqa-gdn --tp 2",
                       exit_code=None),
    ),
    "discover": (
        CommandExample("Observe a layout on simulated ranks at two TP sizes (needs vLLM and Mooncake):",
                       "kvpolicy discover --layout qwen3-next-80b-a3b --tp 2 --tp 4 --out discovery", exit_code=None),
        CommandExample("Check a policy against a report an engine wrote (exit 1: `default` writes a state ranks hold "
                       "alike more than once):", f"kvpolicy discover --check default {EXAMPLE_REPORT}", exit_code=1),
        CommandExample("Propose the rules the report supports:",
                       f"kvpolicy discover --propose {EXAMPLE_REPORT} --name my-model"),
    ),
    "demo": (
        CommandExample("The whole demo (about 2 minutes; `bash scripts/run.sh demo` installs what it needs first):",
                       "kvpolicy demo", exit_code=None),
        CommandExample("Without the vLLM engine run, at TP 2:", "kvpolicy demo --no-engine --tp 2", exit_code=None),
    ),
}
"""Per command, its examples, in the order the reference shows them."""
