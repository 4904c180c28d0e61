"""The core's third layer: a plan checked against what is observed. The replication audit's digests and
verdicts (:mod:`~kvpolicy.evidence.audit`), discovery's partitions and its report
(:mod:`~kvpolicy.evidence.discovery`), and the routers that read the store's keys, checked against
their own code (:mod:`~kvpolicy.evidence.routers`). Imports only the planning and the language below
it; the run-time halves live in :mod:`kvpolicy.runtime`, the device's in :mod:`kvpolicy.device`."""
