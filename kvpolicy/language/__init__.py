"""The core's lowest layer: the policy language. What a policy, a layout and a topology say, as deeply
immutable models (:mod:`~kvpolicy.language.models`), and how they are spelled: expressions, rule
matching, the store key grammar, vLLM's spec classes for authoring help, the diagnostics' codes, and
YAML in (with positions) and out. Imports nothing of kvpolicy above it, nor vLLM, torch or Mooncake."""
