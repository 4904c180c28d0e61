"""A fleet across hosts: network namespaces as hosts, with a Mooncake master, segment holders and vLLM
servers placed on them, for tests and benchmarks that cross a real network stack."""
