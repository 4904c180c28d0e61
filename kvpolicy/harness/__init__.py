"""Tooling beside the simulation, not the product: runners that start real vLLM engines
(:mod:`~kvpolicy.harness.e2e`) and OpenAI servers (:mod:`~kvpolicy.harness.server`) as child
processes, tiny random models made locally (:mod:`~kvpolicy.harness.tinymodel`), and a fleet of test
hosts on network namespaces (:mod:`~kvpolicy.harness.fleet`). The demo, the benchmarks and the tests
use them; the product (core, runtime, adapters, simulation) never imports them."""
