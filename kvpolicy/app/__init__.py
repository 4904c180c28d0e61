"""The application layer: the ``kvpolicy`` command line and its demo. It composes the core, the vLLM
and Mooncake adapters and the simulation; nothing below it imports it."""
